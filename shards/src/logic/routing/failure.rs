//! Why an exchange with an agent failed: who failed, how far the exchange
//! got, and whether trying another agent may help (pingora's error source
//! and retry flag are the model). The retry decision and the latency-sample
//! rule are made here, once, from these facts.

/// Who failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The agent or its link (stream refused, link closed, bad framing).
    Agent,
    /// The backend behind the agent (a 502-504 response head).
    Backend,
    /// The router itself (the request deadline passed).
    Router,
}

/// How far the exchange got when it failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// The request stream was not open yet: nothing reached the agent.
    Opening,
    /// The request was being written or its response head awaited.
    AwaitingHead,
    /// The response head was relayed: the client already has part of it.
    Relaying,
}

/// One failed exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// Who failed.
    pub side: Side,
    /// How far it got.
    pub stage: Stage,
    /// What happened, for the log.
    pub context: String,
}

impl Failure {
    /// A failure of `side` at `stage`.
    pub fn new(side: Side, stage: Stage, context: impl Into<String>) -> Self {
        Failure {
            side,
            stage,
            context: context.into(),
        }
    }

    /// Whether another agent may serve the request: nothing was relayed to
    /// the client yet and the router's own deadline did not pass.
    pub fn retryable(&self) -> bool {
        self.stage < Stage::Relaying && self.side != Side::Router
    }

    /// Whether the request reached the agent, so the time it took is a
    /// latency sample (seed latency-tracking: a sample is taken only for a
    /// request that was written).
    pub fn reached_agent(&self) -> bool {
        self.stage >= Stage::AwaitingHead
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} failed while {:?}: {}",
            self.side, self.stage, self.context
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_and_sample_rules() {
        let open = Failure::new(Side::Agent, Stage::Opening, "refused");
        assert!(open.retryable());
        assert!(!open.reached_agent(), "no sample when nothing was written");
        let head = Failure::new(Side::Backend, Stage::AwaitingHead, "503");
        assert!(head.retryable());
        assert!(head.reached_agent());
        let mid = Failure::new(Side::Agent, Stage::Relaying, "cut");
        assert!(
            !mid.retryable(),
            "the client already has part of the response"
        );
        let late = Failure::new(Side::Router, Stage::Opening, "deadline");
        assert!(!late.retryable());
        assert!(
            !late.reached_agent(),
            "a deadline while opening is no sample"
        );
    }
}
