//! The Conversations API (issue 52), pure: a conversation the router
//! keeps for a tenant (its items, oldest first, and metadata), what its
//! routes read from a request ([`parse_create`], [`parse_items`],
//! [`parse_metadata`], [`parse_list`]) and what they answer
//! ([`Conversation::object`], [`Conversation::list`], [`deleted`]).
//!
//! A Responses turn naming `conversation` is rebuilt from the
//! conversation's items (the engine keeps nothing) and its input and
//! output items are added to it when it ends, as the API has it.
//!
//! Key items: [`Conversation`], [`new_id`], [`is_id`].

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

/// Most items one create or add call may carry (the API's limit).
pub const MAX_ITEMS_PER_CALL: usize = 20;
/// Most metadata keys (the API's limit).
pub const MAX_METADATA_KEYS: usize = 16;
/// Longest metadata key and value (the API's limits).
const MAX_KEY_CHARS: usize = 64;
const MAX_VALUE_CHARS: usize = 512;
/// Most items a list call returns.
pub const MAX_LIST: usize = 100;

/// Why a request is refused: the client's message (400).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid(pub String);

/// An item as stored: its JSON as written (never decoded into a tree on
/// a turn's way: a 5-turn conversation is read, rebuilt and written back
/// with a validation pass and copies).
pub type RawItem = Box<serde_json::value::RawValue>;

/// A conversation as the router keeps it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Conversation {
    /// `conv_...`.
    pub id: String,
    /// Unix seconds.
    pub created_at: u64,
    /// String keys and values ([`parse_metadata`]).
    #[serde(default)]
    pub metadata: Value,
    /// Its items, oldest first, each with an `id`.
    #[serde(default)]
    pub items: Vec<RawItem>,
    /// The next item ID's number.
    #[serde(default)]
    pub next_item: u64,
}

/// A new conversation ID from 128 random bits.
pub fn new_id(random: u128) -> String {
    format!("conv_{random:032x}")
}

/// An ID a client may name as a conversation (`responses` checks a
/// turn's `conversation` the same way).
pub fn is_id(s: &str) -> bool {
    s.starts_with("conv_") && super::responses::valid_id(s)
}

/// `metadata`: absent or null is empty; else an object of at most 16
/// string values (keys up to 64 characters, values up to 512).
pub fn parse_metadata(v: Option<&Value>) -> Result<Value, Invalid> {
    let m = match v {
        None | Some(Value::Null) => return Ok(Value::Object(Map::new())),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(Invalid("'metadata' must be an object".into())),
    };
    if m.len() > MAX_METADATA_KEYS {
        return Err(Invalid(format!(
            "'metadata' may have at most {MAX_METADATA_KEYS} keys"
        )));
    }
    for (k, v) in m {
        let Value::String(s) = v else {
            return Err(Invalid(format!("'metadata.{k}' must be a string")));
        };
        if k.chars().count() > MAX_KEY_CHARS || s.chars().count() > MAX_VALUE_CHARS {
            return Err(Invalid(format!(
                "'metadata' keys are at most {MAX_KEY_CHARS} characters and values at most {MAX_VALUE_CHARS}"
            )));
        }
    }
    Ok(Value::Object(m.clone()))
}

/// `items`: absent or null is none; else an array of at most
/// [`MAX_ITEMS_PER_CALL`] objects (an easy message: `role` and `content`).
pub fn parse_items(v: Option<&Value>) -> Result<Vec<Value>, Invalid> {
    let items = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(Invalid("'items' must be an array".into())),
    };
    if items.len() > MAX_ITEMS_PER_CALL {
        return Err(Invalid(format!(
            "'items' may have at most {MAX_ITEMS_PER_CALL} items per call"
        )));
    }
    if let Some(i) = items
        .iter()
        .position(|i| !i.is_object() || !(i.get("type").is_some() || i.get("role").is_some()))
    {
        return Err(Invalid(format!(
            "'items[{i}]' must be an item object (with 'type' or 'role')"
        )));
    }
    Ok(items.clone())
}

/// The body of `POST /v1/conversations`: its items and metadata.
pub fn parse_create(body: &[u8]) -> Result<(Vec<Value>, Value), Invalid> {
    let v = object(body)?;
    Ok((
        parse_items(v.get("items"))?,
        parse_metadata(v.get("metadata"))?,
    ))
}

/// A request body that must be a JSON object (an empty one is `{}`).
pub fn object(body: &[u8]) -> Result<Map<String, Value>, Invalid> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(Invalid("the request body must be a JSON object".into())),
        Err(e) => Err(Invalid(format!("Invalid request: {e}"))),
    }
}

/// The query of an items list: `after` (an item ID), `limit` (1-100,
/// default 20), `order` (`asc` or `desc`, the default).
pub fn parse_list(query: &str) -> Result<(Option<String>, usize, bool), Invalid> {
    let (mut after, mut limit, mut asc) = (None, 20, false);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "after" => after = Some(v.to_string()),
            "limit" => {
                limit = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=MAX_LIST).contains(n))
                    .ok_or_else(|| Invalid(format!("'limit' must be between 1 and {MAX_LIST}")))?
            }
            "order" => {
                asc = match v {
                    "asc" => true,
                    "desc" => false,
                    _ => return Err(Invalid("'order' must be 'asc' or 'desc'".into())),
                }
            }
            // `include` and others change nothing here.
            _ => {}
        }
    }
    Ok((after, limit, asc))
}

impl Conversation {
    /// A new conversation with `items` (given IDs) and `metadata`.
    pub fn new(id: String, created_at: u64, metadata: Value, items: Vec<Value>) -> Self {
        let mut c = Conversation {
            id,
            created_at,
            metadata,
            items: Vec::new(),
            next_item: 0,
        };
        c.add(items);
        c
    }

    /// Add `items` at the end, each given an ID when it has none and the
    /// `message` type when it is an easy message; returns them as added.
    pub fn add(&mut self, items: Vec<Value>) -> Vec<Value> {
        let tail = self.id.trim_start_matches("conv_").to_string();
        let added: Vec<Value> = items
            .into_iter()
            .map(|mut item| {
                if let Value::Object(m) = &mut item {
                    if !m.get("id").is_some_and(Value::is_string) {
                        let id = format!("msg_{tail}{:06x}", self.next_item);
                        m.insert("id".into(), Value::String(id));
                    }
                    if !m.contains_key("type") && m.contains_key("role") {
                        m.insert("type".into(), Value::String("message".into()));
                    }
                }
                self.next_item += 1;
                item
            })
            .collect();
        for item in &added {
            if let Ok(raw) = serde_json::value::to_raw_value(item) {
                self.items.push(raw);
            }
        }
        added
    }

    /// The ID of a stored item (read alone).
    fn id_of(item: &RawItem) -> Option<String> {
        #[derive(Deserialize)]
        struct Id {
            id: String,
        }
        serde_json::from_str::<Id>(item.get()).ok().map(|i| i.id)
    }

    /// The conversation object the routes answer.
    pub fn object(&self) -> Value {
        json!({
            "id": self.id,
            "object": "conversation",
            "created_at": self.created_at,
            "metadata": self.metadata,
        })
    }

    /// One of its items.
    pub fn item(&self, id: &str) -> Option<Value> {
        self.items
            .iter()
            .find(|i| Self::id_of(i).as_deref() == Some(id))
            .and_then(|i| serde_json::from_str(i.get()).ok())
    }

    /// Delete one of its items; `false`: no such item.
    pub fn delete_item(&mut self, id: &str) -> bool {
        let before = self.items.len();
        self.items.retain(|i| Self::id_of(i).as_deref() != Some(id));
        self.items.len() != before
    }

    /// A page of its items: after the item `after` (in the page's
    /// order), at most `limit`, oldest first when `asc`.
    pub fn list(&self, after: Option<&str>, limit: usize, asc: bool) -> Value {
        let ordered: Vec<&RawItem> = if asc {
            self.items.iter().collect()
        } else {
            self.items.iter().rev().collect()
        };
        let start = match after {
            Some(a) => ordered
                .iter()
                .position(|i| Self::id_of(i).as_deref() == Some(a))
                .map_or(ordered.len(), |p| p + 1),
            None => 0,
        };
        let rest = ordered.get(start..).unwrap_or(&[]);
        let page: Vec<Value> = rest
            .iter()
            .take(limit)
            .filter_map(|v| serde_json::from_str(v.get()).ok())
            .collect();
        list_of(page, rest.len() > limit)
    }
}

/// A list answer of `data`.
pub fn list_of(data: Vec<Value>, has_more: bool) -> Value {
    let id_of = |v: Option<&Value>| v.and_then(|i| i.get("id")).cloned();
    json!({
        "object": "list",
        "first_id": id_of(data.first()),
        "last_id": id_of(data.last()),
        "has_more": has_more,
        "data": data,
    })
}

/// What `DELETE /v1/conversations/{id}` answers.
pub fn deleted(id: &str) -> Value {
    json!({"id": id, "object": "conversation.deleted", "deleted": true})
}

/// The conversation as a stored turn for the rebuild
/// (`responses::expanded_body`): its items as the turn's input, its ID
/// as the chain's first (the conversation's session key).
pub fn as_turn(c: &Conversation) -> Vec<u8> {
    let size: usize = c.items.iter().map(|i| i.get().len() + 1).sum();
    let mut out = Vec::with_capacity(size + c.id.len() + 32);
    out.extend_from_slice(b"{\"id\":");
    out.extend_from_slice(&serde_json::to_vec(&c.id).unwrap_or_default());
    out.extend_from_slice(b",\"input\":[");
    for (k, item) in c.items.iter().enumerate() {
        if k > 0 {
            out.push(b',');
        }
        out.extend_from_slice(item.get().as_bytes());
    }
    out.extend_from_slice(b"],\"output\":[]}");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_get_ids_and_types_and_pages_follow_the_order() {
        let mut c = Conversation::new(
            new_id(7),
            100,
            json!({}),
            vec![json!({"role": "user", "content": "hi"})],
        );
        let added = c.add(vec![
            json!({"type": "message", "role": "assistant", "content": "yo", "id": "msg_engine"}),
            json!({"role": "user", "content": "more"}),
        ]);
        assert_eq!(added[0]["id"], "msg_engine", "an item's own ID is kept");
        assert_eq!(c.items.len(), 3);
        let page = c.list(None, 10, true);
        assert_eq!(page["data"][0]["type"], "message");
        let first = page["data"][0]["id"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(first.starts_with("msg_"), "{first}");
        assert_ne!(json!(first), page["data"][2]["id"]);
        // Newest first by default; `after` continues the page.
        let p = c.list(None, 2, false);
        assert_eq!(p["data"][0]["content"], "more");
        assert_eq!(p["has_more"], true);
        let last = p["last_id"].as_str().unwrap_or_default().to_string();
        let p = c.list(Some(&last), 2, false);
        assert_eq!(p["data"].as_array().map(Vec::len), Some(1));
        assert_eq!(p["data"][0]["id"], json!(first));
        assert_eq!(p["has_more"], false);
        assert_eq!(c.list(None, 10, true)["first_id"], json!(first));
        assert!(c.delete_item(&first));
        assert!(!c.delete_item(&first));
        assert!(c.item(&first).is_none());
        assert!(c.item("msg_engine").is_some());
    }

    #[test]
    fn bad_input_is_refused_with_its_reason() {
        assert!(parse_create(b"[1]").is_err());
        assert!(parse_create(b"{\"items\": 3}").is_err());
        assert!(parse_create(b"{\"items\": [1]}").is_err());
        assert!(parse_create(b"{\"items\": [{\"x\": 1}]}").is_err());
        let many = format!(
            "{{\"items\": [{}]}}",
            vec![r#"{"role":"user","content":"a"}"#; 21].join(",")
        );
        assert!(parse_create(many.as_bytes()).is_err());
        assert!(parse_create(b"{\"metadata\": {\"a\": 1}}").is_err());
        let keys: Vec<String> = (0..17).map(|i| format!("\"k{i}\":\"v\"")).collect();
        let over = format!("{{\"metadata\": {{{}}}}}", keys.join(","));
        assert!(parse_create(over.as_bytes()).is_err());
        assert_eq!(parse_create(b"").map(|(i, _)| i.len()), Ok(0));
        assert!(parse_list("limit=0").is_err());
        assert!(parse_list("limit=101").is_err());
        assert!(parse_list("order=sideways").is_err());
        assert_eq!(
            parse_list("limit=5&order=asc&after=x"),
            Ok((Some("x".into()), 5, true))
        );
        assert!(is_id(&new_id(1)));
        assert!(!is_id("resp_1"));
        assert!(!is_id("conv_../x"));
    }

    #[test]
    fn a_stored_conversation_reads_back() {
        let c = Conversation::new(
            new_id(9),
            5,
            json!({"k": "v"}),
            vec![json!({"role": "user", "content": "a"})],
        );
        let raw = serde_json::to_vec(&c).unwrap_or_default();
        let back: Conversation = serde_json::from_slice(&raw).expect("read back");
        assert_eq!(serde_json::to_vec(&back).unwrap_or_default(), raw);
        assert_eq!(back.list(None, 1, true)["data"][0]["content"], "a");
        let turn: Value = serde_json::from_slice(&as_turn(&c)).unwrap_or_default();
        assert_eq!(turn["id"], json!(c.id));
        assert_eq!(turn["input"][0]["content"], "a");
    }
}
