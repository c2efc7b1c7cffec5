//! `/admin/registration-stream`: SSE events for registrations and removals.

mod common;
use common::*;
use std::io::Read;
use std::time::Duration;

#[test]
fn registrations_and_removals_are_streamed() {
    let dir = tmpdir("feed");
    let r = start_router(&dir, &["--shards", "2"], &[]);
    let (mut s, mut got) = open_feed(r.http);
    let head = String::from_utf8_lossy(&got).to_string();
    assert!(
        head.starts_with("HTTP/1.1 200") && head.contains("text/event-stream"),
        "{head}"
    );
    let (_sim, port) = start_sim(&dir, "feed-model", &[]);
    let mut a = start_agent(&dir, &r, port, "f.key", &[]);
    read_until(&mut s, &mut got, "\"event_type\":\"registered\"");
    let text = String::from_utf8_lossy(&got).to_string();
    assert!(text.contains("\"agent_id\":\"12D3KooW"), "{text}");
    assert!(text.contains("\"timestamp\":\"20"), "{text}");
    a.kill9();
    read_until(&mut s, &mut got, "\"event_type\":\"unregistered\"");
    // Without a key: 401.
    let (st, _) = Req::get("/admin/registration-stream")
        .send(r.http)
        .map(Resp::pair)
        .expect("no key");
    assert_eq!(st, 401);
}

/// A raw agent link for `kp` that registers `model` and stays until `stop`
/// says so (heartbeats every 100 ms meanwhile).
fn hold_link(
    p2p: u16,
    kp: libp2p_identity::Keypair,
    model: &'static str,
    stop: std::sync::mpsc::Receiver<()>,
) -> std::thread::JoinHandle<()> {
    use shards::logic::link::control::ControlMsg;
    use shards::runtime::wire::executor::{run_on_runtime, DriverChoice};
    use shards::runtime::wire::link;
    std::thread::spawn(move || {
        run_on_runtime(DriverChoice::Auto, |_| async move {
            let Some(mut l) = raw_register(p2p, &kp, model).await else {
                return;
            };
            while stop.try_recv().is_err() {
                let hb = ControlMsg::Heartbeat {
                    backend_healthy: true,
                    draining: false,
                };
                let _ = link::write_frame(&mut l.ctl.stream, &hb).await;
                monoio::time::sleep(Duration::from_millis(100)).await;
            }
            let _ = futures::AsyncWriteExt::close(&mut l.ctl.stream).await;
            l.handle.close();
            monoio::time::sleep(Duration::from_millis(100)).await;
        });
    })
}

#[test]
fn a_replaced_link_ending_publishes_nothing() {
    let dir = tmpdir("feed-replace");
    let r = start_router(&dir, &["--shards", "1"], &[]);
    let (mut s, mut got) = open_feed(r.http);
    let kp = libp2p_identity::Keypair::generate_ed25519();
    let (stop1, rx1) = std::sync::mpsc::channel();
    let first = hold_link(r.p2p, kp.clone(), "replace-model", rx1);
    read_until(&mut s, &mut got, "\"event_type\":\"registered\"");
    // The same peer registers again on a new link while the old one lives.
    let (stop2, rx2) = std::sync::mpsc::channel();
    let second = hold_link(r.p2p, kp, "replace-model", rx2);
    wait_until(
        Duration::from_secs(5),
        || {
            String::from_utf8_lossy(&got)
                .matches("\"event_type\":\"registered\"")
                .count()
                >= 2
                || {
                    let mut tmp = [0u8; 4096];
                    let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
                    if let Ok(n) = s.read(&mut tmp) {
                        got.extend_from_slice(&tmp[..n]);
                    }
                    false
                }
        },
        "second registration",
    );
    // The old link ends: the agent stays, and no "unregistered" follows.
    let _ = stop1.send(());
    let _ = first.join();
    std::thread::sleep(Duration::from_millis(500));
    let mut tmp = [0u8; 4096];
    let _ = s.set_read_timeout(Some(Duration::from_millis(300)));
    while let Ok(n) = s.read(&mut tmp) {
        if n == 0 {
            break;
        }
        got.extend_from_slice(&tmp[..n]);
    }
    let text = String::from_utf8_lossy(&got).to_string();
    assert!(
        !text.contains("\"event_type\":\"unregistered\""),
        "the replaced link's end was published: {text}"
    );
    assert_eq!(routing_table(r.http)["total"], 1, "still registered");
    assert!(r.proc.log_text().contains("replaced link ended"));
    // The live link ends: now it leaves.
    let _ = stop2.send(());
    let _ = second.join();
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    read_until(&mut s, &mut got, "\"event_type\":\"unregistered\"");
    wait_until(
        Duration::from_secs(5),
        || routing_table(r.http)["total"] == 0,
        "removed",
    );
}

/// An idle registration stream gets a `: keep-alive` comment every 25 s,
/// so proxies and clients do not time it out.
#[test]
fn an_idle_feed_gets_keep_alives() {
    let dir = tmpdir("feed-keepalive");
    let r = start_router(&dir, &["--shards", "1"], &[]);
    let (mut s, mut got) = open_feed(r.http);
    s.set_read_timeout(Some(Duration::from_secs(40)))
        .expect("timeout");
    let head = String::from_utf8_lossy(&got).to_string();
    assert!(head.contains("X-Accel-Buffering: no"), "{head}");
    let t = std::time::Instant::now();
    read_until(&mut s, &mut got, ": keep-alive\n\n");
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_secs(20) && waited < Duration::from_secs(35),
        "keep-alive after {waited:?}"
    );
}

/// Issue 51 #12: a subscriber that closes its connection gives the
/// router's connection (its descriptor and its place under
/// `--max-client-connections`) back at once; it was held until the next
/// 25 s keepalive write failed.
#[test]
fn a_closed_subscriber_gives_its_descriptor_back_at_once() {
    let dir = tmpdir("feed-closed");
    let r = start_router(&dir, &["--shards", "1"], &[]);
    let open = || metric(r.metrics, "hivenet_client_connections").unwrap_or(-1.0);
    let before = open();
    let feeds: Vec<_> = (0..20).map(|_| open_feed(r.http).0).collect();
    wait_until(
        Duration::from_secs(5),
        || open() >= before + 20.0,
        "20 subscribers",
    );
    drop(feeds);
    let t0 = std::time::Instant::now();
    wait_until(
        Duration::from_secs(5),
        || open() <= before,
        "connections given back",
    );
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "at once, not at the keepalive: {:?}",
        t0.elapsed()
    );
}
