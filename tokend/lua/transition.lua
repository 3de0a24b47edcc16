-- Sweep step 3: make the WARN or EXPIRED transitions that tokend.clocks found due in
-- one shard, each only if its session is still exactly as it was read (compare-and-set
-- on state, last heartbeat and exp), so that each transition happens, and emits, once.
-- KEYS[3..]: pairs of (session hash, tombstone).
-- ARGV: expire_after (ms), then per session: tid, state, hb, exp (as read),
-- target ('WARN', 'EXPIRED' or 'LATER'), then the expiry reason for EXPIRED, or for
-- LATER (not due after all: the claim's lease is replaced) the deadline to put back.
-- Returns, per session, 1 when the transition was made, else 0.
local expire_ms = tonumber(ARGV[5])
local now = now_ms()
local out = {}
for i = 1, (#KEYS - 2) / 2 do
  local skey, tkey = KEYS[1 + 2 * i], KEYS[2 + 2 * i]
  local a = 6 * i
  local tid, target = ARGV[a], ARGV[a + 4]
  local s = redis.call('HMGET', skey, 'sub', 'st', 'hb', 'exp', 'conn')
  out[i] = 0
  if not s[1] then
    redis.call('ZREM', DUE, tid)
  elseif target == 'LATER' then
    redis.call('ZADD', DUE, 'XX', ARGV[a + 5], tid)
  elseif s[2] == ARGV[a + 1] and s[3] == ARGV[a + 2] and s[4] == ARGV[a + 3] then
    local hb, exp = tonumber(s[3]), tonumber(s[4])
    if target == 'WARN' then
      redis.call('HSET', skey, 'st', 'WARN')
      -- Same deadline as tokend.clocks.deadline(WARN, hb, exp).
      redis.call('ZADD', DUE, math.min(hb + expire_ms, exp), tid)
      emit('SESSION_WARN', tid, s[1], now)
      control('notice', tid, s[5])
    else
      finish(skey, tkey, tid, s[1], exp, s[5], now, 'TOKEN_EXPIRED', ARGV[a + 5], 'expired',
             4505)
    end
    out[i] = 1
  end
end
return out
