//! The machine and the process: [`core_plan`] (shards to CPUs),
//! [`procfs`] (`/proc/self` parsers), [`log_gate`] (at most one line per
//! interval), [`timefmt`] and [`calendar`] (writing and reading dates).

pub mod calendar;
pub mod config_error;
pub mod core_plan;
pub mod log_gate;
pub mod procfs;
pub mod timefmt;
pub mod upgrade;
pub mod version;
