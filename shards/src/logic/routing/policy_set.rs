//! The policies in force: the global document and the per-model ones
//! (pure: validated and looked up without I/O).

use std::sync::Arc;

use super::policy::Policy;
use crate::logic::system::config_error::ConfigError;

/// The policies in force: the global one and the per-model documents.
#[derive(Debug, Clone, Default)]
pub struct PolicySet {
    /// Used for models no named document claims.
    pub global: Arc<Policy>,
    /// Named (per-model) documents.
    pub named: std::collections::BTreeMap<String, Arc<Policy>>,
}

impl PolicySet {
    /// Check that no model is claimed twice.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut owner: std::collections::HashMap<&str, &str> = std::collections::HashMap::new();
        for (name, p) in &self.named {
            if p.models.is_empty() {
                return Err(ConfigError::from(format!(
                    "policy {name:?} must include a 'models:' field with at least one model name"
                )));
            }
            for m in &p.models {
                if let Some(other) = owner.insert(m, name) {
                    return Err(ConfigError::from(format!(
                        "model {m:?} is already claimed by policy {other:?}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// The model an alias stands for (global aliases; None: not an alias).
    pub fn resolve_alias(&self, model: &str) -> Option<&str> {
        self.global.aliases.get(model).map(String::as_str)
    }

    /// The effective policy of a model.
    pub fn for_model(&self, model: &str) -> Arc<Policy> {
        self.named
            .values()
            .find(|p| p.models.iter().any(|m| m == model))
            .cloned()
            .unwrap_or_else(|| self.global.clone())
    }
}
