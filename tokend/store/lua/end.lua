-- End a session on request: BYE (SESSION_CLOSED) or revocation (TOKEN_REVOKED).
-- KEYS: the shard's deadline set and event stream, the session hash, its tombstone.
-- ARGV: tid, conn ('' = whichever holds it), event type, tombstone (an ENDED value),
-- close code ('' = do not close the connection; else a CLOSE value), tombstone ttl (ms)
-- when no session is live, who asked ('' = nobody named; the event's `by`).
-- Returns an END_OUTCOME: ENDED when a live session was ended, BARRED when only a
-- tombstone was written, ALREADY_ENDED when the session had already ended (or, for BYE,
-- is no longer this connection's: another holds it, or held it last).
local skey, tkey = KEYS[3], KEYS[4]
local tid, conn, kind, tomb = ARGV[OWN + 1], ARGV[OWN + 2], ARGV[OWN + 3], ARGV[OWN + 4]
local code, tomb_ttl_ms = tonumber(ARGV[OWN + 5]), tonumber(ARGV[OWN + 6])
local by = ARGV[OWN + 7] ~= '' and ARGV[OWN + 7] or nil

-- A client closes its session with BYE and only so.
local reason = kind == 'SESSION_CLOSED' and 'bye' or nil
local s = load_session(skey)
local now = NOW

-- A revocation is told to every node (on CONTROL itself, no node named): each keeps it
-- until its tombstone would expire, to bar the token and to write the tombstone again
-- should a failover lose it (tokend/store/revocations.py).
local function revoked(outcome)
  local left = redis.call('PTTL', tkey)
  if left > 0 then
    redis.call('PUBLISH', CONTROL, cjson.encode({op = 'revoked', tid = tid, expires = now + left}))
  end
  return outcome
end

if not s then
  if conn ~= '' then
    return END_OUTCOME.ALREADY_ENDED
  end
  -- Revoking a token whose session is not live still bars it from starting one.
  if redis.call('SET', tkey, tomb, 'PX', tomb_ttl_ms, 'NX') then
    emit(kind, tid, nil, now, nil, reason, by)
    return revoked(END_OUTCOME.BARRED)
  end
  -- Ended already: the tombstone is written again, unchanged, so that a WAIT after this
  -- script confirms that the replicas have it too.
  redis.call('SET', tkey, redis.call('GET', tkey), 'KEEPTTL')
  return revoked(END_OUTCOME.ALREADY_ENDED)
end
-- A BYE's connection may have been released meanwhile (it dropped while its BYE was on
-- the way: release.lua); no other connection took the session since, so it is still its.
if conn ~= '' and conn ~= holder(s) then
  return END_OUTCOME.ALREADY_ENDED
end
finish({skey = skey, tkey = tkey, tid = tid, session = s, now = now, event = kind,
        reason = reason, tomb = tomb, code = code, by = by})
if code then
  return revoked(END_OUTCOME.ENDED)
end
return END_OUTCOME.ENDED
