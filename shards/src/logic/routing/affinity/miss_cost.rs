//! What a cache miss costs on a model's engines: the seconds one uncached
//! prompt token adds to a request, learned from the requests themselves.
//! It bounds `holder_wait_ms`: waiting longer for a full cache holder than
//! the prefill the hit would save cannot pay, so on engines that prefill
//! fast (a GPU: a few thousand tokens in tens of ms) the wait shrinks to
//! that, and on slow ones (llama.cpp on a CPU: seconds) the configured
//! bound applies.
//!
//! A request's time on its agent is close to `a·uncached + b·output`:
//! prefill per uncached prompt token, decode per output token (the engine
//! reports both counts). Both are solved by least squares over decayed
//! sums, with no intercept: the fixed part of a request spreads over `a`
//! and `b` and overstates them a little, which can only lengthen a wait up
//! to its configured bound. Queueing inside the engine does the same.
//!
//! It also says when affinity is not worth bending the queue for: where a
//! hit saves under [`WORTH`] of a typical request's time (fast prefill,
//! long answers), waiting for a holder or letting a holder's waiter pass
//! the head of the line buys little throughput and costs the passed
//! requests their tail (8 simulated engines at 0.3 ms a prompt token and
//! 128-token answers: p95 up to 1.8x least-loaded's with the reordering,
//! `perf/2026-12-04-affinity-miss-cost`).

use std::time::Duration;

/// Weight of the sums kept per new request (memory of about 200 requests:
/// an engine that changes is followed within minutes).
const DECAY: f64 = 0.995;

/// Requests learned before `a` is trusted.
pub const MIN_SAMPLES: u32 = 8;

/// The share of a typical request's time a hit must save for affinity to
/// wait for a holder or reorder the queue for it.
pub const WORTH: f64 = 0.2;

/// The decayed least-squares sums of one model's requests.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MissCost {
    uu: f64,
    uo: f64,
    oo: f64,
    ud: f64,
    od: f64,
    /// Decayed sum of request seconds, and of weights (their mean).
    secs: f64,
    weight: f64,
    samples: u32,
}

/// What a model's requests cost, once learned.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Learned {
    /// Seconds a byte of prompt prefix costs to prefill.
    pub secs_per_byte: f64,
    /// A typical request's seconds on its agent (decayed mean).
    pub mean_request_secs: f64,
}

impl Learned {
    /// What a hit on `bytes` of prefix saves, and whether that is worth
    /// waiting or reordering for ([`WORTH`]).
    pub fn saving(&self, bytes: f64) -> (f64, bool) {
        let s = self.secs_per_byte * bytes;
        (s, s >= WORTH * self.mean_request_secs)
    }
}

impl MissCost {
    /// Learn one served request: its uncached prompt tokens, its output
    /// tokens and its seconds on the agent (from the request written to
    /// the end of its answer). A duration that is not a finite
    /// non-negative number is ignored.
    pub fn learn(&mut self, uncached: u64, output: u64, secs: f64) {
        if !secs.is_finite() || secs < 0.0 || (uncached == 0 && output == 0) {
            return;
        }
        let (u, o) = (uncached as f64, output as f64);
        self.uu = self.uu * DECAY + u * u;
        self.uo = self.uo * DECAY + u * o;
        self.oo = self.oo * DECAY + o * o;
        self.ud = self.ud * DECAY + u * secs;
        self.od = self.od * DECAY + o * secs;
        self.secs = self.secs * DECAY + secs;
        self.weight = self.weight * DECAY + 1.0;
        self.samples = self.samples.saturating_add(1);
    }

    /// Seconds per uncached prompt token, once the requests tell prefill
    /// and decode apart: `None` before [`MIN_SAMPLES`] requests, with no
    /// uncached token seen, or when every request had the same ratio of
    /// uncached to output tokens (the two cannot be separated).
    pub fn per_token(&self) -> Option<f64> {
        if self.samples < MIN_SAMPLES || self.uu <= 0.0 {
            return None;
        }
        if self.oo <= 0.0 {
            // No output at all (embeddings): the whole time is prefill.
            return Some((self.ud / self.uu).max(0.0));
        }
        let det = self.uu * self.oo - self.uo * self.uo;
        // Relative to its scale: below this the rows are collinear.
        if det <= 1e-6 * self.uu * self.oo {
            return None;
        }
        let a = (self.ud * self.oo - self.od * self.uo) / det;
        let b = (self.od * self.uu - self.ud * self.uo) / det;
        // Non-negative least squares on two unknowns: a negative decode
        // time is noise, refit with prefill alone.
        let a = if b < 0.0 { self.ud / self.uu } else { a };
        a.is_finite().then_some(a.max(0.0))
    }

    /// The learned costs, with `tokens_per_byte` of the model's prompts
    /// (None until [`MissCost::per_token`] is known).
    pub fn learned(&self, tokens_per_byte: f64) -> Option<Learned> {
        let a = self.per_token()?;
        Some(Learned {
            secs_per_byte: a * tokens_per_byte,
            mean_request_secs: if self.weight > 0.0 {
                self.secs / self.weight
            } else {
                0.0
            },
        })
    }
}

/// How long a request waits for a full holder: `cap_ms` (the policy's
/// `holder_wait_ms`), or less when the prefill a hit saves is shorter.
/// `saved_secs`: what missing would cost, when known.
pub fn holder_wait(cap_ms: u32, saved_secs: Option<f64>) -> Duration {
    let cap = Duration::from_millis(u64::from(cap_ms));
    match saved_secs {
        Some(s) if s.is_finite() && s >= 0.0 => cap.min(Duration::from_secs_f64(s.min(3600.0))),
        _ => cap,
    }
}

#[cfg(test)]
mod tests;
