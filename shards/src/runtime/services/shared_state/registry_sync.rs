//! The key registry in Redis: the compare-and-set of a key change, the
//! seeding of an empty store, and the sync that loads a newer epoch
//! (bounded, and a malformed one skipped: issue 51 #3, #11); and what
//! counts as an error of content rather than of Redis.

use std::time::Duration;

use super::{unix_millis, Host, Registry, Snapshot, KEYS_HASH, MAX_REGISTRY_BYTES};

/// Compare-and-set of the registry: KEYS[1] the hash, ARGV[1] the epoch the
/// pushed copy came from, ARGV[2] its JSON. Returns the new epoch, or -1
/// when another router changed it first.
pub(super) const CAS_SCRIPT: &str = r"
local raw = redis.pcall('HGET', KEYS[1], 'epoch')
if type(raw) == 'table' then redis.call('DEL', KEYS[1]); raw = false end
local cur = tonumber(raw or '0')
if cur == nil or cur ~= cur or cur < 0 then cur = tonumber(ARGV[1]) end
if cur ~= tonumber(ARGV[1]) then return -1 end
redis.call('HSET', KEYS[1], 'epoch', cur + 1, 'data', ARGV[2])
return cur + 1
";

/// Where routers that find the store empty offer their copies
/// (`v:<router>` its version, `d:<router>` its JSON).
const SEED_OFFERS: &str = "hivenet:keys:seed";
/// How long offers are gathered before the newest seeds the store: three
/// polls, so every live router has offered its copy.
const SEED_WAIT: Duration = Duration::from_millis(600);

/// Seeds an empty store from the newest offer (issue 51 #4: a router cut
/// off while a key was revoked must not bring it back): KEYS[1] the
/// store, KEYS[2] the offers, ARGV[1] the epoch to start from (unix
/// milliseconds). Returns {epoch or -1, router, version, every offer}.
const SEED_SCRIPT: &str = r"
if type(redis.pcall('HEXISTS', KEYS[1], 'epoch')) == 'table' then redis.call('DEL', KEYS[1]) end
if redis.call('HEXISTS', KEYS[1], 'epoch') == 1 then return {'-1', '', '', ''} end
local fields = redis.pcall('HKEYS', KEYS[2])
if type(fields) ~= 'table' or fields.err then return {'-1', '', '', ''} end
local best, bestv, all = nil, nil, {}
for _, f in ipairs(fields) do
  if string.sub(f, 1, 2) == 'v:' then
    local v = redis.call('HGET', KEYS[2], f)
    local r = string.sub(f, 3)
    table.insert(all, r .. '=' .. v)
    if bestv == nil or v > bestv then best, bestv = r, v end
  end
end
if best == nil then return {'-1', '', '', ''} end
local data = redis.call('HGET', KEYS[2], 'd:' .. best)
if not data then return {'-1', '', '', ''} end
redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'data', data)
redis.call('DEL', KEYS[2])
return {ARGV[1], best, bestv, table.concat(all, ',')}
";

/// An error caused by what a key holds (a value of another type, one
/// that does not parse), not by Redis being away: it concerns that key
/// only (issue 51 #3).
pub fn content_error(e: &redis::RedisError) -> bool {
    matches!(
        e.kind(),
        redis::ErrorKind::UnexpectedReturnType | redis::ErrorKind::Parse
    ) || e.code() == Some("WRONGTYPE")
}

/// `r`, unless its error is a [`content_error`]: then logged (at most once
/// a second per part) and the rest of the round goes on.
pub(super) fn isolated(
    r: redis::RedisResult<()>,
    what: &'static str,
    gate: &mut crate::logic::system::log_gate::LogGate,
) -> redis::RedisResult<()> {
    match r {
        Err(e) if content_error(&e) => {
            if let Some(n) = gate.hit(std::time::Instant::now(), Duration::from_secs(1)) {
                tracing::warn!(part = what, skipped = n, "shared state: a malformed value in Redis skipped ({what}: {e}); only this part is affected ({n} since the previous line)");
            }
            Ok(())
        }
        r => r,
    }
}

/// The compare-and-set; `Ok(None)`: another router was first.
pub(super) fn push(
    c: &mut redis::Connection,
    epoch: u64,
    data: &str,
) -> redis::RedisResult<Option<u64>> {
    let n: i64 = redis::Script::new(CAS_SCRIPT)
        .key(KEYS_HASH)
        .arg(epoch)
        .arg(data)
        .invoke(c)?;
    Ok(u64::try_from(n).ok())
}

/// Bring the local registry in line with the store's: load it when its
/// epoch differs; seed an empty store from a registry that has entries.
pub(super) fn sync(
    c: &mut redis::Connection,
    router: &impl Host,
    bad_epoch: &mut Option<u64>,
    seeding: &mut Option<std::time::Instant>,
) -> redis::RedisResult<()> {
    // The epoch alone each poll; the registry only when it changed. Read
    // as text and parsed here: a malformed one is a content error (the
    // local copy stays), not Redis away.
    let raw: Option<String> = redis::cmd("HGET").arg(KEYS_HASH).arg("epoch").query(c)?;
    let epoch = match raw.map(|r| r.trim().parse::<u64>()) {
        None => None,
        Some(Ok(e)) => Some(e),
        Some(Err(_)) => {
            return Err(redis::RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "the key registry's epoch is not a number",
            )))
        }
    };
    let (local_epoch, local_has) = {
        let g = match router.registry().lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        (g.epoch, g.epoch > 0 || !g.list().is_empty())
    };
    match epoch {
        Some(e) if e != local_epoch && *bad_epoch != Some(e) => {
            // Bounded (issue 51 #11): a registry larger than any router
            // could hold is not read.
            let size: u64 = redis::cmd("HSTRLEN").arg(KEYS_HASH).arg("data").query(c)?;
            if size > MAX_REGISTRY_BYTES {
                *bad_epoch = Some(e);
                return Err(redis::RedisError::from((
                    redis::ErrorKind::UnexpectedReturnType,
                    "the key registry is larger than --shared-state allows",
                    format!("{size} bytes, at most {MAX_REGISTRY_BYTES}"),
                )));
            }
            // Both fields at once: the data of exactly that epoch.
            let (epoch, data): (Option<u64>, Option<String>) = redis::cmd("HMGET")
                .arg(KEYS_HASH)
                .arg("epoch")
                .arg("data")
                .query(c)?;
            let (Some(e), Some(d)) = (epoch, data) else {
                return Ok(());
            };
            let loaded = serde_json::from_str::<Snapshot>(&d)
                .map_err(|e| e.to_string())
                .and_then(|s| Registry::from_snapshot(s, e).map_err(|e| format!("{e:?}")));
            match loaded {
                Ok(reg) => install(router, reg),
                // A store another build wrote, or damaged: keep ours, say
                // so (once a second), and do not read it again until it
                // changes.
                Err(m) => {
                    *bad_epoch = Some(e);
                    return Err(redis::RedisError::from((
                        redis::ErrorKind::UnexpectedReturnType,
                        "the key registry in Redis does not load; kept the local copy",
                        format!("epoch {e}: {m}"),
                    )));
                }
            }
        }
        None if local_has => {
            let local = match router.registry().lock() {
                Ok(g) => g.clone(),
                Err(p) => p.into_inner().clone(),
            };
            // Restarted empty (or never written by a router that has keys):
            // every live router offers its copy; after a few polls the
            // newest version seeds the store and every router loads it
            // (a stale copy never wins over a newer one still alive).
            let snap = local.snapshot();
            let me = router.name();
            let data = serde_json::to_string(&snap).unwrap_or_default();
            redis::cmd("HSET")
                .arg(SEED_OFFERS)
                .arg(format!("v:{me}"))
                .arg(&snap.version)
                .arg(format!("d:{me}"))
                .arg(&data)
                .query::<()>(c)?;
            redis::cmd("PEXPIRE")
                .arg(SEED_OFFERS)
                .arg(10_000)
                .query::<()>(c)?;
            let since = *seeding.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() < SEED_WAIT {
                return Ok(());
            }
            *seeding = None;
            let picked: Vec<String> = redis::Script::new(SEED_SCRIPT)
                .key(KEYS_HASH)
                .key(SEED_OFFERS)
                .arg(unix_millis())
                .invoke(c)?;
            if let [epoch, from, version, offers] = picked.as_slice() {
                if epoch != "-1" {
                    tracing::warn!(
                        "shared state: Redis had no key registry; seeded it with version {version:?} offered by router {from} (the newest of the offers {offers}); every router loads it"
                    );
                }
            }
        }
        _ => *seeding = None,
    }
    Ok(())
}

fn install(router: &impl Host, reg: Registry) {
    let mut g = match router.registry().lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    };
    *g = reg;
    router.publish_registry(&g);
}
