//! Calendar dates, pure: RFC 3339 instants and `DD-MM-YYYY` expiry days
//! parsed into Unix seconds (no calendar crate needed); their writing is
//! in [`super::timefmt`].

/// Parse `DD-MM-YYYY`: the key is valid through that UTC day, so the
/// expiry instant is 00:00 UTC of the next day.
pub fn parse_expiry_day(s: &str) -> Option<u64> {
    let mut it = s.trim().split('-');
    let d: u32 = it.next()?.parse().ok()?;
    let m: u32 = it.next()?.parse().ok()?;
    let y: i64 = it.next()?.parse().ok()?;
    if it.next().is_some() || !(1..=12).contains(&m) || d == 0 || d > days_in_month(y, m) {
        return None;
    }
    let days = days_from_civil(y, m, d).checked_add(1)?;
    u64::try_from(days).ok()?.checked_mul(86_400)
}

/// Parse an RFC 3339 instant (`2027-01-01T00:00:00Z`, offsets and
/// fractions accepted) into Unix seconds (fraction truncated).
pub fn parse_rfc3339(s: &str) -> Option<u64> {
    let s = s.trim();
    let b = s.as_bytes();
    if b.len() < 20 || b.get(4) != Some(&b'-') || b.get(7) != Some(&b'-') {
        return None;
    }
    if !matches!(b.get(10), Some(b'T' | b't' | b' '))
        || b.get(13) != Some(&b':')
        || b.get(16) != Some(&b':')
    {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let t = s.get(r)?;
        if !t.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        t.parse().ok()
    };
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, se) = (num(11..13)?, num(14..16)?, num(17..19)?);
    let mo = u32::try_from(mo).ok()?;
    let d = u32::try_from(d).ok()?;
    if !(1..=12).contains(&mo) || d == 0 || d > days_in_month(y, mo) || h > 23 || mi > 59 || se > 60
    {
        return None;
    }
    let mut rest = s.get(19..)?;
    if let Some(frac) = rest.strip_prefix('.') {
        let n = frac.bytes().take_while(u8::is_ascii_digit).count();
        if n == 0 {
            return None;
        }
        rest = frac.get(n..)?;
    }
    let offset: i64 = match rest {
        "Z" | "z" => 0,
        o if o.len() == 6
            && (o.starts_with('+') || o.starts_with('-'))
            && o.get(3..4) == Some(":") =>
        {
            let oh = num_str(o.get(1..3)?)?;
            let om = num_str(o.get(4..6)?)?;
            if oh > 23 || om > 59 {
                return None;
            }
            let sign = if o.starts_with('-') { -1 } else { 1 };
            sign * (oh * 3600 + om * 60)
        }
        _ => return None,
    };
    let secs = days_from_civil(y, mo, d) * 86_400 + h * 3600 + mi * 60 + se - offset;
    u64::try_from(secs).ok()
}

fn num_str(t: &str) -> Option<i64> {
    if t.bytes().all(|c| c.is_ascii_digit()) {
        t.parse().ok()
    } else {
        None
    }
}

fn days_in_month(y: i64, m: u32) -> u32 {
    match m {
        2 if (y % 4 == 0 && y % 100 != 0) || y % 400 == 0 => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Howard Hinnant's civil-to-days algorithm (days since 1970-01-01).
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}
