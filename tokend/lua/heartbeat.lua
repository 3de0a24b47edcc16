-- HEARTBEAT for a batch of sessions (spec 0x03): record it, recover a WARN session,
-- renew a token inside its window.
-- KEYS and ARGV: grouped by shard (see for_each_session in the prelude); the fixed
-- arguments are warn_after (ms), renew_window (ms), token_ttl (s), grace (ms) and
-- expire_after (ms); each session's are (tid, conn, replayed, restore): replayed = '1'
-- for a heartbeat the node received in time but could only store now (after an outage);
-- it is not judged late. restore = '' or, when the node asks again for a session the
-- store answered gone or taken, what its live connection knows:
-- 'prio|iat_s|exp_ms|since_ms|sub'.
-- Returns, per session in order: exp_ms alone when the heartbeat was stored and the
-- session neither left WARN nor was renewed (the common case, cheapest to send and to
-- parse); else {'ok', was_warn, renewed, exp_ms, iat_s}, {'gone', tombstone or ''} or
-- {'taken'} (another connection holds the session).
local warn_ms, renew_ms = tonumber(ARGV[5]), tonumber(ARGV[6])
local ttl_s, grace_ms, expire_ms = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local now = now_ms()

local function read(skey)
  return redis.call('HMGET', skey, 'sub', 'st', 'exp', 'iat', 'conn', 'hb', 'since')
end

-- Redis lost this connection's session, or its hold on it, in a failover (writes the old
-- master acknowledged and never replicated). Re-assert what the node knows, unless the
-- session ended (tombstone), its token expired, or another connection took it later.
-- Returns whether it did.
local function restore(skey, tkey, tid, conn, s, known)
  local prio, iat, exp, since, sub = known:match('^(%d+)|(%d+)|(%d+)|(%d+)|(.*)$')
  exp, since = tonumber(exp), tonumber(since)
  if s[1] then
    if s[1] ~= sub or tonumber(s[7] or 0) >= since then
      return false
    end
    -- Our connection took the session after the one Redis names: Redis lost that resume.
    control('close', tid, s[5], 4507)
    redis.call('HSET', skey, 'conn', conn, 'since', since, 'hb', now)
    if exp > tonumber(s[3]) then
      redis.call('HSET', skey, 'exp', exp, 'iat', iat)
      redis.call('PEXPIREAT', skey, exp + grace_ms)
    end
  else
    if exp <= now or redis.call('EXISTS', tkey) == 1 then
      return false
    end
    redis.call('HSET', skey, 'sub', sub, 'st', 'ACTIVE', 'hb', now, 'exp', exp, 'iat', iat,
               'prio', prio, 'conn', conn, 'since', since)
    redis.call('PEXPIREAT', skey, exp + grace_ms)
  end
  emit('SESSION_RESTORED', tid, sub, now, conn)
  return true
end

local function heartbeat(skey, tkey, tid, conn, replayed, known)
  local s = read(skey)
  if s[5] ~= conn then
    if known == '' or not restore(skey, tkey, tid, conn, s, known) then
      if s[1] then
        return {'taken'}
      end
      return {'gone', redis.call('GET', tkey) or ''}
    end
    s = read(skey)
  end
  local sub, exp, iat = s[1], tonumber(s[3]), tonumber(s[4])
  if exp <= now then
    finish(skey, tkey, tid, sub, exp, conn, now, 'TOKEN_EXPIRED', 'token_expired', 'expired')
    return {'gone', 'expired'}
  end
  if replayed ~= '1' and now - tonumber(s[6]) >= expire_ms then
    -- Silent for expire_after: expired, even if no sweep has got to it yet.
    finish(skey, tkey, tid, sub, exp, conn, now, 'TOKEN_EXPIRED', 'heartbeat_timeout', 'expired')
    return {'gone', 'expired'}
  end
  local was_warn = 0
  if s[2] == 'WARN' then
    was_warn = 1
    emit('SESSION_RECOVERED', tid, sub, now, conn)
  end
  local renewed = 0
  if exp - now <= renew_ms then
    local new_iat = math.floor(now / 1000)
    local new_exp = (new_iat + ttl_s) * 1000
    -- A renewal never shortens the token, whichever node gets here first.
    if new_exp > exp then
      exp, iat, renewed = new_exp, new_iat, 1
      redis.call('PEXPIREAT', skey, exp + grace_ms)
      emit('TOKEN_RENEWED', tid, sub, now, conn)
    end
  end
  redis.call('HSET', skey, 'st', 'ACTIVE', 'hb', now, 'exp', exp, 'iat', iat)
  -- Same deadline as tokend.clocks.deadline(ACTIVE, now, exp).
  redis.call('ZADD', DUE, math.min(now + warn_ms, exp), tid)
  if was_warn == 0 and renewed == 0 then
    return exp -- the common answer, in one integer: stored, nothing else changed
  end
  return {'ok', was_warn, renewed, exp, iat}
end

return for_each_session(5, 4, heartbeat)
