-- HELLO for a batch of sessions (spec 0x01): start each, or resume the live one with its
-- tid. KEYS and ARGV: grouped by shard (see for_each_session in the prelude); the fixed
-- arguments are warn_after (ms), grace (ms) and expire_after (ms); each session's are
-- (tid, sub, prio, iat (s), exp (s), conn).
-- Returns, per session in order: {'started'|'resumed', exp_ms, iat_s, since_ms},
-- {'tomb', reason}, {'expired'} or {'mismatch'}. since_ms is when this connection took
-- the session (hash field `since`): after a failover a node re-asserts its connection
-- only over one that took it earlier (heartbeat.lua).
local warn_ms, grace_ms, expire_ms = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local now = now_ms()

local function hello(skey, tkey, tid, sub, prio, iat, exp_s, conn)
  local tomb = redis.call('GET', tkey)
  if tomb then
    return {'tomb', tomb}
  end

  local s = redis.call('HMGET', skey, 'sub', 'exp', 'iat', 'conn', 'st', 'hb')
  if s[1] then
    if s[1] ~= sub then
      return {'mismatch'}
    end
    local exp, token_exp = tonumber(s[2]), tonumber(exp_s) * 1000
    if token_exp > exp then
      -- A token of ours newer than the session: a renewal that a Redis failover lost. The
      -- client holds it; it keeps working.
      exp, s[3] = token_exp, iat
      redis.call('HSET', skey, 'exp', exp, 'iat', iat)
      redis.call('PEXPIREAT', skey, exp + grace_ms)
    end
    -- Due but not yet swept: expire it now rather than bring it back.
    if exp <= now then
      finish(skey, tkey, tid, sub, exp, s[4], now, 'TOKEN_EXPIRED', 'token_expired', 'expired',
             4505)
      return {'expired'}
    end
    if now - tonumber(s[6]) >= expire_ms then
      finish(skey, tkey, tid, sub, exp, s[4], now, 'TOKEN_EXPIRED', 'heartbeat_timeout',
             'expired', 4505)
      return {'tomb', 'expired'}
    end
    -- A resume counts as a heartbeat: the session is ACTIVE again.
    redis.call('HSET', skey, 'st', 'ACTIVE', 'hb', now, 'conn', conn, 'since', now)
    redis.call('ZADD', DUE, math.min(now + warn_ms, exp), tid)
    -- The connection that held it is told it was taken over; not the one resuming, which
    -- bears the same id when a node restarted under the same name numbers it alike.
    if s[4] ~= conn then
      control('close', tid, s[4], 4507)
    end
    emit('SESSION_RESUMED', tid, sub, now, conn)
    if s[5] == 'WARN' then
      -- Every WARN ends in exactly one of RECOVERED, EXPIRED, CLOSED or REVOKED.
      emit('SESSION_RECOVERED', tid, sub, now, conn)
    end
    return {'resumed', exp, tonumber(s[3]), now}
  end

  local exp = tonumber(exp_s) * 1000
  if exp <= now then
    return {'expired'}
  end
  redis.call('HSET', skey, 'sub', sub, 'st', 'ACTIVE', 'hb', now, 'exp', exp, 'iat', iat,
             'prio', prio, 'conn', conn, 'since', now)
  redis.call('PEXPIREAT', skey, exp + grace_ms)
  redis.call('ZADD', DUE, math.min(now + warn_ms, exp), tid)
  emit('SESSION_STARTED', tid, sub, now, conn)
  return {'started', exp, tonumber(iat), now}
end

return for_each_session(3, 6, hello)
