-- Sweep step 1: claim the shard's sessions whose deadline has passed.
-- Each claimed entry is pushed a lease into the future so that other nodes
-- skip it; if the claiming node dies, the entry comes due again after the lease.
-- KEYS: the shard's deadline set and event stream (the prelude's DUE and STREAM).
-- ARGV: limit (tids at most), lease (ms).
-- Returns {now_ms, {tid, ...}, next_ms}: next_ms is the shard's earliest deadline left
-- after the claim ('' when none), so that the sweeper can wake for it instead of a full
-- sweep interval later.
local limit, lease_ms = tonumber(ARGV[OWN + 1]), tonumber(ARGV[OWN + 2])

local now = now_ms()
local due = redis.call('ZRANGEBYSCORE', DUE, '-inf', now, 'LIMIT', 0, limit)
for _, tid in ipairs(due) do
  redis.call('ZADD', DUE, 'XX', now + lease_ms, tid)
end
local _, next_due = unpack(redis.call('ZRANGE', DUE, 0, 0, 'WITHSCORES'))
return {now, due, next_due or ''}
