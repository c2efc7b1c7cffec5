//! Sub-millisecond sleeps. monoio's timer wheel ticks in whole
//! milliseconds, so a 1 ms inter-token gap became 1-2 ms. Deadlines closer
//! than [`COARSE_MARGIN`] are handed to one timer thread that sleeps on a
//! condition variable (futex: ~50-100 us slack) and wakes the waiting task
//! through a channel. No busy loops anywhere.

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
