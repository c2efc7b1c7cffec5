//! The agent's part of a request's trace (issue 53): a server span under
//! the router's attempt (its `traceparent`), and a client span for the
//! backend call (time to its head, to its first byte, the events and
//! bytes relayed) whose ID the engine receives as its parent, so an
//! engine that exports (vLLM) joins the same trace. Built only when the
//! export is on; the router's head decision (the `traceparent`'s sampled
//! flag) is followed, and an error or a slow request is kept anyway.
//!
//! Key items: [`AgentTrace`].

use std::sync::Arc;
use std::time::Instant;

use shards::logic::http::framing::http_parse::{Headers, RequestHead};
use shards::logic::http::trace_context::{self, SAMPLED, TRACEPARENT_LEN};
use shards::logic::trace::sampler::Notable;
use shards::logic::trace::span::{traceparent, Kind, Span};
use shards::runtime::services::otlp::TraceExport;

use shards::runtime::request::spans::span_id;
use shards::runtime::wire::clock::unix_ns;

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

struct Traced {
    export: Arc<TraceExport>,
    head: bool,
    server: Span,
    backend: Span,
    started: Instant,
    /// The request's headers with the backend span as the parent.
    headers: Headers,
    first_byte: bool,
    events: u64,
    bytes: u64,
}

/// One request's trace on the agent (`None` inside: not traced).
pub struct AgentTrace(Option<Box<Traced>>);

impl AgentTrace {
    /// The trace of `head`, when the export is on and the router sent a
    /// valid `traceparent`.
    pub fn begin(export: Option<&Arc<TraceExport>>, engine: &str, head: &RequestHead) -> Self {
        let Some(export) = export else {
            return AgentTrace(None);
        };
        let Some(tp) = head.header("traceparent").and_then(trace_context::parse) else {
            return AgentTrace(None);
        };
        let now = unix_ns();
        let path = head.path_only();
        let mut server = Span::new(
            tp.trace_id,
            span_id(),
            Some(tp.parent_id),
            format!("agent {} {path}", head.method),
            Kind::Server,
            now,
        );
        server.set("http.request.method", &*head.method);
        server.set("url.path", path);
        let mut backend = Span::new(
            tp.trace_id,
            span_id(),
            Some(server.span_id),
            format!("backend {} {path}", head.method),
            Kind::Client,
            now,
        );
        backend.set("hivenet.backend.engine", engine);
        let mut value = [0u8; TRACEPARENT_LEN];
        traceparent(&tp.trace_id, &backend.span_id, &mut value);
        if tp.flags & SAMPLED == 0 {
            if let Some(f) = value.get_mut(53..55) {
                f.copy_from_slice(b"00");
            }
        }
        let headers = Headers::from_pairs(
            head.headers
                .iter()
                .filter(|(n, _)| !n.eq_ignore_ascii_case("traceparent"))
                .chain([("traceparent", &value[..])]),
        );
        AgentTrace(Some(Box::new(Traced {
            export: export.clone(),
            head: tp.flags & SAMPLED != 0,
            server,
            backend,
            started: Instant::now(),
            headers,
            first_byte: false,
            events: 0,
            bytes: 0,
        })))
    }

    /// The headers the backend receives: the request's, with the backend
    /// span as the parent when traced.
    pub fn headers<'a>(&'a self, head: &'a RequestHead) -> &'a Headers {
        match &self.0 {
            Some(t) => &t.headers,
            None => &head.headers,
        }
    }

    /// The backend's head arrived with `status`.
    pub fn head(&mut self, status: u16) {
        if let Some(t) = self.0.as_deref_mut() {
            t.backend.set("http.response.status_code", status);
            t.backend
                .set("hivenet.backend.time_to_head_ms", ms(t.started.elapsed()));
        }
    }

    /// A piece of the answer was relayed (`payload`: its bytes).
    pub fn piece(&mut self, payload: &[u8]) {
        if let Some(t) = self.0.as_deref_mut() {
            if !t.first_byte && !payload.is_empty() {
                t.first_byte = true;
                t.backend.set(
                    "hivenet.backend.time_to_first_byte_ms",
                    ms(t.started.elapsed()),
                );
            }
            t.bytes += payload.len() as u64;
            t.events += payload.windows(5).filter(|w| *w == b"data:").count() as u64;
        }
    }

    /// The request ended (`Err`: why it failed): the spans go to the
    /// export thread when the router sampled the trace, or it failed, or
    /// it was slow.
    pub fn end(self, failed: Option<&str>) {
        let Some(mut t) = self.0 else {
            return;
        };
        let end = unix_ns();
        t.backend.set("hivenet.backend.bytes", t.bytes);
        if t.events > 0 {
            t.backend.set("hivenet.backend.events", t.events);
        }
        if let Some(why) = failed {
            t.backend.fail(why);
            t.server.fail(why);
        }
        t.backend.end(end);
        t.server.end(end);
        let notable = Notable {
            error: failed.is_some(),
            elapsed_ms: u64::try_from(t.started.elapsed().as_millis()).unwrap_or(u64::MAX),
            ..Notable::default()
        };
        if t.export.sampler.keep(t.head, notable) {
            let Traced {
                export,
                server,
                backend,
                ..
            } = *t;
            export.send(vec![backend, server]);
        }
    }
}
