-- Sweep step 2: judge the claimed sessions of one shard and make the transitions that
-- are due, reading and writing each session in one atomic step, so that each
-- transition happens, and emits, once. The judgement is tokend.clocks.due_transition's
-- and the deadlines tokend.clocks.deadline's; tests/test_lua_contract.py holds them to it.
-- KEYS: the shard's deadline set and event stream, then (session hash, tombstone) per
-- claimed tid.
-- ARGV: warn_after (ms), expire_after (ms), then the claimed tids.
-- Returns, per session: 0 when nothing was due (its deadline replaces the claim's
-- lease), else {what, conn}: what is a SWEPT value (WARN, an expiry reason, or GONE when
-- the session was gone); conn the connection to warn or close when the calling node
-- holds it (no control message is sent for it then), else ''.
local warn_ms, expire_ms = tonumber(ARGV[OWN + 1]), tonumber(ARGV[OWN + 2])
local FIRST_TID = OWN + 3

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
  local skey, tkey, tid = KEYS[1 + 2 * i], KEYS[2 + 2 * i], ARGV[FIRST_TID + i - 1]
  local s = load_session(skey)
  if not s then
    redis.call('ZREM', DUE, tid)
    out[i] = {SWEPT.GONE, ''}
  else
    local hb, exp = s.hb, s.exp
    local reason = nil
    if now >= exp then
      reason = EXPIRY.TOKEN_EXPIRED
    elseif now - hb >= expire_ms then
      -- Expired even if never marked WARN (the sweep was late).
      reason = EXPIRY.HEARTBEAT_TIMEOUT
    end
    if reason then
      finish({skey = skey, tkey = tkey, tid = tid, session = s, now = now,
              event = 'TOKEN_EXPIRED', reason = reason, tomb = ENDED.EXPIRED})
      out[i] = {reason, tell('close', tid, s.conn, CLOSE.SESSION_EXPIRED)}
    elseif s.st == STATE.ACTIVE and now - hb >= warn_ms then
      redis.call('HSET', skey, 'st', STATE.WARN)
      -- Same deadline as tokend.clocks.deadline(WARN, hb, exp).
      redis.call('ZADD', DUE, math.min(hb + expire_ms, exp), tid)
      emit('SESSION_WARN', tid, s.sub, now, holder(s))
      out[i] = {SWEPT.WARN, tell('notice', tid, s.conn)}
    else
      -- Not due (a heartbeat came after the claim): tokend.clocks.deadline(st, hb, exp).
      local after = warn_ms
      if s.st == STATE.WARN then
        after = expire_ms
      end
      redis.call('ZADD', DUE, 'XX', math.min(hb + after, exp), tid)
      out[i] = 0
    end
  end
end
return out
