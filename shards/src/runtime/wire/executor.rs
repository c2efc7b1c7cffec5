//! Pinned monoio runtimes: one thread per shard, the `FusionDriver`
//! (io_uring, falling back to epoll) or the epoll driver when forced; and
//! SO_REUSEPORT listeners bound on the main thread so port 0 resolves once
//! and every shard shares the same port.

use std::future::Future;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::thread::JoinHandle;

use socket2::{Domain, Socket, Type};
use tracing::info;

/// Which I/O driver a runtime uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriverChoice {
    /// io_uring where available, epoll otherwise.
    Auto,
    /// epoll only.
    Epoll,
}

impl DriverChoice {
    /// Parse `auto|epoll|legacy`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" | "" | "io_uring" | "uring" => Some(DriverChoice::Auto),
            "epoll" | "legacy" => Some(DriverChoice::Epoll),
            _ => None,
        }
    }
}

/// Bind `n` SO_REUSEPORT listeners on `addr` (port 0 resolved by the first).
pub fn bind_reuseport(addr: SocketAddr, n: usize) -> io::Result<Vec<TcpListener>> {
    // SO_REUSEPORT would let us join another process's (or another of our
    // own) listeners on the same port and silently split its traffic:
    // first check the port is free with a plain bind.
    // A previous instance that just exited can hold its listener a little
    // longer (io_uring tears its ring down asynchronously): retry for ~2 s.
    if addr.port() != 0 {
        let mut tries = 0;
        loop {
            let probe = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
            probe.set_reuse_address(true)?;
            match probe.bind(&addr.into()) {
                Ok(()) => break,
                Err(e) if e.kind() == io::ErrorKind::AddrInUse && tries < 40 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                Err(e) => return Err(e),
            }
        }
    }
    let mut out = Vec::with_capacity(n);
    let mut addr = addr;
    for _ in 0..n.max(1) {
        let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
        s.set_reuse_port(true)?;
        s.set_reuse_address(true)?;
        s.set_nonblocking(true)?;
        s.set_nodelay(true)?;
        s.bind(&addr.into())?;
        // As deep as the system allows (the kernel clamps to
        // net.core.somaxconn, as Go's listeners do): a burst of held
        // clients overflowed 1024 and the kernel dropped their final ACKs,
        // costing each a 1 s SYN-ACK retransmit (perf/2026-12-01-hold-scale).
        s.listen(65_535)?;
        let l: TcpListener = s.into();
        addr = l.local_addr()?;
        out.push(l);
    }
    Ok(out)
}

/// Run `make()` on a new thread with its own runtime, pinned to `cpu`.
/// `label` names the thread and the start-up log line.
pub fn spawn_runtime<F, Fut>(
    label: String,
    cpu: Option<usize>,
    driver: DriverChoice,
    make: F,
) -> io::Result<JoinHandle<()>>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + 'static,
{
    std::thread::Builder::new()
        .name(label.clone())
        .spawn(move || {
            let pinned = match cpu {
                Some(c) => core_affinity::set_for_current(core_affinity::CoreId { id: c }),
                None => false,
            };
            let cpu_s = match (cpu, pinned) {
                (Some(c), true) => c.to_string(),
                (Some(c), false) => format!("{c} (pinning failed)"),
                (None, _) => "unpinned".to_string(),
            };
            run_on_runtime(driver, |kind| {
                info!("{label} on cpu {cpu_s}, driver {kind}");
                make()
            });
        })
}

/// Run a future to completion on a runtime of the chosen driver in the
/// current thread. `make` gets the driver's name.
pub fn run_on_runtime<F, Fut>(driver: DriverChoice, make: F)
where
    F: FnOnce(&'static str) -> Fut,
    Fut: Future<Output = ()>,
{
    match driver {
        DriverChoice::Epoll => match monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
            .enable_timer()
            .build()
        {
            Ok(mut rt) => rt.block_on(make("epoll (forced)")),
            Err(e) => tracing::error!("cannot build epoll runtime: {e}"),
        },
        DriverChoice::Auto => match monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
            .enable_timer()
            .build()
        {
            Ok(mut rt) => {
                let kind = match &rt {
                    monoio::FusionRuntime::Uring(_) => "io_uring",
                    monoio::FusionRuntime::Legacy(_) => "epoll (io_uring unavailable)",
                };
                rt.block_on(make(kind))
            }
            Err(e) => tracing::error!("cannot build runtime: {e}"),
        },
    }
}

/// CPUs this process may run on (respects the affinity mask).
pub fn available_cpus() -> Vec<usize> {
    core_affinity::get_core_ids()
        .map(|v| v.into_iter().map(|c| c.id).collect())
        .unwrap_or_default()
}
