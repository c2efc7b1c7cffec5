//! OTLP trace export (issue 53): spans go from the shards (and the
//! agent's request tasks) over a bounded channel to one thread that
//! batches them and POSTs them as OTLP/HTTP protobuf to the collector.
//! A sender never waits: when the queue is full the spans are dropped and
//! counted; when the collector is down, slow or refuses, the batch is
//! dropped and counted after one bounded try; nothing else changes.
//!
//! Configured by the standard variables: `OTEL_EXPORTER_OTLP_ENDPOINT`
//! (`/v1/traces` appended) or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (as
//! is), `OTEL_EXPORTER_OTLP_PROTOCOL` / `_TRACES_PROTOCOL` (only
//! `http/protobuf`), `OTEL_EXPORTER_OTLP_HEADERS` / `_TRACES_HEADERS`,
//! `OTEL_EXPORTER_OTLP_TIMEOUT` / `_TRACES_TIMEOUT` (ms), `OTEL_SERVICE_NAME`,
//! `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_SDK_DISABLED`, `OTEL_TRACES_SAMPLER`
//! and `_ARG`, `OTEL_BSP_SCHEDULE_DELAY`, `OTEL_BSP_MAX_QUEUE_SIZE`,
//! `OTEL_BSP_MAX_EXPORT_BATCH_SIZE`; and `HIVENET_TRACES_KEEP_SLOWER_THAN_MS`.
//!
//! Key items: [`TraceExport`], [`TraceExport::from_env`].

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::logic::system::config_error::ConfigError;
use crate::logic::trace::otlp::{encode, Resource};
use crate::logic::trace::sampler::Sampler;
use crate::logic::trace::span::{Span, Value};

/// Where the batches go.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// `host:port`.
    pub authority: String,
    /// The request path (`/v1/traces`).
    pub path: String,
    /// Extra headers (`OTEL_EXPORTER_OTLP_HEADERS`).
    pub headers: Vec<(String, String)>,
    /// One export's time limit.
    pub timeout: Duration,
}

/// What the export thread is told.
#[derive(Debug, Clone)]
pub struct ExportCfg {
    /// The collector.
    pub target: Target,
    /// The process.
    pub resource: Resource,
    /// Which traces are kept.
    pub sampler: Sampler,
    /// Longest wait before a partial batch goes.
    pub delay: Duration,
    /// Requests' span lists queued at most.
    pub queue: usize,
    /// Spans per export at most.
    pub batch: usize,
}

/// The shards' handle on the export thread.
pub struct TraceExport {
    tx: SyncSender<Vec<Span>>,
    /// Which traces are kept.
    pub sampler: Sampler,
    /// Spans the collector accepted.
    pub exported: AtomicU64,
    /// Spans dropped because the queue was full.
    pub dropped_queue_full: AtomicU64,
    /// Spans dropped because their export failed (collector down, slow
    /// or refusing).
    pub dropped_export_failed: AtomicU64,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// `k=v,k2=v2` (W3C baggage-like, values percent-decoded minimally).
fn pairs(v: &str) -> Vec<(String, String)> {
    v.split(',')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().replace("%20", " ")))
        .filter(|(k, _)| !k.is_empty())
        .collect()
}

/// The collector's address from a URL: `http://host[:port][/path]`.
pub fn target_of(url: &str, append: bool) -> Result<(String, String), ConfigError> {
    let url = url.trim();
    let rest = match url.split_once("://") {
        Some(("http", rest)) => rest,
        Some(("https", _)) => {
            return Err(ConfigError::new(format!(
                "{url}: https OTLP endpoints are not supported; export to a collector over http (a local OpenTelemetry Collector can forward with TLS)"
            )))
        }
        _ => return Err(ConfigError::new(format!("{url}: an http:// URL is expected"))),
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    if authority.is_empty() {
        return Err(ConfigError::new(format!("{url}: no host")));
    }
    let authority = if authority.contains(':') && !authority.ends_with(']') {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    let path = if append {
        format!("{}/v1/traces", path.trim_end_matches('/'))
    } else if path.is_empty() {
        "/".to_string()
    } else {
        path.to_string()
    };
    Ok((authority, path))
}

impl ExportCfg {
    /// From the standard variables: `Ok(None)` when no endpoint is set
    /// (tracing off) or `OTEL_SDK_DISABLED=true`; `Err` names a bad value.
    pub fn from_env(
        default_service: &str,
        version: &'static str,
    ) -> Result<Option<Self>, ConfigError> {
        if env("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        let (url, append) = match (
            env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
            env("OTEL_EXPORTER_OTLP_ENDPOINT"),
        ) {
            (Some(u), _) => (u, false),
            (None, Some(u)) => (u, true),
            (None, None) => return Ok(None),
        };
        let protocol = env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            .or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"))
            .unwrap_or_else(|| "http/protobuf".into());
        if protocol.trim() != "http/protobuf" {
            return Err(ConfigError::new(format!(
                "OTEL_EXPORTER_OTLP_PROTOCOL={protocol:?}: only http/protobuf is supported (no gRPC in this build)"
            )));
        }
        let (authority, path) = target_of(&url, append)?;
        let mut headers = env("OTEL_EXPORTER_OTLP_HEADERS")
            .map(|v| pairs(&v))
            .unwrap_or_default();
        headers.extend(
            env("OTEL_EXPORTER_OTLP_TRACES_HEADERS")
                .map(|v| pairs(&v))
                .unwrap_or_default(),
        );
        let ms = |name: &str, default: u64| -> Result<u64, ConfigError> {
            match env(name) {
                None => Ok(default),
                Some(v) => v.trim().parse().map_err(|_| {
                    ConfigError::new(format!("{name}={v:?}: a whole number is expected"))
                }),
            }
        };
        let timeout = ms(
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
            ms("OTEL_EXPORTER_OTLP_TIMEOUT", 10_000)?,
        )?;
        let sampler = Sampler::parse(
            env("OTEL_TRACES_SAMPLER").as_deref(),
            env("OTEL_TRACES_SAMPLER_ARG").as_deref(),
            env("HIVENET_TRACES_KEEP_SLOWER_THAN_MS").as_deref(),
        )?;
        let service = env("OTEL_SERVICE_NAME").unwrap_or_else(|| default_service.to_string());
        let mut attrs: Vec<(&'static str, Value)> = vec![
            ("service.name", service.into()),
            ("service.version", version.into()),
            ("telemetry.sdk.name", "hivenet".into()),
            ("telemetry.sdk.language", "rust".into()),
        ];
        // OTEL_RESOURCE_ATTRIBUTES: keys must be 'static: leaked once at
        // start (a handful of short strings for the process's life).
        for (k, v) in env("OTEL_RESOURCE_ATTRIBUTES")
            .map(|v| pairs(&v))
            .unwrap_or_default()
        {
            if k == "service.name" {
                continue;
            }
            attrs.push((Box::leak(k.into_boxed_str()), v.into()));
        }
        Ok(Some(ExportCfg {
            target: Target {
                authority,
                path,
                headers,
                timeout: Duration::from_millis(timeout.clamp(100, 60_000)),
            },
            resource: Resource {
                attrs,
                scope: "hivenet",
                version,
            },
            sampler,
            delay: Duration::from_millis(ms("OTEL_BSP_SCHEDULE_DELAY", 5_000)?.clamp(10, 60_000)),
            queue: usize::try_from(ms("OTEL_BSP_MAX_QUEUE_SIZE", 2_048)?.clamp(1, 1 << 20))
                .unwrap_or(2_048),
            batch: usize::try_from(ms("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)?.clamp(1, 1 << 16))
                .unwrap_or(512),
        }))
    }
}

impl TraceExport {
    /// Start the export thread for `cfg`.
    pub fn start(cfg: ExportCfg) -> std::io::Result<Arc<Self>> {
        let (tx, rx) = sync_channel(cfg.queue);
        let me = Arc::new(TraceExport {
            tx,
            sampler: cfg.sampler,
            exported: AtomicU64::new(0),
            dropped_queue_full: AtomicU64::new(0),
            dropped_export_failed: AtomicU64::new(0),
        });
        let stats = me.clone();
        std::thread::Builder::new()
            .name("otlp-export".into())
            .spawn(move || run(&cfg, &rx, &stats))?;
        Ok(me)
    }

    /// Hand one request's spans over (never waits).
    pub fn send(&self, spans: Vec<Span>) {
        let n = spans.len() as u64;
        match self.tx.try_send(spans) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped_queue_full.fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    /// The export counters' families.
    pub fn render(&self, o: &mut String) {
        use crate::runtime::wire::exposition::{Family, Kind::Counter};
        let mut f = Family::new(
            o,
            "hivenet_trace_spans_exported_total",
            Counter,
            "Spans the OTLP collector accepted.",
            [],
        );
        f.series([], self.exported.load(Ordering::Relaxed));
        let mut f = Family::new(
            o,
            "hivenet_trace_spans_dropped_total",
            Counter,
            "Spans dropped: queue_full (the export thread fell behind), export_failed (the collector was down, slow or refused the batch).",
            ["reason"],
        );
        f.series(
            [&"queue_full"],
            self.dropped_queue_full.load(Ordering::Relaxed),
        );
        f.series(
            [&"export_failed"],
            self.dropped_export_failed.load(Ordering::Relaxed),
        );
    }
}

/// How often the export thread looks at the queue. It sleeps between
/// looks rather than waiting on the channel, so a shard's send never has
/// a sleeping receiver to wake: no system call per request (measured:
/// waking it for every request cost the router ~15 us a request).
const TICK: Duration = Duration::from_millis(20);

fn run(cfg: &ExportCfg, rx: &Receiver<Vec<Span>>, stats: &TraceExport) {
    let mut batch: Vec<Span> = Vec::with_capacity(cfg.batch);
    let mut body = Vec::with_capacity(64 * 1024);
    let mut since = Instant::now();
    let mut warned = false;
    loop {
        std::thread::sleep(TICK.min(cfg.delay));
        let gone = loop {
            match rx.try_recv() {
                Ok(spans) => batch.extend(spans),
                Err(TryRecvError::Empty) => break false,
                Err(TryRecvError::Disconnected) => break true,
            }
        };
        let late = since.elapsed() >= cfg.delay || gone;
        // Full batches go at once, the rest when the delay is up.
        while batch.len() >= cfg.batch || (late && !batch.is_empty()) {
            let n = batch.len().min(cfg.batch);
            body.clear();
            encode(&cfg.resource, batch.get(..n).unwrap_or(&[]), &mut body);
            batch.drain(..n);
            match post(&cfg.target, &body) {
                Ok(()) => {
                    stats.exported.fetch_add(n as u64, Ordering::Relaxed);
                    warned = false;
                }
                Err(e) => {
                    stats
                        .dropped_export_failed
                        .fetch_add(n as u64, Ordering::Relaxed);
                    if !warned {
                        tracing::warn!(collector = %cfg.target.authority, error = %e, "OTLP export failed: spans dropped (said once until an export succeeds)");
                        warned = true;
                    }
                }
            }
        }
        if late {
            since = Instant::now();
        }
        if gone {
            return;
        }
    }
}

/// One POST, bounded by the target's timeout; `Ok` on a 2xx answer.
fn post(t: &Target, body: &[u8]) -> std::io::Result<()> {
    let deadline = Instant::now() + t.timeout;
    let addr = t
        .authority
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::other("no address"))?;
    let mut s = TcpStream::connect_timeout(&addr, t.timeout)?;
    let _ = s.set_nodelay(true);
    let mut head = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/x-protobuf\r\nContent-Length: {}\r\nConnection: close\r\n",
        t.path,
        t.authority,
        body.len()
    );
    for (k, v) in &t.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let left = |d: Instant| {
        d.saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    s.set_write_timeout(Some(left(deadline)))?;
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    let mut got = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        s.set_read_timeout(Some(left(deadline)))?;
        let n = s.read(&mut buf)?;
        if n == 0 {
            return Err(std::io::Error::other(
                "the collector closed without an answer",
            ));
        }
        got.extend_from_slice(buf.get(..n).unwrap_or(&[]));
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut r = httparse::Response::new(&mut headers);
        match r.parse(&got) {
            Ok(httparse::Status::Complete(_)) => {
                let code = r.code.unwrap_or(0);
                return if (200..300).contains(&code) {
                    Ok(())
                } else {
                    Err(std::io::Error::other(format!(
                        "the collector answered {code}"
                    )))
                };
            }
            Ok(httparse::Status::Partial) if got.len() < 64 * 1024 => continue,
            _ => {
                return Err(std::io::Error::other(
                    "unreadable answer from the collector",
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_read_as_the_standard_says() {
        assert_eq!(
            target_of("http://127.0.0.1:4318", true),
            Ok(("127.0.0.1:4318".into(), "/v1/traces".into()))
        );
        assert_eq!(
            target_of("http://collector/otlp/", true),
            Ok(("collector:80".into(), "/otlp/v1/traces".into()))
        );
        assert_eq!(
            target_of("http://c:4318/custom", false),
            Ok(("c:4318".into(), "/custom".into()))
        );
        assert!(target_of("https://c:4318", true)
            .expect_err("refused")
            .message()
            .contains("https"));
        assert!(target_of("c:4318", true).is_err());
        assert_eq!(
            pairs("api-key=abc, x = y%20z,bad"),
            vec![("api-key".into(), "abc".into()), ("x".into(), "y z".into())]
        );
    }
}
