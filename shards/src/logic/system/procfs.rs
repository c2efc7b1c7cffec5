//! Parsers for the `/proc/self` files behind the standard `process_*`
//! metrics (the names every Prometheus client library's process collector
//! exports). Pure: the caller reads the files.

/// Clock ticks per second of `/proc/*/stat` times (USER_HZ: 100 on Linux,
/// fixed by the kernel ABI).
pub const USER_HZ: f64 = 100.0;

/// From `/proc/self/limits`: the soft limit on open files (None:
/// unlimited or unreadable).
pub fn open_files_limit(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.trim_start_matches("Max open files")
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Descriptors kept for everything but connections: listeners, the
/// store, the audit log, provider calls, logs.
pub const FD_RESERVE: u64 = 128;

/// Connection caps that fit `nofile` descriptors (issue 29 #4): when
/// clients + links + [`FD_RESERVE`] exceed it, links get at most a quarter
/// of what is left and clients the rest (a cap of 0, none, counts as the
/// whole room). Returns (clients, links, whether they were lowered).
pub fn fit_connection_caps(nofile: u64, clients: usize, links: usize) -> (usize, usize, bool) {
    let room = usize::try_from(nofile.saturating_sub(FD_RESERVE))
        .unwrap_or(usize::MAX)
        .max(2);
    let c = if clients == 0 { usize::MAX } else { clients };
    let l = if links == 0 { usize::MAX } else { links };
    if c.saturating_add(l) <= room {
        return (clients, links, false);
    }
    let l2 = l.min(room / 4).max(1);
    let c2 = c.min(room - l2).max(1);
    (c2, l2, true)
}

/// From `/proc/self/stat`: (CPU seconds user + system, start time in ticks
/// since boot).
pub fn stat(text: &str) -> Option<(f64, u64)> {
    // The command name (field 2) may hold spaces and parentheses: the
    // fields that follow start after its last ')'.
    let rest = text.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After ')': index 0 = field 3 (state); utime = field 14, stime = 15,
    // starttime = field 22.
    let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
    let cpu = (num(11)? + num(12)?) as f64 / USER_HZ;
    Some((cpu, num(19)?))
}

/// A `kB` line of `/proc/self/status` (`VmRSS`, `VmSize`), in bytes.
pub fn status_kb(text: &str, key: &str) -> Option<u64> {
    let rest = text
        .lines()
        .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix(':')))?;
    let kb: u64 = rest.split_whitespace().next()?.parse().ok()?;
    Some(kb * 1024)
}

/// `btime` (boot time, Unix seconds) from `/proc/stat`.
pub fn boot_time(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

/// The soft open-files limit from `/proc/self/limits`.
pub fn max_open_files(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("Max open files"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_with_a_tricky_command_name() {
        let s = "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 500 0 0 0 250 150 0 0 20 0 3 0 987654 100000 2000 18446744073709551615";
        let (cpu, start) = stat(s).expect("parsed");
        assert!((cpu - 4.0).abs() < 1e-9, "{cpu}");
        assert_eq!(start, 987654);
        assert_eq!(stat("garbage"), None);
        assert_eq!(stat("1 (x) S 1 2"), None);
    }

    #[test]
    fn status_limits_and_boot_time() {
        let st = "Name:\trouter\nVmSize:\t  123456 kB\nVmRSS:\t    2048 kB\nVmRSSX:\t 1 kB\n";
        assert_eq!(status_kb(st, "VmRSS"), Some(2048 * 1024));
        assert_eq!(status_kb(st, "VmSize"), Some(123456 * 1024));
        assert_eq!(status_kb(st, "VmSwap"), None);
        let lim = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            20000                20000                files\n";
        assert_eq!(max_open_files(lim), Some(20000));
        assert_eq!(boot_time("cpu 1 2\nbtime 1764547200\n"), Some(1764547200));
        assert_eq!(boot_time("cpu 1 2\n"), None);
    }
}

#[cfg(test)]
mod fd_tests {
    use super::*;

    #[test]
    fn caps_fit_the_descriptor_limit() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \nMax open files            1024                 524288               files     \n";
        assert_eq!(open_files_limit(limits), Some(1024));
        assert_eq!(
            open_files_limit("Max open files            unlimited  unlimited  files\n"),
            None
        );
        // Defaults (4096 clients, 1024 links) in 1024 descriptors: 896 of
        // room, a quarter to links.
        assert_eq!(fit_connection_caps(1024, 4096, 1024), (672, 224, true));
        assert_eq!(fit_connection_caps(20_000, 4096, 1024), (4096, 1024, false));
        // No caps at all still get bounded.
        let (c, l, lowered) = fit_connection_caps(1024, 0, 0);
        assert!(lowered && c + l <= 1024 - 128);
    }
}
