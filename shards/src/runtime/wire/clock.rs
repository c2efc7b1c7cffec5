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

/// Wall-clock milliseconds since the Unix epoch.
pub fn unix_millis() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Wall-clock seconds and nanoseconds since the Unix epoch.
pub fn unix_nanos() -> (u64, u32) {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| (d.as_secs(), d.subsec_nanos()))
        .unwrap_or((0, 0))
}

/// Wall-clock nanoseconds since the Unix epoch (span times).
pub fn unix_ns() -> u64 {
    let (s, n) = unix_nanos();
    s.saturating_mul(1_000_000_000).saturating_add(u64::from(n))
}

/// Monotonic nanoseconds since the process's first call: one time base
/// every shard shares (the quota buckets compare them across cores).
pub fn mono_ns() -> u64 {
    static BASE: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let base = *BASE.get_or_init(Instant::now);
    // Offset by a day so a fresh base never reads as "a full bucket is late".
    u64::try_from(Instant::now().duration_since(base).as_nanos())
        .unwrap_or(u64::MAX)
        .saturating_add(86_400_000_000_000)
}
