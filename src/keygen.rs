//! `hivenet-router keygen [--tenant <name>]` (spec 05 §8): a new client
//! key, printed once, and the `auth.yaml` entry that admits it (only the
//! key's SHA-256 is stored in the file).

use sha2::{Digest, Sha256};

const BASE58: &[u8; 58] = b"123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz";

/// Bitcoin-alphabet base58 of `bytes`.
pub fn base58(bytes: &[u8]) -> String {
    let zeros = bytes.iter().take_while(|b| **b == 0).count();
    // Big-number division by 58, digits little-endian.
    let mut digits: Vec<u8> = Vec::with_capacity(bytes.len() * 138 / 100 + 1);
    for &b in bytes {
        let mut carry = u32::from(b);
        for d in digits.iter_mut() {
            carry += u32::from(*d) << 8;
            *d = (carry % 58) as u8;
            carry /= 58;
        }
        while carry > 0 {
            digits.push((carry % 58) as u8);
            carry /= 58;
        }
    }
    let mut s = String::with_capacity(zeros + digits.len());
    s.extend(std::iter::repeat_n('1', zeros));
    s.extend(
        digits
            .iter()
            .rev()
            .map(|d| char::from(BASE58[usize::from(*d) % 58])),
    );
    s
}

/// The key for 32 random bytes.
pub fn key_from(random: [u8; 32]) -> String {
    format!("sk-hivenet-{}", base58(&random))
}

/// The `auth.yaml` entry for `key`, created on `today` (`DD-MM-YYYY`).
pub fn snippet(key: &str, tenant: &str, today: &str) -> String {
    let hash = shards::logic::tenancy::auth::hex(&Sha256::digest(key.as_bytes()));
    let tail: String = key
        .chars()
        .rev()
        .take(4)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let t = serde_json::to_string(tenant).unwrap_or_else(|_| "\"my-tenant\"".into());
    let name = serde_json::to_string(&format!("{tenant} key")).unwrap_or_default();
    format!(
        "# Add under api.keys in auth.yaml (api.mode: api-key), then start or SIGHUP the router.
    - key_hash: \"{hash}\"
      key_preview: \"sk-...{tail}\"
      metadata:
        name: {name}
        owner: {t}
        created_at: \"{today}\"
        # expires_at: \"31-12-2027\"     # valid through that UTC day
      # models: [\"model-a\"]            # allowlist; absent = every model
      quota:
        requests_per_minute: 100
        tokens_per_day: 500000
"
    )
}

/// Run the subcommand with its arguments (after `keygen`).
pub fn run(args: &[String]) -> Result<String, String> {
    let mut tenant = "my-tenant".to_string();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if let Some(v) = a.strip_prefix("--tenant=") {
            tenant = v.to_string();
        } else if a == "--tenant" {
            tenant = it
                .next()
                .ok_or("keygen: --tenant needs a value")?
                .to_string();
        } else if a == "--help" || a == "-h" {
            return Ok("Usage: hivenet-router keygen [--tenant <name>]\n\nPrints a new client API key once, then the auth.yaml entry (its SHA-256) that admits it.\n".into());
        } else {
            return Err(format!(
                "keygen: unknown argument {a:?} (usage: hivenet-router keygen [--tenant <name>])"
            ));
        }
    }
    let tenant = tenant.trim().to_string();
    if tenant.is_empty() || tenant.len() > 200 {
        return Err("keygen: --tenant must be 1 to 200 characters".into());
    }
    let key = key_from(rand::random());
    let secs = shards::runtime::wire::clock::unix_secs();
    let date = shards::logic::system::timefmt::rfc3339_nanos(secs, 0);
    // YYYY-MM-DD... -> DD-MM-YYYY
    let today = match (date.get(0..4), date.get(5..7), date.get(8..10)) {
        (Some(y), Some(m), Some(d)) => format!("{d}-{m}-{y}"),
        _ => String::new(),
    };
    Ok(format!(
        "API key (shown once; store it now, only its hash goes in auth.yaml):\n\n  {key}\n\n{}",
        snippet(&key, &tenant, &today)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base58_known_vectors() {
        assert_eq!(base58(b""), "");
        assert_eq!(base58(&[0]), "1");
        assert_eq!(base58(&[0, 0, 1]), "112");
        assert_eq!(base58(b"hello world"), "StV1DL6CwTryKyV");
        assert_eq!(base58(&[255; 4]), "7YXq9G");
    }

    #[test]
    fn snippet_parses_and_admits_the_key() {
        let key = key_from([7; 32]);
        assert!(key.starts_with("sk-hivenet-"));
        let yaml = format!(
            "api:\n  mode: api-key\n  keys:\n{}",
            snippet(&key, "acme", "30-11-2026")
        );
        let cfg = shards::logic::tenancy::auth::parse_config("auth.yaml", &yaml).expect("valid");
        let (hash, rec) = &cfg.keys[0];
        assert_eq!(hash, &<[u8; 32]>::from(Sha256::digest(key.as_bytes())));
        assert_eq!(&*rec.tenant, "acme");
        assert!(rec.preview.ends_with(&key[key.len() - 4..]));
        assert!(run(&["--tenant".into(), String::new()]).is_err());
        assert!(run(&["--bogus".into()]).is_err());
        assert!(run(&["--tenant=x".into()])
            .expect("ok")
            .contains("owner: \"x\""));
    }
}
