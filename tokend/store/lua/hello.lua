-- HELLO for a batch of sessions (spec 0x01): start each, or resume the live one with its
-- tid. KEYS and ARGV: grouped by shard (see for_each_session in the prelude); the fixed
-- arguments are warn_after (ms), grace (ms), expire_after (ms) and held_live (ms:
-- heartbeat_interval + tokend.core.lifecycle.HELD_LIVE_SLACK_MS); each session's are (tid, sub,
-- prio, iat (s), exp (s), conn, shown, proof, token, verified): shown is the digest of the
-- HELLO's resume proof ('' for none), proof the digest of the proof this connection's
-- session key makes, kept with the session (field `proof`) for the next resume to show
-- (tokend.store.sessions.proof_digest); token the digest of the HELLO's token
-- (tokend.tokens.service.token_digest), kept with the session (field `tok`) when verified is '1'.
-- A HELLO whose token's signature was not checked (verified '0') goes on only if the
-- session keeps that digest: the very token it was last verified with; else {VERIFY},
-- nothing written, before anything about the session is told (docs/security.md).
-- Returns, per session in order, of HELLO_OUTCOME: {STARTED|RESUMED, exp_ms, iat_s,
-- since_ms}, {ENDED, tombstone}, {EXPIRED}, {MISMATCH}, {IN_USE} or {VERIFY}. since_ms is
-- when this connection took the session (hash field `since`): after a failover a node
-- re-asserts its connection only over one that took it earlier (heartbeat.lua).
local warn_ms, grace_ms, expire_ms = tonumber(ARGV[OWN + 1]), tonumber(ARGV[OWN + 2]),
                                     tonumber(ARGV[OWN + 3])
local held_live_ms = tonumber(ARGV[OWN + 4])
local now = NOW

local function hello(skey, tkey, tid, sub, prio, iat, exp_s, conn, shown, proof, token,
                     verified)
  if verified ~= '1' then
    local known = redis.call('HGET', skey, 'tok')
    if token == '' or known ~= token then
      return {HELLO_OUTCOME.VERIFY}
    end
  end
  local tomb = redis.call('GET', tkey)
  if tomb then
    return {HELLO_OUTCOME.ENDED, tomb}
  end

  local s = load_session(skey)
  if s then
    if s.sub ~= sub then
      return {HELLO_OUTCOME.MISMATCH}
    end
    -- Spec "Resume proof": another connection holds the session live (tokend.core.lifecycle.held_live)
    -- and this HELLO does not show the proof of its last WELCOME's key: it goes on there, and
    -- nothing is written. Both sides are digests (SHA-256), so the time this comparison takes
    -- tells nothing about the proof itself.
    if s.conn and s.conn ~= conn and now - s.hb <= held_live_ms
       and (shown == '' or shown ~= s.proof) then
      return {HELLO_OUTCOME.IN_USE}
    end
    local token_exp = tonumber(exp_s) * 1000
    if token_exp > s.exp then
      -- A token of ours newer than the session: a renewal that a Redis failover lost. The
      -- client holds it; it keeps working.
      s.exp, s.iat = token_exp, tonumber(iat)
      redis.call('HSET', skey, 'exp', s.exp, 'iat', iat)
      redis.call('PEXPIREAT', skey, s.exp + grace_ms)
    end
    -- Due but not yet swept: expire it now rather than bring it back. A parked session's
    -- clocks are held while a restart brings its clients back (sweep.lua): its silence
    -- since the close does not count, only its token's exp.
    local reason = nil
    if s.exp <= now then
      reason = EXPIRY.TOKEN_EXPIRED
    elseif now - s.hb >= expire_ms and not s.pk then
      reason = EXPIRY.HEARTBEAT_TIMEOUT
    end
    if reason then
      finish({skey = skey, tkey = tkey, tid = tid, session = s, now = now,
              event = 'TOKEN_EXPIRED', reason = reason, tomb = ENDED.EXPIRED,
              code = CLOSE.SESSION_EXPIRED})
      if reason == EXPIRY.TOKEN_EXPIRED then
        return {HELLO_OUTCOME.EXPIRED}
      end
      return {HELLO_OUTCOME.ENDED, ENDED.EXPIRED}
    end
    -- A resume counts as a heartbeat: the session is ACTIVE again.
    local exp = s.exp
    redis.call('HSET', skey, 'st', STATE.ACTIVE, 'hb', now, 'conn', conn, 'since', now,
               'proof', proof, 'tok', token)
    if s.left then
      redis.call('HDEL', skey, 'left')
    end
    if s.pk then
      -- A parked session resumed: its shard's restart is under way (sweep.lua's hold). It
      -- stays parked until its first heartbeat (heartbeat.lua): a client that gave up on
      -- this HELLO before its WELCOME came is still coming back, and keeps the hold.
      redis.call('SET', count_key('resumed'), now)
    end
    redis.call('ZADD', DUE, math.min(now + warn_ms, exp), tid)
    -- The connection that held it is told it was taken over; not the one resuming, which
    -- bears the same id when a node restarted under the same name numbers it alike.
    if s.conn ~= conn then
      control('close', tid, s.conn, CLOSE.TAKEN_OVER)
    end
    emit('SESSION_RESUMED', tid, sub, now, conn)
    if s.st == STATE.WARN then
      -- Every WARN ends in exactly one of RECOVERED, EXPIRED, CLOSED or REVOKED.
      unwarned(tid)
      emit('SESSION_RECOVERED', tid, sub, now, conn)
    end
    return {HELLO_OUTCOME.RESUMED, exp, s.iat, now}
  end

  local exp = tonumber(exp_s) * 1000
  if exp <= now then
    return {HELLO_OUTCOME.EXPIRED}
  end
  redis.call('HSET', skey, 'sub', sub, 'st', STATE.ACTIVE, 'hb', now, 'exp', exp, 'iat', iat,
             'prio', prio, 'conn', conn, 'since', now, 'proof', proof, 'tok', token)
  redis.call('PEXPIREAT', skey, exp + grace_ms)
  redis.call('ZADD', DUE, math.min(now + warn_ms, exp), tid)
  emit('SESSION_STARTED', tid, sub, now, conn)
  return {HELLO_OUTCOME.STARTED, exp, tonumber(iat), now}
end

return for_each_session(4, 10, hello)
