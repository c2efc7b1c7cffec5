//! OTLP/HTTP's protobuf body (`ExportTraceServiceRequest`,
//! opentelemetry-proto `trace/v1`), written by hand: one resource (the
//! process: `service.name` and the rest), one scope, the spans. No
//! generated code and no allocation per field: each nested message is
//! written after its length, measured first.
//!
//! Field numbers (trace.proto, common.proto, resource.proto):
//! ExportTraceServiceRequest.resource_spans = 1; ResourceSpans.resource = 1,
//! .scope_spans = 2; Resource.attributes = 1; ScopeSpans.scope = 1,
//! .spans = 2; InstrumentationScope.name = 1, .version = 2; Span.trace_id =
//! 1, .span_id = 2, .parent_span_id = 4, .name = 5, .kind = 6,
//! .start_time_unix_nano = 7 (fixed64), .end_time_unix_nano = 8 (fixed64),
//! .attributes = 9, .events = 11, .status = 15; Event.time_unix_nano = 1
//! (fixed64), .name = 2, .attributes = 3; Status.message = 2, .code = 3;
//! KeyValue.key = 1, .value = 2; AnyValue.string_value = 1, .bool_value =
//! 2, .int_value = 3, .double_value = 4.

use super::span::{Event, Span, Value};

const LEN: u8 = 2;
const VARINT: u8 = 0;
const FIXED64: u8 = 1;

fn varint(out: &mut Vec<u8>, mut n: u64) {
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

fn varint_len(mut n: u64) -> usize {
    let mut len = 1;
    while n >= 0x80 {
        n >>= 7;
        len += 1;
    }
    len
}

fn tag(out: &mut Vec<u8>, field: u8, wire: u8) {
    out.push((field << 3) | wire);
}

/// A length-delimited field's whole size from its content's.
fn field_len(content: usize) -> usize {
    1 + varint_len(content as u64) + content
}

fn bytes(out: &mut Vec<u8>, field: u8, b: &[u8]) {
    tag(out, field, LEN);
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn any_len(v: &Value) -> usize {
    match v {
        Value::Str(s) => field_len(s.len()),
        Value::Bool(_) => 2,
        Value::Int(n) => 1 + varint_len(*n as u64),
        Value::F64(_) => 9,
    }
}

fn any(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::Str(s) => bytes(out, 1, s.as_bytes()),
        Value::Bool(b) => {
            tag(out, 2, VARINT);
            out.push(u8::from(*b));
        }
        Value::Int(n) => {
            tag(out, 3, VARINT);
            // int64: two's complement as a 64-bit varint.
            varint(out, *n as u64);
        }
        Value::F64(x) => {
            tag(out, 4, FIXED64);
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
}

fn kv_len(key: &str, v: &Value) -> usize {
    field_len(key.len()) + field_len(any_len(v))
}

fn kv(out: &mut Vec<u8>, field: u8, key: &str, v: &Value) {
    let value_len = any_len(v);
    tag(out, field, LEN);
    varint(out, (field_len(key.len()) + field_len(value_len)) as u64);
    bytes(out, 1, key.as_bytes());
    tag(out, 2, LEN);
    varint(out, value_len as u64);
    any(out, v);
}

fn attrs_len(attrs: &[(&str, Value)]) -> usize {
    attrs.iter().map(|(k, v)| field_len(kv_len(k, v))).sum()
}

fn event_len(e: &Event) -> usize {
    9 + field_len(e.name.len()) + attrs_len(&e.attrs)
}

fn status_len(s: &Span) -> usize {
    match &s.error {
        Some(m) => field_len(m.len()) + 2,
        None => 0,
    }
}

fn span_len(s: &Span) -> usize {
    let mut n = field_len(16) + field_len(8);
    if s.parent.is_some() {
        n += field_len(8);
    }
    n += field_len(s.name.len()) + 2 + 9 + 9 + attrs_len(&s.attrs);
    n += s
        .events
        .iter()
        .map(|e| field_len(event_len(e)))
        .sum::<usize>();
    if s.error.is_some() {
        n += field_len(status_len(s));
    }
    n
}

fn span(out: &mut Vec<u8>, s: &Span, len: usize) {
    tag(out, 2, LEN);
    varint(out, len as u64);
    bytes(out, 1, &s.trace_id);
    bytes(out, 2, &s.span_id);
    if let Some(p) = &s.parent {
        bytes(out, 4, p);
    }
    bytes(out, 5, s.name.as_bytes());
    tag(out, 6, VARINT);
    out.push(s.kind as u8);
    tag(out, 7, FIXED64);
    out.extend_from_slice(&s.start.to_le_bytes());
    tag(out, 8, FIXED64);
    out.extend_from_slice(&s.end.to_le_bytes());
    for (k, v) in &s.attrs {
        kv(out, 9, k, v);
    }
    for e in &s.events {
        tag(out, 11, LEN);
        varint(out, event_len(e) as u64);
        tag(out, 1, FIXED64);
        out.extend_from_slice(&e.at.to_le_bytes());
        bytes(out, 2, e.name.as_bytes());
        for (k, v) in &e.attrs {
            kv(out, 3, k, v);
        }
    }
    if let Some(m) = &s.error {
        tag(out, 15, LEN);
        varint(out, status_len(s) as u64);
        bytes(out, 2, m.as_bytes());
        // STATUS_CODE_ERROR
        tag(out, 3, VARINT);
        out.push(2);
    }
}

/// The process that exports: its resource attributes and scope.
#[derive(Debug, Clone)]
pub struct Resource {
    /// `service.name` first, then the rest (`OTEL_RESOURCE_ATTRIBUTES`).
    pub attrs: Vec<(&'static str, Value)>,
    /// The instrumentation scope's name.
    pub scope: &'static str,
    /// Its version.
    pub version: &'static str,
}

/// One export request with `spans`, appended to `out`.
pub fn encode(resource: &Resource, spans: &[Span], out: &mut Vec<u8>) {
    let res_len = attrs_len(&resource.attrs);
    let scope_len = field_len(resource.scope.len()) + field_len(resource.version.len());
    // Each span measured once (its length is written before it).
    let lens: Vec<usize> = spans.iter().map(span_len).collect();
    let scope_spans_len = field_len(scope_len) + lens.iter().map(|n| field_len(*n)).sum::<usize>();
    let resource_spans_len = field_len(res_len) + field_len(scope_spans_len);
    out.reserve(field_len(resource_spans_len));
    // ExportTraceServiceRequest.resource_spans
    tag(out, 1, LEN);
    varint(out, resource_spans_len as u64);
    // ResourceSpans.resource
    tag(out, 1, LEN);
    varint(out, res_len as u64);
    for (k, v) in &resource.attrs {
        kv(out, 1, k, v);
    }
    // ResourceSpans.scope_spans
    tag(out, 2, LEN);
    varint(out, scope_spans_len as u64);
    tag(out, 1, LEN);
    varint(out, scope_len as u64);
    bytes(out, 1, resource.scope.as_bytes());
    bytes(out, 2, resource.version.as_bytes());
    for (s, len) in spans.iter().zip(lens) {
        span(out, s, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logic::trace::span::Kind;

    /// A minimal protobuf reader: the fields of one message.
    fn fields(mut b: &[u8]) -> Vec<(u8, Vec<u8>)> {
        let mut out = Vec::new();
        let read_varint = |b: &mut &[u8]| -> u64 {
            let (mut n, mut shift) = (0u64, 0);
            loop {
                let byte = b[0];
                *b = &b[1..];
                n |= u64::from(byte & 0x7f) << shift;
                if byte < 0x80 {
                    return n;
                }
                shift += 7;
            }
        };
        while !b.is_empty() {
            let t = read_varint(&mut b);
            let (field, wire) = ((t >> 3) as u8, (t & 7) as u8);
            let value = match wire {
                0 => read_varint(&mut b).to_le_bytes().to_vec(),
                1 => {
                    let v = b[..8].to_vec();
                    b = &b[8..];
                    v
                }
                2 => {
                    let n = read_varint(&mut b) as usize;
                    let v = b[..n].to_vec();
                    b = &b[n..];
                    v
                }
                w => panic!("wire type {w}"),
            };
            out.push((field, value));
        }
        out
    }

    fn one(fs: &[(u8, Vec<u8>)], field: u8) -> Vec<u8> {
        fs.iter()
            .find(|(f, _)| *f == field)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("field {field}"))
    }

    #[test]
    fn an_export_request_reads_back_field_by_field() {
        let mut s = Span::new(
            [7; 16],
            [8; 8],
            Some([9; 8]),
            "POST /v1/chat/completions",
            Kind::Server,
            1_000,
        );
        s.set("gen_ai.request.model", "m");
        s.set("gen_ai.usage.input_tokens", 300u64);
        s.set("hivenet.srtt_ms", 1.5);
        s.set("hivenet.held", true);
        s.set("negative", -1i64);
        s.events.push(Event {
            name: "keepalive",
            at: 1_500,
            attrs: vec![("n", Value::Int(1))],
        });
        s.end(2_000);
        s.fail("boom");
        let r = Resource {
            attrs: vec![("service.name", "hivenet-router".into())],
            scope: "hivenet",
            version: "1",
        };
        let mut out = Vec::new();
        encode(&r, &[s.clone(), s.clone()], &mut out);
        let top = fields(&out);
        assert_eq!(top.len(), 1);
        let rs = fields(&one(&top, 1));
        let resource = fields(&one(&rs, 1));
        let kv = fields(&one(&resource, 1));
        assert_eq!(one(&kv, 1), b"service.name");
        assert_eq!(fields(&one(&kv, 2)), vec![(1, b"hivenet-router".to_vec())]);
        let ss = fields(&one(&rs, 2));
        assert_eq!(ss.iter().filter(|(f, _)| *f == 2).count(), 2, "two spans");
        let sp = fields(&one(&ss, 2));
        assert_eq!(one(&sp, 1), vec![7; 16]);
        assert_eq!(one(&sp, 2), vec![8; 8]);
        assert_eq!(one(&sp, 4), vec![9; 8]);
        assert_eq!(one(&sp, 5), b"POST /v1/chat/completions");
        assert_eq!(one(&sp, 6)[0], 2, "server");
        assert_eq!(one(&sp, 7), 1_000u64.to_le_bytes());
        assert_eq!(one(&sp, 8), 2_000u64.to_le_bytes());
        let attrs: Vec<_> = sp
            .iter()
            .filter(|(f, _)| *f == 9)
            .map(|(_, v)| fields(v))
            .collect();
        assert_eq!(attrs.len(), 5);
        let value = |key: &[u8]| {
            let a = attrs.iter().find(|a| one(a, 1) == key).expect("key");
            fields(&one(a, 2))
        };
        assert_eq!(
            value(b"gen_ai.usage.input_tokens"),
            vec![(3, 300u64.to_le_bytes().to_vec())]
        );
        assert_eq!(
            value(b"hivenet.srtt_ms"),
            vec![(4, 1.5f64.to_le_bytes().to_vec())]
        );
        assert_eq!(
            value(b"hivenet.held"),
            vec![(2, 1u64.to_le_bytes().to_vec())]
        );
        assert_eq!(
            value(b"negative"),
            vec![(3, (-1i64 as u64).to_le_bytes().to_vec())]
        );
        let ev = fields(&one(&sp, 11));
        assert_eq!(one(&ev, 2), b"keepalive");
        let status = fields(&one(&sp, 15));
        assert_eq!(one(&status, 2), b"boom");
        assert_eq!(one(&status, 3)[0], 2, "error");
    }
}
