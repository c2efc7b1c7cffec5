//! The Go router's flags that this router takes differently (issue 56:
//! "a Go router user's files start unchanged"). Each is either applied
//! (`--p2p-announce-addr`, `--p2p-max-conns-per-ip`, `--unhealthy-after`)
//! or, where the design makes it meaningless, accepted with one warning
//! naming what replaces it.

use std::net::IpAddr;

use shards::runtime::state::router::RouterConfig;
use tracing::warn;

use hivenet_router::cli;

/// The Go flags as given (`None`: not given).
#[derive(Default)]
pub(crate) struct GoFlags {
    pub(crate) grpc_port: Option<String>,
    pub(crate) p2p_announce_addr: Option<String>,
    pub(crate) p2p_max_conns_per_ip: Option<String>,
    pub(crate) queue_size: Option<String>,
    pub(crate) health_check_interval: Option<String>,
    pub(crate) unhealthy_after: Option<String>,
    pub(crate) max_concurrent: Option<String>,
    pub(crate) session_ttl: Option<String>,
    pub(crate) jwt_secret_file: Option<String>,
}

/// The address agents are told to dial, parsed from `--p2p-announce-addr`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Announce {
    /// As given.
    pub(crate) text: String,
    /// Its IP (`None`: a DNS name).
    pub(crate) ip: Option<IpAddr>,
}

/// Parse `/ip4/<ip>/tcp/<port>`, `/ip6/...` or `/dns{,4,6}/<name>/tcp/<port>`
/// (spec 06: an invalid multiaddr is fatal).
pub(crate) fn parse_announce(s: &str) -> Result<Announce, String> {
    let parts: Vec<&str> = s.split('/').filter(|p| !p.is_empty()).collect();
    let bad = || {
        format!("--p2p-announce-addr: {s:?} is not a multiaddr like /ip4/<ip>/tcp/<port> or /dns4/<name>/tcp/<port>")
    };
    if !s.starts_with('/') {
        return Err(bad());
    }
    let [proto, host, "tcp", port, rest @ ..] = parts.as_slice() else {
        return Err(bad());
    };
    if !matches!(port.parse::<u16>(), Ok(p) if p > 0) || !matches!(rest, [] | ["p2p", _]) {
        return Err(bad());
    }
    let ip = match *proto {
        "ip4" => Some(IpAddr::V4(host.parse().map_err(|_| bad())?)),
        "ip6" => Some(IpAddr::V6(host.parse().map_err(|_| bad())?)),
        "dns" | "dns4" | "dns6" if !host.is_empty() && host.len() <= 253 => None,
        _ => return Err(bad()),
    };
    Ok(Announce {
        text: s.to_string(),
        ip,
    })
}

/// A loopback bind while the announce address says agents dial from
/// elsewhere: no agent of another host could ever link (issue 56).
pub(crate) fn reachable_check(bind: IpAddr, announce: &Announce) -> Result<(), String> {
    let elsewhere = announce.ip.is_none_or(|ip| !ip.is_loopback());
    if bind.is_loopback() && elsewhere {
        return Err(format!(
            "--p2p-listen-addr {bind} is loopback while --p2p-announce-addr {} tells agents of other hosts to dial it: bind an address they can reach (0.0.0.0 or this host's)",
            announce.text
        ));
    }
    Ok(())
}

/// Apply the Go flags to `cfg`; returns the announce address.
pub(crate) fn apply(
    g: GoFlags,
    bind: IpAddr,
    cfg: &mut RouterConfig,
) -> Result<Option<Announce>, String> {
    let announce = match g.p2p_announce_addr.as_deref().map(str::trim) {
        Some("") | None => None,
        Some(s) => {
            let a = parse_announce(s)?;
            reachable_check(bind, &a)?;
            Some(a)
        }
    };
    if let Some(v) = cli::flag_or_env_opt(
        g.p2p_max_conns_per_ip,
        "HIVENET_ROUTER_P2P_MAX_CONNS_PER_IP",
    ) {
        cfg.max_agent_links_per_address = match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => {
                return Err(format!(
                    "--p2p-max-conns-per-ip: {v:?} must be an integer > 0"
                ))
            }
        };
    }
    if let Some(v) = g.unhealthy_after {
        let d = cli::parse_duration("--unhealthy-after", &v)?;
        if d.is_zero() || d >= cfg.remove_after {
            return Err(format!(
                "--unhealthy-after ({d:?}) must be greater than 0 and below --remove-after ({:?})",
                cfg.remove_after
            ));
        }
        if d < cfg.heartbeat_interval {
            return Err(format!(
                "--unhealthy-after ({d:?}) is shorter than --heartbeat-interval ({:?}): every agent would flap",
                cfg.heartbeat_interval
            ));
        }
        cfg.unhealthy_after = Some(d);
    }
    let checked = |flag: &str, v: &Option<String>, dur: bool| -> Result<(), String> {
        let Some(v) = v else { return Ok(()) };
        let ok = if dur {
            cli::parse_duration(flag, v).is_ok()
        } else {
            v.trim().parse::<u64>().is_ok()
        };
        if ok {
            Ok(())
        } else {
            Err(format!("{flag}: {v:?} is not a valid value"))
        }
    };
    checked("--queue-size", &g.queue_size, false)?;
    checked("--max-concurrent", &g.max_concurrent, false)?;
    checked("--health-check-interval", &g.health_check_interval, true)?;
    checked("--session-ttl", &g.session_ttl, true)?;
    let ignored = [
        ("--grpc-port", g.grpc_port.is_some(), "agents link over libp2p on --p2p-port"),
        ("--jwt-secret-file", g.jwt_secret_file.is_some(), "the libp2p swarm key (--swarm-key-file) and noise identities"),
        ("--session-ttl", g.session_ttl.is_some(), "links authenticated by noise for their lifetime (no sessions to renew)"),
        ("--queue-size", g.queue_size.is_some(), "no global channel: each shard takes its requests directly; --queue-depth bounds the waits"),
        ("--health-check-interval", g.health_check_interval.is_some(), "each link's heartbeats checked as they arrive (--unhealthy-after, --remove-after)"),
        ("--max-concurrent", g.max_concurrent.is_some(), "each agent's --capacity and --queue-depth per model bound the forwards"),
    ];
    for (flag, set, instead) in ignored {
        if set {
            warn!(
                flag,
                replaced_by = instead,
                "{flag} is a Go router flag with no use here; ignored (replaced by: {instead})"
            );
        }
    }
    Ok(announce)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announce_addresses_parse_or_fail_with_one_line() {
        assert_eq!(
            parse_announce("/ip4/10.0.0.5/tcp/9000").map(|a| a.ip),
            Ok(Some("10.0.0.5".parse().expect("ip")))
        );
        assert_eq!(
            parse_announce("/dns4/router.hivenet.svc/tcp/9000").map(|a| a.ip),
            Ok(None)
        );
        for bad in [
            "10.0.0.5:9000",
            "/ip4/10.0.0.5",
            "/ip4/x/tcp/9000",
            "/ip4/10.0.0.5/tcp/0",
            "/ip4/10.0.0.5/tcp/9000/quic",
        ] {
            assert!(parse_announce(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_loopback_bind_announced_elsewhere_is_refused() {
        let lo: IpAddr = "127.0.0.1".parse().expect("ip");
        let any: IpAddr = "0.0.0.0".parse().expect("ip");
        let far = parse_announce("/ip4/10.0.0.5/tcp/9000").expect("parse");
        let dns = parse_announce("/dns4/router/tcp/9000").expect("parse");
        let near = parse_announce("/ip4/127.0.0.1/tcp/9000").expect("parse");
        assert!(reachable_check(lo, &far).is_err());
        assert!(reachable_check(lo, &dns).is_err());
        assert!(reachable_check(lo, &near).is_ok());
        assert!(reachable_check(any, &far).is_ok());
    }
}
