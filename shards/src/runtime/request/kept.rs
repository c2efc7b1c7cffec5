//! What the router keeps for its clients (issue 52: Responses turns and
//! conversations), read and written where it lives: this router's store
//! (its thread, asked over a channel) and, with `--shared-state`, Redis
//! (the fleet's truth when it answers). Used by [`super::responses`] and
//! [`super::conversations`].

use std::time::Duration;

use futures::channel::oneshot;

use crate::runtime::services::shared_state::conversations;
use crate::runtime::services::store_api::StoreMsg;
use crate::runtime::state::router::Router;

/// Longest wait for the store's answer.
const STORE_WAIT: Duration = Duration::from_secs(2);
/// Ask the store; `None`: no store, or no answer in time.
pub(super) async fn ask<T>(
    router: &Router,
    msg: impl FnOnce(oneshot::Sender<T>) -> StoreMsg,
) -> Option<T> {
    let tx = router.store.as_ref()?;
    let (reply, rx) = oneshot::channel();
    tx.send(msg(reply)).ok()?;
    monoio::time::timeout(STORE_WAIT, rx).await.ok()?.ok()
}

/// Ask the fleet's copy in Redis (`None`: no shared state, or no answer).
pub(super) async fn ask_fleet<T>(
    router: &Router,
    op: impl FnOnce(oneshot::Sender<T>) -> conversations::Op,
) -> Option<T> {
    let shared = router.shared_state.as_ref()?;
    let (reply, rx) = oneshot::channel();
    shared.responses(op(reply));
    monoio::time::timeout(STORE_WAIT, rx).await.ok()?.ok()
}

/// Longest wait for Redis to hold a finished turn before its end goes
/// to the client anyway (the write still lands when Redis catches up).
pub(super) const KEEP_WAIT: Duration = Duration::from_secs(1);

/// A kept record of `tenant` (a response or a conversation): Redis's
/// copy when it answers (the fleet's truth), else this router's store.
pub(super) async fn get_record(router: &Router, tenant: &str, id: &str) -> Option<Vec<u8>> {
    let (t, i) = (tenant.to_string(), id.to_string());
    let fleet = ask_fleet(router, |reply| conversations::Op::Get {
        tenant: t,
        id: i,
        reply,
    })
    .await;
    match fleet {
        Some(v) => v,
        None => {
            let (t, i) = (tenant.to_string(), id.to_string());
            ask(router, |reply| StoreMsg::ResponseGet {
                tenant: t,
                id: i,
                reply,
            })
            .await
            .flatten()
        }
    }
}

/// Delete a kept record of `tenant` here and in Redis; whether it was
/// there (Redis's word when it answers).
pub(super) async fn delete_record(router: &Router, tenant: &str, id: &str) -> bool {
    let (t, i) = (tenant.to_string(), id.to_string());
    let here = ask(router, |reply| StoreMsg::ResponseDelete {
        tenant: t,
        id: i,
        reply,
    })
    .await;
    let (t, i) = (tenant.to_string(), id.to_string());
    let fleet = ask_fleet(router, |reply| conversations::Op::Delete {
        tenant: t,
        id: i,
        reply,
    })
    .await;
    fleet.or(here) == Some(true)
}
