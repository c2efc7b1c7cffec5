//! A request read and probed on the shard that accepted it, and the
//! hand-off payload that carries it to its model's shard.

use crate::logic::http::api::probe::RequestMeta;
use crate::logic::http::endpoint::Endpoint;
use crate::logic::http::framing::http_parse::RequestHead;
use crate::runtime::wire::budget::{BodyPermit, ConnPermit};
use crate::runtime::wire::clock::Instant;

pub use super::tenancy::Principal;

/// A request ready for its model's shard.
#[derive(Debug)]
pub struct PendingRequest {
    /// Parsed head.
    pub head: RequestHead,
    /// Whole body as received (de-chunked).
    pub body: Vec<u8>,
    /// Probed fields.
    pub meta: RequestMeta,
    /// Which endpoint.
    pub endpoint: Endpoint,
    /// When the head started arriving.
    pub received_at: Instant,
    /// `X-Request-ID` (the client's when it is a UUID, else generated).
    pub request_id: crate::logic::http::request_id::RequestId,
    /// Its trace context (sent on to the agent, echoed to the client).
    pub trace: crate::logic::http::trace_context::Trace,
    /// Who sent it.
    pub principal: Principal,
    /// The name the client asked for when it was an alias.
    pub alias: Option<String>,
    /// Headers every response to it carries (`X-Hivenet-Routed-Model`).
    pub reply_headers: Vec<(&'static str, Vec<u8>)>,
    /// The body's share of the router-wide body budget (given back when
    /// the request is done).
    pub body_permit: BodyPermit,
    /// Set when the request was held at zero and released by a wake.
    pub held: Option<Held>,
    /// Hold it for this budget on arrival (it was sent to its model's
    /// hold shard, where every held request of the model waits, so a wake
    /// releases them in one order).
    pub hold_for: Option<std::time::Duration>,
    /// Its trace, carried with it to another shard.
    pub spans: Option<Box<crate::logic::trace::request::RequestTrace>>,
    /// Held at zero by the process this one replaced: its hold state
    /// (issue 54).
    pub carried: Option<Box<crate::logic::system::upgrade::CarriedHold>>,
    /// Relayed by the process this one replaced until its drain timeout:
    /// continued here from what the client received (issue 54).
    pub resumed: Option<Box<crate::logic::system::upgrade::CarriedStream>>,
}

impl PendingRequest {
    /// The request as HTTP/1.1 bytes again (what the process replacing
    /// this one parses, issue 54): its head with the body's length, and
    /// its whole `body` (its own, or the copy its agent request carries
    /// once the driver gave its own back).
    pub fn wire_bytes(&self, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(body.len() + 1024);
        out.extend_from_slice(self.head.method.as_bytes());
        out.push(b' ');
        out.extend_from_slice(self.head.path.as_str().as_bytes());
        out.extend_from_slice(b" HTTP/1.1\r\n");
        for (name, value) in self.head.headers.iter() {
            let skip = [
                "content-length",
                "transfer-encoding",
                "expect",
                "connection",
            ];
            if skip.iter().any(|s| name.eq_ignore_ascii_case(s)) {
                continue;
            }
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
        if !self.head.keep_alive {
            out.extend_from_slice(b"connection: close\r\n");
        }
        out.extend_from_slice(b"content-length: ");
        out.extend_from_slice(body.len().to_string().as_bytes());
        out.extend_from_slice(b"\r\n\r\n");
        out.extend_from_slice(body);
        out
    }

    /// Its priority class: its key's, lowered by the `X-Hivenet-Priority`
    /// header; `Err` (a message for the client) when the header is not a
    /// class or would raise it.
    pub fn class(
        &self,
    ) -> Result<crate::logic::routing::wait_queue::Class, crate::logic::http::errors::ApiError>
    {
        crate::logic::routing::wait_queue::request_class(
            self.principal.key_class(),
            self.head
                .header(crate::logic::routing::wait_queue::PRIORITY_HEADER),
        )
    }
}

/// What a request released by a wake carries on (seed "After the wake").
#[derive(Debug)]
pub struct Held {
    /// End of its hold budget: admission may wait for room until then.
    pub until: Instant,
    /// The budget (for the `model_waking` message and `Retry-After`).
    pub budget: std::time::Duration,
    /// `Retry-After` seconds of a `model_waking` answer.
    pub retry_after: u64,
    /// Keepalives go on until the response starts.
    pub keepalive: Option<super::scope::KeepAlive>,
    /// A 200 head already went out.
    pub committed: bool,
    /// Its pending demand, left when it gets a slot.
    pub demand: super::hold_book::DemandGuard,
    /// The request quota taken before the hold (not taken twice).
    pub quota: Option<super::tenancy::Ticket>,
}

/// A client connection moving to its model's shard: the socket out of
/// its former runtime, the bytes read past the request, and the request.
#[derive(Debug)]
pub struct HandOff {
    /// The socket.
    pub stream: std::net::TcpStream,
    /// Bytes read past the pending request (pipelined input).
    pub buf: Vec<u8>,
    /// The request to serve first.
    pub pending: Box<PendingRequest>,
    /// The connection's place under the router-wide cap.
    pub permit: ConnPermit,
}
