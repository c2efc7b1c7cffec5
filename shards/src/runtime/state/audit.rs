//! The audit log (spec 06 §5): one JSON line per request, written off the
//! request path by its own thread. Shards hand a plain record over a
//! bounded channel and never wait: when the writer falls behind (slow or
//! full disk) records are dropped and counted, and write errors are
//! counted, so serving never stalls on the log. The raw key never
//! reaches it: tenant and key ID only.
//!
//! Key types: [`AuditLog`] (the shards' handle), [`AuditRecord`].

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;

use serde::Serialize;

use crate::logic::system::timefmt;

/// Records buffered between the shards and the writer.
pub const AUDIT_QUEUE: usize = 65_536;

/// One request, as the audit line shows it.
#[derive(Debug, Clone, Default)]
pub struct AuditRecord {
    /// Request start, Unix seconds and nanoseconds (UTC).
    pub started: (u64, u32),
    /// `X-Request-ID`.
    pub request_id: crate::logic::http::request_id::RequestId,
    /// Tenant (`default` without auth, empty before authentication).
    pub tenant_id: Arc<str>,
    /// Key ID (`anonymous` without auth).
    pub key_id: Arc<str>,
    /// Model (resolved).
    pub model: String,
    /// Logical status: 499 when the client went away, the error's status
    /// when a stream was cut after its 200 head.
    pub status: u16,
    /// Whole request, milliseconds.
    pub latency_ms: u64,
    /// Tokens in (response usage).
    pub input_tokens: u64,
    /// Tokens out.
    pub output_tokens: u64,
    /// Agent's peer ID (empty when none was reached).
    pub agent_id: String,
    /// Error code (empty on success).
    pub error_code: &'static str,
    /// Client address.
    pub source_ip: String,
    /// Method and path.
    pub method: String,
    /// Path without query.
    pub path: String,
    /// W3C trace ID, lower-case hex (all zero: none).
    pub trace_id: [u8; 32],
}

#[derive(Serialize)]
struct Line<'a> {
    log_type: &'static str,
    level: &'static str,
    ts: String,
    request_id: &'a str,
    tenant_id: &'a str,
    key_id: &'a str,
    model: &'a str,
    method: &'a str,
    path: &'a str,
    status_code: u16,
    latency_ms: u64,
    input_tokens: u64,
    output_tokens: u64,
    agent_id: &'a str,
    error_code: &'a str,
    source_ip: &'a str,
    trace_id: &'a str,
}

/// Unix time of a request that started `elapsed` ago.
pub fn started_at(elapsed: std::time::Duration) -> (u64, u32) {
    let (secs, nanos) = crate::runtime::wire::clock::unix_nanos();
    let now = std::time::Duration::new(secs, nanos);
    let t = now.saturating_sub(elapsed);
    (t.as_secs(), t.subsec_nanos())
}

/// The trace ID of a request for its record (all zero: none).
pub fn trace_id_of(t: Option<&crate::logic::http::trace_context::Trace>) -> [u8; 32] {
    let mut out = [0u8; 32];
    if let Some(id) = t.map(|t| t.trace_id()).filter(|id| id.len() == 32) {
        out.copy_from_slice(id);
    }
    out
}

/// The error code of a status without a domain code (spec 06 §5).
pub fn code_of_status(status: u16) -> &'static str {
    match status {
        0..=399 => "",
        400 => "request_invalid",
        401 => "unauthorized",
        403 => "model_forbidden",
        404 => "model_not_found",
        429 => "rate_limit_exceeded",
        499 => "client_closed_request",
        503 => "no_agents_available",
        504 => "request_timeout",
        _ => "backend_error",
    }
}

/// Serialise one record (the writer thread does this, not the shards).
pub fn render(r: &AuditRecord) -> String {
    let line = Line {
        log_type: "audit",
        level: if r.status < 400 { "info" } else { "error" },
        ts: timefmt::rfc3339_nanos(r.started.0, r.started.1),
        request_id: r.request_id.as_str(),
        tenant_id: &r.tenant_id,
        key_id: &r.key_id,
        model: &r.model,
        method: &r.method,
        path: &r.path,
        status_code: r.status,
        latency_ms: r.latency_ms,
        input_tokens: r.input_tokens,
        output_tokens: r.output_tokens,
        agent_id: &r.agent_id,
        error_code: if r.error_code.is_empty() {
            code_of_status(r.status)
        } else {
            r.error_code
        },
        source_ip: &r.source_ip,
        trace_id: if r.trace_id == [0; 32] {
            ""
        } else {
            std::str::from_utf8(&r.trace_id).unwrap_or("")
        },
    };
    serde_json::to_string(&line).unwrap_or_default()
}

/// The shards' handle on the audit writer.
#[derive(Debug)]
pub struct AuditLog {
    tx: SyncSender<AuditRecord>,
    /// Records dropped because the writer was behind.
    pub dropped: AtomicU64,
    /// Failed writes (shared with the writer thread).
    pub write_errors: Arc<AtomicU64>,
    /// Lines written.
    pub written: Arc<AtomicU64>,
}

impl AuditLog {
    /// Open `path` for appending (directory created 0755, file 0644) and
    /// start the writer thread.
    pub fn start(path: &Path) -> std::io::Result<(Arc<AuditLog>, std::thread::JoinHandle<()>)> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        let (tx, rx) = sync_channel(AUDIT_QUEUE);
        let write_errors = Arc::new(AtomicU64::new(0));
        let written = Arc::new(AtomicU64::new(0));
        let (e, w) = (write_errors.clone(), written.clone());
        let handle = std::thread::Builder::new()
            .name("audit".into())
            .spawn(move || writer(file, rx, &e, &w))?;
        Ok((
            Arc::new(AuditLog {
                tx,
                dropped: AtomicU64::new(0),
                write_errors,
                written,
            }),
            handle,
        ))
    }

    /// Hand one record to the writer; never blocks.
    pub fn send(&self, r: AuditRecord) {
        match self.tx.try_send(r) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Write records as they come, one flush per batch; ends when every
/// sender is gone (shutdown).
fn writer(file: std::fs::File, rx: Receiver<AuditRecord>, errors: &AtomicU64, written: &AtomicU64) {
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, file);
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while let Ok(more) = rx.try_recv() {
            batch.push(more);
            if batch.len() >= 1024 {
                break;
            }
        }
        let mut ok = 0u64;
        for r in &batch {
            let mut line = render(r);
            line.push('\n');
            if out.write_all(line.as_bytes()).is_err() {
                errors.fetch_add(1, Ordering::Relaxed);
            } else {
                ok += 1;
            }
        }
        if out.flush().is_err() {
            errors.fetch_add(1, Ordering::Relaxed);
        }
        written.fetch_add(ok, Ordering::Relaxed);
    }
    let _ = out.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "123e4567-e89b-12d3-a456-426614174000";

    #[test]
    fn a_line_has_the_spec_fields_and_utc_time() {
        let r = AuditRecord {
            started: (1_795_978_801, 5),
            request_id: crate::logic::http::request_id::RequestId::parse(ID).unwrap_or_default(),
            tenant_id: "acme".into(),
            key_id: "sk_00".into(),
            model: "m".into(),
            status: 499,
            latency_ms: 12,
            input_tokens: 3,
            output_tokens: 4,
            agent_id: "12D3".into(),
            error_code: "",
            source_ip: "127.0.0.1".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            trace_id: *b"4bf92f3577b34da6a3ce929d0e0e4736",
        };
        let v: serde_json::Value = serde_json::from_str(&render(&r)).expect("json");
        assert_eq!(v["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
        let none = render(&AuditRecord::default());
        assert!(none.contains("\"trace_id\":\"\""), "{none}");
        assert_eq!(v["log_type"], "audit");
        assert_eq!(v["level"], "error");
        assert_eq!(v["ts"], "2026-11-29T19:00:01.000000005Z");
        assert_eq!(v["status_code"], 499);
        assert_eq!(v["error_code"], "client_closed_request");
        assert_eq!(v["tenant_id"], "acme");
        assert_eq!(v["output_tokens"], 4);
    }

    #[test]
    fn writes_lines_and_counts_drops() {
        let dir = std::env::temp_dir().join(format!("audit-test-{}", std::process::id()));
        let path = dir.join("sub/audit.jsonl");
        let (log, handle) = AuditLog::start(&path).expect("start");
        for i in 0..3 {
            log.send(AuditRecord {
                status: 200 + i,
                ..AuditRecord::default()
            });
        }
        let written = log.written.clone();
        drop(log);
        handle.join().expect("writer");
        assert_eq!(written.load(Ordering::Relaxed), 3);
        let text = std::fs::read_to_string(&path).expect("read");
        assert_eq!(text.lines().count(), 3);
        let _ = std::fs::remove_dir_all(dir);
    }
}
