//! Client connections carried to the process that replaces this one
//! (issue 54). Once the new process accepts clients, every connection the
//! old one still has goes over at its next request (the head read, not
//! answered: its bytes go with the socket), and every request held at
//! zero goes over with its hold state; the new process serves them as if
//! it had read them. Streams in flight stay here until they end, or
//! until `--upgrade-drain-timeout`: then each goes over with what its
//! client received, and the new process continues it.
//!
//! The process-level protocol is `hivenet_router::upgrade`; this room is
//! the shards' side of it: [`out`] (take a connection out of its runtime
//! and send it to the old process's outbox,
//! [`crate::runtime::state::carry_out::CarryOut`]) and [`relink_all`]
//! (agents told to follow); the new process serves what it receives
//! from its event loop (`ShardMsg::AdoptCarried`).

use std::rc::Rc;

use crate::logic::system::upgrade::{CarriedHold, CarriedStream};
use crate::runtime::state::carry_out::Outgoing;
use crate::runtime::state::scope::Client;
use crate::runtime::state::shard::Shard;
use crate::runtime::wire::budget::ConnPermit;
use crate::runtime::wire::handoff;

/// What goes over ahead of a connection's unread bytes: its first
/// request's bytes, with the state of its hold or of its stream.
pub type Lead = (Vec<u8>, Option<CarriedHold>, Option<Box<CarriedStream>>);

/// Send `c` to the new process: its socket, `first` (a held request or a
/// stream with its state) and what was read past it. When it cannot go
/// (the new process is gone) the connection is closed.
pub fn out(shard: &Shard, c: Client, first: Lead, permit: ConnPermit) {
    // A watched socket (a held request) is duplicated: a cancelled
    // readiness poll may still hold the runtime's descriptor
    // (`handoff::dup_watched`).
    let dup = if c.conn.watched {
        match handoff::dup_watched(&c.conn.stream) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(shard = shard.id, "cannot carry a connection over: {e}");
                return;
            }
        }
    } else {
        None
    };
    let (own, buf) = c.conn.into_parts();
    let stream = match dup {
        Some(s) => s,
        None => handoff::into_std(own),
    };
    let (mut bytes, hold, resumed) = first;
    bytes.extend_from_slice(&buf);
    drop(permit);
    let ok = shard.router.carry.send(Outgoing {
        stream,
        bytes,
        hold,
        resumed,
    });
    if !ok {
        tracing::warn!(
            shard = shard.id,
            "the new process is gone: a connection it was to take is closed"
        );
    }
}

/// The agent-side path of a relink request (the router's own; never a
/// client's: it travels only on the router's authenticated link).
pub const RELINK_PATH: &str = "/_hivenet/relink";

/// Tell every agent linked to this shard to open a second link to the
/// same address, which the process replacing this one now accepts (its
/// capacity is then shared by both links through its load reports); the
/// link here stays until this process closes it. Replies with the peer
/// IDs told.
pub fn relink_all(shard: &Rc<Shard>, reply: futures::channel::oneshot::Sender<Vec<String>>) {
    let agents = shard.all_agents();
    let peers = agents.iter().map(|a| a.reg.peer_id.clone()).collect();
    let _ = reply.send(peers);
    for a in agents {
        monoio::spawn(async move {
            let req =
                format!("POST {RELINK_PATH} HTTP/1.1\r\nhost: agent\r\ncontent-length: 0\r\n\r\n");
            let progress = crate::runtime::request::exchange::Progress::default();
            let got = monoio::time::timeout(
                std::time::Duration::from_secs(5),
                crate::runtime::request::exchange::exchange_head(
                    &a.link,
                    req.as_bytes(),
                    &progress,
                ),
            )
            .await;
            match got {
                Ok(Ok(h)) if h.head.status == 204 => {}
                Ok(Ok(h)) => {
                    tracing::warn!(peer_id = %a.reg.peer_id, status = h.head.status, "agent refused to relink (an older agent?); it follows when this process closes its link")
                }
                _ => {
                    tracing::warn!(peer_id = %a.reg.peer_id, "agent did not answer the relink; it follows when this process closes its link")
                }
            }
        });
    }
}
