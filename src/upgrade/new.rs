//! The replacing router's side of an upgrade (issue 54): started with
//! `--upgrade`, after its flags and files were checked, it takes the
//! running router's listening sockets, then its store, then its agents,
//! then its clients, and serves the connections and held requests the old
//! process sends over while that one finishes its streams.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use shards::logic::system::upgrade::{self as proto, ListenerKind, Msg, StoreAnswer, StoreCall};
use shards::runtime::services::store_api::{ChainError, StoreMsg, StoreTx};
use shards::runtime::state::carry_out::Outgoing;
use shards::runtime::state::mesh::ShardMsg;
use shards::runtime::state::router::Router;
use tracing::{info, warn};

use super::{next_step, Link, STEP};

/// The running router's link and sockets.
pub(crate) struct Inherit {
    link: Link,
    listeners: Vec<(ListenerKind, std::net::TcpListener)>,
}

/// Connect to the running router on `socket` and take its listening
/// sockets.
pub(crate) fn connect(socket: &std::path::Path) -> Result<Inherit, String> {
    let sock = std::os::unix::net::UnixStream::connect(socket).map_err(|e| {
        format!(
            "--upgrade: no running router to take over at {} ({e})",
            socket.display()
        )
    })?;
    let link = Link::new(sock).map_err(|e| e.to_string())?;
    link.read_timeout(Some(STEP));
    link.say(&Msg::Hello {
        pid: std::process::id(),
        version: format!("hivenet-router {}", shards::version()),
    })?;
    let mut listeners = Vec::new();
    loop {
        match link.expect("the listeners")? {
            (Msg::Listener { kind }, _, fds) => {
                for fd in fds {
                    listeners.push((kind, std::net::TcpListener::from(fd)));
                }
            }
            (Msg::Listeners, _, _) => break,
            (other, _, _) => return Err(format!("--upgrade: unexpected message {other:?}")),
        }
    }
    info!(
        listeners = listeners.len(),
        "upgrade: the running router's listening sockets received"
    );
    Ok(Inherit { link, listeners })
}

impl Inherit {
    /// The received listeners of `kind`, dealt over `shards` shards (a
    /// shard may get several, or none when there are fewer than shards).
    pub(crate) fn deal(
        &mut self,
        kind: ListenerKind,
        shards: usize,
    ) -> Vec<Vec<std::net::TcpListener>> {
        let mut out: Vec<Vec<_>> = (0..shards.max(1)).map(|_| Vec::new()).collect();
        let mine: Vec<_> = {
            let (mine, rest) = std::mem::take(&mut self.listeners)
                .into_iter()
                .partition(|(k, _)| *k == kind);
            self.listeners = rest;
            mine
        };
        for (i, (_, l)) in mine.into_iter().enumerate() {
            if let Some(v) = out.get_mut(i % shards.max(1)) {
                v.push(l);
            }
        }
        out
    }

    /// Ask for the store; returns once the old process closed it.
    pub(crate) fn want_store(&self) -> Result<(), String> {
        self.link.say(&Msg::WantState)?;
        match self.link.expect("the store")?.0 {
            Msg::StoreFree => {
                info!("upgrade: the store is ours");
                Ok(())
            }
            other => Err(format!("--upgrade: unexpected message {other:?}")),
        }
    }

    /// Take the agents and clients over (the shards run, accepting agent
    /// links only); returns once this process accepts clients.
    pub(crate) fn take_over(self, shared: Arc<Router>, store: StoreTx) -> Result<(), String> {
        self.link.read_timeout(None);
        let steps = reader(self.link.clone(), shared.clone(), store);
        self.link.say(&Msg::Started)?;
        let peers = match next_step(&steps, "agent list", STEP)? {
            Msg::Expect {
                peers,
                policies,
                drained,
                sibling_map,
                registry,
            } => {
                if let Some(json) = policies {
                    take_policies(&shared, &json);
                }
                if let Some(json) = registry {
                    take_registry(&shared, &json);
                }
                if let Some(body) = sibling_map {
                    let path = "/admin/sibling-map";
                    let target = "/admin/sibling-map?force=true";
                    let r = shards::runtime::admin::sites::sites_api(
                        &shared,
                        "PUT",
                        path,
                        target,
                        body.as_bytes(),
                    );
                    info!(status = ?r.map(|r| r.0), "upgrade: the sibling map carried over");
                }
                (peers, drained)
            }
            other => return Err(format!("--upgrade: unexpected message {other:?}")),
        };
        let (peers, drained) = peers;
        let linked = wait_linked(&shared, &peers, Duration::from_secs(10));
        // Before clients: an agent drained there takes nothing new here.
        for peer_id in drained {
            let found = crate::shard_calls::each_shard(&shared, Duration::from_secs(5), |reply| {
                ShardMsg::DrainAgent {
                    peer_id: peer_id.clone(),
                    on: true,
                    reply,
                }
            });
            if found.iter().all(Option::is_none) {
                warn!(%peer_id, "upgrade: an agent drained there did not link here; its drain mark is lost");
            }
        }
        if linked.len() < peers.len() {
            warn!(
                expected = peers.len(),
                linked = linked.len(),
                "upgrade: not every agent linked in time; the others follow when the old process closes their links"
            );
        }
        self.link.say(&Msg::Linked { peers: linked })?;
        match next_step(&steps, "go", STEP)? {
            Msg::Go { rates } => {
                let rates: Vec<_> = rates
                    .into_iter()
                    .map(|(t, m, ahead)| ((Arc::<str>::from(t.as_str()), m), ahead))
                    .collect();
                let now = shards::runtime::wire::clock::mono_ns();
                shared.auth.load().take_rates(&rates, now);
            }
            other => return Err(format!("--upgrade: unexpected message {other:?}")),
        }
        for kind in [ListenerKind::Http, ListenerKind::Metrics] {
            for tx in &shared.mesh {
                let (reply, r) = futures::channel::oneshot::channel();
                let _ = tx.unbounded_send(ShardMsg::Accept {
                    kind,
                    on: true,
                    reply,
                });
                let _ = futures::executor::block_on(r);
            }
        }
        super::notify_systemd(&format!("MAINPID={}\nREADY=1", std::process::id()));
        info!("upgrade: this process serves; the old one finishes its streams");
        Ok(())
    }
}

/// The policies the old process had from its admin API, in force here
/// instead of the files' (as they were there).
fn take_policies(shared: &Router, json: &str) {
    let applied = serde_json::from_str::<serde_json::Value>(json)
        .map_err(|e| e.to_string())
        .and_then(|v| {
            shards::runtime::admin::policy::apply_policy_set_json(shared, &v)
                .map_err(|e| e.to_string())
        });
    match applied {
        Ok(()) => info!("upgrade: the policies written through the admin API carried over"),
        Err(e) => warn!(
            "upgrade: the admin API's policies could not be carried over (the files' stay): {e}"
        ),
    }
}

/// The old process's dynamic keys, in force here from now on.
fn take_registry(shared: &Router, json: &str) {
    use shards::logic::tenancy::registry::{Registry, Snapshot};
    let reg = serde_json::from_str::<Snapshot>(json)
        .map_err(|e| e.to_string())
        .and_then(|s| Registry::from_snapshot(s, 0).map_err(|e| format!("{e:?}")));
    match reg {
        Ok(reg) => {
            shared.publish_registry(&reg);
            let keys = reg.list().len();
            match shared.registry.lock() {
                Ok(mut g) => *g = reg,
                Err(p) => *p.into_inner() = reg,
            }
            info!(keys, "upgrade: the dynamic key registry carried over");
        }
        Err(e) => warn!("upgrade: the dynamic key registry could not be carried over: {e}"),
    }
}

/// The peers of `want` registered here, waiting up to `within`.
fn wait_linked(shared: &Router, want: &[String], within: Duration) -> Vec<String> {
    let started = std::time::Instant::now();
    loop {
        let here = crate::shard_calls::agents_here(shared);
        let linked: Vec<String> = want.iter().filter(|p| here.contains(*p)).cloned().collect();
        if linked.len() == want.len() || started.elapsed() >= within {
            return linked;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Read the old process's messages: connections go to the shards (in
/// turn), usage deltas into the buckets, store calls to the store;
/// protocol steps are passed on.
fn reader(link: Link, shared: Arc<Router>, store: StoreTx) -> super::Steps {
    let (tx, rx) = std::sync::mpsc::channel();
    let _ = std::thread::Builder::new()
        .name("upgrade-read".into())
        .spawn(move || {
            let mut next = 0usize;
            loop {
                let (m, payload, fds) = match link.recv() {
                    Ok(Some(f)) => f,
                    Ok(None) => return,
                    Err(e) => {
                        warn!("upgrade link: {e}");
                        return;
                    }
                };
                match m {
                    Msg::Conn { hold, stream } => {
                        adopt(&shared, &mut next, fds, payload, hold, stream);
                    }
                    Msg::Usage { deltas } => {
                        let auth = shared.auth.load();
                        for (t, m, day, delta) in deltas {
                            auth.add_usage(&(Arc::from(t.as_str()), m), day, delta);
                        }
                    }
                    Msg::Store { id, call } => {
                        let (answer, out) = store_call(&store, call, payload);
                        if let Some(answer) = answer {
                            let _ = link.send(&Msg::StoreReply { id, answer }, &out, &[]);
                        }
                    }
                    Msg::Affinity { model } => {
                        let notes =
                            shards::logic::routing::affinity::AffinityNote::decode_all(&payload);
                        let owner = shared.directory.load().assigned(&model);
                        if let Some(tx) = owner.and_then(|o| shared.mesh.get(o)) {
                            let _ = tx.unbounded_send(ShardMsg::Affinity { model, notes });
                        }
                    }
                    Msg::Done => info!("upgrade: the old process finished and exits"),
                    step => {
                        let _ = tx.send(step);
                    }
                }
            }
        });
    rx
}

fn adopt(
    shared: &Router,
    next: &mut usize,
    fds: Vec<OwnedFd>,
    payload: Vec<u8>,
    hold: Option<proto::CarriedHold>,
    resumed: Option<Box<proto::CarriedStream>>,
) {
    let Some(fd) = fds.into_iter().next() else {
        warn!("upgrade link: a connection without its socket");
        return;
    };
    // A held request goes to its model's hold shard, a stream to its
    // model's shard (where it is continued); a connection to the shards
    // in turn.
    let owner = resumed
        .as_ref()
        .and_then(|r| shared.directory.load().assigned(&r.model));
    let shard = match (owner, hold.as_ref().filter(|h| !h.model.is_empty())) {
        (Some(o), _) => o,
        (None, Some(h)) => shards::runtime::front::hold::hold_shard(shared, &h.model),
        (None, None) => {
            *next = (*next + 1) % shared.mesh.len().max(1);
            *next
        }
    };
    let Some(tx) = shared.mesh.get(shard) else {
        return;
    };
    let o = Outgoing {
        stream: std::net::TcpStream::from(fd),
        bytes: payload,
        hold,
        resumed,
    };
    let _ = tx.unbounded_send(ShardMsg::AdoptCarried(Box::new(o)));
}

/// Carry out one forwarded store call: its answer and payload (`None`:
/// none is due).
fn store_call(
    store: &StoreTx,
    call: StoreCall,
    payload: Vec<u8>,
) -> (Option<StoreAnswer>, Vec<u8>) {
    use futures::channel::oneshot;
    match call {
        StoreCall::Put {
            tenant,
            id,
            created_at,
        } => {
            let _ = store.send(StoreMsg::ResponsePut {
                tenant,
                id,
                created_at,
                record: payload,
            });
            (None, Vec::new())
        }
        StoreCall::Get { tenant, id } => {
            let (reply, r) = oneshot::channel();
            let _ = store.send(StoreMsg::ResponseGet { tenant, id, reply });
            let got = futures::executor::block_on(r).ok().flatten();
            let found = got.is_some();
            (Some(StoreAnswer::Record { found }), got.unwrap_or_default())
        }
        StoreCall::Chain { tenant, id } => {
            let (reply, r) = oneshot::channel();
            let _ = store.send(StoreMsg::ResponseChain {
                tenant,
                id: id.clone(),
                reply,
            });
            match futures::executor::block_on(r) {
                Ok(Ok(recs)) => (
                    Some(StoreAnswer::Chain {
                        missing: None,
                        too_long: None,
                    }),
                    proto::pack(&recs),
                ),
                Ok(Err(ChainError::TooLong(n))) => (
                    Some(StoreAnswer::Chain {
                        missing: None,
                        too_long: Some(n),
                    }),
                    Vec::new(),
                ),
                Ok(Err(ChainError::NotFound(m))) => (
                    Some(StoreAnswer::Chain {
                        missing: Some(m),
                        too_long: None,
                    }),
                    Vec::new(),
                ),
                Err(_) => (
                    Some(StoreAnswer::Chain {
                        missing: Some(id),
                        too_long: None,
                    }),
                    Vec::new(),
                ),
            }
        }
        StoreCall::Delete { tenant, id } => {
            let (reply, r) = oneshot::channel();
            let _ = store.send(StoreMsg::ResponseDelete { tenant, id, reply });
            let found = futures::executor::block_on(r).unwrap_or(false);
            (Some(StoreAnswer::Deleted { found }), Vec::new())
        }
    }
}
