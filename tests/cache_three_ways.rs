//! Issue 53: the cache hit three ways on real engines. Three llama-servers
//! behind `strategy: prefix-aware`, multi-turn conversations: what the
//! index predicted, what the pick captured (sent to that holder) and what
//! the engines delivered (`hivenet_affinity_cache_tokens_total{stage}`);
//! delivered equals, token for token, both what the clients were told
//! (`prompt_tokens_details.cached_tokens`) and the engines' own counter
//! (`llamacpp:prompt_tokens_cached_total`, summed over the three); the
//! per-agent counters add up to the model's.

mod common;
use common::llama::*;
use common::*;
use std::time::Duration;

fn turn_body(model: &str, conv: usize, turn: usize) -> String {
    let system =
        format!("You are assistant number {conv}. ") + &"Be precise and brief. ".repeat(30);
    let mut msgs = vec![serde_json::json!({"role": "system", "content": system})];
    for t in 0..=turn {
        msgs.push(serde_json::json!({"role": "user", "content": format!("Question {t} of conversation {conv}: name a river.")}));
        if t < turn {
            msgs.push(serde_json::json!({"role": "assistant", "content": format!("Answer {t}: the Nile.")}));
        }
    }
    serde_json::json!({"model": model, "max_tokens": 4, "messages": msgs}).to_string()
}

fn engine_counter(port: u16, name: &str) -> u64 {
    let text = Req::get("/metrics")
        .send(port)
        .map(|r| r.text())
        .unwrap_or_default();
    text.lines()
        .find_map(|l| {
            l.strip_prefix(name)
                .and_then(|v| v.trim().parse::<f64>().ok())
        })
        .unwrap_or_else(|| panic!("{name} missing in {text}")) as u64
}

#[test]
fn predicted_captured_and_delivered_agree_with_the_engines() {
    let dir = tmpdir("cache-three-ways");
    let pf = dir.join("policy.yaml");
    std::fs::write(&pf, "routing_policy:\n  strategy: prefix-aware\n").expect("policy");
    let pfs = pf.to_string_lossy().to_string();
    let r = start_router(&dir, &["--shards", "1", "--policy-file", &pfs], &[]);
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let _llamas: Vec<Proc> = ports.iter().map(|p| start_llama(&dir, *p, &[])).collect();
    let _agents: Vec<Proc> = ports
        .iter()
        .enumerate()
        .map(|(k, p)| {
            let m = format!("a{k}");
            start_agent(
                &dir,
                &r,
                *p,
                &format!("{m}.key"),
                &["--engine", "llamacpp", "--warmup", "off", "--machine", &m],
            )
        })
        .collect();
    wait_until(
        Duration::from_secs(60),
        || {
            let t = routing_table(r.http);
            t["agents"].as_array().is_some_and(|a| {
                a.len() == 3 && a.iter().all(|x| x["status"]["backend_healthy"] == true)
            })
        },
        "three agents, backends healthy",
    );
    let model = routing_table(r.http)["agents"][0]["metadata"]["model"]
        .as_str()
        .expect("model")
        .to_string();
    let (mut told_cached, mut told_input) = (0u64, 0u64);
    for turn in 0..3 {
        for conv in 0..4 {
            let resp = Req::post("/v1/chat/completions", turn_body(&model, conv, turn))
                .send(r.http)
                .expect("chat");
            assert_eq!(resp.status, 200, "{}", resp.text());
            let u = &resp.json()["usage"];
            told_cached += u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .expect("cached_tokens");
            told_input += u["prompt_tokens"].as_u64().expect("prompt_tokens");
        }
    }
    let stage = |s: &str| -> u64 {
        metric(
            r.metrics,
            &format!("hivenet_affinity_cache_tokens_total{{model=\"{model}\",stage=\"{s}\"}}"),
        )
        .unwrap_or(0.0) as u64
    };
    let (predicted, captured, delivered) =
        (stage("predicted"), stage("captured"), stage("delivered"));
    let engines: u64 = ports
        .iter()
        .map(|p| engine_counter(*p, "llamacpp:prompt_tokens_cached_total"))
        .sum();
    eprintln!(
        "cache three ways: input {told_input}, predicted {predicted}, captured {captured}, delivered {delivered}; engines' counters {engines}, clients told {told_cached}"
    );
    assert_eq!(delivered, engines, "delivered is the engines' own sum");
    // Per agent, the same three ways add up to the model's.
    let text = metrics_text(r.metrics);
    let per_agent = |name: &str| -> u64 {
        text.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
            .sum::<f64>() as u64
    };
    assert_eq!(
        per_agent("hivenet_agent_cache_predicted_tokens_total"),
        predicted
    );
    assert_eq!(
        per_agent("hivenet_agent_cache_captured_tokens_total"),
        captured
    );
    assert_eq!(
        per_agent("hivenet_agent_cached_prompt_tokens_total"),
        delivered
    );
    assert_eq!(delivered, told_cached, "and what the clients were told");
    assert!(captured <= predicted, "{captured} <= {predicted}");
    assert!(captured > 0, "turns after the first went to their holder");
    assert!(delivered > 0);
}
