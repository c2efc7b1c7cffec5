//! The store given to the process replacing this one (issue 54): the new
//! process opens the files once this one closed them; until then and
//! after, this thread forwards every message to it (the upgrade's link)
//! instead of touching the disk, until it is told to open the store again
//! (the new process failed) or to stop.

use std::sync::mpsc::Receiver;

use futures::channel::oneshot;
use shards::runtime::services::store_api::StoreMsg;

/// How forwarding ended.
pub(super) enum Back {
    /// Open the store again and say whether it opened.
    Resume(oneshot::Sender<Result<(), String>>),
    /// Stop (the process exits).
    Shutdown(oneshot::Sender<()>),
    /// Every sender is gone.
    Gone,
}

/// Forward every message to `to` until `Resume` or `Shutdown`.
pub(super) fn forward(rx: &Receiver<StoreMsg>, mut to: Box<dyn FnMut(StoreMsg) + Send>) -> Back {
    loop {
        match rx.recv() {
            Err(_) => return Back::Gone,
            Ok(StoreMsg::Resume { done }) => return Back::Resume(done),
            Ok(StoreMsg::Shutdown { done }) => return Back::Shutdown(done),
            Ok(m) => to(m),
        }
    }
}
