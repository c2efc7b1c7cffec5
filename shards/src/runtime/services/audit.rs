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

use std::borrow::Cow;

use serde::Serialize;

use crate::logic::http::framing::inline_str::InlineStr;

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
    pub model: InlineStr,
    /// Logical status: 499 when the client went away, the error's status
    /// when a stream was cut after its 200 head.
    pub status: u16,
    /// Whole request, milliseconds.
    pub latency_ms: u64,
    /// Tokens in (response usage).
    pub input_tokens: u64,
    /// Tokens out.
    pub output_tokens: u64,
    /// Agent's peer ID (none when none was reached).
    pub agent_id: Option<Arc<str>>,
    /// Error code (empty on success).
    pub error_code: &'static str,
    /// Client address.
    pub source_ip: Option<std::net::IpAddr>,
    /// Method.
    pub method: Cow<'static, str>,
    /// Path without query.
    pub path: InlineStr,
    /// W3C trace ID, lower-case hex (all zero: none).
    pub trace_id: [u8; 32],
    /// Agents whose stream broke mid-answer and was continued on the next
    /// (`agent_id` finished it), in order; empty for nearly every request.
    pub continued_from: Vec<Arc<str>>,
}

/// Serialised through `Display`, so a line costs the writer no allocation.
struct Shown<T>(T);

impl<T: std::fmt::Display> Serialize for Shown<T> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.0)
    }
}

/// An absent address is an empty string.
struct MaybeIp(Option<std::net::IpAddr>);

impl std::fmt::Display for MaybeIp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(a) => a.fmt(f),
            None => Ok(()),
        }
    }
}

#[derive(Serialize)]
struct Line<'a> {
    log_type: &'static str,
    level: &'static str,
    ts: Shown<timefmt::Rfc3339>,
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
    source_ip: Shown<MaybeIp>,
    trace_id: &'a str,
    #[serde(skip_serializing_if = "<[Arc<str>]>::is_empty")]
    continued_from: &'a [Arc<str>],
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
    let mut out = Vec::new();
    render_into(r, &mut out);
    String::from_utf8(out).unwrap_or_default()
}

/// Append one record's JSON to `out` (reused by the writer).
pub fn render_into(r: &AuditRecord, out: &mut Vec<u8>) {
    let line = Line {
        log_type: "audit",
        level: if r.status < 400 { "info" } else { "error" },
        ts: Shown(timefmt::Rfc3339(r.started.0, r.started.1)),
        request_id: r.request_id.as_str(),
        tenant_id: &r.tenant_id,
        key_id: &r.key_id,
        model: r.model.as_str(),
        method: &r.method,
        path: r.path.as_str(),
        status_code: r.status,
        latency_ms: r.latency_ms,
        input_tokens: r.input_tokens,
        output_tokens: r.output_tokens,
        agent_id: r.agent_id.as_deref().unwrap_or(""),
        error_code: if r.error_code.is_empty() {
            code_of_status(r.status)
        } else {
            r.error_code
        },
        source_ip: Shown(MaybeIp(r.source_ip)),
        trace_id: if r.trace_id == [0; 32] {
            ""
        } else {
            std::str::from_utf8(&r.trace_id).unwrap_or("")
        },
        continued_from: &r.continued_from,
    };
    // Writing to a Vec fails only on a serialiser error, which these
    // plain fields cannot raise; a partial line is cut back.
    let start = out.len();
    if serde_json::to_writer(&mut *out, &line).is_err() {
        out.truncate(start);
    }
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
    /// Files rotated to `<path>.1`.
    pub rotations: Arc<AtomicU64>,
}

impl AuditLog {
    /// Open `path` for appending (directory created 0755, file 0644) and
    /// start the writer thread; past `max_bytes` (0: never) the file is
    /// renamed to `<path>.1` (replacing the older one) and begun anew.
    pub fn start(
        path: &Path,
        max_bytes: u64,
    ) -> std::io::Result<(Arc<AuditLog>, std::thread::JoinHandle<()>)> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let file = open_append(path)?;
        let (tx, rx) = sync_channel(AUDIT_QUEUE);
        let write_errors = Arc::new(AtomicU64::new(0));
        let written = Arc::new(AtomicU64::new(0));
        let rotations = Arc::new(AtomicU64::new(0));
        let out = Output {
            path: path.to_path_buf(),
            size: file.metadata().map(|m| m.len()).unwrap_or(0),
            file: std::io::BufWriter::with_capacity(64 * 1024, file),
            max_bytes,
            errors: write_errors.clone(),
            written: written.clone(),
            rotations: rotations.clone(),
        };
        let handle = std::thread::Builder::new()
            .name("audit".into())
            .spawn(move || writer(out, rx))?;
        Ok((
            Arc::new(AuditLog {
                tx,
                dropped: AtomicU64::new(0),
                write_errors,
                written,
                rotations,
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

/// How often the writer drains the queue. It polls rather than blocks on
/// the channel so that a shard's send never has to wake it (a blocked
/// receiver costs every request a futex call on the shard); at most one
/// tick of lines is in memory, and 65,536 records cover 0.1 s at any
/// rate this router serves.
const AUDIT_TICK: std::time::Duration = std::time::Duration::from_millis(100);

fn open_append(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
}

/// The file the writer appends to, and its size cap.
struct Output {
    path: std::path::PathBuf,
    file: std::io::BufWriter<std::fs::File>,
    size: u64,
    max_bytes: u64,
    errors: Arc<AtomicU64>,
    written: Arc<AtomicU64>,
    rotations: Arc<AtomicU64>,
}

impl Output {
    fn write(&mut self, line: &[u8]) {
        if self.max_bytes > 0 && self.size > 0 && self.size + line.len() as u64 > self.max_bytes {
            self.rotate();
        }
        if self.file.write_all(line).is_err() {
            self.errors.fetch_add(1, Ordering::Relaxed);
        } else {
            self.size += line.len() as u64;
            self.written.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// `<path>` becomes `<path>.1`; a new `<path>` is begun. On failure
    /// the current file goes on (counted), so no line is lost to it.
    fn rotate(&mut self) {
        if self.file.flush().is_err() {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        let mut old = self.path.clone().into_os_string();
        old.push(".1");
        let fresh = std::fs::rename(&self.path, &old).and_then(|()| open_append(&self.path));
        match fresh {
            Ok(f) => {
                self.file = std::io::BufWriter::with_capacity(64 * 1024, f);
                self.size = 0;
                self.rotations.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                // Try again only after another cap's worth.
                self.size = 0;
            }
        }
    }

    fn flush(&mut self) {
        if self.file.flush().is_err() {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Drain the queue every tick, one flush per batch; ends when every
/// sender is gone (shutdown), after the last records.
fn writer(mut out: Output, rx: Receiver<AuditRecord>) {
    let mut line = Vec::with_capacity(1024);
    loop {
        let mut any = false;
        loop {
            match rx.try_recv() {
                Ok(r) => {
                    line.clear();
                    render_into(&r, &mut line);
                    line.push(b'\n');
                    out.write(&line);
                    any = true;
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    out.flush();
                    return;
                }
            }
        }
        if any {
            out.flush();
        }
        std::thread::sleep(AUDIT_TICK);
    }
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
            model: InlineStr::from("m"),
            status: 499,
            latency_ms: 12,
            input_tokens: 3,
            output_tokens: 4,
            agent_id: Some("12D3".into()),
            error_code: "",
            source_ip: Some(std::net::Ipv4Addr::LOCALHOST.into()),
            method: "POST".into(),
            path: InlineStr::from("/v1/chat/completions"),
            trace_id: *b"4bf92f3577b34da6a3ce929d0e0e4736",
            continued_from: vec!["12D3A".into()],
        };
        let v: serde_json::Value = serde_json::from_str(&render(&r)).expect("json");
        assert_eq!(v["continued_from"], serde_json::json!(["12D3A"]));
        assert_eq!(v["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
        let none = render(&AuditRecord::default());
        assert!(none.contains("\"trace_id\":\"\""), "{none}");
        assert!(
            !none.contains("continued_from"),
            "only when continued: {none}"
        );
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
        let (log, handle) = AuditLog::start(&path, 0).expect("start");
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

    #[test]
    fn rotates_past_the_cap_and_keeps_every_line() {
        let dir = std::env::temp_dir().join(format!("audit-rot-{}", std::process::id()));
        let path = dir.join("audit.jsonl");
        let one = render(&AuditRecord::default()).len() as u64 + 1;
        // Room for three lines a file: 10 lines make 4 files, 3 rotations.
        let (log, handle) = AuditLog::start(&path, 3 * one).expect("start");
        for _ in 0..10 {
            log.send(AuditRecord::default());
        }
        let (written, rotations) = (log.written.clone(), log.rotations.clone());
        drop(log);
        handle.join().expect("writer");
        assert_eq!(written.load(Ordering::Relaxed), 10);
        assert_eq!(rotations.load(Ordering::Relaxed), 3);
        let now = std::fs::read_to_string(&path).expect("read");
        let old = std::fs::read_to_string(dir.join("audit.jsonl.1")).expect("read .1");
        assert_eq!((now.lines().count(), old.lines().count()), (1, 3));
        let _ = std::fs::remove_dir_all(dir);
    }
}
