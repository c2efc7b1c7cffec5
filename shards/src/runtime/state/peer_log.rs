//! The log lines a peer's link events cause, paced per peer and event
//! (issue 51: a peer reconnecting in a loop cannot flood the log).

use super::shard::Shard;

/// Most peers [`Shard::peer_line`] keeps a gate for.
const PEER_LOG_MAX: usize = 4096;

impl Shard {
    /// Whether a line `event` of peer `peer_id` causes may be written now:
    /// `Some(n)`, the events it stands for, at most once a second per peer
    /// and event. Bounded: past 4,096 peers the book starts over (a few
    /// lines more, never more memory).
    pub fn peer_line(&self, peer_id: &str, event: &'static str) -> Option<u64> {
        let mut book = self.peer_log.try_borrow_mut().ok()?;
        if book.len() >= PEER_LOG_MAX && !book.contains_key(&(peer_id.to_string(), event)) {
            book.clear();
        }
        book.entry((peer_id.to_string(), event)).or_default().hit(
            crate::runtime::wire::clock::now(),
            std::time::Duration::from_secs(1),
        )
    }
}
