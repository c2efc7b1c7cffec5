use super::*;
use proptest::prelude::*;
use serde_json::json;

fn record(id: &str, prev: Option<&str>, said: &str, answered: &str) -> Record {
    Record {
        id: id.into(),
        model: "m".into(),
        created_at: 1,
        previous_response_id: prev.map(String::from),
        instructions: None,
        input: vec![json!({"role": "user", "content": said})],
        output: vec![
            json!({"type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": answered, "annotations": []}]}),
        ],
        usage: None,
        status: "completed".into(),
    }
}

#[test]
fn a_request_is_read_with_the_apis_defaults_and_errors() {
    let r = parse_request(br#"{"model":"m","input":"hi"}"#).expect("ok");
    assert_eq!((r.previous.as_deref(), r.store), (None, true));
    assert_eq!(r.input, vec![json!({"role": "user", "content": "hi"})]);
    let r = parse_request(
        br#"{"model":"m","input":[{"role":"user","content":"x"}],"previous_response_id":"resp_1","store":false}"#,
    )
    .expect("ok");
    assert_eq!((r.previous.as_deref(), r.store), (Some("resp_1"), false));
    for (bad, says) in [
        (&br#"[1]"#[..], "object"),
        (br#"{"model":"m"}"#, "'input' is required"),
        (br#"{"model":"m","input":3}"#, "string or an array"),
        (br#"{"model":"m","input":[3]}"#, "input[0]"),
        (br#"{"model":"m","input":"x","store":"yes"}"#, "'store'"),
        (
            br#"{"model":"m","input":"x","previous_response_id":7}"#,
            "must be a string",
        ),
        (
            br#"{"model":"m","input":"x","previous_response_id":"a/b"}"#,
            "response ID",
        ),
        (
            br#"{"model":"m","input":"x","conversation":"c"}"#,
            "conversation ID",
        ),
        (
            br#"{"model":"m","input":"x","conversation":3}"#,
            "'conversation' must be",
        ),
        (
            br#"{"model":"m","input":"x","conversation":{"id":"conv_1"},"previous_response_id":"resp_1"}"#,
            "cannot be used together",
        ),
        (b"{", "Invalid request"),
    ] {
        let e = parse_request(bad).expect_err("refused");
        assert!(e.contains(says), "{e}");
    }
}

#[test]
fn a_conversation_is_named_by_id_or_object_and_never_reaches_the_engine() {
    for body in [
        &br#"{"model":"m","input":"x","conversation":"conv_ab"}"#[..],
        br#"{"model":"m","input":"x","conversation":{"id":"conv_ab"}}"#,
    ] {
        let r = parse_request(body).expect("ok");
        assert_eq!(r.conversation.as_deref(), Some("conv_ab"));
        let c = crate::logic::http::api::conversations::Conversation::new(
            "conv_ab".into(),
            1,
            serde_json::json!({}),
            vec![serde_json::json!({"role": "user", "content": "before"})],
        );
        let chain = vec![crate::logic::http::api::conversations::as_turn(&c)];
        let (out, root) = expanded_body(&r, &chain).expect("expanded");
        let v: serde_json::Value = serde_json::from_slice(&out).expect("json");
        assert!(v.get("conversation").is_none(), "{v}");
        assert_eq!(v["input"][0]["content"], "before");
        assert_eq!(v["input"][1]["content"], "x");
        assert_eq!(root.as_deref(), Some("conv_ab"));
    }
}

#[test]
fn the_engine_gets_the_whole_conversation_and_no_state_to_keep() {
    let chain = [
        record("resp_a", None, "one", "uno"),
        record("resp_b", Some("resp_a"), "two", "dos"),
    ];
    let req = parse_request(
        br#"{"model":"m","input":"three","previous_response_id":"resp_b","instructions":"be brief"}"#,
    )
    .expect("ok");
    let raw: Vec<Vec<u8>> = chain
        .iter()
        .map(|r| serde_json::to_vec(r).expect("json"))
        .collect();
    let (body, root) = expanded_body(&req, &raw).expect("rebuilt");
    assert_eq!(root.as_deref(), Some("resp_a"));
    let v: Value = serde_json::from_slice(&body).expect("json");
    let texts: Vec<String> = v["input"]
        .as_array()
        .expect("items")
        .iter()
        .map(|i| {
            i["content"]
                .as_str()
                .map(String::from)
                .unwrap_or_else(|| i["content"][0]["text"].as_str().unwrap_or("").into())
        })
        .collect();
    assert_eq!(texts, ["one", "uno", "two", "dos", "three"]);
    assert!(v.get("previous_response_id").is_none());
    assert_eq!(v["store"], false);
    assert_eq!(
        v["instructions"], "be brief",
        "this turn's instructions only"
    );
    // Without a chain the input stays as the client wrote it.
    let first = parse_request(br#"{"model":"m","input":"hi"}"#).expect("ok");
    let v: Value =
        serde_json::from_slice(&expanded_body(&first, &[]).expect("body").0).expect("json");
    assert_eq!(
        (v["input"].clone(), v["store"].clone()),
        (json!("hi"), json!(false))
    );
}

/// llama-server's stream (tools/server/server-task.cpp), cut anywhere.
const STREAM: &str = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_engine\",\"object\":\"response\",\"status\":\"in_progress\"}}\n\nevent: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"item_id\":\"msg_1\",\"delta\":\"Hi\"}\n\nevent: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_engine\",\"object\":\"response\",\"status\":\"completed\",\"output\":[{\"type\":\"message\",\"id\":\"msg_1\",\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\",\"text\":\"Hi\"}]}],\"usage\":{\"input_tokens\":5,\"output_tokens\":1,\"total_tokens\":6}}}\n\n";

#[test]
fn a_record_that_is_not_one_is_refused_not_sent() {
    let req =
        parse_request(br#"{"model":"m","input":"x","previous_response_id":"resp_a"}"#).expect("ok");
    assert!(expanded_body(&req, &[b"{\"id\":1}".to_vec()]).is_err());
}

#[test]
fn a_stream_gets_the_routers_id_and_its_end_is_kept_wherever_it_is_cut() {
    for cut in [1, 7, 60, 150, STREAM.len() - 3] {
        let mut tap = Tap::new("resp_ours".into(), Some("resp_prev".into()), true);
        let mut out = Vec::new();
        tap.feed(&STREAM.as_bytes()[..cut], &mut out);
        tap.feed(&STREAM.as_bytes()[cut..], &mut out);
        tap.finish(&mut out);
        let text = String::from_utf8(out).expect("utf8");
        assert!(!text.contains("resp_engine"), "cut {cut}: {text}");
        assert_eq!(text.matches("resp_ours").count(), 2, "cut {cut}");
        assert!(text.contains("\"previous_response_id\":\"resp_prev\""));
        assert!(
            text.contains(
                "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\""
            ),
            "other events unchanged"
        );
        let done = tap.done.as_ref().expect("the end kept");
        assert_eq!(done.status, "completed");
        assert_eq!(done.output[0]["content"][0]["text"], "Hi");
        assert_eq!(
            done.usage.as_ref().map(|u| u["output_tokens"].clone()),
            Some(json!(1))
        );
    }
}

#[test]
fn a_whole_body_gets_the_routers_id_and_anything_else_passes() {
    let mut tap = Tap::new("resp_ours".into(), None, true);
    let body = br#"{"id":"resp_engine","object":"response","status":"completed","store":false,"output":[],"usage":{"input_tokens":1}}"#;
    let v: Value = serde_json::from_slice(&tap.body(body).expect("rewritten")).expect("json");
    assert_eq!(
        (v["id"].clone(), v["store"].clone()),
        (json!("resp_ours"), json!(true))
    );
    assert!(tap.done.is_some());
    let mut tap = Tap::new("resp_ours".into(), None, true);
    assert_eq!(tap.body(br#"{"error":{"message":"x"}}"#), None);
    assert!(tap.done.is_none());
}

#[test]
fn input_items_have_ids_and_types() {
    let r = record("resp_abc", None, "hello", "hi");
    let v = input_items(&r);
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["type"], "message");
    assert_eq!(v["data"][0]["content"][0]["text"], "hello");
    assert_eq!(v["first_id"], v["data"][0]["id"]);
    assert_eq!(render(&r)["object"], "response");
}

proptest! {
    /// Any bytes in any pieces: no panic, and what is not a response
    /// event passes unchanged.
    #[test]
    fn the_tap_never_panics_and_keeps_other_bytes(data in proptest::collection::vec(any::<u8>(), 0..400), cut in 0usize..400) {
        let mut tap = Tap::new("resp_x".into(), None, true);
        let mut out = Vec::new();
        let cut = cut.min(data.len());
        tap.feed(&data[..cut], &mut out);
        tap.feed(&data[cut..], &mut out);
        tap.finish(&mut out);
        if memchr::memmem::find(&data, b"\"response\"").is_none() {
            prop_assert_eq!(out, data);
        }
    }

    #[test]
    fn parsing_never_panics(body in ".{0,200}") {
        let _ = parse_request(body.as_bytes());
    }
}
