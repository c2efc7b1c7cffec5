//! The main thread's calls to the running shards and store (it has no
//! runtime: each call waits on a channel, bounded): today's usage
//! flushed, every shard's snapshot, requests in flight, the agents
//! registered, a timer. Used by the lifecycle (drain) and the upgrade
//! hand-over.

use shards::runtime::state::router::Router;

/// Send today's token usage to the store (`wait`: until persisted).
pub(crate) fn flush_quota(
    shared: &Router,
    store: &shards::runtime::services::store_api::StoreTx,
    wait: bool,
) {
    let states: Vec<((String, String), u64)> = shared
        .auth
        .load()
        .daily_states()
        .into_iter()
        .map(|((t, m), s)| ((t.to_string(), m), s))
        .collect();
    if states.is_empty() {
        return;
    }
    let (t, r) = futures::channel::oneshot::channel();
    let msg = shards::runtime::services::store_api::StoreMsg::QuotaFlush {
        states,
        done: if wait { Some(t) } else { None },
    };
    if store.send(msg).is_ok() && wait {
        let _ = futures::executor::block_on(r);
    }
}

/// Send a message to every shard, then wait for each reply, `within` at
/// most each (a shard that does not answer is left out).
pub(crate) fn each_shard<T>(
    shared: &Router,
    within: std::time::Duration,
    make: impl Fn(futures::channel::oneshot::Sender<T>) -> shards::runtime::state::mesh::ShardMsg,
) -> Vec<T> {
    let mut waits = Vec::new();
    for tx in &shared.mesh {
        let (t, r) = futures::channel::oneshot::channel();
        if tx.unbounded_send(make(t)).is_ok() {
            waits.push(r);
        }
    }
    waits
        .into_iter()
        .filter_map(|r| {
            futures::executor::block_on(async {
                let timeout = futures::FutureExt::fuse(futures_timer(within));
                futures::pin_mut!(timeout);
                futures::select! { v = futures::FutureExt::fuse(r) => v.ok(), _ = timeout => None }
            })
        })
        .collect()
}

/// Every shard's snapshot (a shard that does not answer within 1 s is
/// left out).
pub(crate) fn snapshots(shared: &Router) -> Vec<shards::runtime::state::views::ShardSnapshot> {
    each_shard(shared, std::time::Duration::from_secs(1), |reply| {
        shards::runtime::state::mesh::ShardMsg::Snapshot { reply }
    })
}

/// Requests in flight on every shard (from their snapshots).
pub(crate) fn in_flight(shared: &Router) -> u64 {
    let total: u64 = snapshots(shared)
        .iter()
        .flat_map(|s| s.agents.iter())
        .map(|a| u64::from(a.active))
        .sum();
    // Held requests count until their answer is written (a shutdown
    // answers them model_waking; exiting first would cut those answers).
    total + shared.holds.lock().ledger.held().0
}

/// The peer IDs of the agents registered on every shard.
pub(crate) fn agents_here(shared: &Router) -> std::collections::HashSet<String> {
    snapshots(shared)
        .into_iter()
        .flat_map(|s| s.agents.into_iter().map(|a| a.peer_id))
        .collect()
}

/// A timer future for the main thread (no runtime there).
pub(crate) fn futures_timer(d: std::time::Duration) -> impl std::future::Future<Output = ()> {
    let (tx, rx) = futures::channel::oneshot::channel::<()>();
    std::thread::spawn(move || {
        std::thread::sleep(d);
        let _ = tx.send(());
    });
    async move {
        let _ = rx.await;
    }
}
