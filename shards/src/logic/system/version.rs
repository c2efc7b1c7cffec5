//! The order of the versions operators push (keys, sibling maps): RFC 3339
//! timestamps by the instant they name, anything else in natural order
//! (digit runs compared as numbers), so `j10` follows `j2` and `10`
//! follows `9` (issue 29 #15; the spec's byte-wise rule refused both).

use std::cmp::Ordering;

/// Compare two versions.
pub fn cmp(a: &str, b: &str) -> Ordering {
    use crate::logic::system::calendar::parse_rfc3339;
    if let (Some(x), Some(y)) = (parse_rfc3339(a), parse_rfc3339(b)) {
        if x != y {
            return x.cmp(&y);
        }
    }
    natural(a, b)
}

/// Whether `next` may replace `current` (at or after it; equal: a replay).
pub fn at_or_after(current: Option<&str>, next: &str) -> bool {
    current.is_none_or(|c| cmp(next, c) != Ordering::Less)
}

/// Natural order: runs of ASCII digits compare by value (leading zeros
/// aside), other bytes byte-wise; a tie falls back to the bytes.
fn natural(a: &str, b: &str) -> Ordering {
    let (mut x, mut y) = (
        a.as_bytes().iter().peekable(),
        b.as_bytes().iter().peekable(),
    );
    loop {
        match (x.peek().copied(), y.peek().copied()) {
            (None, None) => return a.as_bytes().cmp(b.as_bytes()),
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(cx), Some(cy)) if cx.is_ascii_digit() && cy.is_ascii_digit() => {
                let (ra, rb) = (digit_run(&mut x), digit_run(&mut y));
                let o = ra.len().cmp(&rb.len()).then_with(|| ra.cmp(&rb));
                if o != Ordering::Equal {
                    return o;
                }
            }
            (Some(cx), Some(cy)) => {
                if cx != cy {
                    return cx.cmp(cy);
                }
                x.next();
                y.next();
            }
        }
    }
}

/// The digits at the front of `it`, without leading zeros.
fn digit_run<'a>(it: &mut std::iter::Peekable<impl Iterator<Item = &'a u8>>) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(c) = it.next_if(|c| c.is_ascii_digit()) {
        if !(out.is_empty() && *c == b'0') {
            out.push(*c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn operators_versions_order_as_they_mean() {
        assert_eq!(cmp("j10", "j2"), Ordering::Greater);
        assert_eq!(cmp("10", "9"), Ordering::Greater);
        assert_eq!(cmp("rev_02", "rev_10"), Ordering::Less);
        assert_eq!(
            cmp("007", "7"),
            Ordering::Less,
            "a tie falls back to the bytes"
        );
        assert_eq!(cmp("v1.10.0", "v1.9.3"), Ordering::Greater);
        // Timestamps by instant, whatever the offset.
        assert_eq!(
            cmp("2026-08-21T12:00:00+02:00", "2026-08-21T10:30:00Z"),
            Ordering::Less
        );
        assert!(at_or_after(None, "anything"));
        assert!(at_or_after(Some("j2"), "j10"));
        assert!(at_or_after(Some("j2"), "j2"), "a replay");
        assert!(!at_or_after(Some("j10"), "j9"));
    }

    proptest! {
        /// A total order: antisymmetric, and equal only for equal strings.
        #[test]
        fn a_total_order(a in "[a-z0-9_.:+TZ-]{0,12}", b in "[a-z0-9_.:+TZ-]{0,12}") {
            prop_assert_eq!(cmp(&a, &b), cmp(&b, &a).reverse());
            prop_assert_eq!(cmp(&a, &b) == Ordering::Equal, a == b || (
                crate::logic::system::calendar::parse_rfc3339(&a).is_some()
                && crate::logic::system::calendar::parse_rfc3339(&a) == crate::logic::system::calendar::parse_rfc3339(&b)
                && natural(&a, &b) == Ordering::Equal));
        }

        /// Integers compare as integers.
        #[test]
        fn integers_by_value(a in 0u64..1_000_000, b in 0u64..1_000_000) {
            prop_assert_eq!(cmp(&a.to_string(), &b.to_string()), a.cmp(&b));
        }
    }
}
