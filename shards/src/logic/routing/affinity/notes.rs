//! The notes routers share of their forwards (`--shared-state-affinity`)
//! and a replaced router gives the process replacing it (issue 54): an
//! agent (by its peer ID's hash, routers numbering agents each their own
//! way) and the salted prefix hashes it holds, in a compact wire form.

use super::*;

/// Hashes one shared note carries at most: the session key, the first
/// mark and the newest others (what the next turn of a conversation or
/// the next request of an application looks up first).
pub const NOTE_HASHES: usize = 9;

/// One forward, as published to the other routers (`--shared-state-affinity`):
/// the model's salt, the agent (a hash of its peer ID: routers number
/// agents each their own way) and the salted hashes it now holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AffinityNote {
    /// [`model_salt`] of the model.
    pub salt: u64,
    /// [`peer_hash`] of the agent.
    pub peer: u64,
    /// Salted hashes, `len` of them.
    pub hashes: [u64; NOTE_HASHES],
    /// Hashes in use.
    pub len: u8,
}

/// The hash of an agent's peer ID in shared notes.
pub fn peer_hash(peer_id: &str) -> u64 {
    xxhash_rust::xxh64::xxh64(peer_id.as_bytes(), 3)
}

impl AffinityNote {
    /// The note of a forward of `req` to the agent whose peer hash is
    /// `peer`, with the marks a step with `block_bytes` uses.
    pub fn of(req: &RequestKeys<'_>, block_bytes: u32, peer: u64) -> Self {
        let mut n = AffinityNote {
            salt: req.salt,
            peer,
            ..AffinityNote::default()
        };
        let mut push = |h: u64| {
            if let Some(slot) = n.hashes.get_mut(usize::from(n.len)) {
                *slot = h;
                n.len += 1;
            }
        };
        if let Some(k) = req.key {
            push(salted(req.salt, k));
        }
        if let Some(f) = req.marks.first {
            push(salted(req.salt, f.hash));
        }
        for m in req
            .marks
            .longest_first(block_bytes)
            .filter(|m| Some(m.hash) != req.marks.first.map(|f| f.hash))
        {
            push(salted(req.salt, m.hash));
        }
        n
    }

    /// Its hashes.
    pub fn hashes(&self) -> &[u64] {
        self.hashes.get(..usize::from(self.len)).unwrap_or(&[])
    }

    /// Append its wire form: salt, peer, count (one byte), hashes; all
    /// little-endian.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.salt.to_le_bytes());
        out.extend_from_slice(&self.peer.to_le_bytes());
        out.push(self.len);
        for h in self.hashes() {
            out.extend_from_slice(&h.to_le_bytes());
        }
    }

    /// Every note of a blob [`AffinityNote::encode`] wrote; a blob another
    /// build or a damaged store wrote stops at its first bad note.
    pub fn decode_all(mut b: &[u8]) -> Vec<AffinityNote> {
        let word = |b: &[u8], at: usize| -> Option<u64> {
            b.get(at..at + 8)
                .and_then(|w| <[u8; 8]>::try_from(w).ok())
                .map(u64::from_le_bytes)
        };
        let mut out = Vec::new();
        while !b.is_empty() {
            let (Some(salt), Some(peer), Some(&len)) = (word(b, 0), word(b, 8), b.get(16)) else {
                break;
            };
            if usize::from(len) > NOTE_HASHES {
                break;
            }
            let mut n = AffinityNote {
                salt,
                peer,
                len,
                ..AffinityNote::default()
            };
            let mut ok = true;
            for (i, slot) in n.hashes.iter_mut().take(usize::from(len)).enumerate() {
                match word(b, 17 + 8 * i) {
                    Some(h) => *slot = h,
                    None => ok = false,
                }
            }
            if !ok {
                break;
            }
            out.push(n);
            b = b.get(17 + 8 * usize::from(len)..).unwrap_or(&[]);
        }
        out
    }
}
