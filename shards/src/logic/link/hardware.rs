//! Host signals an agent reports: CPU use between two `/proc/stat`
//! samples and memory use from `/proc/meminfo`, as fractions 0-1, and its
//! GPUs from `nvidia-smi`'s CSV (the worst GPU: highest utilisation, VRAM
//! use and temperature). Pure: the agent reads the files and the tool's
//! output and passes the text.

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
    /// Highest GPU utilisation, 0-1 (absent: no GPU reported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_util_percent: Option<f64>,
    /// Highest GPU memory use, used/total, 0-1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_vram_used_percent: Option<f64>,
    /// Hottest GPU, °C.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_temperature_c: Option<f64>,
}

impl HardwareSignals {
    /// Drop every host signal out of its range (fractions 0-1, °C within
    /// -50..200); returns how many.
    pub fn sanitize(&mut self) -> u32 {
        use super::engine_metrics::keep_in_range;
        let mut n = 0;
        keep_in_range(&mut self.cpu_usage_percent, 0.0, 1.0, &mut n);
        keep_in_range(&mut self.memory_used_percent, 0.0, 1.0, &mut n);
        keep_in_range(&mut self.gpu_util_percent, 0.0, 1.0, &mut n);
        keep_in_range(&mut self.gpu_vram_used_percent, 0.0, 1.0, &mut n);
        keep_in_range(&mut self.gpu_temperature_c, -50.0, 200.0, &mut n);
        n
    }
}

/// The command line whose output [`nvidia_smi`] reads.
pub const NVIDIA_SMI_ARGS: [&str; 2] = [
    "--query-gpu=name,utilization.gpu,memory.used,memory.total,temperature.gpu",
    "--format=csv,noheader,nounits",
];

/// What `nvidia-smi` says of a host's GPUs.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuReading {
    /// The first GPU's name (`NVIDIA H100 80GB HBM3`).
    pub model: String,
    /// Highest utilisation, 0-1.
    pub util: f64,
    /// Highest used/total memory, 0-1 (0 when a total is 0).
    pub vram_used: f64,
    /// Highest temperature, °C.
    pub temperature_c: f64,
}

/// Parse `nvidia-smi` CSV ([`NVIDIA_SMI_ARGS`]): one line per GPU, `name,
/// util %, MiB used, MiB total, °C`. `None` without a well-formed line;
/// a line with a value out of range (`[N/A]`, negative, over 100 %) is
/// skipped, never read as 0.
pub fn nvidia_smi(csv: &str) -> Option<GpuReading> {
    let mut out: Option<GpuReading> = None;
    for line in csv.lines() {
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        let [name, util, used, total, temp] = f.as_slice() else {
            continue;
        };
        let num = |s: &str| s.parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0);
        let (Some(util), Some(used), Some(total), Some(temp)) =
            (num(util), num(used), num(total), num(temp))
        else {
            continue;
        };
        if name.is_empty() || util > 100.0 || used > total || temp > 200.0 {
            continue;
        }
        let vram = if total > 0.0 { used / total } else { 0.0 };
        let r = out.get_or_insert(GpuReading {
            model: (*name).to_string(),
            util: 0.0,
            vram_used: 0.0,
            temperature_c: 0.0,
        });
        r.util = r.util.max(util / 100.0);
        r.vram_used = r.vram_used.max(vram);
        r.temperature_c = r.temperature_c.max(temp);
    }
    out
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
    fn nvidia_smi_reports_the_worst_gpu() {
        let csv = "NVIDIA H100 80GB HBM3, 35, 40960, 81920, 61\nNVIDIA H100 80GB HBM3, 90, 8192, 81920, 70\n";
        let r = nvidia_smi(csv).expect("two GPUs");
        assert_eq!(r.model, "NVIDIA H100 80GB HBM3");
        assert!((r.util - 0.9).abs() < 1e-9);
        assert!((r.vram_used - 0.5).abs() < 1e-9);
        assert_eq!(r.temperature_c, 70.0);
        // Unreadable values skip the line, never count as 0.
        let odd = "A10, [N/A], 1, 2, 40\nA10, 150, 1, 2, 40\nA10, -1, 1, 2, 40\ngarbage\n";
        assert_eq!(nvidia_smi(odd), None);
        assert_eq!(nvidia_smi(""), None);
        let zero_total = nvidia_smi("L4, 10, 0, 0, 30").expect("one");
        assert_eq!(zero_total.vram_used, 0.0);
    }

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
