//! Decision cost of the fair pick (issue 32): one arrival placed and one
//! waiter served, in steady state with N requests queued (10 to 10,000),
//! 64 tenants, three classes and mixed token estimates. Against the same
//! pair on a plain FIFO (`VecDeque`, what the queue was) and on a naive
//! fair queue that scans every waiter for the smallest tag. Plain output;
//! run with `cargo bench -p shards --bench fairness`.
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::hint::black_box;
use std::time::Instant;

use shards::logic::routing::wait_queue::{Class, Fair, WaitQueue, LOOK_AHEAD, MAX_PASSES};

/// A small deterministic generator (no dependency, same stream each run).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn arrival(r: &mut Rng) -> Fair {
    let x = r.next();
    Fair {
        class: match x % 10 {
            0 => Class::Interactive,
            1..=6 => Class::Standard,
            _ => Class::Batch,
        },
        tenant: (x >> 8) % 64,
        cost: 50 + (x >> 20) % 4_000,
    }
}

fn time<F: FnMut()>(iters: u32, mut f: F) -> f64 {
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    t.elapsed().as_secs_f64() * 1e9 / f64::from(iters)
}

/// The naive fair queue: (class, tag, seq) per waiter in a vector; the
/// pick scans them all.
#[derive(Default)]
struct Naive {
    items: Vec<(u8, u64, u64)>,
    finish: std::collections::HashMap<u64, u64>,
    vtime: u64,
    seq: u64,
}

impl Naive {
    fn push(&mut self, f: Fair) {
        let start = self
            .finish
            .get(&f.tenant)
            .copied()
            .unwrap_or(0)
            .max(self.vtime);
        self.finish.insert(f.tenant, start + f.cost);
        self.items.push((f.class as u8, start, self.seq));
        self.seq += 1;
    }

    fn pop(&mut self) -> Option<(u8, u64, u64)> {
        let (i, _) = self.items.iter().enumerate().min_by_key(|(_, k)| **k)?;
        let k = self.items.swap_remove(i);
        self.vtime = self.vtime.max(k.1);
        Some(k)
    }
}

fn main() {
    println!(
        "{:>7} {:>16} {:>16} {:>16} {:>16}",
        "queued", "fair ns/pair", "fair+look ns", "fifo ns/pair", "naive ns/pair"
    );
    for n in [10usize, 100, 1_000, 10_000] {
        let iters = 200_000u32;
        let mut r = Rng(0x9E37_79B9_7F4A_7C15);
        let mut q: WaitQueue<u64> = WaitQueue::default();
        for i in 0..n {
            let _ = q.push_displacing(i as u64, usize::MAX, arrival(&mut r));
        }
        // One arrival and one pick (the head, as a freed slot with no
        // cache preference takes it).
        let fair = time(iters, || {
            let _ = black_box(q.push_displacing(1, usize::MAX, arrival(&mut r)));
            black_box(q.pop_head());
        });
        // The same with the cache-aware pick (looks at up to LOOK_AHEAD
        // waiters for one that prefers the freed agent; none does here:
        // the worst case).
        let look = time(iters, || {
            let _ = black_box(q.push_displacing(1, usize::MAX, arrival(&mut r)));
            black_box(q.pop_for(LOOK_AHEAD, MAX_PASSES, |v| *v == u64::MAX, |_| true));
        });
        let mut fifo: VecDeque<u64> = (0..n as u64).collect();
        let fifo_ns = time(iters, || {
            fifo.push_back(black_box(1));
            black_box(fifo.pop_front());
        });
        let mut naive = Naive::default();
        for _ in 0..n {
            naive.push(arrival(&mut r));
        }
        let naive_iters = if n >= 10_000 { 5_000 } else { 50_000 };
        let naive_ns = time(naive_iters, || {
            naive.push(arrival(&mut r));
            black_box(naive.pop());
        });
        assert_eq!(q.len(), n, "steady state");
        println!("{n:>7} {fair:>16.1} {look:>16.1} {fifo_ns:>16.1} {naive_ns:>16.1}");
    }
}
