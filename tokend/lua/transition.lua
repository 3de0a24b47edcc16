-- Sweep step 3: make a WARN or EXPIRED transition that tokend.clocks found due,
-- if the session is still exactly as it was read (compare-and-set on state,
-- last heartbeat and exp), so that each transition happens, and emits, once.
-- KEYS[3] session hash, KEYS[4] tombstone.
-- ARGV: tid, state, hb, exp (as read), target ('WARN' or 'EXPIRED'), reason, expire_after (ms).
-- Returns 1 when the transition was made, 0 when the session had moved on.
local skey, tkey = KEYS[3], KEYS[4]
local tid = ARGV[5]
local s = redis.call('HMGET', skey, 'sub', 'st', 'hb', 'exp', 'conn')
if not s[1] then
  redis.call('ZREM', DUE, tid)
  return 0
end
if s[2] ~= ARGV[6] or s[3] ~= ARGV[7] or s[4] ~= ARGV[8] then
  return 0
end
local now = now_ms()
local hb, exp = tonumber(s[3]), tonumber(s[4])
if ARGV[9] == 'WARN' then
  redis.call('HSET', skey, 'st', 'WARN')
  -- Same deadline as tokend.clocks.deadline(WARN, hb, exp).
  redis.call('ZADD', DUE, math.min(hb + tonumber(ARGV[11]), exp), tid)
  emit('SESSION_WARN', tid, s[1], now)
  control('notice', tid, s[5])
else
  finish(skey, tkey, tid, s[1], exp, s[5], now, 'TOKEN_EXPIRED', ARGV[10], 'expired', 4505)
end
return 1
