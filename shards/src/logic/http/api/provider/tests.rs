use super::*;
use crate::logic::http::api::usage::SseUsage;

fn base(s: &str) -> BaseUrl {
    BaseUrl::parse(s).expect("base URL")
}

fn body_of(req: &ProviderRequest) -> Value {
    let text = String::from_utf8_lossy(&req.bytes).into_owned();
    let (_, body) = text.split_once("\r\n\r\n").expect("head and body");
    serde_json::from_str(body).expect("json body")
}

#[test]
fn base_urls_parse_and_refuse() {
    assert_eq!(
        base("https://api.openai.com"),
        BaseUrl {
            tls: true,
            host: "api.openai.com".into(),
            port: 443,
            prefix: String::new()
        }
    );
    let b = base("http://127.0.0.1:8081/proxy/");
    assert_eq!((b.tls, b.port, b.prefix.as_str()), (false, 8081, "/proxy"));
    assert_eq!(b.host_header(), "127.0.0.1:8081");
    assert_eq!(base("http://[::1]:9/").host, "::1");
    assert_eq!(base("http://[::1]:9/").host_header(), "[::1]:9");
    for bad in [
        "ftp://x",
        "api.openai.com",
        "http://",
        "http://h:0",
        "http://h:x",
        "http://a b",
        "http://h/?q",
        "http://u@h",
        "http://h\u{7f}",
    ] {
        assert!(BaseUrl::parse(bad).is_err(), "{bad:?} accepted");
    }
}

#[test]
fn same_api_requests_pass_through_with_the_model_replaced() {
    let b = base("https://api.openai.com");
    let r = build_request(
        Engine::OpenAi,
        "gpt-4o-mini",
        &b,
        "sk-x",
        Api::Chat,
        br#"{"model":"local","messages":[{"role":"user","content":"hi"}],"stream":true,"seed":7}"#,
    )
    .expect("request");
    let head = String::from_utf8_lossy(&r.bytes).into_owned();
    assert!(
        head.starts_with("POST /v1/chat/completions HTTP/1.1\r\nHost: api.openai.com\r\n"),
        "{head}"
    );
    assert!(head.contains("Authorization: Bearer sk-x\r\n"));
    let v = body_of(&r);
    assert_eq!(v["model"], "gpt-4o-mini");
    assert_eq!(v["seed"], 7, "other fields kept");
    assert_eq!(
        v["stream_options"]["include_usage"], true,
        "usage asked for"
    );
    assert!(r.stream && !r.translated);

    let a = build_request(
        Engine::Anthropic,
        "claude-x",
        &base("http://127.0.0.1:9/a"),
        "ak",
        Api::Messages,
        br#"{"model":"local","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#,
    )
    .expect("request");
    let head = String::from_utf8_lossy(&a.bytes).into_owned();
    assert!(
        head.starts_with("POST /a/v1/messages HTTP/1.1\r\n"),
        "{head}"
    );
    assert!(head.contains("x-api-key: ak\r\nanthropic-version: 2023-06-01\r\n"));
    assert_eq!(body_of(&a)["model"], "claude-x");
}

#[test]
fn chat_becomes_messages_as_the_spec_says() {
    let r = build_request(
        Engine::Anthropic,
        "claude-x",
        &base("https://api.anthropic.com"),
        "ak",
        Api::Chat,
        br#"{"model":"m","temperature":0.5,"stop":"END","messages":[
            {"role":"system","content":"be brief"},
            {"role":"system","content":[{"type":"text","text":"and kind"}]},
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
            {"role":"assistant","content":"c"}]}"#,
    )
    .expect("request");
    let v = body_of(&r);
    assert_eq!(v["system"], "be brief\nand kind");
    assert_eq!(v["max_tokens"], 4096, "the spec's default");
    assert_eq!(
        v["messages"],
        json!([{"role":"user","content":"ab"},{"role":"assistant","content":"c"}])
    );
    assert_eq!(v["temperature"], 0.5);
    assert_eq!(v["stop_sequences"], json!(["END"]));
    assert!(r.translated);
    let only_system = build_request(
        Engine::Anthropic,
        "c",
        &base("https://x"),
        "k",
        Api::Chat,
        br#"{"messages":[{"role":"system","content":"s"}]}"#,
    );
    assert!(only_system.is_err());
    assert!(build_request(
        Engine::OpenAi,
        "c",
        &base("https://x"),
        "k",
        Api::Chat,
        b"{not json"
    )
    .is_err());
}

#[test]
fn messages_become_chat() {
    let r = build_request(
        Engine::OpenAi,
        "gpt",
        &base("https://x"),
        "k",
        Api::Messages,
        br#"{"model":"m","max_tokens":9,"system":[{"type":"text","text":"sys"}],"stream":true,
            "messages":[{"role":"user","content":[{"type":"text","text":"q"}]}]}"#,
    )
    .expect("request");
    let v = body_of(&r);
    assert_eq!(
        v["messages"],
        json!([{"role":"system","content":"sys"},{"role":"user","content":"q"}])
    );
    assert_eq!(v["max_tokens"], 9);
    assert_eq!(v["stream_options"]["include_usage"], true);
}

#[test]
fn answers_are_stamped_translated_and_never_empty() {
    let openai = br#"{"id":"c1","object":"chat.completion","model":"gpt","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#;
    let same: Value =
        serde_json::from_slice(&response_body(Engine::OpenAi, Api::Chat, openai).expect("ok"))
            .expect("json");
    assert_eq!(same["processed_by"], "provider:openai");
    assert_eq!(same["choices"][0]["message"]["content"], "hi");
    let as_msg: Value =
        serde_json::from_slice(&response_body(Engine::OpenAi, Api::Messages, openai).expect("ok"))
            .expect("json");
    assert_eq!(as_msg["content"][0]["text"], "hi");
    assert_eq!(as_msg["stop_reason"], "max_tokens");
    assert_eq!(as_msg["usage"], json!({"input_tokens":3,"output_tokens":2}));
    assert_eq!(as_msg["processed_by"], "provider:openai");

    let anthropic = br#"{"id":"m1","type":"message","model":"claude","content":[{"type":"tool_use"},{"type":"text","text":"yo"}],"stop_reason":"tool_use","usage":{"input_tokens":4,"output_tokens":1}}"#;
    let as_chat: Value = serde_json::from_slice(
        &response_body(Engine::Anthropic, Api::Chat, anthropic).expect("ok"),
    )
    .expect("json");
    assert_eq!(as_chat["object"], "chat.completion");
    assert_eq!(as_chat["choices"][0]["message"]["content"], "yo");
    assert_eq!(as_chat["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(as_chat["usage"]["total_tokens"], 5);
    assert_eq!(as_chat["processed_by"], "provider:anthropic");

    // The spec's empty 200 (08 A1) cannot happen: no choices, no text, no
    // JSON are errors.
    assert!(response_body(Engine::OpenAi, Api::Chat, br#"{"choices":[]}"#).is_err());
    assert!(response_body(Engine::Anthropic, Api::Chat, br#"{"content":[]}"#).is_err());
    assert!(response_body(Engine::OpenAi, Api::Chat, b"").is_err());
}

/// Anthropic's stream as OpenAI chunks, fed in pieces that split events
/// anywhere: text in order, finish reason, usage the meter reads, [DONE].
#[test]
fn anthropic_stream_becomes_openai_chunks() {
    let stream = concat!(
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m1\",\"model\":\"claude\",\"usage\":{\"input_tokens\":12,\"output_tokens\":1}}}\n\n",
        "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hel\"}}\n\n",
        "event: content_block_delta\r\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"lo\"}}\r\n\r\n",
        "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\"},\"usage\":{\"output_tokens\":7}}\n\n",
        "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
    );
    for step in [1, 7, stream.len()] {
        let mut t = StreamTranslator::new(Engine::Anthropic);
        let mut out = Vec::new();
        for piece in stream.as_bytes().chunks(step) {
            t.feed(piece, &mut out).expect("feed");
        }
        assert!(t.is_done());
        let text = String::from_utf8_lossy(&out).into_owned();
        let events: Vec<Value> = text
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).expect("chunk json"))
            .collect();
        let content: String = events
            .iter()
            .filter_map(|e| {
                e.pointer("/choices/0/delta/content")
                    .and_then(Value::as_str)
            })
            .collect();
        assert_eq!(content, "Hello", "step {step}");
        assert!(events
            .iter()
            .any(|e| e.pointer("/choices/0/finish_reason") == Some(&json!("length"))));
        assert!(text.ends_with("data: [DONE]\n\n"));
        let mut meter = SseUsage::default();
        meter.feed(&out);
        assert_eq!((meter.tokens.input, meter.tokens.output), (12, 7));
    }
}

#[test]
fn openai_stream_becomes_anthropic_events() {
    let stream = concat!(
        "data: {\"id\":\"c1\",\"model\":\"gpt\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c1\",\"model\":\"gpt\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c1\",\"model\":\"gpt\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
        "data: {\"id\":\"c1\",\"model\":\"gpt\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"total_tokens\":7}}\n\n",
        "data: [DONE]\n\n",
    );
    let mut t = StreamTranslator::new(Engine::OpenAi);
    let mut out = Vec::new();
    for piece in stream.as_bytes().chunks(5) {
        t.feed(piece, &mut out).expect("feed");
    }
    assert!(t.is_done());
    let text = String::from_utf8_lossy(&out).into_owned();
    let names: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    assert!(text.contains("\"text\":\"Hi\""));
    assert!(text.contains("\"stop_reason\":\"end_turn\""));
    let mut meter = SseUsage::default();
    meter.feed(&out);
    assert_eq!((meter.tokens.input, meter.tokens.output), (5, 2));
}

#[test]
fn an_endless_event_is_refused() {
    let mut t = StreamTranslator::new(Engine::Anthropic);
    let mut out = Vec::new();
    let big = vec![b'x'; MAX_EVENT + 1];
    assert!(t.feed(&big, &mut out).is_err());
}
