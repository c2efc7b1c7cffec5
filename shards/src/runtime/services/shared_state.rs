//! `--shared-state redis://host:port/db`: what several routers in front of
//! one fleet share, through Redis or Valkey (issue 31). Today: the dynamic
//! key registry, and the dedup of held requests in
//! `hivenet_pending_demand`.
//!
//! One thread of its own holds the synchronous connection; shards never
//! call the network. They send it commands over a channel and await the
//! answer (an admin call), or read what it last loaded (every request).
//!
//! The registry in Redis is one hash, `hivenet:keys`, with `epoch` (a
//! generation counter) and `data` (the whole registry as
//! [`Snapshot`] JSON: key hashes, never keys). A change is an atomic
//! compare-and-set on the epoch (a Lua script): a router applies the admin
//! call to its copy, pushes the result expecting the epoch that copy came
//! from, and on a conflict reloads and applies the call again, so the
//! version rule holds across routers as on one. Every [`POLL_EVERY`] the
//! thread reads the epoch and loads the registry when it differs: a key
//! pushed to one router is in force on the others within that (plus the
//! load). Redis restarted empty is seeded back from the first router that
//! sees it so.
//!
//! Pending demand: a held request with a client ID (key and
//! `X-Client-Request-ID`) is claimed in Redis by the first router that
//! holds it (`hivenet:held:<model>:<identity>:<id>`, a [`CLAIM_TTL`]
//! lease refreshed while held); another router holding the same client
//! leaves it out of its gauge, so the sum over routers counts each client
//! once. A router that dies frees its claims within the TTL; without
//! Redis each router counts its own (over-counting, never under).
//!
//! Quotas: see [`super::shared_quota`] (leases drawn by this thread).
//!
//! While Redis is unreachable the routers keep their last copy and serve;
//! a change is refused with 503 (it could not be shared); quota-limited
//! requests follow `--shared-state-failure-mode`.
//! `hivenet_shared_state_up`, the age of the last successful sync and the
//! error count are exported.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use super::buckets::{Bucket, BucketKey, QuotaLink};
use crate::logic::routing::affinity::AffinityNote;
use crate::logic::sites::hold::DemandId;
use crate::logic::tenancy::registry::{Registry, Snapshot};
use crate::runtime::services::shared_quota::{Drawer, QUOTA_EVERY};

/// What the shared state reads and writes of its router (implemented by
/// [`crate::runtime::state::router::Router`]; a trait, so this module does not depend on
/// the router's and no import runs back up).
pub trait Host: Send + Sync + 'static {
    /// This router's name on its claims (its peer ID).
    fn name(&self) -> String;
    /// The dynamic key registry.
    fn registry(&self) -> &std::sync::Mutex<Registry>;
    /// Publish the registry's keys as the lookup snapshot.
    fn publish_registry(&self, reg: &Registry);
    /// Run `f` on the hold ledger.
    fn with_ledger<R>(&self, f: impl FnOnce(&mut crate::logic::sites::hold::Ledger) -> R) -> R;
    /// Run `f` on the quota buckets of the lookup snapshot.
    fn with_buckets<R>(
        &self,
        f: impl FnOnce(&std::collections::BTreeMap<BucketKey, Arc<Bucket>>) -> R,
    ) -> R;
    /// Whether forwards are published to the other routers
    /// (`--shared-state-affinity`).
    fn shares_affinity(&self) -> bool;
    /// Swap the forwards noted since the last round into `into` (empty).
    fn take_affinity(&self, into: &mut Vec<AffinityNote>);
    /// Record the forwards other routers made.
    fn deliver_affinity(&self, notes: Vec<AffinityNote>);
}

/// How often the thread reads the store's epoch.
pub const POLL_EVERY: Duration = Duration::from_millis(200);
/// Connect, read and write timeout of one Redis call: past it Redis counts
/// as away (fail-open or closed). A Redis merely slow (under it) is not
/// away (issue 51 #7: 1 s made a slow Redis "down" and every router spend
/// on its own limits): its leases refill late, so routers admit less,
/// never more. A slow Redis costs the sync this much, never a request.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// The registry's hash in Redis.
pub const KEYS_HASH: &str = "hivenet:keys";
/// Largest key registry read from Redis: the admin API's own limit on a
/// whole registry (`POST /admin/api-keys/replace`, 16 MiB), so what the
/// routers wrote always loads and nothing larger is ever read (issue 51
/// #11: a 36 MB registry took each router from 93 to 530 MiB).
pub const MAX_REGISTRY_BYTES: u64 = 16 << 20;

/// Unix milliseconds.
fn unix_millis() -> u64 {
    let (s, n) = crate::runtime::wire::clock::unix_nanos();
    s.saturating_mul(1000) + u64::from(n / 1_000_000)
}

/// How long a claim on a held client lives unless refreshed.
pub const CLAIM_TTL: Duration = Duration::from_secs(30);
/// How often a router refreshes its claims.
const CLAIM_REFRESH: Duration = Duration::from_secs(5);
/// How often a router retries a client another router claimed (it may
/// have let go).
const FOREIGN_RETRY: Duration = Duration::from_secs(1);

/// Claim (or refresh) a held client: KEYS[1] its key, ARGV[1] this
/// router, ARGV[2] the TTL in ms. 1: ours; 0: another router's.
const CLAIM_SCRIPT: &str = r"
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
if not v then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
return 0
";

/// Let go of a claim if it is still ours.
const RELEASE_SCRIPT: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
";

/// This router's claims on held clients: (ours, when last claimed or
/// tried).
#[derive(Default)]
struct Claims {
    held: std::collections::HashMap<DemandId, (bool, std::time::Instant)>,
}

fn claim_key(id: &DemandId) -> String {
    use xxhash_rust::xxh64::xxh64;
    format!(
        "hivenet:held:{:016x}:{:016x}:{:032x}",
        xxh64(id.0.as_bytes(), 0),
        xxh64(id.1.as_bytes(), 0),
        id.2
    )
}

/// Bring the claims in line with the requests held here now, and tell the
/// ledger which clients other routers count.
fn demand_cycle(
    c: &mut redis::Connection,
    router: &impl Host,
    me: &str,
    claims: &mut Claims,
) -> redis::RedisResult<()> {
    let now_ids = router.with_ledger(|l| l.demanded_ids());
    let now = std::time::Instant::now();
    let gone: Vec<DemandId> = claims
        .held
        .keys()
        .filter(|k| !now_ids.contains(*k))
        .cloned()
        .collect();
    for k in gone {
        if let Some((true, _)) = claims.held.remove(&k) {
            let _: i64 = redis::Script::new(RELEASE_SCRIPT)
                .key(claim_key(&k))
                .arg(me)
                .invoke(c)?;
        }
    }
    let ttl_ms = CLAIM_TTL.as_millis() as u64;
    for k in now_ids {
        let due = match claims.held.get(&k) {
            Some((true, t)) => now.saturating_duration_since(*t) >= CLAIM_REFRESH,
            Some((false, t)) => now.saturating_duration_since(*t) >= FOREIGN_RETRY,
            None => true,
        };
        if due {
            let ours: i64 = redis::Script::new(CLAIM_SCRIPT)
                .key(claim_key(&k))
                .arg(me)
                .arg(ttl_ms)
                .invoke(c)?;
            claims.held.insert(k, (ours == 1, now));
        }
    }
    let foreign = claims
        .held
        .iter()
        .filter(|(_, (ours, _))| !ours)
        .map(|(k, _)| k.clone())
        .collect();
    router.with_ledger(|l| l.set_foreign(foreign));
    Ok(())
}

/// Why a push did not land.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PushError {
    /// Another router changed the registry first (the thread has loaded
    /// it: apply the call again).
    Conflict,
    /// Redis could not be reached or answered an error.
    Down(String),
}

enum Cmd {
    PushKeys {
        epoch: u64,
        data: String,
        reply: futures::channel::oneshot::Sender<Result<u64, PushError>>,
    },
    /// A Responses API conversation operation (issue 52).
    Responses(conversations::Op),
}

/// The shards' side of the shared state.
pub struct SharedState {
    tx: mpsc::Sender<Cmd>,
    /// Where, with any password hidden (for logs).
    pub shown: String,
    /// Whether the last call to Redis succeeded (in the link the quota
    /// buckets read), the failure mode and its counters.
    pub link: Arc<QuotaLink>,
    /// Unix milliseconds of the last successful sync (0: never).
    pub last_sync_ms: AtomicU64,
    /// Failed calls to Redis.
    pub errors: AtomicU64,
    /// Affinity notes published to and received from the other routers
    /// (`--shared-state-affinity`).
    pub affinity_notes: (AtomicU64, AtomicU64),
    /// This process's nonce in its presence mark (identity collisions).
    boot: String,
}

/// The thread's side, until it starts.
pub struct Pending {
    rx: mpsc::Receiver<Cmd>,
    client: redis::Client,
}

impl SharedState {
    /// Validate `url` (`redis://` or `rediss://`, `[[user]:password@]host
    /// [:port][/db]`); `ca_pem`: the roots a `rediss://` server's
    /// certificate must chain to (None: the system's). Nothing is dialed
    /// before [`SharedState::start`].
    pub fn new(
        url: &str,
        fail_closed: bool,
        ca_pem: Option<Vec<u8>>,
    ) -> Result<(Arc<Self>, Pending), String> {
        let url = url.trim();
        let tls = url.starts_with("rediss://");
        if !tls && !url.starts_with("redis://") {
            return Err(format!(
                "--shared-state: {:?} is not a redis:// or rediss:// URL",
                shown(url)
            ));
        }
        if url.contains("#insecure") {
            return Err("--shared-state: #insecure (no certificate check) is not supported; give the server's CA with --shared-state-ca-file".into());
        }
        let client = match (tls, ca_pem) {
            (false, Some(_)) => {
                return Err("--shared-state-ca-file is for rediss:// URLs".into());
            }
            (false, None) => redis::Client::open(url),
            (true, root_cert) => {
                // The process's rustls provider: ring, as for providers
                // (already installed is fine).
                let _ = rustls::crypto::ring::default_provider().install_default();
                match root_cert {
                    Some(pem) => redis::Client::build_with_tls(
                        url,
                        redis::TlsCertificates {
                            client_tls: None,
                            root_cert: Some(pem),
                        },
                    ),
                    None => redis::Client::open(url),
                }
            }
        }
        .map_err(|e| format!("--shared-state: {}: {e}", shown(url)))?;
        let (tx, rx) = mpsc::channel();
        let me = Arc::new(SharedState {
            tx,
            shown: shown(url),
            link: Arc::new(QuotaLink {
                fail_closed,
                ..QuotaLink::default()
            }),
            last_sync_ms: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            affinity_notes: (AtomicU64::new(0), AtomicU64::new(0)),
            boot: format!("{:016x}", rand::random::<u64>()),
        });
        Ok((me, Pending { rx, client }))
    }

    /// Check credentials, database, scheme, eviction policy and identity
    /// before the router serves, as router `me` (issue 51 #8).
    pub fn preflight(
        &self,
        pending: &Pending,
        me: &str,
    ) -> Result<preflight::Preflight, preflight::PreflightError> {
        preflight::check(&pending.client, me, &self.boot)
    }

    /// Start the thread that talks to Redis for `router`.
    pub fn start<H: Host>(
        self: &Arc<Self>,
        pending: Pending,
        router: Arc<H>,
    ) -> Result<(), String> {
        let me = self.clone();
        std::thread::Builder::new()
            .name("shared-state".into())
            .spawn(move || me.run(pending, &*router))
            .map(|_| ())
            .map_err(|e| format!("cannot start the shared-state thread: {e}"))
    }

    /// Push the registry `data` built on the copy of `epoch`; the new
    /// epoch when it landed.
    pub async fn push_keys(&self, epoch: u64, data: String) -> Result<u64, PushError> {
        let (reply, rx) = futures::channel::oneshot::channel();
        self.tx
            .send(Cmd::PushKeys { epoch, data, reply })
            .map_err(|_| PushError::Down("the shared-state thread is gone".into()))?;
        rx.await.unwrap_or_else(|_| {
            Err(PushError::Down(
                "no answer from the shared-state thread".into(),
            ))
        })
    }

    /// Hand a conversation operation to the thread (an op it cannot
    /// carry out is answered "not here").
    pub fn responses(&self, op: conversations::Op) {
        if let Err(mpsc::SendError(Cmd::Responses(op))) = self.tx.send(Cmd::Responses(op)) {
            op.unavailable();
        }
    }

    /// Seconds since the last successful sync (None: never).
    pub fn sync_age_secs(&self, now_ms: u64) -> Option<f64> {
        match self.last_sync_ms.load(Ordering::Relaxed) {
            0 => None,
            t => Some(now_ms.saturating_sub(t) as f64 / 1000.0),
        }
    }

    fn run(&self, p: Pending, router: &impl Host) {
        let me = router.name();
        let mut claims = Claims::default();
        let mut drawer = Drawer::new(me.clone());
        let mut share = crate::runtime::services::shared_affinity::Share::new(me.clone());
        let mut conn: Option<redis::Connection> = None;
        let mut logged_down = false;
        let mut content_log = crate::logic::system::log_gate::LogGate::default();
        let mut collision_log = crate::logic::system::log_gate::LogGate::default();
        // The registry epoch whose data did not load: not read again.
        let mut bad_epoch: Option<u64> = None;
        // Since when this router offers its registry to an empty store.
        let mut seeding: Option<std::time::Instant> = None;
        let mut synced_at: Option<std::time::Instant> = None;
        let mut first = true;
        loop {
            // Quota leases in use are topped up every QUOTA_EVERY (a round
            // without buckets in use calls nothing); the rest (key epoch,
            // held claims) every POLL_EVERY. The first round dials at once.
            let wait = if first { Duration::ZERO } else { QUOTA_EVERY };
            first = false;
            let cmd = match p.rx.recv_timeout(wait) {
                Ok(c) => Some(c),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            };
            if conn.is_none() {
                match connect(&p.client).and_then(|mut c| drawer.connected(&mut c).map(|()| c)) {
                    Ok(c) => {
                        share.connected();
                        tracing::info!(redis = %self.shown, "shared state: connected");
                        logged_down = false;
                        conn = Some(c);
                        synced_at = None;
                    }
                    Err(e) => {
                        claims.held.clear();
                        router.with_ledger(|l| l.set_foreign(Default::default()));
                        self.failed(&mut logged_down, &e);
                    }
                }
            }
            let Some(c) = conn.as_mut() else {
                match cmd {
                    Some(Cmd::PushKeys { reply, .. }) => {
                        let _ = reply.send(Err(PushError::Down(format!(
                            "Redis at {} is unreachable",
                            self.shown
                        ))));
                    }
                    Some(Cmd::Responses(op)) => op.unavailable(),
                    None => {}
                }
                continue;
            };
            let due = synced_at.is_none_or(|t| t.elapsed() >= POLL_EVERY);
            let step = match cmd {
                Some(Cmd::PushKeys { epoch, data, reply }) => {
                    let r = push(c, epoch, &data);
                    let answer = match &r {
                        Ok(Some(e)) => Ok(*e),
                        // Loaded below before the caller applies again.
                        Ok(None) => Err(PushError::Conflict),
                        Err(e) => Err(PushError::Down(e.to_string())),
                    };
                    let synced = r.map(|_| ()).and_then(|()| {
                        isolated(
                            sync(c, router, &mut bad_epoch, &mut seeding),
                            "key registry",
                            &mut content_log,
                        )
                    });
                    let _ = reply.send(answer);
                    synced
                }
                Some(Cmd::Responses(op)) => isolated(
                    conversations::carry_out(c, op),
                    "responses",
                    &mut content_log,
                ),
                None if due => isolated(
                    sync(c, router, &mut bad_epoch, &mut seeding),
                    "key registry",
                    &mut content_log,
                ),
                None => Ok(()),
            };
            let step = step.and_then(|()| {
                if due {
                    synced_at = Some(std::time::Instant::now());
                    self.mark_presence(c, &me, &mut collision_log)?;
                    let demand = demand_cycle(c, router, &me, &mut claims);
                    isolated(demand, "held demand", &mut content_log)?;
                    isolated(
                        drawer.check_generation(c),
                        "quota generation",
                        &mut content_log,
                    )?;
                }
                let drawn = router.with_buckets(|buckets| {
                    drawer.cycle(
                        c,
                        &self.link,
                        buckets,
                        crate::runtime::wire::clock::mono_ns(),
                        crate::runtime::wire::clock::unix_secs(),
                    )
                });
                if drawn.as_ref().is_err_and(content_error) {
                    // Never sent again forever: the round's draws go.
                    drawer.drop_pending();
                }
                isolated(drawn, "quota draws", &mut content_log)?;
                if !router.shares_affinity() {
                    return Ok(());
                }
                // Hints never touch quotas: their errors stay theirs.
                let shared = share.cycle(
                    c,
                    |buf| router.take_affinity(buf),
                    |notes| router.deliver_affinity(notes),
                    &self.affinity_notes,
                );
                isolated(shared, "affinity hints", &mut content_log)
            });
            match step {
                Ok(()) => {
                    self.link.up.store(true, Ordering::Relaxed);
                    self.last_sync_ms.store(unix_millis(), Ordering::Relaxed);
                }
                Err(e) => {
                    conn = None;
                    // Nobody to dedup with: count every client here
                    // (over, never under); claim again when it returns.
                    claims.held.clear();
                    router.with_ledger(|l| l.set_foreign(Default::default()));
                    self.failed(&mut logged_down, &e);
                }
            }
        }
    }

    /// Refresh this router's presence mark; another process's nonce in it
    /// is a second router with this identity (logged as an error once a
    /// second; its contributions merge with ours).
    fn mark_presence(
        &self,
        c: &mut redis::Connection,
        me: &str,
        gate: &mut crate::logic::system::log_gate::LogGate,
    ) -> redis::RedisResult<()> {
        let old: Option<String> = redis::cmd("SET")
            .arg(preflight::presence_key(me))
            .arg(&self.boot)
            .arg("PX")
            .arg(preflight::PRESENCE_TTL_MS)
            .arg("GET")
            .query(c)
            .or_else(|e| {
                // Only Redis away stops the round; an older Redis without
                // SET ... GET only loses this check.
                if e.is_io_error() || e.is_timeout() {
                    Err(e)
                } else {
                    Ok(None)
                }
            })?;
        if old.is_some_and(|o| o != self.boot) {
            if let Some(n) = gate.hit(std::time::Instant::now(), Duration::from_secs(1)) {
                tracing::error!(router = me, seen = n, "shared state: another router with this identity is live on the same Redis (its quota contributions and held demand merge with this one's): give each router its own --identity-path");
            }
        }
        Ok(())
    }

    fn failed(&self, logged: &mut bool, e: &redis::RedisError) {
        self.link.up.store(false, Ordering::Relaxed);
        self.errors.fetch_add(1, Ordering::Relaxed);
        if !*logged {
            let quotas = if self.link.fail_closed {
                "quota-limited keys refused (429, --shared-state-failure-mode closed)"
            } else {
                "quotas on local limits, the usage charged when it returns (--shared-state-failure-mode open)"
            };
            tracing::warn!(redis = %self.shown, "shared state unreachable: {e}; serving with the last copy, key changes refused until it returns, {quotas}");
            *logged = true;
        }
        // No tight loop against a Redis that refuses at once.
        std::thread::sleep(POLL_EVERY);
    }
}

pub mod conversations;
pub mod preflight;
mod registry_sync;
pub use registry_sync::content_error;
use registry_sync::{isolated, push, sync};

fn connect(client: &redis::Client) -> redis::RedisResult<redis::Connection> {
    let c = client.get_connection_with_timeout(CALL_TIMEOUT)?;
    c.set_read_timeout(Some(CALL_TIMEOUT))?;
    c.set_write_timeout(Some(CALL_TIMEOUT))?;
    Ok(c)
}

/// `url` with its password replaced by `***`.
fn shown(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s + 3 => {
            format!(
                "{}***{}",
                url.get(..s + 3).unwrap_or(""),
                url.get(at..).unwrap_or("")
            )
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_and_passwords_hidden() {
        assert_eq!(shown("redis://:s3cret@h:6379/0"), "redis://***@h:6379/0");
        assert_eq!(shown("redis://h:6379"), "redis://h:6379");
        assert!(SharedState::new("rediss://h:6380", false, None).is_ok());
        assert!(SharedState::new("rediss://h:6380/#insecure", false, None).is_err());
        assert!(SharedState::new("redis://h:6380", false, Some(b"x".to_vec())).is_err());
        assert!(SharedState::new("http://h", false, None).is_err());
        let (s, _p) =
            SharedState::new(" redis://:pw@127.0.0.1:6379/2 ", false, None).expect("valid");
        assert_eq!(s.shown, "redis://***@127.0.0.1:6379/2");
        assert_eq!(s.sync_age_secs(5_000), None);
        s.last_sync_ms.store(3_000, Ordering::Relaxed);
        assert_eq!(s.sync_age_secs(5_000), Some(2.0));
    }
}
