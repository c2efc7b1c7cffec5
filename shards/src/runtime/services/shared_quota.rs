//! Quotas shared by several routers (`--shared-state`, issue 31): the
//! shared-state thread's side of the leases of [`crate::logic::tenancy::lease`].
//!
//! Every [`QUOTA_EVERY`] while some bucket is in use, the thread reads the
//! balances the request path spends, and sends one pipeline of draws to
//! Redis: for each bucket, its debt (charged whatever is left) and a
//! top-up back to one lease (granted as far as the global quota has room).
//!
//! - Requests per minute: one GCRA state per bucket,
//!   `hivenet:quota:requests:<tenant>:<model>`, in Redis's own clock
//!   (`TIME`), so routers' clocks never matter.
//! - Tokens per day: one counter per bucket and UTC day,
//!   `hivenet:quota:tokens:<day>:<tenant>:<model>`, expiring a day after
//!   the day ends. It counts what routers drew: their usage, true-ups and
//!   refunds go through their leases.
//!
//! Nothing counted twice: every draw carries an ID unique to this process
//! (`hivenet:quota:op:<router>:<boot>:<seq>`, kept 2 minutes with its
//! answer); a draw whose answer was lost is sent again with the same ID
//! and Redis answers what it did the first time.
//!
//! Nothing lost when Redis restarts empty: the token counters carry a
//! generation (`hivenet:quota:gen`, set by the first router that finds it
//! missing). A router that sees a generation it has not contributed to
//! adds what it drew today (its usage plus its lease) to the new counters,
//! once (a set of contributors per generation, checked in the same script).
//!
//! Usage spent while Redis was away (fail-open) is debt on the lease: the
//! first draw after Redis returns charges it.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::buckets::{Bucket, BucketKey, QuotaLink};
use crate::logic::tenancy::lease;

/// How often the thread draws while some bucket is in use.
pub const QUOTA_EVERY: Duration = Duration::from_millis(20);
/// A bucket unused this long gives its lease back.
pub const IDLE_RETURN: Duration = Duration::from_secs(30);

const GEN_KEY: &str = "hivenet:quota:gen";

mod scripts;
use scripts::{CONTRIBUTE_SCRIPT, GEN_SCRIPT, REQUESTS_SCRIPT, TOKENS_SCRIPT};

/// What one draw is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Requests { per_minute: u64, burst: u64 },
    Tokens { limit: u64, day: u64 },
}

/// One draw, kept until Redis answered it (then sent again with its ID).
struct Op {
    bucket: Arc<Bucket>,
    name: BucketKey,
    kind: Kind,
    charge: i64,
    top_up: i64,
    id: String,
    /// A lease given back by an idle bucket: forget the bucket after.
    idle: bool,
}

/// The thread's quota state.
pub struct Drawer {
    me: String,
    boot: u64,
    seq: u64,
    pending: Vec<Op>,
    /// The generation this router contributed to (None: not yet).
    gen: Option<String>,
    /// The UTC day the token leases are of.
    day: u64,
    /// Whether some bucket was in use at the last cycle (draw often).
    pub active: bool,
    /// Monotonic ns of the last draw asked of an exhausted budget.
    probed_ns: u64,
    /// Per bucket (by address): requests and tokens wanted at the last
    /// round (the pace the next top-up is sized on).
    wanted: HashMap<usize, (u64, u64)>,
    /// Values found malformed in Redis and repaired by the scripts (issue
    /// 51 #3: Redis content is input), logged once a second.
    repairs: crate::logic::system::log_gate::LogGate,
}

/// The buckets of the lookup snapshot, by name.
pub type Buckets = std::collections::BTreeMap<BucketKey, Arc<Bucket>>;

/// How often an exhausted daily budget is asked again (a refund or a
/// true-up on another router may have freed some).
const EXHAUSTED_PROBE: Duration = Duration::from_secs(1);

impl Drawer {
    /// A drawer for the router named `me`.
    pub fn new(me: String) -> Self {
        Drawer {
            me,
            boot: rand::random(),
            seq: 0,
            pending: Vec::new(),
            gen: None,
            day: 0,
            active: false,
            probed_ns: 0,
            wanted: HashMap::new(),
            repairs: Default::default(),
        }
    }

    fn requests_key(name: &BucketKey) -> String {
        format!("hivenet:quota:requests:{}:{}", name.0, name.1)
    }

    fn tokens_key(name: &BucketKey, day: u64) -> String {
        format!("hivenet:quota:tokens:{day}:{}:{}", name.0, name.1)
    }

    /// A connection was (re)made: load the scripts (pipelines send them
    /// by hash); the generation may have changed.
    pub fn connected(&mut self, c: &mut redis::Connection) -> redis::RedisResult<()> {
        self.gen = None;
        redis::Script::new(REQUESTS_SCRIPT)
            .prepare_invoke()
            .load(c)?;
        redis::Script::new(TOKENS_SCRIPT).prepare_invoke().load(c)?;
        Ok(())
    }

    /// Whether the generation is still the one this router contributed
    /// to (read every poll: an idle router learns of a Redis restarted
    /// empty too, and adds its usage back).
    pub fn check_generation(&mut self, c: &mut redis::Connection) -> redis::RedisResult<()> {
        if let Some(g) = &self.gen {
            let now: Option<String> = redis::cmd("GET").arg(GEN_KEY).query(c)?;
            if now.as_deref() != Some(g.as_str()) {
                self.gen = None;
            }
        }
        Ok(())
    }

    /// Forget the draws of a round Redis refused for its content (they
    /// are never sent again; their charges stay on the leases).
    pub fn drop_pending(&mut self) {
        self.pending.clear();
    }

    /// One cycle: contribute to a new generation if needed, then draw.
    pub fn cycle(
        &mut self,
        c: &mut redis::Connection,
        link: &QuotaLink,
        buckets: &Buckets,
        now_ns: u64,
        unix_secs: u64,
    ) -> redis::RedisResult<()> {
        let today = crate::logic::tenancy::quota::day_of(unix_secs);
        if today != self.day {
            // A new day: yesterday's token leases are of yesterday.
            for b in buckets.values() {
                b.lease.tokens.store(0, Ordering::Relaxed);
                b.lease.tokens_exhausted.store(false, Ordering::Relaxed);
                b.lease.tokens_left.store(u64::MAX, Ordering::Relaxed);
            }
            self.pending
                .retain(|o| !matches!(o.kind, Kind::Tokens { .. }));
            self.day = today;
        }
        if self.gen.is_none() {
            self.contribute(c, buckets, today)?;
        }
        // Every bucket is looked at only while some are in use, or when
        // the request path says one just started.
        if self.pending.is_empty() && (self.active || link.fresh.swap(false, Ordering::Relaxed)) {
            self.plan(buckets, now_ns, today);
        }
        if self.pending.is_empty() {
            return Ok(());
        }
        self.send(c, now_ns, today)
    }

    /// The draws every bucket in use needs now.
    fn plan(&mut self, buckets: &Buckets, now_ns: u64, today: u64) {
        let mut active = false;
        let mut wanted_now = HashMap::with_capacity(self.wanted.len());
        let probe = now_ns.saturating_sub(self.probed_ns) >= EXHAUSTED_PROBE.as_nanos() as u64;
        if probe {
            self.probed_ns = now_ns;
        }
        for (name, b) in buckets {
            let l = &b.lease;
            let last = l.last_spend.load(Ordering::Relaxed);
            if last == 0 {
                continue;
            }
            let idle = now_ns.saturating_sub(last) >= IDLE_RETURN.as_nanos() as u64;
            active |= !idle;
            let spent = (
                l.requests_wanted.load(Ordering::Relaxed),
                l.tokens_wanted.load(Ordering::Relaxed),
            );
            let before = self
                .wanted
                .get(&(Arc::as_ptr(b) as usize))
                .copied()
                .unwrap_or(spent);
            wanted_now.insert(Arc::as_ptr(b) as usize, spent);
            let pace = (
                spent.0.saturating_sub(before.0),
                spent.1.saturating_sub(before.1),
            );
            let per_minute = l.rate.load(Ordering::Relaxed);
            let burst = l.burst.load(Ordering::Relaxed);
            let limit = l.tokens_limit.load(Ordering::Relaxed);
            let mut wants: Vec<(Kind, i64, i64)> = Vec::new();
            // (charge, top-up) of one balance. Idle: the debt is charged,
            // an unspent lease given back.
            let settle = |bal: i64, base: i64, spent: u64, left: u64| {
                if idle {
                    (bal.saturating_neg(), 0)
                } else {
                    lease::draw(bal, lease::target(base, spent, left))
                }
            };
            if per_minute > 0 {
                let (charge, top) = settle(
                    l.requests.load(Ordering::Relaxed),
                    lease::request_lease(burst),
                    pace.0,
                    l.requests_left.load(Ordering::Relaxed),
                );
                if charge != 0 || top != 0 {
                    wants.push((Kind::Requests { per_minute, burst }, charge, top));
                }
            }
            if limit > 0 {
                let balance = l.tokens.load(Ordering::Relaxed);
                let (charge, top) = settle(
                    balance,
                    lease::token_lease(limit),
                    pace.1,
                    l.tokens_left.load(Ordering::Relaxed),
                );
                // A request waiting for a draw: bring what it needs (the
                // script grants no more than the quota has left).
                let reserve =
                    i64::try_from(l.tokens_reserve.swap(0, Ordering::AcqRel)).unwrap_or(i64::MAX);
                let top = top.max(reserve.saturating_sub(balance.max(0)));
                let top = if l.tokens_exhausted.load(Ordering::Relaxed) && charge == 0 && !probe {
                    // Asking an exhausted budget every 20 ms helps nobody.
                    0
                } else {
                    top
                };
                if charge != 0 || top != 0 {
                    wants.push((Kind::Tokens { limit, day: today }, charge, top));
                }
            }
            if idle && wants.is_empty() {
                let _ =
                    l.last_spend
                        .compare_exchange(last, 0, Ordering::Relaxed, Ordering::Relaxed);
            }
            for (kind, charge, top_up) in wants {
                self.seq += 1;
                self.pending.push(Op {
                    bucket: b.clone(),
                    name: name.clone(),
                    kind,
                    charge,
                    top_up,
                    id: format!(
                        "hivenet:quota:op:{}:{:016x}:{}",
                        self.me, self.boot, self.seq
                    ),
                    idle,
                });
            }
        }
        self.active = active;
        self.wanted = wanted_now;
    }

    /// Send the pending draws in one pipeline and apply the answers.
    fn send(
        &mut self,
        c: &mut redis::Connection,
        now_ns: u64,
        today: u64,
    ) -> redis::RedisResult<()> {
        let requests = redis::Script::new(REQUESTS_SCRIPT);
        let tokens = redis::Script::new(TOKENS_SCRIPT);
        let gen = self.gen.clone().unwrap_or_default();
        let expire_at = (today + 2) * 86_400;
        let mut pipe = redis::pipe();
        for op in &self.pending {
            match op.kind {
                Kind::Requests { per_minute, burst } => {
                    pipe.cmd("EVALSHA")
                        .arg(requests.get_hash())
                        .arg(2)
                        .arg(Self::requests_key(&op.name))
                        .arg(&op.id)
                        .arg(op.charge)
                        .arg(op.top_up)
                        .arg(per_minute)
                        .arg(burst);
                }
                Kind::Tokens { limit, day } => {
                    pipe.cmd("EVALSHA")
                        .arg(tokens.get_hash())
                        .arg(3)
                        .arg(Self::tokens_key(&op.name, day))
                        .arg(&op.id)
                        .arg(GEN_KEY)
                        .arg(op.charge)
                        .arg(op.top_up)
                        .arg(limit)
                        .arg(expire_at)
                        .arg(&gen);
                }
            }
        }
        let answers: Vec<Vec<i64>> = match pipe.query(c) {
            Ok(a) => a,
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                // Redis restarted (or SCRIPT FLUSH): load and send again.
                requests.prepare_invoke().load(c)?;
                tokens.prepare_invoke().load(c)?;
                pipe.query(c)?
            }
            Err(e) => return Err(e),
        };
        let mut regen = false;
        for (op, a) in std::mem::take(&mut self.pending).into_iter().zip(answers) {
            let l = &op.bucket.lease;
            let flag = match op.kind {
                Kind::Requests { .. } => a.get(3),
                Kind::Tokens { .. } => a.get(2),
            };
            if flag == Some(&1) {
                let now = std::time::Instant::now();
                if let Some(n) = self.repairs.hit(now, Duration::from_secs(1)) {
                    tracing::warn!(tenant = %op.name.0, model = %op.name.1, repaired = n,
                        "shared state: a malformed quota value in Redis was repaired (only its own bucket; {n} since the previous line)");
                }
            }
            match op.kind {
                Kind::Requests { .. } => {
                    let (granted, left, wait_us) = (
                        a.first().copied().unwrap_or(0),
                        a.get(1).copied().unwrap_or(0),
                        a.get(2).copied().unwrap_or(0),
                    );
                    l.requests.fetch_add(op.charge + granted, Ordering::AcqRel);
                    l.requests_left
                        .store(u64::try_from(left).unwrap_or(0), Ordering::Relaxed);
                    let until = match u64::try_from(wait_us) {
                        Ok(w) if w > 0 => now_ns.saturating_add(w.saturating_mul(1000)),
                        _ => 0,
                    };
                    l.requests_empty_until.store(until, Ordering::Relaxed);
                }
                Kind::Tokens { day, .. } => {
                    if a.first() == Some(&-1) && a.len() == 1 {
                        // Not applied: contribute to the new generation,
                        // then draw again.
                        regen = true;
                        continue;
                    }
                    if day != self.day {
                        continue;
                    }
                    let (granted, left) = (
                        a.first().copied().unwrap_or(0),
                        a.get(1).copied().unwrap_or(0),
                    );
                    l.tokens.fetch_add(op.charge + granted, Ordering::AcqRel);
                    l.tokens_left
                        .store(u64::try_from(left).unwrap_or(0), Ordering::Relaxed);
                    l.tokens_exhausted
                        .store(granted < op.top_up || left == 0, Ordering::Relaxed);
                }
            }
            if op.idle {
                l.last_spend.store(0, Ordering::Relaxed);
            }
        }
        if regen {
            self.gen = None;
        }
        Ok(())
    }

    /// Join the current generation; when this router has not contributed
    /// to it yet, add what it drew today to its counters first.
    fn contribute(
        &mut self,
        c: &mut redis::Connection,
        buckets: &Buckets,
        today: u64,
    ) -> redis::RedisResult<()> {
        let fresh = format!("{:016x}", rand::random::<u64>());
        let gen: String = redis::Script::new(GEN_SCRIPT)
            .key(GEN_KEY)
            .arg(fresh)
            .invoke(c)?;
        let mut amounts: HashMap<String, i64> = HashMap::new();
        for (name, b) in buckets {
            // Every bucket with usage today (its limit may not be known
            // yet after a restart: the usage restored from the store is).
            let used =
                crate::logic::tenancy::quota::used_on(b.daily.load(Ordering::Relaxed), today);
            let drawn = i64::try_from(used)
                .unwrap_or(i64::MAX)
                .saturating_add(b.lease.tokens.load(Ordering::Relaxed));
            if drawn > 0 {
                amounts.insert(Self::tokens_key(name, today), drawn);
            }
        }
        let script = redis::Script::new(CONTRIBUTE_SCRIPT);
        let mut inv = script.prepare_invoke();
        inv.key(GEN_KEY)
            .key(format!("hivenet:quota:gen:{gen}:routers"))
            .arg(&gen)
            .arg(&self.me)
            .arg((today + 2) * 86_400);
        for (k, v) in &amounts {
            inv.key(k).arg(*v);
        }
        let r: i64 = inv.invoke(c)?;
        if r == 1 && !amounts.is_empty() {
            tracing::info!(
                generation = %gen,
                counters = amounts.len(),
                "shared quota: this router's usage of today added to the shared counters (Redis was empty or new)"
            );
        }
        if r >= 0 {
            self.gen = Some(gen);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The scripts on a real `redis-server` (scripts/test.sh installs it).
    use super::*;

    struct Server(std::process::Child);

    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn server() -> (Server, redis::Connection) {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
            ])
            .args(["--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server (scripts/test.sh installs it)");
        let s = Server(child);
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}/0")).expect("url");
        for _ in 0..200 {
            if let Ok(c) = client.get_connection() {
                return (s, c);
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!("redis-server did not start");
    }

    fn tokens(c: &mut redis::Connection, op: &str, charge: i64, top: i64, gen: &str) -> Vec<i64> {
        redis::Script::new(TOKENS_SCRIPT)
            .key("t")
            .key(op)
            .key(GEN_KEY)
            .arg(charge)
            .arg(top)
            .arg(1000)
            .arg(4_000_000_000u64)
            .arg(gen)
            .invoke(c)
            .expect("tokens script")
    }

    #[test]
    fn a_draw_sent_twice_is_charged_once_and_the_generation_is_checked() {
        let (_s, mut c) = server();
        let _: () = redis::cmd("SET")
            .arg(GEN_KEY)
            .arg("g1")
            .query(&mut c)
            .expect("set");
        assert_eq!(tokens(&mut c, "op1", 30, 100, "g1"), vec![100, 870, 0]);
        // The same op again (its answer was lost): the same answer, no charge.
        assert_eq!(tokens(&mut c, "op1", 30, 100, "g1"), vec![100, 870, 0]);
        let used: i64 = redis::cmd("GET").arg("t").query(&mut c).expect("get");
        assert_eq!(used, 130);
        // A top-up is capped by what is left; a debt is charged regardless.
        assert_eq!(tokens(&mut c, "op2", 0, 2000, "g1"), vec![870, 0, 0]);
        assert_eq!(tokens(&mut c, "op3", 50, 10, "g1"), vec![0, 0, 0]);
        let used: i64 = redis::cmd("GET").arg("t").query(&mut c).expect("get");
        assert_eq!(used, 1050);
        // A lease given back (negative charge) frees room.
        assert_eq!(tokens(&mut c, "op4", -100, 0, "g1"), vec![0, 50, 0]);
        // Another generation (Redis restarted empty): nothing applied.
        assert_eq!(tokens(&mut c, "op5", 10, 10, "g0"), vec![-1]);
        let used: i64 = redis::cmd("GET").arg("t").query(&mut c).expect("get");
        assert_eq!(used, 950);
        // Issue 51 #3: a counter of text is repaired (to 0) and said.
        let _: () = redis::cmd("SET")
            .arg("t")
            .arg("text")
            .query(&mut c)
            .expect("set");
        assert_eq!(tokens(&mut c, "op6", 5, 0, "g1"), vec![0, 995, 1]);
        let used: i64 = redis::cmd("GET").arg("t").query(&mut c).expect("get");
        assert_eq!(used, 5);
    }

    #[test]
    fn the_request_bucket_grants_its_burst_then_the_refill() {
        let (_s, mut c) = server();
        let draw = |c: &mut redis::Connection, op: &str, charge: i64, top: i64| -> Vec<i64> {
            redis::Script::new(REQUESTS_SCRIPT)
                .key("r")
                .key(op)
                .arg(charge)
                .arg(top)
                .arg(60)
                .arg(10)
                .invoke(c)
                .expect("requests script")
        };
        // 60 a minute, burst 10: a draw of 15 gets 10, then nothing, with
        // the wait until one fits (about one second).
        let a = draw(&mut c, "o1", 0, 15);
        assert_eq!(a[..2], [10, 0]);
        assert!((900_000..=1_000_000).contains(&a[2]), "{a:?}");
        let b = draw(&mut c, "o2", 0, 5);
        assert_eq!(b[..2], [0, 0]);
        // Debt is charged past the capacity: the wait grows by it.
        let d = draw(&mut c, "o3", 3, 0);
        assert!(d[2] >= 3_900_000, "{d:?}");
        // Sent again: the same answer, not charged twice.
        assert_eq!(draw(&mut c, "o3", 3, 0), d);
        // Given back: the wait shrinks.
        let e = draw(&mut c, "o4", -3, 0);
        assert!(e[2] <= 1_000_000, "{e:?}");
    }
}
