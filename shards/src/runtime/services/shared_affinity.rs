//! `--shared-state-affinity`: forwards published to the other routers so
//! that a conversation landing on another router still finds its agent
//! (issue 31). The shared-state thread's side.
//!
//! Every round (20 ms) the thread takes the forwards this router's shards
//! noted ([`AffinityNote`]: model salt, agent peer hash, at most
//! [`crate::logic::routing::affinity::NOTE_HASHES`] salted hashes), packs
//! them into one entry of the stream [`STREAM`] (capped at about
//! [`STREAM_MAX`] entries), reads what the other routers added since its
//! last read, and hands those to the owner shards of their models, which
//! record them in their indexes under their own agent IDs. The request
//! path only pushes a note into a buffer (never waiting: a busy or full
//! buffer drops it); a router starts reading at the stream's end.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::logic::routing::affinity::AffinityNote;

/// The stream in Redis.
pub const STREAM: &str = "hivenet:affinity";
/// Entries the stream keeps (about: `MAXLEN ~`); one entry is one router's
/// round, so this is minutes of history at most.
pub const STREAM_MAX: usize = 10_000;
/// Entries read per round at most.
const READ_MAX: usize = 256;

/// The thread's affinity state.
pub struct Share {
    me: String,
    /// The last stream ID read (None: start at the end).
    last: Option<String>,
    buf: Vec<AffinityNote>,
}

impl Share {
    /// The share of the router named `me`.
    pub fn new(me: String) -> Self {
        Share {
            me,
            last: None,
            buf: Vec::new(),
        }
    }

    /// One round: publish ours, read theirs; counted in `counts`
    /// (published, received).
    /// `take` swaps this router's noted forwards into the buffer it is
    /// given; `deliver` hands the other routers' to the shards.
    pub fn cycle(
        &mut self,
        c: &mut redis::Connection,
        take: impl FnOnce(&mut Vec<AffinityNote>),
        deliver: impl FnOnce(Vec<AffinityNote>),
        counts: &(AtomicU64, AtomicU64),
    ) -> redis::RedisResult<()> {
        let last = match &self.last {
            Some(l) => l.clone(),
            None => {
                // Start at the end: history of before this router's start
                // may name agents long gone.
                let r: redis::streams::StreamRangeReply = redis::cmd("XREVRANGE")
                    .arg(STREAM)
                    .arg("+")
                    .arg("-")
                    .arg("COUNT")
                    .arg(1)
                    .query(c)?;
                r.ids
                    .first()
                    .map_or_else(|| "0-0".to_string(), |i| i.id.clone())
            }
        };
        self.last = Some(last.clone());
        take(&mut self.buf);
        if !self.buf.is_empty() {
            let mut blob = Vec::with_capacity(self.buf.len() * 96);
            for n in &self.buf {
                n.encode(&mut blob);
            }
            counts.0.fetch_add(self.buf.len() as u64, Ordering::Relaxed);
            self.buf.clear();
            let _: String = redis::cmd("XADD")
                .arg(STREAM)
                .arg("MAXLEN")
                .arg("~")
                .arg(STREAM_MAX)
                .arg("*")
                .arg("r")
                .arg(&self.me)
                .arg("d")
                .arg(blob)
                .query(c)?;
        }
        let r: Option<redis::streams::StreamReadReply> = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(READ_MAX)
            .arg("STREAMS")
            .arg(STREAM)
            .arg(&last)
            .query(c)?;
        let mut notes = Vec::new();
        for key in r.map(|r| r.keys).unwrap_or_default() {
            for e in key.ids {
                let from: Option<String> = e.get("r");
                if from.as_deref() != Some(self.me.as_str()) {
                    let d: Option<Vec<u8>> = e.get("d");
                    notes.extend(AffinityNote::decode_all(&d.unwrap_or_default()));
                }
                self.last = Some(e.id);
            }
        }
        if !notes.is_empty() {
            counts.1.fetch_add(notes.len() as u64, Ordering::Relaxed);
            deliver(notes);
        }
        Ok(())
    }

    /// A new connection: read from the end again (what was missed while
    /// Redis was away is lost: affinity is a hint).
    pub fn connected(&mut self) {
        self.last = None;
    }
}
