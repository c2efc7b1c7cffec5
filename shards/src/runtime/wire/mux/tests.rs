use super::*;
use crate::runtime::wire::link::adapter::ThreadBound;
use crate::runtime::wire::link::socket::LinkSocket;
use futures::channel::oneshot;
use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};

fn run<F: std::future::Future<Output = ()>>(f: F) {
    let mut rt = monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
        .enable_timer()
        .build()
        .expect("runtime");
    rt.block_on(async {
        monoio::time::timeout(std::time::Duration::from_secs(30), f)
            .await
            .expect("the test hung")
    });
}

fn boxed(s: monoio::net::TcpStream) -> BoxIo {
    Box::new(ThreadBound::new(LinkSocket::new(s).0))
}

/// Two ends of a loopback TCP connection.
async fn pair() -> (monoio::net::TcpStream, monoio::net::TcpStream) {
    let l = monoio::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let (a, b) = futures::join!(l.accept(), monoio::net::TcpStream::connect(addr));
    (a.expect("accept").0, b.expect("connect"))
}

fn spawn_drive(mut c: Connection) -> monoio::task::JoinHandle<io::Result<()>> {
    monoio::spawn(async move { futures::future::poll_fn(|cx| c.poll_drive(cx)).await })
}

/// Router end (server) and agent end (client), driven.
struct Ends {
    server: Opener,
    server_done: monoio::task::JoinHandle<io::Result<()>>,
    client: Opener,
    client_in: Inbound,
    client_done: monoio::task::JoinHandle<io::Result<()>>,
}

async fn ends(client_max_inbound: usize) -> Ends {
    let (a, b) = pair().await;
    let s = Connection::new(boxed(a), Mode::Server, 16);
    let c = Connection::new(boxed(b), Mode::Client, client_max_inbound);
    Ends {
        server: s.opener(),
        client: c.opener(),
        client_in: c.inbound(),
        server_done: spawn_drive(s),
        client_done: spawn_drive(c),
    }
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Read the request to its end, answer with `answer`, close.
async fn answer<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, answer: Vec<u8>) -> Vec<u8> {
    let mut got = Vec::new();
    s.read_to_end(&mut got).await.expect("read request");
    s.write_all(&answer).await.expect("write answer");
    s.close().await.expect("close");
    got
}

#[test]
fn many_streams_carry_more_than_a_window_each_way() {
    run(async {
        let e = ends(64).await;
        let mut client_in = e.client_in;
        let server = monoio::spawn(async move {
            let mut n = 0;
            while let Some(s) = client_in.next().await {
                let seed = n as u8;
                monoio::spawn(async move {
                    let got = answer(s, pattern(700_000, seed.wrapping_add(1))).await;
                    assert_eq!(got, pattern(300_000, seed), "request {seed}");
                });
                n += 1;
            }
        });
        let mut tasks = Vec::new();
        for i in 0..20u8 {
            let mut s = e.server.open().expect("open");
            // Streams are accepted in the order their first frames
            // arrive, which is the order of these writes.
            s.write_all(&pattern(300_000, i)).await.expect("write");
            s.close().await.expect("close");
            tasks.push(monoio::spawn(async move {
                let mut got = Vec::new();
                s.read_to_end(&mut got).await.expect("read");
                assert_eq!(got.len(), 700_000);
                assert!(got == pattern(700_000, i.wrapping_add(1)), "answer {i}");
            }));
        }
        for t in tasks {
            t.await;
        }
        // Everything was let go: no stream state is left behind.
        assert_eq!(e.server.shared.borrow().streams.len(), 0);
        e.server.close();
        assert!(e.server_done.await.is_ok());
        assert!(
            e.client_done.await.is_ok(),
            "the go-away ends the peer cleanly"
        );
        server.await;
        assert!(e.client.open().is_err(), "no opens on a closed link");
    });
}

#[test]
fn dropping_an_unfinished_stream_resets_it_at_the_peer() {
    run(async {
        let mut e = ends(64).await;
        let mut s = e.server.open().expect("open");
        s.write_all(b"partial request").await.expect("write");
        let mut peer = e.client_in.next().await.expect("accepted");
        let mut buf = [0u8; 15];
        peer.read_exact(&mut buf).await.expect("first bytes");
        drop(s);
        // The reset ends the peer's reads and refuses its writes.
        let mut rest = Vec::new();
        peer.read_to_end(&mut rest).await.expect("eof after reset");
        assert!(rest.is_empty());
        let err = peer.write_all(b"late answer").await;
        assert!(err.is_err(), "writes after a reset fail");
        // The session is still up.
        let mut s2 = e.server.open().expect("open");
        s2.write_all(b"x").await.expect("write");
        s2.close().await.expect("close");
        let peer2 = e.client_in.next().await.expect("second stream");
        assert_eq!(answer(peer2, b"y".to_vec()).await, b"x");
        let mut got = Vec::new();
        s2.read_to_end(&mut got).await.expect("read");
        assert_eq!(got, b"y");
    });
}

#[test]
fn streams_over_the_limit_are_refused_alone() {
    run(async {
        let mut e = ends(2).await;
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut s = e.server.open().expect("open");
            s.write_all(b"hello").await.expect("write");
            held.push(s);
        }
        let a = e.client_in.next().await.expect("first");
        let b = e.client_in.next().await.expect("second");
        let mut third = e.server.open().expect("open");
        third.write_all(b"one too many").await.expect("write");
        let mut got = Vec::new();
        third
            .read_to_end(&mut got)
            .await
            .expect("reset reads as the end");
        assert!(got.is_empty());
        assert!(
            third.write_all(b"more").await.is_err(),
            "the third was reset"
        );
        // Letting one go makes room again.
        drop(a);
        let mut fourth = e.server.open().expect("open");
        fourth.write_all(b"fits").await.expect("write");
        fourth.close().await.expect("close");
        let peer = e.client_in.next().await.expect("fourth accepted");
        assert_eq!(answer(peer, b"ok".to_vec()).await, b"fits");
        drop(b);
    });
}

#[test]
fn pings_are_answered_and_garbage_ends_the_session() {
    run(async {
        let (a, mut raw) = pair().await;
        let c = Connection::new(boxed(a), Mode::Server, 4);
        let done = spawn_drive(c);
        use monoio::io::{AsyncReadRentExt, AsyncWriteRentExt};
        let ping = Header {
            kind: Kind::Ping,
            flags: SYN,
            stream: 0,
            len: 0xdead_beef,
        };
        let (r, _) = raw.write_all(ping.encode().to_vec()).await;
        r.expect("write ping");
        let (r, buf) = raw.read_exact(vec![0u8; HEADER_LEN]).await;
        r.expect("read pong");
        let mut hb = [0u8; HEADER_LEN];
        hb.copy_from_slice(&buf);
        let pong = Header::decode(&hb).expect("header");
        assert_eq!(pong.kind, Kind::Ping);
        assert!(pong.has(ACK));
        assert_eq!(pong.len, 0xdead_beef);
        // Version 1 does not exist.
        let (r, _) = raw.write_all(vec![1u8; HEADER_LEN]).await;
        r.expect("write garbage");
        let end = done.await;
        assert_eq!(
            end.map_err(|e| e.kind()).err(),
            Some(io::ErrorKind::InvalidData)
        );
        // It says why before it goes.
        let (r, buf) = raw.read_exact(vec![0u8; HEADER_LEN]).await;
        r.expect("read go-away");
        hb.copy_from_slice(&buf);
        let away = Header::decode(&hb).expect("header");
        assert_eq!((away.kind, away.len), (Kind::GoAway, GO_AWAY_PROTOCOL));
    });
}

/// The wire is yamux's: this implementation and the `yamux` crate
/// exchange more than a window each way, on streams either side opens.
#[test]
fn talks_to_the_yamux_crate() {
    run(async {
        let (a, b) = pair().await;
        let ours = Connection::new(boxed(a), Mode::Server, 16);
        let opener = ours.opener();
        let mut inbound = ours.inbound();
        let ours_done = spawn_drive(ours);
        let mut theirs =
            yamux::Connection::new(boxed(b), yamux::Config::default(), yamux::Mode::Client);
        let (opened_tx, opened_rx) = oneshot::channel();
        let theirs_task = monoio::spawn(async move {
            let mut opened_tx = Some(opened_tx);
            futures::future::poll_fn(|cx| {
                if opened_tx.is_some() {
                    if let Poll::Ready(r) = theirs.poll_new_outbound(cx) {
                        if let Some(tx) = opened_tx.take() {
                            let _ = tx.send(r.expect("yamux opens"));
                        }
                    }
                }
                loop {
                    match theirs.poll_next_inbound(cx) {
                        Poll::Ready(Some(Ok(s))) => {
                            monoio::spawn(async move {
                                let got = answer(s, pattern(400_000, 9)).await;
                                assert!(got == pattern(500_000, 8), "our request reached yamux");
                            });
                        }
                        Poll::Ready(_) => return Poll::Ready(()),
                        Poll::Pending => return Poll::Pending,
                    }
                }
            })
            .await
        });
        // Our stream to them.
        let mut s = opener.open().expect("open");
        s.write_all(&pattern(500_000, 8)).await.expect("write");
        s.close().await.expect("close");
        let mut got = Vec::new();
        s.read_to_end(&mut got).await.expect("read");
        assert!(got == pattern(400_000, 9), "yamux's answer reached us");
        // Their stream to us.
        let mut t = opened_rx.await.expect("yamux stream");
        // More than a window: we must read while yamux writes.
        let theirs_asks = monoio::spawn(async move {
            t.write_all(&pattern(300_000, 3))
                .await
                .expect("yamux writes");
            t.close().await.expect("yamux closes");
            t
        });
        let mine = inbound.next().await.expect("accepted from yamux");
        // More than a window: yamux must read while we write.
        let ours_answers = monoio::spawn(answer(mine, pattern(600_000, 4)));
        let mut t = theirs_asks.await;
        let mut got = Vec::new();
        t.read_to_end(&mut got).await.expect("yamux reads");
        assert!(
            ours_answers.await == pattern(300_000, 3),
            "yamux's request reached us"
        );
        assert!(got == pattern(600_000, 4), "our answer reached yamux");
        drop((s, t));
        opener.close();
        assert!(ours_done.await.is_ok());
        theirs_task.await;
    });
}
/// yamux opens at most 256 streams we have not acknowledged; our
/// first frame on each must carry the ACK, or its opens stall.
#[test]
fn yamux_can_open_past_its_ack_backlog() {
    run(async {
        let (a, b) = pair().await;
        let ours = Connection::new(boxed(a), Mode::Server, 1000);
        let mut inbound = ours.inbound();
        let opener = ours.opener();
        let ours_done = spawn_drive(ours);
        let mut theirs =
            yamux::Connection::new(boxed(b), yamux::Config::default(), yamux::Mode::Client);
        let (tx, mut rx) = futures::channel::mpsc::unbounded();
        let mut left = 300;
        let theirs_task = monoio::spawn(async move {
            futures::future::poll_fn(|cx| {
                while left > 0 {
                    match theirs.poll_new_outbound(cx) {
                        Poll::Ready(Ok(s)) => {
                            left -= 1;
                            let _ = tx.unbounded_send(s);
                        }
                        Poll::Ready(Err(_)) => return Poll::Ready(()),
                        Poll::Pending => break,
                    }
                }
                match theirs.poll_next_inbound(cx) {
                    Poll::Ready(_) => Poll::Ready(()),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await
        });
        let mut held = Vec::new();
        for _ in 0..300 {
            let mut t = rx.next().await.expect("yamux opened");
            t.write_all(b"q").await.expect("yamux writes");
            let mut mine = inbound.next().await.expect("accepted");
            let mut q = [0u8; 1];
            mine.read_exact(&mut q).await.expect("read");
            mine.write_all(b"a").await.expect("answer");
            t.read_exact(&mut q).await.expect("yamux reads");
            assert_eq!(&q, b"a");
            held.push((t, mine));
        }
        drop(held);
        opener.close();
        assert!(ours_done.await.is_ok());
        theirs_task.await;
    });
}
#[test]
fn a_side_that_takes_no_streams_refuses_them() {
    run(async {
        let e = ends(64).await;
        drop(e.client_in);
        let mut s = e.server.open().expect("open");
        s.write_all(b"anyone?").await.expect("write");
        let mut got = Vec::new();
        s.read_to_end(&mut got)
            .await
            .expect("reset reads as the end");
        assert!(got.is_empty());
        assert!(s.write_all(b"more").await.is_err(), "it was reset");
    });
}
/// A quietly dropped stream's FIN waits for the next frame this side
/// sends; what the peer sends meanwhile does not carry it out.
#[test]
fn a_quiet_drop_waits_for_the_next_frame_out() {
    run(async {
        let mut e = ends(64).await;
        let mut b = [0u8; 3];
        let mut s1 = e.server.open().expect("open");
        s1.write_all(b"req").await.expect("write");
        let mut c1 = e.client_in.next().await.expect("c1");
        c1.read_exact(&mut b).await.expect("read");
        c1.write_all(b"resp").await.expect("answer");
        c1.close().await.expect("close");
        let mut got = Vec::new();
        s1.read_to_end(&mut got).await.expect("read");
        let mut s2 = e.server.open().expect("open");
        s2.write_all(b"two").await.expect("write");
        let mut c2 = e.client_in.next().await.expect("c2");
        c2.read_exact(&mut b).await.expect("read");
        s1.drop_quietly();
        // Traffic in wakes the server's driver; the FIN stays.
        c2.write_all(b"ack").await.expect("write");
        s2.read_exact(&mut b).await.expect("read");
        monoio::time::sleep(std::time::Duration::from_millis(50)).await;
        let mut one = [0u8; 1];
        let mut r = c1.read(&mut one);
        assert!(
            futures::poll!(&mut r).is_pending(),
            "the FIN went on its own"
        );
        drop(r);
        // The next frame out carries it.
        s2.write_all(b"x").await.expect("write");
        let n = c1.read(&mut one).await.expect("read");
        assert_eq!(n, 0, "the FIN came with the next frame");
    });
}
