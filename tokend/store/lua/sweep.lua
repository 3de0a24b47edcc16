-- The sweep of one shard: find its sessions whose deadline has passed and make their due
-- transitions, in one atomic step. Finding and judging are not two steps, so no claim or
-- lease is needed: nodes sweeping the shard at the same time run one after the other, the
-- second finding only what the first left, and a node that dies mid-sweep leaves either
-- the whole of a call done or none of it. Each transition happens, and emits, once.
-- The judgement is tokend.core.lifecycle.due_transition's and the deadlines tokend.core.lifecycle.deadline's;
-- tests/test_lua_contract.py holds them to it.
-- KEYS: the shard's deadline set and event stream (the prelude's DUE and STREAM).
-- ARGV: limit (due sessions judged at most: tokend.store.sweeper.SWEEP_BATCH), warn_after (ms),
-- expire_after (ms), then what the shard's session hash and tombstone keys start with
-- (tokend.store.keyspace.Keyspace.session_prefixes; the tid follows). The session keys are
-- made here, not named in KEYS, because the script finds the tids itself; they carry the
-- shard's hash tag, so they are of the one slot that KEYS are of.
-- Returns {now_ms, next_ms, judged, ...}: next_ms is the shard's earliest deadline left
-- ('' when none), so that the sweeper can wake for it; judged how many due sessions were
-- judged (the limit: more may be due); then three values per transition made: the tid,
-- what (a SWEPT value: WARN, an expiry reason, or GONE when the session was gone) and the
-- connection to warn or close when the calling node holds it (no control message is sent
-- for it then), else ''.
local limit = tonumber(ARGV[OWN + 1])
local warn_ms, expire_ms = tonumber(ARGV[OWN + 2]), tonumber(ARGV[OWN + 3])
local session_prefix, tomb_prefix = ARGV[OWN + 4], ARGV[OWN + 5]

local now = NOW
local out = {now, '', 0}

-- A transition made, for the reply.
local function made(tid, what, conn)
  local n = #out
  out[n + 1], out[n + 2], out[n + 3] = tid, what, conn
end

local function tell(op, tid, conn, code)
  if node_of(conn) == NODE then
    return conn
  end
  control(op, tid, conn, code)
  return ''
end

local due = redis.call('ZRANGEBYSCORE', DUE, '-inf', now, 'LIMIT', 0, limit)
for _, tid in ipairs(due) do
  local skey, tkey = session_prefix .. tid, tomb_prefix .. tid
  local s = load_session(skey)
  if not s then
    redis.call('ZREM', DUE, tid)
    unwarned(tid)
    made(tid, SWEPT.GONE, '')
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
      made(tid, reason, tell('close', tid, s.conn, CLOSE.SESSION_EXPIRED))
    elseif s.st == STATE.ACTIVE and now - hb >= warn_ms then
      redis.call('HSET', skey, 'st', STATE.WARN)
      warned(tid)
      -- Same deadline as tokend.core.lifecycle.deadline(WARN, hb, exp).
      redis.call('ZADD', DUE, math.min(hb + expire_ms, exp), tid)
      emit('SESSION_WARN', tid, s.sub, now, holder(s))
      made(tid, SWEPT.WARN, tell('notice', tid, s.conn))
    else
      -- Not due after all (its deadline entry was behind): tokend.core.lifecycle.deadline(st, hb, exp).
      local after = warn_ms
      if s.st == STATE.WARN then
        after = expire_ms
      end
      redis.call('ZADD', DUE, 'XX', math.min(hb + after, exp), tid)
    end
  end
end
out[3] = #due
local _, next_due = unpack(redis.call('ZRANGE', DUE, 0, 0, 'WITHSCORES'))
out[2] = next_due or ''
return out
