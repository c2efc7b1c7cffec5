//! Client and admin authentication settings at start and at SIGHUP (spec
//! 05 §1): `--auth-config-file` (its `api.mode` and `admin.mode` rule) or
//! `HIVENET_ROUTER_AUTH_MODE`; admin keys always from
//! `HIVENET_ROUTER_ADMIN_API_KEYS`. Every refusal is one line.

use std::path::PathBuf;

use shards::logic::tenancy::auth::{self, AdminMode, ApiMode, AuthConfig};

/// Where client authentication comes from.
#[derive(Debug, Clone, Default)]
pub struct AuthSources {
    /// `--auth-config-file` / `HIVENET_ROUTER_AUTH_CONFIG`.
    pub file: Option<PathBuf>,
    /// `HIVENET_ROUTER_AUTH_MODE` (used without a file).
    pub env_mode: Option<String>,
}

/// Read and validate the client configuration.
pub fn load(src: &AuthSources) -> Result<AuthConfig, String> {
    match &src.file {
        Some(f) => {
            let text = std::fs::read_to_string(f)
                .map_err(|e| format!("auth: cannot read {}: {e}", f.display()))?;
            auth::parse_config(&f.display().to_string(), &text).map_err(String::from)
        }
        None => {
            let m = src.env_mode.as_deref().unwrap_or("none").trim();
            let api = ApiMode::parse(m).ok_or_else(|| {
                format!("HIVENET_ROUTER_AUTH_MODE: unknown mode {m:?} (supported: none, api-key, dynamic)")
            })?;
            if api == ApiMode::ApiKey {
                return Err("HIVENET_ROUTER_AUTH_MODE=api-key needs --auth-config-file with the keys (run `hivenet-router keygen`)".into());
            }
            Ok(AuthConfig {
                api,
                admin: None,
                keys: Vec::new(),
            })
        }
    }
}

/// Admin keys and whether admin routes are open, from the file's admin
/// mode, the client mode and the environment's values.
pub fn admin(
    cfg: &AuthConfig,
    keys: Option<&str>,
    insecure: Option<&str>,
) -> Result<(Vec<[u8; 32]>, bool), String> {
    let has_keys = keys.is_some_and(|k| k.split(',').any(|x| !x.trim().is_empty()));
    // Dynamic client mode manages keys through admin routes: never open.
    let mode = if cfg.api == ApiMode::Dynamic {
        Some(AdminMode::ApiKey)
    } else {
        cfg.admin
    };
    match mode {
        Some(AdminMode::ApiKey) if !has_keys => Err(if cfg.api == ApiMode::Dynamic {
            "api.mode dynamic needs admin keys: set HIVENET_ROUTER_ADMIN_API_KEYS".into()
        } else {
            "admin.mode api-key needs HIVENET_ROUTER_ADMIN_API_KEYS".into()
        }),
        Some(AdminMode::ApiKey) => crate::admin_keys::parse(keys, None),
        Some(AdminMode::None) => {
            let open = matches!(
                insecure.map(str::trim),
                Some("1" | "t" | "T" | "true" | "TRUE" | "True")
            );
            if !open {
                return Err(
                    "admin.mode none needs HIVENET_ROUTER_ALLOW_INSECURE_ADMIN=true".into(),
                );
            }
            Ok((Vec::new(), true))
        }
        None => crate::admin_keys::parse(keys, insecure),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(api: ApiMode, admin: Option<AdminMode>) -> AuthConfig {
        AuthConfig {
            api,
            admin,
            keys: Vec::new(),
        }
    }

    #[test]
    fn admin_rules() {
        assert!(admin(
            &cfg(ApiMode::Dynamic, Some(AdminMode::None)),
            None,
            Some("true")
        )
        .is_err());
        assert!(
            !admin(&cfg(ApiMode::Dynamic, None), Some("k"), None)
                .expect("ok")
                .1
        );
        assert!(admin(
            &cfg(ApiMode::None, Some(AdminMode::ApiKey)),
            None,
            Some("true")
        )
        .is_err());
        assert!(admin(&cfg(ApiMode::None, Some(AdminMode::None)), None, None).is_err());
        assert!(
            admin(
                &cfg(ApiMode::None, Some(AdminMode::None)),
                None,
                Some("true")
            )
            .expect("open")
            .1
        );
        assert!(admin(&cfg(ApiMode::None, None), None, None).is_err());
    }

    #[test]
    fn env_mode() {
        let src = |m: &str| AuthSources {
            file: None,
            env_mode: Some(m.into()),
        };
        assert_eq!(load(&src("dynamic")).expect("ok").api, ApiMode::Dynamic);
        assert!(load(&src("api-key"))
            .expect_err("needs file")
            .contains("--auth-config-file"));
        assert!(load(&src("jwt")).expect_err("bad").contains("supported"));
        assert_eq!(
            load(&AuthSources::default()).expect("none").api,
            ApiMode::None
        );
    }
}
