//! Request templates: chat completions, Anthropic messages, embeddings and
//! rerank, with prompt-size and `max_tokens` distributions over several
//! models; and multi-turn conversations ([`Conversations`]: each with its
//! application's long system prompt and a history that grows turn by
//! turn, the workload an engine's prefix cache serves). Pure: bodies come
//! from a seeded [`Rng`].

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
    /// Multi-turn conversations instead of independent prompts (chat and
    /// messages).
    pub conversations: Option<Conversations>,
}

/// The conversation workload: `count` conversations, each of one of
/// `apps` applications (an application's system prompt of
/// `system_tokens` is shared by its conversations); each request takes
/// the next turn of a conversation drawn at random: the system prompt,
/// every earlier turn (user text and a short assistant answer) and a new
/// user text of `prompt_tokens`. After `turns` turns a conversation starts
/// over as a new one (same application).
#[derive(Debug, Clone)]
pub struct Conversations {
    /// Conversations open at once.
    pub count: u32,
    /// Applications (distinct system prompts).
    pub apps: u32,
    /// System prompt length in tokens.
    pub system_tokens: u64,
    /// Turns before a conversation starts over.
    pub turns: u32,
    /// Per conversation: (generation, turns taken).
    state: std::cell::RefCell<Vec<(u64, u32)>>,
}

impl Conversations {
    /// `count` conversations over `apps` applications.
    pub fn new(count: u32, apps: u32, system_tokens: u64, turns: u32) -> Self {
        Conversations {
            count: count.max(1),
            apps: apps.max(1),
            system_tokens,
            turns: turns.max(1),
            state: std::cell::RefCell::new(vec![(0, 0); count.max(1) as usize]),
        }
    }

    /// The messages of the next turn of a conversation drawn from `rng`,
    /// with the system prompt apart (Anthropic's shape puts it apart).
    fn next(&self, rng: &mut Rng, user_tokens: &Dist) -> (String, Vec<serde_json::Value>) {
        let c = rng.next_u64() % u64::from(self.count);
        let (generation, turn) = {
            let mut st = self.state.borrow_mut();
            let Some(e) = st.get_mut(c as usize) else {
                return (String::new(), Vec::new());
            };
            if e.1 >= self.turns {
                *e = (e.0 + 1, 0);
            }
            e.1 += 1;
            *e
        };
        let app = c % u64::from(self.apps);
        let system = format!(
            "You are assistant {app}. {}",
            prompt(&mut Rng::new(0xA995 ^ app), self.system_tokens)
        );
        let mut messages = Vec::with_capacity(2 * turn as usize);
        for k in 0..turn {
            // The same words for the same (conversation, generation, turn):
            // a later turn repeats the earlier ones exactly.
            let seed = (c << 40) ^ (generation << 20) ^ u64::from(k) ^ 0x5EED;
            let mut r = Rng::new(seed);
            let n = user_tokens.draw(&mut r);
            messages.push(json!({"role": "user", "content": prompt(&mut r, n)}));
            if k + 1 < turn {
                messages.push(json!({"role": "assistant", "content": format!("Noted, part {k}.")}));
            }
        }
        (system, messages)
    }
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
        if let (Some(conv), Endpoint::Chat | Endpoint::Messages) =
            (&self.conversations, self.endpoint)
        {
            return self.turn(conv, model, rng);
        }
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

impl Template {
    /// The next turn of a conversation, in the endpoint's shape.
    fn turn(&self, conv: &Conversations, model: String, rng: &mut Rng) -> Request {
        let (system, messages) = conv.next(rng, &self.prompt_tokens);
        let max = self.max_tokens.draw(rng);
        let mut v = match self.endpoint {
            Endpoint::Messages => {
                json!({"model": model, "max_tokens": max, "stream": self.stream, "system": system, "messages": messages})
            }
            _ => {
                let mut all = Vec::with_capacity(messages.len() + 1);
                all.push(json!({"role": "system", "content": system}));
                all.extend(messages);
                let mut v = json!({"model": model, "messages": all, "max_tokens": max, "stream": self.stream});
                if self.stream {
                    v["stream_options"] = json!({"include_usage": true});
                }
                v
            }
        };
        if let Some(t) = self.temperature {
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
                conversations: None,
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
            conversations: None,
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

    #[test]
    fn a_conversation_repeats_its_earlier_turns_and_starts_over() {
        let t = Template {
            endpoint: Endpoint::Chat,
            models: vec!["a".into()],
            prompt_tokens: Dist { lo: 5, hi: 9 },
            max_tokens: Dist { lo: 4, hi: 4 },
            stream: false,
            same_prompt: false,
            temperature: None,
            conversations: Some(Conversations::new(1, 1, 40, 3)),
        };
        let mut rng = Rng::new(7);
        let msgs = |r: &Request| -> Vec<serde_json::Value> {
            let v: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
            v["messages"].as_array().cloned().unwrap_or_default()
        };
        let (a, b, c, d) = (
            msgs(&t.build(&mut rng)),
            msgs(&t.build(&mut rng)),
            msgs(&t.build(&mut rng)),
            msgs(&t.build(&mut rng)),
        );
        assert_eq!((a.len(), b.len(), c.len()), (2, 4, 6), "system + turns");
        assert_eq!(a[0]["role"], "system");
        assert_eq!(b[..2], a[..], "turn 2 starts with turn 1 exactly");
        assert_eq!(c[..4], b[..], "turn 3 starts with turn 2 exactly");
        assert_eq!(d.len(), 2, "after 3 turns it starts over");
        assert_eq!(d[0], a[0], "with its application's system prompt");
        assert_ne!(d[1], a[1], "and a new first question");
        // Two applications: two system prompts.
        let two = Conversations::new(2, 2, 40, 3);
        let mut r = Rng::new(1);
        let mut systems = std::collections::BTreeSet::new();
        for _ in 0..20 {
            systems.insert(two.next(&mut r, &Dist { lo: 3, hi: 3 }).0);
        }
        assert_eq!(systems.len(), 2);
    }
}
