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

/// Seeds an empty store: ARGV[1] the epoch to start from (unix
/// milliseconds: never one a router already mirrors), ARGV[2] the JSON.
/// Returns it, or -1 when the store is not empty any more.
const SEED_SCRIPT: &str = r"
if type(redis.pcall('HEXISTS', KEYS[1], 'epoch')) == 'table' then redis.call('DEL', KEYS[1]) end
if redis.call('HEXISTS', KEYS[1], 'epoch') == 1 then return -1 end
redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'data', ARGV[2])
return tonumber(ARGV[1])
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
            // seed it; the first router to do so wins, the others load it.
            let data = serde_json::to_string(&local.snapshot()).unwrap_or_default();
            let n: i64 = redis::Script::new(SEED_SCRIPT)
                .key(KEYS_HASH)
                .arg(unix_millis())
                .arg(&data)
                .invoke(c)?;
            if let Ok(e) = u64::try_from(n) {
                let mut seeded = local;
                seeded.epoch = e;
                install(router, seeded);
                tracing::info!(
                    "shared state: Redis had no key registry; seeded it from this router's"
                );
            }
        }
        _ => {}
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
