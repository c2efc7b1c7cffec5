//! What the latency and history tests read of the routing table.

use super::*;

pub fn agents(http: u16) -> Vec<serde_json::Value> {
    routing_table(http)["agents"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

pub fn by_machine(http: u16, machine: &str) -> serde_json::Value {
    agents(http)
        .into_iter()
        .find(|a| a["metadata"]["machine"] == machine)
        .unwrap_or_else(|| panic!("no agent on machine {machine}"))
}

pub fn srtt(a: &serde_json::Value) -> Option<f64> {
    a["universal"]["srtt_ms"].as_f64()
}

pub fn rttvar(a: &serde_json::Value) -> Option<f64> {
    a["universal"]["rttvar_ms"].as_f64()
}

pub fn chat(http: u16, model: &str, stream: bool, max_tokens: u32) {
    let body = format!(
        r#"{{"model":"{model}","stream":{stream},"max_tokens":{max_tokens},"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    let (st, b) = Req::post("/v1/chat/completions", &body)
        .send(http)
        .map(Resp::pair)
        .expect("chat");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
}

/// Whether an SRTT/RTTVAR pair follows from the previous one by one
/// sample under either smoothing factor (the asymmetric rule).
pub fn solve_sample_consistent(old_s: f64, old_v: f64, new_s: f64, new_v: f64) -> bool {
    // Either alpha: R = old + (new - old)/alpha; check the RTTVAR rule.
    [0.5, 0.125].iter().any(|alpha| {
        let r = old_s + (new_s - old_s) / alpha;
        let improving = r < old_s;
        let alpha_ok = if improving {
            *alpha == 0.5
        } else {
            *alpha == 0.125
        };
        let v = 0.75 * old_v + 0.25 * (old_s - r).abs();
        alpha_ok && r > 0.0 && (v - new_v).abs() < 1e-6 * new_v.max(1.0)
    })
}
