//! Token usage read from responses, for the per-agent token counters:
//! OpenAI `usage.prompt_tokens/completion_tokens` and Anthropic
//! `usage.input_tokens/output_tokens`, from a whole JSON body or from an
//! SSE stream fed chunk by chunk (OpenAI's last chunk; Anthropic's
//! `message_start` and `message_delta`). Borrowed parsing of only the
//! fields needed.

use serde::Deserialize;

#[derive(Deserialize, Default)]
struct Usage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
}

#[derive(Deserialize, Default)]
struct WithUsage {
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    message: Option<Box<WithUsage>>,
}

/// Input and output tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tokens {
    /// Prompt / input tokens.
    pub input: u64,
    /// Completion / output tokens.
    pub output: u64,
}

fn tokens_of(u: &Usage) -> Tokens {
    Tokens {
        input: u.prompt_tokens.or(u.input_tokens).unwrap_or(0),
        output: u.completion_tokens.or(u.output_tokens).unwrap_or(0),
    }
}

/// Usage of a whole (non-streaming) JSON body.
pub fn from_body(body: &[u8]) -> Option<Tokens> {
    let w: WithUsage = serde_json::from_slice(body).ok()?;
    w.usage.as_ref().map(tokens_of)
}

/// Accumulates usage across an SSE stream.
#[derive(Debug, Default, Clone)]
pub struct SseUsage {
    line: Vec<u8>,
    /// What was seen so far (maximum of each field).
    pub tokens: Tokens,
    /// Whether any usage was seen.
    pub seen: bool,
    /// Count generated text bytes (`content` / `text` strings of `data:`
    /// lines) into `content_bytes`.
    pub count_content: bool,
    /// Generated text bytes seen (when counted).
    pub content_bytes: u64,
}

/// Longest SSE line examined (longer lines are skipped).
const MAX_LINE: usize = 64 * 1024;

impl SseUsage {
    /// A meter that also counts generated text bytes when `content`.
    pub fn counting(content: bool) -> Self {
        SseUsage {
            count_content: content,
            ..SseUsage::default()
        }
    }

    /// Feed decoded body bytes.
    pub fn feed(&mut self, data: &[u8]) {
        for b in data {
            if *b == b'\n' {
                self.line_done();
            } else if self.line.len() < MAX_LINE {
                self.line.push(*b);
            }
        }
    }

    fn line_done(&mut self) {
        let line = std::mem::take(&mut self.line);
        let Some(rest) = line.strip_prefix(b"data:") else {
            return;
        };
        if self.count_content {
            self.content_bytes += content_len(rest);
        }
        // Cheap filter before parsing.
        if !rest.windows(7).any(|w| w == b"\"usage\"") {
            return;
        }
        let Ok(w) = serde_json::from_slice::<WithUsage>(rest.trim_ascii()) else {
            return;
        };
        let u = w.usage.or_else(|| w.message.and_then(|m| m.usage));
        if let Some(u) = u {
            let t = tokens_of(&u);
            self.tokens.input = self.tokens.input.max(t.input);
            self.tokens.output = self.tokens.output.max(t.output);
            self.seen = true;
        }
    }
}

/// Bytes of the JSON string values of `"content":"` and `"text":"` in
/// one data line (escapes count as their encoded length): what a delta
/// generated, without parsing the chunk.
fn content_len(line: &[u8]) -> u64 {
    let mut n = 0u64;
    for key in [&b"\"content\":\""[..], &b"\"text\":\""[..]] {
        let mut from = 0;
        while let Some(at) = line
            .get(from..)
            .and_then(|l| l.windows(key.len()).position(|w| w == key))
        {
            let start = from + at + key.len();
            let mut i = start;
            let mut escaped = false;
            while let Some(&b) = line.get(i) {
                if escaped {
                    escaped = false;
                } else if b == b'\\' {
                    escaped = true;
                } else if b == b'"' {
                    break;
                }
                i += 1;
            }
            n += (i - start) as u64;
            from = i;
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies() {
        assert_eq!(
            from_body(br#"{"usage":{"prompt_tokens":3,"completion_tokens":5}}"#),
            Some(Tokens {
                input: 3,
                output: 5
            })
        );
        assert_eq!(
            from_body(br#"{"usage":{"input_tokens":4,"output_tokens":6}}"#),
            Some(Tokens {
                input: 4,
                output: 6
            })
        );
        assert_eq!(from_body(br#"{"x":1}"#), None);
        assert_eq!(from_body(b"garbage"), None);
    }

    #[test]
    fn content_is_counted_without_parsing() {
        let mut u = SseUsage::counting(true);
        u.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"Hello\"}}]}\n\n");
        u.feed(b"data: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"a\\\"b\"}}\n\n");
        assert_eq!(u.content_bytes, 5 + 4, "escapes count as sent");
        let mut off = SseUsage::default();
        off.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"Hello\"}}]}\n");
        assert_eq!(off.content_bytes, 0, "not counted unless asked");
    }

    #[test]
    fn streams_split_anywhere() {
        let openai = b"data: {\"choices\":[]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":9}}\n\ndata: [DONE]\n\n";
        let anthropic = b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":11,\"output_tokens\":1}}}\n\nevent: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":12}}\n\n";
        for (s, want) in [
            (
                &openai[..],
                Tokens {
                    input: 7,
                    output: 9,
                },
            ),
            (
                &anthropic[..],
                Tokens {
                    input: 11,
                    output: 12,
                },
            ),
        ] {
            for cut in 0..s.len() {
                let mut u = SseUsage::default();
                u.feed(&s[..cut]);
                u.feed(&s[cut..]);
                assert_eq!(u.tokens, want, "cut {cut}");
            }
        }
    }
}
