//! Prompt hashing (issue 30), pure: [`PrefixHasher`], fed by the body
//! probe as it parses, hashes the canonical prompt (roles and text, not
//! JSON formatting) and marks a hash at every message end and every
//! [`BASE_BLOCK`] bytes of text inside long messages; [`PrefixMarks`]
//! keeps the first mark and the newest ones (the longest prefixes), with
//! no allocation. The cache-affinity index
//! ([`crate::logic::routing::affinity`]) looks them up.

use xxhash_rust::xxh64::Xxh64;

/// The probe's finest block of text: a step's `block_bytes` is a multiple.
pub const BASE_BLOCK: u32 = 512;
/// Marks a request keeps: the first and the newest `MAX_MARKS - 1`.
pub const MAX_MARKS: usize = 48;

/// The hash of the canonical prompt up to one boundary.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Mark {
    /// Hash of everything before the boundary (model, system, tools included).
    pub hash: u64,
    /// Text bytes before the boundary.
    pub offset: u32,
    /// The boundary is a message's end (else a block inside one).
    pub message_end: bool,
}

/// A request's marks: the first message end (the system prompt or the
/// first message: what applications share) and the newest others.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixMarks {
    /// The first mark (the shortest prefix: system and first message).
    pub(crate) first: Option<Mark>,
    ring: [Mark; MAX_MARKS - 1],
    /// Marks in the ring (at most its length).
    len: usize,
    /// Next ring position to write.
    head: usize,
}

impl Default for PrefixMarks {
    fn default() -> Self {
        PrefixMarks {
            first: None,
            ring: [Mark::default(); MAX_MARKS - 1],
            len: 0,
            head: 0,
        }
    }
}

impl PrefixMarks {
    fn push(&mut self, m: Mark) {
        // The first message end (the system prompt's, or the seed's) is
        // kept whatever follows: every request of an application shares
        // it, and a lookup that misses it can stop there.
        if self.first.is_none() && m.message_end {
            self.first = Some(m);
            return;
        }
        if let Some(slot) = self.ring.get_mut(self.head) {
            *slot = m;
        }
        self.head = (self.head + 1) % self.ring.len();
        self.len = (self.len + 1).min(self.ring.len());
    }

    /// Number of marks.
    pub fn len(&self) -> usize {
        usize::from(self.first.is_some()) + self.len
    }

    /// No marks at all (no prompt text).
    pub fn is_empty(&self) -> bool {
        self.first.is_none() && self.len == 0
    }

    /// Marks a step with `block_bytes` uses, longest prefix first.
    pub fn longest_first(&self, block_bytes: u32) -> impl Iterator<Item = Mark> + '_ {
        let n = self.ring.len();
        let ring = move || {
            (0..self.len)
                .filter_map(move |k| self.ring.get((self.head + n - 1 - k) % n))
                .copied()
        };
        // Block marks inside the first message come before its end.
        let first = self.first.map(|f| f.offset);
        let longer = ring().filter(move |m| first.is_none_or(|f| m.offset > f));
        let shorter = ring().filter(move |m| first.is_some_and(|f| m.offset <= f));
        longer
            .chain(self.first)
            .chain(shorter)
            .filter(move |m| m.message_end || block_bytes == 0 || m.offset % block_bytes == 0)
    }

    /// Apply the request's seed (model, system, tools) to every mark and
    /// move offsets past the seed's text.
    fn seed(&mut self, seed: u64, seed_bytes: u32) {
        for m in self.first.iter_mut().chain(self.ring.iter_mut()) {
            m.hash = mix(seed, m.hash);
            m.offset = m.offset.saturating_add(seed_bytes);
        }
    }
}

/// Combine two 64-bit hashes (order matters).
pub(crate) fn mix(a: u64, b: u64) -> u64 {
    let x = a.rotate_left(23) ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    // splitmix64's finalizer.
    let x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Hash of a session key's text (`X-Session-ID`, `prompt_cache_key`,
/// `metadata.user_id`); [`model_salt`] places it under a model.
pub fn raw_key_hash(key: &[u8]) -> u64 {
    xxhash_rust::xxh64::xxh64(key, 2)
}

/// What makes one model's hashes its own in a shard's shared table.
pub fn model_salt(model: &str) -> u64 {
    xxhash_rust::xxh64::xxh64(model.as_bytes(), 1)
}

/// A hash under a model's salt.
pub fn salted(salt: u64, hash: u64) -> u64 {
    mix(salt, hash)
}

/// Hash of a session key under its model (tests).
pub fn key_hash(model: &str, key: &str) -> u64 {
    salted(model_salt(model), raw_key_hash(key.as_bytes()))
}

/// Fed by the body probe while it parses `messages` (roles and text in
/// order); `finish` seeds the marks with the model, system and tools,
/// which JSON may place anywhere in the body.
#[derive(Clone)]
pub struct PrefixHasher {
    state: Xxh64,
    in_block: u32,
    offset: u32,
    marks: PrefixMarks,
}

impl Default for PrefixHasher {
    fn default() -> Self {
        PrefixHasher {
            state: Xxh64::new(0),
            in_block: 0,
            offset: 0,
            marks: PrefixMarks::default(),
        }
    }
}

impl PrefixHasher {
    /// A role, a part type or another structural token: hashed, not counted
    /// as text.
    pub fn token(&mut self, t: &[u8]) {
        self.state.update(&[0xff]);
        self.state.update(t);
        self.state.update(&[0xfe]);
    }

    /// Text of the prompt: a mark every [`BASE_BLOCK`] bytes.
    pub fn text(&mut self, s: &[u8]) {
        let mut rest = s;
        while !rest.is_empty() {
            let room = (BASE_BLOCK - self.in_block) as usize;
            let n = room.min(rest.len());
            let (now, later) = rest.split_at(n);
            self.state.update(now);
            self.in_block += n as u32;
            self.offset = self.offset.saturating_add(n as u32);
            rest = later;
            if self.in_block >= BASE_BLOCK {
                self.in_block = 0;
                self.marks.push(Mark {
                    hash: self.state.digest(),
                    offset: self.offset,
                    message_end: false,
                });
            }
        }
    }

    /// A message ended.
    pub fn message_end(&mut self) {
        self.state.update(&[0xfd]);
        self.marks.push(Mark {
            hash: self.state.digest(),
            offset: self.offset,
            message_end: true,
        });
    }

    /// The marks under `seed` ([`seed_of`]); `seed_bytes` of text come
    /// before the messages (system and tools). With a system prompt, its
    /// own mark comes first.
    pub fn finish(mut self, seed: u64, seed_bytes: u32, system: bool) -> PrefixMarks {
        self.marks.seed(seed, seed_bytes);
        if !system {
            return self.marks;
        }
        let mut out = PrefixMarks::default();
        out.push(Mark {
            hash: mix(seed, 0),
            offset: seed_bytes,
            message_end: true,
        });
        // The messages' marks follow, oldest first; the ring keeps the newest.
        let old = self.marks;
        let n = old.ring.len();
        let ring = (0..old.len)
            .rev()
            .filter_map(|k| old.ring.get((old.head + n - 1 - k) % n));
        for m in old.first.iter().chain(ring) {
            out.push(*m);
        }
        out
    }
}

/// The seed of a request's marks: its system text and raw tools (the
/// model is mixed in where the index is asked: an alias resolves after
/// the probe).
pub fn seed_of(system: u64, tools: u64) -> u64 {
    mix(mix(0x5EED, system), tools)
}
