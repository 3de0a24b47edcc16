-- HEARTBEAT for a batch of sessions (spec 0x03): record it, recover a WARN session,
-- renew a token inside its window.
-- KEYS: groups, one per shard: the shard's deadline set and event stream, then pairs of
-- (session hash, tombstone) of that shard. On a Cluster a call has one group (one slot);
-- on one Redis, a whole batch's groups go in one call.
-- ARGV: warn_after (ms), renew_window (ms), token_ttl (s), grace (ms), expire_after (ms),
-- then per group: its number of sessions, then their quadruples (tid, conn, replayed,
-- restore): replayed = '1' for a heartbeat the node received in time but could only store
-- now (after an outage); it is not judged late. restore = '' or, when the node asks again
-- for a session the store answered gone or taken, what its live connection knows:
-- 'prio|iat_s|exp_ms|since_ms|sub'.
-- Returns, per session in order: {'ok', was_warn, renewed, exp_ms, iat_s},
-- {'gone', tombstone or ''} or {'taken'} (another connection holds the session).
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
  emit('SESSION_RESTORED', tid, sub, now)
  return true
end

local function beat(skey, tkey, tid, conn, replayed, known)
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
    emit('SESSION_RECOVERED', tid, sub, now)
  end
  local renewed = 0
  if exp - now <= renew_ms then
    local new_iat = math.floor(now / 1000)
    local new_exp = (new_iat + ttl_s) * 1000
    -- A renewal never shortens the token, whichever node gets here first.
    if new_exp > exp then
      exp, iat, renewed = new_exp, new_iat, 1
      redis.call('PEXPIREAT', skey, exp + grace_ms)
      emit('TOKEN_RENEWED', tid, sub, now)
    end
  end
  redis.call('HSET', skey, 'st', 'ACTIVE', 'hb', now, 'exp', exp, 'iat', iat)
  -- Same deadline as tokend.clocks.deadline(ACTIVE, now, exp).
  redis.call('ZADD', DUE, math.min(now + warn_ms, exp), tid)
  return {'ok', was_warn, renewed, exp, iat}
end

local out = {}
local k, a = 0, 9 -- the last KEYS and ARGV read
while a < #ARGV do
  -- The prelude's emit() and finish() use the group's shard keys from here on.
  DUE, STREAM = KEYS[k + 1], KEYS[k + 2]
  local sessions = tonumber(ARGV[a + 1])
  k, a = k + 2, a + 1
  for _ = 1, sessions do
    out[#out + 1] = beat(KEYS[k + 1], KEYS[k + 2], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3],
                         ARGV[a + 4])
    k, a = k + 2, a + 4
  end
end
return out
