//! Request heads: never a panic; a head that parses is written back by the
//! router's writer and parses again to the same method, path, framing and
//! (forwardable) headers.
#![no_main]
use libfuzzer_sys::fuzz_target;
use shards::logic::http::framing::http_parse::{
    parse_forwarded_request_head, parse_request_head, BodyFraming, Headers,
};
use shards::logic::http::framing::http_write::{is_hop_header, write_request_head_from, OutFraming};

fuzz_target!(|data: &[u8]| {
    let Ok(Some((head, used))) = parse_request_head(data) else {
        return;
    };
    assert!(used <= data.len());
    let len = match head.framing {
        BodyFraming::Length(n) => n.min(1 << 20) as usize,
        _ => 0,
    };
    let mut out = Vec::new();
    write_request_head_from(
        &mut out,
        &head.method,
        &head.path,
        "agent",
        head.headers.iter(),
        OutFraming::Length(len),
    );
    let (again, n) = parse_forwarded_request_head(&out)
        .expect("our own head parses")
        .expect("complete");
    assert_eq!(n, out.len());
    assert_eq!(again.method, head.method);
    assert_eq!(again.path, head.path);
    let keep = |h: &Headers| -> Vec<(String, Vec<u8>)> {
        h.iter()
            .filter(|(n, _)| {
                !is_hop_header(n)
                    && !n.eq_ignore_ascii_case("host")
                    && !n.eq_ignore_ascii_case("expect")
            })
            .map(|(n, v)| (n.to_string(), v.to_vec()))
            .collect()
    };
    assert_eq!(keep(&again.headers), keep(&head.headers));
});
