//! hivenet-bench against a real hivenet-sim process: report counts add up,
//! percentiles are ordered, and the open loop exposes a server stall that
//! a closed loop hides (coordinated omission).

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

fn sim(extra: &[&str]) -> (Kill, u16) {
    let port = free_port();
    let ps = port.to_string();
    let mut args = vec!["--port", ps.as_str()];
    args.extend_from_slice(extra);
    let child = Command::new(env!("CARGO_BIN_EXE_hivenet-sim"))
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("sim");
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "sim did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (Kill(child), port)
}

fn opts(port: u16, out: &str) -> bench::Opts {
    bench::Opts {
        url: format!("http://127.0.0.1:{port}"),
        rate: None,
        connections: None,
        duration: "2s".into(),
        arrivals: "poisson".into(),
        endpoint: "chat".into(),
        model: "sim-model".into(),
        stream: false,
        prompt_tokens: "8-32".into(),
        max_tokens: "4-16".into(),
        api_key: Some("k".into()),
        threads: 1,
        spin: "100us".into(),
        cpus: None,
        timeout: "10s".into(),
        max_connections: 4096,
        seed: 7,
        out: std::env::temp_dir().join(out).to_string_lossy().to_string(),
        quiet: true,
    }
}

fn ordered(s: &bench::report::Summary) -> bool {
    s.p50 <= s.p90 && s.p90 <= s.p99 && s.p99 <= s.p999 && s.p999 <= s.max
}

#[test]
fn short_run_report_adds_up() {
    let (_s, port) = sim(&["--ttft", "2ms", "--itl", "1ms", "--error-rate", "0.1"]);
    let mut o = opts(port, &format!("bench-short-{port}.json"));
    o.rate = Some(150.0);
    o.stream = true;
    let r = bench::run(&o).expect("run");
    assert!(r.sent > 200, "{}", r.sent);
    assert_eq!(r.sent, r.ok + r.errors, "sent = ok + errors");
    assert!(r.errors > 0, "10% injected errors are counted");
    assert_eq!(
        r.errors_by_status.get("500").copied().unwrap_or(0),
        r.errors
    );
    assert_eq!(
        r.errors_by_code.get("server_error").copied().unwrap_or(0),
        r.errors
    );
    for s in [
        &r.total,
        &r.service,
        &r.headers,
        &r.first_event,
        &r.event_gap,
    ] {
        assert!(s.count > 0 && ordered(s), "{s:?}");
    }
    assert!(
        r.first_event.p50 >= 2.0,
        "ttft is in the first event: {:?}",
        r.first_event
    );
    // The JSON and the plot are on disk and the JSON parses back.
    let text = std::fs::read_to_string(&o.out).expect("json");
    let back: bench::report::Report = serde_json::from_str(&text).expect("parse");
    assert_eq!(back.sent, r.sent);
    let svg = std::fs::read_to_string(o.out.replace(".json", ".svg")).expect("svg");
    assert!(svg.starts_with("<svg") && svg.contains("polyline"));
}

#[test]
fn open_loop_sees_the_stall_closed_loop_hides_it() {
    let (_s, port) = sim(&["--stall-after", "50", "--stall-for", "1s"]);
    let mut o = opts(port, &format!("bench-co-open-{port}.json"));
    o.rate = Some(100.0);
    o.duration = "5s".into();
    o.arrivals = "constant".into();
    let open = bench::run(&o).expect("open run");
    assert_eq!(open.sent, open.ok);
    // About 100 of 500 requests were due during the 1 s stall: p99 must show it.
    assert!(open.total.p99 >= 500.0, "open-loop p99 {:?}", open.total);
    assert!(
        open.total.p90 >= 100.0,
        "about a fifth of the requests waited: {:?}",
        open.total
    );

    let (_s2, port2) = sim(&["--stall-after", "50", "--stall-for", "1s"]);
    let mut c = opts(port2, &format!("bench-co-closed-{port2}.json"));
    c.connections = Some(1);
    c.duration = "5s".into();
    let closed = bench::run(&c).expect("closed run");
    assert!(
        closed.total.max >= 900.0,
        "the stall happened: {:?}",
        closed.total
    );
    assert!(
        closed.total.p99 < 100.0,
        "one connection waited once: the closed loop hides it: {:?}",
        closed.total
    );
}
