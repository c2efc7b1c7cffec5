//! The Responses API on the request path (issue 52): the conversation
//! state is the router's. A turn naming `previous_response_id` is expanded
//! into the whole conversation before it is routed ([`prepare`]); the
//! answer reaches the client with the router's response ID
//! ([`Conversation::tap`], applied by the relay); the turn is kept in the
//! store when it ends, before its end reaches the client
//! ([`Conversation::keep`], called by the relay); `GET` / `DELETE /v1/responses/{id}`
//! and `GET .../input_items` read it back ([`serve_api`]). Every read is
//! the tenant's own: another tenant's ID is answered as unknown (404).
//!
//! Key items: [`prepare`], [`Conversation`], [`Conversation::keep`], [`serve_api`].

use std::sync::Arc;
use std::time::Duration;

use futures::channel::oneshot;

use super::kept::{ask, ask_fleet, delete_record, get_record, KEEP_WAIT};
use super::respond;
use crate::logic::http::api::probe;
use crate::logic::http::api::prompt_hash::raw_key_hash;
use crate::logic::http::api::responses::{self, Record, Tap};
use crate::logic::http::endpoint::Endpoint;
use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::runtime::services::shared_state::conversations;
use crate::runtime::services::store_api::{ChainError, StoreMsg};
use crate::runtime::state::pending::PendingRequest;
use crate::runtime::state::router::Router;
use crate::runtime::state::scope::Client;
use crate::runtime::state::shard::Shard;
use crate::runtime::state::tenancy::Principal;
use crate::runtime::wire::clock;

/// Largest expanded body when `--max-request-bytes` sets no limit.
const MAX_EXPANDED: usize = 64 << 20;

/// One Responses turn under way.
pub struct Conversation {
    /// Gives the client the router's ID and keeps the engine's end.
    pub tap: Tap,
    router: Arc<Router>,
    tenant: Arc<str>,
    model: String,
    previous: Option<String>,
    /// The conversation its items are added to (`conversations`).
    conversation: Option<String>,
    instructions: Option<serde_json::Value>,
    input: Vec<serde_json::Value>,
    store: bool,
}

fn not_found(id: &str) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!("Response with id '{id}' not found."),
    )
}

/// The chain ending at `id`: with `--shared-state` the fleet's copy is
/// the truth (a chain begun, continued or deleted on another router);
/// this router's store answers alone, or when Redis does not.
async fn chain_of(
    shard: &Shard,
    tenant: &str,
    id: &str,
) -> Option<Result<Vec<Vec<u8>>, ChainError>> {
    let fleet = || {
        let (t, i) = (tenant.to_string(), id.to_string());
        ask_fleet(&shard.router, |reply| conversations::Op::Chain {
            tenant: t,
            id: i,
            reply,
        })
    };
    let mut answer = fleet().await;
    if matches!(answer, Some(Err(ChainError::NotFound(_)))) {
        // The turn may have been answered by another router a moment
        // ago, its write still on the way: once more, a little later.
        monoio::time::sleep(FLEET_RETRY).await;
        answer = fleet().await;
    }
    // Redis answered: the fleet's word stands (a response deleted on
    // another router stays deleted here).
    if answer.is_some() {
        return answer;
    }
    let (t, i) = (tenant.to_string(), id.to_string());
    ask(&shard.router, |reply| StoreMsg::ResponseChain {
        tenant: t,
        id: i,
        reply,
    })
    .await
}

/// How long a chain the fleet does not know yet is waited for.
const FLEET_RETRY: Duration = Duration::from_millis(100);

/// Before routing: a Responses request is read, its conversation rebuilt
/// from the store and put in its body (the engine keeps nothing), and it
/// gets its ID. `Ok(None)`: another endpoint.
pub async fn prepare(
    shard: &Shard,
    p: &mut PendingRequest,
) -> Result<Option<Conversation>, ApiError> {
    if p.endpoint != Endpoint::Responses {
        return Ok(None);
    }
    let prepared = rebuild(shard, p).await;
    let kind = match &prepared {
        Err(_) => "refused",
        // Rebuilt from a chain or a conversation.
        Ok(c) if c.previous.is_some() || c.conversation.is_some() => "continued",
        Ok(_) => "new",
    };
    if let Some(m) = shard.model(p.meta.model.as_str()) {
        m.borrow_mut().stats.responses.count(kind);
    }
    prepared.map(Some)
}

/// [`prepare`] of a Responses request.
async fn rebuild(shard: &Shard, p: &mut PendingRequest) -> Result<Conversation, ApiError> {
    let req = responses::parse_request(&p.body)
        .map_err(|m| ApiError::new(ErrorCode::RequestInvalid, m))?;
    let tenant = p.principal.tenant_arc();
    let chain: Vec<Vec<u8>> = match (&req.previous, &req.conversation) {
        (None, None) => Vec::new(),
        // Its items come first, as a turn's would.
        (_, Some(id)) => match super::conversations::load(&shard.router, &tenant, id).await {
            Some(c) => vec![crate::logic::http::api::conversations::as_turn(&c)],
            None => return Err(super::conversations::not_found(id)),
        },
        (Some(id), None) => {
            let found = chain_of(shard, &tenant, id).await;
            match found {
                Some(Ok(raw)) => raw,
                Some(Err(ChainError::NotFound(missing))) => return Err(not_found(&missing)),
                Some(Err(ChainError::TooLong(n))) => {
                    return Err(ApiError::new(
                        ErrorCode::RequestInvalid,
                        format!("the conversation is longer than {n} responses"),
                    ))
                }
                None => return Err(not_found(id)),
            }
        }
    };
    let (body, root) = responses::expanded_body(&req, &chain)
        .map_err(|m| ApiError::new(ErrorCode::RequestInvalid, m))?;
    let limit = match shard.router.cfg.max_request_bytes {
        0 => MAX_EXPANDED,
        n => usize::try_from(n).unwrap_or(usize::MAX),
    };
    if body.len() > limit {
        return Err(ApiError::new(
            ErrorCode::RequestInvalid,
            format!(
                "the conversation and its new input ({} bytes) are over the request limit of {limit} bytes",
                body.len()
            ),
        ));
    }
    // The estimate counts the whole conversation the engine reads.
    if let Ok(meta) = probe::probe(&body) {
        p.meta.text_bytes = meta.text_bytes;
    }
    p.body = body;
    let id = responses::new_id(rand::random());
    // Every turn of a conversation has the same session key (its first
    // response's ID) unless the client gave one: prefix-aware policies
    // send it to the engine that holds its prefix, on any router that
    // shares affinity.
    if p.meta.affinity.body_key.is_none() {
        let root = root.as_deref().unwrap_or(id.as_str());
        p.meta.affinity.body_key = Some(raw_key_hash(root.as_bytes()));
    }
    Ok(Conversation {
        tap: Tap::new(id, req.previous.clone(), req.store),
        router: shard.router.clone(),
        tenant,
        model: p.meta.model.as_str().to_string(),
        previous: req.previous,
        conversation: req.conversation,
        instructions: req.instructions,
        input: req.input,
        store: req.store,
    })
}

impl Conversation {
    /// The engine's answer reached its end (completed, incomplete or
    /// failed): the turn is kept, when the client asked for it, before
    /// the end reaches the client. So a client that sends its next turn
    /// the moment it has this one, to any router of the fleet, finds it
    /// (read-your-writes): the fleet's copy is waited for (up to
    /// [`KEEP_WAIT`]), this router's store is asked first on its one
    /// queue, so no later read here overtakes it. Once per turn.
    pub async fn keep(&mut self) {
        let Some(done) = self.tap.done.take() else {
            return;
        };
        if let Some(conv) = self.conversation.take() {
            let (input, output) = (self.input.clone(), done.output.clone());
            super::conversations::append(&self.router, &self.tenant, &conv, input, output).await;
        }
        if !self.store {
            return;
        }
        let id = self.tap.id().to_string();
        let created_at = clock::unix_secs();
        let record = Record {
            id: id.clone(),
            model: std::mem::take(&mut self.model),
            created_at,
            previous_response_id: self.previous.take(),
            instructions: self.instructions.take(),
            input: std::mem::take(&mut self.input),
            output: done.output,
            usage: done.usage,
            status: done.status,
        };
        let Ok(record) = serde_json::to_vec(&record) else {
            return;
        };
        let tenant = self.tenant.to_string();
        if let Some(tx) = self.router.store.as_ref() {
            let _ = tx.send(StoreMsg::ResponsePut {
                tenant: tenant.clone(),
                id: id.clone(),
                created_at,
                record: record.clone(),
            });
        }
        let Some(shared) = self.router.shared_state.as_ref() else {
            return;
        };
        let cfg = &self.router.cfg;
        let (stored, rx) = oneshot::channel();
        shared.responses(conversations::Op::Put {
            tenant,
            id: id.clone(),
            created_at,
            record,
            per_tenant: cfg.responses_per_tenant,
            ttl_secs: cfg.responses_ttl_secs,
            stored,
        });
        if !matches!(monoio::time::timeout(KEEP_WAIT, rx).await, Ok(Ok(()))) {
            // Redis is away or slow: the answer is not held for it; the
            // other routers may not see this turn until Redis has it.
            tracing::debug!(response = %id, "responses: the fleet's copy not confirmed");
        }
    }
}

/// `hivenet_responses_stored{tenant}` and `..._bytes{tenant}`: what this
/// router's store keeps per tenant (asked of the store thread; nothing
/// when it does not answer within 100 ms).
pub async fn render_stored(shard: &Shard, o: &mut String) {
    use crate::runtime::wire::exposition::{Family, Kind::Gauge};
    let Some(tx) = shard.router.store.as_ref() else {
        return;
    };
    let (reply, rx) = oneshot::channel();
    if tx.send(StoreMsg::ResponseTenants { reply }).is_err() {
        return;
    }
    let Ok(Ok(tenants)) = monoio::time::timeout(Duration::from_millis(100), rx).await else {
        return;
    };
    let mut f = Family::new(
        o,
        "hivenet_responses_stored",
        Gauge,
        "Responses API responses this router's store keeps, per tenant.",
        ["tenant"],
    );
    for (t, n, _) in &tenants {
        f.series([t], n);
    }
    let mut f = Family::new(
        o,
        "hivenet_responses_stored_bytes",
        Gauge,
        "Bytes of Responses API conversations this router's store keeps, per tenant (what --responses-max-bytes-per-tenant bounds).",
        ["tenant"],
    );
    for (t, _, b) in &tenants {
        f.series([t], b);
    }
}

/// Whether `path` is one of the stored-response routes.
pub fn is_api_path(path: &str) -> bool {
    path.starts_with("/v1/responses/") && path != "/v1/responses/input_tokens"
}

/// `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`,
/// `GET /v1/responses/{id}/input_items`, for `p`'s tenant only.
pub async fn serve_api(
    shard: &Shard,
    c: &mut Client,
    p: &Principal,
    method: &str,
    path: &str,
    keep: bool,
) -> bool {
    let rest = path.trim_start_matches("/v1/responses/");
    let (id, items) = match rest.strip_suffix("/input_items") {
        Some(id) => (id, true),
        None => (rest, false),
    };
    if !responses::valid_id(id) {
        return respond::send_error(c, &not_found(id), keep).await;
    }
    let allowed = matches!((method, items), ("GET", _) | ("DELETE", false));
    if !allowed {
        let e = respond::method_not_allowed(method, path);
        return respond::send_error(c, &e, keep).await;
    }
    let tenant = p.tenant().to_string();
    if method == "DELETE" {
        let deleted = delete_record(&shard.router, &tenant, id).await;
        if !deleted {
            return respond::send_error(c, &not_found(id), keep).await;
        }
        let body = serde_json::json!({"id": id, "object": "response", "deleted": true});
        return respond::send_json(c, 200, body.to_string().as_bytes(), keep).await;
    }
    let raw = get_record(&shard.router, &tenant, id).await;
    let Some(record) = raw.and_then(|r| serde_json::from_slice::<Record>(&r).ok()) else {
        return respond::send_error(c, &not_found(id), keep).await;
    };
    let body = if items {
        responses::input_items(&record)
    } else {
        responses::render(&record)
    };
    respond::send_json(c, 200, body.to_string().as_bytes(), keep).await
}
