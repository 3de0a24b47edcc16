-- Sweep step 2: read the claimed sessions of one shard, for tokend.clocks to judge.
-- KEYS[3..]: session hashes. Returns, per session, {st, hb, exp}, or {} when it is gone.
local out = {}
for i = 3, #KEYS do
  local s = redis.call('HMGET', KEYS[i], 'st', 'hb', 'exp')
  if s[1] then
    out[i - 2] = s
  else
    out[i - 2] = {}
  end
end
return out
