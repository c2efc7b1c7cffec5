//! The store thread: owns the fjall database (agent history keyed by peer
//! ID). Blocking I/O and fjall's own workers stay off the shard cores.
//!
//! - Open: `--reset-disk-db` empties it first; a store that cannot be
//!   opened (corruption) is moved aside with a loud log line and a fresh
//!   one is created; if even that fails the router runs without
//!   persistence.
//! - Writes: batched per flush, each flush ends with a persist (fsync); a
//!   failed write keeps the router serving and counts a storage error, its
//!   records stay in memory and the store is reopened at the next flush
//!   (a full disk recovers without a restart).
//! - Retention: records older than `--disk-db-ttl` days read as absent and
//!   are swept at open and hourly.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode};
use shards::logic::routing::history::History;
use shards::runtime::services::store_api::StoreMsg;
use shards::runtime::wire::clock;
use tracing::{error, info, warn};

mod handover;
pub mod responses;
mod stamps;
mod upkeep;

use stamps::*;
use upkeep::{stats, sweep};

const KEYSPACE: &str = "agent_history";
/// Keyspace of the store's own records (the flush stamp).
const META: &str = "store_meta";
const FLUSH_STAMP: &[u8] = b"flush";
/// Keyspace of daily token usage: `<tenant>\0<model>` -> 8-byte big-endian
/// packed (UTC day, tokens used).
const QUOTA: &str = "quota_daily";
const SWEEP_EVERY: Duration = Duration::from_secs(3600);

/// Store settings.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// `--disk-db-path`.
    pub path: PathBuf,
    /// `--reset-disk-db`.
    pub reset: bool,
    /// `--disk-db-ttl` days (0: keep forever).
    pub ttl_days: u64,
    /// Bounds of the Responses API's conversations (issue 52).
    pub responses: responses::Bounds,
}

struct Open {
    db: Database,
    ks: Keyspace,
    meta: Keyspace,
    quota: Keyspace,
    responses: Keyspace,
}

/// A daily bucket's name and packed state, as persisted.
pub type QuotaState = ((String, String), u64);

fn quota_key(tenant: &str, model: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(tenant.len() + 1 + model.len());
    k.extend_from_slice(tenant.as_bytes());
    k.push(0);
    k.extend_from_slice(model.as_bytes());
    k
}

/// Every persisted daily bucket of `today` (older days are gone at
/// 00:00 UTC anyway).
fn load_quota(o: &Open, today: u64) -> Vec<QuotaState> {
    let mut out = Vec::new();
    for kv in o.quota.iter() {
        let Ok((k, v)) = kv.into_inner() else {
            continue;
        };
        let Ok(bytes) = <[u8; 8]>::try_from(&v[..]) else {
            continue;
        };
        let state = u64::from_be_bytes(bytes);
        if shards::logic::tenancy::quota::used_on(state, today) == 0 {
            continue;
        }
        let mut parts = k.splitn(2, |b| *b == 0);
        let (Some(t), Some(m)) = (parts.next(), parts.next()) else {
            continue;
        };
        let (Ok(t), Ok(m)) = (std::str::from_utf8(t), std::str::from_utf8(m)) else {
            continue;
        };
        out.push(((t.to_string(), m.to_string()), state));
    }
    out
}

/// Why the store could not be opened.
enum OpenError {
    /// Another process holds the store's lock: never touch its files.
    Locked,
    /// The environment refuses (permission, read-only or full filesystem):
    /// the data may be fine; never move it aside (issue 29 #6).
    Environment(std::io::ErrorKind, String),
    /// Checksums, formats, unreadable records: corruption.
    Other(String),
}

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpenError::Locked => f.write_str("locked by another process"),
            OpenError::Environment(_, e) | OpenError::Other(e) => f.write_str(e),
        }
    }
}

/// An I/O error the environment causes (not the data): permission,
/// read-only or full filesystem.
fn environmental(e: &std::io::Error) -> bool {
    use std::io::ErrorKind as K;
    matches!(
        e.kind(),
        K::PermissionDenied | K::ReadOnlyFilesystem | K::StorageFull | K::QuotaExceeded
    )
}

fn classify(e: fjall::Error) -> OpenError {
    let env_kind = match &e {
        fjall::Error::Io(io) | fjall::Error::Storage(fjall::LsmError::Io(io)) => {
            environmental(io).then(|| io.kind())
        }
        _ => None,
    };
    match (e, env_kind) {
        (fjall::Error::Locked, _) => OpenError::Locked,
        (e, Some(kind)) => OpenError::Environment(kind, e.to_string()),
        (e, None) => OpenError::Other(e.to_string()),
    }
}

/// The one line that stops the start on an environment error.
fn environment_refusal(path: &Path, kind: std::io::ErrorKind, e: &str) -> String {
    use std::io::ErrorKind as K;
    let cure = match kind {
        K::PermissionDenied => {
            "give the router's user ownership of it (chown -R <user> it) or run as its owner"
        }
        K::ReadOnlyFilesystem => {
            "mount it read-write or point --disk-db-path to a writable directory"
        }
        _ => "free space on its filesystem or point --disk-db-path elsewhere",
    };
    format!(
        "the history store {} cannot be opened ({e}); its data is left as it is: {cure}",
        path.display()
    )
}

fn try_open(path: &Path) -> Result<Open, OpenError> {
    let db = Database::builder(path).open().map_err(classify)?;
    let db_err = classify;
    let ks = db
        .keyspace(KEYSPACE, KeyspaceCreateOptions::default)
        .map_err(db_err)?;
    let meta = db
        .keyspace(META, KeyspaceCreateOptions::default)
        .map_err(db_err)?;
    let quota = db
        .keyspace(QUOTA, KeyspaceCreateOptions::default)
        .map_err(db_err)?;
    let responses = db
        .keyspace(responses::KEYSPACE, KeyspaceCreateOptions::default)
        .map_err(db_err)?;
    // Read every record once: a store whose data cannot be read is treated
    // as corrupt now rather than failing later on the request path's side.
    for kv in ks.iter() {
        kv.into_inner().map_err(db_err)?;
    }
    Ok(Open {
        db,
        ks,
        meta,
        quota,
        responses,
    })
}

fn in_use(path: &Path) -> String {
    format!(
        "the history store {} is in use by another process (another hivenet-router?); stop it or give this one its own --disk-db-path",
        path.display()
    )
}

/// Open the store: `Err` only when another process holds it (the caller
/// stops; its files are never touched); a corrupt store is moved aside and
/// a fresh one made; `Ok(None)`: no persistence at all.
fn open(cfg: &StoreConfig, errors: &AtomicU64) -> Result<Option<Open>, String> {
    if cfg.reset && cfg.path.exists() {
        // Never empty a store another router is using.
        if let Err(OpenError::Locked) = try_open(&cfg.path) {
            return Err(in_use(&cfg.path));
        }
        let _ = std::fs::remove_file(beside_stamp_file(&cfg.path));
        match std::fs::remove_dir_all(&cfg.path) {
            Ok(()) => info!(path = %cfg.path.display(), "--reset-disk-db: store emptied"),
            Err(e) => {
                error!(path = %cfg.path.display(), "--reset-disk-db: cannot remove the store: {e}")
            }
        }
    }
    match try_open(&cfg.path) {
        Ok(o) => return Ok(Some(o)),
        Err(OpenError::Locked) => return Err(in_use(&cfg.path)),
        Err(OpenError::Environment(kind, e)) => {
            return Err(environment_refusal(&cfg.path, kind, &e))
        }
        Err(e) => {
            let aside = PathBuf::from(format!(
                "{}.corrupt-{}",
                cfg.path.display(),
                clock::unix_secs()
            ));
            error!(
                path = %cfg.path.display(), moved_to = %aside.display(),
                "STORE CORRUPT: cannot open the history store ({e}); moving it aside and starting EMPTY: latency history and counters are lost"
            );
            errors.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = std::fs::rename(&cfg.path, &aside) {
                error!("cannot move the corrupt store aside: {e}");
            }
            // Already reported loudly: the fresh store starts a new count
            // (the stamp inside moved aside with the store).
            let _ = std::fs::remove_file(beside_stamp_file(&cfg.path));
        }
    }
    match try_open(&cfg.path) {
        Ok(o) => Ok(Some(o)),
        Err(OpenError::Locked) => Err(in_use(&cfg.path)),
        Err(OpenError::Environment(kind, e)) => Err(environment_refusal(&cfg.path, kind, &e)),
        Err(e) => {
            error!(path = %cfg.path.display(), "cannot create a fresh store ({e}); running WITHOUT persistence");
            errors.fetch_add(1, Ordering::Relaxed);
            Ok(None)
        }
    }
}

/// The store thread's sender, its join handle, today's token usage, and
/// the agents whose history was written lately (the ones a restarted
/// router waits for before it says it is ready).
pub type Started = (
    std::sync::mpsc::Sender<StoreMsg>,
    std::thread::JoinHandle<()>,
    Vec<QuotaState>,
    Vec<String>,
);

/// Peers whose record was written in the last `within` seconds.
fn recent_peers(o: &Open, now: u64, within: u64) -> Vec<String> {
    let mut out = Vec::new();
    for kv in o.ks.iter() {
        let Ok((k, v)) = kv.into_inner() else {
            continue;
        };
        match (std::str::from_utf8(&k), History::decode(&v)) {
            (Ok(peer), Ok(h)) if now.saturating_sub(h.written_at) <= within => {
                out.push(peer.to_string())
            }
            _ => {}
        }
    }
    out
}

/// Open the store (on the calling thread, so a store held by another
/// process stops start-up with a clear error), then start the store
/// thread; returns its sender, join handle and today's daily token usage.
pub fn start(cfg: StoreConfig, errors: Arc<AtomicU64>) -> Result<Started, String> {
    let store = open(&cfg, &errors)?;
    let today = shards::logic::tenancy::quota::day_of(clock::unix_secs());
    let restored = store
        .as_ref()
        .map(|o| load_quota(o, today))
        .unwrap_or_default();
    // A router flushes every agent's record when it stops (and
    // periodically): records of the last 3 minutes are the agents it had.
    let recent = store
        .as_ref()
        .map(|o| recent_peers(o, clock::unix_secs(), 180))
        .unwrap_or_default();
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::Builder::new()
        .name("store".into())
        .spawn(move || run(cfg, store, rx, errors))
        .map_err(|e| format!("cannot start the store thread: {e}"))?;
    Ok((tx, h, restored, recent))
}

/// What failed to reach the disk, kept in memory (the newest value per
/// key) and written again with the next flush (issue 29 #5: a disk that
/// was full must not lose what was counted meanwhile).
#[derive(Default)]
struct Unflushed {
    history: std::collections::HashMap<String, History>,
    quota: std::collections::HashMap<(String, String), u64>,
    /// When writes began to fail (Unix seconds), while they do.
    since: Option<u64>,
}

impl Unflushed {
    fn is_empty(&self) -> bool {
        self.history.is_empty() && self.quota.is_empty()
    }
}

/// Write `u` (all of it) and the flush stamp; on failure everything stays
/// in `u`. Returns the new stamp when written.
fn write_all(o: &Open, u: &mut Unflushed, seq: u64) -> Result<Stamp, fjall::Error> {
    let now = clock::unix_secs();
    let mut b = o.db.batch();
    for (peer, h) in &u.history {
        let mut h = *h;
        h.written_at = now;
        b.insert(&o.ks, peer.as_bytes(), h.encode());
    }
    for ((t, m), state) in &u.quota {
        b.insert(&o.quota, quota_key(t, m), state.to_be_bytes());
    }
    let stamp = Stamp {
        seq: seq + 1,
        unix: now,
    };
    b.insert(&o.meta, FLUSH_STAMP, stamp.encode());
    b.commit()?;
    o.db.persist(PersistMode::SyncAll)?;
    u.history.clear();
    u.quota.clear();
    Ok(stamp)
}

/// Write what is pending; after a failure, reopen the store first (a
/// poisoned fjall keyspace refuses every later write until reopened) and
/// say so; what cannot be written stays pending.
fn flush_pending(
    cfg: &StoreConfig,
    store: &mut Option<Open>,
    pending: &mut Unflushed,
    seq: &mut u64,
    errors: &AtomicU64,
) {
    if pending.is_empty() {
        return;
    }
    if pending.since.is_some() {
        // Drop the broken handle (and its lock) before opening again.
        if store.take().is_some() {
            match try_open(&cfg.path) {
                Ok(o) => {
                    info!(path = %cfg.path.display(), "history store reopened after failed writes");
                    *seq = check_stamps(&cfg.path, &o, errors).max(*seq);
                    *store = Some(o);
                }
                Err(e) => {
                    errors.fetch_add(1, Ordering::Relaxed);
                    warn!("history store still cannot be reopened ({e}); keeping {} records and {} usage buckets in memory", pending.history.len(), pending.quota.len());
                }
            }
        } else if let Ok(o) = try_open(&cfg.path) {
            *seq = check_stamps(&cfg.path, &o, errors).max(*seq);
            *store = Some(o);
        }
    }
    let Some(o) = store.as_ref() else {
        return;
    };
    match write_all(o, pending, *seq) {
        Ok(stamp) => {
            *seq = stamp.seq;
            if let Some(since) = pending.since.take() {
                info!(
                    failing_since_unix = since,
                    flush = stamp.seq,
                    "history store writes succeed again: everything kept in memory is on disk"
                );
            }
            tracing::debug!(flush = stamp.seq, "store flushed");
            if let Err(e) = write_stamp_file(&cfg.path, stamp) {
                errors.fetch_add(1, Ordering::Relaxed);
                warn!("cannot write the flush stamp file: {e}");
            }
        }
        Err(e) => {
            errors.fetch_add(1, Ordering::Relaxed);
            let since = *pending.since.get_or_insert_with(clock::unix_secs);
            error!(
                failing_since_unix = since,
                "store write failed ({e}); still serving, {} history records and {} usage buckets kept in memory until it succeeds",
                pending.history.len(),
                pending.quota.len()
            );
            mark_unflushed(&cfg.path, *seq, since);
        }
    }
}

fn run(cfg: StoreConfig, store: Option<Open>, rx: Receiver<StoreMsg>, errors: Arc<AtomicU64>) {
    let mut store = store;
    let mut pending = Unflushed::default();
    let mut seq = store
        .as_ref()
        .map(|o| check_stamps(&cfg.path, o, &errors))
        .unwrap_or(0);
    // The previous run could not write what it counted: say so at once.
    if let Some(since) = unflushed_marker(&cfg.path) {
        errors.fetch_add(1, Ordering::Relaxed);
        error!(
            path = %cfg.path.display(), failing_since_unix = since,
            "STORE BEHIND: writes failed from {since} (Unix) until the router stopped; latency history and token usage counted since then were lost"
        );
    }
    if let Some(o) = &store {
        sweep(o, cfg.ttl_days, &errors);
        info!(path = %cfg.path.display(), records = o.ks.iter().count(), ttl_days = cfg.ttl_days, "history store open");
    }
    let disk = |s: &Option<Open>| s.as_ref().map(|o| (o.db.clone(), o.responses.clone()));
    let mut conversations = responses::Conversations::open(disk(&store), cfg.responses);
    let mut last_sweep = Instant::now();
    // The expiry sweep at open is the first (Unix seconds, for the admin).
    let mut last_sweep_unix = store.as_ref().map(|_| clock::unix_secs());
    loop {
        let msg = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) => {
                if let Some(o) = &store {
                    if last_sweep.elapsed() > SWEEP_EVERY {
                        sweep(o, cfg.ttl_days, &errors);
                        conversations.sweep(clock::unix_secs(), disk(&store));
                        last_sweep = Instant::now();
                        last_sweep_unix = Some(clock::unix_secs());
                    }
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        let Some(msg) = conversations.handle(msg, clock::unix_secs(), disk(&store)) else {
            continue;
        };
        match msg {
            StoreMsg::Flush { records, done } => {
                for (peer, h) in records {
                    pending.history.insert(peer, h);
                }
                flush_pending(&cfg, &mut store, &mut pending, &mut seq, &errors);
                if let Some(d) = done {
                    let _ = d.send(());
                }
            }
            StoreMsg::QuotaFlush { states, done } => {
                for (k, state) in states {
                    pending.quota.insert(k, state);
                }
                flush_pending(&cfg, &mut store, &mut pending, &mut seq, &errors);
                if let Some(d) = done {
                    let _ = d.send(());
                }
            }
            StoreMsg::Lookup { peer_id, reply } => {
                let found = store
                    .as_ref()
                    .and_then(|o| match o.ks.get(peer_id.as_bytes()) {
                        Ok(Some(v)) => match History::decode(&v) {
                            Ok(h) if !h.expired(clock::unix_secs(), cfg.ttl_days) => Some(h),
                            Ok(_) => None,
                            Err(e) => {
                                warn!(%peer_id, "unreadable history record ignored: {e:?}");
                                None
                            }
                        },
                        Ok(None) => None,
                        Err(e) => {
                            errors.fetch_add(1, Ordering::Relaxed);
                            warn!(%peer_id, "history lookup failed: {e}");
                            None
                        }
                    });
                let _ = reply.send(found);
            }
            StoreMsg::Stats { reply } => {
                let mut s = stats(store.as_ref(), &cfg, last_sweep_unix);
                (s.responses_count, s.responses_bytes) = conversations.stats();
                let _ = reply.send(s);
            }
            StoreMsg::ResetAll { reply } => {
                let r = match &store {
                    Some(o) => {
                        o.ks.clear()
                            .and_then(|_| o.db.persist(PersistMode::SyncAll))
                            .map_err(|e| {
                                errors.fetch_add(1, Ordering::Relaxed);
                                e.to_string()
                            })
                    }
                    None => Ok(()),
                };
                let _ = reply.send(r);
            }
            StoreMsg::Release { forward, done } => {
                flush_pending(&cfg, &mut store, &mut pending, &mut seq, &errors);
                if let Some(o) = store.take() {
                    let _ = o.db.persist(PersistMode::SyncAll);
                }
                drop(std::mem::replace(
                    &mut conversations,
                    responses::Conversations::open(None, cfg.responses),
                ));
                let _ = done.send(());
                match handover::forward(&rx, forward) {
                    handover::Back::Resume(done) => {
                        let r = try_open(&cfg.path).map(|o| store = Some(o));
                        conversations = responses::Conversations::open(disk(&store), cfg.responses);
                        let _ = done.send(r.map_err(|e| e.to_string()));
                    }
                    handover::Back::Shutdown(done) => {
                        let _ = done.send(());
                        break;
                    }
                    handover::Back::Gone => break,
                }
            }
            StoreMsg::Shutdown { done } => {
                flush_pending(&cfg, &mut store, &mut pending, &mut seq, &errors);
                if !pending.is_empty() {
                    error!(
                        failing_since_unix = pending.since,
                        "STORE BEHIND at shutdown: {} history records and {} usage buckets could not be written and are lost",
                        pending.history.len(),
                        pending.quota.len()
                    );
                }
                if let Some(o) = &store {
                    if let Err(e) = o.db.persist(PersistMode::SyncAll) {
                        errors.fetch_add(1, Ordering::Relaxed);
                        error!("final persist failed: {e}");
                    }
                }
                let _ = done.send(());
                break;
            }
            // Conversations: carried out above.
            _ => {}
        }
    }
}
