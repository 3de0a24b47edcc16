-- A rolling reload hands live connections to the new worker of their slot
-- (tokend.server.handoff): each session moves from connection `from` to connection `to`,
-- in one atomic step, and only while `from` still holds it (taken over, ended or
-- released meanwhile: nothing is written). The session's state, clocks, proof and token
-- stay as they are: for its client nothing happened, so nothing is emitted
-- (docs/events.md). The same script moves a session back to the old worker's connection
-- when the new worker died before it answered: `from` is then the new worker's node name
-- and `since` is '', and any connection of that node counts as `from`.
-- KEYS and ARGV: grouped by shard (see for_each_session in the prelude); no fixed
-- arguments; each session's are (tid, from, since, to): since is when `from` took the
-- session (its `since` field), which tells it from a connection of a node that restarted
-- under the same name and numbered its connections alike.
-- Returns, per session in order, the Redis time (ms) at which `to` took the session (its
-- new `since`), or 0 when `from` did not hold it.
local now = NOW

local function move(skey, tkey, tid, from, since, to)
  local s = load_session(skey)
  if not s or not s.conn then
    return 0
  end
  if since == '' then
    if node_of(s.conn) ~= from then
      return 0
    end
  elseif s.conn ~= from or s.since ~= tonumber(since) then
    return 0
  end
  redis.call('HSET', skey, 'conn', to, 'since', now)
  return now
end

return for_each_session(0, 4, move)
