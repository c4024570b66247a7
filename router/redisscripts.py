"""The shared store's atomic steps, as Lua run by the Redis-protocol server (one round trip
each, no other client sees a half-done step). Keys, under the store's prefix: `h:<key>`
the entry (JSON), `order` all keys by store time, `rep:<decode url>` a replica's keys by
store time, `pin` blocks pinned per replica, `len:<tenant>` keys by prompt length."""

# Remove one entry and return it. KEYS: entry, order; ARGV: key, prefix.
TAKE = """
local v = redis.call('GET', KEYS[1])
if not v then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return false
end
local e = cjson.decode(v)
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', ARGV[2] .. 'rep:' .. e['decode_url'], ARGV[1])
redis.call('HINCRBY', ARGV[2] .. 'pin', e['decode_url'], -(e['blocks'] or 0))
if e['tenant'] then redis.call('ZREM', ARGV[2] .. 'len:' .. e['tenant'], ARGV[1]) end
return v
"""

# Store an entry, replacing (or, with ARGV[6] == "1", keeping) an existing one. KEYS: entry,
# order; ARGV: key, entry JSON, store time, TTL ms, prefix, keep-existing.
PUT = """
local old = redis.call('GET', KEYS[1])
if old then
  local o = cjson.decode(old)
  redis.call('ZREM', ARGV[5] .. 'rep:' .. o['decode_url'], ARGV[1])
  redis.call('HINCRBY', ARGV[5] .. 'pin', o['decode_url'], -(o['blocks'] or 0))
  if o['tenant'] then redis.call('ZREM', ARGV[5] .. 'len:' .. o['tenant'], ARGV[1]) end
end
if ARGV[6] == '1' and old then return {old, 0, 0} end
local e = cjson.decode(ARGV[2])
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
redis.call('ZADD', ARGV[5] .. 'rep:' .. e['decode_url'], ARGV[3], ARGV[1])
redis.call('HINCRBY', ARGV[5] .. 'pin', e['decode_url'], e['blocks'] or 0)
if e['tenant'] then
  redis.call('ZADD', ARGV[5] .. 'len:' .. e['tenant'], e['prefix_len'], ARGV[1])
end
-- What the caller checks its bounds against, in the same round trip.
return {old, redis.call('ZCARD', KEYS[2]),
        tonumber(redis.call('HGET', ARGV[5] .. 'pin', e['decode_url']))}
"""


# Take the oldest entries of one index (a replica's, or `order` for the LRU bound) while
# a bound is exceeded, in one round trip. ARGV: prefix, index suffix, kind ('pin' with
# the replica url and the most blocks, or 'count' with the most entries), bound, limit.
TRIM = """
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
  redis.call('ZREM', p .. 'order', k)
  if v then
    local e = cjson.decode(v)
    redis.call('DEL', p .. 'h:' .. k)
    redis.call('ZREM', p .. 'rep:' .. e['decode_url'], k)
    redis.call('HINCRBY', p .. 'pin', e['decode_url'], -(e['blocks'] or 0))
    if e['tenant'] then redis.call('ZREM', p .. 'len:' .. e['tenant'], k) end
    out[#out + 1] = v
  end
end
return out
"""
