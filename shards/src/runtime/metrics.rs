//! `/metrics` on the metrics port: gathers every shard's snapshot by
//! message and renders the Prometheus text format.

use std::fmt::Write as _;
use std::rc::Rc;

use super::conn::Conn;
use super::shard::{Shard, ShardSnapshot};
use crate::logic::http_parse;
use crate::logic::http_write;

fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Render snapshots as Prometheus text.
pub fn render(snaps: &[ShardSnapshot], storage_errors: u64) -> String {
    let mut o = String::with_capacity(4096);
    let _ = writeln!(o, "# HELP hivenet_storage_errors_total Failed history-store operations (open, flush, lookup, reset).");
    let _ = writeln!(o, "# TYPE hivenet_storage_errors_total counter");
    let _ = writeln!(o, "hivenet_storage_errors_total {storage_errors}");
    let _ = writeln!(
        o,
        "# HELP hivenet_shard_requests_total Inference requests served by each shard."
    );
    let _ = writeln!(o, "# TYPE hivenet_shard_requests_total counter");
    for s in snaps {
        let _ = writeln!(
            o,
            "hivenet_shard_requests_total{{shard=\"{}\"}} {}",
            s.shard, s.requests
        );
    }
    let _ = writeln!(
        o,
        "# HELP hivenet_shard_handoffs_total Client connections handed between shards."
    );
    let _ = writeln!(o, "# TYPE hivenet_shard_handoffs_total counter");
    for s in snaps {
        let _ = writeln!(
            o,
            "hivenet_shard_handoffs_total{{shard=\"{}\",direction=\"out\"}} {}",
            s.shard, s.handoffs_out
        );
        let _ = writeln!(
            o,
            "hivenet_shard_handoffs_total{{shard=\"{}\",direction=\"in\"}} {}",
            s.shard, s.handoffs_in
        );
    }
    let _ = writeln!(o, "# HELP hivenet_agent_links_rejected_total Agent links refused (preamble, handshake or registration).");
    let _ = writeln!(o, "# TYPE hivenet_agent_links_rejected_total counter");
    for s in snaps {
        let _ = writeln!(
            o,
            "hivenet_agent_links_rejected_total{{shard=\"{}\"}} {}",
            s.shard, s.links_rejected
        );
    }
    let agents: Vec<_> = snaps.iter().flat_map(|s| s.agents.iter()).collect();
    let label_a = |a: &super::shard::AgentView| {
        format!(
            "peer_id=\"{}\",region=\"{}\",engine=\"{}\",model=\"{}\",capacity=\"{}\",organization=\"{}\",machine=\"{}\"",
            esc(&a.peer_id), esc(&a.reg.region), esc(&a.reg.engine), esc(&a.reg.model), a.reg.capacity, esc(&a.reg.organization), esc(&a.reg.machine)
        )
    };
    let label_u = |a: &super::shard::AgentView| {
        format!(
            "peer_id=\"{}\",model=\"{}\",engine=\"{}\",organization=\"{}\",machine=\"{}\"",
            esc(&a.peer_id),
            esc(&a.reg.model),
            esc(&a.reg.engine),
            esc(&a.reg.organization),
            esc(&a.reg.machine)
        )
    };
    let _ = writeln!(
        o,
        "# HELP hivenet_routing_agent_info 1 while the agent is registered."
    );
    let _ = writeln!(o, "# TYPE hivenet_routing_agent_info gauge");
    for a in &agents {
        let _ = writeln!(o, "hivenet_routing_agent_info{{{}}} 1", label_a(a));
    }
    let _ = writeln!(
        o,
        "# HELP hivenet_routing_agent_healthy 1 when the agent is routable."
    );
    let _ = writeln!(o, "# TYPE hivenet_routing_agent_healthy gauge");
    for a in &agents {
        let _ = writeln!(
            o,
            "hivenet_routing_agent_healthy{{{}}} {}",
            label_a(a),
            u8::from(a.healthy)
        );
    }
    let _ = writeln!(
        o,
        "# HELP hivenet_agent_active_requests Requests in flight on the agent."
    );
    let _ = writeln!(o, "# TYPE hivenet_agent_active_requests gauge");
    for a in &agents {
        let _ = writeln!(
            o,
            "hivenet_agent_active_requests{{{}}} {}",
            label_u(a),
            a.active
        );
    }
    let _ = writeln!(
        o,
        "# HELP hivenet_agent_requests_success_total Successful requests per agent."
    );
    let _ = writeln!(o, "# TYPE hivenet_agent_requests_success_total counter");
    for a in &agents {
        let _ = writeln!(
            o,
            "hivenet_agent_requests_success_total{{{}}} {}",
            label_u(a),
            a.success
        );
    }
    let _ = writeln!(
        o,
        "# HELP hivenet_agent_requests_failed_total Failed requests per agent."
    );
    let _ = writeln!(o, "# TYPE hivenet_agent_requests_failed_total counter");
    for a in &agents {
        let _ = writeln!(
            o,
            "hivenet_agent_requests_failed_total{{{}}} {}",
            label_u(a),
            a.failed
        );
    }
    type Get = fn(&super::shard::AgentView) -> Option<f64>;
    let per_agent: [(&str, &str, &str, Get); 10] = [
        (
            "hivenet_agent_input_tokens_total",
            "counter",
            "Input tokens per agent (from response usage).",
            |a| Some(a.input_tokens as f64),
        ),
        (
            "hivenet_agent_output_tokens_total",
            "counter",
            "Output tokens per agent (from response usage).",
            |a| Some(a.output_tokens as f64),
        ),
        (
            "hivenet_agent_disconnections_total",
            "counter",
            "Times the agent's link closed.",
            |a| Some(a.disconnections as f64),
        ),
        (
            "hivenet_agent_failure_total",
            "counter",
            "Missed-heartbeat healthy to unhealthy transitions.",
            |a| Some(a.agent_failures as f64),
        ),
        (
            "hivenet_model_backend_failure_total",
            "counter",
            "Backend-unhealthy transitions reported by the agent.",
            |a| Some(a.backend_failures as f64),
        ),
        (
            "hivenet_agent_success_rate",
            "gauge",
            "Lifetime successful / all requests.",
            |a| {
                let t = a.success + a.failed;
                (t > 0).then(|| a.success as f64 / t as f64)
            },
        ),
        // Latency: emitted only while the estimator is KNOWN (no misleading 0).
        (
            "hivenet_agent_srtt_ms",
            "gauge",
            "Smoothed request latency to response headers, ms (only once known).",
            |a| a.srtt,
        ),
        (
            "hivenet_agent_rttvar_ms",
            "gauge",
            "Latency variation, ms (only once known).",
            |a| a.rttvar,
        ),
        (
            "hivenet_router_agent_srtt_ms",
            "gauge",
            "Older name of hivenet_agent_srtt_ms.",
            |a| a.srtt,
        ),
        (
            "hivenet_router_agent_rttvar_ms",
            "gauge",
            "Older name of hivenet_agent_rttvar_ms.",
            |a| a.rttvar,
        ),
    ];
    for (name, kind, help, get) in per_agent {
        let _ = writeln!(o, "# HELP {name} {help}");
        let _ = writeln!(o, "# TYPE {name} {kind}");
        for a in &agents {
            if let Some(v) = get(a) {
                let _ = writeln!(o, "{name}{{{}}} {v}", label_u(a));
            }
        }
    }
    o
}

/// Serve the metrics port.
pub async fn serve(shard: Rc<Shard>, mut conn: Conn) {
    loop {
        let head = loop {
            match http_parse::parse_request_head(&conn.buf) {
                Ok(Some((h, n))) => {
                    conn.consume(n);
                    break h;
                }
                Ok(None) => {}
                Err(_) => return,
            }
            match monoio::time::timeout(std::time::Duration::from_secs(30), conn.fill()).await {
                Ok(Ok(n)) if n > 0 => {}
                _ => return,
            }
        };
        let keep = head.keep_alive && head.framing == http_parse::BodyFraming::None;
        let mut out = Vec::new();
        if head.method == "GET" && head.path_only() == "/metrics" {
            let snaps = shard.gather().await;
            let body = render(
                &snaps,
                shard
                    .shared
                    .storage_errors
                    .load(std::sync::atomic::Ordering::Relaxed),
            );
            http_write::write_full_response(
                &mut out,
                200,
                "text/plain; version=0.0.4; charset=utf-8",
                body.as_bytes(),
                keep,
                &[],
            );
        } else {
            http_write::write_full_response(
                &mut out,
                404,
                "text/plain",
                b"404 page not found\n",
                keep,
                &[],
            );
        }
        if conn.write_all(out).await.is_err() || !keep {
            return;
        }
    }
}
