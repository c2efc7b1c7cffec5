//! The one ending of every client request: [`finish`] settles its quota
//! (refund or true-up), counts the tenant's outcome and writes its one
//! audit line, whatever path it took (served, refused at ingress,
//! redirected, held and expired, client gone). The connection loop of
//! [`crate::runtime::front::ingress`] calls it once per request answered on this shard; a
//! request handed to another shard is finished there.

use crate::runtime::services::audit::{self, AuditRecord};
use crate::runtime::state::model::stats::{self, DURATION_BUCKETS};
use crate::runtime::state::scope::{Client, RequestScope};
use crate::runtime::state::shard::Shard;
use crate::runtime::state::tenancy::{Principal, Settle};
use crate::runtime::wire::clock;

/// At most one audited 401 per this period on a shard (issue 29 #14).
const AUDIT_401_PERIOD: std::time::Duration = std::time::Duration::from_millis(100);

/// Settle, count and audit the request of the client's scope (once: the
/// ticket and the agent are taken out of it).
pub fn finish(shard: &Shard, c: &mut Client) {
    let scope = &mut c.scope;
    let end = &mut scope.ending;
    end.settle_cut();
    let ok = end.status > 0 && end.status < 400;
    if let Some(t) = end.ticket.take() {
        t.settle(match (ok, end.tokens) {
            (true, Some(u)) => Settle::Usage(u),
            // Served, usage unknown, or the client left mid-response: the
            // estimate stands.
            _ if end.relayed && (ok || end.status == 499) => Settle::Unknown,
            // Nothing generated reached the client.
            _ => Settle::NothingSent,
        });
    }
    let elapsed = scope.started.elapsed();
    let tokens = end.tokens.unwrap_or_default();
    if end.dispatched {
        count_tenant(shard, scope, ok, elapsed);
    }
    super::spans::finish(shard, scope);
    let agent = scope.ending.agent.take();
    if scope.ending.status > 0 {
        let key = (
            stats::method_of(&scope.method),
            stats::route_of(&scope.path),
            scope.ending.status,
        );
        stats::observe_http(&mut shard.http.borrow_mut(), key, elapsed.as_secs_f64());
    }
    if scope.quiet {
        return;
    }
    let Some(log) = &shard.router.audit else {
        return;
    };
    if scope.ending.status == 401
        && shard
            .audit_401_gate
            .borrow_mut()
            .hit(clock::now(), AUDIT_401_PERIOD)
            .is_none()
    {
        crate::runtime::state::shard::inc(&shard.counters.audit_401_suppressed);
        return;
    }
    let principal = scope.principal.as_ref();
    log.send(AuditRecord {
        started: audit::started_at(elapsed),
        request_id: scope.request_id,
        trace_id: audit::trace_id_of(scope.trace.as_ref()),
        tenant_id: principal
            .map(Principal::tenant_arc)
            .unwrap_or_else(|| "".into()),
        key_id: principal
            .map(Principal::key_id_arc)
            .unwrap_or_else(|| "".into()),
        model: scope.model.clone(),
        status: scope.ending.status,
        latency_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
        input_tokens: tokens.input,
        output_tokens: tokens.output,
        agent_id: agent.map(|a| a.peer.clone()),
        error_code: scope.ending.error_code,
        source_ip: c.conn.stream.peer_addr().ok().map(|a| a.ip()),
        method: scope.method.clone(),
        path: scope.path.clone(),
        continued_from: std::mem::take(&mut scope.ending.continued_from),
    });
}

/// The tenant's outcome on the model's shard: success with tokens and
/// duration, or a failure.
fn count_tenant(shard: &Shard, scope: &RequestScope, ok: bool, elapsed: std::time::Duration) {
    let tokens = scope.ending.tokens.unwrap_or_default();
    let now_unix = clock::unix_secs();
    let Some(m) = shard.model(scope.model.as_str()) else {
        return;
    };
    let mut m = m.borrow_mut();
    let Some(principal) = &scope.principal else {
        return;
    };
    let (tenant, key) = principal.names();
    let Some(t) = m.stats.tenant(tenant, key) else {
        return;
    };
    if ok {
        t.success += 1;
        t.input_tokens += tokens.input;
        t.output_tokens += tokens.output;
        t.duration.observe(&DURATION_BUCKETS, elapsed.as_secs_f64());
    } else {
        t.failed += 1;
    }
    t.last_request = now_unix;
}
