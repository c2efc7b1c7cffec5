//! [`ConfigError`]: an operator's configuration refused (a flag, a file,
//! an environment variable, an admin API document): the operator's side,
//! never retried as it is, with one line that names the file, entry and
//! field. Start-up prints it and stops; a reload or an admin call answers
//! it and keeps what it had.

use std::fmt;

/// A configuration value refused, with the one-line reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    message: String,
}

impl ConfigError {
    /// The refusal with its reason.
    pub fn new(message: impl Into<String>) -> Self {
        ConfigError {
            message: message.into(),
        }
    }

    /// The one-line reason.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The same reason, `at` in front (the file or flag it came from).
    pub fn at(self, at: &str) -> Self {
        ConfigError::new(format!("{at}: {}", self.message))
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConfigError {}

// The admin API answers it as its `error` string.
impl serde::Serialize for ConfigError {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.message)
    }
}

// The parsers below it build their reasons as text.
impl From<String> for ConfigError {
    fn from(message: String) -> Self {
        ConfigError { message }
    }
}

impl From<&str> for ConfigError {
    fn from(message: &str) -> Self {
        ConfigError::new(message)
    }
}

// Process wiring (`src/`) reports every start-up failure as one line.
impl From<ConfigError> for String {
    fn from(e: ConfigError) -> Self {
        e.message
    }
}
