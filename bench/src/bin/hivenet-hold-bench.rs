//! `hivenet-hold-bench`: held requests at scale, timed from Rust (see
//! `bench::hold_client`); driven by `scripts/bench/hold.py --client rust`.
#![forbid(unsafe_code)]

use std::time::Duration;

use argh::FromArgs;
use shards::runtime::wire::executor::{run_on_runtime, DriverChoice};

/// Hold many streaming requests for a model at zero and time keepalives.
#[derive(FromArgs)]
struct Args {
    /// router address, e.g. 127.0.0.1:8080
    #[argh(option)]
    addr: std::net::SocketAddr,
    /// model at zero (default zero-model)
    #[argh(option, default = "String::from(\"zero-model\")")]
    model: String,
    /// held requests
    #[argh(option)]
    held: usize,
    /// the router's --wake-keepalive (default 1s)
    #[argh(option, default = "String::from(\"1s\")")]
    keepalive: String,
    /// how long to hold once all are sent (default 10s)
    #[argh(option, default = "String::from(\"10s\")")]
    hold_seconds: String,
    /// give up on the release after (default 300s)
    #[argh(option, default = "String::from(\"300s\")")]
    timeout: String,
}

fn dur(flag: &str, v: &str) -> Duration {
    match humantime::parse_duration(v) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("hivenet-hold-bench: --{flag} {v:?}: {e}");
            std::process::exit(2);
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    shards::exit_on_version_flag("hivenet-hold-bench", &args);
    let a: Args = argh::from_env();
    let opts = bench::hold_client::HoldOpts {
        addr: a.addr,
        model: a.model,
        held: a.held,
        keepalive: dur("keepalive", &a.keepalive),
        hold: dur("hold-seconds", &a.hold_seconds),
        timeout: dur("timeout", &a.timeout),
    };
    run_on_runtime(DriverChoice::Auto, move |_| bench::hold_client::run(opts));
}
