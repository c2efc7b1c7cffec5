//! A shard's event loop: its listeners (client HTTP, metrics, agent
//! links) under one accept loop, the periodic history flush, and the
//! cross-core messages it receives.
//!
//! Entry point: [`run`].

use std::future::Future;
use std::net::TcpListener as StdListener;
use std::rc::Rc;
use std::sync::Arc;

use futures::channel::mpsc::UnboundedReceiver;
use futures::StreamExt;
use tracing::warn;

use crate::logic::system::upgrade::ListenerKind;
use crate::runtime::state::mesh::ShardMsg;
use crate::runtime::state::router::Router;
use crate::runtime::state::shard::{inc, Shard};
use crate::runtime::wire::conn::Conn;
use crate::runtime::wire::handoff;

/// Listeners of one shard: bound by the main thread with SO_REUSEPORT, or
/// received from the process this one replaces (then a shard may have
/// several of a kind, or none).
pub struct ShardListeners {
    /// Client HTTP.
    pub http: Vec<StdListener>,
    /// Prometheus.
    pub metrics: Vec<StdListener>,
    /// Agent links.
    pub p2p: Vec<StdListener>,
    /// Accept clients (HTTP, metrics) from the start; `false` while an
    /// upgrade's old process still does (they start on `Accept`).
    pub clients: bool,
}

/// The shard's listeners and the switches of their accept loops.
struct Accepting {
    listeners: Vec<(ListenerKind, Rc<monoio::net::TcpListener>)>,
    /// The running loops' cancellers, by kind.
    running: Vec<(
        ListenerKind,
        monoio::io::Canceller,
        Rc<std::cell::Cell<bool>>,
    )>,
}

impl Accepting {
    /// Start (`on`) or stop accepting on every listener of `kind`.
    fn switch(&mut self, shard: &Rc<Shard>, kind: ListenerKind, on: bool) {
        let running = self.running.iter().any(|(k, _, _)| *k == kind);
        if on && !running {
            for (k, l) in self.listeners.iter().filter(|(k, _)| *k == kind) {
                let c = monoio::io::Canceller::new();
                let stopped = Rc::new(std::cell::Cell::new(false));
                let handle = (c.handle(), stopped.clone());
                let l = l.clone();
                match k {
                    ListenerKind::Http => accept_loop(shard, "HTTP", l, handle, serve_http),
                    ListenerKind::Metrics => {
                        accept_loop(shard, "metrics", l, handle, |shard, s| {
                            crate::runtime::metrics::serve(shard, Conn::new(s, Vec::new()))
                        })
                    }
                    ListenerKind::P2p => {
                        accept_loop(shard, "p2p", l, handle, super::agent_link::accept_link)
                    }
                }
                self.running.push((kind, c, stopped));
            }
        } else if !on {
            // A connection the kernel gave an accept being cancelled is
            // served, never dropped (the cancelled accept still returns it).
            let (stop, keep) = std::mem::take(&mut self.running)
                .into_iter()
                .partition(|(k, _, _)| *k == kind);
            self.running = keep;
            for (_, c, stopped) in stop {
                stopped.set(true);
                c.cancel();
            }
        }
    }
}

async fn serve_http(shard: Rc<Shard>, s: monoio::net::TcpStream) {
    let conn = Conn::new(s, Vec::new());
    match shard.router.budget.connection() {
        Some(permit) => super::ingress::serve(shard, conn, None, permit).await,
        None => refuse_connection(conn).await,
    }
}

/// Accept connections on `listener` until `stop` is cancelled, serving
/// each with `serve`.
fn accept_loop<F, Fut>(
    shard: &Rc<Shard>,
    what: &'static str,
    listener: Rc<monoio::net::TcpListener>,
    (stop, stopped): (monoio::io::CancelHandle, Rc<std::cell::Cell<bool>>),
    serve: F,
) where
    F: Fn(Rc<Shard>, monoio::net::TcpStream) -> Fut + 'static,
    Fut: Future<Output = ()> + 'static,
{
    let shard = shard.clone();
    monoio::spawn(async move {
        // Accept errors come in floods (out of descriptors): one line a
        // second, with how many it stands for (issue 29 #4).
        let mut gate = crate::logic::system::log_gate::LogGate::default();
        loop {
            match listener.cancelable_accept(stop.clone()).await {
                Ok((s, _)) => {
                    monoio::spawn(serve(shard.clone(), s));
                }
                Err(_) if stopped.get() => return,
                Err(e) => {
                    // Out of descriptors and the like: back off, keep serving.
                    let now = crate::runtime::wire::clock::now();
                    if let Some(n) = gate.hit(now, std::time::Duration::from_secs(1)) {
                        warn!(
                            shard = shard.id,
                            errors = n,
                            "{what} accept: {e} ({n} accept error(s) since the previous line)"
                        );
                    }
                    monoio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    });
}

/// Over `--max-client-connections`: answer 503 with `Retry-After` and
/// close, without reading anything.
async fn refuse_connection(conn: Conn) {
    let mut c = crate::runtime::state::scope::Client::new(conn);
    c.scope = crate::runtime::state::scope::RequestScope::fresh(crate::runtime::wire::clock::now());
    let err = crate::logic::http::errors::ApiError::new(
        crate::logic::http::errors::ErrorCode::NoCapacity,
        "the router has too many client connections; retry shortly",
    )
    .retry_after(1);
    let _ = monoio::time::timeout(
        std::time::Duration::from_secs(1),
        crate::runtime::request::respond::send_error(&mut c, &err, false),
    )
    .await;
}

/// Run a shard until its mesh channel closes.
pub async fn run(
    id: usize,
    router: Arc<Router>,
    listeners: ShardListeners,
    mut rx: UnboundedReceiver<ShardMsg>,
) {
    let shard = Rc::new(Shard::new(id, router));
    let mut accepting = Accepting {
        listeners: Vec::new(),
        running: Vec::new(),
    };
    let kinds = [
        (ListenerKind::Http, listeners.http),
        (ListenerKind::Metrics, listeners.metrics),
        (ListenerKind::P2p, listeners.p2p),
    ];
    for (kind, ls) in kinds {
        for l in ls {
            match monoio::net::TcpListener::from_std(l) {
                Ok(l) => accepting.listeners.push((kind, Rc::new(l))),
                Err(e) => warn!(shard = shard.id, "cannot adopt a {kind:?} listener: {e}"),
            }
        }
    }
    accepting.switch(&shard, ListenerKind::P2p, true);
    if listeners.clients {
        accepting.switch(&shard, ListenerKind::Http, true);
        accepting.switch(&shard, ListenerKind::Metrics, true);
    }
    {
        // Periodic history flush.
        let shard = shard.clone();
        monoio::spawn(async move {
            let every = shard.router.cfg.flush_interval;
            loop {
                monoio::time::sleep(every).await;
                shard.flush(&shard.all_agents(), None);
            }
        });
    }
    {
        // Names of models whose agents all left are forgotten after
        // --remove-after (issue 29 #2).
        let shard = shard.clone();
        monoio::spawn(async move {
            let after = shard.router.cfg.remove_after;
            let every = (after / 2).max(std::time::Duration::from_secs(1));
            loop {
                monoio::time::sleep(every).await;
                let n = shard.forget_idle_models(after);
                if n > 0 {
                    tracing::info!(
                        shard = shard.id,
                        forgotten = n,
                        "models without agents forgotten"
                    );
                }
            }
        });
    }
    while let Some(msg) = rx.next().await {
        on_message(&shard, &mut accepting, msg);
    }
}

/// Serve a connection the process this one replaced sent (issue 54).
fn adopt_carried(shard: &Rc<Shard>, o: crate::runtime::state::carry_out::Outgoing) {
    let s = match handoff::adopt(o.stream) {
        Ok(s) => s,
        Err(e) => {
            warn!(shard = shard.id, "cannot adopt a carried connection: {e}");
            return;
        }
    };
    // Under the connection cap like any other; over it, served anyway:
    // it was accepted once already.
    let permit = shard.router.budget.connection_forced();
    // Its bytes are read already; its first request was held there, or
    // its stream relayed there until the drain timeout.
    let mut c = crate::runtime::state::scope::Client::new(Conn::new(s, o.bytes));
    (c.carried, c.resumed) = (o.hold.map(Box::new), o.resumed);
    monoio::spawn(super::ingress::serve_client(shard.clone(), c, None, permit));
}

fn on_message(shard: &Rc<Shard>, accepting: &mut Accepting, msg: ShardMsg) {
    match msg {
        ShardMsg::Accept { kind, on, reply } => {
            accepting.switch(shard, kind, on);
            let _ = reply.send(());
        }
        ShardMsg::HandOverHolds => super::hold::hand_over(shard),
        ShardMsg::AffinityDump { reply } => {
            let _ = reply.send(crate::runtime::request::affinity::dump(shard));
        }
        ShardMsg::AdoptCarried(o) => adopt_carried(shard, *o),
        ShardMsg::Relink { reply } => super::carry::relink_all(shard, reply),
        ShardMsg::CutStreams { reply } => {
            let cut = shard.all_agents().iter().map(|a| a.cut_streams()).sum();
            let _ = reply.send(cut);
        }
        ShardMsg::DrainAgent { peer_id, on, reply } => {
            let _ = reply.send(shard.drain_agent(&peer_id, on));
        }
        ShardMsg::ResetMetrics { reply } => {
            shard.reset_metrics();
            let _ = reply.send(());
        }
        ShardMsg::Shutdown { reply } => {
            // Flush everything; the store processes this before the main
            // thread's shutdown message (one FIFO channel).
            shard.flush(&shard.all_agents(), None);
            let _ = reply.send(());
        }
        ShardMsg::AdoptHttp(h) => match handoff::adopt(h.stream) {
            Ok(s) => {
                inc(&shard.counters.handoffs_in);
                monoio::spawn(super::ingress::serve(
                    shard.clone(),
                    Conn::new(s, h.buf),
                    Some(h.pending),
                    h.permit,
                ));
            }
            Err(e) => warn!(shard = shard.id, "cannot adopt client connection: {e}"),
        },
        ShardMsg::AdoptLink {
            stream,
            prefix,
            model,
            permit,
        } => match handoff::adopt(stream) {
            Ok(s) => {
                monoio::spawn(super::agent_link::serve_link(
                    shard.clone(),
                    s,
                    prefix,
                    model,
                    permit,
                ));
            }
            Err(e) => {
                shard.router.release(&model);
                warn!(shard = shard.id, "cannot adopt agent link: {e}");
            }
        },
        ShardMsg::Snapshot { reply } => {
            let _ = reply.send(shard.snapshot());
        }
        ShardMsg::Woken(model) => super::hold::wake(shard, &model),
        ShardMsg::Affinity { model, notes } => shard.record_foreign_affinity(&model, &notes),
        ShardMsg::MapChanged => super::hold::map_changed(shard),
        ShardMsg::ReleaseHolds => super::hold::shut_down(shard),
    }
}
