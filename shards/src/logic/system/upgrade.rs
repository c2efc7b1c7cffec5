//! The upgrade hand-over's messages (issue 54): what the running router
//! ("old") and the one replacing it ("new") say over the Unix socket, in
//! this order:
//!
//! ```text
//! new → old  Hello                     (its flags were valid; it wants the sockets)
//! old → new  Listener × 3n, Listeners  (each with its descriptor)
//! new → old  WantState                 (its shards are built)
//! old → new  StoreFree                 (history and usage flushed, the store closed)
//! new → old  Started                   (store open, shards up, agent links accepted)
//! old → new  Expect                    (its agents, told to link to new)
//! new → old  Linked                    (they did, or the wait ended)
//! old → new  Go                        (old stopped accepting: new accepts clients)
//! old → new  Conn …, Usage …, Store …  (connections, held requests, usage, store calls)
//! new → old  StoreReply …
//! old → new  Done                      (old is empty and exits)
//! ```
//!
//! A new process that fails before `Go` leaves the old one serving: the
//! old reopens its store and accepts again. Pure data: no I/O here.

use serde::{Deserialize, Serialize};

/// Which listening socket a descriptor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ListenerKind {
    /// Client HTTP.
    Http,
    /// Prometheus.
    Metrics,
    /// Agent links.
    P2p,
}

/// A held request's state, carried with its connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CarriedHold {
    /// Held this long already, milliseconds.
    pub held_ms: u64,
    /// Its whole hold budget, milliseconds.
    pub budget_ms: u64,
    /// The next keepalive is due in this many milliseconds (`None`: no
    /// keepalives).
    pub keepalive_in_ms: Option<u64>,
    /// Its `200` head already went out.
    pub committed: bool,
    /// The daily tokens its quota reserved: (day, charged, input
    /// estimate), settled by the new process when it ends.
    pub daily: Option<(u64, u64, u64)>,
    /// Its request ID (a generated one is kept: the client may have seen it).
    pub request_id: String,
    /// Its model: the new process sends the connection straight to the
    /// model's hold shard (no second hand-off between its shards).
    #[serde(default)]
    pub model: String,
}

/// A stream the old process still relayed at `--upgrade-drain-timeout`,
/// carried with its connection (the payload: its request's bytes): the
/// new process continues it from what the client received, as a stream
/// whose agent broke (issue 33's continuation, spliced: the client sees
/// one whole answer).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CarriedStream {
    /// Its request ID.
    pub request_id: String,
    /// Its model (the new process serves it on the model's shard).
    pub model: String,
    /// The daily tokens its quota reserved (as [`CarriedHold::daily`]).
    pub daily: Option<(u64, u64, u64)>,
    /// What the client received of it.
    pub transcript: crate::logic::http::api::continuation::Transcript,
    /// The agent it was relayed from (its peer ID, for the log).
    pub from: String,
}

/// A store call the old process forwards to the new one (which owns the
/// store from `StoreFree` on). The record bytes travel as the payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum StoreCall {
    /// Keep a Responses record (no answer).
    Put {
        /// Its tenant.
        tenant: String,
        /// The response ID.
        id: String,
        /// Unix seconds.
        created_at: u64,
    },
    /// One record.
    Get {
        /// Tenant.
        tenant: String,
        /// ID.
        id: String,
    },
    /// A chain ending at `id`.
    Chain {
        /// Tenant.
        tenant: String,
        /// Newest ID.
        id: String,
    },
    /// Delete a record.
    Delete {
        /// Tenant.
        tenant: String,
        /// ID.
        id: String,
    },
}

/// The answer to a [`StoreCall`]; records travel as the payload, each
/// length-prefixed ([`pack`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "r", rename_all = "snake_case")]
pub enum StoreAnswer {
    /// `Get`: found (payload: the record) or not.
    Record {
        /// Found.
        found: bool,
    },
    /// `Chain`: the records (payload, packed), or the ID missing / the
    /// length refused.
    Chain {
        /// Missing ID.
        missing: Option<String>,
        /// Too long (its length).
        too_long: Option<usize>,
    },
    /// `Delete`: whether it was there.
    Deleted {
        /// It was.
        found: bool,
    },
}

/// One message of the hand-over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "m", rename_all = "snake_case")]
pub enum Msg {
    /// new → old: start.
    Hello {
        /// The new process's ID.
        pid: u32,
        /// Its version line.
        version: String,
    },
    /// old → new: one listening socket (descriptor attached).
    Listener {
        /// Which.
        kind: ListenerKind,
    },
    /// old → new: every listener was sent.
    Listeners,
    /// new → old: shards built; give me the store.
    WantState,
    /// old → new: the store is flushed (history, today's usage) and
    /// closed: open it.
    StoreFree,
    /// new → old: store open, shards running, agent links accepted.
    Started,
    /// old → new: the agents told to link to new (peer IDs), the sibling
    /// map pushed to old (its `PUT` body; `None`: none) and its dynamic
    /// keys (both live in memory, pushed through the admin API).
    Expect {
        /// Peer IDs.
        peers: Vec<String>,
        /// The policies in force, when written through the admin API since
        /// the files were read (`admin::policy::policy_set_json`).
        #[serde(default)]
        policies: Option<String>,
        /// Agents drained through the admin API (peer IDs).
        #[serde(default)]
        drained: Vec<String>,
        /// The map.
        #[serde(default)]
        sibling_map: Option<String>,
        /// The dynamic key registry (`HIVENET_ROUTER_AUTH_MODE=dynamic`),
        /// its snapshot as JSON (`None`: none pushed).
        #[serde(default)]
        registry: Option<String>,
    },
    /// new → old: these agents are linked to new.
    Linked {
        /// Peer IDs.
        peers: Vec<String>,
    },
    /// old → new: the cache-affinity index's entries of `model` (the
    /// payload: notes, `AffinityNote::encode`d), before `Go`.
    Affinity {
        /// The model.
        model: String,
    },
    /// old → new: old stopped accepting; accept clients now. `rates`:
    /// each request-rate bucket spending ahead (tenant, model, ns ahead).
    Go {
        /// Buckets ahead.
        #[serde(default)]
        rates: Vec<(String, String, u64)>,
    },
    /// old → new: a client connection (descriptor attached; payload:
    /// the bytes read from it and not answered).
    Conn {
        /// Set when its first request was held at zero.
        hold: Option<CarriedHold>,
        /// Set when its stream was still relayed at
        /// `--upgrade-drain-timeout`: new continues it.
        #[serde(default)]
        stream: Option<Box<CarriedStream>>,
    },
    /// old → new: today's usage the old counted since `StoreFree` (or
    /// since the previous `Usage`): (tenant, model, day, token delta).
    Usage {
        /// Deltas.
        deltas: Vec<(String, String, u64, i64)>,
    },
    /// old → new: a store call (payload: a record for `Put`).
    Store {
        /// Call number (answers carry it).
        id: u64,
        /// The call.
        call: StoreCall,
    },
    /// new → old: an answer.
    StoreReply {
        /// The call's number.
        id: u64,
        /// The answer.
        answer: StoreAnswer,
    },
    /// old → new: old has nothing left and exits.
    Done,
}

/// Encode a message header.
pub fn encode(m: &Msg) -> Vec<u8> {
    serde_json::to_vec(m).unwrap_or_default()
}

/// A message header that is not one of [`Msg`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadMessage(pub String);

impl std::fmt::Display for BadMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "bad upgrade message: {}", self.0)
    }
}

/// Decode a message header (from a peer process: any bytes get an error).
pub fn decode(b: &[u8]) -> Result<Msg, BadMessage> {
    serde_json::from_slice(b).map_err(|e| BadMessage(e.to_string()))
}

/// Records packed into one payload: each `u32` big-endian length first.
pub fn pack(records: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(records.iter().map(|r| r.len() + 4).sum());
    for r in records {
        out.extend_from_slice(&(r.len() as u32).to_be_bytes());
        out.extend_from_slice(r);
    }
    out
}

/// The records of a [`pack`]ed payload (`None`: malformed).
pub fn unpack(mut b: &[u8]) -> Option<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let len = b.get(..4)?;
        let mut l = [0u8; 4];
        l.copy_from_slice(len);
        let n = u32::from_be_bytes(l) as usize;
        let rec = b.get(4..4 + n)?;
        out.push(rec.to_vec());
        b = b.get(4 + n..)?;
    }
    Some(out)
}

/// A daily bucket: (tenant, model).
pub type BucketName = (String, String);
/// A bucket's usage: (day, tokens).
pub type DayUsage = (u64, u64);

/// The delta of usage between two counts of the same buckets: what the
/// new process adds to its own (`now` minus `before`, per (tenant,
/// model, day); a day that changed counts from zero).
pub fn usage_deltas(
    before: &std::collections::HashMap<BucketName, DayUsage>,
    now: &[(BucketName, DayUsage)],
) -> Vec<(String, String, u64, i64)> {
    let mut out = Vec::new();
    for ((t, m), (day, used)) in now {
        let was = match before.get(&(t.clone(), m.clone())) {
            Some((d, u)) if d == day => *u,
            _ => 0,
        };
        let delta = i64::try_from(*used).unwrap_or(i64::MAX) - i64::try_from(was).unwrap_or(0);
        if delta != 0 {
            out.push((t.clone(), m.clone(), *day, delta));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn messages_round_trip() {
        let m = Msg::Conn {
            hold: Some(CarriedHold {
                held_ms: 1200,
                budget_ms: 60_000,
                keepalive_in_ms: Some(300),
                committed: true,
                daily: Some((20_000, 512, 12)),
                request_id: "r".into(),
                model: "m".into(),
            }),
            stream: None,
        };
        assert_eq!(decode(&encode(&m)), Ok(m));
        let mut transcript = crate::logic::http::api::continuation::Transcript::default();
        transcript.feed(
            crate::logic::http::api::continuation::Api::OpenAi,
            b"data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"content\":\"The quick\"}}]}\n\n",
        );
        assert_eq!(transcript.text, "The quick");
        let m = Msg::Conn {
            hold: None,
            stream: Some(Box::new(CarriedStream {
                request_id: "r".into(),
                model: "m".into(),
                daily: None,
                transcript,
                from: "12D3KooW".into(),
            })),
        };
        assert_eq!(decode(&encode(&m)), Ok(m));
        // A message of the build before carries no stream.
        let old = br#"{"m":"conn","hold":null}"#;
        assert!(matches!(decode(old), Ok(Msg::Conn { stream: None, .. })));
        assert!(decode(b"{\"m\":\"nope\"}").is_err());
        assert!(decode(b"\xff").is_err());
    }

    #[test]
    fn deltas_count_only_what_changed_and_restart_at_a_new_day() {
        let mut before = std::collections::HashMap::new();
        before.insert(("t".to_string(), "m".to_string()), (10, 100));
        before.insert(("u".to_string(), "m".to_string()), (10, 50));
        let now = vec![
            (("t".to_string(), "m".to_string()), (10, 130)),
            (("u".to_string(), "m".to_string()), (11, 7)),
            (("v".to_string(), "m".to_string()), (10, 0)),
        ];
        assert_eq!(
            usage_deltas(&before, &now),
            vec![
                ("t".to_string(), "m".to_string(), 10, 30),
                ("u".to_string(), "m".to_string(), 11, 7)
            ]
        );
    }

    proptest! {
        #[test]
        fn pack_round_trips(recs in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 0..8)) {
            prop_assert_eq!(unpack(&pack(&recs)), Some(recs));
        }

        #[test]
        fn unpack_never_panics(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = unpack(&b);
            let _ = decode(&b);
        }
    }
}
