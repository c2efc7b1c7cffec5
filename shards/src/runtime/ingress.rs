//! Client HTTP/1.1 connections: head and body under limits, routing by
//! path, probing the JSON body, and the one hand-off to the model's shard.
//! Inference requests continue in [`super::dispatch`]; admin routes in
//! [`super::admin`].
//!
//! Entry point: [`serve`].

use std::rc::Rc;

use super::budget::ConnPermit;
use super::clock;
use super::conn::{Conn, HeadRead};
use super::dispatch;
use super::handoff;
use super::mesh::ShardMsg;
use super::models_api;
use super::pending::{HandOff, PendingRequest, Principal};
use super::respond;
use super::shard::{inc, Shard};
use crate::logic::endpoint::Endpoint;
use crate::logic::errors::{ApiError, ErrorCode};
use crate::logic::http_parse::{BodyFraming, HeadError, RequestHead};
use crate::logic::probe;

/// What the connection does after a request.
enum Next {
    /// Read the next request.
    KeepAlive,
    /// Close it.
    Close,
    /// Give it to the model's shard with this request.
    HandOff(Box<PendingRequest>, usize),
}

impl From<bool> for Next {
    /// A response was written; `keep`: the connection stays open.
    fn from(keep: bool) -> Self {
        if keep {
            Next::KeepAlive
        } else {
            Next::Close
        }
    }
}

/// Serve one client connection; `first` is a request handed over by
/// another shard; `permit` is the connection's place under the cap.
pub async fn serve(
    shard: Rc<Shard>,
    mut conn: Conn,
    first: Option<Box<PendingRequest>>,
    permit: ConnPermit,
) {
    if let Some(p) = first {
        conn.request_id = p.request_id.clone();
        if !dispatch::serve_inference(&shard, &mut conn, *p).await {
            return;
        }
    }
    let header_timeout = shard.router.cfg.header_timeout;
    loop {
        let started = clock::now();
        let head = match monoio::time::timeout(header_timeout, conn.read_request_head()).await {
            Ok(Ok(h)) => {
                conn.request_id = respond::request_id(&h);
                h
            }
            Ok(Err(HeadRead::Closed)) => return,
            Ok(Err(HeadRead::Bad(e))) => {
                conn.request_id = respond::new_request_id();
                let err = match e {
                    HeadError::Bad(why) => ApiError::new(ErrorCode::RequestInvalid, why),
                    HeadError::TooLarge(why) => ApiError::new(ErrorCode::HeadersTooLarge, why),
                };
                respond::send_error(&mut conn, &err, false).await;
                return;
            }
            Err(_) => {
                if !conn.buf.is_empty() {
                    let err = ApiError::new(ErrorCode::ClientTimeout, "request header timeout");
                    respond::send_error(&mut conn, &err, false).await;
                }
                return;
            }
        };
        match route(&shard, &mut conn, head, started).await {
            Next::KeepAlive => {}
            Next::Close => return,
            Next::HandOff(pending, owner) => {
                hand_off(&shard, conn, pending, owner, permit);
                return;
            }
        }
    }
}

async fn route(
    shard: &Rc<Shard>,
    conn: &mut Conn,
    head: RequestHead,
    started: clock::Instant,
) -> Next {
    let path = head.path_only().to_string();
    // Requests other than inference ones carry no body we want: close
    // rather than drain when one is declared.
    let keep = head.keep_alive && head.framing == BodyFraming::None;
    if head.method == "OPTIONS" {
        return respond::send_no_content(conn, keep).await.into();
    }
    if let Some(ep) = Endpoint::of(&path) {
        if head.method != "POST" {
            return respond::send_error(
                conn,
                &respond::method_not_allowed(&head.method, &path),
                keep,
            )
            .await
            .into();
        }
        return read_inference(shard, conn, head, ep, started).await;
    }
    if path.starts_with("/admin/") || path == "/admin" {
        return super::admin::serve(shard, conn, &head, &path).await.into();
    }
    let done = match (head.method.as_str(), path.as_str()) {
        ("GET", "/health") => respond::send_json(conn, 200, br#"{"status":"ok"}"#, keep).await,
        ("GET", "/v1/models") => {
            let snaps = shard.gather().await;
            let body = models_api::list(snaps.iter().flat_map(|s| s.agents.iter()));
            respond::send_json(conn, 200, &body, keep).await
        }
        ("GET", p) if p.starts_with("/v1/models/") => {
            let id = p.trim_start_matches("/v1/models/");
            let snaps = shard.gather().await;
            match models_api::detail(id, snaps.iter().flat_map(|s| s.agents.iter()), true) {
                Some(body) => respond::send_json(conn, 200, &body, keep).await,
                None => respond::send_error(conn, &models_api::not_found(id), keep).await,
            }
        }
        (_, "/health" | "/v1/models") => {
            respond::send_error(
                conn,
                &respond::method_not_allowed(&head.method, &path),
                keep,
            )
            .await
        }
        (_, p) if p.starts_with("/v1/models/") => {
            respond::send_error(
                conn,
                &respond::method_not_allowed(&head.method, &path),
                keep,
            )
            .await
        }
        _ => respond::send_error(conn, &respond::no_route(&head.method, &path), keep).await,
    };
    done.into()
}

/// Read an inference request's body under the limits, probe it, and
/// serve it here or hand it to the model's shard.
async fn read_inference(
    shard: &Rc<Shard>,
    conn: &mut Conn,
    head: RequestHead,
    ep: Endpoint,
    started: clock::Instant,
) -> Next {
    let cfg = &shard.router.cfg;
    let limit = cfg.max_request_bytes;
    if let BodyFraming::Length(n) = head.framing {
        if limit > 0 && n > limit {
            // Rejected from the declared length, before reading it.
            respond::send_error(conn, &ApiError::body_too_large(limit), false).await;
            return Next::Close;
        }
    }
    if head.expect_continue
        && head.framing != BodyFraming::None
        && conn.buf.is_empty()
        && conn.write_all(respond::CONTINUE.to_vec()).await.is_err()
    {
        return Next::Close;
    }
    let mut body_permit = shard.router.budget.body();
    let read = conn.read_request_body(head.framing, limit, cfg.body_timeout, &mut body_permit);
    let body = match read.await {
        Ok(b) => b,
        Err(None) => return Next::Close,
        Err(Some(e)) => {
            // A full body budget is transient: say when to come back.
            let retry: &[(&'static str, &[u8])] = if e.status == 503 {
                &[("Retry-After", b"1")]
            } else {
                &[]
            };
            respond::send_error_with(conn, &e, false, retry).await;
            return Next::Close;
        }
    };
    let keep = head.keep_alive;
    let meta = match probe::probe(&body) {
        Ok(m) => m,
        Err(e) => return respond::send_error(conn, &e, keep).await.into(),
    };
    // Unknown model, or no agent registered now: answered here; no
    // directory entry, no metric series.
    let Some(owner) = shard.owner(&meta.model) else {
        let e = ApiError::new(
            ErrorCode::ModelNotFound,
            "No agents registered for this model",
        );
        return respond::send_error(conn, &e, keep).await.into();
    };
    let pending = PendingRequest {
        head,
        body,
        meta,
        endpoint: ep,
        received_at: started,
        request_id: conn.request_id.clone(),
        principal: Principal::Anonymous,
        body_permit,
    };
    if owner != shard.id {
        return Next::HandOff(Box::new(pending), owner);
    }
    dispatch::serve_inference(shard, conn, pending).await.into()
}

/// Hand the connection over to `owner`: the socket, the bytes read past
/// this request, and the parsed request, in one message.
fn hand_off(
    shard: &Shard,
    conn: Conn,
    pending: Box<PendingRequest>,
    owner: usize,
    permit: ConnPermit,
) {
    let Some(tx) = shard.router.mesh.get(owner) else {
        return;
    };
    let (stream, buf) = conn.into_parts();
    let msg = ShardMsg::AdoptHttp(Box::new(HandOff {
        stream: handoff::into_std(stream),
        buf,
        pending,
        permit,
    }));
    if tx.unbounded_send(msg).is_ok() {
        inc(&shard.counters.handoffs_out);
    } else {
        tracing::warn!(
            shard = shard.id,
            owner,
            "hand-off failed: owner shard is gone; connection dropped"
        );
    }
}
