"""The shared store's atomic steps, as Lua run by the Redis-protocol server (one round trip
each, no other client sees a half-done step). Keys, under the store's prefix:

    h:<key>              the entry (JSON)
    order                all keys by expiry less the TTL (their store time, but for
                         a handle kept earlier: recalled)
    rep:<url>            one decode replica's keys in store order
    pin                  hash: blocks pinned per replica
    len:<tenant>         a tenant's completion keys by prompt length
    ten:<tenant>         a tenant's keys in store order
    tcount               zset: entries per tenant (the heaviest is the LRU bound's victim)
    rt:<url>|<tenant>    a tenant's keys on one replica in store order
    rtp:<url>            zset: blocks one replica pins per tenant (the watermark's victim)
    rto:<url>|<tenant>   the same keys by when each conversation turns overdue, and
    rte:<url>|<tenant>   by when it is expected back (bidirkv/returns.py): the order the
                         block bounds take a tenant's keys on a replica in
    meta                 key -> what the indexes hold for it (decode url, blocks, tenant)
    seq                  a counter: the store order of the three indexes above (store
                         times in ms tie under load, and a tie orders by key, not age)

`meta` has no TTL: when the server itself expires an `h:` key (its safety TTL, once no
router swept for a minute), the next step that meets the key still takes it out of every
index and count, instead of leaving blocks pinned that no entry holds. Tenant counts are
lowered only for keys their index really held, so entries stored before the tenant
indexes existed never drive a count below what is there."""

# Every script below takes an entry out of the indexes through this, from its JSON or,
# once the server expired it, from `meta`.
_UNINDEX = """
local function settle(z, member, delta)
  if delta == 0 then return end
  local n = tonumber(redis.call('ZINCRBY', z, delta, member))
  if n <= 0 then redis.call('ZREM', z, member) end
end
local function unindex(p, k, v)
  local url, blocks, tenant
  if v then
    local e = cjson.decode(v)
    url, blocks, tenant = e['decode_url'], e['blocks'] or 0, e['tenant'] or ''
  else
    local m = redis.call('HGET', p .. 'meta', k)
    if not m then return end
    local e = cjson.decode(m)
    url, blocks, tenant = e[1], e[2], e[3]
  end
  redis.call('ZREM', p .. 'order', k)
  redis.call('ZREM', p .. 'rep:' .. url, k)
  -- Lua writes -0 as "-0", which HINCRBY refuses: a handle of no blocks pins nothing.
  if blocks ~= 0 then redis.call('HINCRBY', p .. 'pin', url, -blocks) end
  if tenant ~= '' then redis.call('ZREM', p .. 'len:' .. tenant, k) end
  if redis.call('ZREM', p .. 'ten:' .. tenant, k) == 1 then
    settle(p .. 'tcount', tenant, -1)
  end
  if redis.call('ZREM', p .. 'rt:' .. url .. '|' .. tenant, k) == 1 then
    settle(p .. 'rtp:' .. url, tenant, -blocks)
  end
  redis.call('ZREM', p .. 'rto:' .. url .. '|' .. tenant, k)
  redis.call('ZREM', p .. 'rte:' .. url .. '|' .. tenant, k)
  redis.call('HDEL', p .. 'meta', k)
end
"""

# Remove one entry and return it. KEYS: entry, order; ARGV: key, prefix.
TAKE = _UNINDEX + """
local v = redis.call('GET', KEYS[1])
unindex(ARGV[2], ARGV[1], v)
redis.call('ZREM', KEYS[2], ARGV[1])
if not v then return false end
redis.call('DEL', KEYS[1])
return v
"""

# Store an entry, replacing (or, with ARGV[6] == "1", keeping) an existing one. KEYS: entry,
# order; ARGV: key, entry JSON, store time, TTL ms, prefix, keep-existing, when it turns
# overdue, when it is expected back (Unix seconds). Returns the old
# entry and what the caller checks its bounds against, in the same round trip: entries
# stored, blocks pinned on the replica, the tenant's entries, the tenant's blocks there.
PUT = _UNINDEX + """
local p, k = ARGV[5], ARGV[1]
local old = redis.call('GET', KEYS[1])
if ARGV[6] == '1' and old then return {old, 0, 0, 0, 0} end
unindex(p, k, old)
local e = cjson.decode(ARGV[2])
local url, blocks, t = e['decode_url'], e['blocks'] or 0, e['tenant'] or ''
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[3], k)
local seq = redis.call('INCR', p .. 'seq')
redis.call('ZADD', p .. 'rep:' .. url, seq, k)
redis.call('HINCRBY', p .. 'pin', url, blocks)
if t ~= '' and (e['prefix_len'] or 0) > 0 then
  redis.call('ZADD', p .. 'len:' .. t, e['prefix_len'], k)
end
redis.call('ZADD', p .. 'ten:' .. t, seq, k)
redis.call('ZINCRBY', p .. 'tcount', 1, t)
redis.call('ZADD', p .. 'rt:' .. url .. '|' .. t, seq, k)
redis.call('ZADD', p .. 'rto:' .. url .. '|' .. t, ARGV[7], k)
redis.call('ZADD', p .. 'rte:' .. url .. '|' .. t, ARGV[8], k)
settle(p .. 'rtp:' .. url, t, blocks)
redis.call('HSET', p .. 'meta', k, cjson.encode({url, blocks, t}))
return {old, redis.call('ZCARD', KEYS[2]),
        tonumber(redis.call('HGET', p .. 'pin', url)),
        tonumber(redis.call('ZSCORE', p .. 'tcount', t) or '0'),
        tonumber(redis.call('ZSCORE', p .. 'rtp:' .. url, t) or '0')}
"""


# Take entries while a bound is exceeded, in one round trip. ARGV: prefix, kind, replica
# url, tenant, bound, limit, now (Unix seconds), spare (a key never taken: the handle an
# extend's put just stored; '' for none). Kinds, and whose entry goes:
#   count       all entries > bound: the tenant with the most entries, its oldest
#   pin         blocks on the replica > bound: the tenant pinning the most there
#   tenant      the tenant's entries > bound: the tenant's oldest
#   tenantpin   the tenant's blocks on the replica > bound: the tenant's, on that replica
# The two block bounds take, of the tenant's keys on the replica, the one overdue longest,
# else the one expected back last. An empty victim index (entries stored before these
# indexes) falls back to the tenant's oldest there, then the oldest overall, or on the
# replica.
TRIM = _UNINDEX + """
local p, kind, url, t = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local bound, limit, now = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local spare = ARGV[8] or ''
local function score(z, m) return tonumber(redis.call('ZSCORE', z, m) or '0') end
-- The first of a sorted set's two ends other than the spared key: its member and score.
local function first(z, rev)
  local top = redis.call(rev and 'ZREVRANGE' or 'ZRANGE', z, 0, 1, 'WITHSCORES')
  if top[1] == spare then return top[3], top[4] end
  return top[1], top[2]
end
local function heaviest(z)
  local top = redis.call('ZREVRANGE', z, 0, 0)
  return top[1] or ''
end
local function over()
  if kind == 'pin' then return tonumber(redis.call('HGET', p .. 'pin', url) or '0') > bound end
  if kind == 'count' then return redis.call('ZCARD', p .. 'order') > bound end
  if kind == 'tenant' then return score(p .. 'tcount', t) > bound end
  return score(p .. 'rtp:' .. url, t) > bound
end
local function victim_index()
  if kind == 'count' then return 'ten:' .. heaviest(p .. 'tcount'), 'order' end
  if kind == 'pin' then
    return 'rt:' .. url .. '|' .. heaviest(p .. 'rtp:' .. url), 'rep:' .. url
  end
  if kind == 'tenant' then return 'ten:' .. t, nil end
  return 'rt:' .. url .. '|' .. t, nil
end
-- Of one tenant's keys on a replica (`rt` index): the one overdue longest, else the one
-- expected back last; nil when the value indexes hold none. A key the `rt` index does
-- not hold (a router of an older release removed it, or stored it elsewhere since) is
-- taken out of both value indexes and passed over.
local function by_value(index)
  local rt = string.sub(index, 4)
  local due_z, back_z = p .. 'rto:' .. rt, p .. 'rte:' .. rt
  for _ = 1, 64 do
    local k, z
    local due, due_at = first(due_z)
    if due and tonumber(due_at) < now then
      k, z = due, 'rto:' .. rt
    else
      k = first(back_z, true)
      if not k then return nil end
      z = 'rte:' .. rt
    end
    if redis.call('ZSCORE', p .. index, k) then return k, z end
    redis.call('ZREM', due_z, k)
    redis.call('ZREM', back_z, k)
  end
  return nil
end
local out = {}
for _ = 1, limit do
  if not over() then break end
  local index, fallback = victim_index()
  local m = {}
  if kind == 'pin' or kind == 'tenantpin' then
    local k, valued = by_value(index)
    if k then m, index = {k}, valued end
  end
  if #m == 0 then m = {first(p .. index)} end
  if #m == 0 and fallback then
    index = fallback
    m = {first(p .. index)}
  end
  if #m == 0 then break end
  local k = m[1]
  local v = redis.call('GET', p .. 'h:' .. k)
  unindex(p, k, v)
  redis.call('ZREM', p .. index, k)
  if v then
    redis.call('DEL', p .. 'h:' .. k)
    out[#out + 1] = v
  end
end
return out
"""
