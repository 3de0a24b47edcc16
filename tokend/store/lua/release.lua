-- The connections that held these sessions ended (tokend.server.batchers.ReleaseBatcher): no
-- connection holds them now (docs/protocol.md §5, "When a connection ends").
-- KEYS and ARGV: grouped by shard (see for_each_session in the prelude); the fixed
-- arguments are warn_after (ms) and restart_grace (ms); each session's are (tid, conn,
-- since_ms, reason): the connection and when it took the session (hello.lua's `since`), and
-- the reason of its close when the server itself closed it with 1001 (a planned close:
-- drain, reload, shutdown), '' for any other end.
-- since_ms is -1 when the HELLO's answer was lost (tokend.core.session.SINCE_UNKNOWN): the
-- connection ids alone then decide.
-- Only a session still held by that very connection is released: its `conn` moves to
-- `left`. After a planned close, an ACTIVE session with nothing due is also parked: its
-- clocks restart at the close as a heartbeat's would, plus restart_grace, and
-- SESSION_PARKED is emitted with the close's reason (tokend.core.lifecycle.parked_heartbeat; a
-- session in WARN, or already due, keeps its clocks). tests/test_lua_contract.py holds
-- this to tokend.core.lifecycle.
-- Returns, per session in order, a RELEASE_OUTCOME: NOT_HELD, RELEASED or PARKED.
local warn_ms, restart_grace_ms = tonumber(ARGV[OWN + 1]), tonumber(ARGV[OWN + 2])
local now = NOW

local function release(skey, tkey, tid, conn, since, reason)
  local s = load_session(skey)
  -- Taken over or ended meanwhile; `since` tells this connection from one of a node that
  -- restarted under the same name and numbered its connections alike.
  since = tonumber(since)
  if not s or s.conn ~= conn or (since ~= -1 and s.since ~= since) then
    return RELEASE_OUTCOME.NOT_HELD
  end
  redis.call('HDEL', skey, 'conn')
  local exp = s.exp
  -- tokend.core.lifecycle.parked_heartbeat: ACTIVE and nothing due (neither WARN nor EXPIRED).
  if reason == '' or s.st ~= STATE.ACTIVE or now >= exp or now - s.hb >= warn_ms then
    redis.call('HSET', skey, 'left', conn)
    return RELEASE_OUTCOME.RELEASED
  end
  local hb = now + restart_grace_ms
  redis.call('HSET', skey, 'left', conn, 'hb', hb)
  -- Same deadline as tokend.core.lifecycle.deadline(ACTIVE, hb, exp).
  redis.call('ZADD', DUE, math.min(hb + warn_ms, exp), tid)
  emit('SESSION_PARKED', tid, s.sub, now, conn, reason)
  return RELEASE_OUTCOME.PARKED
end

return for_each_session(2, 4, release)
