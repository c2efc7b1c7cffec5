//! Which traces are exported: the standard head samplers
//! (`OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`: `always_on`,
//! `always_off`, `traceidratio`, and their `parentbased_` forms, the
//! default `parentbased_always_on`), plus a tail rule the router decides
//! when the request ends: a trace that explains something worth reading
//! (an error, a hold at zero, a continued stream, a redirect, a provider
//! fallback, a request slower than `HIVENET_TRACES_KEEP_SLOWER_THAN_MS`)
//! is kept whatever the head said.

use crate::logic::system::config_error::ConfigError;

/// The sampler for a trace without a parent (or ignoring it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Root {
    /// Every trace.
    AlwaysOn,
    /// None (the tail rule still keeps the notable).
    AlwaysOff,
    /// This share of trace IDs.
    Ratio(f64),
}

/// Head and tail sampling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampler {
    /// For traces started here (and all, unless `parent_based`).
    pub root: Root,
    /// A client's `traceparent` decides by its sampled flag.
    pub parent_based: bool,
    /// Requests at least this slow are kept (0: none by duration).
    pub keep_slower_than_ms: u64,
}

impl Default for Sampler {
    fn default() -> Self {
        Sampler {
            root: Root::AlwaysOn,
            parent_based: true,
            keep_slower_than_ms: 10_000,
        }
    }
}

/// What the tail rule looks at.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Notable {
    /// Answered with a status of 500 or more, or failed.
    pub error: bool,
    /// Held at zero.
    pub held: bool,
    /// Its stream was continued on another agent.
    pub continued: bool,
    /// Redirected to a sibling site.
    pub redirected: bool,
    /// Served by the fallback provider.
    pub provider: bool,
    /// Its duration.
    pub elapsed_ms: u64,
}

impl Sampler {
    /// From the standard variables' values; `Err` names what is wrong.
    pub fn parse(
        sampler: Option<&str>,
        arg: Option<&str>,
        slow_ms: Option<&str>,
    ) -> Result<Self, ConfigError> {
        let ratio = || -> Result<f64, ConfigError> {
            match arg.map(str::trim).filter(|a| !a.is_empty()) {
                None => Ok(1.0),
                Some(a) => match a.parse::<f64>() {
                    Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
                    _ => Err(ConfigError::new(format!(
                        "OTEL_TRACES_SAMPLER_ARG={a:?}: a ratio from 0 to 1 is expected"
                    ))),
                },
            }
        };
        let name = sampler.map(str::trim).filter(|s| !s.is_empty());
        let (root, parent_based) = match name.unwrap_or("parentbased_always_on") {
            "always_on" => (Root::AlwaysOn, false),
            "always_off" => (Root::AlwaysOff, false),
            "traceidratio" => (Root::Ratio(ratio()?), false),
            "parentbased_always_on" => (Root::AlwaysOn, true),
            "parentbased_always_off" => (Root::AlwaysOff, true),
            "parentbased_traceidratio" => (Root::Ratio(ratio()?), true),
            other => {
                return Err(ConfigError::new(format!(
                    "OTEL_TRACES_SAMPLER={other:?} is not one of always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off, parentbased_traceidratio"
                )))
            }
        };
        let keep_slower_than_ms = match slow_ms.map(str::trim).filter(|s| !s.is_empty()) {
            None => Sampler::default().keep_slower_than_ms,
            Some(v) => v.parse().map_err(|_| {
                ConfigError::new(format!(
                    "HIVENET_TRACES_KEEP_SLOWER_THAN_MS={v:?}: milliseconds expected"
                ))
            })?,
        };
        Ok(Sampler {
            root,
            parent_based,
            keep_slower_than_ms,
        })
    }

    /// The head decision: `parent_flags` are the client's `traceparent`
    /// flags when it sent a valid one.
    pub fn head(&self, trace_id: &[u8; 16], parent_flags: Option<u8>) -> bool {
        if let (true, Some(flags)) = (self.parent_based, parent_flags) {
            return flags & crate::logic::http::trace_context::SAMPLED != 0;
        }
        match self.root {
            Root::AlwaysOn => true,
            Root::AlwaysOff => false,
            Root::Ratio(r) => {
                // The trace ID's last 56 bits, as W3C trace context level 2
                // makes them random.
                let mut low = [0u8; 8];
                if let (Some(dst), Some(src)) = (low.get_mut(1..), trace_id.get(9..)) {
                    dst.copy_from_slice(src);
                }
                let x = u64::from_be_bytes(low);
                (x as f64) < r * (1u64 << 56) as f64
            }
        }
    }

    /// The tail decision, when the request ends.
    pub fn keep(&self, head: bool, n: Notable) -> bool {
        let slow = self.keep_slower_than_ms > 0 && n.elapsed_ms >= self.keep_slower_than_ms;
        head || n.error || n.held || n.continued || n.redirected || n.provider || slow
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_standard_names_parse_and_bad_values_are_named() {
        let s = Sampler::parse(None, None, None).expect("default");
        assert_eq!(s, Sampler::default());
        let s = Sampler::parse(Some("traceidratio"), Some("0.25"), Some("500")).expect("ratio");
        assert_eq!(s.root, Root::Ratio(0.25));
        assert!(!s.parent_based);
        assert_eq!(s.keep_slower_than_ms, 500);
        assert!(Sampler::parse(Some("traceidratio"), Some("2"), None)
            .expect_err("refused")
            .message()
            .contains("OTEL_TRACES_SAMPLER_ARG"));
        assert!(Sampler::parse(Some("sometimes"), None, None)
            .expect_err("refused")
            .message()
            .contains("OTEL_TRACES_SAMPLER"));
        assert!(Sampler::parse(None, None, Some("soon"))
            .expect_err("refused")
            .message()
            .contains("HIVENET_TRACES_KEEP_SLOWER_THAN_MS"));
    }

    #[test]
    fn a_ratio_keeps_its_share_and_a_parent_decides_when_asked() {
        let s = Sampler::parse(Some("parentbased_traceidratio"), Some("0.1"), None).expect("ok");
        let mut kept = 0;
        for i in 0u64..10_000 {
            let mut id = [0u8; 16];
            // Spread like random IDs: a multiplicative hash of i.
            id[8..].copy_from_slice(&i.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_be_bytes());
            kept += usize::from(s.head(&id, None));
        }
        assert!((800..1200).contains(&kept), "{kept} of 10000 at 0.1");
        assert!(s.head(&[0xff; 16], Some(0x01)), "the parent sampled it");
        assert!(!s.head(&[0; 16], Some(0x00)), "the parent did not");
    }

    #[test]
    fn the_tail_keeps_what_explains_something() {
        let s = Sampler::parse(Some("always_off"), None, Some("1000")).expect("ok");
        assert!(!s.keep(false, Notable::default()));
        for n in [
            Notable {
                error: true,
                ..Notable::default()
            },
            Notable {
                held: true,
                ..Notable::default()
            },
            Notable {
                continued: true,
                ..Notable::default()
            },
            Notable {
                redirected: true,
                ..Notable::default()
            },
            Notable {
                provider: true,
                ..Notable::default()
            },
            Notable {
                elapsed_ms: 1000,
                ..Notable::default()
            },
        ] {
            assert!(s.keep(false, n), "{n:?}");
        }
        assert!(!s.keep(
            false,
            Notable {
                elapsed_ms: 999,
                ..Notable::default()
            }
        ));
    }
}
