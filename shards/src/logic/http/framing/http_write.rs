//! HTTP/1.1 writing: response and request heads, chunk framing, the JSON
//! error response. Pure: everything appends to a `Vec<u8>`.

use crate::logic::http::errors::ApiError;

/// Reason phrase for the statuses we emit.
pub fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        204 => "No Content",
        307 => "Temporary Redirect",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Payload Too Large",
        422 => "Unprocessable Entity",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Status",
    }
}

/// Hop-by-hop and framing headers never copied from one side to the other.
pub fn is_hop_header(name: &str) -> bool {
    const HOP: [&str; 8] = [
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "te",
        "trailer",
        "upgrade",
        "proxy-connection",
    ];
    HOP.iter().any(|h| name.eq_ignore_ascii_case(h))
}

/// Body framing of a response we write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutFraming {
    /// `Content-Length: n`.
    Length(usize),
    /// `Transfer-Encoding: chunked`.
    Chunked,
}

/// Append a status line and headers. `headers` are copied except hop-by-hop
/// ones and those `extra` sets (the router's `X-Request-ID` and
/// `traceparent` win over a backend's); framing and `Connection` are
/// written from the arguments.
pub fn write_response_head<'h>(
    out: &mut Vec<u8>,
    status: u16,
    headers: impl IntoIterator<Item = (&'h str, &'h [u8])>,
    framing: OutFraming,
    keep_alive: bool,
    extra: &[(&str, &[u8])],
) {
    use std::io::Write as _;
    // Numbers are written in place: no temporary String per response.
    let _ = write!(out, "HTTP/1.1 {status} ");
    out.extend_from_slice(reason(status).as_bytes());
    out.extend_from_slice(b"\r\n");
    for (n, v) in headers {
        if is_hop_header(n) || extra.iter().any(|(e, _)| e.eq_ignore_ascii_case(n)) {
            continue;
        }
        push_header(out, n, v);
    }
    for (n, v) in extra {
        push_header(out, n, v);
    }
    match framing {
        OutFraming::Length(n) => {
            let _ = write!(out, "Content-Length: {n}\r\n");
        }
        OutFraming::Chunked => push_header(out, "Transfer-Encoding", b"chunked"),
    }
    if !keep_alive {
        push_header(out, "Connection", b"close");
    }
    out.extend_from_slice(b"\r\n");
}

fn push_header(out: &mut Vec<u8>, n: &str, v: &[u8]) {
    out.extend_from_slice(n.as_bytes());
    out.extend_from_slice(b": ");
    out.extend_from_slice(v);
    out.extend_from_slice(b"\r\n");
}

/// A complete response with a body and `Content-Length`.
pub fn write_full_response(
    out: &mut Vec<u8>,
    status: u16,
    content_type: &str,
    body: &[u8],
    keep_alive: bool,
    extra: &[(&str, &[u8])],
) {
    let mut more = Vec::with_capacity(extra.len() + 1);
    more.push(("Content-Type", content_type.as_bytes()));
    more.extend_from_slice(extra);
    write_response_head(
        out,
        status,
        std::iter::empty(),
        OutFraming::Length(body.len()),
        keep_alive,
        &more,
    );
    out.extend_from_slice(body);
}

/// A complete JSON error response in the router envelope.
pub fn write_error(out: &mut Vec<u8>, err: &ApiError, keep_alive: bool) {
    let body = err.body();
    write_full_response(out, err.status, "application/json", &body, keep_alive, &[]);
}

/// One chunk of a chunked body (nothing for an empty slice: that would end it).
pub fn write_chunk(out: &mut Vec<u8>, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    out.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// The terminating chunk.
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// Append a request head. `headers` are copied except hop-by-hop ones and
/// `host`; framing is written from `framing`.
pub fn write_request_head(
    out: &mut Vec<u8>,
    method: &str,
    path: &str,
    host: &str,
    headers: &[(String, Vec<u8>)],
    framing: OutFraming,
) {
    let hs = headers.iter().map(|(n, v)| (n.as_str(), v.as_slice()));
    write_request_head_from(out, method, path, host, hs, framing);
}

/// [`write_request_head`] over borrowed header pairs (the router's request
/// to an agent: no per-header copies).
pub fn write_request_head_from<'a>(
    out: &mut Vec<u8>,
    method: &str,
    path: &str,
    host: &str,
    headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    framing: OutFraming,
) {
    use std::io::Write as _;
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nHost: ");
    out.extend_from_slice(host.as_bytes());
    out.extend_from_slice(b"\r\n");
    for (n, v) in headers {
        if is_hop_header(n) || n.eq_ignore_ascii_case("host") || n.eq_ignore_ascii_case("expect") {
            continue;
        }
        push_header(out, n, v);
    }
    match framing {
        OutFraming::Length(n) => {
            out.extend_from_slice(b"Content-Length: ");
            let _ = write!(out, "{n}");
            out.extend_from_slice(b"\r\n");
        }
        OutFraming::Chunked => push_header(out, "Transfer-Encoding", b"chunked"),
    }
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logic::http::framing::http_parse::{parse_response_head, BodyFraming};

    #[test]
    fn the_routers_headers_replace_the_backends() {
        let mut out = Vec::new();
        let hs: [(&str, &[u8]); 3] = [
            ("x-request-id", b"backend-id"),
            ("Traceparent", b"00-backend"),
            ("Content-Type", b"application/json"),
        ];
        let extra: [(&str, &[u8]); 2] = [("X-Request-ID", b"ours"), ("traceparent", b"00-ours")];
        write_response_head(&mut out, 200, hs, OutFraming::Length(0), true, &extra);
        let text = String::from_utf8(out).expect("ascii");
        assert!(!text.contains("backend"), "{text}");
        assert_eq!(text.matches("ours").count(), 2, "{text}");
        assert!(text.contains("Content-Type: application/json"), "{text}");
    }

    #[test]
    fn head_round_trips_through_parser() {
        let mut out = Vec::new();
        let hs: [(&str, &[u8]); 3] = [
            ("Content-Type", b"application/json"),
            ("Content-Length", b"999"),
            ("Connection", b"keep-alive"),
        ];
        write_response_head(
            &mut out,
            200,
            hs,
            OutFraming::Length(2),
            true,
            &[("X-Accel-Buffering", b"no")],
        );
        out.extend_from_slice(b"{}");
        let (h, n) = parse_response_head(&out).expect("ok").expect("complete");
        assert_eq!(h.status, 200);
        assert_eq!(h.framing, BodyFraming::Length(2));
        assert_eq!(h.header("x-accel-buffering"), Some(b"no".as_slice()));
        assert_eq!(&out[n..], b"{}");
    }

    #[test]
    fn chunk_bytes() {
        let mut out = Vec::new();
        write_chunk(&mut out, b"hello world, 16!!");
        write_chunk(&mut out, b"");
        out.extend_from_slice(LAST_CHUNK);
        assert_eq!(out, b"11\r\nhello world, 16!!\r\n0\r\n\r\n");
    }
}
