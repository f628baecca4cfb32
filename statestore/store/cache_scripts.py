"""The Lua scripts the Redis history cache runs (store/redis_cache.py): each writes an entry's keys atomically, and
drops them rather than leave a count that describes bytes it does not match."""

from __future__ import annotations

from statestore.store.resp import Script

# Both scripts run their writes with pcall and, if any fails (OOM, WRONGTYPE, a bad TTL), delete the
# thread's keys before returning the error: a half-applied write could leave a count that matches
# bytes it does not describe, and that would be served as valid. DEL is allowed even under OOM.
_APPLY_OR_DROP = """
local function apply_or_drop(steps)
  for _, step in ipairs(steps) do
    local reply = redis.pcall(unpack(step))
    if type(reply) == 'table' and reply.err then
      redis.call('DEL', KEYS[1], KEYS[2])
      return reply
    end
  end
  return 1
end
"""

# KEYS: joined, count. ARGV: joined bytes, count, ttl ms.
_PUT_LUA = (
    _APPLY_OR_DROP
    + """
return apply_or_drop({
  {'SET', KEYS[1], ARGV[1], 'PX', ARGV[3]},
  {'SET', KEYS[2], ARGV[2], 'PX', ARGV[3]},
})
"""
)

# KEYS: joined, count. ARGV: expected count, new count, ttl ms, bytes to append (separator included).
# The count is compared as the decimal string we wrote; pcall turns a wrong-typed key into a mismatch.
_APPEND_LUA = (
    _APPLY_OR_DROP
    + """
if redis.pcall('GET', KEYS[2]) ~= ARGV[1] or redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[1], KEYS[2])
  return 0
end
return apply_or_drop({
  {'APPEND', KEYS[1], ARGV[4]},
  {'SET', KEYS[2], ARGV[2], 'PX', ARGV[3]},
  {'PEXPIRE', KEYS[1], ARGV[3]},
})
"""
)

# A commit's row and claim (a thread's: store/thread_claims.py; a chain head's row: store/response_heads.py; the row's
# stored form: store/redis_rows.py), settled by the same script as its history. KEYS[3]: the row, KEYS[4]: the claim.
# The row is kept only when the history was written; the claim is freed only by its holder.
_SETTLE = """
local function keep_row(row, ttl)
  if row ~= '' then
    local reply = redis.pcall('SET', KEYS[3], row, 'PX', ttl)
    if type(reply) == 'table' and reply.err then redis.call('DEL', KEYS[3]) end
  end
end
local function free_claim(token)
  if token ~= '' and redis.call('GET', KEYS[4]) == token then redis.call('DEL', KEYS[4]) end
end
"""

# The append of a settling script (after its checks): ARGV[2] the new count, ARGV[3] the ttl, ARGV[4] the bytes, ARGV[5]
# the row, kept when the history was appended to.
_APPEND_KEEPING_ROW = """
local done = apply_or_drop({
  {'APPEND', KEYS[1], ARGV[4]},
  {'SET', KEYS[2], ARGV[2], 'PX', ARGV[3]},
  {'PEXPIRE', KEYS[1], ARGV[3]},
})
if done == 1 then keep_row(ARGV[5], ARGV[3]) else redis.call('DEL', KEYS[3]) end
"""

# KEYS: joined, count, row, claim. ARGV: joined bytes, count, ttl ms, row, claim token ('' for none).
_PUT_SETTLE_LUA = (
    _APPLY_OR_DROP
    + _SETTLE
    + """
local done = apply_or_drop({
  {'SET', KEYS[1], ARGV[1], 'PX', ARGV[3]},
  {'SET', KEYS[2], ARGV[2], 'PX', ARGV[3]},
})
if done == 1 then keep_row(ARGV[4], ARGV[3]) else redis.call('DEL', KEYS[3]) end
free_claim(ARGV[5])
return done
"""
)

# KEYS: joined, count, row, claim. ARGV: expected count, new count, ttl ms, bytes to append, row, claim token.
_APPEND_SETTLE_LUA = (
    _APPLY_OR_DROP
    + _SETTLE
    + """
if redis.pcall('GET', KEYS[2]) ~= ARGV[1] or redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
  free_claim(ARGV[6])
  return 0
end
"""
    + _APPEND_KEEPING_ROW
    + """
free_claim(ARGV[6])
return done
"""
)

# A chain head moving on, with the new head's row ('' for none: store/response_heads.py). KEYS: new joined, new count,
# new row, old joined, old count, old row. ARGV: expected count, new count, ttl ms, bytes to append, row. The old head's
# row goes with its context (one row per cached head); the new one is kept only when the context moved whole.
# Standalone Redis only: the old and new keys are under different hash tags, so in different Cluster slots.
_MOVE_LUA = (
    _APPLY_OR_DROP
    + _SETTLE
    + """
if redis.pcall('GET', KEYS[5]) ~= ARGV[1] or redis.call('EXISTS', KEYS[4]) == 0 then
  redis.call('DEL', KEYS[4], KEYS[5], KEYS[6])
  return 0
end
redis.call('RENAME', KEYS[4], KEYS[1])
redis.call('DEL', KEYS[5], KEYS[6])
"""
    + _APPEND_KEEPING_ROW
    + """
return done
"""
)

PUT = Script(_PUT_LUA)
APPEND = Script(_APPEND_LUA)
PUT_SETTLE = Script(_PUT_SETTLE_LUA)
APPEND_SETTLE = Script(_APPEND_SETTLE_LUA)
MOVE = Script(_MOVE_LUA)
