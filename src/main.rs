//! `hivenet-router`: parses flags, builds the shared state, binds the
//! SO_REUSEPORT listeners, starts one pinned shard runtime per CPU and
//! waits for a signal.
#![forbid(unsafe_code)]

mod config;
mod go_flags;
mod lifecycle;
mod shard_calls;
mod start_checks;
mod startup;
mod upgrade;

use crate::config::build;
use crate::lifecycle::run;
use hivenet_router::cli;
use tracing::error;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    // A thread that panics (a shard, the store) takes the process down
    // with it: a dead shard would leave its listener taking connections
    // that never answer (issue 51 #1). The supervisor restarts it.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        std::process::exit(101);
    }));
    let args: Vec<String> = std::env::args().collect();
    shards::exit_on_version_flag("hivenet-router", &args);
    if args.get(1).map(String::as_str) == Some("keygen") {
        match hivenet_router::keygen::run(args.get(2..).unwrap_or(&[])) {
            Ok(out) => {
                print!("{out}");
                return;
            }
            Err(e) => {
                eprintln!("hivenet-router: {e}");
                std::process::exit(2);
            }
        }
    }
    cli::init_logging();
    if args.get(1).map(String::as_str) == Some("map-writer") {
        if let Err(e) = hivenet_router::map_writer::run(args.get(2..).unwrap_or(&[])) {
            eprintln!("hivenet-router: {e}");
            std::process::exit(2);
        }
        return;
    }
    let startup = match build() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("hivenet-router: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(startup) {
        error!("{e}");
        eprintln!("hivenet-router: {e}");
        std::process::exit(1);
    }
}
