//! `GET /admin/storage` (spec 02 §6): what the router holds in memory per
//! agent and what its history store holds on disk. The store is fjall,
//! not Badger: `lsm_size_bytes` is its tables, `vlog_size_bytes` its
//! write-ahead journal, `gc_interval` and `last_gc_at` its expiry sweep
//! of records older than `--disk-db-ttl`.

use std::rc::Rc;

use serde_json::json;

use crate::logic::link::engine_metrics::EngineSignals;
use crate::logic::link::hardware::HardwareSignals;
use crate::logic::system::timefmt::rfc3339_nanos;
use crate::runtime::services::store_api::{StoreMsg, StoreStats};
use crate::runtime::state::shard::Shard;

/// The answer: status and JSON body.
pub async fn storage(shard: &Rc<Shard>) -> (u16, Vec<u8>) {
    let Some(store) = &shard.router.store else {
        let body = json!({"error": "storage stats not available for this backend"});
        return (200, serde_json::to_vec(&body).unwrap_or_default());
    };
    let (tx, rx) = futures::channel::oneshot::channel();
    if store.send(StoreMsg::Stats { reply: tx }).is_err() {
        return error("store thread is gone");
    }
    let disk = match monoio::time::timeout(std::time::Duration::from_secs(5), rx).await {
        Ok(Ok(s)) => s,
        _ => return error("store did not answer within 5s"),
    };
    let snaps = shard.gather().await;
    let agents: Vec<_> = snaps.iter().flat_map(|s| s.agents.iter()).collect();
    let engine = agents
        .iter()
        .filter(|a| a.signals != EngineSignals::default())
        .count();
    let hardware = agents
        .iter()
        .filter(|a| a.hardware != HardwareSignals::default())
        .count();
    let body = json!({
        "mem_db": {
            "metadata_count": agents.len(),
            "univ_punctual_count": agents.len(),
            "eng_punctual_count": engine,
            "hardware_snapshot_count": hardware,
        },
        "disk_db": disk_json(&disk),
        "gc_interval": go_duration(disk.sweep_every_secs),
        "last_gc_at": disk
            .last_sweep_unix
            .map_or_else(|| "never".to_string(), |t| rfc3339_nanos(t, 0)),
    });
    (200, serde_json::to_vec(&body).unwrap_or_default())
}

fn disk_json(d: &StoreStats) -> serde_json::Value {
    json!({
        "univ_history_count": d.history_count,
        "quota_bucket_count": d.quota_count,
        "responses_count": d.responses_count,
        "responses_bytes": d.responses_bytes,
        "lsm_size_bytes": d.lsm_size_bytes,
        "vlog_size_bytes": d.journal_size_bytes,
        "entry_ttl_days": d.ttl_days,
        "open": d.open,
    })
}

fn error(why: &str) -> (u16, Vec<u8>) {
    let body = json!({"error": format!("failed to read storage stats: {why}")});
    (500, serde_json::to_vec(&body).unwrap_or_default())
}

/// Go's `time.Duration` text: `5s`, `1m30s`, `1h0m0s`.
fn go_duration(secs: u64) -> String {
    let (h, m, s) = (secs / 3600, secs % 3600 / 60, secs % 60);
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, _) => format!("{m}m{s}s"),
        _ => format!("{h}h{m}m{s}s"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn durations_read_as_go_prints_them() {
        assert_eq!(super::go_duration(5), "5s");
        assert_eq!(super::go_duration(90), "1m30s");
        assert_eq!(super::go_duration(3600), "1h0m0s");
    }
}
