//! The persisted per-agent record (keyed by peer ID in the store) and its
//! compact, versioned binary codec. Pure; the store thread does the I/O.
//!
//! Layout v1 (little endian): `[1u8][flags u8][srtt f64][rttvar f64]`
//! then eight u64: successes, failures, input tokens, output tokens,
//! disconnections, agent failures, backend failures, written-at (Unix
//! seconds). Flag bit 0: the estimator is KNOWN.

/// Codec version.
pub const VERSION: u8 = 1;
/// Encoded size of v1.
pub const LEN_V1: usize = 2 + 8 * 2 + 8 * 8;

/// What survives a restart for one agent.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct History {
    /// SRTT, ms (None: UNKNOWN).
    pub srtt: Option<f64>,
    /// RTTVAR, ms.
    pub rttvar: Option<f64>,
    /// Lifetime successful requests.
    pub success: u64,
    /// Lifetime failed requests.
    pub failed: u64,
    /// Lifetime input tokens.
    pub input_tokens: u64,
    /// Lifetime output tokens.
    pub output_tokens: u64,
    /// Times the agent left (link closed).
    pub disconnections: u64,
    /// Healthy -> unhealthy transitions from missed heartbeats.
    pub agent_failures: u64,
    /// Healthy -> unhealthy transitions of reported backend health.
    pub backend_failures: u64,
    /// Unix seconds of the write (for TTL and staleness checks).
    pub written_at: u64,
}

/// Why a record could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// Unknown version byte.
    Version(u8),
    /// Wrong length for the version.
    Length(usize),
}

impl History {
    /// Encode.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(LEN_V1);
        out.push(VERSION);
        let known = self.srtt.is_some() && self.rttvar.is_some();
        out.push(u8::from(known));
        out.extend_from_slice(&self.srtt.unwrap_or(0.0).to_le_bytes());
        out.extend_from_slice(&self.rttvar.unwrap_or(0.0).to_le_bytes());
        for v in [
            self.success,
            self.failed,
            self.input_tokens,
            self.output_tokens,
            self.disconnections,
            self.agent_failures,
            self.backend_failures,
            self.written_at,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }

    /// Decode.
    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        match b.first() {
            Some(&VERSION) => {}
            Some(v) => return Err(DecodeError::Version(*v)),
            None => return Err(DecodeError::Length(0)),
        }
        if b.len() != LEN_V1 {
            return Err(DecodeError::Length(b.len()));
        }
        let known = b.get(1).copied().unwrap_or(0) & 1 == 1;
        let f = |i: usize| -> f64 {
            let mut a = [0u8; 8];
            if let Some(s) = b.get(i..i + 8) {
                a.copy_from_slice(s);
            }
            f64::from_le_bytes(a)
        };
        let u = |k: usize| -> u64 {
            let i = 18 + k * 8;
            let mut a = [0u8; 8];
            if let Some(s) = b.get(i..i + 8) {
                a.copy_from_slice(s);
            }
            u64::from_le_bytes(a)
        };
        let (srtt, rttvar) = (f(2), f(10));
        let valid = known && srtt.is_finite() && srtt > 0.0 && rttvar.is_finite() && rttvar >= 0.0;
        Ok(History {
            srtt: valid.then_some(srtt),
            rttvar: valid.then_some(rttvar),
            success: u(0),
            failed: u(1),
            input_tokens: u(2),
            output_tokens: u(3),
            disconnections: u(4),
            agent_failures: u(5),
            backend_failures: u(6),
            written_at: u(7),
        })
    }

    /// Whether a record written at `written_at` has expired at `now`
    /// (`ttl_days` 0: never).
    pub fn expired(&self, now: u64, ttl_days: u64) -> bool {
        ttl_days > 0 && now.saturating_sub(self.written_at) > ttl_days.saturating_mul(86_400)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trip(srtt in proptest::option::of(0.001f64..1e7), c in proptest::collection::vec(any::<u64>(), 8)) {
            let h = History {
                srtt, rttvar: srtt.map(|s| s / 3.0),
                success: c[0], failed: c[1], input_tokens: c[2], output_tokens: c[3],
                disconnections: c[4], agent_failures: c[5], backend_failures: c[6], written_at: c[7],
            };
            prop_assert_eq!(History::decode(&h.encode()).expect("decode"), h);
        }

        #[test]
        fn never_panics(b in proptest::collection::vec(any::<u8>(), 0..120)) {
            let _ = History::decode(&b);
        }
    }

    #[test]
    fn rejects_and_expires() {
        assert_eq!(History::decode(&[9, 0]), Err(DecodeError::Version(9)));
        assert_eq!(History::decode(&[1, 0]), Err(DecodeError::Length(2)));
        let h = History {
            written_at: 1000,
            ..Default::default()
        };
        assert!(!h.expired(1000 + 86_400, 1));
        assert!(h.expired(1001 + 86_400, 1));
        assert!(!h.expired(u64::MAX, 0));
    }
}
