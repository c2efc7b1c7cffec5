//! RFC 3339 timestamps in UTC from Unix time (no calendar crate needed).

/// `YYYY-MM-DDTHH:MM:SS.nnnnnnnnnZ` for `secs` and `nanos` since the epoch.
pub fn rfc3339_nanos(secs: u64, nanos: u32) -> String {
    Rfc3339(secs, nanos).to_string()
}

/// The same text, written where it goes (no allocation).
pub struct Rfc3339(pub u64, pub u32);

impl std::fmt::Display for Rfc3339 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Rfc3339(secs, nanos) = *self;
        let days = (secs / 86_400) as i64;
        let rem = secs % 86_400;
        let (y, m, d) = civil_from_days(days);
        write!(
            f,
            "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{nanos:09}Z",
            rem / 3600,
            (rem % 3600) / 60,
            rem % 60
        )
    }
}

/// Howard Hinnant's days-to-civil algorithm.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_dates() {
        assert_eq!(rfc3339_nanos(0, 0), "1970-01-01T00:00:00.000000000Z");
        assert_eq!(
            rfc3339_nanos(951_782_400, 5),
            "2000-02-29T00:00:00.000000005Z"
        );
        assert_eq!(
            rfc3339_nanos(1_795_978_801, 123_456_789),
            "2026-11-29T19:00:01.123456789Z"
        );
        assert_eq!(
            rfc3339_nanos(4_102_444_799, 0),
            "2099-12-31T23:59:59.000000000Z"
        );
    }
}
