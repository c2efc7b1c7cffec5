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
pub fn render(snaps: &[ShardSnapshot]) -> String {
    let mut o = String::with_capacity(4096);
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
            let body = render(&snaps);
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
