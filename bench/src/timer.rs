//! Sub-millisecond sleeps. monoio's timer wheel ticks in whole
//! milliseconds, so a 1 ms inter-token gap became 1-2 ms.
//!
//! - [`PreciseTimer`] (io_uring runtimes): a timerfd read through the
//!   runtime's own ring, so the worker thread itself sleeps until the
//!   kernel's high-resolution timer fires (no other thread, no timer
//!   slack). The open loop's sends use it ([`arrive_at`]).
//! - Otherwise deadlines closer than [`COARSE_MARGIN`] are handed to one
//!   timer thread that sleeps on a condition variable and wakes the task
//!   through a channel. That thread inherits the worker's CPU pinning, so a
//!   busy worker delays its wake-ups: measured 0.15 ms median, >1 ms p99
//!   send lag at 2,000 req/s (perf/2026-12-01-send-lag).
//!
//! [`arrive_at`] then busy-waits the last `--spin` (100 us by default):
//! the timerfd wake-up on these VMs is 0-30 us late, rarely more. Other
//! tasks (responses) keep running during that wait ([`yield_turn`]).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use futures::channel::oneshot;

/// Below this distance the precise thread takes over from the runtime timer.
pub const COARSE_MARGIN: Duration = Duration::from_millis(3);

struct Entry {
    at: Instant,
    seq: u64,
    tx: oneshot::Sender<()>,
}

impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

#[derive(Default)]
struct State {
    heap: BinaryHeap<Reverse<Entry>>,
    seq: u64,
}

struct Inner {
    state: Mutex<State>,
    cv: Condvar,
}

fn inner() -> &'static Arc<Inner> {
    static T: OnceLock<Arc<Inner>> = OnceLock::new();
    T.get_or_init(|| {
        let i = Arc::new(Inner {
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
        });
        let t = i.clone();
        let _ = std::thread::Builder::new()
            .name("precise-timer".into())
            .spawn(move || run(&t));
        i
    })
}

fn run(i: &Inner) {
    let Ok(mut st) = i.state.lock() else { return };
    loop {
        let now = Instant::now();
        while st
            .heap
            .peek()
            .map(|Reverse(e)| e.at <= now)
            .unwrap_or(false)
        {
            if let Some(Reverse(e)) = st.heap.pop() {
                let _ = e.tx.send(());
            }
        }
        let wait = st
            .heap
            .peek()
            .map(|Reverse(e)| e.at.saturating_duration_since(now));
        st = match wait {
            Some(d) => match i.cv.wait_timeout(st, d) {
                Ok((g, _)) => g,
                Err(_) => return,
            },
            None => match i.cv.wait(st) {
                Ok(g) => g,
                Err(_) => return,
            },
        };
    }
}

/// Sleep until `at` with sub-millisecond precision.
pub async fn sleep_until(at: Instant) {
    let now = Instant::now();
    if at <= now {
        return;
    }
    if at - now > COARSE_MARGIN {
        monoio::time::sleep(at - now - COARSE_MARGIN + Duration::from_millis(1)).await;
    }
    if at <= Instant::now() {
        return;
    }
    let (tx, rx) = oneshot::channel();
    let i = inner();
    if let Ok(mut st) = i.state.lock() {
        st.seq += 1;
        let seq = st.seq;
        st.heap.push(Reverse(Entry { at, seq, tx }));
    } else {
        return;
    }
    i.cv.notify_one();
    let _ = rx.await;
}

/// Sleep for `d` with sub-millisecond precision.
pub async fn sleep(d: Duration) {
    if !d.is_zero() {
        sleep_until(Instant::now() + d).await;
    }
}

/// Let every other ready task run once, and the runtime reap its
/// completions, then come back. A task that wakes itself is put at the
/// front of monoio's queue and polled again at once, so a busy wait made
/// of self-wakes starves everything else (no response was read during the
/// 100 us waits: at 10,000 req/s constant the wait never ends, and
/// responses sat for milliseconds). The wake here comes from a task
/// spawned behind the others instead.
pub async fn yield_turn() {
    let (tx, rx) = futures::channel::oneshot::channel::<()>();
    drop(monoio::spawn(async move {
        let _ = tx.send(());
    }));
    let _ = rx.await;
}

/// A timerfd read through the runtime's io_uring: the waiting thread is
/// woken by the kernel's high-resolution timer itself.
pub struct PreciseTimer {
    fd: rustix::fd::OwnedFd,
    file: monoio::fs::File,
    buf: Option<Vec<u8>>,
}

impl PreciseTimer {
    /// A timer for this thread's runtime; `None` when the runtime is not
    /// io_uring (the epoll driver would block on the read) or timerfd is
    /// unavailable.
    pub fn new() -> Option<Self> {
        use rustix::time::{timerfd_create, TimerfdClockId, TimerfdFlags};
        if !monoio::utils::detect_uring() {
            return None;
        }
        let fd = timerfd_create(TimerfdClockId::Monotonic, TimerfdFlags::CLOEXEC).ok()?;
        let file = monoio::fs::File::from_std(std::fs::File::from(fd.try_clone().ok()?)).ok()?;
        Some(PreciseTimer {
            fd,
            file,
            buf: Some(vec![0u8; 8]),
        })
    }

    /// Sleep until `at`.
    pub async fn sleep_until(&mut self, at: Instant) -> std::io::Result<()> {
        use rustix::time::{timerfd_settime, Itimerspec, TimerfdTimerFlags, Timespec};
        let Some(d) = at
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
        else {
            return Ok(());
        };
        let spec = Itimerspec {
            it_interval: Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: Timespec {
                tv_sec: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
                tv_nsec: i64::from(d.subsec_nanos()),
            },
        };
        timerfd_settime(&self.fd, TimerfdTimerFlags::empty(), &spec)?;
        let buf = self.buf.take().unwrap_or_else(|| vec![0u8; 8]);
        let (res, buf) = self.file.read_at(buf, 0).await;
        self.buf = Some(buf);
        res.map(|_| ())
    }
}

/// Arrive at `at` as exactly as the machine allows: sleep until `spin`
/// before it (on `precise` when there is one), then busy-wait. Returns at
/// once when `at` is past.
pub async fn arrive_at(at: Instant, spin: Duration, precise: &mut Option<PreciseTimer>) {
    if let Some(early) = at.checked_sub(spin) {
        let now = Instant::now();
        if early > now + COARSE_MARGIN {
            // Far: the runtime's millisecond wheel, waking a little early.
            monoio::time::sleep(early - now - COARSE_MARGIN + Duration::from_millis(1)).await;
        }
        let waited = match precise {
            Some(t) => t.sleep_until(early).await.is_ok(),
            None => false,
        };
        if !waited {
            sleep_until(early).await;
        }
    }
    while Instant::now() < at {
        yield_turn().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Never early, with and without the timerfd, with and without the
    /// busy wait (an upper bound on lateness would be a timing test: the
    /// figures are in perf/, from scripts/bench/send-lag.py).
    #[test]
    fn arrive_at_is_never_early() {
        let mut rt = match monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
            .enable_timer()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => panic!("runtime: {e}"),
        };
        rt.block_on(async {
            let mut precise = PreciseTimer::new();
            assert_eq!(precise.is_some(), monoio::utils::detect_uring());
            let mut none = None;
            for d in [0u64, 30, 300, 2_000, 4_500] {
                for spin in [Duration::ZERO, Duration::from_micros(100)] {
                    for p in [&mut precise, &mut none] {
                        let at = Instant::now() + Duration::from_micros(d);
                        arrive_at(at, spin, p).await;
                        assert!(Instant::now() >= at, "early: {d} us, spin {spin:?}");
                    }
                }
            }
        });
    }
}
