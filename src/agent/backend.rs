//! The agent's HTTP/1.1 client to its backend: keep-alive connections
//! pooled per backend (a new TCP connection per request cost the agent and
//! the backend ~25-50 us of CPU each; see perf/), our own strict parser, a
//! total timeout per exchange.

use std::cell::RefCell;
use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use shards::logic::http::framing::http_parse::{contains_ci, BodyFraming, Headers, ResponseHead};
use shards::logic::http::framing::http_write::{self, OutFraming};
use shards::runtime::wire::conn::Conn;

/// A parsed `http://host:port/prefix` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendUrl {
    /// `host:port` for the Host header.
    pub authority: String,
    /// Path prefix without a trailing slash (may be empty).
    pub prefix: String,
}

impl BackendUrl {
    /// Parse; only plain `http://` is supported.
    pub fn parse(s: &str) -> Result<Self, String> {
        let rest = s
            .trim()
            .strip_prefix("http://")
            .ok_or_else(|| format!("{s:?}: only http:// URLs are supported"))?;
        let (auth, path) = match rest.find('/') {
            Some(i) => (rest.get(..i).unwrap_or(""), rest.get(i..).unwrap_or("")),
            None => (rest, ""),
        };
        if auth.is_empty() {
            return Err(format!("{s:?}: missing host"));
        }
        let authority = if auth
            .rsplit_once(':')
            .map(|(_, p)| p.parse::<u16>().is_ok())
            .unwrap_or(false)
        {
            auth.to_string()
        } else {
            format!("{auth}:80")
        };
        Ok(BackendUrl {
            authority,
            prefix: path.trim_end_matches('/').to_string(),
        })
    }

    /// Resolve the authority to a socket address.
    pub fn resolve(&self) -> io::Result<SocketAddr> {
        self.authority.to_socket_addrs()?.next().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("cannot resolve {}", self.authority),
            )
        })
    }

    /// Full path for a request path (borrowed when there is no prefix:
    /// no allocation per request in the common case).
    pub fn path<'a>(&self, p: &'a str) -> std::borrow::Cow<'a, str> {
        if self.prefix.is_empty() {
            std::borrow::Cow::Borrowed(p)
        } else {
            std::borrow::Cow::Owned(format!("{}{}", self.prefix, p))
        }
    }
}

/// Idle connections kept per backend.
const MAX_IDLE: usize = 64;

/// What the agent keeps per backend: its idle connections, and whether
/// the backend closes a connection after a streamed response although it
/// announced keep-alive (llama.cpp's server does). Once that is seen, a
/// streamed response's connection is not kept: a new one is opened in the
/// background as the stream ends, so the next request neither sends into
/// a dead connection (a write, a read of the end and a reconnect on its
/// path) nor waits for a connect.
#[derive(Default)]
struct Pool {
    /// Idle connections; `true`: it carried a streamed response.
    idle: Vec<(Conn, bool)>,
    closes_after_stream: bool,
    /// A background connect is on its way.
    connecting: bool,
}

thread_local! {
    static POOLS: RefCell<HashMap<String, Pool>> = RefCell::new(HashMap::new());
}

fn with_pool<R>(url: &BackendUrl, f: impl FnOnce(&mut Pool) -> R) -> R {
    POOLS.with(|m| {
        let mut m = m.borrow_mut();
        // Looked up before inserting: the key is copied once per backend.
        if let Some(p) = m.get_mut(&url.authority) {
            return f(p);
        }
        f(m.entry(url.authority.clone()).or_default())
    })
}

fn take_idle(url: &BackendUrl) -> Option<(Conn, bool)> {
    with_pool(url, |p| p.idle.pop())
}

fn keep(url: &BackendUrl, conn: Conn, after_stream: bool) {
    with_pool(url, |p| {
        if p.idle.len() < MAX_IDLE {
            p.idle.push((conn, after_stream));
        }
    });
}

/// Return a connection whose response was read to its end, unless the
/// backend asked to close it or its framing was "until close".
pub fn release(url: &BackendUrl, conn: Conn, head: &ResponseHead) {
    let closes = head
        .header("connection")
        .map(|v| contains_ci(v, b"close"))
        .unwrap_or(false);
    if closes || head.framing == BodyFraming::UntilClose || !conn.buf.is_empty() {
        return;
    }
    let stream = head.is_event_stream();
    if stream && with_pool(url, |p| p.closes_after_stream) {
        drop(conn);
        connect_ahead(url);
        return;
    }
    keep(url, conn, stream);
}

/// Open a connection in the background for the next request, unless one
/// is idle or on its way.
fn connect_ahead(url: &BackendUrl) {
    let start = with_pool(url, |p| {
        let start = p.idle.is_empty() && !p.connecting;
        p.connecting |= start;
        start
    });
    if !start {
        return;
    }
    let url = url.clone();
    drop(monoio::spawn(async move {
        if let Ok(addr) = url.resolve() {
            if let Ok(stream) = monoio::net::TcpStream::connect(addr).await {
                keep(&url, Conn::new(stream, Vec::new()), false);
            }
        }
        with_pool(&url, |p| p.connecting = false);
    }));
}

async fn write_request(
    conn: &mut Conn,
    url: &BackendUrl,
    method: &str,
    path: &str,
    headers: &Headers,
    body: &[u8],
) -> io::Result<()> {
    // From the thread's pool; the write gives it back.
    let mut out = shards::runtime::wire::bufpool::take(512 + body.len());
    // Borrowed pairs: no copy of the request's headers per request.
    let typed = headers
        .iter()
        .any(|(n, _)| n.eq_ignore_ascii_case("content-type"));
    let default_type =
        (!typed && !body.is_empty()).then_some(("Content-Type", &b"application/json"[..]));
    let hs = headers.iter().chain(default_type);
    http_write::write_request_head_from(
        &mut out,
        method,
        &url.path(path),
        &url.authority,
        hs,
        OutFraming::Length(body.len()),
    );
    out.extend_from_slice(body);
    conn.write_all(out).await
}

/// Send a request (on a pooled connection when one is idle) and read the
/// response head. A pooled connection the backend closed while idle is
/// detected by an end of stream before any response byte, and the request
/// is sent once more on a fresh connection.
pub async fn request(
    url: &BackendUrl,
    method: &str,
    path: &str,
    headers: &Headers,
    body: &[u8],
) -> io::Result<(Conn, ResponseHead)> {
    if let Some((mut conn, after_stream)) = take_idle(url) {
        if write_request(&mut conn, url, method, path, headers, body)
            .await
            .is_ok()
        {
            match conn.read_response_head().await {
                Ok(h) => return Ok((conn, h)),
                Err(e)
                    if conn.buf.is_empty()
                        && matches!(
                            e.kind(),
                            io::ErrorKind::UnexpectedEof
                                | io::ErrorKind::ConnectionReset
                                | io::ErrorKind::BrokenPipe
                        ) =>
                {
                    if after_stream {
                        with_pool(url, |p| p.closes_after_stream = true);
                    }
                }
                Err(e) => return Err(e),
            }
        } else if after_stream {
            with_pool(url, |p| p.closes_after_stream = true);
        }
    }
    let addr = url.resolve()?;
    let stream = monoio::net::TcpStream::connect(addr).await?;
    let mut conn = Conn::new(stream, Vec::new());
    write_request(&mut conn, url, method, path, headers, body).await?;
    let h = conn.read_response_head().await?;
    Ok((conn, h))
}

/// A whole exchange with a buffered body, under `timeout`.
pub async fn fetch(
    url: &BackendUrl,
    method: &str,
    path: &str,
    body: &[u8],
    timeout: Duration,
) -> io::Result<(ResponseHead, Vec<u8>)> {
    let run = async {
        let (mut conn, head) = request(url, method, path, &Headers::default(), body).await?;
        let body = conn.read_body(head.framing, 64 * 1024 * 1024).await?;
        release(url, conn, &head);
        Ok((head, body))
    };
    match monoio::time::timeout(timeout, run).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "backend timed out")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let u = BackendUrl::parse("http://localhost:8888").expect("ok");
        assert_eq!(u.authority, "localhost:8888");
        assert_eq!(u.path("/health"), "/health");
        let u = BackendUrl::parse("http://h/api/").expect("ok");
        assert_eq!(u.authority, "h:80");
        assert_eq!(u.path("/v1/models"), "/api/v1/models");
        assert!(BackendUrl::parse("https://x").is_err());
        assert!(BackendUrl::parse("http://").is_err());
    }
}
