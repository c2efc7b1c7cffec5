//! What every client route reads before it is served (shared by
//! [`super::ingress`] and [`super::stateful`]): the credentials, and a
//! request body under `--max-request-bytes`, the body timeout and the
//! router-wide body budget.

use super::placing::Next;
use crate::logic::http::errors::ApiError;
use crate::logic::http::framing::http_parse::{BodyFraming, RequestHead};
use crate::runtime::request::respond;
use crate::runtime::state::scope::Client;
use crate::runtime::state::shard::Shard;
use crate::runtime::state::tenancy::{Principal, WWW_AUTHENTICATE};
use crate::runtime::wire::budget::BodyPermit;
use crate::runtime::wire::clock;

/// Authenticate a client route (the principal goes into the scope):
/// `Err(keep)` after the 401 is written.
pub(super) async fn authenticate(
    shard: &Shard,
    c: &mut Client,
    head: &RequestHead,
    keep: bool,
) -> Result<Principal, bool> {
    let now = clock::unix_secs();
    match shard.authenticate(head.header("authorization"), head.header("x-api-key"), now) {
        Ok(p) => {
            c.scope.principal = Some(p.clone());
            Ok(p)
        }
        Err(e) => Err(respond::send_error_with(c, &e.error(), keep, &[WWW_AUTHENTICATE]).await),
    }
}

/// The body under `--max-request-bytes`, the body timeout and the
/// router-wide body budget (`100 Continue` first when asked); `Err`: the
/// connection's next step after the refusal.
pub(super) async fn read_body(
    shard: &Shard,
    c: &mut Client,
    head: &RequestHead,
) -> Result<(Vec<u8>, BodyPermit), Next> {
    let cfg = &shard.router.cfg;
    let limit = cfg.max_request_bytes;
    if let BodyFraming::Length(n) = head.framing {
        if limit > 0 && n > limit {
            // Rejected from the declared length, before reading it.
            respond::send_error(c, &ApiError::body_too_large(limit), false).await;
            return Err(Next::Close);
        }
    }
    if head.expect_continue
        && head.framing != BodyFraming::None
        && c.conn.buf.is_empty()
        && c.write_all(respond::CONTINUE.to_vec()).await.is_err()
    {
        return Err(Next::Close);
    }
    let mut body_permit = shard.router.budget.body();
    let read = c
        .conn
        .read_request_body(head.framing, limit, cfg.body_timeout, &mut body_permit);
    match read.await {
        Ok(b) => Ok((b, body_permit)),
        Err(None) => Err(Next::Close),
        Err(Some(e)) => {
            // A full body budget is transient: say when to come back.
            let e = if e.status == 503 { e.retry_after(1) } else { e };
            respond::send_error(c, &e, false).await;
            Err(Next::Close)
        }
    }
}
