//! An answer not yet started, waited for while its engine works (issue
//! 56). A non-streamed answer gives no byte before it is whole, so a head
//! deadline alone (`--http-timeout`) cuts every answer longer than it. The
//! agent waits past it while the engine's work counter moves (tokens per
//! scheduler step on vLLM and SGLang, `llama_decode()` calls on
//! llama-server, `engine_metrics::work_done`) and tells the router so with
//! an interim `102 Processing` head, which restarts the router's own head
//! deadline. An engine that exports no counter (Ollama, custom, Infinity)
//! or whose counter stands still for `--http-timeout` gets the 504 as
//! before: a hung engine is still found.
//!
//! Key items: [`EngineProgress`], [`HeadWatch`], [`await_head`].

use std::cell::Cell;
use std::io;
use std::time::{Duration, Instant};

use futures::AsyncWriteExt;
use shards::logic::link::engine_metrics;
use shards::runtime::wire::http_stream::HttpStream;

use super::backend;
use super::AgentConfig;

/// The interim head the router reads as "still working".
const PROCESSING: &[u8] = b"HTTP/1.1 102 Processing\r\n\r\n";

/// The engine's work counter as last read, shared by the agent's signal
/// scrape and every request waiting for its head (one `/metrics` read
/// serves them all).
pub struct EngineProgress {
    engine: &'static str,
    last: Cell<Option<(Instant, f64)>>,
}

impl EngineProgress {
    /// For the agent's engine.
    pub fn new(engine: super::engine::Engine) -> Self {
        EngineProgress {
            engine: engine.as_str(),
            last: Cell::new(None),
        }
    }

    /// Whether the engine exports a work counter at all.
    pub fn tracked(&self) -> bool {
        engine_metrics::tracks_work(self.engine)
    }

    /// Note a `/metrics` text read at `at`.
    pub fn record(&self, at: Instant, text: &str) {
        if let Some(w) = engine_metrics::work_done(self.engine, text) {
            self.last.set(Some((at, w)));
        }
    }

    /// The newest reading, whenever it was made.
    pub fn latest(&self) -> Option<f64> {
        self.last.get().map(|(_, w)| w)
    }

    /// A reading no older than `fresh` (read now when the last is older).
    async fn read(&self, cfg: &AgentConfig, fresh: Duration) -> Option<f64> {
        if let Some((at, w)) = self.last.get() {
            if at.elapsed() < fresh {
                return Some(w);
            }
        }
        let limit = fresh.clamp(Duration::from_millis(10), Duration::from_secs(2));
        let (h, body) = backend::fetch(&cfg.backend, "GET", "/metrics", b"", limit)
            .await
            .ok()?;
        if h.status != 200 {
            return None;
        }
        self.record(Instant::now(), &String::from_utf8_lossy(&body));
        self.latest()
    }
}

/// What a check of the engine's work decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The counter moved: the head deadline restarts (and the router is
    /// told).
    Progress,
    /// No move yet; the deadline still runs.
    Waiting,
    /// No move for the whole `--http-timeout`: the 504.
    Expired,
}

/// The head deadline of one request, restarted by engine progress. Pure:
/// time and readings are arguments.
pub struct HeadWatch {
    limit: Duration,
    progress_at: Instant,
    seen: Option<f64>,
}

impl HeadWatch {
    /// A request sent at `start`, the engine's counter then `seen`.
    pub fn new(limit: Duration, start: Instant, seen: Option<f64>) -> Self {
        HeadWatch {
            limit,
            progress_at: start,
            seen,
        }
    }

    /// A check at `now` with the counter at `reading`.
    pub fn check(&mut self, now: Instant, reading: Option<f64>) -> Verdict {
        let moved = matches!((self.seen, reading), (Some(a), Some(b)) if b > a);
        // A lower value is a restarted engine: the new baseline.
        if reading.is_some() {
            self.seen = reading;
        }
        if moved {
            self.progress_at = now;
            Verdict::Progress
        } else if now.saturating_duration_since(self.progress_at) >= self.limit {
            Verdict::Expired
        } else {
            Verdict::Waiting
        }
    }
}

/// The backend's answer (`fut`, up to its head) within `--http-timeout`
/// of the engine's last progress. `interim`: the router reads `102` heads
/// and wants one at most this often (`None`: an older router, told
/// nothing).
pub async fn await_head<T>(
    cfg: &AgentConfig,
    meter: &EngineProgress,
    interim: Option<Duration>,
    s: &mut HttpStream,
    fut: impl std::future::Future<Output = io::Result<T>>,
) -> io::Result<T> {
    let limit = cfg.http_timeout;
    let expired = || {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no response head from the backend for {limit:?}"),
        )
    };
    if !meter.tracked() {
        return super::serve::within(Some(limit), "no response head from the backend", fut).await;
    }
    // Two checks per deadline at least, and one per router period.
    let period = interim
        .map_or(limit / 2, |p| p.min(limit / 2))
        .max(Duration::from_millis(10));
    let mut watch = HeadWatch::new(limit, Instant::now(), meter.latest());
    futures::pin_mut!(fut);
    loop {
        if let Ok(r) = monoio::time::timeout(period, &mut fut).await {
            return r;
        }
        let reading = meter.read(cfg, period / 2).await;
        match watch.check(Instant::now(), reading) {
            Verdict::Progress => {
                if interim.is_some() {
                    // A router that is gone ends the wait (the backend's
                    // answer goes nowhere).
                    let told = async {
                        s.write_all(PROCESSING).await?;
                        s.flush().await
                    };
                    match monoio::time::timeout(period, told).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => return Err(e),
                        Err(_) => {
                            return Err(io::Error::new(
                                io::ErrorKind::BrokenPipe,
                                "the router took no progress report",
                            ))
                        }
                    }
                }
            }
            Verdict::Waiting => {}
            Verdict::Expired => return Err(expired()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_runs_from_the_last_move_of_the_counter() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut w = HeadWatch::new(s, t0, Some(10.0));
        assert_eq!(w.check(t0 + s / 2, Some(10.0)), Verdict::Waiting);
        assert_eq!(w.check(t0 + s, Some(12.0)), Verdict::Progress);
        // 1.9 s after the start but 0.9 s after the move: still waiting.
        assert_eq!(w.check(t0 + s * 19 / 10, Some(12.0)), Verdict::Waiting);
        assert_eq!(w.check(t0 + s * 2, Some(12.0)), Verdict::Expired);
    }

    #[test]
    fn no_reading_or_a_restarted_engine_is_no_progress() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut w = HeadWatch::new(s, t0, None);
        // The first reading is a baseline, not a move.
        assert_eq!(w.check(t0 + s / 2, Some(5.0)), Verdict::Waiting);
        assert_eq!(w.check(t0 + s * 3 / 4, None), Verdict::Waiting);
        // A counter that went down (a restart) is the new baseline ...
        assert_eq!(w.check(t0 + s * 9 / 10, Some(1.0)), Verdict::Waiting);
        assert_eq!(w.check(t0 + s, Some(1.0)), Verdict::Expired);
        // ... and a move past it counts.
        assert_eq!(w.check(t0 + s * 11 / 10, Some(2.0)), Verdict::Progress);
    }
}
