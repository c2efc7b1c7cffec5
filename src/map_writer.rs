//! `hivenet-router map-writer --config sites.yaml`: keeps every site's
//! sibling map fresh (spec 07 §4). Each round it asks every site's admin
//! API which models have healthy agents (warm), then pushes the whole map
//! with a fresh `hints_generated_at` and a newer version to every site.
//! A site that cannot be reached is "unknown" (never "cold": only positive
//! evidence of cold keeps a request from being redirected); a push that
//! fails is retried next round without holding up the other sites. One
//! log line per change of warmth, not per poll.
//!
//! The config file:
//! ```yaml
//! interval: 5s                    # rounds (default 5s; hints stay fresh
//!                                 # while interval < --sibling-hints-max-age)
//! sites:
//!   - site_id: par1
//!     base_url: http://par1.example:8080   # where clients are redirected
//!     admin_url: http://10.0.0.1:8080      # optional: admin API (default base_url)
//!     admin_key_env: PAR1_ADMIN_KEY        # env var with its admin key (optional)
//!     scopes: [eu]
//! placements:
//!   - {site_id: par1, model: m, kind: chat, scale_from_zero: true, hold_budget: 4m}
//! ```

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde::Deserialize;
use shards::logic::sites::{self, Kind, MapDto, Placement, Site};
use tracing::{info, warn};

/// One site of the writer's file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SiteEntry {
    /// The site's id (`--site-id` of its routers).
    pub site_id: String,
    /// Public URL clients are redirected to.
    pub base_url: String,
    /// The admin API (default: `base_url`).
    #[serde(default)]
    pub admin_url: Option<String>,
    /// Environment variable holding the site's admin key.
    #[serde(default)]
    pub admin_key_env: Option<String>,
    /// Scopes.
    #[serde(default)]
    pub scopes: Vec<String>,
}

/// One placement of the writer's file (warmth is the writer's to find).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlacementEntry {
    /// Site.
    pub site_id: String,
    /// Model.
    pub model: String,
    /// Kind.
    pub kind: Kind,
    /// May be held there at zero replicas.
    #[serde(default)]
    pub scale_from_zero: bool,
    /// Hold budget (Go duration, (0, 1h]).
    #[serde(default)]
    pub hold_budget: Option<String>,
}

/// The writer's file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WriterConfig {
    /// Round period.
    #[serde(default)]
    pub interval: Option<String>,
    /// Sites.
    pub sites: Vec<SiteEntry>,
    /// Placements.
    #[serde(default)]
    pub placements: Vec<PlacementEntry>,
}

/// Parse and check the file: the map it describes must be one every site
/// accepts (so a typo fails here, not as 400s every round).
pub fn parse_config(text: &str) -> Result<(WriterConfig, Duration), String> {
    let cfg: WriterConfig = serde_saphyr::from_str(text).map_err(|e| format!("{e}"))?;
    let interval = match &cfg.interval {
        Some(s) => humantime::parse_duration(s).map_err(|e| format!("interval {s:?}: {e}"))?,
        None => Duration::from_secs(5),
    };
    if interval.is_zero() {
        return Err("interval must be > 0".into());
    }
    for s in &cfg.sites {
        let admin = s.admin_url.as_deref().unwrap_or(&s.base_url);
        if !admin.starts_with("http://") {
            return Err(format!(
                "site {}: the admin API is reached over plain http (admin_url {admin:?}); run the writer beside the routers or give an http admin_url",
                s.site_id
            ));
        }
    }
    for s in &cfg.sites {
        sites::validate(build(&cfg, &BTreeMap::new(), "0", 0), &s.site_id)?;
    }
    if cfg.sites.is_empty() {
        return Err("sites: at least one site is required".into());
    }
    Ok((cfg, interval))
}

/// The map for one round: `warm` says which (site, model) have healthy
/// agents (`None` for a site that did not answer: unknown).
pub fn build(
    cfg: &WriterConfig,
    warm: &BTreeMap<String, Option<Vec<String>>>,
    version: &str,
    now_unix: u64,
) -> MapDto {
    MapDto {
        version: version.to_string(),
        hints_generated_at: Some(shards::logic::system::timefmt::rfc3339_nanos(now_unix, 0)),
        sites: cfg
            .sites
            .iter()
            .map(|s| Site {
                site_id: s.site_id.clone(),
                base_url: s.base_url.clone(),
                scopes: s.scopes.clone(),
            })
            .collect(),
        placements: cfg
            .placements
            .iter()
            .map(|p| Placement {
                site_id: p.site_id.clone(),
                model: p.model.clone(),
                kind: p.kind,
                scale_from_zero: p.scale_from_zero,
                hold_budget: p.hold_budget.clone(),
                warm: warm
                    .get(&p.site_id)
                    .and_then(|w| w.as_ref())
                    .map(|models| models.contains(&p.model)),
            })
            .collect(),
    }
}

/// A plain-http request with a bearer key; (status, body).
fn http(
    url: &str,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: &[u8],
) -> Result<(u16, Vec<u8>), String> {
    let rest = url.strip_prefix("http://").ok_or("not an http URL")?;
    let (hostport, base_path) = match rest.split_once('/') {
        Some((h, p)) => (h, format!("/{}", p.trim_end_matches('/'))),
        None => (rest, String::new()),
    };
    let addr = if hostport.contains(':') {
        hostport.to_string()
    } else {
        format!("{hostport}:80")
    };
    let sock = std::net::ToSocketAddrs::to_socket_addrs(&addr)
        .map_err(|e| format!("{addr}: {e}"))?
        .next()
        .ok_or_else(|| format!("{addr}: no address"))?;
    let mut s = TcpStream::connect_timeout(&sock, Duration::from_secs(2))
        .map_err(|e| format!("{addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(3))).ok();
    s.set_write_timeout(Some(Duration::from_secs(3))).ok();
    let auth = key
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    let head = format!(
        "{method} {base_path}{path} HTTP/1.1\r\nHost: {hostport}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())
        .and_then(|()| s.write_all(body))
        .map_err(|e| format!("{addr}: {e}"))?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)
        .map_err(|e| format!("{addr}: {e}"))?;
    let text_end = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| format!("{addr}: no response head"))?;
    let status = out
        .get(9..12)
        .and_then(|b| std::str::from_utf8(b).ok())
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("{addr}: bad status line"))?;
    let head = String::from_utf8_lossy(out.get(..text_end).unwrap_or(&[])).to_ascii_lowercase();
    let mut body = out.get(text_end + 4..).unwrap_or(&[]).to_vec();
    if head.contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    Ok((status, body))
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let n = std::str::from_utf8(b.get(..eol).unwrap_or(&[]))
            .ok()
            .and_then(|s| usize::from_str_radix(s.trim(), 16).ok())
            .unwrap_or(0);
        if n == 0 {
            return out;
        }
        out.extend_from_slice(b.get(eol + 2..eol + 2 + n).unwrap_or(&[]));
        b = b.get(eol + 4 + n..).unwrap_or(&[]);
    }
}

/// Models with at least one healthy agent at a site (`None`: unreachable).
fn poll(site: &SiteEntry) -> Option<Vec<String>> {
    let url = site.admin_url.as_deref().unwrap_or(&site.base_url);
    let key = site
        .admin_key_env
        .as_deref()
        .and_then(|v| std::env::var(v).ok());
    match http(url, "GET", "/admin/models", key.as_deref(), b"") {
        Ok((200, body)) => {
            let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
            Some(
                v["data"]
                    .as_array()?
                    .iter()
                    .filter(|m| m["agents"]["healthy"].as_u64().unwrap_or(0) > 0)
                    .filter_map(|m| m["id"].as_str().map(str::to_string))
                    .collect(),
            )
        }
        Ok((st, _)) => {
            warn!(site = %site.site_id, status = st, "map-writer: admin API refused the poll");
            None
        }
        Err(_) => None,
    }
}

/// Run the writer until killed.
pub fn run(args: &[String]) -> Result<(), String> {
    let mut path = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--config" => path = it.next().cloned(),
            s if s.starts_with("--config=") => path = Some(s["--config=".len()..].to_string()),
            "-h" | "--help" => {
                return Err("usage: hivenet-router map-writer --config sites.yaml".into())
            }
            other => return Err(format!("map-writer: unknown argument {other:?}")),
        }
    }
    let path = path.ok_or("usage: hivenet-router map-writer --config sites.yaml")?;
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    let (cfg, interval) = parse_config(&text).map_err(|e| format!("{path}: {e}"))?;
    info!(sites = cfg.sites.len(), placements = cfg.placements.len(), interval = ?interval, "map-writer starting");
    let mut last_version = String::new();
    let mut last_warm: BTreeMap<String, Option<Vec<String>>> = BTreeMap::new();
    let mut pushed_ok: BTreeMap<String, bool> = BTreeMap::new();
    loop {
        let started = std::time::Instant::now();
        let warm: BTreeMap<String, Option<Vec<String>>> = std::thread::scope(|s| {
            let hs: Vec<_> = cfg
                .sites
                .iter()
                .map(|site| (site.site_id.clone(), s.spawn(move || poll(site))))
                .collect();
            hs.into_iter()
                .map(|(id, h)| (id, h.join().ok().flatten()))
                .collect()
        });
        for (site, now) in &warm {
            let before = last_warm.get(site);
            if before != Some(now) {
                match now {
                    Some(models) => {
                        info!(site = %site, warm = ?models, "map-writer: warmth changed")
                    }
                    None => {
                        warn!(site = %site, "map-writer: site unreachable; its models are unknown (not cold)")
                    }
                }
            }
        }
        last_warm.clone_from(&warm);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let mut version =
            shards::logic::system::timefmt::rfc3339_nanos(now.as_secs(), now.subsec_nanos());
        if version <= last_version {
            // The clock did not move (or went back): stay ahead of the last.
            version = format!("{last_version}+");
        }
        last_version.clone_from(&version);
        let body = serde_json::to_vec(&build(&cfg, &warm, &version, now.as_secs()))
            .map_err(|e| e.to_string())?;
        let results: Vec<(String, Result<u16, String>)> = std::thread::scope(|s| {
            let hs: Vec<_> = cfg
                .sites
                .iter()
                .map(|site| {
                    let body = &body;
                    (
                        site.site_id.clone(),
                        s.spawn(move || {
                            let url = site.admin_url.as_deref().unwrap_or(&site.base_url);
                            let key = site
                                .admin_key_env
                                .as_deref()
                                .and_then(|v| std::env::var(v).ok());
                            http(url, "PUT", "/admin/sibling-map", key.as_deref(), body)
                                .map(|(st, _)| st)
                        }),
                    )
                })
                .collect();
            hs.into_iter()
                .map(|(id, h)| (id, h.join().unwrap_or_else(|_| Err("panicked".into()))))
                .collect()
        });
        for (site, r) in results {
            let ok = matches!(r, Ok(200));
            if pushed_ok.insert(site.clone(), ok) != Some(ok) {
                match r {
                    Ok(200) => info!(site = %site, version = %version, "map-writer: map pushed"),
                    Ok(st) => {
                        warn!(site = %site, status = st, "map-writer: push refused; retrying next round")
                    }
                    Err(e) => {
                        warn!(site = %site, "map-writer: push failed ({e}); retrying next round")
                    }
                }
            }
        }
        std::thread::sleep(interval.saturating_sub(started.elapsed()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "interval: 1s\nsites:\n  - {site_id: a, base_url: \"http://127.0.0.1:1\"}\n  - {site_id: b, base_url: \"http://127.0.0.1:2\", scopes: [eu]}\nplacements:\n  - {site_id: a, model: m, kind: chat, scale_from_zero: true, hold_budget: 4m}\n  - {site_id: b, model: m, kind: chat}\n";

    #[test]
    fn warmth_is_known_only_from_an_answer() {
        let (cfg, interval) = parse_config(FILE).expect("config");
        assert_eq!(interval, Duration::from_secs(1));
        let mut warm = BTreeMap::new();
        warm.insert("a".to_string(), Some(vec![]));
        warm.insert("b".to_string(), None);
        let m = build(&cfg, &warm, "v1", 0);
        assert_eq!(
            m.placements[0].warm,
            Some(false),
            "answered without m: cold"
        );
        assert_eq!(m.placements[1].warm, None, "unreachable: unknown, not cold");
        warm.insert("b".to_string(), Some(vec!["m".to_string()]));
        assert_eq!(build(&cfg, &warm, "v2", 0).placements[1].warm, Some(true));
        for local in ["a", "b"] {
            assert!(sites::validate(m.clone(), local).is_ok());
        }
    }

    #[test]
    fn a_bad_file_fails_at_start() {
        for (bad, want) in [
            (FILE.replace("4m", "2h"), "hold_budget"),
            (
                FILE.replace("site_id: b, model", "site_id: z, model"),
                "not a listed site",
            ),
            (
                FILE.replace("http://127.0.0.1:2", "https://x"),
                "plain http",
            ),
            (FILE.replace("interval: 1s", "interval: 0s"), "interval"),
            (FILE.replace("scopes", "scope"), "unknown field"),
        ] {
            let e = parse_config(&bad).expect_err(want);
            assert!(e.contains(want), "{want}: {e}");
        }
    }
}
