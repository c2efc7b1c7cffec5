//! The flush stamps of the history store: which flush it holds (in the
//! store and in files inside and beside it), so a store that comes back
//! older than the last flush, or empty, is noticed and said; and the mark
//! of writes that failed until the router stopped.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use tracing::error;

use super::{Open, FLUSH_STAMP};

/// Which flush a store holds: a sequence number and its time, written in
/// the flush's own batch, and (after the persist) in a small file beside
/// the store, so a store that comes back older than the last flush we made
/// (a truncated journal, a restored copy) or empty is noticed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Stamp {
    pub(super) seq: u64,
    pub(super) unix: u64,
}

impl Stamp {
    pub(super) fn encode(self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.seq.to_be_bytes());
        b[8..].copy_from_slice(&self.unix.to_be_bytes());
        b
    }

    pub(super) fn decode(b: &[u8]) -> Option<Self> {
        let seq = u64::from_be_bytes(b.get(..8)?.try_into().ok()?);
        let unix = u64::from_be_bytes(b.get(8..16)?.try_into().ok()?);
        Some(Stamp { seq, unix })
    }
}

/// The files that remember the last persisted flush, both written after
/// every flush: one inside the store's directory, so that a volume
/// mounted at the store path carries it across restarts (issue 29 #7;
/// fjall ignores files it does not own), one beside it, so that an older
/// copy restored over the store is still noticed. The newest counts.
pub(super) fn stamp_file(store: &Path) -> PathBuf {
    store.join("hivenet-flush-stamp")
}

/// The stamp beside the store (the only one of earlier versions).
pub(super) fn beside_stamp_file(store: &Path) -> PathBuf {
    PathBuf::from(format!("{}.flush-stamp", store.display()))
}

pub(super) fn parse_stamp(text: &str) -> Option<Stamp> {
    let mut it = text.split_whitespace();
    Some(Stamp {
        seq: it.next()?.parse().ok()?,
        unix: it.next()?.parse().ok()?,
    })
}

/// When writes began to fail, if a stamp file says they never recovered.
pub(super) fn unflushed_marker(store: &Path) -> Option<u64> {
    [stamp_file(store), beside_stamp_file(store)]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .find_map(|t| {
            let mut it = t.split_whitespace();
            let (_, since, mark) = (it.next()?, it.next()?, it.next()?);
            (mark == "unflushed").then(|| since.parse().ok()).flatten()
        })
}

/// The newest of the two stamp files.
pub(super) fn read_stamp_file(store: &Path) -> Option<Stamp> {
    [stamp_file(store), beside_stamp_file(store)]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .filter_map(|t| parse_stamp(&t))
        .max_by_key(|s| s.seq)
}

pub(super) fn write_one_stamp(path: &Path, s: Stamp) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = PathBuf::from(format!("{}.tmp", path.display()));
    let mut f = std::fs::File::create(&tmp)?;
    writeln!(f, "{} {}", s.seq, s.unix)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

pub(super) fn write_stamp_file(store: &Path, s: Stamp) -> std::io::Result<()> {
    write_one_stamp(&stamp_file(store), s)?;
    write_one_stamp(&beside_stamp_file(store), s)
}

/// Compare the store's stamp with the file's on open; log loudly and count
/// a storage error when the store is older than the last flush we made or
/// empty when one was expected. Returns the sequence to continue from.
pub(super) fn check_stamps(path: &Path, o: &Open, errors: &AtomicU64) -> u64 {
    let in_store = o
        .meta
        .get(FLUSH_STAMP)
        .ok()
        .flatten()
        .and_then(|v| Stamp::decode(&v));
    let on_file = read_stamp_file(path);
    match (on_file, in_store) {
        (Some(f), None) => {
            errors.fetch_add(1, Ordering::Relaxed);
            let empty = o.ks.iter().next().is_none();
            error!(
                path = %path.display(), expected_flush = f.seq, expected_flush_unix = f.unix,
                "{}: the store holds no flush stamp but flush #{} was persisted; latency history may be lost",
                if empty { "STORE EMPTY" } else { "STORE ROLLED BACK" },
                f.seq
            );
        }
        (Some(f), Some(s)) if s.seq < f.seq => {
            errors.fetch_add(1, Ordering::Relaxed);
            error!(
                path = %path.display(), recovered_flush = s.seq, recovered_flush_unix = s.unix,
                expected_flush = f.seq, expected_flush_unix = f.unix,
                "STORE ROLLED BACK: the store recovered flush #{} but flush #{} was persisted; the history is older than it should be",
                s.seq, f.seq
            );
        }
        _ => {}
    }
    on_file
        .map(|f| f.seq)
        .max(in_store.map(|s| s.seq))
        .unwrap_or(0)
}

/// Mark the stamp files "writes failing since `since`" in place (no new
/// block on a full disk): a restart then says what was lost.
pub(super) fn mark_unflushed(store: &Path, last: u64, since: u64) {
    for p in [stamp_file(store), beside_stamp_file(store)] {
        if let Ok(mut f) = std::fs::OpenOptions::new().write(true).open(&p) {
            use std::io::Write;
            let line = format!("{last} {since} unflushed");
            let _ = f.write_all(format!("{line:<63}\n").as_bytes());
        }
    }
}
