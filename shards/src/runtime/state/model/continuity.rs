//! Stream continuity (issue 33), the model's sub-state: how every broken
//! stream of the model ended ([`ContinuityStats`]) and its metric family
//! ([`render`]). The transcript a broken stream keeps and its tries are
//! the request's ([`crate::runtime::request::continuation`]); which agent
//! continues, and the wait for one, are the decision machine's.

use std::collections::BTreeMap;

use crate::runtime::wire::exposition::Family;
use crate::runtime::wire::exposition::Kind::Counter;

/// Streams whose agent broke mid-answer, by outcome label.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ContinuityStats {
    /// `hivenet_stream_migrations_total{outcome}`: counted once per
    /// broken stream.
    pub migrations: BTreeMap<&'static str, u64>,
}

impl ContinuityStats {
    /// A broken stream ended as `outcome`.
    pub fn ended(&mut self, outcome: &'static str) {
        *self.migrations.entry(outcome).or_default() += 1;
    }

    /// Add another shard's counters of the model.
    pub fn add(&mut self, o: &ContinuityStats) {
        for (outcome, n) in &o.migrations {
            *self.migrations.entry(outcome).or_default() += n;
        }
    }
}

/// The continuity family, a series per model and outcome seen.
pub fn render<'m, I>(o: &mut String, models: I)
where
    I: Iterator<Item = (&'m String, &'m ContinuityStats)>,
{
    let mut f = Family::new(
        o,
        "hivenet_stream_migrations_total",
        Counter,
        "Streams whose agent broke mid-answer, by outcome: continued on another agent, failed (every continuation broke), no_agent, deadline, client_gone, finished (the answer was whole), or why it could not be continued (tools, not_text, engine_cannot_continue...).",
        ["model", "outcome"],
    );
    for (m, st) in models {
        for (outcome, n) in &st.migrations {
            f.series([m, outcome], n);
        }
    }
}
