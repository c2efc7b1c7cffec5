//! `hivenet-hold-bench`: many held streaming requests from one Rust
//! process, timing every keepalive against its due time (issue 13's
//! targets). A Python asyncio client saturated at ~18,000 held requests
//! and its own lateness could not be told from the router's.
//!
//! Protocol with the driver (`scripts/bench/hold.py`): the client prints
//! `SENT` once every request is written, `HOLD_DONE <json>` after
//! `--hold-seconds` more (the driver then reads the router's RSS and
//! registers an agent), and `RESULT <json>` when every request ended or
//! the timeout passed.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;
use serde::Serialize;

/// What the scanner saw in a chunk of a held response.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Seen {
    /// Keepalive comments (`: keep-alive` lines) completed in the chunk.
    pub keepalives: u32,
    /// The first `data: {` event began in the chunk.
    pub first_data: bool,
    /// `data: [DONE]` was seen: the stream is over.
    pub done: bool,
}

/// Finds keepalives and events in a streamed response, across reads
/// (a marker may be split between two reads). Pure: no I/O, no clock.
#[derive(Default)]
pub struct Scanner {
    tail: Vec<u8>,
    data_seen: bool,
}

const KEEPALIVE: &[u8] = b": keep-alive\n";
const DATA: &[u8] = b"data: {";
const DONE: &[u8] = b"data: [DONE]";

impl Scanner {
    /// Feed the next bytes read.
    pub fn feed(&mut self, bytes: &[u8]) -> Seen {
        let keep = KEEPALIVE.len().max(DONE.len()).max(DATA.len()) - 1;
        let mut buf = std::mem::take(&mut self.tail);
        let old = buf.len();
        buf.extend_from_slice(bytes);
        let mut seen = Seen::default();
        // Count only markers that end in the new bytes (the tail was
        // already scanned up to its own length).
        let ends_new = |at: usize, len: usize| at + len > old;
        let mut i = 0;
        while i < buf.len() {
            let rest = &buf[i..];
            if rest.starts_with(KEEPALIVE) {
                if ends_new(i, KEEPALIVE.len()) && !self.data_seen {
                    seen.keepalives += 1;
                }
                i += KEEPALIVE.len();
                continue;
            }
            if rest.starts_with(DONE) {
                if ends_new(i, DONE.len()) {
                    seen.done = true;
                }
                i += DONE.len();
                continue;
            }
            if rest.starts_with(DATA) {
                if ends_new(i, DATA.len()) && !self.data_seen {
                    seen.first_data = true;
                    self.data_seen = true;
                }
                i += DATA.len();
                continue;
            }
            i += 1;
        }
        let from = buf.len().saturating_sub(keep);
        self.tail = buf[from..].to_vec();
        seen
    }
}

/// Options of one run.
pub struct HoldOpts {
    /// Router address.
    pub addr: SocketAddr,
    /// Model at zero.
    pub model: String,
    /// Held requests.
    pub held: usize,
    /// The router's `--wake-keepalive`.
    pub keepalive: Duration,
    /// How long to hold once every request is sent.
    pub hold: Duration,
    /// Give up on the release after this long.
    pub timeout: Duration,
}

#[derive(Default)]
struct Book {
    sent_at: Vec<Option<Instant>>,
    first_data: Vec<Option<Instant>>,
    late_us: Vec<u64>,
    gap_late_us: Vec<u64>,
    /// Gaps more than 1 s late, by the second (since the first connect)
    /// they ended in: when the router fell behind.
    late_gaps_by_second: std::collections::BTreeMap<u64, u64>,
    t0: Option<Instant>,
    early: u64,
    served: u64,
    closed: u64,
    connect_errors: u64,
    sent: usize,
    ended: usize,
    /// The last bytes of the first few answers that ended after data
    /// but without `[DONE]` (cut).
    cut: Vec<String>,
}

/// Keepalive figures.
#[derive(Serialize)]
pub struct KeepaliveFigures {
    /// Keepalives received.
    pub keepalives: usize,
    /// Lateness percentiles against hold start + k x period (ms).
    pub late_p50_ms: f64,
    /// p99.
    pub late_p99_ms: f64,
    /// Max.
    pub late_max_ms: f64,
    /// Keepalives more than 1 s late.
    pub later_than_1s: usize,
}

/// Release figures.
#[derive(Serialize)]
pub struct ReleaseFigures {
    /// Requests that got data and `[DONE]`.
    pub served: u64,
    /// Closed before data.
    pub closed_without_data: u64,
    /// Could not connect.
    pub connect_errors: u64,
    /// Ended after data, without `[DONE]`.
    pub cut: u64,
    /// The last bytes of the first few of those.
    pub cut_tails: Vec<String>,
    /// Instants of first data, seconds after the earliest, in hold order.
    pub first_data_s_by_hold_order: Vec<Option<f64>>,
}

fn keepalive_figures(late_us: &[u64]) -> KeepaliveFigures {
    let mut l = late_us.to_vec();
    l.sort_unstable();
    let at = |q: f64| {
        l.get(((l.len() as f64 * q) as usize).min(l.len().saturating_sub(1)))
            .map_or(0.0, |v| *v as f64 / 1000.0)
    };
    KeepaliveFigures {
        keepalives: l.len(),
        late_p50_ms: at(0.5),
        late_p99_ms: at(0.99),
        late_max_ms: l.last().map_or(0.0, |v| *v as f64 / 1000.0),
        later_than_1s: l.iter().filter(|v| **v > 1_000_000).count(),
    }
}

fn request(model: &str) -> Vec<u8> {
    // ~200-byte body, as the target says.
    let body = format!(
        r#"{{"model":"{model}","stream":true,"max_tokens":4,"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(120)
    );
    let mut out = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body.as_bytes());
    out
}

async fn one(i: usize, opts: Rc<HoldOpts>, book: Rc<RefCell<Book>>, req: Rc<Vec<u8>>) {
    let end = |b: &mut Book| b.ended += 1;
    let mut s = match connect_from(opts.addr, i) {
        Ok(s) => s,
        Err(_) => {
            let mut b = book.borrow_mut();
            b.connect_errors += 1;
            b.sent += 1;
            end(&mut b);
            return;
        }
    };
    let start = Instant::now();
    let (r, _) = s.write_all(req.to_vec()).await;
    {
        let mut b = book.borrow_mut();
        b.sent += 1;
        if r.is_err() {
            b.connect_errors += 1;
            end(&mut b);
            return;
        }
        b.sent_at[i] = Some(start);
    }
    let mut scan = Scanner::default();
    let mut k = 0u32;
    let mut last: Option<Instant> = None;
    let mut buf = vec![0u8; 512];
    let mut tail: Vec<u8> = Vec::new();
    loop {
        let (r, b) = s.read(buf).await;
        buf = b;
        let n = match r {
            Ok(0) | Err(_) => {
                let mut b = book.borrow_mut();
                if b.first_data[i].is_none() {
                    b.closed += 1;
                } else if memchr_find(&unchunked(&tail), b"data: [DONE]") {
                    // The end marker split over two HTTP chunks (legal:
                    // the relay passes reads on as they come).
                    b.served += 1;
                } else if b.cut.len() < 5 {
                    let why = match &r {
                        Err(e) => format!("error {e}"),
                        _ => "eof".into(),
                    };
                    b.cut
                        .push(format!("{why}: {}", String::from_utf8_lossy(&tail)));
                } else {
                    b.cut.push(String::new());
                }
                end(&mut b);
                return;
            }
            Ok(n) => n,
        };
        tail.extend_from_slice(&buf[..n]);
        if tail.len() > 600 {
            tail.drain(..tail.len() - 600);
        }
        let now = Instant::now();
        let seen = scan.feed(&buf[..n]);
        let mut b = book.borrow_mut();
        for _ in 0..seen.keepalives {
            k += 1;
            // Against the previous keepalive: the router's own schedule,
            // without the time it took to accept and read the request.
            if let Some(prev) = last {
                let due = prev + opts.keepalive;
                let l = now.checked_duration_since(due).unwrap_or_default();
                b.gap_late_us.push(l.as_micros() as u64);
                if l > Duration::from_secs(1) {
                    let sec = b.t0.map_or(0, |t| now.duration_since(t).as_secs());
                    *b.late_gaps_by_second.entry(sec).or_default() += 1;
                }
            }
            last = Some(now);
            let due = start + opts.keepalive * k;
            match now.checked_duration_since(due) {
                Some(l) => b.late_us.push(l.as_micros() as u64),
                None => {
                    b.early += 1;
                    b.late_us.push(0);
                }
            }
        }
        if seen.first_data {
            b.first_data[i] = Some(now);
        }
        if seen.done {
            b.served += 1;
            end(&mut b);
            return;
        }
    }
}

/// `b` with every chunk-size line (`\r\n<hex>\r\n`) taken out: the
/// events of a chunked body, near enough to find a marker split by one.
pub fn unchunked(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"\r\n") {
            let rest = &b[i + 2..];
            let hex = rest.iter().take_while(|c| c.is_ascii_hexdigit()).count();
            if hex > 0 && rest[hex..].starts_with(b"\r\n") {
                i += 2 + hex + 2;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    out
}

fn memchr_find(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Connect from a source address and port of our own choosing: with
/// 18,000 connections to one address, the kernel's ephemeral-port search
/// (`__inet_check_established`) took 41 % of the client's time and
/// stalled it for seconds, which showed up as keepalive lateness. The
/// connect is blocking (loopback completes it in the call).
fn connect_from(to: SocketAddr, i: usize) -> std::io::Result<TcpStream> {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::for_address(to), Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    if to.ip().is_loopback() && to.is_ipv4() {
        // 127.0.0.2-127.0.0.9, ports 20000-59999: 320,000 pairs.
        let ip = std::net::Ipv4Addr::new(127, 0, 0, 2 + (i / 40_000 % 8) as u8);
        let mut port = 20_000 + (i % 40_000) as u16;
        loop {
            match s.bind(&SocketAddr::from((ip, port)).into()) {
                Ok(()) => break,
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && port < 59_999 => port += 1,
                Err(e) => return Err(e),
            }
        }
    }
    s.connect(&to.into())?;
    s.set_nonblocking(true)?;
    TcpStream::from_std(std::net::TcpStream::from(s))
}

/// Run the client on the current thread's monoio runtime; prints the
/// protocol lines of the module doc.
pub async fn run(opts: HoldOpts) {
    let n = opts.held;
    let book = Rc::new(RefCell::new(Book {
        sent_at: vec![None; n],
        first_data: vec![None; n],
        t0: Some(Instant::now()),
        ..Book::default()
    }));
    let opts = Rc::new(opts);
    let req = Rc::new(request(&opts.model));
    for i in 0..n {
        monoio::spawn(one(i, opts.clone(), book.clone(), req.clone()));
        // Pace connects so the listen backlog never overflows.
        if i % 500 == 499 {
            monoio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    while book.borrow().sent < n {
        monoio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("SENT");
    monoio::time::sleep(opts.hold).await;
    let (held_fig, gap_fig) = {
        let mut b = book.borrow_mut();
        let f = keepalive_figures(&b.late_us);
        let g = keepalive_figures(&b.gap_late_us);
        b.late_us.clear();
        b.gap_late_us.clear();
        (f, g)
    };
    println!(
        "HOLD_DONE {}",
        serde_json::json!({"from_send": held_fig, "from_previous": gap_fig,
            "late_gaps_by_second": book.borrow().late_gaps_by_second})
    );
    let deadline = Instant::now() + opts.timeout;
    while book.borrow().ended < n && Instant::now() < deadline {
        monoio::time::sleep(Duration::from_millis(50)).await;
    }
    let b = book.borrow();
    let mut order: Vec<usize> = (0..n).filter(|i| b.sent_at[*i].is_some()).collect();
    order.sort_by_key(|i| b.sent_at[*i]);
    let first = b.first_data.iter().flatten().min().copied();
    let rel = ReleaseFigures {
        served: b.served,
        closed_without_data: b.closed,
        cut: b.cut.len() as u64,
        cut_tails: b.cut.iter().filter(|t| !t.is_empty()).cloned().collect(),
        connect_errors: b.connect_errors,
        first_data_s_by_hold_order: order
            .iter()
            .map(|i| match (b.first_data[*i], first) {
                (Some(t), Some(f)) => Some(t.duration_since(f).as_secs_f64()),
                _ => None,
            })
            .collect(),
    };
    // Keepalives after the release (requests waiting for a slot).
    let after = keepalive_figures(&b.late_us);
    let after_gap = keepalive_figures(&b.gap_late_us);
    println!(
        "RESULT {}",
        serde_json::json!({"release": rel, "keepalives_after_release": after,
            "keepalive_gaps_after_release": after_gap, "early": b.early})
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_end_marker_split_over_two_chunks_is_found() {
        let tail = b"data: {\"a\":1}\n\ndata: [\r\n7\r\nDONE]\n\n\r\n0\r\n\r\n";
        assert!(memchr_find(&unchunked(tail), b"data: [DONE]"));
        assert!(!memchr_find(
            &unchunked(b"data: {\"a\":1}\n\n"),
            b"data: [DONE]"
        ));
    }

    #[test]
    fn counts_keepalives_and_events_split_across_reads() {
        let stream = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n: keep-alive\n\n: keep-alive\n\ndata: {\"a\":1}\n\ndata: [DONE]\n\n";
        for cut in 0..stream.len() {
            let mut s = Scanner::default();
            let a = s.feed(&stream[..cut]);
            let b = s.feed(&stream[cut..]);
            assert_eq!(a.keepalives + b.keepalives, 2, "cut at {cut}");
            assert!(a.first_data ^ b.first_data, "cut at {cut}");
            assert!(a.done ^ b.done, "cut at {cut}");
        }
    }

    #[test]
    fn keepalives_after_data_are_not_counted() {
        let mut s = Scanner::default();
        let seen = s.feed(b"data: {\"x\":1}\n\n: keep-alive\n\n");
        assert_eq!(seen.keepalives, 0);
        assert!(seen.first_data);
        assert_eq!(s.feed(b": keep-alive\n\n").keepalives, 0);
    }

    #[test]
    fn figures_of_lateness() {
        let f = keepalive_figures(&[0, 1_000, 2_000_000, 500]);
        assert_eq!(f.keepalives, 4);
        assert_eq!(f.later_than_1s, 1);
        assert!((f.late_max_ms - 2000.0).abs() < 1e-9);
    }
}
