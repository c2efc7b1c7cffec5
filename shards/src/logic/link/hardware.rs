//! Host signals an agent reports: CPU use between two `/proc/stat`
//! samples and memory use from `/proc/meminfo`, as fractions 0-1. Pure:
//! the agent reads the files and passes the text.

use serde::{Deserialize, Serialize};

/// Host signals (absent when unknown).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct HardwareSignals {
    /// CPU busy fraction since the previous sample.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_usage_percent: Option<f64>,
    /// Memory in use (1 - available/total).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_used_percent: Option<f64>,
}

/// Busy and total jiffies of the aggregate `cpu` line.
pub fn cpu_ticks(stat: &str) -> Option<(u64, u64)> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    if v.len() < 4 {
        return None;
    }
    let total: u64 = v.iter().sum();
    // idle + iowait are not busy.
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    Some((total.saturating_sub(idle), total))
}

/// CPU busy fraction between two samples.
pub fn cpu_usage(prev: (u64, u64), now: (u64, u64)) -> Option<f64> {
    let busy = now.0.checked_sub(prev.0)?;
    let total = now.1.checked_sub(prev.1)?;
    (total > 0).then(|| (busy as f64 / total as f64).clamp(0.0, 1.0))
}

/// Memory used fraction from `/proc/meminfo`.
pub fn memory_used(meminfo: &str) -> Option<f64> {
    let field = |name: &str| -> Option<f64> {
        meminfo
            .lines()
            .find(|l| l.starts_with(name))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    let total = field("MemTotal:")?;
    let avail = field("MemAvailable:")?;
    (total > 0.0).then(|| (1.0 - avail / total).clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn proc_files() {
        let a = cpu_ticks("cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 1 2 3 4\n").expect("a");
        let b = cpu_ticks("cpu  200 0 200 800 100 0 0 0 0 0\n").expect("b");
        assert_eq!(a, (200, 1000));
        assert_eq!(cpu_usage(a, b), Some(200.0 / 300.0));
        assert_eq!(
            memory_used("MemTotal:       1000 kB\nMemFree: 1 kB\nMemAvailable:    250 kB\n"),
            Some(0.75)
        );
        assert_eq!(memory_used("garbage"), None);
        assert_eq!(
            cpu_usage(b, a),
            None,
            "counters going back are not a sample"
        );
    }

    proptest! {
        #[test]
        fn never_panics(t in ".{0,300}") {
            let _ = cpu_ticks(&t);
            let _ = memory_used(&t);
        }
    }
}
