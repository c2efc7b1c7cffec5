//! Process wiring shared by the `hivenet-router` and `hivenet-agent`
//! binaries: flag helpers, logging set-up. No per-request logic lives here.
#![forbid(unsafe_code)]

pub mod admin_keys;
pub mod agent;
pub mod auth_files;
pub mod cli;
pub mod keygen;
pub mod map_writer;
pub mod policy_files;
pub mod store;
