-- HELLO: start a session, or resume the live one with this tid (spec 0x01).
-- KEYS[3] session hash, KEYS[4] tombstone.
-- ARGV: tid, sub, prio, iat (s), exp (s), conn, warn_after (ms), grace (ms), expire_after (ms).
-- Returns {'started'|'resumed', exp_ms, iat_s}, {'tomb', reason}, {'expired'} or {'mismatch'}.
local skey, tkey = KEYS[3], KEYS[4]
local tid, sub, prio, iat, exp_s, conn = ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10]
local warn_ms, grace_ms, expire_ms = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local now = now_ms()

local tomb = redis.call('GET', tkey)
if tomb then
  return {'tomb', tomb}
end

local s = redis.call('HMGET', skey, 'sub', 'exp', 'iat', 'conn', 'st', 'hb')
if s[1] then
  if s[1] ~= sub then
    return {'mismatch'}
  end
  local exp = tonumber(s[2])
  -- Due but not yet swept: expire it now rather than bring it back.
  if exp <= now then
    finish(skey, tkey, tid, sub, exp, s[4], now, 'TOKEN_EXPIRED', 'token_expired', 'expired', 4505)
    return {'expired'}
  end
  if now - tonumber(s[6]) >= expire_ms then
    finish(skey, tkey, tid, sub, exp, s[4], now, 'TOKEN_EXPIRED', 'heartbeat_timeout', 'expired',
           4505)
    return {'tomb', 'expired'}
  end
  -- A resume counts as a heartbeat: the session is ACTIVE again.
  redis.call('HSET', skey, 'st', 'ACTIVE', 'hb', now, 'conn', conn)
  redis.call('ZADD', DUE, math.min(now + warn_ms, exp), tid)
  -- The connection it was held on is closed (4507), unless it bears this very id: a
  -- node restarted under its name counts connections afresh, and would close the new one.
  if s[4] ~= conn then
    control('close', tid, s[4], 4507)
  end
  emit('SESSION_RESUMED', tid, sub, now)
  if s[5] == 'WARN' then
    -- Every WARN ends in exactly one of RECOVERED, EXPIRED, CLOSED or REVOKED.
    emit('SESSION_RECOVERED', tid, sub, now)
  end
  return {'resumed', exp, tonumber(s[3])}
end

local exp = tonumber(exp_s) * 1000
if exp <= now then
  return {'expired'}
end
redis.call('HSET', skey, 'sub', sub, 'st', 'ACTIVE', 'hb', now, 'exp', exp, 'iat', iat,
           'prio', prio, 'conn', conn)
redis.call('PEXPIREAT', skey, exp + grace_ms)
redis.call('ZADD', DUE, math.min(now + warn_ms, exp), tid)
emit('SESSION_STARTED', tid, sub, now)
return {'started', exp, tonumber(iat)}
