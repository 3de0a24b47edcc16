-- Sweep step 2: judge the claimed sessions of one shard and make the transitions that
-- are due, reading and writing each session in one atomic step, so that each
-- transition happens, and emits, once. The judgement is tokend.clocks.due_transition's
-- and the deadlines tokend.clocks.deadline's; tests/test_store.py holds them to it.
-- KEYS[3..]: pairs of (session hash, tombstone).
-- ARGV: warn_after (ms), expire_after (ms), then the claimed tids.
-- Returns, per session: 0 when nothing was due (its deadline replaces the claim's
-- lease), -1 when it was gone, else {what, conn}: what is 'warn', 'token_expired' or
-- 'heartbeat_timeout'; conn the connection to warn or close when the calling node holds
-- it (no control message is sent for it then), else ''.
local warn_ms, expire_ms = tonumber(ARGV[5]), tonumber(ARGV[6])
local now = now_ms()
local out = {}

local function tell(op, tid, conn, code)
  if node_of(conn) == NODE then
    return conn
  end
  control(op, tid, conn, code)
  return ''
end

for i = 1, (#KEYS - 2) / 2 do
  local skey, tkey, tid = KEYS[1 + 2 * i], KEYS[2 + 2 * i], ARGV[6 + i]
  local s = redis.call('HMGET', skey, 'sub', 'st', 'hb', 'exp', 'conn')
  if not s[1] then
    redis.call('ZREM', DUE, tid)
    out[i] = -1
  else
    local sub, hb, exp, conn = s[1], tonumber(s[3]), tonumber(s[4]), s[5]
    local reason = nil
    if now >= exp then
      reason = 'token_expired'
    elseif now - hb >= expire_ms then
      -- Expired even if never marked WARN (the sweep was late).
      reason = 'heartbeat_timeout'
    end
    if reason then
      finish(skey, tkey, tid, sub, exp, conn, now, 'TOKEN_EXPIRED', reason, 'expired')
      out[i] = {reason, tell('close', tid, conn, 4505)}
    elseif s[2] == 'ACTIVE' and now - hb >= warn_ms then
      redis.call('HSET', skey, 'st', 'WARN')
      -- Same deadline as tokend.clocks.deadline(WARN, hb, exp).
      redis.call('ZADD', DUE, math.min(hb + expire_ms, exp), tid)
      emit('SESSION_WARN', tid, sub, now, conn)
      out[i] = {'warn', tell('notice', tid, conn)}
    else
      -- Not due (a heartbeat came after the claim): tokend.clocks.deadline(st, hb, exp).
      local after = warn_ms
      if s[2] == 'WARN' then
        after = expire_ms
      end
      redis.call('ZADD', DUE, 'XX', math.min(hb + after, exp), tid)
      out[i] = 0
    end
  end
end
return out
