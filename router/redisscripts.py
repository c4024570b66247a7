"""The shared store's atomic steps, as Lua run by the Redis-protocol server (one round trip
each, no other client sees a half-done step). Keys, under the store's prefix: `h:<key>`
the entry (JSON), `order` all keys by store time, `rep:<decode url>` a replica's keys by
store time, `pin` blocks pinned per replica, `len:<tenant>` keys by prompt length, and
`meta` key -> what the indexes hold for it (decode url, blocks, tenant), kept without a
TTL: when the server itself expires an `h:` key (its safety TTL, once no router swept for
a minute), the next step that meets the key still takes it out of every index and the
`pin` count, instead of leaving blocks pinned that no entry holds."""

# Every script below takes an entry out of the indexes through this, from its JSON or,
# once the server expired it, from `meta`.
_UNINDEX = """
local function unindex(p, k, v)
  local url, blocks, tenant
  if v then
    local e = cjson.decode(v)
    url, blocks, tenant = e['decode_url'], e['blocks'] or 0, e['tenant']
  else
    local m = redis.call('HGET', p .. 'meta', k)
    if not m then return end
    local e = cjson.decode(m)
    url, blocks, tenant = e[1], e[2], e[3]
  end
  redis.call('ZREM', p .. 'order', k)
  redis.call('ZREM', p .. 'rep:' .. url, k)
  redis.call('HINCRBY', p .. 'pin', url, -blocks)
  if tenant and tenant ~= '' then redis.call('ZREM', p .. 'len:' .. tenant, k) end
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
# order; ARGV: key, entry JSON, store time, TTL ms, prefix, keep-existing.
PUT = _UNINDEX + """
local old = redis.call('GET', KEYS[1])
if ARGV[6] == '1' and old then return {old, 0, 0} end
unindex(ARGV[5], ARGV[1], old)
local e = cjson.decode(ARGV[2])
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
redis.call('ZADD', ARGV[5] .. 'rep:' .. e['decode_url'], ARGV[3], ARGV[1])
redis.call('HINCRBY', ARGV[5] .. 'pin', e['decode_url'], e['blocks'] or 0)
if e['tenant'] then
  redis.call('ZADD', ARGV[5] .. 'len:' .. e['tenant'], e['prefix_len'], ARGV[1])
end
redis.call('HSET', ARGV[5] .. 'meta', ARGV[1],
           cjson.encode({e['decode_url'], e['blocks'] or 0, e['tenant'] or ''}))
-- What the caller checks its bounds against, in the same round trip.
return {old, redis.call('ZCARD', KEYS[2]),
        tonumber(redis.call('HGET', ARGV[5] .. 'pin', e['decode_url']))}
"""


# Take the oldest entries of one index (a replica's, or `order` for the LRU bound) while
# a bound is exceeded, in one round trip. ARGV: prefix, index suffix, kind ('pin' with
# the replica url and the most blocks, or 'count' with the most entries), bound, limit.
TRIM = _UNINDEX + """
local p, index, kind, bound, limit = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[5]),
  tonumber(ARGV[6])
local url = ARGV[4]
local function over()
  if kind == 'pin' then
    return tonumber(redis.call('HGET', p .. 'pin', url) or '0') > bound
  end
  return redis.call('ZCARD', p .. 'order') > bound
end
local out = {}
while #out < limit and over() do
  local m = redis.call('ZRANGE', p .. index, 0, 0)
  if #m == 0 then break end
  local k = m[1]
  local v = redis.call('GET', p .. 'h:' .. k)
  redis.call('ZREM', p .. index, k)
  unindex(p, k, v)
  if v then
    redis.call('DEL', p .. 'h:' .. k)
    out[#out + 1] = v
  end
end
return out
"""
