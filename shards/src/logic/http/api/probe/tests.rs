use super::*;
use proptest::prelude::*;

#[test]
fn extracts_model_and_stream() {
    let m = probe(br#"{"messages":[{"role":"user","content":"hi"}],"model":"m1","stream":true,"x":{"y":[1,2]}}"#)
        .expect("ok");
    assert_eq!(m.model, "m1");
    assert!(m.stream);
}

#[test]
fn counts_what_the_estimate_needs() {
    let m = probe(br#"{"model":"m","max_tokens":7,"max_completion_tokens":9,
        "system":[{"type":"text","text":"sys!"}],
        "tools":[{"a":1}],
        "messages":[{"role":"user","content":"hello"},
          {"role":"user","content":[{"type":"text","text":"abc"},{"type":"image_url","image_url":{"url":"x"}},{"type":"image"}]},
          {"role":"assistant","content":null}]}"#)
    .expect("ok");
    assert_eq!(m.messages, 3);
    assert_eq!(m.images, 2);
    assert_eq!(m.text_bytes, 5 + 3 + 4 + r#"[{"a":1}]"#.len() as u64);
    assert_eq!(m.declared_output, 9);
    assert_eq!(m.estimate(COLD_TOKENS_PER_BYTE), 12);
    let m =
        probe(br#"{"model":"m","max_tokens":-3,"system":"abcdefgh","messages":[]}"#).expect("ok");
    assert_eq!(
        (m.declared_output, m.text_bytes, m.estimate(0.5)),
        (0, 8, 4)
    );
    // Floor of 4 tokens per message.
    let m = probe(br#"{"model":"m","messages":[{"content":""},{"content":"a"}]}"#).expect("ok");
    assert_eq!(m.estimate(COLD_TOKENS_PER_BYTE), 8);
    // Content that is neither a string nor parts is refused (spec 01 §3).
    assert_eq!(
        probe(br#"{"model":"m","messages":[{"content":5}]}"#)
            .expect_err("e")
            .status,
        400
    );
    assert_eq!(
        probe(br#"{"model":"m","max_tokens":1.5}"#)
            .expect_err("e")
            .status,
        400
    );
    assert_eq!(
        probe(br#"{"model":"m","messages":{}}"#)
            .expect_err("e")
            .status,
        400
    );
}

#[test]
fn escaped_model_is_unescaped() {
    assert_eq!(probe(br#"{"model":"a\/b"}"#).expect("ok").model, "a/b");
}

#[test]
fn errors() {
    assert_eq!(probe(b"not json").expect_err("bad").status, 400);
    assert_eq!(
        probe(br#"{"model":""}"#).expect_err("e").message,
        "model field is required"
    );
    assert_eq!(
        probe(br#"{}"#).expect_err("e").message,
        "model field is required"
    );
    assert_eq!(
        probe(br#"{"model":"m","stream":"yes"}"#)
            .expect_err("e")
            .status,
        400
    );
    assert_eq!(probe(br#"[1]"#).expect_err("e").status, 400);
    let long = format!(r#"{{"model":"{}"}}"#, "a".repeat(257));
    assert!(probe(long.as_bytes())
        .expect_err("e")
        .message
        .contains("256"));
}

#[test]
fn model_is_replaced_in_place() {
    let body =
        br#"{"messages":[{"content":"model \"x\" {"}],"model" : "alias", "n":{"model":"inner"}}"#;
    let out = replace_model(body, "real/m").expect("replaced");
    assert_eq!(
        std::str::from_utf8(&out).expect("utf8"),
        r#"{"messages":[{"content":"model \"x\" {"}],"model" : "real/m", "n":{"model":"inner"}}"#
    );
    // The last top-level occurrence wins, like a decoder.
    let out = replace_model(br#"{"model":"a","model":"b"}"#, "c").expect("r");
    assert_eq!(&out[..], br#"{"model":"a","model":"c"}"#);
    let out = replace_model(br#"{"mod\u0065l":"a"}"#, "c").expect("r");
    assert_eq!(&out[..], br#"{"mod\u0065l":"c"}"#);
    assert!(replace_model(b"[1]", "c").is_none());
    assert!(replace_model(br#"{"x":1}"#, "c").is_none());
}

proptest! {
    #[test]
    fn replacing_keeps_the_rest_of_a_valid_body(m in "[a-z]{1,10}", n in "[a-z]{1,10}", extra in 0u32..1000) {
        let body = serde_json::json!({"a": [1, {"model": "x"}], "model": m, "z": extra}).to_string();
        let out = replace_model(body.as_bytes(), &n).expect("replaced");
        let v: serde_json::Value = serde_json::from_slice(&out).expect("still JSON");
        prop_assert_eq!(v["model"].as_str(), Some(n.as_str()));
        prop_assert_eq!(v["a"][1]["model"].as_str(), Some("x"));
        prop_assert_eq!(v["z"].as_u64(), Some(u64::from(extra)));
    }

    #[test]
    fn replace_never_panics(b in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = replace_model(&b, "m");
    }

    #[test]
    fn never_panics(b in proptest::collection::vec(any::<u8>(), 0..500)) {
        let _ = probe(&b);
    }

    #[test]
    fn model_round_trips(m in "[a-zA-Z0-9/._:-]{1,100}") {
        let body = serde_json::json!({"model": m, "messages": []}).to_string();
        prop_assert_eq!(probe(body.as_bytes()).expect("ok").model, m);
    }
}
