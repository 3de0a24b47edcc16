-- Prepended to every tokend script (see tokend/store.py).
-- Calling convention: KEYS[1] is the shard's deadline set, KEYS[2] its event
-- stream; every other key is a session or tombstone key of the same shard, so
-- all keys share one hash tag (heartbeat.lua, on one Redis, takes groups of
-- several shards, each group's keys led by its shard's; on a Cluster, one group
-- per call). ARGV[1..4] are node name, events channel, control channel and stream
-- cap; ARGV[5] is the request's deadline (below) and is taken out, so that script
-- arguments start at ARGV[5].
local NODE, EVENTS, CONTROL, MAXLEN = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local GIVEN_UP_AT = tonumber(table.remove(ARGV, 5))
local DUE, STREAM = KEYS[1], KEYS[2]

-- Time comes from Redis, never from a node, so skewed nodes agree on deadlines.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A request that reaches Redis after its node stopped waiting for it (its wall clock
-- plus redis_timeout plus leeway for clock skew) does nothing. Such requests are left
-- in a frozen Redis's socket buffers (a paused process, a long fork, a stalled VM) and
-- run when it thaws: a heartbeat judged then would find the session silent for the
-- whole freeze, a HELLO or BYE would act for a client already told 1013.
if now_ms() > GIVEN_UP_AT then
  return false
end

-- The node of connection `conn` ("<node>/<counter>"); nil for none.
local function node_of(conn)
  return conn and conn:match('^(.+)/')
end

-- The event of a transition, emitted in the same atomic step that makes it. Its
-- `node` is the node holding the session (of its connection `conn`), whichever node
-- runs the script; `by` says who asked for a revocation. docs/events.md lists the
-- fields of each type.
local function emit(kind, tid, sub, at, conn, reason, by)
  local json = cjson.encode({v = 1, type = kind, tid = tid, sub = sub, at = at,
                             node = node_of(conn), reason = reason, by = by})
  redis.call('XADD', STREAM, 'MAXLEN', '~', MAXLEN, '*', 'event', json)
  redis.call('PUBLISH', EVENTS, json)
end

-- Ask the node holding connection `conn` to act on it, on that node's own control
-- channel (CONTROL:<node>), so that no other node hears of it.
local function control(op, tid, conn, code)
  local node = node_of(conn)
  if node then
    redis.call('PUBLISH', CONTROL .. ':' .. node,
               cjson.encode({op = op, tid = tid, conn = conn, code = code}))
  end
end

-- End a session: delete it, leave a tombstone until its token's exp, emit
-- its final event, and (when code is given) close its connection wherever it is.
local function finish(skey, tkey, tid, sub, exp, conn, now, kind, reason, tomb, code, by)
  redis.call('DEL', skey)
  redis.call('ZREM', DUE, tid)
  if exp > now then
    redis.call('SET', tkey, tomb, 'PXAT', exp)
  end
  emit(kind, tid, sub, now, conn, reason, by)
  if code then
    control('close', tid, conn, code)
  end
end

-- The batch scripts (hello.lua, heartbeat.lua) take many sessions in one call, grouped
-- by shard. KEYS, per group: the shard's deadline set and event stream, then (session
-- hash, tombstone) per session of that shard. ARGV, after the script's `fixed` first
-- arguments: per group, its number of sessions, then `width` arguments per session. On
-- a Cluster a call has one group (one slot); on one Redis, a whole batch's groups.
-- Calls fn(session hash, tombstone, the session's arguments...) for each session, with
-- DUE and STREAM set to its shard's keys (emit and finish use them), and returns what
-- fn returned, in order.
local function for_each_session(fixed, width, fn)
  local out, k, a = {}, 0, 4 + fixed -- the last KEYS and ARGV read
  while a < #ARGV do
    DUE, STREAM = KEYS[k + 1], KEYS[k + 2]
    local sessions = tonumber(ARGV[a + 1])
    k, a = k + 2, a + 1
    for _ = 1, sessions do
      out[#out + 1] = fn(KEYS[k + 1], KEYS[k + 2], unpack(ARGV, a + 1, a + width))
      k, a = k + 2, a + width
    end
  end
  return out
end
