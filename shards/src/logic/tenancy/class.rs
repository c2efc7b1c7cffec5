//! A request's priority class, pure: its key's `priority`, lowered (never
//! raised) by the `X-Hivenet-Priority` header. The capacity queue
//! ([`crate::logic::routing::wait_queue`]) and the hold order
//! ([`crate::logic::sites::hold`]) order by it.

use crate::logic::http::errors::{ApiError, ErrorCode};

/// A request's priority class (`priority` on a key, lowered by the
/// `X-Hivenet-Priority` header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Hash)]
pub enum Class {
    /// Chat a person waits on: first.
    Interactive = 0,
    /// The default.
    #[default]
    Standard = 1,
    /// Throughput work: last.
    Batch = 2,
}

impl Class {
    /// Every class, first served first.
    pub const ALL: [Class; 3] = [Class::Interactive, Class::Standard, Class::Batch];

    /// `interactive`, `standard`, `batch`.
    pub fn parse(s: &str) -> Option<Class> {
        match s.trim().to_ascii_lowercase().as_str() {
            "interactive" => Some(Class::Interactive),
            "standard" => Some(Class::Standard),
            "batch" => Some(Class::Batch),
            _ => None,
        }
    }

    /// Its name (labels, headers, the key API).
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Interactive => "interactive",
            Class::Standard => "standard",
            Class::Batch => "batch",
        }
    }

    /// Its index in [`Class::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// The header a request may lower its class with.
pub const PRIORITY_HEADER: &str = "x-hivenet-priority";

/// A request's class: its key's, or lower when `header` asks (a value
/// above the key's, or not a class, is refused with the reason).
pub fn request_class(key: Class, header: Option<&[u8]>) -> Result<Class, ApiError> {
    let Some(raw) = header else {
        return Ok(key);
    };
    let text = std::str::from_utf8(raw).unwrap_or("");
    let Some(asked) = Class::parse(text) else {
        return Err(ApiError::new(
            ErrorCode::RequestInvalid,
            format!(
                "X-Hivenet-Priority: {:?} is not one of interactive, standard, batch",
                text.chars().take(32).collect::<String>()
            ),
        ));
    };
    if asked < key {
        return Err(ApiError::new(
            ErrorCode::RequestInvalid,
            format!(
            "X-Hivenet-Priority: {} is above this key's class ({}); a request may only lower it",
            asked.as_str(),
            key.as_str()
        ),
        ));
    }
    Ok(asked)
}
