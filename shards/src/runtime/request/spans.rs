//! The request's trace (issue 53), its room: one server span for the
//! request, children for what explains it (a hold at zero, each attempt
//! to an agent with the decision that chose it, a continuation, the
//! fallback provider), and attributes for the rest (ingress, redirect,
//! admission, usage, the cache hit). Built only when the OTLP export is
//! on (`OTEL_EXPORTER_OTLP_ENDPOINT`); every hook is one `if let` on
//! `None` otherwise. The spans travel with the request (a hand-off to
//! another shard carries them) and leave at its one ending
//! ([`finish`]), where the sampler's tail rule decides.
//!
//! The `traceparent` the agent receives names the attempt's span as its
//! parent, so the agent's and the engine's spans join the trace under
//! the attempt that caused them.
//!
//! Key items: [`begin`], [`with`], [`finish`]; the data is
//! [`RequestTrace`].

use std::time::Duration;

use super::forward::Outcome;
use crate::logic::http::api::usage::Tokens;
use crate::logic::http::framing::http_parse::RequestHead;
use crate::logic::http::trace_context::{self, TRACEPARENT_LEN};
use crate::logic::routing::affinity::AffinityPick;
use crate::logic::routing::decision::{AdmitEnd, Decision};
use crate::logic::routing::refusal::Refusal;
use crate::logic::routing::wait_queue::Class;
use crate::logic::trace::request::RequestTrace;
use crate::logic::trace::span::{traceparent, Kind, Span, Value};
use crate::runtime::state::model::agent::Agent;
use crate::runtime::state::model::ModelState;
use crate::runtime::state::scope::{Client, RequestScope};
use crate::runtime::state::shard::Shard;
use crate::runtime::wire::clock;

use crate::runtime::wire::clock::unix_ns;

/// Unix nanoseconds of `at` (an instant in the past).
fn unix_of(at: clock::Instant) -> u64 {
    let ago = clock::now().saturating_duration_since(at);
    unix_ns().saturating_sub(u64::try_from(ago.as_nanos()).unwrap_or(0))
}

/// A fresh span ID (never all zero), for the router's and the agent's spans.
pub fn span_id() -> [u8; 8] {
    let mut id: [u8; 8] = rand::random();
    if id == [0; 8] {
        id[7] = 1;
    }
    id
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Start the request's trace (inference routes, export on): its span
/// becomes the parent in the `traceparent` sent on and echoed.
pub fn begin(shard: &Shard, scope: &mut RequestScope, head: &RequestHead, route: &str) {
    let (Some(export), Some(trace)) = (shard.router.traces.as_ref(), scope.trace.as_mut()) else {
        return;
    };
    let client = trace
        .from_client
        .then(|| trace_context::parse(&trace.header))
        .flatten();
    let trace_id = match &client {
        Some(c) => c.trace_id,
        None => trace_context::parse(&trace.header)
            .map(|t| t.trace_id)
            .unwrap_or_else(rand::random),
    };
    let sampled = export.sampler.head(&trace_id, client.map(|c| c.flags));
    let mut root = Span::new(
        trace_id,
        span_id(),
        client.map(|c| c.parent_id),
        format!("{} {route}", head.method),
        Kind::Server,
        unix_of(scope.started),
    );
    root.set("http.request.method", &*head.method);
    root.set("url.path", route);
    root.set("hivenet.request_id", scope.request_id.to_string());
    let mut header = [0u8; TRACEPARENT_LEN];
    traceparent(&trace_id, &root.span_id, &mut header);
    if !sampled {
        if let Some(flags) = header.get_mut(53..55) {
            flags.copy_from_slice(b"00");
        }
    }
    trace.header = header;
    scope.spans = Some(Box::new(RequestTrace::new(root, sampled)));
}

/// Run `f` on the request's spans, if it is traced.
pub fn with(scope: &mut RequestScope, f: impl FnOnce(&mut RequestTrace)) {
    if let Some(s) = scope.spans.as_deref_mut() {
        f(s);
    }
}

/// Ingress: who asked for what (after the key, the alias and the
/// allowlist passed).
pub fn ingress(
    scope: &mut RequestScope,
    tenant: &str,
    key_id: &str,
    model: &str,
    alias: Option<&str>,
) {
    with(scope, |s| {
        s.root.set("hivenet.tenant", tenant);
        s.root.set("hivenet.key_id", key_id);
        s.root.set("gen_ai.request.model", model);
        if let Some(a) = alias {
            s.root.set("hivenet.alias", a);
        }
    });
}

/// Redirected to a sibling site (307).
pub fn redirected(scope: &mut RequestScope, site: &str, location: &str) {
    with(scope, |s| {
        s.root.set("hivenet.redirect.site", site);
        s.root.set("hivenet.redirect.location", location);
        s.root.set(
            "hivenet.redirect.reason",
            "no healthy agent here; a sibling site serves the model",
        );
        s.notable.redirected = true;
    });
}

/// A hold at zero ended (`woken`, `expired`, `cancelled`, ...).
pub fn held(scope: &mut RequestScope, started: clock::Instant, budget: Duration, outcome: &str) {
    let keepalives = scope.keepalive.as_ref().map(|k| k.every);
    with(scope, |s| {
        let mut h = s.child("hivenet.hold", Kind::Internal, span_id(), unix_of(started));
        h.set("hivenet.hold.budget_ms", ms(budget));
        h.set("hivenet.hold.outcome", outcome);
        if let Some(every) = keepalives {
            h.set("hivenet.hold.keepalive_every_ms", ms(every));
            let sent = started.elapsed().as_millis() / every.as_millis().max(1);
            h.set(
                "hivenet.hold.keepalives_sent",
                u64::try_from(sent).unwrap_or(u64::MAX),
            );
        }
        if outcome != "woken" {
            h.fail(format!("hold ended: {outcome}"));
        }
        h.end(unix_ns());
        s.keep(h);
        s.notable.held = true;
    });
}

/// Admission (B1-B4) let it through or not; `parked`: how long it took.
pub fn admitted(scope: &mut RequestScope, end: &AdmitEnd, parked: Duration) {
    with(scope, |s| {
        let verdict = match end {
            AdmitEnd::Admitted => "admitted".to_string(),
            AdmitEnd::Refused(reason, e) => format!("refused ({reason:?}): {}", e.message),
            AdmitEnd::WaitEnded => "parked until its wait ended, without room".to_string(),
            AdmitEnd::ClientGone => "the client left while parked".to_string(),
        };
        s.root.set("hivenet.admission", verdict);
        s.root.set("hivenet.admission.parked_ms", ms(parked));
    });
}

/// The machine refused the request: which rule (a quota's limit, an
/// admission gate, the routing steps) and what the client was told.
pub fn refused(c: &mut Client, r: &Refusal, model: &str) {
    with(&mut c.scope, |s| {
        s.root.set("hivenet.refusal", r.reason());
        s.root
            .set("hivenet.refusal.message", r.error(model).message);
    });
}

/// An attempt to `agent` begins: its span (the decision that chose the
/// agent in its attributes) becomes the parent in the `traceparent` the
/// agent receives (patched into `request`, the bytes about to be sent).
pub fn attempt_begins(
    c: &mut Client,
    d: &Decision,
    step_name: &str,
    agent: &Agent,
    waited: Option<(Duration, Class)>,
    request: &mut [u8],
) {
    with(&mut c.scope, |s| {
        if !s.has_room() {
            return;
        }
        let mut a = s.child("hivenet.attempt", Kind::Client, span_id(), unix_ns());
        a.set("hivenet.agent.peer_id", &*agent.peer);
        a.set("hivenet.agent.engine", &*agent.labels.1);
        a.set("hivenet.decision.step", step_name);
        a.set("hivenet.decision.trail", d.trail());
        a.set("hivenet.agent.active", u64::from(agent.active.get()));
        a.set("hivenet.agent.capacity", u64::from(agent.reg.capacity));
        if let Some(srtt) = agent.est.get().srtt() {
            a.set("hivenet.agent.srtt_ms", srtt);
        }
        if let Some((w, class)) = waited {
            a.set("hivenet.queue.wait_ms", ms(w));
            a.set("hivenet.queue.class", class.as_str());
        }
        patch_parent(request, &a.span_id);
        s.attempt = Some(a);
    });
}

/// Most agents whose verdict an attempt lists.
const VERDICTS_MAX: usize = 32;

/// The attempt just begun: each agent's verdict at its step (the gate
/// that removed it, or `eligible`), by the last 8 characters of its peer
/// ID; and the tenant's share of the model's running requests.
pub fn verdicts(c: &mut Client, d: &Decision, m: &ModelState, tenant: u64) {
    with(&mut c.scope, |s| {
        let Some(a) = s.attempt.as_mut() else {
            return;
        };
        let (mine, all, tenants) = super::fairness::tenant_share(m, tenant);
        a.set("hivenet.queue.tenant_running", u64::from(mine));
        a.set("hivenet.queue.model_running", u64::from(all));
        a.set("hivenet.queue.tenants_running", tenants);
        let pool = &m.agents[..];
        let mut out = String::with_capacity(24 * pool.len().min(VERDICTS_MAX));
        for (id, v) in d.verdicts(pool, VERDICTS_MAX) {
            let peer = pool.iter().find(|x| x.id == id).map_or("?", |x| {
                x.peer
                    .get(x.peer.len().saturating_sub(8)..)
                    .unwrap_or(&x.peer)
            });
            if !out.is_empty() {
                out.push_str(", ");
            }
            out.push_str(peer);
            out.push_str(": ");
            out.push_str(v);
        }
        if pool.len() > VERDICTS_MAX {
            out.push_str(&format!(", +{} more", pool.len() - VERDICTS_MAX));
        }
        a.set("hivenet.decision.verdicts", out);
    });
}

/// Put `span` as the parent into the request's `traceparent` header.
fn patch_parent(request: &mut [u8], span: &[u8; 8]) {
    const NAME: &[u8] = b"\r\ntraceparent: ";
    let head_end = memchr::memmem::find(request, b"\r\n\r\n").unwrap_or(request.len());
    let Some(at) = request
        .get(..head_end)
        .and_then(|h| memchr::memmem::find(h, NAME))
    else {
        return;
    };
    let v = at + NAME.len();
    let Some(value) = request.get_mut(v..v + TRACEPARENT_LEN) else {
        return;
    };
    let mut fresh = [0u8; TRACEPARENT_LEN];
    let Some(tp) = trace_context::parse(value) else {
        return;
    };
    traceparent(&tp.trace_id, span, &mut fresh);
    if let (Some(f), Some(o)) = (fresh.get_mut(53..55), value.get(53..55)) {
        f.copy_from_slice(o);
    }
    value.copy_from_slice(&fresh);
}

/// The attempt ended: how, its latency sample, and the prefix-aware
/// pick that chose it (outcome, the holder's matched prefix in bytes).
pub fn attempt_ended(
    c: &mut Client,
    outcome: &Outcome,
    sample_ms: Option<f64>,
    affinity: Option<AffinityPick>,
) {
    with(&mut c.scope, |s| {
        let Some(mut a) = s.attempt.take() else {
            return;
        };
        match outcome {
            Outcome::Served { status, tokens } => {
                a.set("http.response.status_code", *status);
                if let Some(t) = tokens {
                    usage(&mut a, t);
                }
            }
            Outcome::ClientGone => a.set("hivenet.attempt.end", "client_gone"),
            Outcome::Failed(f) | Outcome::Broken(f) => a.fail(f.to_string()),
            Outcome::Full => a.fail("the agent was full (its other routers hold its capacity)"),
        }
        if let Some(ms) = sample_ms {
            a.set("hivenet.srtt_sample_ms", ms);
        }
        if let Some(pick) = affinity {
            a.set("hivenet.affinity.outcome", pick.outcome.as_str());
            if let Some(h) = pick.predicted {
                // The index's prediction (text bytes; 0: a session key).
                a.set("hivenet.cache.predicted_prefix_bytes", u64::from(h.depth));
                a.set("hivenet.cache.captured", pick.hit.is_some());
            }
            a.set("hivenet.affinity.holder_wait", pick.held);
        }
        a.end(unix_ns());
        s.keep(a);
    });
}

/// A broken stream's continuation begins on `agent` (`why`: the break,
/// `carried`: the content events delivered before it): its span is
/// closed by [`attempt_ended`] like an attempt's, and is the agent's
/// parent in the `traceparent` patched into `request`.
pub fn continuation_begins(
    c: &mut Client,
    agent: &Agent,
    why: &str,
    carried: u64,
    request: &mut [u8],
) {
    with(&mut c.scope, |s| {
        s.notable.continued = true;
        if !s.has_room() {
            return;
        }
        let mut k = s.child("hivenet.continuation", Kind::Client, span_id(), unix_ns());
        k.set("hivenet.agent.peer_id", &*agent.peer);
        k.set("hivenet.continuation.break", why);
        k.set("hivenet.continuation.carried_events", carried);
        patch_parent(request, &k.span_id);
        s.attempt = Some(k);
    });
}

/// The fallback provider answered `status` (0: nothing).
pub fn provider(c: &mut Client, name: &str, started: clock::Instant, status: u16) {
    with(&mut c.scope, |s| {
        let mut p = s.child(
            "hivenet.provider",
            Kind::Client,
            span_id(),
            unix_of(started),
        );
        p.set("hivenet.provider.name", name);
        p.set("http.response.status_code", status);
        if status == 0 || status >= 500 {
            p.fail(format!("the provider answered {status}"));
        }
        p.end(unix_ns());
        s.keep(p);
        s.notable.provider = true;
    });
}

/// The request ended: the request span gets the outcome and usage, the
/// sampler decides, the spans go to the export thread (never waiting).
pub fn finish(shard: &Shard, scope: &mut RequestScope) {
    let (Some(mut s), Some(export)) = (scope.spans.take(), shard.router.traces.as_ref()) else {
        return;
    };
    let end = &scope.ending;
    let r = &mut s.root;
    r.set("http.response.status_code", end.status);
    if !end.error_code.is_empty() {
        r.set("error.type", end.error_code);
    }
    if let Some(a) = &end.agent {
        r.set("hivenet.agent.peer_id", &*a.peer);
    }
    if let Some(t) = end.tokens {
        usage(r, &t);
    }
    if !end.continued_from.is_empty() {
        let from: Vec<&str> = end.continued_from.iter().map(|p| &**p).collect();
        r.set("hivenet.continued_from", from.join(","));
    }
    let failed = end.status >= 500 || end.status == 0;
    if failed {
        r.fail(format!("status {} {}", end.status, end.error_code));
    }
    s.notable.error = failed;
    s.notable.elapsed_ms = u64::try_from(scope.started.elapsed().as_millis()).unwrap_or(u64::MAX);
    if export.sampler.keep(s.head, s.notable) {
        export.send(s.into_spans(unix_ns()));
    }
}

/// The GenAI usage attributes, with the cache hit the engine delivered.
fn usage(r: &mut Span, t: &Tokens) {
    r.set("gen_ai.usage.input_tokens", t.input);
    r.set("gen_ai.usage.output_tokens", t.output);
    if t.cache_reported {
        r.set("gen_ai.usage.cache_read.input_tokens", t.cached);
        r.set("hivenet.cache.delivered_tokens", t.cached);
    }
}

/// An attribute's value for tests and the docs.
pub fn value_text(v: &Value) -> String {
    match v {
        Value::Str(s) => s.clone(),
        Value::Int(n) => n.to_string(),
        Value::F64(x) => x.to_string(),
        Value::Bool(b) => b.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_attempt_span_becomes_the_agents_parent() {
        let mut req = b"POST /v1/chat/completions HTTP/1.1\r\nHost: agent\r\ntraceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00\r\nContent-Length: 2\r\n\r\n{}".to_vec();
        patch_parent(&mut req, &[0x11; 8]);
        let text = String::from_utf8(req).expect("ascii");
        assert!(
            text.contains(
                "traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-1111111111111111-00\r\n"
            ),
            "{text}"
        );
        // A body that looks like a header is never touched.
        let mut req = b"POST / HTTP/1.1\r\n\r\n\r\ntraceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_vec();
        let before = req.clone();
        patch_parent(&mut req, &[0x11; 8]);
        assert_eq!(req, before);
    }
}
