//! The agent link's control protocol on the router: the preamble (and the
//! hand-off to the model's shard), the handshake, the registration and its
//! checks, then heartbeats and routing signals until the link ends or goes
//! silent for `--remove-after`.
//!
//! Entry points: [`accept_link`] (any shard), [`serve_link`] (the owner).

use std::rc::Rc;

use tracing::{info, warn};

use crate::logic::link::control::{self, ControlMsg, Registration};
use crate::logic::link::preamble;
use crate::runtime::state::mesh::ShardMsg;
use crate::runtime::state::model::agent::Agent;
use crate::runtime::state::model::{wake_all, wake_for};
use crate::runtime::state::shard::{inc, Shard, WarmStart};
use crate::runtime::wire::clock;
use crate::runtime::wire::conn::Conn;
use crate::runtime::wire::handoff;
use crate::runtime::wire::link::budget::{LinkCap, LinkPermit};
use crate::runtime::wire::link::{self, LinkStream};

/// Read the preamble, reserve the model's shard, then serve the link here
/// or hand it to the owner.
pub async fn accept_link(shard: Rc<Shard>, stream: monoio::net::TcpStream) {
    let peer = stream.peer_addr().ok();
    // The pre-handshake budget first, before a byte is read (issue 29 #1);
    // the caps of registered agents count only links that finished the
    // handshake (issue 51 #2: silent connections locked agents out).
    let permit = match shard.router.pending_links.take(peer.map(|p| p.ip())) {
        Ok(p) => p,
        Err(cap) => {
            let (kind, why) = match cap {
                LinkCap::Total(n) => (
                    "pending_cap",
                    format!("{n} agent connections before their handshake (--max-pending-agent-links)"),
                ),
                LinkCap::Address(n) => (
                    "pending_address_cap",
                    format!(
                        "{n} agent connections before their handshake from this address (--max-pending-agent-links-per-address)"
                    ),
                ),
            };
            return refused(&shard, peer, "", kind, &why);
        }
    };
    let mut conn = Conn::new(stream, Vec::new());
    let timeout = shard.router.cfg.preamble_timeout;
    let read = async {
        // Wait for a first byte without a read buffer: a silent
        // connection holds its socket and task only (issue 51 #2).
        if let Err(e) = conn.stream.readable(false).await {
            return Err(("preamble_read", format!("read error: {e}")));
        }
        loop {
            match preamble::decode(&conn.buf) {
                Ok(Some(done)) => return Ok(done),
                Ok(None) => {}
                Err(e) => return Err((e.kind(), e.to_string())),
            }
            match conn.fill().await {
                Ok(0) => {
                    return Err((
                        "preamble_closed",
                        "closed before a complete preamble".into(),
                    ))
                }
                Ok(_) => {}
                Err(e) => return Err(("preamble_read", format!("read error: {e}"))),
            }
        }
    };
    let read = monoio::time::timeout(timeout, read);
    let (model, used) = match permit.or_evicted(read).await {
        Some(Ok(Ok(v))) => v,
        Some(Ok(Err((kind, reason)))) => return refused(&shard, peer, "", kind, &reason),
        Some(Err(_)) => {
            let why = format!("no preamble within {timeout:?}");
            return refused(&shard, peer, "", "preamble_timeout", &why);
        }
        None => return evicted(&shard, peer),
    };
    conn.consume(used);
    let owner = shard.router.reserve(&model);
    let (stream, buf) = conn.into_parts();
    if owner != shard.id {
        if let Some(tx) = shard.router.mesh.get(owner) {
            let msg = ShardMsg::AdoptLink {
                stream: handoff::into_std(stream),
                prefix: buf,
                model,
                permit,
            };
            match tx.unbounded_send(msg) {
                Ok(()) => inc(&shard.counters.link_handoffs_out),
                Err(e) => {
                    if let ShardMsg::AdoptLink { model, .. } = e.into_inner() {
                        shard.router.release(&model);
                    }
                }
            }
            return;
        }
    }
    serve_link(shard, stream, buf, model, permit).await;
}

/// A link cut before its handshake to make room for a newer one from its
/// address (the per-address pending cap evicts the oldest).
fn evicted(shard: &Shard, peer: Option<std::net::SocketAddr>) {
    let why = "cut before its handshake: the oldest of its address at --max-pending-agent-links-per-address";
    refused(shard, peer, "", "pending_evicted", &why)
}

/// Count a refused link and log it: at most one line per second per
/// reason, with the number of refusals it stands for (a scan of the p2p
/// port must not flood the log).
fn refused(
    shard: &Shard,
    peer: Option<std::net::SocketAddr>,
    model: &str,
    kind: &'static str,
    reason: &dyn std::fmt::Display,
) {
    inc(&shard.counters.links_rejected);
    *shard.refusals.borrow_mut().entry(kind).or_default() += 1;
    let lines = shard
        .refusal_log
        .borrow_mut()
        .entry(kind)
        .or_default()
        .hit(clock::now(), std::time::Duration::from_secs(1));
    if let Some(n) = lines {
        warn!(shard = shard.id, peer = ?peer, model, kind, refused = n, "agent link refused: {reason} ({n} refusal(s) of this kind since the previous line)");
    }
}

/// Why an agent link is refused (logged and counted; the agent gets the
/// text in a `Rejected` frame when the control stream is up).
#[derive(Debug)]
#[non_exhaustive]
pub enum Refusal {
    /// The private-network or noise handshake failed.
    Handshake(link::LinkError),
    /// Without a private network, the bytes after the preamble do not
    /// start a noise handshake (its first frame is 32 bytes).
    NotNoise(u16),
    /// The link closed before opening its control stream.
    NoControlStream,
    /// The control stream did not negotiate our protocol.
    Negotiation(std::io::Error),
    /// The registration frame could not be read.
    Unreadable(std::io::Error),
    /// The link closed before registering.
    ClosedBeforeRegistration,
    /// The first frame was something else.
    NotARegistration(String),
    /// The registration names another peer than the noise identity.
    PeerMismatch {
        /// What the registration said.
        claimed: String,
        /// Who noise authenticated.
        authenticated: String,
    },
    /// The registration names another model than the preamble.
    ModelMismatch {
        /// What the registration said.
        registered: String,
        /// What the preamble said.
        preamble: String,
    },
    /// Capacity 0.
    ZeroCapacity,
    /// Another shard owns the model (a race with another registration).
    OwnedElsewhere(usize),
    /// The registered agents' caps are full (`--max-agent-links`,
    /// `--max-agent-links-per-address`).
    Cap(LinkCap),
}

impl Refusal {
    /// A short stable name of the reason (log rate limiting).
    pub fn kind(&self) -> &'static str {
        match self {
            Refusal::Handshake(_) => "handshake",
            Refusal::NotNoise(_) => "not_noise",
            Refusal::NoControlStream => "no_control_stream",
            Refusal::Negotiation(_) => "negotiation",
            Refusal::Unreadable(_) => "unreadable_registration",
            Refusal::ClosedBeforeRegistration => "closed_before_registration",
            Refusal::NotARegistration(_) => "not_a_registration",
            Refusal::PeerMismatch { .. } => "peer_mismatch",
            Refusal::ModelMismatch { .. } => "model_mismatch",
            Refusal::ZeroCapacity => "zero_capacity",
            Refusal::OwnedElsewhere(_) => "owned_elsewhere",
            Refusal::Cap(LinkCap::Total(_)) => "link_cap",
            Refusal::Cap(LinkCap::Address(_)) => "address_cap",
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Handshake(e) => write!(f, "{e}"),
            Refusal::NotNoise(n) => write!(
                f,
                "not a noise handshake after the preamble (first frame of {n} bytes)"
            ),
            Refusal::NoControlStream => f.write_str("link closed before the control stream"),
            Refusal::Negotiation(e) => write!(f, "control stream negotiation: {e}"),
            Refusal::Unreadable(e) => write!(f, "registration: {e}"),
            Refusal::ClosedBeforeRegistration => f.write_str("link closed before registration"),
            Refusal::NotARegistration(got) => write!(f, "expected a registration, got {got}"),
            Refusal::PeerMismatch {
                claimed,
                authenticated,
            } => write!(
                f,
                "registration peer_id {claimed} does not match the noise identity {authenticated}"
            ),
            Refusal::ModelMismatch {
                registered,
                preamble,
            } => write!(
                f,
                "registration names model {registered:?} but the preamble named {preamble:?}"
            ),
            Refusal::ZeroCapacity => f.write_str("capacity must be greater than 0"),
            Refusal::OwnedElsewhere(owner) => {
                write!(f, "model is owned by shard {owner}; reconnect")
            }
            Refusal::Cap(LinkCap::Total(n)) => {
                write!(f, "{n} agent links registered (--max-agent-links)")
            }
            Refusal::Cap(LinkCap::Address(n)) => write!(
                f,
                "{n} agent links registered from this address (--max-agent-links-per-address)"
            ),
        }
    }
}

/// What the handshake and the first control frame produced.
struct Setup {
    peer_id: String,
    link: link::LinkHandle,
    ctl: Conn<LinkStream>,
    first: ControlMsg,
}

async fn handshake(
    shard: &Shard,
    stream: monoio::net::TcpStream,
    prefix: Vec<u8>,
) -> Result<Setup, Refusal> {
    let router = &shard.router;
    let (stream, prefix) = check_noise_start(stream, prefix, router.psk.is_some()).await?;
    let (peer, conn) = link::accept(stream, prefix, router.psk, &router.keypair)
        .await
        .map_err(Refusal::Handshake)?;
    let (handle, mut inbound, _closed) = link::spawn_driver(conn);
    let ctl = futures::StreamExt::next(&mut inbound)
        .await
        .ok_or(Refusal::NoControlStream)?;
    let (_, ctl) = link::accept_protocol(ctl, &[link::CONTROL_PROTOCOL])
        .await
        .map_err(Refusal::Negotiation)?;
    let mut ctl = Conn::over(ctl, Vec::new());
    let first = ctl
        .read_frame()
        .await
        .map_err(Refusal::Unreadable)?
        .ok_or(Refusal::ClosedBeforeRegistration)?;
    Ok(Setup {
        peer_id: peer.to_string(),
        link: handle,
        ctl,
        first,
    })
}

/// Largest first noise frame accepted (libp2p-noise's initiator sends 32
/// bytes: the ephemeral key, no payload).
const MAX_FIRST_NOISE_FRAME: u16 = 1024;

/// Without a private network, refuse at once a link whose bytes after the
/// preamble cannot be a noise handshake, instead of waiting for the
/// handshake timeout on a length field that garbage made huge. (With one,
/// the key check fails as soon as 32 bytes arrive.)
async fn check_noise_start(
    stream: monoio::net::TcpStream,
    prefix: Vec<u8>,
    psk: bool,
) -> Result<(monoio::net::TcpStream, Vec<u8>), Refusal> {
    if psk {
        return Ok((stream, prefix));
    }
    let mut conn = Conn::over(stream, prefix);
    while conn.buf.len() < 2 {
        match conn.fill().await {
            Ok(0) => return Err(Refusal::ClosedBeforeRegistration),
            Ok(_) => {}
            Err(e) => return Err(Refusal::Handshake(link::LinkError::Io(e))),
        }
    }
    let len = u16::from_be_bytes([
        conn.buf.first().copied().unwrap_or(0),
        conn.buf.get(1).copied().unwrap_or(0),
    ]);
    if len == 0 || len > MAX_FIRST_NOISE_FRAME {
        return Err(Refusal::NotNoise(len));
    }
    Ok(conn.into_parts())
}

/// Check a registration against the link it came on.
fn check_registration(
    shard: &Shard,
    msg: ControlMsg,
    peer_id: &str,
    model: &str,
) -> Result<Registration, Refusal> {
    let mut reg = match msg {
        ControlMsg::Register(r) => r,
        other => return Err(Refusal::NotARegistration(format!("{other:?}"))),
    };
    if reg.peer_id != peer_id {
        return Err(Refusal::PeerMismatch {
            claimed: reg.peer_id,
            authenticated: peer_id.to_string(),
        });
    }
    if reg.model != model {
        return Err(Refusal::ModelMismatch {
            registered: reg.model,
            preamble: model.to_string(),
        });
    }
    if reg.capacity == 0 {
        return Err(Refusal::ZeroCapacity);
    }
    // Display labels from a peer: bounded, never refused for their size.
    control::truncate_label(&mut reg.llm_pretty_name, control::MAX_LLM_PRETTY_NAME);
    control::truncate_label(&mut reg.llm_info, control::MAX_LLM_INFO);
    if reg.capacity > link::MAX_AGENT_CAPACITY {
        if shard.peer_line(&reg.peer_id, "capacity_capped").is_some() {
            warn!(peer_id = %reg.peer_id, declared = reg.capacity, granted = link::MAX_AGENT_CAPACITY,
                  "agent capacity capped to the link's stream budget");
        }
        reg.capacity = link::MAX_AGENT_CAPACITY;
    }
    Ok(reg)
}

/// Handshake, registration, then heartbeats until the link ends. The
/// model's reservation (made at the preamble) is released when the link
/// fails before registering.
pub async fn serve_link(
    shard: Rc<Shard>,
    stream: monoio::net::TcpStream,
    prefix: Vec<u8>,
    model: String,
    // Its place before the handshake: given back once it is done.
    pending: LinkPermit,
) {
    let peer_addr = stream.peer_addr().ok();
    let cfg = shard.router.cfg.clone();
    let shaking = monoio::time::timeout(cfg.handshake_timeout, handshake(&shard, stream, prefix));
    let setup = match pending.or_evicted(shaking).await {
        Some(Ok(Ok(s))) => s,
        Some(Ok(Err(reason))) => {
            shard.router.release(&model);
            return refused(&shard, peer_addr, &model, reason.kind(), &reason);
        }
        Some(Err(_)) => {
            shard.router.release(&model);
            let why = format!(
                "handshake or registration timed out after {:?}",
                cfg.handshake_timeout
            );
            return refused(&shard, peer_addr, &model, "handshake_timeout", &why);
        }
        None => {
            shard.router.release(&model);
            return evicted(&shard, peer_addr);
        }
    };
    let Setup {
        peer_id,
        link,
        mut ctl,
        first,
    } = setup;
    let reg = match check_registration(&shard, first, &peer_id, &model) {
        Ok(r) => r,
        Err(reason) => {
            shard.router.release(&model);
            return reject(&shard, &mut ctl, &model, reason).await;
        }
    };
    // Authenticated (noise, and the swarm key when there is one): now it
    // takes a place under the registered agents' caps, held until the
    // link ends.
    let _permit = match shard.router.links.take(peer_addr.map(|a| a.ip())) {
        Ok(p) => p,
        Err(cap) => {
            shard.router.release(&model);
            return reject(&shard, &mut ctl, &model, Refusal::Cap(cap)).await;
        }
    };
    drop(pending);
    let owner = shard.router.register(&model, shard.id, reg.capability);
    if owner != shard.id {
        shard.router.unregister(&model, reg.capability, true);
        return reject(&shard, &mut ctl, &model, Refusal::OwnedElsewhere(owner)).await;
    }
    let hb = ControlMsg::Registered {
        heartbeat_interval_ms: cfg.heartbeat_interval.as_millis() as u64,
        progress_interval_ms: progress_interval(cfg.request_timeout).as_millis() as u64,
    };
    if let Err(e) = link::write_frame(&mut ctl.stream, &hb).await {
        shard.router.unregister(&model, reg.capability, true);
        warn!(shard = shard.id, %peer_id, "cannot confirm registration: {e}");
        return;
    }
    // Warm start: the store's record for this peer ID (the registration path
    // may wait for the store; the request path never does). A peer that
    // re-registers while its previous entry is still here keeps its live
    // state (fresher than the store's last flush).
    let warm = shard.warm_start(&reg.model, &reg.peer_id).await;
    match &warm {
        WarmStart::Live(..) | WarmStart::Stored(None) => {}
        WarmStart::Stored(Some(h)) => {
            if shard.peer_line(&reg.peer_id, "warm_start").is_some() {
                info!(peer_id = %reg.peer_id, srtt_ms = ?h.srtt, rttvar_ms = ?h.rttvar, success = h.success, failed = h.failed,
                      record_age_s = clock::unix_secs().saturating_sub(h.written_at), "warm start from the history store");
            }
        }
        WarmStart::Unknown => {
            if shard.peer_line(&reg.peer_id, "warm_start").is_some() {
                warn!(peer_id = %reg.peer_id, "history lookup failed; starting without history and leaving the stored record untouched");
            }
        }
    }
    let agent = shard.add_agent(reg, link, warm);
    shard.router.readiness.registered(&agent.reg.peer_id);
    shard.router.publish("registered", &agent.reg);
    if let Some(n) = shard.peer_line(&agent.reg.peer_id, "registered") {
        info!(
            shard = shard.id, peer_id = %agent.reg.peer_id, model = %agent.reg.model, engine = %agent.reg.engine,
            capability = agent.reg.capability.as_str(), capacity = agent.reg.capacity, registrations = n,
            "agent registered ({n} registration(s) of this peer since the previous line)"
        );
    }
    // A policy that reads GPU signals or the GPU model, for an agent that
    // knows no GPU: its gates pass and its match fails, silently unless
    // said (issue 28 #15).
    if agent.reg.gpu_model.is_empty()
        && shard.peer_line(&agent.reg.peer_id, "no_gpu").is_some()
        && shard
            .policy(&agent.reg.model)
            .steps
            .iter()
            .any(|s| s.reads_gpu())
    {
        warn!(peer_id = %agent.reg.peer_id, model = %agent.reg.model,
              "the model's policy reads GPU signals, and this agent reports no GPU (no nvidia-smi, no --gpu-model): gpu_* gates pass for it and match.gpu_model does not");
    }
    heartbeats(&shard, &agent, &mut ctl).await;
    leave(&shard, &agent);
}

/// Heartbeats and signals until the control stream ends, fails, or stays
/// silent for `--remove-after`. Three missed heartbeats make the agent
/// unhealthy; any frame makes it live again.
async fn heartbeats(shard: &Shard, agent: &Agent, ctl: &mut Conn<LinkStream>) {
    let cfg = &shard.router.cfg;
    let miss = cfg
        .unhealthy_after
        .unwrap_or_else(|| cfg.heartbeat_interval.saturating_mul(3));
    let mut last_frame = clock::now();
    loop {
        let silent = last_frame.elapsed();
        if silent >= cfg.remove_after {
            warn!(peer_id = %agent.reg.peer_id, silent_s = silent.as_secs_f64(), "no control frame for --remove-after: removing the agent");
            agent.link.close();
            return;
        }
        let wait = miss.min(cfg.remove_after - silent);
        match monoio::time::timeout(wait, ctl.read_frame()).await {
            Ok(Ok(Some(msg))) => {
                last_frame = clock::now();
                let ok = on_frame(agent, msg);
                shard.sync_health(agent);
                if !ok {
                    return;
                }
            }
            Ok(Ok(None)) => {
                if shard.peer_line(&agent.reg.peer_id, "control_end").is_some() {
                    info!(peer_id = %agent.reg.peer_id, "control stream closed");
                }
                return;
            }
            Ok(Err(e)) => {
                if shard.peer_line(&agent.reg.peer_id, "control_end").is_some() {
                    info!(peer_id = %agent.reg.peer_id, "control stream failed: {e}");
                }
                return;
            }
            Err(_) if last_frame.elapsed() >= miss => {
                if agent.live.get() {
                    // Declared dead: its in-flight responses are cut now
                    // rather than left hanging until they time out.
                    let cut = agent.cut_streams();
                    warn!(peer_id = %agent.reg.peer_id, cut_responses = cut, "no heartbeat for --unhealthy-after (3 heartbeats by default): agent unhealthy");
                    agent.agent_failures.set(agent.agent_failures.get() + 1);
                }
                agent.live.set(false);
                shard.sync_health(agent);
            }
            Err(_) => {}
        }
    }
}

/// Apply one control frame; false: close the link.
fn on_frame(agent: &Agent, msg: ControlMsg) -> bool {
    match msg {
        ControlMsg::Heartbeat {
            backend_healthy,
            draining,
        } => {
            let was_healthy = agent.healthy();
            agent.live.set(true);
            // One line a second at most per agent, with the changes it
            // stands for: a peer flipping its state cannot flood the log.
            if agent.draining.replace(draining) != draining {
                if let Some(n) = agent.peer_line(clock::now()) {
                    let what = if draining {
                        "agent draining: no new requests"
                    } else {
                        "agent no longer draining"
                    };
                    info!(peer_id = %agent.reg.peer_id, draining, changes = n, "{what} (this line stands for {n} state changes since the previous one)");
                }
            }
            if agent.backend_healthy.get() != backend_healthy {
                if let Some(n) = agent.peer_line(clock::now()) {
                    info!(peer_id = %agent.reg.peer_id, backend_healthy, changes = n, "agent backend health changed: {backend_healthy} (this line stands for {n} state changes since the previous one)");
                }
                if !backend_healthy {
                    agent.backend_failures.set(agent.backend_failures.get() + 1);
                }
            }
            agent.backend_healthy.set(backend_healthy);
            agent.last_seen_ms.set(clock::unix_millis());
            if !was_healthy && agent.healthy() {
                // A recovered agent wakes every queued request.
                wake_all(&agent.queue);
            }
            true
        }
        ControlMsg::RoutingSignals {
            mut engine,
            mut hardware,
        } => {
            agent.live.set(true);
            let dropped = engine.sanitize() + hardware.sanitize();
            if dropped > 0 {
                agent
                    .signals_dropped
                    .set(agent.signals_dropped.get() + u64::from(dropped));
            }
            agent.signals.set(engine);
            agent.hardware.set(hardware);
            true
        }
        ControlMsg::Load { active, own } => {
            // Never more than its capacity, whatever it claims.
            let others = active.saturating_sub(own).min(agent.reg.capacity);
            let was = agent.others.replace(others);
            // Each slot another router freed may serve a request queued here.
            for _ in others..was {
                wake_for(&agent.queue, agent.id);
            }
            true
        }
        other => {
            if agent.peer_line(clock::now()).is_some() {
                warn!(peer_id = %agent.reg.peer_id, "unexpected control message {other:?}; closing link");
            }
            false
        }
    }
}

/// The link is gone: leave routing at once and flush the history, unless
/// a newer registration of the same peer already replaced this one (it
/// carries the live state; publishing or flushing here would undo it).
fn leave(shard: &Shard, agent: &Rc<Agent>) {
    let counted = agent.counted_healthy.get();
    shard
        .router
        .unregister(&agent.reg.model, agent.reg.capability, counted);
    if !shard.remove_agent(agent) {
        if shard.peer_line(&agent.reg.peer_id, "left").is_some() {
            info!(shard = shard.id, peer_id = %agent.reg.peer_id, "replaced link ended");
        }
        return;
    }
    shard.router.publish("unregistered", &agent.reg);
    agent.disconnections.set(agent.disconnections.get() + 1);
    shard.flush(std::slice::from_ref(agent), None);
    if let Some(n) = shard.peer_line(&agent.reg.peer_id, "left") {
        info!(shard = shard.id, peer_id = %agent.reg.peer_id, model = %agent.reg.model, departures = n,
              "agent left routing ({n} departure(s) of this peer since the previous line)");
    }
}

async fn reject(shard: &Shard, ctl: &mut Conn<LinkStream>, model: &str, reason: Refusal) {
    refused(shard, None, model, reason.kind(), &reason);
    let reason = reason.to_string();
    let _ = monoio::time::timeout(
        std::time::Duration::from_secs(1),
        link::write_frame(&mut ctl.stream, &ControlMsg::Rejected { reason }),
    )
    .await;
}

/// How often an agent reports progress on an answer not yet started
/// (interim `102` heads, issue 56): three times per `--request-timeout`,
/// the head deadline each restarts, so one late report cuts nothing.
pub fn progress_interval(request_timeout: std::time::Duration) -> std::time::Duration {
    (request_timeout / 3).clamp(
        std::time::Duration::from_millis(50),
        std::time::Duration::from_secs(60),
    )
}
