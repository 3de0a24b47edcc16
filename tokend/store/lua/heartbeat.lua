-- HEARTBEAT for a batch of sessions (spec 0x03): record it, recover a WARN session,
-- renew a token inside its window.
-- KEYS and ARGV: grouped by shard (see for_each_session in the prelude); the fixed
-- arguments are warn_after (ms), renew_window (ms), token_ttl (s), grace (ms) and
-- expire_after (ms); each session's are (tid, conn, replayed, restore, token): replayed =
-- '1' for a heartbeat the node received in time but could only store now (after an
-- outage); it is not judged late. restore = '' or, when the node asks again for a session
-- the store answered gone or taken, what its live connection knows:
-- 'prio|iat_s|exp_ms|since_ms|proof|sub' (proof: as hello.lua keeps it, base64url).
-- token = '' or the digest of a token the node signed and gave this connection since its
-- last heartbeat (a renewal, a token re-sent): kept with the session (field `tok`) as
-- hello.lua keeps a verified token's, so that a resume with it skips the signature.
-- Returns, per session in order: exp_ms alone when the heartbeat was stored and the
-- session neither left WARN nor was renewed (the common case, cheapest to send and to
-- parse); else {OK, was_warn, renewed, exp_ms, iat_s}, {GONE, tombstone or ''} or
-- {TAKEN} (another connection holds the session), of HEARTBEAT_OUTCOME.
local warn_ms, renew_ms = tonumber(ARGV[OWN + 1]), tonumber(ARGV[OWN + 2])
local ttl_s, grace_ms, expire_ms = tonumber(ARGV[OWN + 3]), tonumber(ARGV[OWN + 4]),
                                   tonumber(ARGV[OWN + 5])
local now = NOW

-- Redis lost this connection's session, or its hold on it, in a failover (writes the old
-- master acknowledged and never replicated). Re-assert what the node knows, unless the
-- session ended (tombstone), its token expired, or another connection took it later.
-- Returns whether it did.
local function restore(skey, tkey, tid, conn, s, known)
  local prio, iat, exp, since, proof, sub = known:match('^(%d+)|(%d+)|(%d+)|(%d+)|([%w_%-]*)|(.*)$')
  exp, since = tonumber(exp), tonumber(since)
  if s then
    if s.sub ~= sub or (s.since or 0) >= since then
      return false
    end
    -- Our connection took the session after the one Redis names: Redis lost that resume.
    control('close', tid, s.conn, CLOSE.TAKEN_OVER)
    redis.call('HSET', skey, 'conn', conn, 'since', since, 'hb', now, 'proof', proof)
    redis.call('HDEL', skey, 'left') -- if it was released (not read: HEARTBEAT_FIELDS)
    if exp > s.exp then
      redis.call('HSET', skey, 'exp', exp, 'iat', iat)
      redis.call('PEXPIREAT', skey, exp + grace_ms)
    end
  else
    if exp <= now or redis.call('EXISTS', tkey) == 1 then
      return false
    end
    redis.call('HSET', skey, 'sub', sub, 'st', STATE.ACTIVE, 'hb', now, 'exp', exp, 'iat', iat,
               'prio', prio, 'conn', conn, 'since', since, 'proof', proof)
    redis.call('PEXPIREAT', skey, exp + grace_ms)
  end
  emit('SESSION_RESTORED', tid, sub, now, conn)
  return true
end

local function heartbeat(skey, tkey, tid, conn, replayed, known, token)
  local s = load_session(skey, HEARTBEAT_FIELDS)
  if not s or s.conn ~= conn then
    if known == '' or not restore(skey, tkey, tid, conn, s, known) then
      if s then
        return {HEARTBEAT_OUTCOME.TAKEN}
      end
      return {HEARTBEAT_OUTCOME.GONE, redis.call('GET', tkey) or ''}
    end
    s = load_session(skey, HEARTBEAT_FIELDS)
  end
  local reason = nil
  if s.exp <= now then
    reason = EXPIRY.TOKEN_EXPIRED
  elseif replayed ~= '1' and now - s.hb >= expire_ms then
    -- Silent for expire_after: expired, even if no sweep has got to it yet.
    reason = EXPIRY.HEARTBEAT_TIMEOUT
  end
  if reason then
    finish({skey = skey, tkey = tkey, tid = tid, session = s, now = now,
            event = 'TOKEN_EXPIRED', reason = reason, tomb = ENDED.EXPIRED})
    return {HEARTBEAT_OUTCOME.GONE, ENDED.EXPIRED}
  end
  if token ~= '' then
    -- Only the connection holding the session gets here: a token this node signed for it.
    redis.call('HSET', skey, 'tok', token)
  end
  if s.pk then
    -- The first heartbeat after the resume of a parked session: its client is back.
    redis.call('HDEL', skey, 'pk')
  end
  local sub, exp, iat = s.sub, s.exp, s.iat
  local was_warn = 0
  if s.st == STATE.WARN then
    was_warn = 1
    unwarned(tid)
    emit('SESSION_RECOVERED', tid, sub, now, conn)
  end
  local renewed = 0
  if exp - now <= renew_ms then
    local new_iat = math.floor(now / 1000)
    local new_exp = (new_iat + ttl_s) * 1000
    -- A renewal never shortens the token, whichever node gets here first.
    if new_exp > exp then
      exp, iat, renewed = new_exp, new_iat, 1
      redis.call('PEXPIREAT', skey, exp + grace_ms)
      emit('TOKEN_RENEWED', tid, sub, now, conn)
    end
  end
  -- Same deadline as tokend.core.lifecycle.deadline(ACTIVE, now, exp).
  redis.call('ZADD', DUE, math.min(now + warn_ms, exp), tid)
  if was_warn == 0 and renewed == 0 then
    -- st is ACTIVE (the only other state is WARN) and exp, iat are unchanged: write hb alone.
    redis.call('HSET', skey, 'hb', now)
    return exp -- the common answer, in one integer: stored, nothing else changed
  end
  redis.call('HSET', skey, 'st', STATE.ACTIVE, 'hb', now, 'exp', exp, 'iat', iat)
  return {HEARTBEAT_OUTCOME.OK, was_warn, renewed, exp, iat}
end

return for_each_session(5, 5, heartbeat)
