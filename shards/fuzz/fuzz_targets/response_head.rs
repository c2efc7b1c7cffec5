//! Response heads (agent links, backend client): never a panic; a head that
//! parses is written back and parses to the same status and headers.
#![no_main]
use libfuzzer_sys::fuzz_target;
use shards::logic::http::framing::http_parse::{parse_response_head, Headers};
use shards::logic::http::framing::http_write::{is_hop_header, write_response_head, OutFraming};

fuzz_target!(|data: &[u8]| {
    let Ok(Some((head, used))) = parse_response_head(data) else {
        return;
    };
    assert!(used <= data.len());
    let mut out = Vec::new();
    write_response_head(
        &mut out,
        head.status,
        head.headers.iter(),
        OutFraming::Chunked,
        true,
        &[],
    );
    let (again, n) = parse_response_head(&out)
        .expect("our own head parses")
        .expect("complete");
    assert_eq!(n, out.len());
    assert_eq!(again.status, head.status);
    let keep = |h: &Headers| -> Vec<(String, Vec<u8>)> {
        h.iter()
            .filter(|(n, _)| !is_hop_header(n))
            .map(|(n, v)| (n.to_string(), v.to_vec()))
            .collect()
    };
    assert_eq!(keep(&again.headers), keep(&head.headers));
});
