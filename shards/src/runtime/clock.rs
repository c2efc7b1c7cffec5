//! The one module that reads time.

pub use std::time::{Duration, Instant};

/// Monotonic now.
#[inline]
pub fn now() -> Instant {
    Instant::now()
}

/// Wall-clock seconds since the Unix epoch.
pub fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Wall-clock seconds and nanoseconds since the Unix epoch.
pub fn unix_nanos() -> (u64, u32) {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| (d.as_secs(), d.subsec_nanos()))
        .unwrap_or((0, 0))
}
