-- End a session on request: BYE (SESSION_CLOSED) or revocation (TOKEN_REVOKED).
-- KEYS[3] session hash, KEYS[4] tombstone.
-- ARGV: tid, conn ('' = whichever holds it), event type, tombstone, close code
-- ('' = do not close the connection), tombstone ttl (ms) when no session is live,
-- who asked ('' = nobody named; the event's `by`).
-- Returns 1 when a live session was ended, 2 when only a tombstone was written, 0 when the
-- session had already ended (or, for BYE, is no longer this connection's).
local skey, tkey = KEYS[3], KEYS[4]
local tid, conn, kind, tomb = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local code = tonumber(ARGV[9])
local by = ARGV[11] ~= '' and ARGV[11] or nil
-- A client closes its session with BYE and only so.
local reason = kind == 'SESSION_CLOSED' and 'bye' or nil
local s = redis.call('HMGET', skey, 'sub', 'exp', 'conn')
local now = now_ms()

-- A revocation is told to every node (on CONTROL itself, no node named): each keeps it
-- until its tombstone would expire, to bar the token and to write the tombstone again
-- should a failover lose it (tokend/revocations.py).
local function revoked(outcome)
  local left = redis.call('PTTL', tkey)
  if left > 0 then
    redis.call('PUBLISH', CONTROL, cjson.encode({op = 'revoked', tid = tid, expires = now + left}))
  end
  return outcome
end

if not s[1] then
  if conn ~= '' then
    return 0
  end
  -- Revoking a token whose session is not live still bars it from starting one.
  if redis.call('SET', tkey, tomb, 'PX', tonumber(ARGV[10]), 'NX') then
    emit(kind, tid, nil, now, nil, reason, by)
    return revoked(2)
  end
  -- Ended already: the tombstone is written again, unchanged, so that a WAIT after this
  -- script confirms that the replicas have it too.
  redis.call('SET', tkey, redis.call('GET', tkey), 'KEEPTTL')
  return revoked(0)
end
if conn ~= '' and conn ~= s[3] then
  return 0
end
finish(skey, tkey, tid, s[1], tonumber(s[2]), s[3], now, kind, reason, tomb, code, by)
if code then
  return revoked(1)
end
return 1
