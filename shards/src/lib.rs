//! `shards`: what a pinned core runs.
//!
//! Key parts:
//! - [`logic`]: sans-I/O modules (HTTP/1.1 framing, request probing, error
//!   envelopes, model directory assignment, agent-link codecs, agent
//!   selection). They never read a clock, never touch a socket and compile
//!   without the `runtime` feature.
//! - `runtime` (feature `runtime`): the I/O shell: pinned monoio runtimes,
//!   the cross-core mesh, the client HTTP ingress, libp2p agent links and
//!   the per-shard agent pools.
//!
//! Unsafe code: denied everywhere except one audited function
//! (`runtime::wire::handoff::into_std`), which moves a socket's ownership out of
//! one monoio runtime so another core can adopt it. monoio offers no safe
//! way to do that and the architecture's one-hand-off-per-connection rule
//! depends on it.
#![deny(unsafe_code)]

pub mod logic;

/// The product version and the commit it was built from, as `--version`
/// prints it after the binary's name.
pub fn version() -> String {
    format!(
        "{} (commit {})",
        env!("CARGO_PKG_VERSION"),
        env!("HIVENET_COMMIT")
    )
}

/// `--version` as the last argument (or `-V` anywhere): print `<name>
/// <version>` and exit 0. Only as the last argument because the agent's
/// spec flag `--version VALUE` sets its version label.
pub fn exit_on_version_flag(name: &str, args: &[String]) {
    let rest = args.get(1..).unwrap_or(&[]);
    if rest.last().is_some_and(|a| a == "--version") || rest.iter().any(|a| a == "-V") {
        println!("{name} {}", version());
        std::process::exit(0);
    }
}

#[cfg(feature = "runtime")]
pub mod runtime;
