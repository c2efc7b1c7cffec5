//! The simulator's prefix cache, shaped like an engine's: the prompt is cut
//! into blocks of `block_tokens` tokens (vLLM: 16; llama.cpp reuses every
//! cached token, so 1 behaves like it); a block is keyed by a hash of
//! everything up to its end (so only a common *prefix* hits, as in vLLM's
//! and llama.cpp's caches); a prompt's cached tokens are its leading blocks
//! found; the blocks are kept in a least-recently-used order bounded in
//! tokens ([`Eviction`]: which of a prompt's blocks goes first). Pure: no
//! clock, no I/O.

use std::collections::{BTreeMap, HashMap};

/// Tokens per cached block by default (vLLM's block size).
pub const BLOCK_TOKENS: u64 = 16;
/// Bytes per token by default, as the simulator counts prompt tokens
/// (`--bytes-per-token`; SmolLM2's tokenizer on the calibration prompts:
/// perf/2026-12-02-sim-calibration).
pub const BYTES_PER_TOKEN: f64 = 4.0;

/// Tokens in `bytes` bytes of prompt at `bytes_per_token` (at least 1).
pub fn tokens_of(bytes: usize, bytes_per_token: f64) -> u64 {
    ((bytes as f64 / bytes_per_token.max(0.1)).round() as u64).max(1)
}

/// Which of one prompt's blocks an engine evicts first when its cache is
/// full (`--cache-eviction`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Eviction {
    /// The prompt's blocks age in prompt order: its head goes first (the
    /// default; the llama-server calibration fits it within 0.5 points on
    /// 10 of 12 rows: perf/2026-12-06-affinity-lead/calibration).
    #[default]
    PromptOrder,
    /// Its tail goes first, a shared head last: vLLM frees a request's
    /// blocks in reverse order "so that the tail blocks are evicted
    /// first" (vllm/v1/core/kv_cache_manager.py), and SGLang's radix cache
    /// evicts leaves only. A long prompt then evicts other conversations'
    /// tails and its own, not the application's system prompt.
    TailFirst,
}

impl Eviction {
    /// `prompt-order` or `tail-first`.
    pub fn parse(s: &str) -> Option<Eviction> {
        match s {
            "prompt-order" => Some(Eviction::PromptOrder),
            "tail-first" => Some(Eviction::TailFirst),
            _ => None,
        }
    }
}

/// A bounded LRU of prefix blocks.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct PrefixCache {
    capacity_tokens: u64,
    /// Tokens per block.
    block_tokens: u64,
    /// Prompt bytes per block.
    block_bytes: usize,
    /// Block key to its last use.
    blocks: HashMap<u64, u64>,
    /// Last use to block key (the eviction order).
    order: BTreeMap<u64, u64>,
    tick: u64,
    #[serde(default)]
    eviction: Eviction,
}

impl PrefixCache {
    /// A cache holding at most `capacity_tokens` (0: nothing is kept) in
    /// blocks of [`BLOCK_TOKENS`], prompts counted at [`BYTES_PER_TOKEN`].
    pub fn new(capacity_tokens: u64) -> Self {
        Self::shaped(capacity_tokens, BLOCK_TOKENS, BYTES_PER_TOKEN)
    }

    /// A cache of `block_tokens`-token blocks (at least 1), prompts
    /// counted at `bytes_per_token`.
    pub fn shaped(capacity_tokens: u64, block_tokens: u64, bytes_per_token: f64) -> Self {
        let block_tokens = block_tokens.max(1);
        PrefixCache {
            capacity_tokens,
            block_tokens,
            block_bytes: ((block_tokens as f64 * bytes_per_token).round() as usize).max(1),
            ..Default::default()
        }
    }

    /// This cache, evicting a prompt's blocks in `eviction` order.
    pub fn evicting(mut self, eviction: Eviction) -> Self {
        self.eviction = eviction;
        self
    }

    /// Tokens held now.
    pub fn held_tokens(&self) -> u64 {
        self.blocks.len() as u64 * self.block_tokens
    }

    /// Look `prompt` up and keep its blocks: returns the tokens read from
    /// the cache (its leading blocks that were there). A partial last
    /// block is never cached.
    pub fn lookup_and_keep(&mut self, prompt: &[u8]) -> u64 {
        let block_bytes = self.block_bytes;
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        let mut hits = 0;
        let mut leading = true;
        let mut keys = Vec::new();
        for block in prompt.chunks_exact(block_bytes) {
            for b in block {
                // FNV-1a over the whole prefix: the key of a block names
                // everything before it too.
                hash = (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
            }
            let found = match self.eviction {
                Eviction::PromptOrder => self.touch(hash),
                Eviction::TailFirst => {
                    keys.push(hash);
                    self.blocks.contains_key(&hash)
                }
            };
            if leading && found {
                hits += self.block_tokens;
            } else {
                leading = false;
            }
        }
        // Tail first: the last block is used "longest ago" of the prompt's.
        for k in keys.into_iter().rev() {
            self.touch(k);
        }
        self.evict();
        hits
    }

    /// The tokens [`PrefixCache::lookup_and_keep`] would read for
    /// `prompt`, changing nothing.
    pub fn peek(&self, prompt: &[u8]) -> u64 {
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        let mut hits = 0;
        for block in prompt.chunks_exact(self.block_bytes) {
            for b in block {
                hash = (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
            }
            if !self.blocks.contains_key(&hash) {
                break;
            }
            hits += self.block_tokens;
        }
        hits
    }

    /// Mark a block used now; whether it was there.
    fn touch(&mut self, key: u64) -> bool {
        self.tick += 1;
        let found = match self.blocks.insert(key, self.tick) {
            Some(old) => {
                self.order.remove(&old);
                true
            }
            None => false,
        };
        self.order.insert(self.tick, key);
        found
    }

    fn evict(&mut self) {
        while self.held_tokens() > self.capacity_tokens {
            let Some((_, key)) = self.order.pop_first() else {
                break;
            };
            self.blocks.remove(&key);
        }
    }
}

/// The benchmark's oracle for cache affinity (issue 30): a router that
/// knows every engine's cache exactly. It mirrors each sim's cache (the
/// same [`PrefixCache`] fed the same prompts in the same order) and places
/// a request on the engine with a free slot whose cache holds the longest
/// prefix of it (ties: the fewest running, then the first); none free:
/// the request waits. Pure: the caller sends and reports the end.
/// Serializable, so that a fleet's mirrors outlive one bench run (the
/// sims' caches outlive it too: `--oracle-state`).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Oracle {
    caches: Vec<PrefixCache>,
    running: Vec<usize>,
    capacity: usize,
    /// Cached tokens the mirrors gave the requests placed (equal to the
    /// sims' own `prefix_cache_hits` when the mirrors are exact).
    pub predicted: u64,
}

impl Oracle {
    /// `engines` engines of `capacity` slots each, caches shaped as the
    /// sims' (`--prefix-cache-tokens`, `--cache-block-tokens`,
    /// `--bytes-per-token`, `--cache-eviction`).
    pub fn new(
        engines: usize,
        capacity: usize,
        cache_tokens: u64,
        block_tokens: u64,
        bytes_per_token: f64,
        eviction: Eviction,
    ) -> Self {
        Oracle {
            caches: (0..engines)
                .map(|_| {
                    PrefixCache::shaped(cache_tokens, block_tokens, bytes_per_token)
                        .evicting(eviction)
                })
                .collect(),
            running: vec![0; engines],
            capacity: capacity.max(1),
            predicted: 0,
        }
    }

    /// The engine for a request whose prompt renders as `prompt` (see
    /// `sim::prompt_text`), now counted running there and its blocks kept
    /// in that engine's mirror; `None`: every engine is full.
    pub fn place(&mut self, prompt: &[u8]) -> Option<usize> {
        let i = (0..self.caches.len())
            .filter(|&i| self.running.get(i).is_some_and(|&r| r < self.capacity))
            .max_by_key(|&i| {
                let cached = self.caches.get(i).map_or(0, |c| c.peek(prompt));
                let running = self.running.get(i).copied().unwrap_or(0);
                // The longest prefix; then the fewest running; then the first.
                (cached, std::cmp::Reverse(running), std::cmp::Reverse(i))
            })?;
        if let Some(c) = self.caches.get_mut(i) {
            self.predicted += c.lookup_and_keep(prompt);
        }
        if let Some(r) = self.running.get_mut(i) {
            *r += 1;
        }
        Some(i)
    }

    /// A request placed on `engine` ended.
    pub fn done(&mut self, engine: usize) {
        if let Some(r) = self.running.get_mut(engine) {
            *r = r.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(words: &[&str]) -> Vec<u8> {
        words.join(" ").into_bytes()
    }

    #[test]
    fn a_shared_prefix_hits_and_a_changed_start_does_not() {
        let mut c = PrefixCache::new(10_000);
        let system = "You are terse. ".repeat(40);
        let a = format!("{system}Say hi.");
        let b = format!("{system}Say hello, and more words here.");
        assert_eq!(c.lookup_and_keep(a.as_bytes()), 0, "cold");
        let hit = c.lookup_and_keep(b.as_bytes());
        let shared_blocks = (system.len() / 64) as u64;
        assert_eq!(
            hit,
            shared_blocks * BLOCK_TOKENS,
            "the system prompt's whole blocks"
        );
        // The same words behind another start share no prefix.
        let moved = format!("X{system}");
        assert_eq!(c.lookup_and_keep(moved.as_bytes()), 0);
        // Asked again: all its whole blocks.
        assert_eq!(
            c.lookup_and_keep(a.as_bytes()),
            (a.len() / 64) as u64 * BLOCK_TOKENS
        );
    }

    #[test]
    fn one_token_blocks_reuse_all_but_the_partial_tail_like_llama_cpp() {
        // 2 bytes a token, 1-token blocks: a prompt that repeats an
        // earlier one with more after it hits the whole earlier prompt.
        let mut c = PrefixCache::shaped(10_000, 1, 2.0);
        let first = "You are terse. Say hi.";
        let second = format!("{first} And then more.");
        assert_eq!(c.lookup_and_keep(first.as_bytes()), 0, "cold");
        assert_eq!(
            c.lookup_and_keep(second.as_bytes()),
            (first.len() / 2) as u64,
            "every whole token of the earlier prompt"
        );
        // 16-token blocks of the same prompts hit nothing: too short.
        let mut v = PrefixCache::shaped(10_000, 16, 2.0);
        v.lookup_and_keep(first.as_bytes());
        assert_eq!(v.lookup_and_keep(second.as_bytes()), 0);
        assert_eq!(tokens_of(21, 2.0), 11);
        assert_eq!(tokens_of(0, 4.0), 1, "never 0 tokens");
    }

    #[test]
    fn the_capacity_bounds_it_and_the_least_recent_goes_first() {
        let mut c = PrefixCache::new(4 * BLOCK_TOKENS);
        let p1 = text(&["alpha"; 60]); // 359 bytes: 5 blocks
        let p2 = text(&["omega"; 60]);
        c.lookup_and_keep(&p1);
        assert!(c.held_tokens() <= 4 * BLOCK_TOKENS);
        c.lookup_and_keep(&p2);
        assert!(c.held_tokens() <= 4 * BLOCK_TOKENS);
        // p1's blocks were the least recent: gone.
        assert_eq!(c.lookup_and_keep(&p1), 0);
        assert_eq!(
            PrefixCache::new(0).lookup_and_keep(&p1),
            0,
            "capacity 0 keeps nothing"
        );
    }

    #[test]
    fn tail_first_keeps_a_shared_head_that_a_long_prompt_overflows() {
        // 10 one-byte tokens of cache; a 6-token shared head ("system").
        let run = |e: Eviction| {
            let mut c = PrefixCache::shaped(10, 1, 1.0).evicting(e);
            c.lookup_and_keep(b"SSSSSSabc");
            // Head and 6 more: 15 tokens held, 5 go.
            let hit = c.lookup_and_keep(b"SSSSSSdefghi");
            (hit, c.lookup_and_keep(b"SSSSSSxyz"))
        };
        // Both read the head; then prompt order lost its first blocks
        // (aged first), tail-first lost tails only.
        assert_eq!(run(Eviction::PromptOrder), (6, 0));
        assert_eq!(run(Eviction::TailFirst), (6, 6));
        assert_eq!(Eviction::parse("tail-first"), Some(Eviction::TailFirst));
        assert_eq!(Eviction::parse("prompt-order"), Some(Eviction::PromptOrder));
        assert_eq!(Eviction::parse("lru"), None);
    }

    #[test]
    fn peek_reads_what_lookup_would_and_changes_nothing() {
        let mut c = PrefixCache::shaped(1000, 1, 1.0);
        c.lookup_and_keep(b"abcdef");
        assert_eq!(c.peek(b"abcxyz"), 3);
        assert_eq!(c.peek(b"abcxyz"), 3, "peek keeps nothing");
        assert_eq!(c.lookup_and_keep(b"abcxyz"), 3);
        assert_eq!(c.peek(b"abcxyz"), 6);
    }

    #[test]
    fn the_oracle_goes_to_the_longest_cached_prefix_with_a_free_slot() {
        let mut o = Oracle::new(3, 1, 1000, 1, 1.0, Eviction::PromptOrder);
        // Nothing cached: the first engine, then the others (fewest running).
        assert_eq!(o.place(b"system A\nuser 1"), Some(0));
        assert_eq!(o.place(b"system B\nuser 1"), Some(1));
        o.done(0);
        o.done(1);
        // Each conversation goes back to the engine holding its prefix.
        assert_eq!(o.place(b"system B\nuser 1\nuser 2"), Some(1));
        assert_eq!(o.place(b"system A\nuser 1\nuser 2"), Some(0));
        // Both holders full: the free engine, though it holds nothing.
        assert_eq!(o.place(b"system A\nuser 1\nuser 3"), Some(2));
        assert_eq!(o.place(b"system A"), None, "every engine is full");
        o.done(0);
        assert_eq!(o.place(b"system A\nuser 1\nuser 2\nuser 3"), Some(0));
    }
}
