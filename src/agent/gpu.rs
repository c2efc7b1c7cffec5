//! The host's GPUs, read with `nvidia-smi` (issue 28 #15): once at start
//! (the GPU model to register, unless `--gpu-model` declares one) and
//! then every sample interval on a thread of its own, so the tool's run
//! never blocks the agent's runtime. Without the tool, or without a GPU,
//! nothing is reported and GPU gates pass for this agent, as every absent
//! signal does.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use shards::logic::link::hardware::{self, GpuReading, HardwareSignals};

/// The latest reading, shared with the signal loop.
pub type Latest = Arc<Mutex<Option<GpuReading>>>;

/// Which GPUs to report (`--gpu-devices-file`, spec 03 §10).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Devices {
    /// Every GPU (no file given).
    All,
    /// The file is missing: every GPU, and the file is looked for again at
    /// each sample (once read, never again).
    Pending(String),
    /// These UUIDs only (empty: report no GPU).
    Only(Vec<String>),
}

impl Devices {
    /// From the flag's value.
    pub fn from_flag(path: Option<&str>) -> Devices {
        match path {
            None => Devices::All,
            Some(p) => Devices::Pending(p.to_string()).resolved(),
        }
    }

    /// A pending file read if it is there now.
    fn resolved(self) -> Devices {
        match self {
            Devices::Pending(p) => match std::fs::read_to_string(&p) {
                Ok(text) => Devices::Only(parse_devices(&text)),
                Err(_) => Devices::Pending(p),
            },
            d => d,
        }
    }
}

/// UUIDs separated by commas or newlines; `all` and `none` are ignored.
pub fn parse_devices(text: &str) -> Vec<String> {
    text.split([',', '\n'])
        .map(str::trim)
        .filter(|t| !t.is_empty() && *t != "all" && *t != "none")
        .map(str::to_string)
        .collect()
}

/// Run `nvidia-smi` once for `devices` (bounded: a hung driver must not
/// hang the agent).
pub fn read(tool: &str, devices: &Devices) -> Option<GpuReading> {
    let only = match devices {
        Devices::Only(ids) if ids.is_empty() => return None,
        Devices::Only(ids) => Some(format!("--id={}", ids.join(","))),
        _ => None,
    };
    let mut child = std::process::Command::new(tool)
        .args(hardware::NVIDIA_SMI_ARGS)
        .args(only)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let started = std::time::Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if started.elapsed() < Duration::from_secs(5) => {
                std::thread::sleep(Duration::from_millis(20));
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
    let out = child.wait_with_output().ok()?;
    if !out.status.success() {
        return None;
    }
    hardware::nvidia_smi(&String::from_utf8_lossy(&out.stdout))
}

/// The first reading (for the registration) and the sampler thread that
/// keeps [`Latest`] fresh every `every`; no thread when the first reading
/// finds no GPU.
pub fn start(tool: &str, devices: Devices, every: Duration) -> (Option<GpuReading>, Latest) {
    let first = read(tool, &devices);
    let latest: Latest = Arc::new(Mutex::new(first.clone()));
    if first.is_some() {
        let (tool, shared) = (tool.to_string(), latest.clone());
        let mut devices = devices;
        let _ = std::thread::Builder::new()
            .name("gpu-sampler".into())
            .spawn(move || loop {
                std::thread::sleep(every);
                devices = devices.resolved();
                let r = read(&tool, &devices);
                if let Ok(mut l) = shared.lock() {
                    *l = r;
                }
            });
    }
    (first, latest)
}

/// The GPU part of the host signals (all absent without a reading).
pub fn signals(latest: &Latest) -> HardwareSignals {
    let r = latest.lock().ok().and_then(|l| l.clone());
    HardwareSignals {
        gpu_util_percent: r.as_ref().map(|g| g.util),
        gpu_vram_used_percent: r.as_ref().map(|g| g.vram_used),
        gpu_temperature_c: r.as_ref().map(|g| g.temperature_c),
        ..HardwareSignals::default()
    }
}
