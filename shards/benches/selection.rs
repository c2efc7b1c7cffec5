//! Selection cost: our one-pass gate pipeline against a naive baseline
//! that copies the agents, sorts them by peer ID (as the Go router did on
//! every attempt) and then scans, at 1, 10, 100 and 1000 agents per model
//! and 0, 2 and 5 `exclude_if` gates; then what `prefix-aware` adds at 8,
//! 32, 100 and 1000 agents. Plain output; run with
//! `cargo bench -p shards --bench selection`.
#![forbid(unsafe_code)]

use std::hint::black_box;
use std::time::Instant;

use shards::logic::link::control::Capability;
use shards::logic::routing::affinity::{
    model_salt, AffinityCfg, AffinityIndex, PrefixHasher, RequestKeys,
};
use shards::logic::routing::policy::{
    select, select_with, AgentFacts, Field, Match, Op, Rule, Step, StepPick,
};

struct Agent {
    id: u64,
    peer: String,
    active: u32,
    capacity: u32,
    srtt: Option<f64>,
    tags: Vec<String>,
}

fn agents(n: usize) -> Vec<Agent> {
    (0..n)
        .map(|i| Agent {
            id: i as u64,
            peer: format!(
                "12D3KooW{:040x}",
                (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ),
            active: (i % 7) as u32,
            capacity: 10,
            srtt: if i % 5 == 0 {
                None
            } else {
                Some(50.0 + (i % 300) as f64)
            },
            tags: vec!["production".into()],
        })
        .collect()
}

fn facts(a: &Agent) -> AgentFacts<'_> {
    AgentFacts {
        id: a.id,
        healthy: true,
        capability: Capability::Llm,
        engine: "vllm",
        region: "eu",
        organization: "o",
        machine: "m",
        tags: &a.tags,
        active: a.active,
        capacity: a.capacity,
        srtt: a.srtt,
        success_rate: Some(0.99),
        consecutive_failures: Some(0),
        probe_due: false,
        signals: Default::default(),
        hardware: Default::default(),
        gpu_model: "",
    }
}

fn step(gates: usize) -> Step {
    let all = [
        Rule {
            field: Field::Srtt,
            op: Op::Gt,
            value: 300.0,
        },
        Rule {
            field: Field::SuccessRate,
            op: Op::Lt,
            value: 0.5,
        },
        Rule {
            field: Field::ConsecutiveFailures,
            op: Op::Gte,
            value: 5.0,
        },
        Rule {
            field: Field::CapacityUtilization,
            op: Op::Gt,
            value: 0.95,
        },
        Rule {
            field: Field::KvCacheUtilization,
            op: Op::Gt,
            value: 0.9,
        },
    ];
    Step {
        name: "s".into(),
        matcher: Match::default(),
        exclude_if: all.iter().take(gates).copied().collect(),
        max_tries: 0,
        affinity: None,
    }
}

/// The baseline: copy, sort by peer ID, scan with the same gates.
fn naive(step: &Step, agents: &[Agent]) -> Option<u64> {
    // The copy the baseline makes on every attempt.
    let copy: Vec<AgentFacts<'_>> = agents.iter().map(facts).collect();
    let mut peers: Vec<(&str, usize)> = agents
        .iter()
        .enumerate()
        .map(|(i, a)| (a.peer.as_str(), i))
        .collect();
    peers.sort_unstable();
    let order: Vec<usize> = peers.into_iter().map(|(_, i)| i).collect();
    let mut best: Option<(u64, f64)> = None;
    for i in order {
        let f = copy[i];
        if f.active >= f.capacity {
            continue;
        }
        let excluded = step.exclude_if.iter().any(|r| {
            let v = match r.field {
                Field::Srtt => f.srtt,
                Field::SuccessRate => f.success_rate,
                Field::ConsecutiveFailures => f.consecutive_failures.map(|x| x as f64),
                Field::CapacityUtilization => Some(f64::from(f.active) / f64::from(f.capacity)),
                _ => None,
            };
            v.map(|x| r.violated(x)).unwrap_or(false)
        });
        if excluded {
            continue;
        }
        let load = f64::from(f.active) / f64::from(f.capacity);
        if best.map(|(_, b)| load < b).unwrap_or(true) {
            best = Some((f.id, load));
        }
    }
    best.map(|(id, _)| id)
}

fn time<F: FnMut()>(iters: u32, mut f: F) -> f64 {
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    t.elapsed().as_secs_f64() * 1e9 / f64::from(iters)
}

fn main() {
    println!(
        "{:>7} {:>6} {:>14} {:>14} {:>8}",
        "agents", "gates", "ours ns/pick", "naive ns/pick", "ratio"
    );
    for n in [1usize, 10, 100, 1000] {
        let a = agents(n);
        for gates in [0usize, 2, 5] {
            let s = step(gates);
            let iters = (2_000_000 / n.max(1)).clamp(200, 200_000) as u32;
            let mut rot = 0usize;
            let ours = time(iters, || {
                rot = rot.wrapping_add(1);
                let p = select(
                    &s,
                    Capability::Llm,
                    a.len(),
                    |i| a.get(i).map(facts),
                    &[],
                    rot,
                );
                black_box(matches!(p, StepPick::Agent(_)));
            });
            let base = time(iters, || {
                black_box(naive(&s, &a));
            });
            println!(
                "{n:>7} {gates:>6} {ours:>14.1} {base:>14.1} {:>8.1}",
                base / ours
            );
        }
    }
    prefix_aware();
}

/// What `prefix-aware` adds to a decision (issue 30 target: at most 2 us
/// at 1,000 agents): the index lookup over a long prompt's marks and the
/// holder check in the pass, against least-loaded's pass alone. Cases: a
/// miss (every mark looked up, none held: the worst case), and a hit on
/// the longest mark.
fn prefix_aware() {
    println!();
    println!(
        "{:>7} {:>10} {:>18} {:>18} {:>12}",
        "agents", "case", "least-loaded ns", "prefix-aware ns", "added ns"
    );
    // A 40-turn conversation with a long system prompt: the ring is full.
    let mut h = PrefixHasher::default();
    h.token(b"system");
    h.text("You are a careful assistant. ".repeat(200).as_bytes());
    h.message_end();
    for t in 0..40 {
        h.token(b"user");
        h.text(format!("question number {t} about the document").as_bytes());
        h.message_end();
    }
    let marks = h.finish(0, 0, false);
    let cfg = AffinityCfg::default();
    let keys = RequestKeys {
        salt: model_salt("m"),
        key: None,
        marks: &marks,
    };
    // 8 and 32: the GPU-shaped fleets of issue 55's side-by-side runs.
    for n in [8usize, 32, 100, 1000] {
        let a = agents(n);
        let ll = step(2);
        let pa = Step {
            affinity: Some(cfg),
            ..step(2)
        };
        // A full-size table (the default share of one of two shards).
        let mut ix = AffinityIndex::new(1 << 19);
        for ag in &a {
            ix.join(ag.id);
        }
        if n == 8 {
            // Its memory does not grow with the engines: one fixed table,
            // and one map entry (an ID and a horizon) per engine.
            println!(
                "  (index table: {} bytes for {} entries, whatever the engines)",
                ix.table_bytes(),
                ix.capacity()
            );
        }
        for (case, held) in [("miss", false), ("hit", true)] {
            if held {
                ix.record_request(&keys, cfg.block_bytes, (n / 2) as u64, 1000);
            }
            // Alternating rounds, medians: this machine's noise between
            // two long blocks is larger than the difference measured.
            let iters = (200_000 / n).clamp(50, 20_000) as u32;
            let mut rot = 0usize;
            let (mut bases, mut ourss) = (Vec::new(), Vec::new());
            for _ in 0..31 {
                bases.push(time(iters, || {
                    rot = rot.wrapping_add(1);
                    let p = select(
                        &ll,
                        Capability::Llm,
                        a.len(),
                        |i| a.get(i).map(facts),
                        &[],
                        rot,
                    );
                    black_box(matches!(p, StepPick::Agent(_)));
                }));
                ourss.push(time(iters, || {
                    rot = rot.wrapping_add(1);
                    let holders = ix.lookup(&keys, &cfg, 1001);
                    let p = select_with(
                        &pa,
                        Capability::Llm,
                        a.len(),
                        |i| a.get(i).map(facts),
                        &[],
                        rot,
                        &holders,
                    );
                    black_box(p);
                }));
            }
            let median = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let (base, ours) = (median(&mut bases), median(&mut ourss));
            println!(
                "{n:>7} {case:>10} {base:>18.1} {ours:>18.1} {:>12.1}",
                ours - base
            );
        }
    }
}
