//! A stream across an upgrade (issue 54): one still relayed when this
//! process's `--upgrade-drain-timeout` passes goes to the process
//! replacing it ([`Run::carry_if_upgrading`]), which continues it from
//! what its client received ([`Run::resume`]) as a stream whose agent
//! broke: the decision machine's continuation, spliced, so the client
//! sees one whole answer. The steps before routing (quota, admission,
//! the daily charge) were the old process's: the new one takes none
//! again and settles the daily tokens the old one reserved.

use super::Run;
use crate::logic::http::api::continuation::Api;
use crate::logic::routing::decision::Decision;
use crate::runtime::request::continuation::{self, Continuity};
use crate::runtime::state::scope::Client;
use crate::runtime::state::tenancy::{Principal, Ticket};
use crate::runtime::wire::clock;

// === impl Run ===

impl Run<'_> {
    /// A stream the process this one replaced carried over: the machine
    /// starts at its continuation. Nothing when the request is not one.
    pub(super) fn resume(&mut self, c: &mut Client, d: &mut Decision) {
        let Some(r) = self.resumed.take() else {
            return;
        };
        let (shard, p) = (self.shard, self.p);
        let r = *r;
        c.scope.committed = true;
        if matches!(p.principal, Principal::Key(_)) {
            c.scope.ending.ticket = Some(Ticket::carried(&p.principal, self.model, r.daily));
        }
        // `--stream-migrations 0` here: cut at once (the machine's
        // `failed`), as a break would be.
        let api = continuation::api_of(shard, p);
        let cfg = &shard.router.cfg;
        let tries = if api.is_some() {
            cfg.stream_migrations
        } else {
            0
        };
        d.stream_resumed(tries, clock::now() + cfg.request_timeout);
        c.scope.ending.continued_from.push(r.from.as_str().into());
        let api = api.unwrap_or(Api::OpenAi);
        self.cont = Some(Continuity::resumed(shard, p, api, r.transcript, &r.from));
    }

    /// A stream under continuation while this process is being replaced
    /// past its drain timeout: it goes to the new process; `Some(false)`
    /// (the request is finished here), else `None`.
    pub(super) fn carry_if_upgrading(&mut self, c: &mut Client) -> Option<bool> {
        if !self.shard.router.carry.streams() {
            return None;
        }
        let cont = self.cont.take()?;
        cont.carry_over(c, &self.request);
        Some(false)
    }
}
