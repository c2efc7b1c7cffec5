//! Admin keys from `HIVENET_ROUTER_ADMIN_API_KEYS` (comma separated, each
//! trimmed, empty items dropped, SHA-256 hashed at load; duplicates are an
//! error). Without keys the router refuses to start unless
//! `HIVENET_ROUTER_ALLOW_INSECURE_ADMIN` is true.

use sha2::{Digest, Sha256};

/// Parse the two variables' values.
pub fn parse(keys: Option<&str>, insecure: Option<&str>) -> Result<(Vec<[u8; 32]>, bool), String> {
    let insecure = matches!(
        insecure.map(str::trim),
        Some("1" | "t" | "T" | "true" | "TRUE" | "True")
    );
    let mut out: Vec<[u8; 32]> = Vec::new();
    for k in keys
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|k| !k.is_empty())
    {
        let h: [u8; 32] = Sha256::digest(k.as_bytes()).into();
        if out.contains(&h) {
            return Err("HIVENET_ROUTER_ADMIN_API_KEYS: duplicate key".into());
        }
        out.push(h);
    }
    if out.is_empty() && !insecure {
        return Err("no admin keys: set HIVENET_ROUTER_ADMIN_API_KEYS (comma-separated) or HIVENET_ROUTER_ALLOW_INSECURE_ADMIN=true".into());
    }
    Ok((
        out,
        insecure && keys.map(str::trim).unwrap_or("").is_empty(),
    ))
}

/// Read from the environment.
pub fn from_env() -> Result<(Vec<[u8; 32]>, bool), String> {
    let keys = std::env::var("HIVENET_ROUTER_ADMIN_API_KEYS").ok();
    let insecure = std::env::var("HIVENET_ROUTER_ALLOW_INSECURE_ADMIN").ok();
    parse(keys.as_deref(), insecure.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules() {
        assert!(parse(None, None).is_err());
        assert!(parse(Some(" , "), Some("false")).is_err());
        assert!(parse(None, Some("true")).expect("insecure").1);
        let (k, open) = parse(Some("a, b"), None).expect("keys");
        assert_eq!(k.len(), 2);
        assert!(!open);
        assert!(parse(Some("a,a"), None).is_err());
        // Keys given: the insecure flag does not open the routes.
        assert!(!parse(Some("a"), Some("true")).expect("k").1);
    }
}
