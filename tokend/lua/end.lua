-- End a session on request: BYE (SESSION_CLOSED) or revocation (TOKEN_REVOKED).
-- KEYS[3] session hash, KEYS[4] tombstone.
-- ARGV: tid, conn ('' = whichever holds it), event type, tombstone, close code
-- ('' = do not close the connection), tombstone ttl (ms) when no session is live,
-- who asked ('' = nobody named; the event's `by`).
-- Returns 1 when a live session was ended, 2 when only a tombstone was written.
local skey, tkey = KEYS[3], KEYS[4]
local tid, conn, kind, tomb = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local code = tonumber(ARGV[9])
local by = ARGV[11] ~= '' and ARGV[11] or nil
-- A client closes its session with BYE and only so.
local reason = kind == 'SESSION_CLOSED' and 'bye' or nil
local s = redis.call('HMGET', skey, 'sub', 'exp', 'conn')
local now = now_ms()
if not s[1] then
  if conn ~= '' then
    return 0
  end
  -- Revoking a token whose session is not live still bars it from starting one.
  if redis.call('SET', tkey, tomb, 'PX', tonumber(ARGV[10]), 'NX') then
    emit(kind, tid, nil, now, nil, reason, by)
    return 2
  end
  return 0
end
if conn ~= '' and conn ~= s[3] then
  return 0
end
finish(skey, tkey, tid, s[1], tonumber(s[2]), s[3], now, kind, reason, tomb, code, by)
return 1
