//! The providers the router can fall back to (spec 04 §7): their
//! accounts, read from the environment at start, and the TLS client
//! settings. State, read by the request path's fallback
//! ([`crate::runtime::request::provider`]).

use std::sync::Arc;

use crate::logic::http::api::provider::{BaseUrl, Engine};
use crate::logic::routing::policy_set::PolicySet;
use crate::logic::system::config_error::ConfigError;

/// One provider's account: its key and where it is.
#[derive(Clone)]
pub struct Account {
    /// The API key (a credential: never logged).
    pub(crate) key: String,
    /// Where requests go.
    pub base: BaseUrl,
}

impl std::fmt::Debug for Account {
    // The key is a credential: never in a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Account")
            .field("key", &"<redacted>")
            .field("base", &self.base)
            .finish()
    }
}

/// The providers the router can fall back to (keys read at start).
#[derive(Debug, Clone, Default)]
pub struct Providers {
    /// OpenAI's (or a compatible server's) account.
    pub openai: Option<Account>,
    /// Anthropic's (or a compatible server's) account.
    pub anthropic: Option<Account>,
    /// TLS client settings (webpki roots plus the operator's CA file).
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

impl Providers {
    /// Read the accounts from `env` (a key variable makes an account;
    /// its base URL variable moves it) and build the TLS settings, with
    /// the PEM certificates of `ca_file` trusted beside the public roots.
    pub fn from_env(env: impl Fn(&str) -> Option<String>) -> Result<Providers, ConfigError> {
        let account = |engine: Engine| -> Result<Option<Account>, String> {
            let Some(key) = env(engine.key_env()).filter(|k| !k.trim().is_empty()) else {
                return Ok(None);
            };
            let base = env(engine.base_env())
                .filter(|b| !b.trim().is_empty())
                .unwrap_or_else(|| engine.default_base().to_string());
            let base =
                BaseUrl::parse(base.trim()).map_err(|e| format!("{}: {e}", engine.base_env()))?;
            Ok(Some(Account {
                key: key.trim().to_string(),
                base,
            }))
        };
        let openai = account(Engine::OpenAi)?;
        let anthropic = account(Engine::Anthropic)?;
        let needs_tls = [&openai, &anthropic]
            .into_iter()
            .flatten()
            .any(|a| a.base.tls);
        let tls = if needs_tls {
            Some(Arc::new(tls_config(
                env("HIVENET_ROUTER_PROVIDER_CA_FILE").as_deref(),
            )?))
        } else {
            None
        };
        Ok(Providers {
            openai,
            anthropic,
            tls,
        })
    }

    /// The account of `engine`.
    pub fn account(&self, engine: Engine) -> Option<&Account> {
        match engine {
            Engine::OpenAi => self.openai.as_ref(),
            Engine::Anthropic => self.anthropic.as_ref(),
        }
    }

    /// Every policy's provider must have an account (spec 04 §7: start-up,
    /// reload and PUT refuse a policy whose provider key is missing).
    pub fn check(&self, set: &PolicySet) -> Result<(), ConfigError> {
        let docs = std::iter::once(("global", &set.global))
            .chain(set.named.iter().map(|(n, p)| (n.as_str(), p)));
        for (name, p) in docs {
            if let Some(fp) = &p.fallback_provider {
                if self.account(fp.engine).is_none() {
                    return Err(ConfigError::from(format!(
                        "policy {name:?}: fallback_provider {} needs {} to be set",
                        fp.engine.name(),
                        fp.engine.key_env()
                    )));
                }
            }
        }
        Ok(())
    }
}

fn tls_config(ca_file: Option<&str>) -> Result<rustls::ClientConfig, ConfigError> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = ca_file.filter(|p| !p.trim().is_empty()) {
        let certs = rustls::pki_types::CertificateDer::pem_file_iter(path)
            .map_err(|e| format!("HIVENET_ROUTER_PROVIDER_CA_FILE {path}: {e}"))?;
        let mut n = 0;
        for c in certs {
            let c = c.map_err(|e| format!("HIVENET_ROUTER_PROVIDER_CA_FILE {path}: {e}"))?;
            roots
                .add(c)
                .map_err(|e| format!("HIVENET_ROUTER_PROVIDER_CA_FILE {path}: {e}"))?;
            n += 1;
        }
        if n == 0 {
            return Err(ConfigError::from(format!(
                "HIVENET_ROUTER_PROVIDER_CA_FILE {path}: no certificate in it"
            )));
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS settings: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logic::http::api::provider::FallbackProvider;

    #[test]
    fn accounts_come_from_the_environment_and_keys_stay_hidden() {
        let env = |k: &str| match k {
            "HIVENET_ROUTER_OPENAI_API_KEY" => Some("sk-secret".to_string()),
            "HIVENET_ROUTER_OPENAI_BASE_URL" => Some("http://127.0.0.1:9999".to_string()),
            _ => None,
        };
        let p = Providers::from_env(env).expect("providers");
        let a = p.account(Engine::OpenAi).expect("openai");
        assert_eq!((a.base.tls, a.base.port), (false, 9999));
        assert!(p.anthropic.is_none() && p.tls.is_none());
        assert!(!format!("{p:?}").contains("sk-secret"), "{p:?}");
        let https = Providers::from_env(|k| {
            (k == "HIVENET_ROUTER_ANTHROPIC_API_KEY").then(|| "ak".to_string())
        })
        .expect("providers");
        assert!(https.tls.is_some(), "https default needs TLS");
        let bad = Providers::from_env(|k| match k {
            "HIVENET_ROUTER_OPENAI_API_KEY" => Some("k".into()),
            "HIVENET_ROUTER_OPENAI_BASE_URL" => Some("ftp://x".into()),
            _ => None,
        });
        assert!(bad.is_err());
        let missing_ca = Providers::from_env(|k| match k {
            "HIVENET_ROUTER_OPENAI_API_KEY" => Some("k".into()),
            "HIVENET_ROUTER_PROVIDER_CA_FILE" => Some("/nonexistent/ca.pem".into()),
            _ => None,
        });
        assert!(missing_ca.is_err());
    }

    #[test]
    fn a_policy_needs_its_providers_key() {
        let mut set = PolicySet::default();
        let p = crate::logic::routing::policy::Policy {
            fallback_provider: Some(FallbackProvider {
                engine: Engine::Anthropic,
                model: "c".into(),
            }),
            ..Default::default()
        };
        set.global = Arc::new(p);
        let none = Providers::default();
        let e = none.check(&set).expect_err("refused");
        assert!(
            e.message().contains("HIVENET_ROUTER_ANTHROPIC_API_KEY"),
            "{e}"
        );
        let with = Providers::from_env(|k| {
            (k == "HIVENET_ROUTER_ANTHROPIC_API_KEY").then(|| "ak".to_string())
        })
        .expect("providers");
        assert!(with.check(&set).is_ok());
    }
}
