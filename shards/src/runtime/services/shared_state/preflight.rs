//! The shared state checked at start (issue 51 #8): a wrong password, a
//! database index out of range or the wrong scheme (TLS to a plain server
//! or the reverse) used to warn and run every router alone; an evicting
//! `maxmemory-policy` silently lost or doubled usage; two routers started
//! from one identity file merged their contributions. Each is found here,
//! before the router serves.

use std::time::{Duration, Instant};

/// How long a router's presence mark lives without being refreshed.
pub const PRESENCE_TTL_MS: u64 = 2000;

/// The presence key of router `me` (its peer ID).
pub fn presence_key(me: &str) -> String {
    format!("hivenet:router:{me}")
}

/// What the check found.
#[derive(Debug, Default)]
pub struct Preflight {
    /// Loud warnings that do not stop the start (an evicting policy).
    pub warnings: Vec<String>,
}

/// Why the shared state cannot be used as configured.
#[derive(Debug)]
pub struct PreflightError(pub String);

/// Connect, authenticate, select the database, check the eviction policy
/// and that no other live router uses this identity (`me`, with this
/// process's `boot` nonce).
pub fn check(client: &redis::Client, me: &str, boot: &str) -> Result<Preflight, PreflightError> {
    let fail = |what: &str, e: &redis::RedisError| PreflightError(format!("{what}: {e}"));
    let mut c = client
        .get_connection_with_timeout(Duration::from_secs(3))
        .map_err(|e| {
            let what = if e.kind() == redis::ErrorKind::AuthenticationFailed
                || matches!(e.code(), Some("NOAUTH" | "WRONGPASS"))
            {
                "the password (or ACL user) is refused"
            } else if e.to_string().contains("DB index") {
                "the database index is out of range"
            } else {
                "cannot connect (is it up, and is the scheme right: redis:// plain, rediss:// TLS?)"
            };
            fail(what, &e)
        })?;
    let _ = c.set_read_timeout(Some(Duration::from_secs(3)));
    let pong: redis::RedisResult<String> = redis::cmd("PING").query(&mut c);
    pong.map_err(|e| fail("PING failed", &e))?;
    let mut out = Preflight::default();
    // Managed Redis may forbid CONFIG: then nothing is known, and said.
    let policy: redis::RedisResult<Vec<String>> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query(&mut c);
    match policy.as_deref().map(|v| v.get(1).map(String::as_str)) {
        Ok(Some("noeviction")) => {}
        Ok(Some(p)) => out.warnings.push(format!(
            "Redis evicts keys under memory pressure (maxmemory-policy {p}): quota usage may be lost (over-admitting) or its generation key evicted (usage counted twice); set maxmemory-policy noeviction"
        )),
        _ => out.warnings.push(
            "cannot read Redis's maxmemory-policy (CONFIG GET refused): make sure it is noeviction".into(),
        ),
    }
    // Another live router with this identity refreshes its mark every
    // 200 ms; a dead one's expires within PRESENCE_TTL_MS.
    let key = presence_key(me);
    let until = Instant::now() + Duration::from_millis(PRESENCE_TTL_MS + 500);
    loop {
        let set: Option<String> = redis::cmd("SET")
            .arg(&key)
            .arg(boot)
            .arg("NX")
            .arg("PX")
            .arg(PRESENCE_TTL_MS)
            .query(&mut c)
            .map_err(|e| fail("cannot mark this router's presence", &e))?;
        if set.is_some() {
            return Ok(out);
        }
        if Instant::now() >= until {
            return Err(PreflightError(format!(
                "another router with this identity ({me}) is live on the same Redis: give each router its own --identity-path (their quota contributions and held demand would merge)"
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
