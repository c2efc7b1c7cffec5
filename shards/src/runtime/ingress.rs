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
use super::pending::{HandOff, PendingRequest};
use super::respond;
use super::shard::{inc, Shard};
use super::tenancy::{Principal, WWW_AUTHENTICATE};
use crate::logic::auth::Access;
use crate::logic::endpoint::Endpoint;
use crate::logic::errors::{ApiError, ErrorCode};
use crate::logic::http_parse::{BodyFraming, HeadError, RequestHead};
use crate::logic::inline_str::InlineStr;
use crate::logic::probe;
use crate::logic::sites::{self, Choice, Kind};

/// What the connection does after a request.
enum Next {
    /// Read the next request.
    KeepAlive,
    /// Close it.
    Close,
    /// Give it to the model's shard with this request.
    HandOff(Box<PendingRequest>, usize),
    /// Hold this request here, its model's hold shard (`hold_for` set).
    Hold(Box<PendingRequest>),
}

/// What a hold leaves the connection to do.
enum AfterHold {
    /// Answered or served here; `keep`.
    Keep(bool),
    /// Woken: serve it on its owner.
    HandOff(Box<PendingRequest>, usize),
}

/// Hold `p` on this shard (its model's hold shard), at the top of the
/// connection's task so that a held request keeps only the small hold
/// state (not the whole request path's), then serve it or pass it on.
async fn hold_here(shard: &Rc<Shard>, conn: &mut Conn, mut p: Box<PendingRequest>) -> AfterHold {
    let budget = p
        .hold_for
        .take()
        .unwrap_or(shard.router.cfg.wake_hold_budget);
    conn.request_id = p.request_id;
    conn.trace = Some(p.trace);
    conn.reply_headers = std::mem::take(&mut p.reply_headers);
    let (method, path) = (p.head.method.clone(), p.head.path_only().to_string());
    let (started, principal) = (p.received_at, p.principal.clone());
    match Box::pin(super::hold::hold(shard, conn, *p, budget)).await {
        super::hold::HoldEnd::Answered(k) => {
            audit_here(shard, conn, &method, &path, started, Some(&principal));
            AfterHold::Keep(k)
        }
        super::hold::HoldEnd::Released(p, o) if o != shard.id => AfterHold::HandOff(p, o),
        super::hold::HoldEnd::Released(p, _) => {
            AfterHold::Keep(Box::pin(dispatch::serve_inference(shard, conn, *p)).await)
        }
    }
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
        conn.request_id = p.request_id;
        conn.trace = Some(p.trace);
        conn.reply_headers.clear();
        let keep = if p.hold_for.is_some() {
            // Sent here to be held with the model's other held requests.
            match hold_here(&shard, &mut conn, p).await {
                AfterHold::Keep(k) => k,
                AfterHold::HandOff(p, o) => {
                    hand_off(&shard, conn, p, o, permit).await;
                    return;
                }
            }
        } else {
            Box::pin(dispatch::serve_inference(&shard, &mut conn, *p)).await
        };
        if !keep {
            linger(&mut conn).await;
            return;
        }
    }
    let header_timeout = shard.router.cfg.header_timeout;
    loop {
        let started = clock::now();
        let head = match monoio::time::timeout(header_timeout, conn.read_request_head()).await {
            Ok(Ok(h)) => {
                conn.request_id = respond::request_id(&h);
                conn.trace = Some(respond::trace(&h));
                conn.reply_headers.clear();
                conn.keepalive = None;
                conn.committed = false;
                h
            }
            Ok(Err(HeadRead::Closed)) => return,
            Ok(Err(HeadRead::Bad(e))) => {
                conn.request_id = respond::new_request_id();
                conn.trace = Some(respond::new_trace());
                let err = match e {
                    HeadError::Bad(why) => ApiError::new(ErrorCode::RequestInvalid, why),
                    HeadError::TooLarge(why) => ApiError::new(ErrorCode::HeadersTooLarge, why),
                };
                respond::send_error(&mut conn, &err, false).await;
                linger(&mut conn).await;
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
        // Boxed: between requests (idle keep-alive) and while a request is
        // held, the connection's task keeps only this loop's state.
        match Box::pin(route(&shard, &mut conn, head, started)).await {
            Next::KeepAlive => {}
            Next::Close => {
                linger(&mut conn).await;
                return;
            }
            Next::HandOff(pending, owner) => {
                hand_off(&shard, conn, pending, owner, permit).await;
                return;
            }
            Next::Hold(pending) => match hold_here(&shard, &mut conn, pending).await {
                AfterHold::Keep(true) => {}
                AfterHold::Keep(false) => {
                    linger(&mut conn).await;
                    return;
                }
                AfterHold::HandOff(p, o) => {
                    hand_off(&shard, conn, p, o, permit).await;
                    return;
                }
            },
        }
    }
}

/// Longest a connection lingers after its last response.
pub const LINGER_TIME: std::time::Duration = std::time::Duration::from_secs(2);

/// Close after the last response the way nginx does (lingering close):
/// the rest of a request the router did not read (the body of a refused
/// request) may still be arriving, and closing with input pending or
/// arriving makes the kernel answer with a reset, which clients see as
/// ECONNRESET instead of the response's end. Shut the write side (the
/// client sees the end of the response), then discard input until the
/// client closes, at most [`LINGER_TIME`].
async fn linger(conn: &mut Conn) {
    use monoio::io::AsyncWriteRent;
    if conn.stream.shutdown().await.is_err() {
        return;
    }
    let drain = async {
        loop {
            conn.buf.clear();
            match conn.fill().await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    };
    let _ = monoio::time::timeout(LINGER_TIME, drain).await;
}

async fn route(
    shard: &Rc<Shard>,
    conn: &mut Conn,
    head: RequestHead,
    started: clock::Instant,
) -> Next {
    // Inline: the usual paths are copied without an allocation.
    let path = InlineStr::from(head.path_only());
    // Requests other than inference ones carry no body we want: close
    // rather than drain when one is declared.
    let keep = head.keep_alive && head.framing == BodyFraming::None;
    if head.method == "OPTIONS" {
        return respond::send_no_content(conn, keep).await.into();
    }
    if path == "/health" {
        return if head.method == "GET" {
            respond::send_json(conn, 200, br#"{"status":"ok"}"#, keep).await
        } else {
            respond::send_error(
                conn,
                &respond::method_not_allowed(&head.method, &path),
                keep,
            )
            .await
        }
        .into();
    }
    let mut principal = None;
    let method = if shard.router.audit.is_some() {
        head.method.clone()
    } else {
        std::borrow::Cow::Borrowed("")
    };
    let next = match route_audited(shard, conn, head, &path, started, keep, &mut principal).await {
        Routed::Done(n) => n,
        // Served by the dispatch driver, which audits it.
        Routed::Dispatched(n) => return n,
    };
    if !matches!(next, Next::HandOff(..)) {
        audit_here(shard, conn, &method, &path, started, principal.as_ref());
    }
    next
}

/// How [`route_audited`] ended.
enum Routed {
    /// Answered here (audited by the caller).
    Done(Next),
    /// Handed to the dispatch driver on this shard (audited there).
    Dispatched(Next),
}

/// Authenticate a client route: `Err(keep)` after the 401 is written.
async fn authenticate(
    shard: &Shard,
    conn: &mut Conn,
    head: &RequestHead,
    keep: bool,
) -> Result<Principal, bool> {
    let now = clock::unix_secs();
    match shard.authenticate(head.header("authorization"), head.header("x-api-key"), now) {
        Ok(p) => Ok(p),
        Err(e) => Err(respond::send_error_with(conn, &e.error(), keep, &[WWW_AUTHENTICATE]).await),
    }
}

/// One audit line for a request answered on this shard.
fn audit_here(
    shard: &Shard,
    conn: &Conn,
    method: &str,
    path: &str,
    started: clock::Instant,
    principal: Option<&Principal>,
) {
    let Some(log) = &shard.router.audit else {
        return;
    };
    let elapsed = started.elapsed();
    log.send(super::audit::AuditRecord {
        started: super::audit::started_at(elapsed),
        request_id: conn.request_id,
        trace_id: super::audit::trace_id_of(conn.trace.as_ref()),
        tenant_id: principal
            .map(Principal::tenant_arc)
            .unwrap_or_else(|| "".into()),
        key_id: principal
            .map(Principal::key_id_arc)
            .unwrap_or_else(|| "".into()),
        status: conn.status,
        latency_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
        error_code: conn.error_code,
        source_ip: conn
            .stream
            .peer_addr()
            .map(|a| a.ip().to_string())
            .unwrap_or_default(),
        method: method.to_string(),
        path: path.to_string(),
        ..Default::default()
    });
}

async fn route_audited(
    shard: &Rc<Shard>,
    conn: &mut Conn,
    head: RequestHead,
    path: &str,
    started: clock::Instant,
    keep: bool,
    principal: &mut Option<Principal>,
) -> Routed {
    if let Some(ep) = Endpoint::of(path) {
        if head.method != "POST" {
            let e = respond::method_not_allowed(&head.method, path);
            return Routed::Done(respond::send_error(conn, &e, keep).await.into());
        }
        // Authenticated before the body is read (spec 01 §5.1 step 1).
        let p = match authenticate(shard, conn, &head, keep).await {
            Ok(p) => p,
            Err(k) => return Routed::Done(k.into()),
        };
        *principal = Some(p.clone());
        return read_inference(shard, conn, head, ep, started, p).await;
    }
    if path.starts_with("/admin/") || path == "/admin" {
        *principal = Some(Principal::Admin);
        return Routed::Done(super::admin::serve(shard, conn, &head, path).await.into());
    }
    let client_route = path == "/v1/models" || path.starts_with("/v1/models/");
    if client_route && head.method == "GET" {
        let p = match authenticate(shard, conn, &head, keep).await {
            Ok(p) => p,
            Err(k) => return Routed::Done(k.into()),
        };
        let sees = |m: &str| p.access(m) == Access::Allowed;
        let snaps = shard.gather().await;
        let agents = || {
            snaps
                .iter()
                .flat_map(|s| s.agents.iter())
                .filter(|a| sees(&a.reg.model))
        };
        let aliases: std::collections::BTreeMap<String, String> = shard
            .aliases()
            .into_iter()
            .filter(|(_, t)| sees(t))
            .collect();
        let done = if path == "/v1/models" {
            let body = models_api::list(agents(), &aliases);
            respond::send_json(conn, 200, &body, keep).await
        } else {
            let id = path.trim_start_matches("/v1/models/");
            let found = match aliases.get(id) {
                Some(target) => models_api::alias_detail(id, target, agents()),
                None => models_api::detail(id, agents(), true),
            };
            match found {
                Some(body) => respond::send_json(conn, 200, &body, keep).await,
                // Not visible and unknown look the same (no catalog leak).
                None => respond::send_error(conn, &models_api::not_found(id), keep).await,
            }
        };
        *principal = Some(p);
        return Routed::Done(done.into());
    }
    let done = match (&*head.method, path) {
        (_, "/v1/models") => {
            respond::send_error(conn, &respond::method_not_allowed(&head.method, path), keep).await
        }
        (_, p) if p.starts_with("/v1/models/") => {
            respond::send_error(conn, &respond::method_not_allowed(&head.method, path), keep).await
        }
        _ => respond::send_error(conn, &respond::no_route(&head.method, path), keep).await,
    };
    Routed::Done(done.into())
}

/// Read an inference request's body under the limits, probe it, resolve
/// its alias, check the key's allow-set, and serve it here or hand it to
/// the model's shard.
async fn read_inference(
    shard: &Rc<Shard>,
    conn: &mut Conn,
    head: RequestHead,
    ep: Endpoint,
    started: clock::Instant,
    principal: Principal,
) -> Routed {
    let cfg = &shard.router.cfg;
    let limit = cfg.max_request_bytes;
    if let BodyFraming::Length(n) = head.framing {
        if limit > 0 && n > limit {
            // Rejected from the declared length, before reading it.
            respond::send_error(conn, &ApiError::body_too_large(limit), false).await;
            return Routed::Done(Next::Close);
        }
    }
    if head.expect_continue
        && head.framing != BodyFraming::None
        && conn.buf.is_empty()
        && conn.write_all(respond::CONTINUE.to_vec()).await.is_err()
    {
        return Routed::Done(Next::Close);
    }
    let mut body_permit = shard.router.budget.body();
    let read = conn.read_request_body(head.framing, limit, cfg.body_timeout, &mut body_permit);
    let mut body = match read.await {
        Ok(b) => b,
        Err(None) => return Routed::Done(Next::Close),
        Err(Some(e)) => {
            // A full body budget is transient: say when to come back.
            let retry: &[(&'static str, &[u8])] = if e.status == 503 {
                &[("Retry-After", b"1")]
            } else {
                &[]
            };
            respond::send_error_with(conn, &e, false, retry).await;
            return Routed::Done(Next::Close);
        }
    };
    let keep = head.keep_alive;
    let mut meta = match probe::probe(&body) {
        Ok(m) => m,
        Err(e) => return Routed::Done(respond::send_error(conn, &e, keep).await.into()),
    };
    // Aliases resolve right after authentication, before the allow-set
    // and quotas; the agent receives the resolved name.
    let mut alias = None;
    if let Some(target) = shard.resolve_alias(&meta.model) {
        match probe::replace_model(&body, &target) {
            Some(b) => body = b,
            None => {
                let e = ApiError::new(ErrorCode::RequestInvalid, "model field is required");
                return Routed::Done(respond::send_error(conn, &e, keep).await.into());
            }
        }
        alias =
            Some(std::mem::replace(&mut meta.model, InlineStr::from(target.as_str())).to_string());
        conn.reply_headers
            .push(("X-Hivenet-Routed-Model", meta.model.as_bytes().to_vec()));
    }
    match principal.access(&meta.model) {
        Access::Allowed => {}
        Access::Forbidden => {
            let e = ApiError::new(
                ErrorCode::ModelForbidden,
                format!("your API key does not have access to model: {}", meta.model),
            );
            return Routed::Done(respond::send_error(conn, &e, keep).await.into());
        }
        Access::Undeclared => {
            let r = super::tenancy::undeclared(&meta.model);
            let h: Vec<(&'static str, &[u8])> =
                r.headers.iter().map(|(n, v)| (*n, v.as_slice())).collect();
            return Routed::Done(
                respond::send_error_with(conn, &r.error, keep, &h)
                    .await
                    .into(),
            );
        }
    }
    let owner = shard.owner(&meta.model);
    // Not served on this site: another site of the map may serve it.
    if owner.is_none() {
        if let Some((site, location, count)) = redirect(shard, &head, ep, &meta.model, &principal) {
            let done = respond::send_redirect(conn, &location, count, &site, keep).await;
            *shard
                .redirects
                .borrow_mut()
                .entry((meta.model.to_string(), site))
                .or_default() += 1;
            return Routed::Done(done.into());
        }
    }
    let mut pending = PendingRequest {
        head,
        body,
        meta,
        endpoint: ep,
        received_at: started,
        request_id: conn.request_id,
        trace: conn.trace.unwrap_or_else(respond::new_trace),
        principal,
        alias,
        reply_headers: std::mem::take(&mut conn.reply_headers),
        body_permit,
        held: None,
        hold_for: None,
    };
    // At zero here and placed here with scale_from_zero: held until an
    // agent registers (seed hold-at-zero).
    if owner.is_none() {
        if let Some(budget) = super::hold::holdable(shard, ep, &pending.meta.model) {
            // Held on the model's hold shard, from the top of its
            // connection's task there (or here).
            let home = super::hold::hold_shard(&shard.router, &pending.meta.model);
            pending.hold_for = Some(budget);
            let pending = Box::new(pending);
            return Routed::Dispatched(if home != shard.id {
                Next::HandOff(pending, home)
            } else {
                Next::Hold(pending)
            });
        }
    }
    // Unknown model, or no agent registered now: answered here; no
    // directory entry, no metric series.
    let Some(owner) = owner else {
        let e = ApiError::new(
            ErrorCode::ModelNotFound,
            "No agents registered for this model",
        );
        conn.reply_headers = std::mem::take(&mut pending.reply_headers);
        return Routed::Done(respond::send_error(conn, &e, keep).await.into());
    };
    if owner != shard.id {
        return Routed::Dispatched(Next::HandOff(Box::new(pending), owner));
    }
    // Not boxed on its own: it runs inside `route`'s box, which only
    // exists while a request is served (an idle or held connection's task
    // keeps neither), so a second box was a second allocation per request.
    let served = dispatch::serve_inference(shard, conn, pending).await;
    Routed::Dispatched(served.into())
}

/// Where to redirect a request for `model`, which no agent serves here
/// (spec 07 §5): (target site, `Location`, new redirect count). `None`
/// without `--site-id`, without a map, for `count_tokens`, after two
/// redirects, or when the map names no sibling to send it to.
fn redirect(
    shard: &Shard,
    head: &RequestHead,
    ep: Endpoint,
    model: &str,
    principal: &Principal,
) -> Option<(String, String, u32)> {
    let local = shard.router.cfg.site_id.as_deref()?;
    let kind = Kind::of(ep)?;
    let map = shard.site_map()?;
    let query = head.path.split_once('?').map_or("", |(_, q)| q);
    let (count, from) = sites::redirect_params(query);
    if count >= sites::MAX_REDIRECTS {
        return None;
    }
    let (identity, scopes) = match principal {
        Principal::Key(c) => (
            &*c.key.key_id,
            Some(c.key.site_scopes.as_slice()).filter(|s| !s.is_empty()),
        ),
        _ => ("anonymous", None),
    };
    let max_age = shard.router.cfg.sibling_hints_max_age.as_secs();
    let ask = sites::Ask {
        identity,
        model,
        kind,
        local,
        scopes,
        from,
        fresh: map.fresh(clock::unix_secs(), max_age),
    };
    match sites::choose(&map, ask) {
        Choice::Redirect(site) => {
            let base = map.site(&site)?.base_url.clone();
            let location = sites::location(&base, &head.path, count + 1, local);
            Some((site, location, count + 1))
        }
        // Held here comes with hold-at-zero; until then it fails as before.
        Choice::HoldHere | Choice::Stay => None,
    }
}

/// Hand the connection over to `owner`: the socket, the bytes read past
/// this request, and the parsed request, in one message.
async fn hand_off(
    shard: &Shard,
    mut conn: Conn,
    pending: Box<PendingRequest>,
    owner: usize,
    permit: ConnPermit,
) {
    let Some(tx) = shard.router.mesh.get(owner) else {
        return;
    };
    let stream = if conn.watched {
        match handoff::dup_watched(&conn.stream) {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors: say so rather than drop it.
                tracing::warn!(
                    shard = shard.id,
                    "hand-off failed: cannot duplicate the socket: {e}"
                );
                let err = ApiError::new(
                    ErrorCode::BackendUnavailable,
                    format!("the router could not hand the request to its model's shard: {e}"),
                );
                respond::send_error_with(&mut conn, &err, false, &[("Retry-After", b"1")]).await;
                return;
            }
        }
    } else {
        let (stream, buf) = conn.into_parts();
        return send_hand_off(
            shard,
            tx,
            handoff::into_std(stream),
            buf,
            pending,
            permit,
            owner,
        );
    };
    let (_, buf) = conn.into_parts();
    send_hand_off(shard, tx, stream, buf, pending, permit, owner);
}

/// Send the hand-off message.
fn send_hand_off(
    shard: &Shard,
    tx: &futures::channel::mpsc::UnboundedSender<ShardMsg>,
    stream: std::net::TcpStream,
    buf: Vec<u8>,
    pending: Box<PendingRequest>,
    permit: ConnPermit,
    owner: usize,
) {
    let msg = ShardMsg::AdoptHttp(Box::new(HandOff {
        stream,
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
