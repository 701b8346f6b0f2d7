//! `k3 serve` under clients that never finish: a half-sent request, a body that stops, an
//! idle kept-alive connection, more connections than the cap, and signals while they hold on.
//! Each is seen through the binary over loopback.

use crate::serve::{curl, long_stream, start, Server};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// A raw connection to the server, with `head` already sent.
fn connect(s: &Server, head: &str) -> TcpStream {
    let addr = s.url.trim_start_matches("http://");
    let mut c = TcpStream::connect(addr).unwrap();
    c.write_all(head.as_bytes()).unwrap();
    c
}

/// Read until the server closes the connection (or `limit` passes); what arrived and when the
/// connection ended, or None if it was still open at the limit.
fn until_closed(c: &mut TcpStream, limit: Duration) -> (String, Option<Instant>) {
    let end = Instant::now() + limit;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return (String::from_utf8_lossy(&got).into_owned(), None);
        }
        c.set_read_timeout(Some(left)).unwrap();
        match c.read(&mut buf) {
            Ok(0) => {
                return (
                    String::from_utf8_lossy(&got).into_owned(),
                    Some(Instant::now()),
                )
            }
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            // A reset is the server closing too.
            Err(_) => {
                return (
                    String::from_utf8_lossy(&got).into_owned(),
                    Some(Instant::now()),
                )
            }
        }
    }
}

/// Wait for the server to exit, at most `limit`; its status and how long it took.
fn exit_within(s: &mut Server, limit: Duration) -> (Option<i32>, Duration) {
    let t0 = Instant::now();
    loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            return (st.code(), t0.elapsed());
        }
        assert!(
            t0.elapsed() < limit,
            "k3 serve still running {limit:?} after the signal"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(s: &Server, sig: &str) {
    let pid = s.child.id().to_string();
    assert!(std::process::Command::new("kill")
        .args([sig, &pid])
        .status()
        .unwrap()
        .success());
}

/// Wait for a line of the server's stderr containing `what`.
fn said(s: &Server, what: &str) {
    let end = Instant::now() + Duration::from_secs(30);
    while let Ok(line) = s
        .stderr
        .recv_timeout(end.saturating_duration_since(Instant::now()))
    {
        if line.contains(what) {
            return;
        }
    }
    panic!("k3 serve never said {what:?}");
}

#[test]
fn sigterm_ends_the_server_while_a_client_holds_a_half_sent_request() {
    // Timeouts far longer than the test: only the drain bound can end the process.
    let mut s = start(&["--client-timeout", "600", "--drain-timeout", "2"], &[]);
    let mut held = connect(&s, "GET /health HTTP/1.1\r\n");
    // The server has taken the connection once a complete request on another one is answered.
    assert_eq!(curl(&s, "/health", None, &[]).0, 200);
    signal(&s, "-TERM");
    let (code, took) = exit_within(&mut s, Duration::from_secs(30));
    assert_eq!(code, Some(0));
    assert!(took < Duration::from_secs(15), "exit took {took:?}");
    let (_, closed) = until_closed(&mut held, Duration::from_secs(5));
    assert!(closed.is_some(), "the held connection is closed at exit");
}

#[test]
fn a_second_signal_stops_the_drain_at_once() {
    let mut s = start(&["--drain-timeout", "600", "--max-tokens", "30000"], &[]);
    // A reply far longer than the test, in progress.
    let (mut client, _out) = long_stream(&s, 30_000);
    signal(&s, "-TERM");
    said(&s, "stopping");
    assert!(
        s.child.try_wait().unwrap().is_none(),
        "the first signal lets the reply in progress go on"
    );
    signal(&s, "-INT");
    let (code, took) = exit_within(&mut s, Duration::from_secs(30));
    assert_eq!(code, Some(128 + 2), "128 + SIGINT");
    assert!(took < Duration::from_secs(10), "exit took {took:?}");
    let _ = client.kill();
    let _ = client.wait();
}

#[test]
fn slow_and_idle_clients_are_dropped_after_the_timeout_and_connections_are_capped() {
    let cap = 8;
    let slow = 20;
    let s = start(
        &[
            "--client-timeout",
            "2",
            "--max-connections",
            &cap.to_string(),
        ],
        &[],
    );
    let t0 = Instant::now();
    let mut conns: Vec<TcpStream> = (0..slow)
        .map(|_| connect(&s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"))
        .collect();
    let mut refused = 0;
    let mut timed_out = 0;
    for c in &mut conns {
        let (got, closed) = until_closed(c, Duration::from_secs(20));
        let closed = closed.unwrap_or_else(|| panic!("a slow client was never dropped: {got:?}"));
        if got.starts_with("HTTP/1.1 503") {
            assert!(got.contains("connections open"), "{got}");
            refused += 1;
        } else {
            // Dropped by the header timeout, not before it.
            assert!(
                closed.duration_since(t0) >= Duration::from_millis(1500),
                "dropped after {:?}: {got:?}",
                closed.duration_since(t0)
            );
            timed_out += 1;
        }
    }
    assert_eq!((timed_out, refused), (cap, slow - cap));
    assert!(t0.elapsed() < Duration::from_secs(20));

    // The slots are free again.
    assert_eq!(curl(&s, "/health", None, &[]).0, 200);

    // A body that stops arriving is answered 408.
    let mut body = connect(
        &s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n\
         content-length: 100\r\n\r\n{\"prompt\":",
    );
    let (got, closed) = until_closed(&mut body, Duration::from_secs(20));
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(got.contains("did not arrive within 2 s"), "{got}");
    assert!(closed.is_some());

    // A kept-alive connection left idle after its answer is closed.
    let mut idle = connect(&s, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    let t1 = Instant::now();
    let (got, closed) = until_closed(&mut idle, Duration::from_secs(20));
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    let closed = closed.expect("an idle connection is closed");
    assert!(
        closed.duration_since(t1) >= Duration::from_millis(1500),
        "closed after {:?}",
        closed.duration_since(t1)
    );
}

#[test]
fn serve_refuses_bad_connection_limits() {
    for args in [
        ["--client-timeout", "0"],
        ["--max-connections", "0"],
        ["--drain-timeout", "4000"],
    ] {
        let out = crate::common::k3_command()
            .arg("serve")
            .args(args)
            .args(["--port", "0"])
            .env("XDG_CONFIG_HOME", "/nonexistent/k3-test-config")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(args[0]),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
