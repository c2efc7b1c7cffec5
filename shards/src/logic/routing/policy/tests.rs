use super::parse::*;
use super::*;
use proptest::prelude::*;

const SEED_GATE: &str =
    "routing_policy:\n  exclude_if:\n    srtt:\n      gt: 500\n\n  strategy: least-loaded\n";
const SEED_FALLBACK: &str = "routing_policy:\n  match:\n    engine: vllm\n\n  exclude_if:\n    srtt:\n      gt: 500\n\n  strategy: least-loaded\n\nfallback_chain:\n  - name: relaxed-latency\n\n    match:\n      engine: vllm\n\n    exclude_if:\n      srtt:\n        gt: 1500\n\n    strategy: least-loaded\n";

#[test]
fn seed_documents_are_accepted() {
    let p = parse("gate.yaml", SEED_GATE).expect("seed gate");
    assert_eq!(p.steps.len(), 1);
    assert_eq!(
        p.steps[0].exclude_if,
        vec![Rule {
            field: Field::Srtt,
            op: Op::Gt,
            value: 500.0
        }]
    );
    let p = parse("fallback.yaml", SEED_FALLBACK).expect("seed fallback");
    assert_eq!(p.steps.len(), 2);
    assert_eq!(p.steps[1].name, "relaxed-latency");
    assert_eq!(p.steps[1].matcher.engine, "vllm");
    assert_eq!(p.steps[1].exclude_if[0].value, 1500.0);
}

#[test]
fn validation_table() {
    let cases: &[(&str, &str, u64, &str)] = &[
        ("routing_policy:\n  exclude_if:\n    srtt_ms:\n      gt: 500\n  strategy: least-loaded\n", "routing_policy.exclude_if.srtt_ms", 3, "use `srtt`, not `srtt_ms`"),
        ("routing_policy:\n  strategy: lowest-srtt\n", "routing_policy.strategy", 2, "lowest-srtt"),
        ("routing_policy:\n  strategy: round-robin\n", "routing_policy.strategy", 2, "unknown strategy"),
        ("routing_policy:\n  match: {engine: vllm}\n", "routing_policy", 1, "strategy is required"),
        ("fallback_chain: []\n", "routing_policy", 1, "routing_policy is required"),
        ("routing_policy:\n  strategy: least-loaded\n  exclude_if:\n    latency:\n      gt: 1\n", "routing_policy.exclude_if.latency", 4, "unknown exclude_if field"),
        ("routing_policy:\n  strategy: least-loaded\n  exclude_if:\n    srtt:\n      gt: 1\n      lt: 0\n", "routing_policy.exclude_if.srtt", 4, "exactly one operator"),
        ("routing_policy:\n  strategy: least-loaded\n  exclude_if:\n    srtt:\n      above: 1\n", "routing_policy.exclude_if.srtt.above", 5, "unknown operator"),
        ("routing_policy:\n  strategy: least-loaded\nfallback_chain:\n  - name: a\n    strategy: least-loaded\n  - name: b\n    strategy: fastest\n", "fallback_chain[1].strategy", 7, "unknown strategy"),
        ("routing_policy:\n  strategy: least-loaded\n  max_tries: -1\n", "routing_policy.max_tries", 3, "max_tries"),
        ("routing_policy:\n  strategy: least-loaded\n  match:\n    capability: vision\n", "routing_policy.match.capability", 4, "unknown capability"),
        ("routing_policy:\n  strategy: least-loaded\nfallback_chains: []\n", "fallback_chains", 3, "unknown field"),
        ("routing_policy:\n  strategy: least-loaded\n  max_try: 2\n", "max_try", 3, "unknown field"),
        ("mode: shared\nrouting_policy:\n  strategy: least-loaded\n", "mode", 1, "unknown mode"),
        ("routing_policy:\n  strategy: least-loaded\nmax_input_tokens: -1\n", "max_input_tokens", 3, ">= 0"),
        ("routing_policy:\n  strategy: least-loaded\nimages_max: -2\n", "images_max", 3, ">= 0"),
        ("routing_policy:\n  strategy: least-loaded\nadmit_budget_tokens: -5\n", "admit_budget_tokens", 3, ">= 0"),
        ("routing_policy:\n  strategy: least-loaded\nmax_inflight: -8\n", "max_inflight", 3, ">= 0"),
        ("routing_policy:\n  strategy: least-loaded\nshed_if:\n  srtt:\n    gt: 5\n", "shed_if.srtt", 4, "unknown shed_if field"),
        ("routing_policy:\n  strategy: least-loaded\nshed_if:\n  waiting_requests:\n    gt: 5\n    lt: 9\n", "shed_if.waiting_requests", 4, "exactly one operator"),
        ("routing_policy:\n  strategy: least-loaded\nshed_if:\n  kv_cache_utilization:\n    over: 0.9\n", "shed_if.kv_cache_utilization.over", 5, "unknown operator"),
        ("routing_policy:\n  strategy: least-loaded\nmax_inflight: lots\n", "", 0, ""),
        ("routing_policy: [\n", "", 0, ""),
        ("routing_policy:\n  strategy: least-loaded\nmin_share:\n  urgent: 0.1\n", "min_share.urgent", 0, "unknown class"),
        ("routing_policy:\n  strategy: least-loaded\nmin_share:\n  batch: 1.5\n", "min_share.batch", 0, "between 0 and 1"),
        ("routing_policy:\n  strategy: least-loaded\nmin_share:\n  batch: 0.6\n  interactive: 0.6\n", "min_share", 0, "more than 1"),
        ("routing_policy:\n  strategy: least-loaded\ntenant_headroom: -1\n", "tenant_headroom", 0, "0 to 1024"),
        ("routing_policy:\n  strategy: least-loaded\ntenant_headroom: 5000\n", "tenant_headroom", 0, "0 to 1024"),
    ];
    for (text, path, line, msg) in cases {
        let e = parse("p.yaml", text).expect_err(text);
        assert_eq!(e.file, "p.yaml");
        if !path.is_empty() {
            assert_eq!(&e.path, path, "{text}: {e}");
        }
        if *line > 0 {
            assert_eq!(e.line, *line, "{text}: {e}");
        }
        assert!(e.message.contains(msg), "{text}: {e}");
        assert!(e.to_string().starts_with("policy: p.yaml:"), "{e}");
    }
}

#[test]
fn tenant_headroom_defaults_to_six_and_zero_turns_it_off() {
    let base = "routing_policy:\n  strategy: least-loaded\n";
    assert_eq!(parse("p.yaml", base).expect("default").tenant_headroom, 6);
    let off = parse("p.yaml", &format!("{base}tenant_headroom: 0\n")).expect("off");
    assert_eq!(off.tenant_headroom, 0);
    assert_eq!(Policy::default().tenant_headroom, 6);
}

#[test]
fn admission_fields_are_parsed() {
    let p = parse(
        "a.yaml",
        "models: [m]\nmode: serverless\nmax_input_tokens: 4096\nimages_max: 2\nadmit_budget_tokens: 100000\nmax_inflight: 8\nshed_if:\n  kv_cache_utilization: {gt: 0.9}\n  waiting_requests: {gte: 20}\nrouting_policy:\n  strategy: least-loaded\n",
    )
    .expect("admission policy");
    let a = &p.admission;
    assert_eq!(a.mode, Mode::Serverless);
    assert_eq!(
        (
            a.max_input_tokens,
            a.images_max,
            a.admit_budget_tokens,
            a.max_inflight
        ),
        (4096, 2, 100_000, 8)
    );
    assert_eq!(
        a.shed_if,
        vec![
            Rule {
                field: Field::KvCacheUtilization,
                op: Op::Gt,
                value: 0.9
            },
            Rule {
                field: Field::WaitingRequests,
                op: Op::Gte,
                value: 20.0
            }
        ]
    );
    assert!(a.any() && a.occupancy());
    let plain = parse(
        "b.yaml",
        "mode: reserved\nrouting_policy:\n  strategy: least-loaded\n",
    )
    .expect("reserved");
    assert!(!plain.admission.any(), "reserved with no caps: no gate");
}

fn facts(
    id: u64,
    healthy: bool,
    active: u32,
    capacity: u32,
    srtt: Option<f64>,
    engine: &'static str,
) -> AgentFacts<'static> {
    AgentFacts {
        id,
        healthy,
        capability: Capability::Llm,
        engine,
        region: "eu",
        organization: "o",
        machine: "m",
        tags: &[],
        active,
        capacity,
        srtt,
        success_rate: None,
        consecutive_failures: None,
        probe_due: false,
        signals: Default::default(),
        hardware: Default::default(),
        gpu_model: "",
    }
}

fn gate(th: f64) -> Step {
    Step {
        name: "s".into(),
        matcher: Match::default(),
        exclude_if: vec![Rule {
            field: Field::Srtt,
            op: Op::Gt,
            value: th,
        }],
        max_tries: 0,
        affinity: None,
    }
}

#[test]
fn srtt_gate_passes_unknown_and_excludes_slow() {
    let agents = [
        facts(1, true, 0, 10, Some(50.0), "vllm"),
        facts(2, true, 0, 10, Some(900.0), "vllm"),
        facts(3, true, 5, 10, None, "vllm"),
    ];
    let step = gate(500.0);
    let picks: Vec<_> = (0..6)
        .map(|r| {
            select(
                &step,
                Capability::Llm,
                3,
                |i| agents.get(i).copied(),
                &[],
                r,
            )
        })
        .collect();
    assert!(
        picks.iter().all(|p| *p == StepPick::Agent(0)),
        "{picks:?}: least loaded of {{1, 3}} is 1"
    );
    let only_slow = [facts(2, true, 0, 10, Some(900.0), "vllm")];
    assert!(
        matches!(select(&step, Capability::Llm, 1, |i| only_slow.get(i).copied(), &[], 0), StepPick::Empty(c) if c.excluded == 1)
    );
}

#[test]
fn full_is_queue_eligible_and_session_advances() {
    let agents = [facts(1, true, 2, 2, None, "vllm")];
    let step = Policy::default().steps[0].clone();
    assert!(matches!(
        select(
            &step,
            Capability::Llm,
            1,
            |i| agents.get(i).copied(),
            &[],
            0
        ),
        StepPick::Full(_)
    ));
    let p = parse("f", SEED_FALLBACK).expect("ok");
    let mut s = Session::new(&p, 2);
    s.record_failure(&p, 1);
    assert_eq!(s.step, 0);
    s.record_failure(&p, 2);
    assert_eq!(s.step, 1, "two tries used: next step");
    s.advance();
    assert!(s.exhausted());
}

fn arb_facts() -> impl Strategy<Value = (u64, bool, u32, u32, Option<f64>, bool, bool)> {
    (
        0u64..50,
        any::<bool>(),
        0u32..6,
        0u32..6,
        proptest::option::of(1.0f64..2000.0),
        any::<bool>(),
        any::<bool>(),
    )
}

proptest! {
    /// Never selects an unhealthy, excluded, failed, full or non-matching
    /// agent; same inputs, same choice; the SRTT gate excludes exactly the
    /// agents above the threshold and passes the unknown ones.
    #[test]
    fn pipeline_properties(raw in proptest::collection::vec(arb_facts(), 0..30), th in 1.0f64..2000.0, rot in 0usize..64, failed in proptest::collection::vec(0u64..50, 0..5), want_sglang in any::<bool>()) {
        let agents: Vec<AgentFacts<'static>> = raw.iter().map(|(id, h, a, c, s, sg, _)| {
            let mut f = facts(*id, *h, *a, *c, *s, if *sg { "sglang" } else { "vllm" });
            f.capability = Capability::Llm;
            f
        }).collect();
        let mut step = gate(th);
        if want_sglang {
            step.matcher.engine = "sglang".into();
        }
        let pick = select(&step, Capability::Llm, agents.len(), |i| agents.get(i).copied(), &failed, rot);
        prop_assert_eq!(pick, select(&step, Capability::Llm, agents.len(), |i| agents.get(i).copied(), &failed, rot));
        let eligible = |a: &AgentFacts| a.healthy && !failed.contains(&a.id) && a.capacity > 0 && a.active < a.capacity
            && (!want_sglang || a.engine == "sglang") && a.srtt.map(|s| s <= th).unwrap_or(true);
        match pick {
            StepPick::Agent(i) => {
                let a = agents[i];
                prop_assert!(eligible(&a));
                for o in &agents {
                    if eligible(o) {
                        prop_assert!(u64::from(a.active) * u64::from(o.capacity) <= u64::from(o.active) * u64::from(a.capacity));
                    }
                }
            }
            StepPick::Full(_) | StepPick::Empty(_) => prop_assert!(!agents.iter().any(eligible)),
        }
    }
}

#[test]
fn equal_loads_take_turns() {
    let agents = [
        facts(1, true, 0, 10, None, "vllm"),
        facts(2, true, 0, 10, None, "vllm"),
        facts(3, true, 0, 10, None, "vllm"),
    ];
    let step = Policy::default().steps[0].clone();
    let picks: Vec<_> = (0..3)
        .map(|r| {
            select(
                &step,
                Capability::Llm,
                3,
                |i| agents.get(i).copied(),
                &[],
                r,
            )
        })
        .collect();
    assert_eq!(
        picks,
        vec![StepPick::Agent(0), StepPick::Agent(1), StepPick::Agent(2)],
        "not always the lowest peer"
    );
}

/// Issue 28 #15: GPU gates read the agent's reported GPU signals (absent
/// still passes) and `match.gpu_model` matches the declared model.
#[test]
fn gpu_signals_gate_and_gpu_model_matches() {
    let mut hot = facts(1, true, 0, 4, None, "vllm");
    hot.hardware.gpu_temperature_c = Some(91.0);
    hot.hardware.gpu_util_percent = Some(0.95);
    hot.gpu_model = "NVIDIA H100 80GB HBM3";
    let cool = facts(2, true, 0, 4, None, "vllm");
    assert_eq!(hot.signal(Field::GpuUtilPercent), Some(0.95));
    assert_eq!(cool.signal(Field::GpuUtilPercent), None, "no GPU: absent");
    let step = |m: Match, rules: Vec<Rule>| Step {
        name: "s".into(),
        matcher: m,
        exclude_if: rules,
        max_tries: 1,
        affinity: None,
    };
    let picks = |s: &Step, a: &AgentFacts<'static>| {
        let a = *a;
        matches!(
            select(s, Capability::Llm, 1, move |_| Some(a), &[], 0),
            StepPick::Agent(0)
        )
    };
    let temp = Rule {
        field: Field::GpuTemperatureC,
        op: Op::Gt,
        value: 85.0,
    };
    let s = step(Match::default(), vec![temp]);
    assert!(!picks(&s, &hot), "a hot GPU is excluded");
    assert!(picks(&s, &cool), "no GPU reported: the gate passes");
    let h100 = Match {
        gpu_model: "NVIDIA H100 80GB HBM3".into(),
        ..Match::default()
    };
    let s = step(h100, vec![]);
    assert!(picks(&s, &hot), "declared model matches");
    assert!(!picks(&s, &cool), "no GPU model: no match");
}

#[test]
fn fallback_provider_is_parsed_and_checked() {
    let ok = "routing_policy:\n  strategy: least-loaded\nfallback_provider:\n  engine: anthropic\n  model: claude-x\n";
    let p = parse("p.yaml", ok).expect("accepted");
    assert_eq!(
        p.fallback_provider,
        Some(crate::logic::http::api::provider::FallbackProvider {
            engine: crate::logic::http::api::provider::Engine::Anthropic,
            model: "claude-x".into()
        })
    );
    let shown = serde_json::to_value(&p).expect("json");
    assert_eq!(shown["fallback_provider"]["engine"], "anthropic");
    let bad_engine = "routing_policy:\n  strategy: least-loaded\nfallback_provider:\n  engine: gemini\n  model: g\n";
    let e = parse("p.yaml", bad_engine).expect_err("refused");
    assert_eq!((e.path.as_str(), e.line), ("fallback_provider.engine", 4));
    assert!(e.message.contains("supported: openai, anthropic"), "{e}");
    let no_model =
        "routing_policy:\n  strategy: least-loaded\nfallback_provider:\n  engine: openai\n";
    let e = parse("p.yaml", no_model).expect_err("refused");
    assert_eq!(e.path, "fallback_provider.model");
    let typo = "routing_policy:\n  strategy: least-loaded\nfallback_provider:\n  engine: openai\n  model: m\n  modle: n\n";
    assert!(parse("p.yaml", typo).is_err());
}

/// Issue 29 #10: at equal load, an agent whose last request failed (a
/// timeout on a hung backend) loses the tie whatever the rotation; a
/// lighter failing agent still wins on load.
#[test]
fn a_failing_agent_loses_ties_not_load() {
    let mut hung = facts(1, true, 0, 10, None, "vllm");
    hung.consecutive_failures = Some(1);
    let ok = facts(2, true, 0, 10, None, "vllm");
    let step = Policy::default().steps[0].clone();
    for rot in 0..4 {
        let agents = [hung, ok];
        let pick = select(
            &step,
            Capability::Llm,
            2,
            |i| agents.get(i).copied(),
            &[],
            rot,
        );
        assert_eq!(pick, StepPick::Agent(1), "rotation {rot}");
    }
    let busy_ok = facts(2, true, 5, 10, None, "vllm");
    let agents = [hung, busy_ok];
    let pick = select(
        &step,
        Capability::Llm,
        2,
        |i| agents.get(i).copied(),
        &[],
        0,
    );
    assert_eq!(pick, StepPick::Agent(0), "load first");
}

/// Issue 51 #12: a failing agent whose probe is due is no longer put
/// behind the others at equal load, and the failure gates let it through,
/// so requests that come one at a time reach it again; the SRTT gate is
/// not lifted (the seed's fallback steps give it samples).
#[test]
fn a_due_probe_puts_a_failing_agent_back_in_rotation() {
    let mut hung = facts(1, true, 0, 10, None, "vllm");
    hung.consecutive_failures = Some(3);
    hung.success_rate = Some(0.2);
    let ok = facts(2, true, 0, 10, None, "vllm");
    let step = Policy::default().steps[0].clone();
    let pick = |agents: [AgentFacts<'static>; 2], step: &Step, rot| {
        select(
            step,
            Capability::Llm,
            2,
            |i| agents.get(i).copied(),
            &[],
            rot,
        )
    };
    // Not due: never chosen at equal load, whatever the rotation.
    assert!((0..4).all(|r| pick([hung, ok], &step, r) == StepPick::Agent(1)));
    // Due: chosen by the rotation like any other.
    let due = AgentFacts {
        probe_due: true,
        ..hung
    };
    assert!((0..4).any(|r| pick([due, ok], &step, r) == StepPick::Agent(0)));
    // The failure gates let a due probe through, the SRTT gate does not.
    let yaml = "routing_policy:\n  strategy: least-loaded\n  exclude_if:\n    consecutive_failures:\n      gt: 2\n    success_rate:\n      lt: 0.5\n";
    let gated = parse("p.yaml", yaml).expect("policy").steps[0].clone();
    let only = |a: AgentFacts<'static>, step: &Step| {
        select(step, Capability::Llm, 1, |i| [a].get(i).copied(), &[], 0)
    };
    assert!(matches!(only(hung, &gated), StepPick::Empty(_)));
    assert_eq!(only(due, &gated), StepPick::Agent(0));
    let slow = AgentFacts {
        srtt: Some(900.0),
        ..due
    };
    assert!(matches!(only(slow, &gate(500.0)), StepPick::Empty(_)));
}

#[test]
fn the_probe_backoff_doubles_from_one_second_to_thirty() {
    let s = |n| probe_backoff(n).as_secs();
    assert_eq!(
        [s(0), s(1), s(2), s(3), s(5), s(6), s(60)],
        [1, 1, 2, 4, 16, 30, 30]
    );
}

/// A `prefix-aware` step with this load band.
fn prefix_aware_step(band: f64) -> Step {
    Step {
        name: "s".into(),
        matcher: Match::default(),
        exclude_if: Vec::new(),
        max_tries: 1,
        affinity: Some(AffinityCfg {
            load_band: band,
            ..AffinityCfg::default()
        }),
    }
}

/// The load guard of `prefix-aware`: a holder within the band wins, one
/// beyond it or full loses to least-loaded, and a holder outside the pool
/// changes nothing.
#[test]
fn prefix_aware_picks_a_holder_within_the_load_band_only() {
    use crate::logic::routing::affinity::{HitKind, Holder, Holders, Outcome};
    let step = prefix_aware_step;
    // Agent 2 holds the prefix with 2 of 4 slots busy; agent 1 is idle.
    let pool = [
        facts(1, true, 0, 4, None, "vllm"),
        facts(2, true, 2, 4, None, "vllm"),
    ];
    let get = |i: usize| pool.get(i).copied();
    let held_by = |id: u32| {
        Holders::of(
            HitKind::Prefix,
            &[Holder {
                agent: id,
                depth: 100,
                age: 1,
                hash: 9,
            }],
        )
    };
    let run = |band, h: &Holders| select_with(&step(band), Capability::Llm, 2, get, &[], 0, h);
    assert_eq!(
        run(0.5, &held_by(2)),
        (StepPick::Agent(1), Some(Outcome::PrefixHit))
    );
    assert_eq!(
        run(0.25, &held_by(2)),
        (StepPick::Agent(0), Some(Outcome::Overloaded))
    );
    assert_eq!(
        run(0.25, &held_by(1)),
        (StepPick::Agent(0), Some(Outcome::PrefixHit))
    );
    assert_eq!(
        run(0.25, &Holders::default()),
        (StepPick::Agent(0), Some(Outcome::Miss))
    );
    // A holder that is not in the pool (gone) is an overloaded holder at
    // worst, never a pick.
    assert_eq!(
        run(1.0, &held_by(9)),
        (StepPick::Agent(0), Some(Outcome::Overloaded))
    );
    // Full holder: skipped whatever the band.
    let full = [
        facts(1, true, 3, 4, None, "vllm"),
        facts(2, true, 4, 4, None, "vllm"),
    ];
    let got = select_with(
        &step(1.0),
        Capability::Llm,
        2,
        |i| full.get(i).copied(),
        &[],
        0,
        &held_by(2),
    );
    assert_eq!(got, (StepPick::Agent(0), Some(Outcome::Overloaded)));
    // A key hit is named as such; least-loaded steps report nothing.
    let key = Holders::of(
        HitKind::Key,
        &[Holder {
            agent: 2,
            depth: 0,
            age: 1,
            hash: 3,
        }],
    );
    assert_eq!(run(0.5, &key).1, Some(Outcome::KeyHit));
    let ll = Step {
        affinity: None,
        ..step(0.5)
    };
    assert_eq!(
        select_with(&ll, Capability::Llm, 2, get, &[], 0, &key),
        (StepPick::Agent(0), None)
    );
}

/// Among holders within the band the most recent wins, not the least
/// loaded: its engine's cache is the one that most likely still holds the
/// prefix. Outside the band it is passed for the next most recent.
#[test]
fn prefix_aware_picks_the_most_recent_holder_within_the_band() {
    use crate::logic::routing::affinity::{HitKind, Holder, Holders, Outcome};
    let step = prefix_aware_step;
    // Agent 3 served the prefix last (2 of 4 busy); agent 2 before it
    // (idle); agent 1 never (1 busy).
    let pool = [
        facts(1, true, 1, 4, None, "vllm"),
        facts(2, true, 0, 4, None, "vllm"),
        facts(3, true, 2, 4, None, "vllm"),
    ];
    let h = |agent, age| Holder {
        agent,
        depth: 100,
        age,
        hash: 9,
    };
    let holders = Holders::of(HitKind::Prefix, &[h(3, 0), h(2, 5)]);
    let run = |band| {
        select_with(
            &step(band),
            Capability::Llm,
            3,
            |i| pool.get(i).copied(),
            &[],
            0,
            &holders,
        )
    };
    assert_eq!(run(1.0), (StepPick::Agent(2), Some(Outcome::PrefixHit)));
    assert_eq!(run(0.5), (StepPick::Agent(2), Some(Outcome::PrefixHit)));
    // 2/4 is beyond 0 + 0.25: the older holder, idle, takes it.
    assert_eq!(run(0.25), (StepPick::Agent(1), Some(Outcome::PrefixHit)));
    // A request that waited for its holders takes the freshest free one.
    assert_eq!(
        free_holder(
            &step(0.0),
            Capability::Llm,
            3,
            |i| pool.get(i).copied(),
            &[],
            &holders
        ),
        Some(2)
    );
}

#[test]
fn prefix_aware_fields_are_validated() {
    let p = parse(
        "p.yaml",
        "routing_policy:\n  strategy: prefix-aware\n  affinity:\n    load_band: 0.5\n    ttl_seconds: 60\n    block_bytes: 4096\n    holder_wait_ms: 750\n",
    )
    .expect("accepted");
    assert_eq!(
        p.steps[0].affinity,
        Some(AffinityCfg {
            load_band: 0.5,
            ttl_seconds: 60,
            block_bytes: 4096,
            holder_wait_ms: 750,
        })
    );
    let d = parse("p.yaml", "routing_policy:\n  strategy: prefix-aware\n").expect("defaults");
    assert_eq!(d.steps[0].affinity, Some(AffinityCfg::default()));
    for (text, path, msg) in [
        (
            "  affinity:\n    load_band: 1.5\n",
            "routing_policy.affinity.load_band",
            "between 0 and 1",
        ),
        (
            "  affinity:\n    load_band: .nan\n",
            "routing_policy.affinity.load_band",
            "between 0 and 1",
        ),
        (
            "  affinity:\n    holder_wait_ms: -1\n",
            "routing_policy.affinity.holder_wait_ms",
            "between 0 and 60000",
        ),
        (
            "  affinity:\n    holder_wait_ms: 60001\n",
            "routing_policy.affinity.holder_wait_ms",
            "between 0 and 60000",
        ),
        (
            "  affinity:\n    ttl_seconds: 0\n",
            "routing_policy.affinity.ttl_seconds",
            "between 1 and 86400",
        ),
        (
            "  affinity:\n    ttl_seconds: 100000\n",
            "routing_policy.affinity.ttl_seconds",
            "between 1 and 86400",
        ),
        (
            "  affinity:\n    block_bytes: 100\n",
            "routing_policy.affinity.block_bytes",
            "multiple of 512",
        ),
        (
            "  affinity:\n    block_bytes: 1536\n    x: 1\n",
            "x",
            "unknown field",
        ),
    ] {
        let e = parse(
            "p.yaml",
            &format!("routing_policy:\n  strategy: prefix-aware\n{text}"),
        )
        .expect_err(text);
        assert!(
            e.path.contains(path) && e.message.contains(msg),
            "{text:?}: {e}"
        );
    }
    let e = parse(
        "p.yaml",
        "routing_policy:\n  strategy: least-loaded\n  affinity: {}\n",
    )
    .expect_err("affinity without prefix-aware");
    assert_eq!(e.path, "routing_policy.affinity");
}

#[test]
fn each_agent_gets_the_verdict_of_the_first_gate_that_removes_it() {
    let step = gate(500.0);
    let cases = [
        (
            facts(1, true, 0, 10, Some(50.0), "vllm"),
            &[][..],
            "eligible",
        ),
        (
            facts(2, false, 0, 10, Some(50.0), "vllm"),
            &[][..],
            "unhealthy",
        ),
        (
            facts(3, true, 0, 10, Some(50.0), "vllm"),
            &[3u64][..],
            "prev_failed",
        ),
        (
            facts(4, true, 10, 10, Some(50.0), "vllm"),
            &[][..],
            "at_capacity",
        ),
        (
            facts(5, true, 0, 10, Some(900.0), "vllm"),
            &[][..],
            "exclude_if",
        ),
        // Unhealthy and slow: the first gate in order names it.
        (
            facts(6, false, 10, 10, Some(900.0), "vllm"),
            &[6u64][..],
            "unhealthy",
        ),
    ];
    for (a, failed, want) in cases {
        assert_eq!(
            verdict(&step, Capability::Llm, &a, failed),
            want,
            "agent {}",
            a.id
        );
    }
    let emb = facts(7, true, 0, 10, None, "vllm");
    assert_eq!(
        verdict(&step, Capability::Embedding, &emb, &[]),
        "capability_mismatch"
    );
}
