//! Which CPU each shard runs on, computed from a topology value (the CPUs
//! the process may use) and the flags; discovery lives in the runtime.

use crate::logic::system::config_error::ConfigError;

/// Parse a CPU list such as `0-3,6`.
pub fn parse_cpu_list(s: &str) -> Result<Vec<usize>, ConfigError> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if let Some((a, b)) = part.split_once('-') {
            let a: usize = a
                .trim()
                .parse()
                .map_err(|_| format!("invalid CPU range {part:?}"))?;
            let b: usize = b
                .trim()
                .parse()
                .map_err(|_| format!("invalid CPU range {part:?}"))?;
            if a > b || b - a > 4096 {
                return Err(ConfigError::from(format!("invalid CPU range {part:?}")));
            }
            out.extend(a..=b);
        } else {
            out.push(part.parse().map_err(|_| format!("invalid CPU {part:?}"))?);
        }
    }
    if out.is_empty() {
        return Err("empty CPU list".into());
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// Shard -> CPU plan. `available` is what the process may use (may be
/// empty when unknown: shards then run unpinned).
pub fn plan(
    shards: Option<usize>,
    cpus: Option<&[usize]>,
    available: &[usize],
) -> Result<Vec<Option<usize>>, ConfigError> {
    let pool: Vec<usize> = match cpus {
        Some(list) => {
            if let Some(bad) = list
                .iter()
                .find(|c| !available.is_empty() && !available.contains(c))
            {
                return Err(ConfigError::from(format!(
                    "CPU {bad} is not available to this process (available: {available:?})"
                )));
            }
            list.to_vec()
        }
        None => available.to_vec(),
    };
    let n = match shards {
        Some(0) => return Err("--shards must be at least 1".into()),
        // Each shard is a thread with its own runtime, listeners and
        // state: more than a few per CPU only costs (issue 51 #1: a huge
        // count panicked allocating the plan).
        Some(n) if n > MAX_SHARDS => {
            return Err(ConfigError::from(format!(
                "--shards {n}: at most {MAX_SHARDS} (one per CPU is the design; this machine offers {})",
                pool.len().max(1)
            )))
        }
        Some(n) => n,
        None => pool.len().max(1),
    };
    Ok((0..n)
        .map(|i| {
            if pool.is_empty() {
                None
            } else {
                pool.get(i % pool.len()).copied()
            }
        })
        .collect())
}

/// Most shards a router may run.
pub const MAX_SHARDS: usize = 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_count_past_the_ceiling_is_refused() {
        assert!(plan(Some(MAX_SHARDS + 1), None, &[0, 1]).is_err());
        assert!(plan(Some(usize::MAX), None, &[0, 1]).is_err());
        assert_eq!(plan(Some(4), None, &[0, 1]).map(|p| p.len()).ok(), Some(4));
    }

    #[test]
    fn lists() {
        assert_eq!(parse_cpu_list("0-3,6").expect("ok"), vec![0, 1, 2, 3, 6]);
        assert!(parse_cpu_list("3-1").is_err());
        assert!(parse_cpu_list("x").is_err());
    }

    #[test]
    fn plans() {
        assert_eq!(
            plan(None, None, &[0, 1]).expect("ok"),
            vec![Some(0), Some(1)]
        );
        assert_eq!(
            plan(Some(3), None, &[0, 1]).expect("ok"),
            vec![Some(0), Some(1), Some(0)]
        );
        assert_eq!(
            plan(Some(1), Some(&[1]), &[0, 1]).expect("ok"),
            vec![Some(1)]
        );
        assert!(plan(None, Some(&[5]), &[0, 1]).is_err());
        assert!(plan(Some(0), None, &[0]).is_err());
        assert_eq!(plan(Some(2), None, &[]).expect("ok"), vec![None, None]);
    }
}
