-- HEARTBEAT for a batch of sessions (spec 0x03): record it, recover a WARN session,
-- renew a token inside its window.
-- KEYS and ARGV: grouped by shard (see for_each_session in the prelude); the fixed
-- arguments are warn_after (ms), renew_window (ms), token_ttl (s), grace (ms) and
-- expire_after (ms); each session's are (tid, conn, replayed): replayed = '1' for a
-- heartbeat the node received in time but could only store now (after an outage); it
-- is not judged late.
-- Returns, per session in order: exp_ms alone when the heartbeat was stored and the
-- session neither left WARN nor was renewed (the common case, cheapest to send and to
-- parse); else {'ok', was_warn, renewed, exp_ms, iat_s}, {'gone', tombstone or ''} or
-- {'taken'} (another connection holds the session).
local warn_ms, renew_ms = tonumber(ARGV[5]), tonumber(ARGV[6])
local ttl_s, grace_ms, expire_ms = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local now = now_ms()

local function heartbeat(skey, tkey, tid, conn, replayed)
  local s = redis.call('HMGET', skey, 'sub', 'st', 'exp', 'iat', 'conn', 'hb')
  if not s[1] then
    return {'gone', redis.call('GET', tkey) or ''}
  end
  if s[5] ~= conn then
    return {'taken'}
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

return for_each_session(5, 3, heartbeat)
