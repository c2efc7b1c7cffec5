//! The Lua scripts of the quota draws. Each reads the values it finds
//! with types and bounds and repairs what is malformed in its own key
//! (issue 51 #3: Redis content is input).

/// The start of a draw script: `get(key)` reads a string value, deleting
/// one of another type (and noting the repair in `fixed`); the op record
/// (KEYS[2]) answers a draw sent again, unless it does not decode.
macro_rules! checked_reads {
    () => {
        r"
local fixed = 0
local function get(k)
  local v = redis.pcall('GET', k)
  if type(v) == 'table' then redis.call('DEL', k); fixed = 1; return false end
  return v
end
local done = get(KEYS[2])
if done then
  local ok, r = pcall(cjson.decode, done)
  if ok and type(r) == 'table' then return r end
  fixed = 1
end
"
    };
}

/// Weighted GCRA draw. KEYS[1] the state, KEYS[2] the op record. ARGV:
/// charge (any sign: debt, or a lease given back), top-up, per minute,
/// burst. Returns {granted top-up, requests left, µs until one fits}.
pub(super) const REQUESTS_SCRIPT: &str = concat!(
    checked_reads!(),
    r"local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = 60000000 / tonumber(ARGV[3])
local cap = interval * tonumber(ARGV[4])
local tat = tonumber(get(KEYS[1]) or '0')
if tat == nil or tat ~= tat or tat < 0 or tat > now + cap + 86400000000 then
  tat = now; fixed = 1
end
if tat < now then tat = now end
tat = tat + tonumber(ARGV[1]) * interval
if tat < now then tat = now end
local top = tonumber(ARGV[2])
local fit = math.floor((now + cap - tat) / interval)
if fit < 0 then fit = 0 end
if top > fit then top = fit end
tat = tat + top * interval
redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.floor((tat - now) / 1000) + 60000)
local left = math.floor((now + cap - tat) / interval)
local wait = 0
if left < 1 then
  left = 0
  wait = math.ceil(tat + interval - cap - now)
end
local r = {top, left, wait, fixed}
redis.call('SET', KEYS[2], cjson.encode(r), 'EX', 120)
return r
"
);

/// Daily token draw. KEYS[1] the day's counter, KEYS[2] the op record,
/// KEYS[3] the generation. ARGV: charge (any sign), top-up, limit, expiry
/// (unix s), the generation this router contributed to. Returns {granted
/// top-up, tokens left}, or {-1} when the generation changed (Redis
/// restarted empty: contribute first).
pub(super) const TOKENS_SCRIPT: &str = concat!(
    checked_reads!(),
    r"if get(KEYS[3]) ~= ARGV[5] then return {-1} end
local used = tonumber(get(KEYS[1]) or '0')
if used == nil or used ~= used or used < 0 or used > 1e15 then used = 0; fixed = 1 end
used = used + tonumber(ARGV[1])
if used < 0 then used = 0 end
local limit = tonumber(ARGV[3])
local top = tonumber(ARGV[2])
local room = limit - used
if room < 0 then room = 0 end
if top > room then top = room end
used = used + top
redis.call('SET', KEYS[1], string.format('%.0f', used), 'EXAT', ARGV[4])
local left = limit - used
if left < 0 then left = 0 end
local r = {top, left, fixed}
redis.call('SET', KEYS[2], cjson.encode(r), 'EX', 120)
return r
"
);

/// The generation: KEYS[1]; ARGV[1] a new one, set if none. Returns it.
pub(super) const GEN_SCRIPT: &str = r"
if type(redis.pcall('GET', KEYS[1])) == 'table' then redis.call('DEL', KEYS[1]) end
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return redis.call('GET', KEYS[1])
";

/// Contribute this router's draws of today to a new generation, once.
/// KEYS[1] the generation, KEYS[2] its contributors, KEYS[3..] counters;
/// ARGV[1] the generation expected, ARGV[2] this router, ARGV[3] expiry,
/// ARGV[4..] amounts. 1: added; 0: already; -1: the generation changed.
pub(super) const CONTRIBUTE_SCRIPT: &str = r"
if redis.pcall('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if type(redis.pcall('SCARD', KEYS[2])) == 'table' then redis.call('DEL', KEYS[2]) end
if redis.call('SISMEMBER', KEYS[2], ARGV[2]) == 1 then return 0 end
for i = 3, #KEYS do
  local r = redis.pcall('INCRBY', KEYS[i], ARGV[i + 1])
  if type(r) == 'table' then redis.call('SET', KEYS[i], ARGV[i + 1]) end
  redis.call('EXPIREAT', KEYS[i], ARGV[3])
end
redis.call('SADD', KEYS[2], ARGV[2])
redis.call('EXPIRE', KEYS[2], 172800)
return 1
";
