//! The standard `process_*` series (CPU, memory, descriptors, start
//! time), as every Prometheus client library's process collector exports
//! them, read from `/proc/self` at scrape time (Linux only; a file that
//! cannot be read leaves its series out).

use crate::logic::system::procfs;
use crate::runtime::wire::exposition::Family;
use crate::runtime::wire::exposition::Kind::{self, Counter, Gauge};

/// Append the process series to `o`.
pub fn render(o: &mut String) {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let mut series = |name: &'static str, kind: Kind, help: &str, v: f64| {
        Family::new(o, name, kind, help, []).series([], v);
    };
    let stat = read("/proc/self/stat").and_then(|s| procfs::stat(&s));
    if let Some((cpu, _)) = stat {
        series(
            "process_cpu_seconds_total",
            Counter,
            "Total user and system CPU time spent in seconds.",
            cpu,
        );
    }
    if let Some(status) = read("/proc/self/status") {
        if let Some(b) = procfs::status_kb(&status, "VmRSS") {
            series(
                "process_resident_memory_bytes",
                Gauge,
                "Resident memory size in bytes.",
                b as f64,
            );
        }
        if let Some(b) = procfs::status_kb(&status, "VmSize") {
            series(
                "process_virtual_memory_bytes",
                Gauge,
                "Virtual memory size in bytes.",
                b as f64,
            );
        }
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        series(
            "process_open_fds",
            Gauge,
            "Number of open file descriptors.",
            fds.count() as f64,
        );
    }
    if let Some(max) = read("/proc/self/limits").and_then(|s| procfs::max_open_files(&s)) {
        series(
            "process_max_fds",
            Gauge,
            "Maximum number of open file descriptors.",
            max as f64,
        );
    }
    let boot = read("/proc/stat").and_then(|s| procfs::boot_time(&s));
    if let (Some((_, ticks)), Some(boot)) = (stat, boot) {
        series(
            "process_start_time_seconds",
            Gauge,
            "Start time of the process since unix epoch in seconds.",
            boot as f64 + ticks as f64 / procfs::USER_HZ,
        );
    }
}
