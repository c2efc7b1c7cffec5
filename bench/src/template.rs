//! Request templates: chat completions, Anthropic messages, embeddings and
//! rerank, with prompt-size and `max_tokens` distributions over several
//! models. Pure: bodies come from a seeded [`Rng`].

use serde_json::json;

use crate::schedule::Rng;

/// Which API a request uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/messages`.
    Messages,
    /// `POST /v1/embeddings`.
    Embeddings,
    /// `POST /v1/rerank`.
    Rerank,
}

impl Endpoint {
    /// Parse a flag value.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "chat" => Some(Endpoint::Chat),
            "messages" => Some(Endpoint::Messages),
            "embeddings" => Some(Endpoint::Embeddings),
            "rerank" => Some(Endpoint::Rerank),
            _ => None,
        }
    }

    /// Request path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Messages => "/v1/messages",
            Endpoint::Embeddings => "/v1/embeddings",
            Endpoint::Rerank => "/v1/rerank",
        }
    }
}

/// A size distribution: `N` (fixed) or `A-B` (uniform).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dist {
    /// Smallest value.
    pub lo: u64,
    /// Largest value.
    pub hi: u64,
}

impl Dist {
    /// Parse `N` or `A-B`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let (a, b) = match s.split_once('-') {
            Some((a, b)) => (a, b),
            None => (s, s),
        };
        let lo: u64 = a
            .trim()
            .parse()
            .map_err(|_| format!("invalid size {s:?}"))?;
        let hi: u64 = b
            .trim()
            .parse()
            .map_err(|_| format!("invalid size {s:?}"))?;
        if lo > hi {
            return Err(format!("invalid range {s:?}"));
        }
        Ok(Dist { lo, hi })
    }

    /// Draw a value.
    pub fn draw(&self, rng: &mut Rng) -> u64 {
        rng.range(self.lo, self.hi)
    }
}

/// What to send.
#[derive(Debug, Clone)]
pub struct Template {
    /// API.
    pub endpoint: Endpoint,
    /// Models, picked uniformly.
    pub models: Vec<String>,
    /// Prompt length in tokens (about 4 bytes each).
    pub prompt_tokens: Dist,
    /// `max_tokens`.
    pub max_tokens: Dist,
    /// Ask for a stream (chat and messages).
    pub stream: bool,
    /// The same prompt (of the first drawn length) every time.
    pub same_prompt: bool,
    /// `temperature`, when given.
    pub temperature: Option<f64>,
}

/// One concrete request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Path.
    pub path: &'static str,
    /// JSON body.
    pub body: Vec<u8>,
}

const FILL: &[&str] = &[
    "lorem", "ipsum", "dolor", "sit", "amet", "router", "token", "shard",
];

fn prompt(rng: &mut Rng, tokens: u64) -> String {
    let mut s = String::with_capacity(tokens as usize * 6);
    for i in 0..tokens {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(FILL[(rng.next_u64() % FILL.len() as u64) as usize]);
    }
    s
}

impl Template {
    /// Build the next request.
    pub fn build(&self, rng: &mut Rng) -> Request {
        let model = if self.models.is_empty() {
            "model".to_string()
        } else {
            self.models[(rng.next_u64() % self.models.len() as u64) as usize].clone()
        };
        let n = self.prompt_tokens.draw(rng);
        let p = if self.same_prompt {
            // Its own generator: the same words whatever was drawn before.
            prompt(&mut Rng::new(1), n)
        } else {
            prompt(rng, n)
        };
        let max = self.max_tokens.draw(rng);
        let v = match self.endpoint {
            Endpoint::Chat => {
                let mut v = json!({"model": model, "messages": [{"role": "user", "content": p}], "max_tokens": max, "stream": self.stream});
                if self.stream {
                    v["stream_options"] = json!({"include_usage": true});
                }
                v
            }
            Endpoint::Messages => {
                json!({"model": model, "max_tokens": max, "stream": self.stream, "messages": [{"role": "user", "content": p}]})
            }
            Endpoint::Embeddings => json!({"model": model, "input": p}),
            Endpoint::Rerank => {
                json!({"model": model, "query": p, "documents": ["alpha beta", "router token", "lorem ipsum"]})
            }
        };
        let mut v = v;
        if let (Some(t), Endpoint::Chat | Endpoint::Messages) = (self.temperature, self.endpoint) {
            v["temperature"] = json!(t);
        }
        Request {
            path: self.endpoint.path(),
            body: serde_json::to_vec(&v).unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_each_endpoint() {
        let mut rng = Rng::new(1);
        for (ep, key) in [
            (Endpoint::Chat, "messages"),
            (Endpoint::Messages, "messages"),
            (Endpoint::Embeddings, "input"),
            (Endpoint::Rerank, "documents"),
        ] {
            let t = Template {
                endpoint: ep,
                models: vec!["a".into(), "b".into()],
                prompt_tokens: Dist { lo: 3, hi: 9 },
                max_tokens: Dist { lo: 5, hi: 5 },
                stream: true,
                same_prompt: false,
                temperature: None,
            };
            let r = t.build(&mut rng);
            let v: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
            assert!(v.get(key).is_some());
            assert!(v["model"] == "a" || v["model"] == "b");
        }
        // Same prompt: equal bodies whatever the generator drew before;
        // the temperature goes into chat bodies.
        let t = Template {
            endpoint: Endpoint::Chat,
            models: vec!["a".into()],
            prompt_tokens: Dist { lo: 8, hi: 8 },
            max_tokens: Dist { lo: 4, hi: 4 },
            stream: true,
            same_prompt: true,
            temperature: Some(0.0),
        };
        let (a, b) = (t.build(&mut rng), t.build(&mut rng));
        assert_eq!(a, b);
        let v: serde_json::Value = serde_json::from_slice(&a.body).expect("json");
        assert_eq!(v["temperature"], 0.0);
        let other = Template {
            same_prompt: false,
            ..t.clone()
        };
        assert_ne!(other.build(&mut rng), other.build(&mut rng));
        assert_eq!(Dist::parse("10-20").expect("ok"), Dist { lo: 10, hi: 20 });
        assert!(Dist::parse("20-10").is_err());
    }
}
