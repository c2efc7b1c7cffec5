//! Settings that can be valid in themselves and still not be honoured
//! here: an open p2p port without a swarm key, an affinity table larger
//! than the machine. Each stops the start with one line.

/// Issue 28 #12: links without a swarm key are authenticated by nothing
/// but the noise handshake, so any peer may register a model and receive
/// prompts. That is refused on an address others can reach, unless the
/// operator says so; loopback (the default, the demos) stays open.
pub(crate) fn open_p2p_check(
    ip: std::net::IpAddr,
    swarm_key: bool,
    allowed: bool,
) -> Result<(), String> {
    if swarm_key || allowed || ip.is_loopback() {
        return Ok(());
    }
    Err(format!(
        "--p2p-listen-addr {ip} is reachable from other hosts and no --swarm-key-file is given: \
         any peer could register a model and receive prompts; give the fleet's swarm key, \
         or --allow-open-p2p to accept that"
    ))
}

/// The cache-affinity index is allocated at the first prefix-aware
/// request, possibly hours after start: a count the machine cannot hold
/// must stop the start, not a shard later (issue 51 #1). The ceiling is a
/// quarter of the machine's memory (`MemTotal`; 4 GiB where it cannot be
/// read).
pub(crate) fn affinity_fits(entries: usize, shards: usize) -> Result<(), String> {
    const UNKNOWN_MEMORY_CEILING: u64 = 4 << 30;
    let ceiling = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| shards::logic::system::procfs::status_kb(&t, "MemTotal"))
        .map_or(UNKNOWN_MEMORY_CEILING, |bytes| bytes / 4);
    match shards::logic::routing::affinity::table_bytes(entries, shards) {
        Some(bytes) if bytes <= ceiling => Ok(()),
        Some(bytes) => Err(format!(
            "--affinity-table-entries {entries}: the index would take {} MiB on {shards} shards, more than a quarter of this machine's memory ({} MiB)",
            bytes >> 20,
            ceiling >> 20
        )),
        None => Err(format!(
            "--affinity-table-entries {entries}: more than this machine can address"
        )),
    }
}

/// The shared state's check at start (issue 51 #8): a wrong password,
/// database or scheme, or another live router with this identity, stops
/// the start with one line, unless the operator said fail-open is
/// acceptable (`--shared-state-failure-mode open` given explicitly): then
/// it is said loudly and the router serves alone until Redis answers. An
/// evicting `maxmemory-policy` is said loudly.
pub(crate) fn shared_state_usable(
    checked: Result<
        shards::runtime::services::shared_state::preflight::Preflight,
        shards::runtime::services::shared_state::preflight::PreflightError,
    >,
    shown: &str,
    open_said: bool,
) -> Result<(), String> {
    match checked {
        Ok(p) => {
            for w in p.warnings {
                tracing::error!(redis = %shown, "--shared-state: {w}");
            }
            Ok(())
        }
        Err(e) if open_said => {
            tracing::error!(redis = %shown, "--shared-state: {}; starting anyway (--shared-state-failure-mode open): quotas per router until it answers", e.0);
            Ok(())
        }
        Err(e) => Err(format!(
            "--shared-state {shown}: {}; fix it, or give --shared-state-failure-mode open to start without it",
            e.0
        )),
    }
}
