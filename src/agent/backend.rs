//! The agent's HTTP/1.1 client to its backend: one connection per request
//! (the backend is beside the agent, on loopback or a pod network), our
//! own strict parser, a total timeout per exchange.

use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use shards::logic::http_parse::ResponseHead;
use shards::logic::http_write::{self, OutFraming};
use shards::runtime::conn::Conn;

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

    /// Full path for a request path.
    pub fn path(&self, p: &str) -> String {
        format!("{}{}", self.prefix, p)
    }
}

/// Connect and send a request; returns the connection positioned at the
/// response head.
pub async fn send(
    url: &BackendUrl,
    method: &str,
    path: &str,
    headers: &[(String, Vec<u8>)],
    body: &[u8],
) -> io::Result<Conn> {
    let addr = url.resolve()?;
    let stream = monoio::net::TcpStream::connect(addr).await?;
    let mut conn = Conn::new(stream, Vec::new());
    let mut out = Vec::with_capacity(512 + body.len());
    let mut hs: Vec<(String, Vec<u8>)> = headers.to_vec();
    if !hs
        .iter()
        .any(|(n, _)| n.eq_ignore_ascii_case("content-type"))
        && !body.is_empty()
    {
        hs.push(("Content-Type".into(), b"application/json".to_vec()));
    }
    hs.push(("Connection".into(), b"close".to_vec()));
    http_write::write_request_head(
        &mut out,
        method,
        &url.path(path),
        &url.authority,
        &hs,
        OutFraming::Length(body.len()),
    );
    out.extend_from_slice(body);
    conn.write_all(out).await?;
    Ok(conn)
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
        let mut conn = send(url, method, path, &[], body).await?;
        let head = conn.read_response_head().await?;
        let body = conn.read_body(head.framing, 64 * 1024 * 1024).await?;
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
