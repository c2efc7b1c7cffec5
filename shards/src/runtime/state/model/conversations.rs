//! The Responses API (issue 52), the model's sub-state: its requests by
//! how the router treated the conversation ([`ResponsesStats`]) and the
//! metric family ([`render`]). The conversation itself is the store's;
//! the request's part is [`crate::runtime::request::responses`].

use std::collections::BTreeMap;

use crate::runtime::wire::exposition::Family;
use crate::runtime::wire::exposition::Kind::Counter;

/// Responses requests of the model, by kind.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ResponsesStats {
    /// `hivenet_responses_requests_total{kind}`: `new` (no previous
    /// response), `continued` (the router rebuilt the conversation into
    /// the request: the engine keeps no state), `refused` (bad input, or
    /// a previous response unknown to the tenant).
    pub requests: BTreeMap<&'static str, u64>,
}

impl ResponsesStats {
    /// One request of `kind`.
    pub fn count(&mut self, kind: &'static str) {
        *self.requests.entry(kind).or_default() += 1;
    }

    /// Add another shard's counters of the model.
    pub fn add(&mut self, o: &ResponsesStats) {
        for (k, n) in &o.requests {
            *self.requests.entry(k).or_default() += n;
        }
    }
}

/// The Responses family, a series per model and kind seen.
pub fn render<'m, I>(o: &mut String, models: I)
where
    I: Iterator<Item = (&'m String, &'m ResponsesStats)>,
{
    let mut f = Family::new(
        o,
        "hivenet_responses_requests_total",
        Counter,
        "Responses API requests, by kind: new (no previous_response_id), continued (the router rebuilt the conversation from its store into the request), refused (bad input, or a previous response unknown to the key's tenant).",
        ["model", "kind"],
    );
    for (m, st) in models {
        for (kind, n) in &st.requests {
            f.series([m, kind], n);
        }
    }
}
