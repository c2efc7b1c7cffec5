//! The running router's side of an upgrade (issue 54): it listens on
//! `--upgrade-socket`; a new process that connects gets its listening
//! sockets, then its store (flushed and closed here, forwarded to from
//! then on), then its agents (told to link to it), then its clients (this
//! process stops accepting, carries its connections and held requests
//! over). Until that last step nothing is lost by a failure of the new
//! process: this one takes its store back and accepts again.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::channel::oneshot;
use shards::logic::system::upgrade::{self as proto, ListenerKind, Msg, StoreAnswer, StoreCall};
use shards::runtime::services::store_api::{ChainError, StoreMsg, StoreStats, StoreTx};
use shards::runtime::state::mesh::ShardMsg;
use shards::runtime::state::router::Router;
use tracing::{info, warn};

use super::{next_step, Link, STEP};

/// What the running process keeps to hand over.
pub(crate) struct Handles {
    pub(crate) shared: Arc<Router>,
    pub(crate) store: StoreTx,
    /// Copies of every listening socket (the shards own the others).
    pub(crate) listeners: Vec<(ListenerKind, std::net::TcpListener)>,
    /// Pauses the periodic usage flush while the store moves.
    pub(crate) flush_paused: Arc<AtomicBool>,
}

/// A finished hand-over: the link to the new process and today's usage
/// as counted when the store moved (the usage deltas start there).
pub(crate) struct Handed {
    pub(crate) link: Link,
    pub(crate) baseline: HashMap<(String, String), (u64, u64)>,
}

/// Listen on `path` (mode 0600, a stale file replaced) and hand over to
/// the first process that completes the protocol; `done` hears of it.
pub(crate) fn listen(
    path: &std::path::Path,
    replacing: bool,
    h: Handles,
    done: std::sync::mpsc::Sender<Handed>,
) -> Result<(), String> {
    let listener = bind(path, replacing)?;
    info!(socket = %path.display(), "upgrade socket open: `hivenet-router --upgrade` (or SIGUSR2) replaces this process");
    std::thread::Builder::new()
        .name("upgrade".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(sock) = conn else { continue };
                if !same_user(&sock) {
                    warn!("upgrade socket: a process of another user connected; refused");
                    continue;
                }
                match hand_over(&h, sock) {
                    Ok(handed) => {
                        let _ = done.send(handed);
                        // Wakes the main thread's signal loop.
                        let _ = signal_hook::low_level::raise(signal_hook::consts::SIGUSR1);
                        return;
                    }
                    Err(e) => warn!("upgrade abandoned, this process serves on: {e}"),
                }
            }
        })
        .map(|_| ())
        .map_err(|e| format!("cannot start the upgrade thread: {e}"))
}

fn bind(path: &std::path::Path, replacing: bool) -> Result<UnixListener, String> {
    // A file nobody listens on is a previous run's: replace it. One that
    // answers belongs to a running router: never steal it (unless this
    // process just replaced that router).
    if !replacing && std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(format!(
            "--upgrade-socket {}: another router listens there (start this one with --upgrade to replace it, or give it its own --upgrade-socket)",
            path.display()
        ));
    }
    let _ = std::fs::remove_file(path);
    let l = UnixListener::bind(path)
        .map_err(|e| format!("--upgrade-socket {}: {e}", path.display()))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("--upgrade-socket {}: {e}", path.display()))?;
    Ok(l)
}

/// Only a process of this user may take the sockets over.
fn same_user(sock: &std::os::unix::net::UnixStream) -> bool {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    use std::os::fd::AsRawFd;
    match getsockopt(sock.as_raw_fd(), PeerCredentials) {
        Ok(c) => c.uid() == nix::unistd::getuid().as_raw(),
        Err(_) => false,
    }
}

/// Send a message to every shard and wait for each reply (5 s at most).
fn each_shard<T>(shared: &Router, make: impl Fn(oneshot::Sender<T>) -> ShardMsg) -> Vec<T> {
    crate::shard_calls::each_shard(shared, Duration::from_secs(5), make)
}

fn accept(shared: &Router, kind: ListenerKind, on: bool) {
    each_shard(shared, |reply| ShardMsg::Accept { kind, on, reply });
}

/// Today's usage per bucket: (tenant, model) → (day, tokens).
pub(crate) fn usage(shared: &Router) -> Vec<((String, String), (u64, u64))> {
    let today = shards::logic::tenancy::quota::day_of(shards::runtime::wire::clock::unix_secs());
    shared
        .auth
        .load()
        .daily_states()
        .into_iter()
        .map(|((t, m), s)| {
            let used = shards::logic::tenancy::quota::used_on(s, today);
            ((t.to_string(), m), (today, used))
        })
        .collect()
}

fn hand_over(h: &Handles, sock: std::os::unix::net::UnixStream) -> Result<Handed, String> {
    let link = Link::new(sock).map_err(|e| e.to_string())?;
    link.read_timeout(Some(STEP));
    match link.expect("hello")?.0 {
        Msg::Hello { pid, version } => {
            info!(pid, %version, "upgrade: a new process asks to take over")
        }
        other => return Err(format!("unexpected first message {other:?}")),
    }
    for (kind, l) in &h.listeners {
        link.send(&Msg::Listener { kind: *kind }, &[], &[l.as_fd()])
            .map_err(|e| format!("cannot send a listener: {e}"))?;
    }
    link.say(&Msg::Listeners)?;
    match link.expect("its request for the store")?.0 {
        Msg::WantState => {}
        other => return Err(format!("unexpected message {other:?}")),
    }
    // The store moves: history and usage flushed, the files closed.
    h.flush_paused.store(true, Ordering::Relaxed);
    each_shard(&h.shared, |reply| ShardMsg::Shutdown { reply });
    crate::shard_calls::flush_quota(&h.shared, &h.store, true);
    let counted = usage(&h.shared);
    let calls = Arc::new(Calls::default());
    let forward = forwarder(link.clone(), calls.clone());
    let (t, r) = oneshot::channel();
    h.store
        .send(StoreMsg::Release { forward, done: t })
        .map_err(|_| "the store thread is gone".to_string())?;
    let _ = futures::executor::block_on(r);
    // The reader blocks without a bound (the steps have theirs): a read
    // cut by a timeout could stop inside a frame.
    link.read_timeout(None);
    let steps = reader(link.clone(), calls);
    let undo_store = || {
        let (t, r) = oneshot::channel();
        if h.store.send(StoreMsg::Resume { done: t }).is_ok() {
            match futures::executor::block_on(r) {
                Ok(Ok(())) => info!("upgrade abandoned: the store is open here again"),
                _ => warn!("upgrade abandoned: the store could not be reopened here"),
            }
        }
        h.flush_paused.store(false, Ordering::Relaxed);
    };
    link.say(&Msg::StoreFree)?;
    match next_step(&steps, "start", STEP) {
        Ok(Msg::Started) => {}
        other => {
            undo_store();
            return Err(format!("the new process did not start: {other:?}"));
        }
    }
    // The agents: links go to the new process from now on; each agent is
    // told to open one there (its capacity shared by both links).
    accept(&h.shared, ListenerKind::P2p, false);
    let peers: Vec<String> = each_shard(&h.shared, |reply| ShardMsg::Relink { reply })
        .into_iter()
        .flatten()
        .collect();
    info!(
        agents = peers.len(),
        "upgrade: agents told to link to the new process"
    );
    // The sibling map lives in memory (pushed through the admin API).
    let sibling_map = h
        .shared
        .sites
        .load()
        .map
        .as_ref()
        .and_then(|m| serde_json::to_string(&m.dto).ok());
    let registry = {
        let dynamic = h.shared.auth.load().mode == shards::logic::tenancy::auth::ApiMode::Dynamic;
        let reg = match h.shared.registry.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        (dynamic && !reg.version().is_empty())
            .then(|| serde_json::to_string(&reg.snapshot()).ok())
            .flatten()
    };
    // Policies written through the admin API and admin drain marks live
    // in memory too.
    let policies = h.shared.policies_from_api.load(Ordering::Relaxed).then(|| {
        shards::runtime::admin::policy::policy_set_json(&h.shared.policies.load()).to_string()
    });
    let drained: Vec<String> = crate::shard_calls::snapshots(&h.shared)
        .into_iter()
        .flat_map(|s| s.agents.into_iter())
        .filter(|a| a.admin_drained)
        .map(|a| a.peer_id)
        .collect();
    let linked = link
        .say(&Msg::Expect {
            peers,
            policies,
            drained,
            sibling_map,
            registry,
        })
        .and_then(|()| next_step(&steps, "linked agents", STEP));
    match linked {
        Ok(Msg::Linked { peers }) => info!(
            agents = peers.len(),
            "upgrade: agents linked to the new process"
        ),
        other => {
            accept(&h.shared, ListenerKind::P2p, true);
            undo_store();
            return Err(format!(
                "the new process did not link the agents: {other:?}"
            ));
        }
    }
    // The clients: this process stops accepting; its connections and
    // held requests go over.
    accept(&h.shared, ListenerKind::Http, false);
    accept(&h.shared, ListenerKind::Metrics, false);
    // Conversations keep their engines: the affinity index goes over.
    let mut by_model: HashMap<String, Vec<u8>> = HashMap::new();
    for (model, note) in each_shard(&h.shared, |reply| ShardMsg::AffinityDump { reply })
        .into_iter()
        .flatten()
    {
        note.encode(by_model.entry(model).or_default());
    }
    for (model, blob) in by_model {
        link.send(&Msg::Affinity { model }, &blob, &[])
            .map_err(|e| format!("cannot send the affinity index: {e}"))?;
    }
    let (tx, rx) = std::sync::mpsc::channel::<shards::runtime::state::carry_out::Outgoing>();
    let carrier = link.clone();
    std::thread::Builder::new()
        .name("upgrade-carry".into())
        .spawn(move || {
            for o in rx {
                let m = Msg::Conn {
                    hold: o.hold,
                    stream: o.resumed,
                };
                if let Err(e) = carrier.send(&m, &o.bytes, &[o.stream.as_fd()]) {
                    warn!("upgrade: a connection could not be carried over: {e}");
                }
            }
        })
        .map_err(|e| format!("cannot start the carrier thread: {e}"))?;
    h.shared.carry.start(tx);
    h.shared.readiness.drain();
    let now = shards::runtime::wire::clock::mono_ns();
    let rates = h
        .shared
        .auth
        .load()
        .rates_ahead(now)
        .into_iter()
        .map(|((t, m), ahead)| (t.to_string(), m, ahead))
        .collect();
    link.say(&Msg::Go { rates })?;
    for s in &h.shared.mesh {
        let _ = s.unbounded_send(ShardMsg::HandOverHolds);
    }
    Ok(Handed {
        link,
        baseline: counted.into_iter().collect(),
    })
}

/// Store calls waiting for the new process's answer.
#[derive(Default)]
struct Calls {
    next: AtomicU64,
    waiting: Mutex<HashMap<u64, Waiting>>,
}

enum Waiting {
    Get(oneshot::Sender<Option<Vec<u8>>>),
    Chain(oneshot::Sender<Result<Vec<Vec<u8>>, ChainError>>),
    Delete(oneshot::Sender<bool>),
}

impl Calls {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Waiting>> {
        match self.waiting.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }
}

/// The store thread's sink once the store moved: Responses records go
/// to (and come from) the new process's store; latency history and usage
/// flushes are the new process's to write (usage goes over as deltas).
fn forwarder(link: Link, calls: Arc<Calls>) -> Box<dyn FnMut(StoreMsg) + Send> {
    Box::new(move |m| {
        let call = |call: StoreCall, payload: &[u8], waiting: Option<Waiting>| {
            let id = calls.next.fetch_add(1, Ordering::Relaxed);
            if let Some(w) = waiting {
                calls.lock().insert(id, w);
            }
            if let Err(e) = link.send(&Msg::Store { id, call }, payload, &[]) {
                warn!("upgrade: a store call could not be forwarded: {e}");
                calls.lock().remove(&id);
            }
        };
        match m {
            StoreMsg::ResponsePut {
                tenant,
                id,
                created_at,
                record,
            } => call(
                StoreCall::Put {
                    tenant,
                    id,
                    created_at,
                },
                &record,
                None,
            ),
            StoreMsg::ResponseGet { tenant, id, reply } => call(
                StoreCall::Get { tenant, id },
                &[],
                Some(Waiting::Get(reply)),
            ),
            StoreMsg::ResponseChain { tenant, id, reply } => call(
                StoreCall::Chain { tenant, id },
                &[],
                Some(Waiting::Chain(reply)),
            ),
            StoreMsg::ResponseDelete { tenant, id, reply } => call(
                StoreCall::Delete { tenant, id },
                &[],
                Some(Waiting::Delete(reply)),
            ),
            StoreMsg::Lookup { reply, .. } => {
                let _ = reply.send(None);
            }
            StoreMsg::Flush { done, .. } | StoreMsg::QuotaFlush { done, .. } => {
                if let Some(d) = done {
                    let _ = d.send(());
                }
            }
            StoreMsg::Stats { reply } => {
                let _ = reply.send(StoreStats::default());
            }
            StoreMsg::ResetAll { reply } => {
                let _ = reply.send(Err(
                    "the store belongs to the process that replaced this one".into(),
                ));
            }
            StoreMsg::ResponseTenants { reply } => {
                let _ = reply.send(Vec::new());
            }
            StoreMsg::Release { done, .. } => {
                let _ = done.send(());
            }
            StoreMsg::Resume { done } => {
                let _ = done.send(Ok(()));
            }
            StoreMsg::Shutdown { done } => {
                let _ = done.send(());
            }
        }
    })
}

/// Read the new process's messages: store answers are delivered here,
/// protocol steps passed on.
fn reader(link: Link, calls: Arc<Calls>) -> super::Steps {
    let (tx, rx) = std::sync::mpsc::channel();
    let _ = std::thread::Builder::new()
        .name("upgrade-read".into())
        .spawn(move || loop {
            let (m, payload) = match link.recv() {
                Ok(Some((m, p, _))) => (m, p),
                Ok(None) => return,
                Err(e) => {
                    warn!("upgrade link: {e}");
                    return;
                }
            };
            match m {
                Msg::StoreReply { id, answer } => answer_call(&calls, id, answer, payload),
                step => {
                    if tx.send(step).is_err() {
                        return;
                    }
                }
            }
        });
    rx
}

fn answer_call(calls: &Calls, id: u64, answer: StoreAnswer, payload: Vec<u8>) {
    let Some(w) = calls.lock().remove(&id) else {
        return;
    };
    match (w, answer) {
        (Waiting::Get(r), StoreAnswer::Record { found }) => {
            let _ = r.send(found.then_some(payload));
        }
        (Waiting::Chain(r), StoreAnswer::Chain { missing, too_long }) => {
            let v = match (missing, too_long) {
                (Some(id), _) => Err(ChainError::NotFound(id)),
                (_, Some(n)) => Err(ChainError::TooLong(n)),
                _ => proto::unpack(&payload).ok_or(ChainError::NotFound(String::new())),
            };
            let _ = r.send(v);
        }
        (Waiting::Delete(r), StoreAnswer::Deleted { found }) => {
            let _ = r.send(found);
        }
        _ => warn!("upgrade link: a store answer of the wrong kind"),
    }
}

/// SIGUSR2: start this binary again (the file at its path now, which an
/// upgrade replaced) with `--upgrade`; it takes over when it is ready, or
/// fails and leaves this process serving.
pub(crate) fn start_replacement(u: &crate::startup::UpgradeCfg) {
    let Some(exe) = &u.exe else {
        warn!("SIGUSR2: this binary's path is unknown; start `hivenet-router --upgrade` by hand");
        return;
    };
    match std::process::Command::new(exe).args(&u.args).spawn() {
        Ok(mut child) => {
            info!(pid = child.id(), exe = %exe.display(), "SIGUSR2: replacement started");
            let _ = std::thread::Builder::new()
                .name("upgrade-child".into())
                .spawn(move || match child.wait() {
                    Ok(s) if s.success() => info!("the replacement process exited"),
                    Ok(s) => warn!("the replacement process exited with {s}"),
                    Err(e) => warn!("the replacement process: {e}"),
                });
        }
        Err(e) => warn!(exe = %exe.display(), "SIGUSR2: cannot start the replacement: {e}"),
    }
}

/// How long the streams cut at the drain timeout get to go over.
const CARRY_STREAMS: Duration = Duration::from_secs(5);

/// After the hand-over: let the streams here end (up to `limit`; then
/// each still relayed goes to the new process, which continues it), send
/// the new process the usage counted meanwhile, and say goodbye.
pub(crate) fn drain(shared: &Router, h: Handed, limit: Duration) {
    let started = std::time::Instant::now();
    let mut carrying = false;
    let mut counted = h.baseline;
    let send_usage = |counted: &mut HashMap<(String, String), (u64, u64)>| {
        let now = usage(shared);
        let deltas = proto::usage_deltas(counted, &now);
        *counted = now.into_iter().collect();
        if !deltas.is_empty() {
            let _ = h.link.say(&Msg::Usage { deltas });
        }
    };
    loop {
        send_usage(&mut counted);
        // A request read just before the switch and held after it.
        for s in &shared.mesh {
            let _ = s.unbounded_send(ShardMsg::HandOverHolds);
        }
        let active = crate::shard_calls::in_flight(shared);
        let conns = shared.budget.connections();
        if active == 0 && conns == 0 {
            info!(waited = ?started.elapsed(), "upgrade: every stream here ended");
            break;
        }
        if started.elapsed() >= limit && !carrying {
            carrying = true;
            shared.carry.carry_streams();
            let cut: usize = each_shard(shared, |reply| ShardMsg::CutStreams { reply })
                .into_iter()
                .sum();
            info!(
                responses = cut,
                "--upgrade-drain-timeout passed: the streams still relayed here go to the new process, which continues them"
            );
        }
        if started.elapsed() >= limit + CARRY_STREAMS {
            warn!(
                active,
                conns, "--upgrade-drain-timeout passed: cutting what is left here"
            );
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    send_usage(&mut counted);
    let [idle, held, streams] = &shared.carry.sent;
    info!(
        connections = idle.load(Ordering::Relaxed),
        held = held.load(Ordering::Relaxed),
        streams = streams.load(Ordering::Relaxed),
        "upgrade: handed over"
    );
    let _ = h.link.say(&Msg::Done);
}
