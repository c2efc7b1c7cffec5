//! `hivenet-service`: what a Kubernetes Service does for a rolling
//! replacement benchmark (`scripts/bench/rolling.py`, issue 54), on one
//! host without iptables: each new client connection goes to the next
//! endpoint in turn and its bytes are copied both ways until either side
//! closes; connections already open stay where they are. The endpoints
//! are the lines of `--endpoints-file`, read again every 100 ms (what the
//! endpoints controller does: the script removes a pod being deleted and
//! adds one once its `/ready` answers 200). Prints every second one
//! `SERVICE {json}` line: connections so far per endpoint and those that
//! could not be connected anywhere (the last line is the run's).
#![forbid(unsafe_code)]

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use argh::FromArgs;
use monoio::io::Splitable;
use monoio::net::{TcpListener, TcpStream};
use shards::runtime::wire::executor::{run_on_runtime, DriverChoice};

/// A Service in front of routers: new connections to the endpoints in turn.
#[derive(FromArgs)]
struct Args {
    /// address to listen on, e.g. 127.0.0.1:8080
    #[argh(option)]
    listen: SocketAddr,
    /// file with one endpoint address per line (the Service's endpoints)
    #[argh(option)]
    endpoints_file: std::path::PathBuf,
    /// stop and report after this long (default 1h)
    #[argh(option, default = "String::from(\"1h\")")]
    duration: String,
}

/// Connections per endpoint, and those no endpoint took.
#[derive(Default)]
struct Counts {
    by_endpoint: RefCell<BTreeMap<String, u64>>,
    unconnected: Cell<u64>,
}

fn read_endpoints(path: &std::path::Path) -> Vec<SocketAddr> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Copy one direction; then close the other side's writing half.
async fn pipe<R, W>(mut from: R, mut to: W)
where
    R: monoio::io::AsyncReadRent,
    W: monoio::io::AsyncWriteRent,
{
    let _ = monoio::io::copy(&mut from, &mut to).await;
    let _ = to.shutdown().await;
}

async fn serve(client: TcpStream, endpoints: Vec<SocketAddr>, first: usize, counts: Rc<Counts>) {
    // The next endpoint in turn; one that refuses is skipped (a Service
    // would not have it: its pod is gone).
    for k in 0..endpoints.len() {
        let Some(ep) = endpoints.get((first + k) % endpoints.len()) else {
            break;
        };
        let Ok(up) = TcpStream::connect(*ep).await else {
            continue;
        };
        let _ = up.set_nodelay(true);
        *counts
            .by_endpoint
            .borrow_mut()
            .entry(ep.to_string())
            .or_default() += 1;
        let (cr, cw) = client.into_split();
        let (ur, uw) = up.into_split();
        futures::join!(pipe(cr, uw), pipe(ur, cw));
        return;
    }
    counts.unconnected.set(counts.unconnected.get() + 1);
}

async fn run(a: Args) {
    let listener = match TcpListener::bind(a.listen) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("hivenet-service: --listen {}: {e}", a.listen);
            std::process::exit(2);
        }
    };
    let duration = humantime::parse_duration(&a.duration).unwrap_or(Duration::from_secs(3600));
    let endpoints = Rc::new(RefCell::new(read_endpoints(&a.endpoints_file)));
    {
        let (endpoints, path) = (endpoints.clone(), a.endpoints_file.clone());
        monoio::spawn(async move {
            loop {
                monoio::time::sleep(Duration::from_millis(100)).await;
                *endpoints.borrow_mut() = read_endpoints(&path);
            }
        });
    }
    let counts = Rc::new(Counts::default());
    let stop = Rc::new(Cell::new(false));
    {
        let (stop, counts) = (stop.clone(), counts.clone());
        monoio::spawn(async move {
            let t = std::time::Instant::now();
            while t.elapsed() < duration {
                monoio::time::sleep(Duration::from_secs(1)).await;
                report(&counts);
            }
            stop.set(true);
        });
    }
    println!("LISTENING {}", a.listen);
    let mut next = 0usize;
    while !stop.get() {
        let accepted = monoio::time::timeout(Duration::from_millis(200), listener.accept()).await;
        let Ok(Ok((client, _))) = accepted else {
            continue;
        };
        let _ = client.set_nodelay(true);
        let eps = endpoints.borrow().clone();
        next = next.wrapping_add(1);
        monoio::spawn(serve(client, eps, next, counts.clone()));
    }
    report(&counts);
}

fn report(counts: &Counts) {
    use std::io::Write;
    let r = serde_json::json!({
        "by_endpoint": *counts.by_endpoint.borrow(),
        "unconnected": counts.unconnected.get(),
    });
    println!("SERVICE {r}");
    let _ = std::io::stdout().flush();
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    shards::exit_on_version_flag("hivenet-service", &args);
    let a: Args = argh::from_env();
    run_on_runtime(DriverChoice::Epoll, move |_| run(a));
}
