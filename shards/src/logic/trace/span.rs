//! One span as it is exported: what it names, when, under which parent,
//! and its attributes (GenAI semantic conventions where they exist,
//! `hivenet.*` where they do not).

/// A span's kind (OTLP's numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Work inside the process (a decision, a wait).
    Internal = 1,
    /// A request received (the router's and the agent's request span).
    Server = 2,
    /// A request sent (an attempt to an agent, the agent's backend call).
    Client = 3,
}

/// An attribute's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Text.
    Str(String),
    /// A whole number.
    Int(i64),
    /// A number.
    F64(f64),
    /// A flag.
    Bool(bool),
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Value::Str(s.to_string())
    }
}
impl From<String> for Value {
    fn from(s: String) -> Self {
        Value::Str(s)
    }
}
impl From<u64> for Value {
    fn from(n: u64) -> Self {
        Value::Int(i64::try_from(n).unwrap_or(i64::MAX))
    }
}
impl From<i64> for Value {
    fn from(n: i64) -> Self {
        Value::Int(n)
    }
}
impl From<usize> for Value {
    fn from(n: usize) -> Self {
        Value::Int(i64::try_from(n).unwrap_or(i64::MAX))
    }
}
impl From<u16> for Value {
    fn from(n: u16) -> Self {
        Value::Int(i64::from(n))
    }
}
impl From<f64> for Value {
    fn from(x: f64) -> Self {
        Value::F64(x)
    }
}
impl From<bool> for Value {
    fn from(b: bool) -> Self {
        Value::Bool(b)
    }
}

/// A point in a span (a keepalive sent, a stream broken).
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Its name.
    pub name: &'static str,
    /// Unix nanoseconds.
    pub at: u64,
    /// Its attributes.
    pub attrs: Vec<(&'static str, Value)>,
}

/// One finished span.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// Its trace.
    pub trace_id: [u8; 16],
    /// Its own ID (never all zero).
    pub span_id: [u8; 8],
    /// Its parent's, if any.
    pub parent: Option<[u8; 8]>,
    /// Its name.
    pub name: String,
    /// Its kind.
    pub kind: Kind,
    /// Unix nanoseconds.
    pub start: u64,
    /// Unix nanoseconds.
    pub end: u64,
    /// `Some(message)`: it failed.
    pub error: Option<String>,
    /// Its attributes.
    pub attrs: Vec<(&'static str, Value)>,
    /// Its events.
    pub events: Vec<Event>,
}

impl Span {
    /// A span of `kind` named `name`, started at `start` (ended there too
    /// until [`Span::end`] says otherwise).
    pub fn new(
        trace_id: [u8; 16],
        span_id: [u8; 8],
        parent: Option<[u8; 8]>,
        name: impl Into<String>,
        kind: Kind,
        start: u64,
    ) -> Self {
        Span {
            trace_id,
            span_id,
            parent,
            name: name.into(),
            kind,
            start,
            end: start,
            error: None,
            attrs: Vec::new(),
            events: Vec::new(),
        }
    }

    /// Set one attribute (a key set twice keeps its last value).
    pub fn set(&mut self, key: &'static str, v: impl Into<Value>) {
        let v = v.into();
        match self.attrs.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = v,
            None => self.attrs.push((key, v)),
        }
    }

    /// The value of `key`, if set.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.attrs.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// It ends at `at` (never before its start).
    pub fn end(&mut self, at: u64) {
        self.end = at.max(self.start);
    }

    /// It failed: `why`.
    pub fn fail(&mut self, why: impl Into<String>) {
        self.error = Some(why.into());
    }
}

/// `traceparent` (version 00, sampled) naming `span_id` as the parent of
/// what follows, written into `out` (55 bytes).
pub fn traceparent(trace_id: &[u8; 16], span_id: &[u8; 8], out: &mut [u8; 55]) {
    let hex = |n: u8| if n < 10 { b'0' + n } else { b'a' + n - 10 };
    let mut w = |at: usize, bytes: &[u8]| {
        if let Some(dst) = out.get_mut(at..at + 2 * bytes.len()) {
            for (pair, b) in dst.chunks_exact_mut(2).zip(bytes) {
                if let [h, l] = pair {
                    *h = hex(b >> 4);
                    *l = hex(b & 0x0f);
                }
            }
        }
    };
    w(3, trace_id);
    w(36, span_id);
    w(53, &[0x01]);
    if let Some(v) = out.get_mut(0..2) {
        v.copy_from_slice(b"00");
    }
    for at in [2, 35, 52] {
        if let Some(b) = out.get_mut(at) {
            *b = b'-';
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_names_the_span_as_parent() {
        let mut out = [0u8; 55];
        traceparent(&[0xab; 16], &[0x01, 0x02, 0, 0, 0, 0, 0, 0xff], &mut out);
        assert_eq!(
            std::str::from_utf8(&out).expect("ascii"),
            "00-abababababababababababababababab-01020000000000ff-01"
        );
        let parsed = crate::logic::http::trace_context::parse(&out).expect("valid");
        assert_eq!(parsed.parent_id, [0x01, 0x02, 0, 0, 0, 0, 0, 0xff]);
    }

    #[test]
    fn an_attribute_set_twice_keeps_its_last_value_and_an_end_never_precedes_the_start() {
        let mut s = Span::new([1; 16], [2; 8], None, "x", Kind::Internal, 100);
        s.set("a", 1u64);
        s.set("a", "two");
        assert_eq!(s.attrs.len(), 1);
        assert_eq!(s.get("a"), Some(&Value::Str("two".into())));
        s.end(50);
        assert_eq!(s.end, 100);
    }
}
