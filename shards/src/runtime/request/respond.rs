//! Every response the router writes itself goes out through here: errors
//! in the spec's envelope, JSON bodies, `204` for CORS preflight, `100
//! Continue`, and the head of a relayed response; each carries the CORS
//! headers, the request's `X-Request-ID` and its `traceparent`.

use crate::logic::http::errors::{ApiError, ErrorCode};
use crate::logic::http::framing::http_parse::ResponseHead;
use crate::logic::http::framing::http_write::{self, OutFraming};
use crate::logic::routing::refusal::{QuotaRefusal, Refusal};
use crate::runtime::state::scope::{Client, RequestScope};

/// CORS headers on every response (spec 01 §1).
pub const CORS: [(&str, &[u8]); 3] = [
    ("Access-Control-Allow-Origin", b"*"),
    ("Access-Control-Allow-Methods", b"POST, GET, OPTIONS"),
    (
        "Access-Control-Allow-Headers",
        b"Content-Type, Authorization",
    ),
];

/// The interim response to `Expect: 100-continue`.
pub const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// CORS, `X-Request-ID`, `traceparent`, the request's reply headers (quota state, the
/// routed model) and `more`, in that order, each handed to `put`.
fn each_extra<'a>(
    scope: &'a RequestScope,
    more: &[(&'static str, &'a [u8])],
    mut put: impl FnMut((&'static str, &'a [u8])),
) {
    if !scope.no_cors {
        CORS.iter().copied().for_each(&mut put);
    }
    if !scope.request_id.is_empty() {
        put(("X-Request-ID", scope.request_id.as_bytes()));
    }
    if let Some(t) = &scope.trace {
        put(("traceparent", &t.header[..]));
    }
    scope
        .reply_headers
        .iter()
        .for_each(|(n, b)| put((*n, b.as_slice())));
    more.iter().copied().for_each(put);
}

/// The extra headers ([`each_extra`]) collected, borrowed for the writers.
fn extras<'a>(
    scope: &'a RequestScope,
    more: &[(&'static str, &'a [u8])],
) -> Vec<(&'static str, &'a [u8])> {
    let mut v = Vec::with_capacity(CORS.len() + 2 + scope.reply_headers.len() + more.len());
    each_extra(scope, more, |h| v.push(h));
    v
}

/// [`extras`] handed to `f` from the stack when they fit (the relayed
/// head of every proxied response: no allocation per request).
fn with_extras<'a, R>(
    scope: &'a RequestScope,
    more: &[(&'static str, &'a [u8])],
    f: impl FnOnce(&[(&'static str, &'a [u8])]) -> R,
) -> R {
    const INLINE: usize = 16;
    if CORS.len() + 2 + scope.reply_headers.len() + more.len() > INLINE {
        return f(&extras(scope, more));
    }
    let mut a: [(&'static str, &'a [u8]); INLINE] = [("", &[]); INLINE];
    let mut len = 0;
    each_extra(scope, more, |h| {
        if let Some(slot) = a.get_mut(len) {
            *slot = h;
            len += 1;
        }
    });
    f(a.get(..len).unwrap_or(&[]))
}

/// Write a whole response; returns whether the connection stays open.
async fn send(c: &mut Client, out: Vec<u8>, keep: bool) -> bool {
    c.conn.write_all(out).await.is_ok() && keep
}

/// An error in the spec's envelope (with its `Retry-After` when it has one).
pub async fn send_error(c: &mut Client, err: &ApiError, keep: bool) -> bool {
    send_error_with(c, err, keep, &[]).await
}

/// An error with extra headers (`WWW-Authenticate`).
pub async fn send_error_with(
    c: &mut Client,
    err: &ApiError,
    keep: bool,
    more: &[(&'static str, &[u8])],
) -> bool {
    c.scope.ending.status = err.status;
    c.scope.ending.error_code = err.code.as_str();
    // model_waking repeats its Retry-After in the body (`retry_after`).
    let waking_retry = err
        .retry_after
        .filter(|_| err.code == crate::logic::http::errors::ErrorCode::ModelWaking);
    if c.scope.committed {
        // A 200 already went out with keepalives: the error is the body's
        // end (the audit keeps the logical status set above).
        return send_late_error(c, err, waking_retry).await;
    }
    let body = match waking_retry {
        Some(secs) => crate::logic::sites::hold::waking_body(err, secs),
        // Anthropic's clients read Anthropic's envelope (issue 29 #14).
        None if c.scope.path.as_str().starts_with("/v1/messages") => err.body_anthropic(),
        None => err.body(),
    };
    let mut digits = itoa::Buffer::new();
    let retry: Option<(&'static str, &[u8])> = match err.retry_after {
        Some(secs) => Some(("Retry-After", digits.format(secs).as_bytes())),
        None => None,
    };
    let mut headers = extras(&c.scope, more);
    headers.extend(retry);
    let mut out = Vec::with_capacity(256 + body.len());
    http_write::write_full_response(
        &mut out,
        err.status,
        "application/json",
        &body,
        keep,
        &headers,
    );
    drop(headers);
    send(c, out, keep).await
}

/// A quota refusal: its `X-RateLimit-*` headers join the reply headers.
pub async fn send_quota_refusal(c: &mut Client, r: QuotaRefusal, keep: bool) -> bool {
    c.scope.reply_headers.extend(r.headers);
    send_error(c, &r.error, keep).await
}

/// Any refusal of a request for `model` (nothing is written when the
/// client is gone: `false`, the connection closes).
pub async fn send_refusal(c: &mut Client, r: Refusal, model: &str, keep: bool) -> bool {
    if r.client_gone() {
        c.scope.ending.client_gone();
        return false;
    }
    let e = r.error(model);
    if let Refusal::Quota(q) = r {
        return send_quota_refusal(c, q, keep).await;
    }
    send_error(c, &e, keep).await
}

/// An error after a committed 200: the in-band error (an SSE event for
/// streams, the envelope after the spaces otherwise), then the last
/// chunk; the connection closes.
pub async fn send_late_error(c: &mut Client, err: &ApiError, retry_after: Option<u64>) -> bool {
    let (stream, anthropic) = c
        .scope
        .keepalive
        .as_ref()
        .map_or((false, false), |k| (k.stream, k.anthropic));
    c.scope.keepalive = None;
    let body = crate::logic::sites::hold::late_error(err, stream, anthropic, retry_after);
    let mut out = Vec::with_capacity(body.len() + 16);
    http_write::write_chunk(&mut out, &body);
    out.extend_from_slice(http_write::LAST_CHUNK);
    let _ = c.conn.write_all(out).await;
    false
}

/// The committed head of a held request (200, chunked, the request's
/// headers), written with its first keepalive.
pub fn committed_head(scope: &RequestScope, stream: bool) -> Vec<u8> {
    let ct: &[u8] = if stream {
        b"text/event-stream"
    } else {
        b"application/json"
    };
    let headers: [(&str, &[u8]); 2] = [("Content-Type", ct), ("Cache-Control", b"no-cache")];
    let mut out = Vec::with_capacity(512);
    http_write::write_response_head(
        &mut out,
        200,
        headers.into_iter().take(if stream { 2 } else { 1 }),
        OutFraming::Chunked,
        false,
        &extras(scope, &[("X-Accel-Buffering", b"no")]),
    );
    out
}

/// A JSON body.
pub async fn send_json(c: &mut Client, status: u16, body: &[u8], keep: bool) -> bool {
    send_body(c, status, "application/json", body, keep).await
}

/// A body of any content type (`/metrics` text, JSON).
pub async fn send_body(
    c: &mut Client,
    status: u16,
    content_type: &str,
    body: &[u8],
    keep: bool,
) -> bool {
    c.scope.ending.status = status;
    c.scope.ending.error_code = "";
    let mut out = Vec::with_capacity(body.len() + 256);
    http_write::write_full_response(
        &mut out,
        status,
        content_type,
        body,
        keep,
        &extras(&c.scope, &[]),
    );
    send(c, out, keep).await
}

/// `204 No Content` (CORS preflight).
pub async fn send_no_content(c: &mut Client, keep: bool) -> bool {
    c.scope.ending.status = 204;
    c.scope.ending.error_code = "";
    let mut out = Vec::with_capacity(256);
    http_write::write_response_head(
        &mut out,
        204,
        std::iter::empty(),
        OutFraming::Length(0),
        keep,
        &extras(&c.scope, &[]),
    );
    send(c, out, keep).await
}

/// `307 Temporary Redirect` to another site (spec 07 §5.3), empty body.
pub async fn send_redirect(
    c: &mut Client,
    location: &str,
    count: u32,
    site: &str,
    keep: bool,
) -> bool {
    c.scope.ending.status = 307;
    c.scope.ending.error_code = "";
    let n = count.to_string();
    let more: [(&'static str, &[u8]); 3] = [
        ("Location", location.as_bytes()),
        ("X-Hivenet-Redirect-Count", n.as_bytes()),
        ("X-Hivenet-Redirect-Site", site.as_bytes()),
    ];
    let mut out = Vec::with_capacity(512);
    http_write::write_response_head(
        &mut out,
        307,
        std::iter::empty(),
        OutFraming::Length(0),
        keep,
        &extras(&c.scope, &more),
    );
    send(c, out, keep).await
}

/// The head of an event stream the router produces itself.
pub fn event_stream_head(out: &mut Vec<u8>, scope: &RequestScope) {
    http_write::write_response_head(
        out,
        200,
        [("Content-Type", &b"text/event-stream"[..])],
        OutFraming::Chunked,
        false,
        &extras(
            scope,
            &[("Cache-Control", b"no-cache"), ("X-Accel-Buffering", b"no")],
        ),
    );
}

/// The head of a response relayed from an agent (SSE gets
/// `X-Accel-Buffering: no` so buffering proxies pass events through).
pub fn relayed_head(
    out: &mut Vec<u8>,
    head: &ResponseHead,
    framing: OutFraming,
    keep: bool,
    scope: &RequestScope,
) {
    let more: &[(&'static str, &[u8])] = if head.is_event_stream() {
        &[("X-Accel-Buffering", b"no")]
    } else {
        &[]
    };
    with_extras(scope, more, |extra| {
        http_write::write_response_head(out, head.status, head.headers.iter(), framing, keep, extra)
    });
}

/// The error for a method a known route does not take.
pub fn method_not_allowed(method: &str, path: &str) -> ApiError {
    ApiError::new(
        ErrorCode::MethodNotAllowed,
        format!("method {method} not allowed on {path}"),
    )
}

/// The error for an unknown route.
pub fn no_route(method: &str, path: &str) -> ApiError {
    ApiError::new(ErrorCode::NotFound, format!("no route for {method} {path}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::state::scope::{new_request_id, new_trace};
    use crate::runtime::wire::executor::{run_on_runtime, DriverChoice};

    /// The stack copy of the extra headers is the same list as the
    /// allocated one, in order, below, at and past its inline size.
    #[test]
    fn extras_from_the_stack_match_the_allocated_ones() {
        run_on_runtime(DriverChoice::Auto, |_| async {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            let addr = l.local_addr().expect("addr");
            let s = monoio::net::TcpStream::connect(addr)
                .await
                .expect("connect");
            let mut c = Client::new(crate::runtime::wire::conn::Conn::new(s, Vec::new()));
            c.scope.request_id = new_request_id();
            c.scope.trace = Some(new_trace());
            let more: [(&'static str, &[u8]); 2] = [("A", b"1"), ("B", b"2")];
            for n in 0..14 {
                c.scope.reply_headers = (0..n).map(|i| ("X-Reply", vec![b'a' + i])).collect();
                let stack = with_extras(&c.scope, &more, |x| x.to_vec());
                assert_eq!(stack, extras(&c.scope, &more), "{n} reply headers");
                let names: Vec<&str> = stack.iter().map(|(h, _)| *h).collect();
                let mut want: Vec<&str> = CORS.iter().map(|(h, _)| *h).collect();
                want.extend(["X-Request-ID", "traceparent"]);
                want.extend(std::iter::repeat_n("X-Reply", usize::from(n)));
                want.extend(["A", "B"]);
                assert_eq!(names, want, "{n} reply headers");
                assert_eq!(stack.last().map(|(_, v)| *v), Some(&b"2"[..]));
            }
        });
    }
}
