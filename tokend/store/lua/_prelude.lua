-- Prepended to every tokend script, after the constants that tokend/store/scripts.py generates
-- from Python, so that neither side spells the other's values: CLOSE (close codes,
-- tokend.core.protocol.CloseCode), EXPIRY (tokend.core.lifecycle.ExpiryReason), ENDED (tombstones,
-- tokend.core.store_messages.Ended), the replies HELLO_OUTCOME, HEARTBEAT_OUTCOME, END_OUTCOME,
-- RELEASE_OUTCOME and SWEPT (tokend.core.store_messages), SESSION_FIELDS (the session hash's fields)
-- and session_fields (an HMGET reply of those as a table by name).
--
-- Calling convention: KEYS[1] is the shard's deadline set, KEYS[2] its event stream; every
-- other key is a session or tombstone key of the same shard, so all keys share one hash
-- tag (the batch scripts take groups of several shards on one Redis, each group's keys led
-- by its shard's; on a Cluster, one group per call: see for_each_session). ARGV[1..5] are
-- the prelude's (named below); a script's own arguments follow, from ARGV[OWN + 1].
local NODE, EVENTS, CONTROL, MAXLEN = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local GIVEN_UP_AT = tonumber(ARGV[5])
local OWN = 5
local DUE, STREAM = KEYS[1], KEYS[2]

-- Time comes from Redis, never from a node, so skewed nodes agree on deadlines.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Redis time as the script began: the one TIME a script needs (a script runs atomically).
local NOW = now_ms()

-- A request that reaches Redis after its node stopped waiting for it (its wall clock
-- plus redis_timeout plus leeway for clock skew) does nothing. Such requests are left
-- in a frozen Redis's socket buffers (a paused process, a long fork, a stalled VM) and
-- run when it thaws: a heartbeat judged then would find the session silent for the
-- whole freeze, a HELLO or BYE would act for a client already told 1013.
if NOW > GIVEN_UP_AT then
  return false
end

-- The session in hash `skey`, by field name (hb, exp, iat, prio and since as numbers; a
-- field the hash lacks is false, or nil if a number), or nil when there is none. Only the
-- first `fields` of SESSION_FIELDS when given (HEARTBEAT_FIELDS: the others are nil). The one
-- read of a session hash: no script reads a field by its position in a reply.
local function load_session(skey, fields)
  local s = session_fields(redis.call('HMGET', skey, unpack(SESSION_FIELDS, 1, fields)))
  if not s.sub then
    return nil
  end
  return s
end

-- The node of connection `conn` ("<node>/<counter>"); nil for none.
local function node_of(conn)
  return conn and conn:match('^(.+)/')
end

-- The connection a session's events name: the one holding it, else (its connection
-- ended: release.lua) the one that held it last.
local function holder(s)
  return s.conn or s.left
end

-- The event of a transition, emitted in the same atomic step that makes it. Its
-- `node` is the node holding the session (of its connection `conn`: see holder),
-- whichever node runs the script; `by` says who asked for a revocation. docs/events.md
-- lists the fields of each type.
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

-- The shard's state counts, beside its deadline set (tokend.store.keyspace's count_keys;
-- tokend.store.queries.Queries.counts sums them): 'warn', the set of its sessions in WARN
-- (the deadline set holds every live session, so ACTIVE is the rest), and 'ended', its
-- ended sessions by tombstone (an ENDED value). Whatever changes a session's state moves
-- them in the same atomic step: a session enters WARN only by warned(), leaves it by
-- unwarned() (every end does), and every end is counted by finish().
local function count_key(name)
  return DUE:sub(1, -4) .. name -- DUE is '<shard tag>:due'
end

local function warned(tid)
  redis.call('SADD', count_key('warn'), tid)
end

local function unwarned(tid)
  redis.call('SREM', count_key('warn'), tid)
end

-- End a session: delete it, leave a tombstone until its token's exp, emit its final
-- event, and (when a close code is given) close its connection wherever it is.
-- t: {skey, tkey, tid, session (as load_session read it), now, event, reason, tomb,
-- code (a CLOSE value, or nil), by (or nil)}.
local function finish(t)
  local s = t.session
  redis.call('DEL', t.skey)
  redis.call('ZREM', DUE, t.tid)
  unwarned(t.tid)
  redis.call('HINCRBY', count_key('ended'), t.tomb, 1)
  if s.exp > t.now then
    redis.call('SET', t.tkey, t.tomb, 'PXAT', s.exp)
  end
  emit(t.event, t.tid, s.sub, t.now, holder(s), t.reason, t.by)
  if t.code then
    control('close', t.tid, s.conn, t.code)
  end
end

-- The batch scripts (hello.lua, heartbeat.lua, release.lua) take many sessions in one
-- call, grouped by shard. KEYS, per group: the shard's deadline set and event stream, then
-- (session hash, tombstone) per session of that shard. ARGV, after the script's `fixed` first
-- arguments: per group, its number of sessions, then `width` arguments per session. On
-- a Cluster a call has one group (one slot); on one Redis, a whole batch's groups.
-- Calls fn(session hash, tombstone, the session's arguments...) for each session, with
-- DUE and STREAM set to its shard's keys (emit and finish use them), and returns what
-- fn returned, in order.
local function for_each_session(fixed, width, fn)
  local out, k, a = {}, 0, OWN + fixed -- the last KEYS and ARGV read
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
