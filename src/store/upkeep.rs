//! The store's upkeep: the expiry sweep of records older than
//! `--disk-db-ttl` days (at open and hourly) and the figures of
//! `GET /admin/storage`.

use std::sync::atomic::{AtomicU64, Ordering};

use fjall::PersistMode;
use shards::logic::routing::history::History;
use shards::runtime::services::store_api::StoreStats;
use shards::runtime::wire::clock;
use tracing::{info, warn};

use super::{Open, StoreConfig, SWEEP_EVERY};

/// The store's figures (full scans: as many records as peers and buckets).
pub(super) fn stats(
    store: Option<&Open>,
    cfg: &StoreConfig,
    last_sweep_unix: Option<u64>,
) -> StoreStats {
    let mut s = StoreStats {
        ttl_days: cfg.ttl_days,
        sweep_every_secs: SWEEP_EVERY.as_secs(),
        last_sweep_unix,
        ..Default::default()
    };
    if let Some(o) = store {
        s.open = true;
        s.history_count = o.ks.iter().count() as u64;
        s.quota_count = o.quota.iter().count() as u64;
        s.journal_size_bytes = o.db.journal_disk_space().unwrap_or(0);
        s.lsm_size_bytes =
            o.db.disk_space()
                .unwrap_or(0)
                .saturating_sub(s.journal_size_bytes);
    }
    s
}

pub(super) fn sweep(o: &Open, ttl_days: u64, errors: &AtomicU64) {
    if ttl_days == 0 {
        return;
    }
    let now = clock::unix_secs();
    let mut expired = Vec::new();
    for kv in o.ks.iter() {
        let Ok((k, v)) = kv.into_inner() else {
            continue;
        };
        match History::decode(&v) {
            Ok(h) if !h.expired(now, ttl_days) => {}
            _ => expired.push(k),
        }
    }
    if expired.is_empty() {
        return;
    }
    let n = expired.len();
    let mut b = o.db.batch();
    for k in expired {
        b.remove(&o.ks, k);
    }
    if let Err(e) = b.commit().and_then(|_| o.db.persist(PersistMode::SyncAll)) {
        errors.fetch_add(1, Ordering::Relaxed);
        warn!("store sweep failed: {e}");
    } else {
        info!(removed = n, "expired history records swept");
    }
}
