//! The Conversations API (issue 52), the shell: `/v1/conversations` and
//! its items, kept like Responses turns (this router's store, and with
//! `--shared-state` Redis, which is the truth when it answers), each the
//! tenant's own: another tenant's ID is answered as unknown (404). A
//! Responses turn naming `conversation` reads it ([`load`]) and adds its
//! items to it when it ends ([`append`]).
//!
//! A conversation is one record, read, changed and written whole: two
//! turns of one conversation at once (which the API's clients do not
//! send) may lose one's items; the bounds of stored conversations
//! (`--responses-max-bytes-per-tenant`, the TTL, counted from its last
//! change) hold for it as for responses.
//!
//! Key items: [`serve_api`], [`load`], [`append`].

use futures::channel::oneshot;
use serde_json::Value;

use super::kept::{delete_record, get_record, KEEP_WAIT};
use super::respond;
use crate::logic::http::api::conversations::{self as api, Conversation};
use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::runtime::services::shared_state::conversations as fleet;
use crate::runtime::services::store_api::StoreMsg;
use crate::runtime::state::router::Router;
use crate::runtime::state::scope::Client;
use crate::runtime::state::shard::Shard;
use crate::runtime::state::tenancy::Principal;
use crate::runtime::wire::clock;

/// The 404 of a conversation not found (or another tenant's).
pub fn not_found(id: &str) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!("Conversation with id '{id}' not found."),
    )
}

fn bad(m: api::Invalid) -> ApiError {
    ApiError::new(ErrorCode::RequestInvalid, m.0)
}

/// The conversation `id` of `tenant` (Redis first, then this router's
/// store); `None`: not found.
pub async fn load(router: &Router, tenant: &str, id: &str) -> Option<Conversation> {
    let raw = get_record(router, tenant, id).await;
    raw.and_then(|r| serde_json::from_slice::<Conversation>(&r).ok())
        .filter(|c| c.id == id)
}

/// Write `c` whole (this router's store, then Redis, waited for up to a
/// second). `Err`: it is over the per-tenant bound and was not written.
pub async fn save(router: &Router, tenant: &str, c: &Conversation) -> Result<(), ApiError> {
    let record = serde_json::to_vec(c).unwrap_or_default();
    let bound = router.cfg.responses_per_tenant;
    if bound > 0 && record.len() as u64 > bound {
        return Err(bad(api::Invalid(format!(
            "the conversation would be {} bytes, over the {bound} bytes kept per tenant",
            record.len()
        ))));
    }
    // Its TTL and place in the eviction order count from its last change.
    let now = clock::unix_secs();
    if let Some(tx) = router.store.as_ref() {
        let _ = tx.send(StoreMsg::ResponsePut {
            tenant: tenant.to_string(),
            id: c.id.clone(),
            created_at: now,
            record: record.clone(),
        });
    }
    if let Some(shared) = router.shared_state.as_ref() {
        let (stored, rx) = oneshot::channel();
        shared.responses(fleet::Op::Put {
            tenant: tenant.to_string(),
            id: c.id.clone(),
            created_at: now,
            record,
            per_tenant: router.cfg.responses_per_tenant,
            ttl_secs: router.cfg.responses_ttl_secs,
            stored,
        });
        let _ = monoio::time::timeout(KEEP_WAIT, rx).await;
    }
    Ok(())
}

/// A turn of conversation `id` ended: its input and output items are
/// added (read again first: the latest copy).
pub async fn append(
    router: &Router,
    tenant: &str,
    id: &str,
    input: Vec<Value>,
    output: Vec<Value>,
) {
    let Some(mut c) = load(router, tenant, id).await else {
        tracing::warn!(
            conversation = id,
            "responses: the conversation is gone; the turn's items are not added"
        );
        return;
    };
    c.add(input);
    c.add(output);
    if let Err(e) = save(router, tenant, &c).await {
        tracing::warn!(
            conversation = id,
            "responses: the turn's items are not added: {}",
            e.message
        );
    }
}

/// Whether `path` is a Conversations API route.
pub fn is_api_path(path: &str) -> bool {
    path == "/v1/conversations" || path.starts_with("/v1/conversations/")
}

/// `/v1/conversations[/{id}[/items[/{item_id}]]]` for `p`'s tenant;
/// `query`: the target's query (an items list's page).
#[allow(clippy::too_many_arguments)]
pub async fn serve_api(
    shard: &Shard,
    c: &mut Client,
    p: &Principal,
    method: &str,
    path: &str,
    query: &str,
    body: &[u8],
    keep: bool,
) -> bool {
    let answer = answer(shard, p.tenant(), method, path, query, body).await;
    match answer {
        Ok(v) => respond::send_json(c, 200, v.to_string().as_bytes(), keep).await,
        Err(e) => respond::send_error(c, &e, keep).await,
    }
}

async fn answer(
    shard: &Shard,
    tenant: &str,
    method: &str,
    path: &str,
    query: &str,
    body: &[u8],
) -> Result<Value, ApiError> {
    let rest = path.trim_start_matches("/v1/conversations");
    let parts: Vec<&str> = rest.trim_start_matches('/').split('/').collect();
    let not_allowed = || respond::method_not_allowed(method, path);
    match (method, parts.as_slice()) {
        ("POST", [""]) => {
            let (items, metadata) = api::parse_create(body).map_err(bad)?;
            let id = api::new_id(rand::random());
            let c = Conversation::new(id, clock::unix_secs(), metadata, items);
            save(&shard.router, tenant, &c).await?;
            Ok(c.object())
        }
        (_, [""]) => Err(not_allowed()),
        (_, [id, ..]) if !api::is_id(id) => Err(not_found(id)),
        ("GET", [id]) => Ok(found(shard, tenant, id).await?.object()),
        ("POST", [id]) => {
            let v = api::object(body).map_err(bad)?;
            let metadata = api::parse_metadata(v.get("metadata")).map_err(bad)?;
            let mut c = found(shard, tenant, id).await?;
            c.metadata = metadata;
            save(&shard.router, tenant, &c).await?;
            Ok(c.object())
        }
        ("DELETE", [id]) => {
            found(shard, tenant, id).await?;
            delete_record(&shard.router, tenant, id).await;
            Ok(api::deleted(id))
        }
        ("GET", [id, "items"]) => {
            let (after, limit, asc) = api::parse_list(query).map_err(bad)?;
            Ok(found(shard, tenant, id)
                .await?
                .list(after.as_deref(), limit, asc))
        }
        ("POST", [id, "items"]) => {
            let v = api::object(body).map_err(bad)?;
            let items = api::parse_items(v.get("items")).map_err(bad)?;
            let mut c = found(shard, tenant, id).await?;
            let added = c.add(items);
            save(&shard.router, tenant, &c).await?;
            Ok(api::list_of(added, false))
        }
        ("GET", [id, "items", item]) => {
            let c = found(shard, tenant, id).await?;
            c.item(item).ok_or_else(|| item_not_found(item))
        }
        ("DELETE", [id, "items", item]) => {
            let mut c = found(shard, tenant, id).await?;
            if !c.delete_item(item) {
                return Err(item_not_found(item));
            }
            save(&shard.router, tenant, &c).await?;
            Ok(c.object())
        }
        (_, [_] | [_, "items"] | [_, "items", _]) => Err(not_allowed()),
        _ => Err(ApiError::new(
            ErrorCode::NotFound,
            format!("no route {method} {path}"),
        )),
    }
}

async fn found(shard: &Shard, tenant: &str, id: &str) -> Result<Conversation, ApiError> {
    load(&shard.router, tenant, id)
        .await
        .ok_or_else(|| not_found(id))
}

fn item_not_found(id: &str) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!("Item with id '{id}' not found."),
    )
}
