//! Client HTTP/1.1 connections: head and body under limits, routing by
//! path, probing the JSON body, and the one hand-off to the model's shard.
//! Inference requests continue in [`crate::runtime::request::dispatch`]; admin routes in
//! [`crate::runtime::admin`].
//!
//! Entry point: [`serve`].

use crate::runtime::state::model::stats::ActiveRequest;
use std::rc::Rc;

use super::placing::{place, provider_serves, serving, Next};
use super::reading::{authenticate, read_body};
use crate::logic::http::api::probe::{self, RequestMeta};
use crate::logic::http::endpoint::Endpoint;
use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::logic::http::framing::http_parse::{BodyFraming, HeadError, RequestHead};
use crate::logic::http::framing::inline_str::InlineStr;
use crate::logic::sites::serving::{LocalAgents, Serving};
use crate::logic::tenancy::auth::Access;
use crate::runtime::request::dispatch;
use crate::runtime::request::ending;
use crate::runtime::request::models_api;
use crate::runtime::request::respond;
use crate::runtime::state::mesh::ShardMsg;
use crate::runtime::state::pending::{HandOff, PendingRequest};
use crate::runtime::state::scope::{Client, RequestScope};
use crate::runtime::state::shard::{inc, Shard};
use crate::runtime::state::tenancy::Principal;
use crate::runtime::wire::budget::ConnPermit;
use crate::runtime::wire::clock;
use crate::runtime::wire::conn::{Conn, HeadRead};
use crate::runtime::wire::handoff;

/// The scope of a request handed over by another shard.
fn adopt(p: &mut PendingRequest) -> RequestScope {
    RequestScope {
        spans: p.spans.take(),
        request_id: p.request_id,
        trace: Some(p.trace),
        method: p.head.method.clone(),
        path: InlineStr::from(p.head.path_only()),
        principal: Some(p.principal.clone()),
        model: p.meta.model.clone(),
        active: Some(ActiveRequest::begin(&p.head.method, p.head.path_only())),
        ..RequestScope::fresh(p.received_at)
    }
}

/// Hold `p` on this shard (its model's hold shard), at the top of the
/// connection's task so that a held request keeps only the small hold
/// state (not the whole request path's), then serve it or pass it on.
/// Never answers [`Next::Hold`].
async fn hold_here(shard: &Rc<Shard>, c: &mut Client, mut p: Box<PendingRequest>) -> Next {
    let budget = p
        .hold_for
        .take()
        .unwrap_or(shard.router.cfg.wake_hold_budget);
    c.scope.reply_headers = std::mem::take(&mut p.reply_headers);
    match Box::pin(super::hold::hold(shard, c, *p, budget)).await {
        super::hold::HoldEnd::Answered(k) => k.into(),
        super::hold::HoldEnd::Carry(p, h) => Next::Carry(Some((p, h))),
        super::hold::HoldEnd::Released(p, o) if o != shard.id => Next::HandOff(p, o),
        super::hold::HoldEnd::Released(p, _) => Box::pin(dispatch::serve_inference(shard, c, *p))
            .await
            .into(),
    }
}

/// Serve one client connection; `first` is a request handed over by
/// another shard; `permit` is the connection's place under the cap.
pub async fn serve(
    shard: Rc<Shard>,
    conn: Conn,
    first: Option<Box<PendingRequest>>,
    permit: ConnPermit,
) {
    serve_client(shard, Client::new(conn), first, permit).await
}

pub(super) async fn serve_client(
    shard: Rc<Shard>,
    mut c: Client,
    first: Option<Box<PendingRequest>>,
    permit: ConnPermit,
) {
    // The request answered last (`None`: none yet on this connection).
    let mut last = match first {
        Some(mut p) => {
            c.scope = adopt(&mut p);
            Some(if p.hold_for.is_some() {
                // Sent here to be held with the model's other held requests.
                Next::Hold(p)
            } else {
                Box::pin(dispatch::serve_inference(&shard, &mut c, *p))
                    .await
                    .into()
            })
        }
        None => None,
    };
    loop {
        if let Some(s) = c.carry_stream.take() {
            let (bytes, stream) = *s;
            return super::carry::out(&shard, c, (bytes, None, Some(Box::new(stream))), permit);
        }
        match last.take() {
            None => {}
            Some(Next::Hold(p)) => {
                last = Some(hold_here(&shard, &mut c, p).await);
                continue;
            }
            // Its owner finishes it.
            Some(Next::HandOff(p, owner)) => return hand_off(&shard, c, p, owner, permit).await,
            Some(Next::Carry(held)) => {
                let first = match held {
                    Some((p, h)) => (p.wire_bytes(&p.body), Some(h), None),
                    None => (Vec::new(), None, None),
                };
                return super::carry::out(&shard, c, first, permit);
            }
            Some(Next::KeepAlive) => ending::finish(&shard, &mut c),
            Some(Next::Close) => {
                ending::finish(&shard, &mut c);
                return linger(&mut c.conn).await;
            }
        }
        last = match read_next(&shard, &mut c).await {
            // Boxed: between requests (idle keep-alive) and while a
            // request is held, the connection's task keeps only this
            // loop's state.
            Read::Head(head) => Some(Box::pin(route(&shard, &mut c, head)).await),
            // Read, not answered: the process replacing this one answers.
            Read::Carry => Some(Next::Carry(None)),
            Read::Done => return,
        };
    }
}

/// What [`read_next`] found. Not boxed: the head moves once into
/// `route`, and a box would be one more allocation per request
/// (`tests/allocations.rs`).
#[allow(clippy::large_enum_variant)]
enum Read {
    /// A request head (its scope begun).
    Head(RequestHead),
    /// A whole head while this process hands its connections over: the
    /// head's bytes stay in the buffer for the new process (issue 54).
    Carry,
    /// The connection is done (closed, a bad head answered, the header
    /// timeout).
    Done,
}

/// Read the next request head and start its scope.
async fn read_next(shard: &Shard, c: &mut Client) -> Read {
    let header_timeout = shard.router.cfg.header_timeout;
    let started = clock::now();
    match monoio::time::timeout(header_timeout, c.conn.peek_request_head()).await {
        Ok(Ok(_)) if shard.router.carry.on() && c.carried.is_none() && c.resumed.is_none() => {
            Read::Carry
        }
        Ok(Ok((mut h, n))) => {
            c.conn.consume(n);
            // A stopping router's keep-alive clients go elsewhere after
            // this answer (the Service sends their next connection to a
            // ready router): else they would keep it busy to the end.
            h.keep_alive &= !shard.router.readiness.draining();
            c.scope.begin(&h, started);
            let id = match (&c.carried, &c.resumed) {
                (Some(k), _) => Some(k.request_id.as_str()),
                (None, Some(r)) => Some(r.request_id.as_str()),
                (None, None) => None,
            };
            if let Some(id) = id.and_then(crate::logic::http::request_id::RequestId::parse) {
                c.scope.request_id = id;
            }
            // Its head went out from the process this one replaced.
            c.scope.committed |= c.resumed.is_some();
            Read::Head(h)
        }
        Ok(Err(HeadRead::Closed)) => Read::Done,
        Ok(Err(HeadRead::Bad(e))) => {
            // Not audited: no request to name.
            c.scope = RequestScope::fresh(started);
            let err = match e {
                HeadError::Bad(why) => ApiError::new(ErrorCode::RequestInvalid, why),
                HeadError::TooLarge(why) => ApiError::new(ErrorCode::HeadersTooLarge, why),
            };
            respond::send_error(c, &err, false).await;
            linger(&mut c.conn).await;
            Read::Done
        }
        Err(_) => {
            if !c.conn.buf.is_empty() {
                c.scope = RequestScope::fresh(started);
                let err = ApiError::new(ErrorCode::ClientTimeout, "request header timeout");
                respond::send_error(c, &err, false).await;
            }
            Read::Done
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

/// Whether a browser's `Origin` names the host the request was sent to
/// (`http(s)://<Host>`; `null` and anything else are foreign).
fn same_origin(origin: &[u8], host: Option<&[u8]>) -> bool {
    let Some(host) = host else {
        return false;
    };
    let rest = origin
        .strip_prefix(b"http://")
        .or_else(|| origin.strip_prefix(b"https://"));
    rest.is_some_and(|r| r.eq_ignore_ascii_case(host))
}

/// Route one request by its path.
async fn route(shard: &Rc<Shard>, c: &mut Client, head: RequestHead) -> Next {
    let path = c.scope.path.clone();
    let path = path.as_str();
    // Requests other than inference ones carry no body we want: close
    // rather than drain when one is declared.
    let keep = head.keep_alive && head.framing == BodyFraming::None;
    let admin = path.starts_with("/admin/") || path == "/admin";
    if admin {
        // No CORS on admin routes, and a browser request from another
        // origin is refused outright (issue 29 #13): with insecure admin
        // mode a page elsewhere could otherwise reset metrics.
        c.scope.no_cors = true;
        c.scope.principal = Some(Principal::Admin);
        if let Some(origin) = head.header("origin") {
            if !same_origin(origin, head.header("host")) {
                let e = ApiError::new(
                    ErrorCode::Forbidden,
                    "cross-origin admin requests are refused",
                );
                return respond::send_error(c, &e, false).await.into();
            }
        }
    }
    if head.method == "OPTIONS" {
        c.scope.quiet = true;
        return respond::send_no_content(c, keep).await.into();
    }
    // Readiness (a load balancer's probe): 503 until its former agents
    // are back, and once it stops or was replaced (its streams and held
    // requests still finish here).
    if path == "/ready" && head.method == "GET" {
        c.scope.quiet = true;
        let r = &shard.router.readiness;
        return if r.ready(clock::now()) {
            respond::send_json(c, 200, br#"{"status":"ready"}"#, keep).await
        } else if r.draining() {
            respond::send_json(c, 503, br#"{"status":"draining"}"#, keep).await
        } else {
            respond::send_json(c, 503, br#"{"status":"starting"}"#, keep).await
        }
        .into();
    }
    if path == "/health" {
        c.scope.quiet = true;
        return if head.method == "GET" {
            respond::send_json(c, 200, br#"{"status":"ok"}"#, keep).await
        } else {
            let e = respond::method_not_allowed(&head.method, path);
            respond::send_error(c, &e, keep).await
        }
        .into();
    }
    if let Some(ep) = Endpoint::of(path) {
        if head.method != "POST" {
            let e = respond::method_not_allowed(&head.method, path);
            return respond::send_error(c, &e, keep).await.into();
        }
        crate::runtime::request::spans::begin(shard, &mut c.scope, &head, path);
        // Authenticated before the body is read (spec 01 §5.1 step 1).
        let p = match authenticate(shard, c, &head, keep).await {
            Ok(p) => p,
            Err(k) => return k.into(),
        };
        return read_inference(shard, c, head, ep, p).await;
    }
    if admin {
        return crate::runtime::admin::serve(shard, c, &head, path)
            .await
            .into();
    }
    if super::stateful::is_path(path) {
        return Box::pin(super::stateful::api(shard, c, &head, path)).await;
    }
    let models_route = path == "/v1/models" || path.starts_with("/v1/models/");
    let done = if models_route && head.method == "GET" {
        match authenticate(shard, c, &head, keep).await {
            Ok(p) => models(shard, c, &p, path, keep).await,
            Err(k) => k,
        }
    } else if models_route {
        let e = respond::method_not_allowed(&head.method, path);
        respond::send_error(c, &e, keep).await
    } else {
        respond::send_error(c, &respond::no_route(&head.method, path), keep).await
    };
    done.into()
}

/// `GET /v1/models` and `/v1/models/{id}`: what `p` sees.
async fn models(shard: &Rc<Shard>, c: &mut Client, p: &Principal, path: &str, keep: bool) -> bool {
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
    if path == "/v1/models" {
        let body = models_api::list(agents(), &aliases);
        return respond::send_json(c, 200, &body, keep).await;
    }
    let id = path.trim_start_matches("/v1/models/");
    let found = match aliases.get(id) {
        Some(target) => models_api::alias_detail(id, target, agents()),
        None => models_api::detail(id, agents(), true),
    };
    match found {
        Some(body) => respond::send_json(c, 200, &body, keep).await,
        // Not visible and unknown look the same (no catalog leak).
        None => respond::send_error(c, &models_api::not_found(id), keep).await,
    }
}

/// Read an inference request's body under the limits, probe it, resolve
/// its alias, check the key's allow-set, and serve it here or hand it to
/// the model's shard.
async fn read_inference(
    shard: &Rc<Shard>,
    c: &mut Client,
    head: RequestHead,
    ep: Endpoint,
    principal: Principal,
) -> Next {
    let keep = head.keep_alive;
    let (body, body_permit) = match read_body(shard, c, &head).await {
        Ok(b) => b,
        Err(next) => return next,
    };
    let (body, meta, alias) = match resolve(shard, c, body, &principal, keep).await {
        Ok(r) => r,
        Err(next) => return next,
    };
    let (tenant, key) = principal.names();
    let alias_name = alias.as_deref();
    crate::runtime::request::spans::ingress(&mut c.scope, tenant, key, &meta.model, alias_name);
    // Served here when a healthy agent of the endpoint's kind is; agents
    // that are all unhealthy, or of another kind, leave the request to
    // a warm sibling or a hold first, then to the owner's answer (seed 2).
    let found = shard.owner_and_cap(&meta.model, ep.capability());
    let owner = found.map(|(o, _)| o);
    let agents = match found {
        Some((_, healthy)) => LocalAgents::Registered { healthy },
        None => LocalAgents::None,
    };
    // Held by the process this one replaced: held here for the rest of
    // its budget, wherever the model is now (its 200 head may be out).
    let (carried, resumed) = (c.carried.take(), c.resumed.take());
    let serving = match serving(shard, &head, ep, &meta.model, &principal, agents) {
        _ if carried.is_some() => Serving::Hold(shard.router.cfg.wake_hold_budget),
        // Continued by its model's shard (or cut there with no agent).
        _ if resumed.is_some() => Serving::Here,
        // No agent anywhere, and the policy names a fallback provider for
        // this API: the machine sends it there (spec 04 §7, issue 56).
        Serving::NotFound if provider_serves(shard, ep, &meta.model) => Serving::Here,
        s => s,
    };
    let hold_for = match place(shard, c, serving, &meta.model, keep).await {
        Ok(h) => h,
        Err(next) => return next,
    };
    let mut pending = PendingRequest {
        head,
        body,
        meta,
        endpoint: ep,
        received_at: c.scope.started,
        request_id: c.scope.request_id,
        trace: c
            .scope
            .trace
            .unwrap_or_else(crate::runtime::state::scope::new_trace),
        principal,
        alias,
        reply_headers: std::mem::take(&mut c.scope.reply_headers),
        body_permit,
        held: None,
        hold_for: None,
        spans: None,
        carried,
        resumed,
    };
    // At zero here and placed here with scale_from_zero: held until an
    // agent registers (seed hold-at-zero), on the model's hold shard,
    // from the top of its connection's task there (or here).
    if let Some(budget) = hold_for {
        let home = super::hold::hold_shard(&shard.router, &pending.meta.model);
        pending.hold_for = Some(budget);
        let pending = Box::new(pending);
        return if home != shard.id {
            Next::HandOff(pending, home)
        } else {
            Next::Hold(pending)
        };
    }
    match owner {
        Some(o) if o != shard.id => Next::HandOff(Box::new(pending), o),
        // Not boxed on its own: it runs inside `route`'s box, which only
        // exists while a request is served (an idle or held connection's
        // task keeps neither), so a second box was a second allocation
        // per request.
        _ => dispatch::serve_inference(shard, c, pending).await.into(),
    }
}

/// Probe the body, resolve its alias (right after authentication, before
/// the allow-set and quotas; the agent receives the resolved name) and
/// check the key's allow-set: the body, its probed fields and the alias
/// the client asked for.
async fn resolve(
    shard: &Shard,
    c: &mut Client,
    mut body: Vec<u8>,
    principal: &Principal,
    keep: bool,
) -> Result<(Vec<u8>, RequestMeta, Option<String>), Next> {
    let mut meta = match probe::probe(&body) {
        Ok(m) => m,
        Err(e) => return Err(respond::send_error(c, &e, keep).await.into()),
    };
    let mut alias = None;
    if let Some(target) = shard.resolve_alias(&meta.model) {
        match probe::replace_model(&body, &target) {
            Some(b) => body = b,
            None => {
                let e = ApiError::new(ErrorCode::RequestInvalid, "model field is required");
                return Err(respond::send_error(c, &e, keep).await.into());
            }
        }
        alias =
            Some(std::mem::replace(&mut meta.model, InlineStr::from(target.as_str())).to_string());
        c.scope
            .reply_headers
            .push(("X-Hivenet-Routed-Model", meta.model.as_bytes().to_vec()));
    }
    c.scope.model = meta.model.clone();
    match principal.access(&meta.model) {
        Access::Allowed => Ok((body, meta, alias)),
        Access::Forbidden => {
            let e = ApiError::new(
                ErrorCode::ModelForbidden,
                format!("your API key does not have access to model: {}", meta.model),
            );
            Err(respond::send_error(c, &e, keep).await.into())
        }
        Access::Undeclared => {
            let r = crate::runtime::state::tenancy::undeclared(&meta.model);
            Err(respond::send_quota_refusal(c, r, keep).await.into())
        }
    }
}

/// Hand the connection over to `owner`: the socket, the bytes read past
/// this request, and the parsed request, in one message.
async fn hand_off(
    shard: &Shard,
    mut c: Client,
    mut pending: Box<PendingRequest>,
    owner: usize,
    permit: ConnPermit,
) {
    // Its trace goes with it.
    pending.spans = c.scope.spans.take();
    let Some(tx) = shard.router.mesh.get(owner) else {
        return;
    };
    let stream = if c.conn.watched {
        match handoff::dup_watched(&c.conn.stream) {
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
                )
                .retry_after(1);
                respond::send_error(&mut c, &err, false).await;
                ending::finish(shard, &mut c);
                return;
            }
        }
    } else {
        let (stream, buf) = c.conn.into_parts();
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
    let (_, buf) = c.conn.into_parts();
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
