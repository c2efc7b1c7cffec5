use super::*;
use proptest::prelude::*;

fn chunk(id: &str, delta: &str, finish: Option<&str>) -> String {
    let f = finish.map_or("null".to_string(), |f| format!("\"{f}\""));
    format!(
        "data: {{\"id\":\"{id}\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"finish_reason\":{f}}}]}}\n\n"
    )
}

/// An OpenAI stream of `id` that says `pieces`, from its role delta to
/// `[DONE]` (`end`: with its final chunk).
fn openai_stream(id: &str, pieces: &[&str], end: bool) -> String {
    let mut s = chunk(id, r#"{"role":"assistant","content":""}"#, None);
    for p in pieces {
        let text = serde_json::to_string(p).unwrap_or_default();
        s += &chunk(id, &format!("{{\"content\":{text}}}"), None);
    }
    if end {
        s += &chunk(id, "{}", Some("stop"));
        s += "data: [DONE]\n\n";
    }
    s
}

#[test]
fn only_plain_text_streams_are_eligible() {
    let ok =
        br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}],"tools":[]}"#;
    assert_eq!(eligible(Api::OpenAi, ok), Ok(()));
    let text_parts =
        br#"{"stream":true,"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#;
    assert_eq!(eligible(Api::Anthropic, text_parts), Ok(()));
    let cases: [(&[u8], Refusal); 7] = [
        (br#"{"messages":[]}"#, Refusal::NotStreamed),
        (br#"{"stream":true,"messages":[],"tools":[{"type":"function"}]}"#, Refusal::Tools),
        (br#"{"stream":true,"messages":[],"logprobs":true}"#, Refusal::Logprobs),
        (br#"{"stream":true,"messages":[],"n":2}"#, Refusal::SeveralChoices),
        (
            br#"{"stream":true,"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
            Refusal::Images,
        ),
        (b"not json", Refusal::Malformed),
        (b"[1]", Refusal::Malformed),
    ];
    for (body, want) in cases {
        assert_eq!(
            eligible(Api::OpenAi, body),
            Err(want),
            "{}",
            String::from_utf8_lossy(body)
        );
    }
}

#[test]
fn engines_say_how_they_continue() {
    assert_eq!(prefill_for("vllm"), Some(Prefill::ContinueFinalMessage));
    assert_eq!(prefill_for("sglang"), Some(Prefill::ContinueFinalMessage));
    assert_eq!(prefill_for("llamacpp"), Some(Prefill::LastAssistant));
    assert_eq!(prefill_for("ollama"), None);
    assert_eq!(prefill_for("openai"), None);
    assert_eq!(Refusal::Engine.label(), "engine_cannot_continue");
}

#[test]
fn the_transcript_keeps_the_id_the_text_and_the_end() {
    let mut t = Transcript::default();
    t.feed(
        Api::OpenAi,
        openai_stream("chatcmpl-1", &["Hel", "lo", " \"world\""], false).as_bytes(),
    );
    assert_eq!(t.id.as_deref(), Some("chatcmpl-1"));
    assert_eq!(t.text, "Hello \"world\"");
    assert_eq!((t.deltas, t.done, t.not_text), (3, false, false));
    t.feed(Api::OpenAi, b"data: [DONE]\n\n");
    assert!(t.done);
    let mut tool = Transcript::default();
    tool.feed(
        Api::OpenAi,
        chunk(
            "c",
            r#"{"tool_calls":[{"index":0,"function":{"name":"f"}}]}"#,
            None,
        )
        .as_bytes(),
    );
    assert!(tool.not_text);
    let anthropic = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"role\":\"assistant\"}}\n\n\
event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n\
event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n";
    let mut a = Transcript::default();
    a.feed(Api::Anthropic, anthropic.as_bytes());
    assert_eq!(
        (a.id.as_deref(), a.text.as_str(), a.deltas),
        (Some("msg_1"), "Hi", 1)
    );
    a.feed(
        Api::Anthropic,
        b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
    );
    assert!(a.done && !a.not_text);
    let mut a_tool = Transcript::default();
    a_tool.feed(
        Api::Anthropic,
        b"data: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"tool_use\"}}\n",
    );
    assert!(a_tool.not_text);
}

#[test]
fn the_continuation_asks_for_the_rest_only() {
    let body = br#"{"model":"m","stream":true,"max_tokens":100,"messages":[{"role":"user","content":"count"}]}"#;
    let vllm = continuation_body(Api::OpenAi, body, Prefill::ContinueFinalMessage, "1, 2,", 4)
        .expect("body");
    let v: Value = serde_json::from_slice(&vllm).expect("json");
    assert_eq!(v["messages"][1]["role"], "assistant");
    assert_eq!(v["messages"][1]["content"], "1, 2,");
    assert_eq!(v["max_tokens"], 96);
    assert_eq!(v["continue_final_message"], true);
    assert_eq!(v["add_generation_prompt"], false);
    let llama =
        continuation_body(Api::OpenAi, body, Prefill::LastAssistant, "x", 500).expect("body");
    let v: Value = serde_json::from_slice(&llama).expect("json");
    assert_eq!(v["max_tokens"], 1, "never 0");
    assert!(v.get("continue_final_message").is_none());
    assert_eq!(
        continuation_body(Api::OpenAi, b"{}", Prefill::LastAssistant, "x", 1),
        Err(Refusal::Malformed)
    );
}

#[test]
fn the_splice_drops_the_opening_and_keeps_the_first_id() {
    let first = Transcript {
        id: Some("chatcmpl-first".into()),
        ..Transcript::default()
    };
    let mut s = Splice::new(Api::OpenAi, &first, Prefill::ContinueFinalMessage);
    let out = s.feed(openai_stream("chatcmpl-second", &[" 3,", " 4"], true).as_bytes());
    let text = String::from_utf8(out).expect("utf8");
    assert!(!text.contains("\"role\""), "{text}");
    assert!(!text.contains("chatcmpl-second"), "{text}");
    assert_eq!(text.matches("chatcmpl-first").count(), 3, "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    // An engine that sends the role with the first content.
    let mut s = Splice::new(Api::OpenAi, &first, Prefill::ContinueFinalMessage);
    let out = s.feed(
        b"data: {\"id\":\"x\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\" 3\"}}]}\n\n",
    );
    let text = String::from_utf8(out).expect("utf8");
    assert!(!text.contains("role"), "{text}");
    assert!(text.contains("\" 3\""), "{text}");
    let mut a = Splice::new(
        Api::Anthropic,
        &Transcript::default(),
        Prefill::ContinueFinalMessage,
    );
    let out = a.feed(
        b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_2\"}}\n\n\
event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"!\"}}\n\n",
    );
    let text = String::from_utf8(out).expect("utf8");
    assert!(!text.contains("message_start"), "{text}");
    assert!(
        text.contains("event: content_block_delta\ndata: "),
        "{text}"
    );
}

proptest! {
    /// Whatever the text, where the first stream is cut and how the bytes
    /// arrive: the delivered text plus the continuation's spliced text is
    /// the whole text, byte for byte, with one role delta and one ID.
    #[test]
    fn first_part_and_continuation_make_the_whole_text(
        pieces in proptest::collection::vec("[a-z \"\\\\\u{e9}\u{4e16}\n]{1,6}", 1..20),
        cut in 0usize..20,
        split in 1usize..50,
        echo in proptest::option::of(0usize..64),
        regen in 1usize..4,
    ) {
        let cut = cut.min(pieces.len());
        let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
        let (first, rest) = refs.split_at(cut);
        let mut t = Transcript::default();
        let bytes = openai_stream("id-1", first, false).into_bytes();
        for c in bytes.chunks(split) {
            t.feed(Api::OpenAi, c);
        }
        prop_assert_eq!(t.deltas, first.len() as u64);
        // The prefill is the delivered text less its trailing whitespace,
        // which the engine generates again (here in pieces of `regen`
        // chars) before the rest.
        let prefill_text = t.prefill().to_string();
        let held = t.held().to_string();
        prop_assert_eq!(format!("{prefill_text}{held}"), first.concat());
        prop_assert!(held.trim().is_empty());
        let mut generated: Vec<String> = held
            .chars()
            .collect::<Vec<_>>()
            .chunks(regen)
            .map(|c| c.iter().collect())
            .collect();
        generated.extend(rest.iter().map(|p| p.to_string()));
        // llama.cpp streams the prefill back first: in two pieces cut
        // anywhere (on a char boundary), the second one joined to the
        // first new piece.
        let (prefill, continued) = match echo {
            None => (Prefill::ContinueFinalMessage, generated),
            Some(at) => {
                let mut at = at.min(prefill_text.len());
                while !prefill_text.is_char_boundary(at) {
                    at -= 1;
                }
                let (a, b) = prefill_text.split_at(at);
                let mut v = vec![a.to_string()];
                let mut joined = b.to_string();
                if let Some(r) = generated.first() {
                    joined.push_str(r);
                }
                v.push(joined);
                v.extend(generated.iter().skip(1).cloned());
                v.retain(|p| !p.is_empty());
                (Prefill::LastAssistant, v)
            }
        };
        let continued: Vec<&str> = continued.iter().map(String::as_str).collect();
        let mut s = Splice::new(Api::OpenAi, &t, prefill);
        let mut out = Vec::new();
        for c in openai_stream("id-2", &continued, true).into_bytes().chunks(split) {
            out.extend(s.feed(c));
        }
        let mut whole = Transcript::default();
        whole.feed(Api::OpenAi, &bytes);
        whole.feed(Api::OpenAi, &out);
        prop_assert_eq!(whole.text, pieces.concat());
        prop_assert!(whole.done);
        let all = String::from_utf8_lossy(&[bytes, out].concat()).to_string();
        prop_assert_eq!(all.matches("\"role\"").count(), 1);
        prop_assert!(!all.contains("id-2"));
    }
}

fn usage_of(out: &[u8]) -> serde_json::Value {
    let text = String::from_utf8_lossy(out);
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("data: "))
        .unwrap_or("null");
    serde_json::from_str::<serde_json::Value>(line).unwrap_or_default()["usage"].clone()
}

#[test]
fn the_splice_makes_the_usage_the_whole_answers() {
    let usage = b"data: {\"id\":\"b\",\"choices\":[],\"usage\":{\"prompt_tokens\":25,\"completion_tokens\":7,\"total_tokens\":32}}\n\n";
    // Input unknown: the continuation's, less the delivered text it was
    // sent back.
    let first = Transcript {
        deltas: 5,
        ..Transcript::default()
    };
    let u = usage_of(&Splice::new(Api::OpenAi, &first, Prefill::ContinueFinalMessage).feed(usage));
    assert_eq!(
        (
            &u["prompt_tokens"],
            &u["completion_tokens"],
            &u["total_tokens"]
        ),
        (&20.into(), &12.into(), &32.into()),
        "{u}"
    );
    // Input known from the first part.
    let first = Transcript {
        deltas: 5,
        input: Some(18),
        ..Transcript::default()
    };
    let u = usage_of(&Splice::new(Api::OpenAi, &first, Prefill::ContinueFinalMessage).feed(usage));
    assert_eq!(
        (&u["prompt_tokens"], &u["total_tokens"]),
        (&18.into(), &30.into()),
        "{u}"
    );
    let u = usage_of(&Splice::new(Api::Anthropic, &first, Prefill::ContinueFinalMessage).feed(
        b"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":7}}\n\n",
    ));
    assert_eq!(u["output_tokens"], 12, "{u}");
    // A dropped event leaves no blank line behind.
    let out = Splice::new(Api::OpenAi, &first, Prefill::ContinueFinalMessage).feed(
        b"data: {\"id\":\"b\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n",
    );
    assert!(out.is_empty(), "{}", String::from_utf8_lossy(&out));
    // The first part's input comes from Anthropic's message_start.
    let mut t = Transcript::default();
    t.feed(
        Api::Anthropic,
        b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"usage\":{\"input_tokens\":9}}}\n\n",
    );
    assert_eq!((t.input, t.id.as_deref()), (Some(9), Some("msg_1")));
}

#[test]
fn trailing_whitespace_is_generated_again_not_prefilled() {
    let mut t = Transcript::default();
    t.feed(
        Api::OpenAi,
        openai_stream(
            "c",
            &["It", " had", " seen", " it", " all", ".", "\n", "\n"],
            false,
        )
        .as_bytes(),
    );
    assert_eq!((t.prefill(), t.held()), ("It had seen it all.", "\n\n"));
    assert_eq!((t.deltas, t.blank_deltas, t.produced()), (8, 2, 6));
    // The engine generates the newlines again, then goes on: the client
    // sees each once.
    let regenerated = openai_stream("d", &["\n", "\n", "One", " day"], true);
    let mut s = Splice::new(Api::OpenAi, &t, Prefill::ContinueFinalMessage);
    let mut whole = t.clone();
    whole.feed(Api::OpenAi, &s.feed(regenerated.as_bytes()));
    assert_eq!(whole.text, "It had seen it all.\n\nOne day");
    // llama.cpp echoes the prefill (without the newlines) first.
    let echoed = openai_stream("d", &["It had seen it all.", "\n\nOne", " day"], true);
    let mut s = Splice::new(Api::OpenAi, &t, Prefill::LastAssistant);
    let mut whole = t.clone();
    whole.feed(Api::OpenAi, &s.feed(echoed.as_bytes()));
    assert_eq!(whole.text, "It had seen it all.\n\nOne day");
    // An engine that goes another way keeps what the client has: no
    // newline lost, none doubled.
    let other = openai_stream("d", &["\n", " But"], true);
    let mut s = Splice::new(Api::OpenAi, &t, Prefill::ContinueFinalMessage);
    let mut whole = t.clone();
    whole.feed(Api::OpenAi, &s.feed(other.as_bytes()));
    assert_eq!(whole.text, "It had seen it all.\n\n But");
    // A text of whitespace only is continued as it is.
    let mut blank = Transcript::default();
    blank.feed(Api::OpenAi, openai_stream("c", &["\n"], false).as_bytes());
    assert_eq!(
        (blank.prefill(), blank.held(), blank.produced()),
        ("\n", "", 1)
    );
    // A word after whitespace ends the run of blank deltas.
    let mut t = Transcript::default();
    t.feed(
        Api::OpenAi,
        openai_stream("c", &["\n", "a", " "], false).as_bytes(),
    );
    assert_eq!((t.prefill(), t.held(), t.produced()), ("\na", " ", 2));
}
