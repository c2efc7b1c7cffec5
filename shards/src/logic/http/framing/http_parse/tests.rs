use super::*;
use crate::logic::http::framing::chunked::has_bare_line_end;
use proptest::prelude::*;

#[test]
fn headers_keep_order_case_and_duplicates() {
    let mut h = Headers::default();
    assert!(h.is_empty());
    h.push("Content-Type", b"application/json");
    h.push("tracestate", b"a=1");
    h.push("X-Empty", b"");
    h.push("TraceState", b"b=2");
    assert_eq!(h.len(), 4);
    assert_eq!(h.get("content-type"), Some(&b"application/json"[..]));
    assert_eq!(h.get("x-empty"), Some(&b""[..]));
    assert_eq!(h.get("missing"), None);
    let all: Vec<&[u8]> = h.get_all("TRACESTATE").collect();
    assert_eq!(all, [&b"a=1"[..], &b"b=2"[..]]);
    let names: Vec<&str> = h.iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        ["Content-Type", "tracestate", "X-Empty", "TraceState"]
    );
    assert_eq!(Headers::from_pairs(h.iter()), h);
    // Parsed heads: one allocation per head, fields as sent.
    let (r, _) = parse_request_head(b"GET / HTTP/1.1\r\nHost: a\r\nX-A: 1\r\nx-a: 2\r\n\r\n")
        .expect("ok")
        .expect("complete");
    assert_eq!(
        r.header_values("X-A").collect::<Vec<_>>(),
        [&b"1"[..], &b"2"[..]]
    );
    assert_eq!(r.headers.iter().count(), 3);
}

fn req(s: &str) -> Result<Option<(RequestHead, usize)>, HeadError> {
    parse_request_head(s.as_bytes())
}

#[test]
fn simple_post() {
    let (h, n) =
        req("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
            .expect("ok")
            .expect("complete");
    assert_eq!(h.method, "POST");
    assert_eq!(h.framing, BodyFraming::Length(5));
    assert!(h.keep_alive);
    assert_eq!(
        n,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n".len()
    );
}

#[test]
fn incomplete_is_none() {
    assert_eq!(req("POST / HTTP/1.1\r\nHost: x\r\n"), Ok(None));
}

#[test]
fn cl_and_te_rejected() {
    assert!(matches!(
        req("POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"),
        Err(HeadError::Bad(_))
    ));
}

#[test]
fn te_other_than_chunked_rejected() {
    assert!(matches!(
        req("POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"),
        Err(HeadError::Bad(_))
    ));
}

#[test]
fn duplicate_cl_rejected() {
    assert!(matches!(
        req("POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n"),
        Err(HeadError::Bad(_))
    ));
    assert!(matches!(
        req("POST / HTTP/1.1\r\nContent-Length: +5\r\n\r\n"),
        Err(HeadError::Bad(_))
    ));
    assert!(matches!(
        req("POST / HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\n"),
        Err(HeadError::Bad(_))
    ));
}

#[test]
fn obs_fold_rejected() {
    assert!(matches!(
        req("POST / HTTP/1.1\r\nX-A: a\r\n b\r\n\r\n"),
        Err(HeadError::Bad(_))
    ));
}

#[test]
fn too_many_headers_431() {
    let mut s = String::from("GET / HTTP/1.1\r\n");
    for i in 0..101 {
        s.push_str(&format!("X-{i}: v\r\n"));
    }
    s.push_str("\r\n");
    assert!(matches!(req(&s), Err(HeadError::TooLarge(_))));
}

#[test]
fn oversize_head_431_before_complete() {
    let s = format!("GET / HTTP/1.1\r\nX: {}", "a".repeat(MAX_HEAD_BYTES + 1));
    assert!(matches!(req(&s), Err(HeadError::TooLarge(_))));
}

#[test]
fn connection_semantics() {
    let (h, _) = req("GET / HTTP/1.0\r\n\r\n").expect("ok").expect("c");
    assert!(!h.keep_alive);
    let (h, _) = req("GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        .expect("ok")
        .expect("c");
    assert!(!h.keep_alive);
    let (h, _) = req("GET / HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\n\r\n")
        .expect("ok")
        .expect("c");
    assert!(h.expect_continue);
}

#[test]
fn bare_lf_and_cr_are_refused_in_heads() {
    for bad in [
        "GET / HTTP/1.1\nHost: h\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: h\nX: 1\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: h\r\n\n",
        "GET / HTTP/1.1\r\nHost: h\rX: 1\r\n\r\n",
    ] {
        assert!(matches!(req(bad), Err(HeadError::Bad(_))), "{bad:?}");
    }
    // Refused before the head is complete: no waiting for a CRLFCRLF
    // that a bare-LF sender never writes.
    assert!(matches!(
        req("GET / HTTP/1.1\nHost"),
        Err(HeadError::Bad(_))
    ));
    assert!(
        matches!(req("GET / HTTP/1.1\r"), Ok(None)),
        "CR may await its LF"
    );
    assert!(matches!(
        parse_response_head(b"HTTP/1.1 200 OK\nContent-Length: 0\r\n\r\n"),
        Err(HeadError::Bad(_))
    ));
}

#[test]
fn status_codes_are_three_digits_in_range() {
    // Found by the response_head fuzz target.
    assert!(parse_response_head(b"HTTP/1.1 020 OK\r\n\r\n").is_err());
    assert!(parse_response_head(b"HTTP/1.1 600 X\r\n\r\n").is_err());
    assert!(parse_response_head(b"HTTP/1.1 599 X\r\n\r\n").is_ok());
}

#[test]
fn host_rules_and_absolute_form() {
    assert!(matches!(
        req("GET / HTTP/1.1\r\n\r\n"),
        Err(HeadError::Bad(_))
    ));
    assert!(matches!(
        req("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"),
        Err(HeadError::Bad(_))
    ));
    let (h, _) =
        req("POST http://router:8080/v1/chat/completions?x=1 HTTP/1.1\r\nHost: router\r\n\r\n")
            .expect("ok")
            .expect("c");
    assert_eq!(h.path, "/v1/chat/completions?x=1");
    assert_eq!(h.path_only(), "/v1/chat/completions");
    let (h, _) = req("GET HTTPS://r?q HTTP/1.1\r\nHost: r\r\n\r\n")
        .expect("ok")
        .expect("c");
    assert_eq!(h.path, "/?q");
    let (h, _) = req("GET http://r HTTP/1.1\r\nHost: r\r\n\r\n")
        .expect("ok")
        .expect("c");
    assert_eq!(h.path, "/");
}

#[test]
fn forwarded_heads_allow_the_routers_headers() {
    let mut s = String::from("POST / HTTP/1.1\r\nHost: h\r\n");
    for i in 0..(MAX_HEADERS + 1) {
        s.push_str(&format!("X-{i}: v\r\n"));
    }
    s.push_str("\r\n");
    assert!(matches!(req(&s), Err(HeadError::TooLarge(_))));
    assert!(parse_forwarded_request_head(s.as_bytes())
        .expect("ok")
        .is_some());
    assert_eq!(
        HeadError::TooLarge("too many header fields").to_string(),
        "head too large: too many header fields",
        "no debug text"
    );
}

#[test]
fn chunk_lines_follow_rfc_9112() {
    let ok = |input: &[u8]| {
        let mut d = ChunkedDecoder::new();
        let mut out = Vec::new();
        d.decode(input, &mut out, 0).map(|_| (d.is_done(), out))
    };
    assert_eq!(
        ok(b"5 ;a=b\r\nhello\r\n0\r\n\r\n").expect("BWS before ;"),
        (true, b"hello".to_vec())
    );
    assert_eq!(
        ok(b"5;a=\"q s\"\r\nhello\r\n0\r\n\r\n")
            .expect("quoted ext")
            .1,
        b"hello".to_vec()
    );
    for bad in [
        &b" 5\r\nhello\r\n0\r\n\r\n"[..],
        b"5;a\nb\r\nhello\r\n0\r\n\r\n",
        b"5\nhello\r\n0\r\n\r\n",
        b"5 \r\nhello\r\n0\r\n\r\n",
        b"5x\r\nhello\r\n0\r\n\r\n",
        b"5;\x01\r\nhello\r\n0\r\n\r\n",
        b"5\r\nhello\r\n0\r\nX: 1\n\r\n",
        b"5\r\nhello\r\n0\r\nX: 1\rY\r\n\r\n",
    ] {
        assert_eq!(
            ok(bad),
            Err(ChunkError::Bad),
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
    // A bare LF is refused as soon as it arrives.
    let mut d = ChunkedDecoder::new();
    assert_eq!(d.decode(b"5\n", &mut Vec::new(), 0), Err(ChunkError::Bad));
}

#[test]
fn chunked_decoding() {
    let mut d = ChunkedDecoder::new();
    let mut out = Vec::new();
    let input = b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-T: 1\r\n\r\nNEXT";
    let n = d.decode(input, &mut out, 0).expect("ok");
    assert!(d.is_done());
    assert_eq!(out, b"hello world");
    assert_eq!(&input[n..], b"NEXT");
}

#[test]
fn chunked_limit() {
    let mut d = ChunkedDecoder::new();
    let mut out = Vec::new();
    assert_eq!(d.decode(b"10\r\n", &mut out, 8), Err(ChunkError::TooLarge));
    let mut d = ChunkedDecoder::new();
    assert_eq!(d.decode(b"zz\r\n", &mut out, 0), Err(ChunkError::Bad));
}

#[test]
fn response_framing() {
    let (h, _) = parse_response_head(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
        .expect("ok")
        .expect("c");
    assert_eq!(h.framing, BodyFraming::UntilClose);
    assert!(h.is_event_stream());
    let (h, _) = parse_response_head(b"HTTP/1.1 204 No Content\r\n\r\n")
        .expect("ok")
        .expect("c");
    assert_eq!(h.framing, BodyFraming::None);
}

/// The scans [`scan_head`] replaced, as they were.
fn scan_reference(buf: &[u8]) -> HeadScan {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4);
    let scanned = buf.get(..end.unwrap_or(buf.len())).unwrap_or(&[]);
    if has_bare_line_end(scanned) {
        return HeadScan {
            end: None,
            bare: true,
            folded: false,
        };
    }
    HeadScan {
        end,
        bare: false,
        folded: end.is_some_and(|e| has_obs_fold(&buf[..e])),
    }
}

#[test]
fn one_pass_head_scan_cases() {
    for (buf, end, bare, folded) in [
        (
            &b"GET / HTTP/1.1\r\nHost: a\r\n\r\nbody"[..],
            Some(27),
            false,
            false,
        ),
        (b"GET / HTTP/1.1\r\nHost: a\r\n", None, false, false),
        (b"GET / HTTP/1.1\r\nHost: a\r\n\r", None, false, false),
        (b"GET / HTTP/1.1\nHost: a\r\n\r\n", None, true, false),
        (b"GET / HTTP/1.1\r\nHost: a\rb\r\n\r\n", None, true, false),
        (
            b"GET / HTTP/1.1\r\nA: b\r\n c\r\n\r\n",
            Some(28),
            false,
            true,
        ),
        (b"\r\n\r\n", Some(4), false, false),
        (b"\n", None, true, false),
        (
            b"GET / HTTP/1.1\r\nHost: a\r\n\r\n\n\r x",
            Some(27),
            false,
            false,
        ),
    ] {
        let got = scan_head(buf);
        let want = HeadScan { end, bare, folded };
        // Where the reference found a bare line end it stopped looking
        // for folds: only the verdict is compared then.
        assert_eq!((got.end, got.bare), (want.end, want.bare), "{buf:?}");
        if !bare {
            assert_eq!(got.folded, folded, "{buf:?}");
        }
        let r = scan_reference(buf);
        assert_eq!(
            (r.end, r.bare, r.folded || bare),
            (end, bare, folded || bare)
        );
    }
}

proptest! {
    /// The one-pass scan agrees with the byte-by-byte scans it
    /// replaced on buffers rich in CR, LF, SP and HT.
    #[test]
    fn one_pass_head_scan_matches_the_reference(
        buf in proptest::collection::vec(prop_oneof![
            Just(b'\r'), Just(b'\n'), Just(b' '), Just(b'\t'), Just(b'a'), any::<u8>()
        ], 0..80)
    ) {
        let got = scan_head(&buf);
        let want = scan_reference(&buf);
        prop_assert_eq!((got.end, got.bare), (want.end, want.bare));
        if !want.bare {
            prop_assert_eq!(got.folded && got.end.is_some(), want.folded);
        }
    }

    /// Any split of a chunked body into two feeds decodes the same.
    #[test]
    fn chunked_split_invariant(payload in proptest::collection::vec(any::<u8>(), 0..300), chunk in 1usize..50, split in 0usize..400) {
        let mut enc = Vec::new();
        for c in payload.chunks(chunk) {
            enc.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
            enc.extend_from_slice(c);
            enc.extend_from_slice(b"\r\n");
        }
        enc.extend_from_slice(b"0\r\n\r\n");
        let split = split.min(enc.len());
        let mut d = ChunkedDecoder::new();
        let mut out = Vec::new();
        let mut buf = enc[..split].to_vec();
        let n = d.decode(&buf, &mut out, 0).expect("first");
        buf.drain(..n);
        buf.extend_from_slice(&enc[split..]);
        let n2 = d.decode(&buf, &mut out, 0).expect("second");
        prop_assert!(d.is_done());
        prop_assert_eq!(n2, buf.len());
        prop_assert_eq!(out, payload);
    }

    /// The parser never panics on arbitrary bytes.
    #[test]
    fn request_parser_total(bytes in proptest::collection::vec(any::<u8>(), 0..2000)) {
        let _ = parse_request_head(&bytes);
        let _ = parse_response_head(&bytes);
        let mut d = ChunkedDecoder::new();
        let _ = d.decode(&bytes, &mut Vec::new(), 100);
    }

    /// A valid head split anywhere is either incomplete or parsed whole.
    #[test]
    fn head_prefixes(cut in 0usize..80) {
        let full = b"POST /v1/embeddings HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}";
        let cut = cut.min(full.len());
        match parse_request_head(&full[..cut]) {
            Ok(None) => prop_assert!(cut < full.len() - 2),
            Ok(Some((h, n))) => { prop_assert_eq!(n, full.len() - 2); prop_assert_eq!(h.framing, BodyFraming::Length(2)); }
            Err(e) => prop_assert!(false, "unexpected {:?}", e),
        }
    }
}
