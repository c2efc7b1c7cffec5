//! Flag helpers: `--flag=value` normalisation (argh wants `--flag value`),
//! environment fallbacks, listen-address and duration parsing, logging.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// Split `--flag=value` into `--flag value` so both spellings work.
pub fn normalize_args(args: impl Iterator<Item = String>) -> Vec<String> {
    let mut out = Vec::new();
    for a in args {
        if a.starts_with("--") {
            if let Some((k, v)) = a.split_once('=') {
                // Go's boolean flags take `=true` / `=false` (a Go user's
                // unit file may say `--reset-disk-db=false`).
                if BOOL_SWITCHES.contains(&k) {
                    match v {
                        "true" | "1" => out.push(k.to_string()),
                        "false" | "0" => {}
                        _ => out.push(a.clone()),
                    }
                    continue;
                }
                out.push(k.to_string());
                out.push(v.to_string());
                continue;
            }
        }
        out.push(a);
    }
    out
}

/// The switches of both binaries (flags without a value).
const BOOL_SWITCHES: [&str; 5] = [
    "--reset-disk-db",
    "--no-pin",
    "--allow-open-p2p",
    "--shared-state-affinity",
    "--hide-llm",
];

/// Parse the command line into `T`, exiting with argh's message on error.
pub fn parse_args<T: argh::FromArgs + argh::TopLevelCommand>() -> T {
    let args = normalize_args(std::env::args());
    let cmd = args.first().cloned().unwrap_or_default();
    let rest: Vec<&str> = args.iter().skip(1).map(String::as_str).collect();
    match T::from_args(&[cmd.as_str()], &rest) {
        Ok(t) => t,
        Err(e) => {
            if e.status.is_ok() {
                println!("{}", e.output);
                std::process::exit(0);
            }
            eprintln!("{}", e.output.trim_end());
            std::process::exit(2);
        }
    }
}

/// Flag value, else a non-empty environment variable.
pub fn flag_or_env_opt(flag: Option<String>, env: &str) -> Option<String> {
    flag.or_else(|| std::env::var(env).ok().filter(|v| !v.is_empty()))
}

/// Flag value, else environment variable, else default.
pub fn flag_or_env(flag: Option<String>, env: &str, default: &str) -> String {
    flag_or_env_opt(flag, env).unwrap_or_else(|| default.to_string())
}

/// Parse a listen address: `:8080`, `8080`, `127.0.0.1:8080`, `[::1]:8080`.
pub fn parse_listen(s: &str) -> Result<SocketAddr, String> {
    let s = s.trim();
    if let Some(port) = s.strip_prefix(':') {
        let p: u16 = port.parse().map_err(|_| format!("invalid port in {s:?}"))?;
        return Ok(SocketAddr::from(([0, 0, 0, 0], p)));
    }
    if let Ok(p) = s.parse::<u16>() {
        return Ok(SocketAddr::from(([0, 0, 0, 0], p)));
    }
    s.parse::<SocketAddr>()
        .map_err(|_| format!("invalid listen address {s:?}"))
}

/// Parse an IP literal.
pub fn parse_ip(s: &str) -> Result<IpAddr, String> {
    s.trim()
        .parse()
        .map_err(|_| format!("invalid IP address {s:?}"))
}

/// Parse a humantime duration such as `30s` or `1m`.
pub fn parse_duration(name: &str, s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s.trim())
        .map_err(|e| format!("{name}: invalid duration {s:?}: {e}"))?;
    if d > MAX_DURATION {
        return Err(format!(
            "{name}: {s:?} is longer than the longest accepted duration, 7 days"
        ));
    }
    Ok(d)
}

/// Longest duration any flag accepts: every deadline and period the
/// router and agent compute from them stays far from overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(7 * 24 * 3600);

/// Set up `tracing` from `RUST_LOG`, or from the spec's `GOLOG_LOG_LEVEL`
/// (`router=debug,metrics=debug`) mapped onto our targets.
pub fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.is_empty() => v,
        _ => match std::env::var("GOLOG_LOG_LEVEL") {
            Ok(v) if !v.is_empty() => map_golog(&v),
            _ => "info".to_string(),
        },
    };
    use std::io::IsTerminal;
    if json_logs(std::env::var("GOLOG_LOG_FMT").ok().as_deref()) {
        // One JSON object per line (spec 06 `GOLOG_LOG_FMT=json`): the same
        // fields as the text lines, under `fields`, with level and time.
        let _ = tracing_subscriber::fmt()
            .json()
            .with_env_filter(EnvFilter::new(filter))
            .with_target(false)
            .with_current_span(false)
            .try_init();
        return;
    }
    let _ = tracing_subscriber::fmt()
        .with_ansi(std::io::stdout().is_terminal())
        .with_env_filter(EnvFilter::new(filter))
        .with_target(false)
        .try_init();
}

/// The OTLP trace export the standard variables ask for (spec 06:
/// `OTEL_EXPORTER_OTLP_ENDPOINT` turns tracing on), started; `Ok(None)`:
/// off. A bad value is an error at start, not a silent default.
pub fn trace_export(
    service: &str,
) -> Result<Option<std::sync::Arc<shards::runtime::services::otlp::TraceExport>>, String> {
    use shards::runtime::services::otlp::{ExportCfg, TraceExport};
    let Some(cfg) = ExportCfg::from_env(service, env!("CARGO_PKG_VERSION"))? else {
        return Ok(None);
    };
    let (collector, path, sampler) = (
        cfg.target.authority.clone(),
        cfg.target.path.clone(),
        cfg.sampler,
    );
    let export = TraceExport::start(cfg).map_err(|e| format!("OTLP export thread: {e}"))?;
    tracing::info!(%collector, %path, ?sampler, "OTLP trace export on");
    Ok(Some(export))
}

/// Whether `GOLOG_LOG_FMT` asks for JSON lines (case-insensitive).
pub fn json_logs(v: Option<&str>) -> bool {
    v.is_some_and(|v| v.trim().eq_ignore_ascii_case("json"))
}

/// Map Go subsystem levels onto our module targets.
pub fn map_golog(v: &str) -> String {
    let mut parts = vec!["info".to_string()];
    for item in v.split(',') {
        let (sys, level) = match item.split_once('=') {
            Some((s, l)) => (s.trim(), l.trim()),
            None => ("", item.trim()),
        };
        let targets: &[&str] = match sys {
            "" => &[""],
            "router" => &[
                "router",
                "shards::runtime::request::dispatch",
                "shards::runtime::front::agent_link",
                "shards::runtime::state::shard",
            ],
            "metrics" => &["metrics", "shards::runtime::metrics"],
            "api" => &["shards::runtime::front::ingress"],
            "p2p" => &["shards::runtime::wire::link"],
            "agent" => &["hivenet_agent"],
            other => {
                parts.push(format!("{other}={level}"));
                continue;
            }
        };
        for t in targets {
            if t.is_empty() {
                parts.push(level.to_string());
            } else {
                parts.push(format!("{t}={level}"));
            }
        }
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_bounded() {
        assert_eq!(parse_duration("--x", "7days").expect("max"), MAX_DURATION);
        let e = parse_duration("--request-timeout", "18446744073709551615s").expect_err("huge");
        assert!(e.starts_with("--request-timeout:"), "{e}");
        assert!(parse_duration("--x", "8days").is_err());
        assert!(parse_duration("--x", "soon").is_err());
    }

    #[test]
    fn listen_forms() {
        assert_eq!(parse_listen(":8080").expect("ok").port(), 8080);
        assert_eq!(
            parse_listen("127.0.0.1:1").expect("ok").to_string(),
            "127.0.0.1:1"
        );
        assert!(parse_listen("nope").is_err());
    }

    #[test]
    fn equals_form() {
        let v = normalize_args(["x", "--a=b", "--c", "d"].iter().map(|s| s.to_string()));
        assert_eq!(v, vec!["x", "--a", "b", "--c", "d"]);
        // Go's booleans: `=true` is the switch, `=false` its absence.
        let v = normalize_args(
            ["x", "--reset-disk-db=false", "--hide-llm=true", "--a=true"]
                .iter()
                .map(|s| s.to_string()),
        );
        assert_eq!(v, vec!["x", "--hide-llm", "--a", "true"]);
    }

    #[test]
    fn golog_mapping() {
        let m = map_golog("router=debug,metrics=debug");
        assert!(m.contains("router=debug"));
        assert!(m.contains("shards::runtime::request::dispatch=debug"));
    }
}
