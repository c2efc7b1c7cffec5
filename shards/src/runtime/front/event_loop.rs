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

use crate::runtime::state::mesh::ShardMsg;
use crate::runtime::state::router::Router;
use crate::runtime::state::shard::{inc, Shard};
use crate::runtime::wire::conn::Conn;
use crate::runtime::wire::handoff;

/// Listeners of one shard, bound by the main thread with SO_REUSEPORT.
pub struct ShardListeners {
    /// Client HTTP.
    pub http: StdListener,
    /// Prometheus.
    pub metrics: StdListener,
    /// Agent links.
    pub p2p: StdListener,
}

/// Accept connections on `listener` forever, serving each with `serve`.
fn accept_loop<F, Fut>(shard: &Rc<Shard>, what: &'static str, listener: StdListener, serve: F)
where
    F: Fn(Rc<Shard>, monoio::net::TcpStream) -> Fut + 'static,
    Fut: Future<Output = ()> + 'static,
{
    let listener = match monoio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            warn!(shard = shard.id, "cannot adopt the {what} listener: {e}");
            return;
        }
    };
    let shard = shard.clone();
    monoio::spawn(async move {
        // Accept errors come in floods (out of descriptors): one line a
        // second, with how many it stands for (issue 29 #4).
        let mut gate = crate::logic::system::log_gate::LogGate::default();
        loop {
            match listener.accept().await {
                Ok((s, _)) => {
                    monoio::spawn(serve(shard.clone(), s));
                }
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
    accept_loop(&shard, "HTTP", listeners.http, |shard, s| async move {
        let conn = Conn::new(s, Vec::new());
        match shard.router.budget.connection() {
            Some(permit) => super::ingress::serve(shard, conn, None, permit).await,
            None => refuse_connection(conn).await,
        }
    });
    accept_loop(&shard, "metrics", listeners.metrics, |shard, s| {
        crate::runtime::metrics::serve(shard, Conn::new(s, Vec::new()))
    });
    accept_loop(&shard, "p2p", listeners.p2p, super::agent_link::accept_link);
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
        on_message(&shard, msg);
    }
}

fn on_message(shard: &Rc<Shard>, msg: ShardMsg) {
    match msg {
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
