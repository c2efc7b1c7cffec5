//! Client HTTP/1.1 connections: head and body under limits, routing by
//! path, probing the JSON body, and the one hand-off to the model's shard.
//!
//! The request path has one obvious seam for what later issues add
//! (policy, admission, quotas, holds): [`serve_inference`], which runs on
//! the owning shard before the proxy.

use std::rc::Rc;

use serde_json::json;
use tracing::debug;

use super::clock;
use super::conn::{Conn, HeadRead};
use super::handoff;
use super::mesh::{Endpoint, PendingRequest, ShardMsg};
use super::proxy::{self, Outcome};
use super::shard::{AgentView, Shard};
use crate::logic::errors::{ApiError, ErrorCode};
use crate::logic::http_parse::{self, BodyFraming, ChunkedDecoder, HeadError, RequestHead};
use crate::logic::http_write;
use crate::logic::probe;

/// Extra headers of every response: CORS and `X-Request-ID`.
pub fn extra_headers(request_id: &str) -> Vec<(&'static str, Vec<u8>)> {
    let mut v: Vec<(&'static str, Vec<u8>)> = CORS.iter().map(|(k, v)| (*k, v.to_vec())).collect();
    if !request_id.is_empty() {
        v.push(("X-Request-ID", request_id.as_bytes().to_vec()));
    }
    v
}

/// Borrowed view for the writers.
pub fn refs<'a>(v: &'a [(&'static str, Vec<u8>)]) -> Vec<(&'static str, &'a [u8])> {
    v.iter().map(|(k, b)| (*k, b.as_slice())).collect()
}

/// The request's ID: the client's `X-Request-ID` when it is a UUID, else a new v4.
pub fn request_id(head: &RequestHead) -> String {
    match head
        .header("x-request-id")
        .and_then(|v| std::str::from_utf8(v).ok())
        .map(str::trim)
    {
        Some(v) if crate::logic::request_id::valid(v) => v.to_string(),
        _ => crate::logic::request_id::format_v4(rand::random::<[u8; 16]>()),
    }
}

/// CORS headers on every response (spec 01 §1).
pub const CORS: [(&str, &[u8]); 3] = [
    ("Access-Control-Allow-Origin", b"*"),
    ("Access-Control-Allow-Methods", b"POST, GET, OPTIONS"),
    (
        "Access-Control-Allow-Headers",
        b"Content-Type, Authorization",
    ),
];

fn method_not_allowed(method: &str, path: &str) -> ApiError {
    ApiError::new(
        ErrorCode::MethodNotAllowed,
        format!("method {method} not allowed on {path}"),
    )
}

fn no_route(method: &str, path: &str) -> ApiError {
    ApiError::new(ErrorCode::NotFound, format!("no route for {method} {path}"))
}

async fn send_error(conn: &mut Conn, err: &ApiError, keep_alive: bool) -> bool {
    let mut out = Vec::with_capacity(256);
    let body = err.body();
    let headers = [("Content-Type".to_string(), b"application/json".to_vec())];
    let ex = extra_headers(&conn.request_id);
    http_write::write_response_head(
        &mut out,
        err.status,
        &headers,
        http_write::OutFraming::Length(body.len()),
        keep_alive,
        &refs(&ex),
    );
    out.extend_from_slice(&body);
    conn.write_all(out).await.is_ok() && keep_alive
}

async fn send_json(conn: &mut Conn, status: u16, body: &[u8], keep_alive: bool) -> bool {
    let mut out = Vec::with_capacity(body.len() + 256);
    http_write::write_full_response(
        &mut out,
        status,
        "application/json",
        body,
        keep_alive,
        &refs(&extra_headers(&conn.request_id)),
    );
    conn.write_all(out).await.is_ok() && keep_alive
}

/// Body read outcome.
enum BodyRead {
    Ok(Vec<u8>),
    TooLarge,
    Bad,
    Closed,
}

async fn read_body(conn: &mut Conn, framing: BodyFraming, limit: u64) -> BodyRead {
    match framing {
        BodyFraming::None => BodyRead::Ok(Vec::new()),
        BodyFraming::Length(n) => {
            if limit > 0 && n > limit {
                return BodyRead::TooLarge;
            }
            let Ok(n) = usize::try_from(n) else {
                return BodyRead::TooLarge;
            };
            while conn.buf.len() < n {
                match conn.fill().await {
                    Ok(0) | Err(_) => return BodyRead::Closed,
                    Ok(_) => {}
                }
            }
            let body = conn.buf.get(..n).unwrap_or(&[]).to_vec();
            conn.consume(n);
            BodyRead::Ok(body)
        }
        BodyFraming::Chunked => {
            let mut dec = ChunkedDecoder::new();
            let mut out = Vec::new();
            loop {
                match dec.decode(&conn.buf, &mut out, limit) {
                    Ok(used) => conn.consume(used),
                    Err(http_parse::ChunkError::TooLarge) => return BodyRead::TooLarge,
                    Err(http_parse::ChunkError::Bad) => return BodyRead::Bad,
                }
                if dec.is_done() {
                    return BodyRead::Ok(out);
                }
                match conn.fill().await {
                    Ok(0) | Err(_) => return BodyRead::Closed,
                    Ok(_) => {}
                }
            }
        }
        BodyFraming::UntilClose => BodyRead::Bad,
    }
}

/// Serve one client connection; `first` is a request handed over by another shard.
pub async fn serve(shard: Rc<Shard>, mut conn: Conn, first: Option<Box<PendingRequest>>) {
    if let Some(p) = first {
        conn.request_id = p.request_id.clone();
        if !serve_inference(&shard, &mut conn, *p).await {
            return;
        }
    }
    let cfg = shard.shared.cfg.clone();
    loop {
        let started = clock::now();
        let head = match monoio::time::timeout(cfg.header_timeout, conn.read_request_head()).await {
            Ok(Ok(h)) => {
                conn.request_id = request_id(&h);
                h
            }
            Ok(Err(HeadRead::Closed)) => return,
            Ok(Err(HeadRead::Bad(e))) => {
                conn.request_id = crate::logic::request_id::format_v4(rand::random::<[u8; 16]>());
                let err = match e {
                    HeadError::Bad(why) => ApiError::new(ErrorCode::RequestInvalid, why),
                    HeadError::TooLarge(why) => ApiError::new(ErrorCode::HeadersTooLarge, why),
                };
                send_error(&mut conn, &err, false).await;
                return;
            }
            Err(_) => {
                if !conn.buf.is_empty() {
                    send_error(
                        &mut conn,
                        &ApiError::new(ErrorCode::ClientTimeout, "request header timeout"),
                        false,
                    )
                    .await;
                }
                return;
            }
        };
        match route(&shard, &mut conn, head, started).await {
            Routed::Continue => {}
            Routed::Close => return,
            Routed::HandOff(pending, owner) => {
                hand_off(&shard, conn, *pending, owner);
                return;
            }
        }
    }
}

enum Routed {
    Continue,
    Close,
    HandOff(Box<PendingRequest>, usize),
}

fn ok(b: bool) -> Routed {
    if b {
        Routed::Continue
    } else {
        Routed::Close
    }
}

async fn route(
    shard: &Rc<Shard>,
    conn: &mut Conn,
    head: RequestHead,
    started: clock::Instant,
) -> Routed {
    let path = head.path_only().to_string();
    // Requests other than inference ones carry no body we want: close
    // rather than drain when one is declared.
    let keep = head.keep_alive && head.framing == BodyFraming::None;
    if head.method == "OPTIONS" {
        let mut out = Vec::new();
        http_write::write_response_head(
            &mut out,
            204,
            &[],
            http_write::OutFraming::Length(0),
            keep,
            &refs(&extra_headers(&conn.request_id)),
        );
        return ok(conn.write_all(out).await.is_ok() && keep);
    }
    if let Some(ep) = Endpoint::of(&path) {
        if head.method != "POST" {
            return ok(send_error(conn, &method_not_allowed(&head.method, &path), keep).await);
        }
        return read_and_dispatch(shard, conn, head, ep, started).await;
    }
    if path.starts_with("/admin/") || path == "/admin" {
        // Admin bodies (policy documents) are small: at most 1 MiB.
        const ADMIN_BODY: u64 = 1024 * 1024;
        let read = monoio::time::timeout(
            shard.shared.cfg.body_timeout,
            read_body(conn, head.framing, ADMIN_BODY),
        )
        .await;
        let Ok(BodyRead::Ok(body)) = read else {
            send_json(
                conn,
                400,
                br#"{"error":"failed to read request body (max 1 MB)"}"#,
                false,
            )
            .await;
            return Routed::Close;
        };
        return admin_route(shard, conn, &head, &path, head.keep_alive, &body).await;
    }
    match (head.method.as_str(), path.as_str()) {
        ("GET", "/health") => ok(send_json(conn, 200, br#"{"status":"ok"}"#, keep).await),
        ("GET", "/v1/models") => {
            let snaps = shard.gather().await;
            let body = models_list(snaps.iter().flat_map(|s| s.agents.iter()));
            ok(send_json(conn, 200, &body, keep).await)
        }
        ("GET", p) if p.starts_with("/v1/models/") => {
            let id = p.trim_start_matches("/v1/models/").to_string();
            let snaps = shard.gather().await;
            match model_detail(&id, snaps.iter().flat_map(|s| s.agents.iter())) {
                Some(body) => ok(send_json(conn, 200, &body, keep).await),
                None => ok(send_error(
                    conn,
                    &ApiError::new(
                        ErrorCode::ModelNotFound,
                        format!("No agents registered for model: {id}"),
                    ),
                    keep,
                )
                .await),
            }
        }
        (_, "/health" | "/v1/models") => {
            ok(send_error(conn, &method_not_allowed(&head.method, &path), keep).await)
        }
        (_, p) if p.starts_with("/v1/models/") => {
            ok(send_error(conn, &method_not_allowed(&head.method, &path), keep).await)
        }
        _ => ok(send_error(conn, &no_route(&head.method, &path), keep).await),
    }
}

async fn admin_route(
    shard: &Rc<Shard>,
    conn: &mut Conn,
    head: &RequestHead,
    path: &str,
    keep: bool,
    body: &[u8],
) -> Routed {
    if !super::admin::authorized(shard, head) {
        let err = super::admin::unauthorized();
        let mut out = Vec::with_capacity(256);
        let body = err.body();
        let headers = [("Content-Type".to_string(), b"application/json".to_vec())];
        let mut ex = extra_headers(&conn.request_id);
        ex.push((
            "WWW-Authenticate",
            br#"Bearer realm="hivenet-router""#.to_vec(),
        ));
        let extra = refs(&ex);
        http_write::write_response_head(
            &mut out,
            401,
            &headers,
            http_write::OutFraming::Length(body.len()),
            keep,
            &extra,
        );
        out.extend_from_slice(&body);
        return ok(conn.write_all(out).await.is_ok() && keep);
    }
    if let Some((status, body)) = super::admin::policy_api(shard, &head.method, path, body) {
        return ok(send_json(conn, status, &body, keep).await);
    }
    match (head.method.as_str(), path) {
        ("GET", "/admin/routing-table") => {
            let body = super::admin::routing_table(shard).await;
            ok(send_json(conn, 200, &body, keep).await)
        }
        ("POST", "/admin/metrics/reset") => match super::admin::reset_metrics(shard).await {
            Ok(body) => ok(send_json(conn, 200, &body, keep).await),
            Err(e) => {
                let body =
                    serde_json::to_vec(&json!({"error": format!("failed to reset metrics: {e}")}))
                        .unwrap_or_default();
                ok(send_json(conn, 500, &body, keep).await)
            }
        },
        ("GET", "/admin/models") => {
            let snaps = shard.gather().await;
            let body = models_list(snaps.iter().flat_map(|s| s.agents.iter()));
            ok(send_json(conn, 200, &body, keep).await)
        }
        ("GET", p) if p.starts_with("/admin/models/") => {
            let id = p.trim_start_matches("/admin/models/").to_string();
            let snaps = shard.gather().await;
            let v: Vec<&AgentView> = snaps
                .iter()
                .flat_map(|s| s.agents.iter())
                .filter(|a| a.reg.model == id)
                .collect();
            if v.is_empty() {
                let e = ApiError::new(
                    ErrorCode::ModelNotFound,
                    format!("No agents registered for model: {id}"),
                );
                return ok(send_error(conn, &e, keep).await);
            }
            let body = serde_json::to_vec(&model_object(&id, &v, true)).unwrap_or_default();
            ok(send_json(conn, 200, &body, keep).await)
        }
        ("GET", "/admin/registration-stream") => {
            registration_stream(shard, conn).await;
            Routed::Close
        }
        ("GET", "/admin/health") => {
            let snaps = shard.gather().await;
            let agents: Vec<&AgentView> = snaps.iter().flat_map(|s| s.agents.iter()).collect();
            let healthy = agents.iter().filter(|a| a.healthy).count();
            let list: Vec<_> = agents
                .iter()
                .map(|a| {
                    json!({"peer_id": a.peer_id, "model": a.reg.model, "engine": a.reg.engine, "version": a.reg.version,
                           "capacity": a.reg.capacity, "region": a.reg.region, "is_healthy": a.healthy, "last_seen": a.last_seen})
                })
                .collect();
            let queued: usize = snaps
                .iter()
                .flat_map(|s| s.models.iter())
                .map(|(_, st)| st.queue_depth)
                .sum();
            let body = json!({
                "status": if healthy > 0 { "healthy" } else { "degraded" },
                "total_agents": agents.len(),
                "healthy_agents": healthy,
                "queue_length": queued,
                "timestamp": super::clock::unix_secs(),
                "agents": list,
            });
            ok(send_json(
                conn,
                200,
                &serde_json::to_vec(&body).unwrap_or_default(),
                keep,
            )
            .await)
        }
        (
            _,
            "/admin/routing-table" | "/admin/metrics/reset" | "/admin/models" | "/admin/health",
        ) => ok(send_error(conn, &method_not_allowed(&head.method, path), keep).await),
        _ => ok(send_error(conn, &no_route(&head.method, path), keep).await),
    }
}

/// `GET /admin/registration-stream`: SSE `data:` lines for every agent
/// registration and removal, a `: keep-alive` comment every 25 s; the
/// stream ends when the client goes away.
async fn registration_stream(shard: &Rc<Shard>, conn: &mut Conn) {
    use futures::StreamExt;
    let (tx, mut rx) = futures::channel::mpsc::channel::<String>(super::shared::FEED_BUFFER);
    if let Ok(mut subs) = shard.shared.feed.lock() {
        subs.push(tx);
    }
    let mut out = Vec::with_capacity(512);
    let mut ex = extra_headers(&conn.request_id);
    ex.push(("Cache-Control", b"no-cache".to_vec()));
    ex.push(("X-Accel-Buffering", b"no".to_vec()));
    let headers = [("Content-Type".to_string(), b"text/event-stream".to_vec())];
    http_write::write_response_head(
        &mut out,
        200,
        &headers,
        http_write::OutFraming::Chunked,
        false,
        &refs(&ex),
    );
    if conn.write_all(out).await.is_err() {
        return;
    }
    loop {
        let frame = match monoio::time::timeout(std::time::Duration::from_secs(25), rx.next()).await
        {
            Ok(Some(line)) => format!("data: {line}\n\n"),
            Ok(None) => return,
            Err(_) => ": keep-alive\n\n".to_string(),
        };
        let mut chunk = Vec::with_capacity(frame.len() + 16);
        http_write::write_chunk(&mut chunk, frame.as_bytes());
        if conn.write_all(chunk).await.is_err() {
            return;
        }
    }
}

async fn read_and_dispatch(
    shard: &Rc<Shard>,
    conn: &mut Conn,
    head: RequestHead,
    ep: Endpoint,
    started: clock::Instant,
) -> Routed {
    let cfg = &shard.shared.cfg;
    let limit = cfg.max_request_bytes;
    if let BodyFraming::Length(n) = head.framing {
        if limit > 0 && n > limit {
            // Rejected from the declared length, before reading it.
            send_error(conn, &ApiError::body_too_large(limit), false).await;
            return Routed::Close;
        }
    }
    if head.expect_continue
        && head.framing != BodyFraming::None
        && conn.buf.is_empty()
        && conn
            .write_all(
                b"HTTP/1.1 100 Continue

"
                .to_vec(),
            )
            .await
            .is_err()
    {
        return Routed::Close;
    }
    let body =
        match monoio::time::timeout(cfg.body_timeout, read_body(conn, head.framing, limit)).await {
            Ok(BodyRead::Ok(b)) => b,
            Ok(BodyRead::TooLarge) => {
                send_error(conn, &ApiError::body_too_large(limit), false).await;
                return Routed::Close;
            }
            Ok(BodyRead::Bad) => {
                send_error(
                    conn,
                    &ApiError::new(ErrorCode::RequestInvalid, "failed to read request body"),
                    false,
                )
                .await;
                return Routed::Close;
            }
            Ok(BodyRead::Closed) => return Routed::Close,
            Err(_) => {
                send_error(
                    conn,
                    &ApiError::new(ErrorCode::ClientTimeout, "request body deadline exceeded"),
                    false,
                )
                .await;
                return Routed::Close;
            }
        };
    let keep = head.keep_alive;
    let meta = match probe::probe(&body) {
        Ok(m) => m,
        Err(e) => return ok(send_error(conn, &e, keep).await),
    };
    // Unknown model: answered here; no directory entry, no metric series.
    let Some(owner) = shard.owner(&meta.model) else {
        return ok(send_error(
            conn,
            &ApiError::new(
                ErrorCode::ModelNotFound,
                "No agents registered for this model",
            ),
            keep,
        )
        .await);
    };
    let pending = PendingRequest {
        head,
        body,
        meta,
        endpoint: ep,
        received_at: started,
        request_id: conn.request_id.clone(),
    };
    if owner != shard.id {
        return Routed::HandOff(Box::new(pending), owner);
    }
    ok(serve_inference(shard, conn, pending).await)
}

/// Serve one inference request on its model's shard. Returns whether the
/// connection stays open. Later issues plug policy, admission, quotas and
/// holds in here, before the proxy.
pub async fn serve_inference(shard: &Rc<Shard>, conn: &mut Conn, p: PendingRequest) -> bool {
    shard.count_request();
    debug!(shard = shard.id, model = %p.meta.model, "serving request");
    matches!(proxy::forward(shard, conn, &p).await, Outcome::KeepAlive)
}

/// Hand the connection over to `owner`: the socket, the bytes read past
/// this request, and the parsed request, in one message.
fn hand_off(shard: &Shard, conn: Conn, pending: PendingRequest, owner: usize) {
    let Some(tx) = shard.shared.mesh.get(owner) else {
        return;
    };
    let (stream, buf) = conn.into_parts();
    let msg = ShardMsg::AdoptHttp {
        stream: handoff::into_std(stream),
        buf,
        pending: Box::new(pending),
    };
    if tx.unbounded_send(msg).is_ok() {
        shard.count_handoff_out();
    } else {
        tracing::warn!(
            shard = shard.id,
            owner,
            "hand-off failed: owner shard is gone; connection dropped"
        );
    }
}

/// Models with at least one healthy agent, OpenAI list shape.
pub fn models_list<'a>(agents: impl Iterator<Item = &'a AgentView>) -> Vec<u8> {
    let mut by_model: std::collections::BTreeMap<&str, Vec<&AgentView>> = Default::default();
    for a in agents {
        by_model.entry(a.reg.model.as_str()).or_default().push(a);
    }
    let data: Vec<_> = by_model
        .iter()
        .filter(|(_, v)| v.iter().any(|a| a.healthy))
        .map(|(m, v)| model_object(m, v, false))
        .collect();
    serde_json::to_vec(&json!({"object": "list", "data": data})).unwrap_or_default()
}

fn model_object(model: &str, agents: &[&AgentView], with_list: bool) -> serde_json::Value {
    let mut engines: Vec<&str> = agents
        .iter()
        .map(|a| a.reg.engine.as_str())
        .filter(|s| !s.is_empty())
        .collect();
    engines.sort_unstable();
    engines.dedup();
    let mut regions: Vec<&str> = agents
        .iter()
        .map(|a| a.reg.region.as_str())
        .filter(|s| !s.is_empty())
        .collect();
    regions.sort_unstable();
    regions.dedup();
    let capability = agents
        .first()
        .map(|a| a.reg.capability.as_str())
        .unwrap_or("llm");
    let mut summary = json!({
        "total": agents.len(),
        "healthy": agents.iter().filter(|a| a.healthy).count(),
        "total_capacity": agents.iter().map(|a| u64::from(a.reg.capacity)).sum::<u64>(),
        "engines": engines,
        "regions": regions,
    });
    if with_list {
        let list: Vec<_> = agents
            .iter()
            .map(|a| json!({
                "peer_id": a.peer_id, "engine": a.reg.engine, "version": a.reg.version, "region": a.reg.region,
                "organization": a.reg.organization, "machine": a.reg.machine, "capacity": a.reg.capacity,
                "is_healthy": a.healthy, "last_seen": a.last_seen,
            }))
            .collect();
        summary["list"] = json!(list);
    }
    json!({"id": model, "object": "model", "owned_by": "hivenet", "capability": capability, "agents": summary})
}

/// One model's detail, if it has a healthy agent.
pub fn model_detail<'a>(id: &str, agents: impl Iterator<Item = &'a AgentView>) -> Option<Vec<u8>> {
    let v: Vec<&AgentView> = agents.filter(|a| a.reg.model == id).collect();
    if !v.iter().any(|a| a.healthy) {
        return None;
    }
    serde_json::to_vec(&model_object(id, &v, true)).ok()
}
