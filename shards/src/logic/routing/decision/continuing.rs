//! The decision machine's continuation of a broken stream (issue 33):
//! after [`Decision::stream_broke`], [`Decision::next`] answers
//! [`Action::Continue`] on the policy's first step with a free agent that
//! can prefill (never one already tried for this answer),
//! [`Action::Wait`] at the head of the line when every such agent is
//! full, or [`Action::Cut`] with why the stream ends cut. The driver
//! reports each try with [`Decision::continuation_ended`] and each wait
//! with [`Decision::wait_ended`], as for a forward.
//!
//! The same selector ([`policy::select`]) and the same wait as any
//! forward: the shell has no picker and no wait loop of its own.

use std::time::Instant;

use super::{Action, AttemptEnd, Decision, ModelFacts, Pool, WaitEnd};
use crate::logic::http::api::continuation::prefill_for;
use crate::logic::routing::policy::{self, StepPick};
use crate::logic::routing::wait_queue::Prefer;

/// Why a broken stream ends cut (the `outcome` label of
/// `hivenet_stream_migrations_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CutReason {
    /// Every continuation try broke or failed (`--stream-migrations`).
    Failed,
    /// No agent that can continue is registered.
    NoAgent,
    /// The continuation's deadline (the break plus `--request-timeout`)
    /// passed.
    Deadline,
    /// The client left while a continuation waited for a slot.
    ClientGone,
}

impl CutReason {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            CutReason::Failed => "failed",
            CutReason::NoAgent => "no_agent",
            CutReason::Deadline => "deadline",
            CutReason::ClientGone => "client_gone",
        }
    }
}

/// A broken stream under continuation.
#[derive(Debug, Clone)]
pub(super) struct Continuing {
    /// Continuation tries left.
    left: u32,
    /// Agents tried for this answer, the first one included: never again.
    tried: Vec<u64>,
    /// How it ended (sticky).
    end: Option<CutReason>,
    /// Its last wake is not yet answered by a pick.
    woken: bool,
    /// When it gives up: `--request-timeout` after the break (issue 56),
    /// not after routing started, so a stream of any age can be continued.
    deadline: Instant,
}

impl Continuing {
    pub(super) fn wait_ended(&mut self, end: WaitEnd) {
        match end {
            WaitEnd::Woken => self.woken = true,
            // Let go from the line (displaced): look again.
            WaitEnd::Refused => {}
            WaitEnd::TimedOut => self.end = Some(CutReason::Deadline),
            WaitEnd::ClientGone => self.end = Some(CutReason::ClientGone),
        }
    }
}

// === impl Decision ===

impl Decision {
    /// The stream forwarded to `agent_id` broke mid-answer and the driver
    /// found it continuable: up to `migrations` tries on other agents,
    /// until `deadline` (the break plus `--request-timeout`).
    pub fn stream_broke(&mut self, agent_id: u64, migrations: u32, deadline: Instant) {
        self.continuing = Some(Continuing {
            left: migrations,
            tried: vec![agent_id],
            end: None,
            woken: false,
            deadline,
        });
    }

    /// A stream the process this one replaced was relaying when its
    /// `--upgrade-drain-timeout` passed (issue 54): continued here as if
    /// it broke here, on any agent (its own one too: its engine holds the
    /// prefix; the cut was the router's). The steps before routing were
    /// the old process's: none is taken again.
    pub fn stream_resumed(&mut self, migrations: u32, deadline: Instant) {
        self.stream_broke(0, migrations, deadline);
        if let Some(c) = self.continuing.as_mut() {
            c.tried.clear();
        }
    }

    /// The deadline of the continuation under way (the request's when
    /// none is).
    pub fn continuation_deadline(&self) -> Instant {
        self.continuing
            .as_ref()
            .map_or(self.request.deadline, |c| c.deadline)
    }

    /// A continuation try ended. Returns whether the continuation goes on
    /// (call [`Decision::next`]); `false`: the answer is finished.
    pub fn continuation_ended(&mut self, end: &AttemptEnd) -> bool {
        match end {
            AttemptEnd::Responded => {
                self.continuing = None;
                false
            }
            AttemptEnd::Failed(_) | AttemptEnd::Full => true,
        }
    }

    pub(super) fn next_continuation<P: Pool + ?Sized>(
        &mut self,
        model: &ModelFacts<'_, P>,
        now: Instant,
    ) -> Action {
        let cap = self.request.endpoint.capability();
        let Some(c) = self.continuing.as_mut() else {
            return Action::Cut(CutReason::Failed);
        };
        let deadline = c.deadline;
        if let Some(end) = c.end {
            return Action::Cut(end);
        }
        let end = if c.left == 0 {
            CutReason::Failed
        } else if now >= deadline {
            CutReason::Deadline
        } else {
            let n = model.pool.agent_count();
            let get = |i| {
                model
                    .pool
                    .facts(i)
                    .filter(|f| prefill_for(f.engine).is_some())
            };
            let mut full = false;
            for (s, step) in self.policy.steps.iter().enumerate() {
                match policy::select(step, cap, n, get, &c.tried, model.rotation) {
                    StepPick::Agent(i) => {
                        let Some((id, prefill)) =
                            get(i).and_then(|f| Some((f.id, prefill_for(f.engine)?)))
                        else {
                            continue;
                        };
                        c.left -= 1;
                        c.tried.push(id);
                        c.woken = false;
                        return Action::Continue {
                            agent: i,
                            agent_id: id,
                            step: s,
                            prefill,
                        };
                    }
                    StepPick::Full(_) => full = true,
                    StepPick::Empty(_) => {}
                }
            }
            if full {
                return Action::Wait {
                    until: deadline,
                    place: None,
                    wake_first: None,
                    prefer: Prefer::default(),
                    pinned: false,
                    head: true,
                    pass_on: std::mem::take(&mut c.woken),
                };
            }
            CutReason::NoAgent
        };
        c.end = Some(end);
        Action::Cut(end)
    }
}
