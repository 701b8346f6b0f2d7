//! `k3 chat --remote` as a user runs it: over HTTPS through a TLS front whose certificate a
//! private CA made here signs, and against hostile servers on loopback (an endless stream, a
//! line that never ends, a server that goes silent), each bounded in time and memory, with the
//! conversation kept in the journal.

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

/// A private CA and a certificate it signs for `localhost`: (CA PEM, leaf DER, leaf key DER).
fn private_ca() -> (String, Vec<u8>, Vec<u8>) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "k3 test CA");
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .signed_by(&leaf_key, &ca)
        .unwrap();
    (ca.pem(), leaf.der().to_vec(), leaf_key.serialize_der())
}

/// A TLS front on 127.0.0.1 that forwards each connection to `backend`; returns its port.
fn tls_front(backend: std::net::SocketAddr, cert: Vec<u8>, key: Vec<u8>) -> u16 {
    use tokio_rustls::rustls;
    // ring, the provider the client's TLS uses too (its post-quantum groups do not matter to a
    // test on loopback).
    #[allow(deprecated)]
    let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![rustls::pki_types::CertificateDer::from(cert)],
        rustls::pki_types::PrivateKeyDer::Pkcs8(key.into()),
    )
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let Ok(mut back) = tokio::net::TcpStream::connect(backend).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut back).await;
                });
            }
        });
    });
    port
}

/// `k3 chat --plain --jsonl --no-think` with `args` on `input`, in a fresh session directory
/// (returned with the output so a test can look at the journal).
fn chat(args: &[&str], input: &str, env: &[(&str, &str)]) -> (Output, tempfile::TempDir) {
    let tmp = tempfile::tempdir().unwrap();
    let mut cmd = crate::common::k3_command();
    cmd.args(["chat", "--plain", "--jsonl", "--no-think"])
        .arg("--session-dir")
        .arg(tmp.path().join("sessions"))
        .args(args)
        .env("XDG_CONFIG_HOME", tmp.path().join("no-config"))
        .env_remove("SSL_CERT_FILE")
        .env_remove("SSL_CERT_DIR")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    // A run refused before it reads its input closes the pipe: not an error here.
    let _ = child.stdin.take().unwrap().write_all(input.as_bytes());
    (child.wait_with_output().unwrap(), tmp)
}

fn jsonl(out: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn https_through_a_tls_front_with_a_private_ca() {
    let server = crate::serve::start(&[], &[]);
    let backend: std::net::SocketAddr = server.url.trim_start_matches("http://").parse().unwrap();
    let (ca_pem, cert, key) = private_ca();
    let port = tls_front(backend, cert, key);
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &ca_pem).unwrap();
    let url = format!("https://localhost:{port}");
    let input = "My name is Ada.\nWhat is my name?\n";

    let (plain, _t) = chat(&["--greedy", "--remote", &server.url], input, &[]);
    assert!(plain.status.success(), "{}", stderr(&plain));
    let (tls, _t) = chat(
        &[
            "--greedy",
            "--remote",
            &url,
            "--ca-cert",
            ca.to_str().unwrap(),
        ],
        input,
        &[],
    );
    assert!(tls.status.success(), "{}", stderr(&tls));
    let (a, b) = (jsonl(&plain), jsonl(&tls));
    assert_eq!(a.len(), 2);
    assert_eq!(b.len(), 2);
    for (p, t) in a.iter().zip(&b) {
        assert_eq!(p["reply"], t["reply"]);
        assert_eq!(p["generated_tokens"], t["generated_tokens"]);
        assert!(t["generated_tokens"].as_u64().unwrap() > 0, "{t}");
    }
    // The info line names the model the server lists, not a part of the URL.
    assert!(
        stderr(&tls).contains("model \"kimi-k3-local\""),
        "{}",
        stderr(&tls)
    );

    // SSL_CERT_FILE is honoured as OpenSSL honours it.
    let (env, _t) = chat(
        &["--greedy", "--remote", &url],
        "Hi\n",
        &[("SSL_CERT_FILE", ca.to_str().unwrap())],
    );
    assert!(env.status.success(), "{}", stderr(&env));
    assert_eq!(jsonl(&env).len(), 1);

    // Without the CA the server is refused, with a line that says what to do.
    let (refused, _t) = chat(&["--remote", &url], "Hi\n", &[]);
    assert_eq!(refused.status.code(), Some(1), "{}", stderr(&refused));
    assert!(
        stderr(&refused).contains("--ca-cert"),
        "{}",
        stderr(&refused)
    );
    // A CA file that holds no certificate is a usage error before anything starts.
    let bad = dir.path().join("bad.pem");
    std::fs::write(&bad, "not a certificate\n").unwrap();
    let (bad_out, _t) = chat(
        &["--remote", &url, "--ca-cert", bad.to_str().unwrap()],
        "Hi\n",
        &[],
    );
    assert_eq!(bad_out.status.code(), Some(2), "{}", stderr(&bad_out));
    assert!(
        stderr(&bad_out).contains("no PEM certificate"),
        "{}",
        stderr(&bad_out)
    );
}

/// A server on 127.0.0.1: each connection's request is read, then `answer(n, stream)` writes
/// (`n` counts the chat requests from 0). `/v1/models` is answered with one model. Every answer
/// says `connection: close`, as a server that closes after one request must: without it the
/// client may send its next request on the pooled connection the server just closed.
fn fake_server(answer: impl Fn(usize, TcpStream) + Send + Sync + 'static) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let answer = std::sync::Arc::new(answer);
    std::thread::spawn(move || {
        let mut n = 0;
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            let mut head = String::new();
            let mut length = 0usize;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
                head.push_str(&line);
                if line == "\r\n" {
                    break;
                }
            }
            let mut body = vec![0; length];
            let _ = reader.read_exact(&mut body);
            let mut conn = conn;
            if head.starts_with("GET /v1/models") {
                let body = r#"{"object":"list","data":[{"id":"hostile","object":"model"}]}"#;
                let _ = write!(
                    conn,
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                continue;
            }
            let answer = std::sync::Arc::clone(&answer);
            let k = n;
            n += 1;
            std::thread::spawn(move || answer(k, conn));
        }
    });
    url
}

const SSE_HEAD: &str =
    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";

fn chunk(text: &str) -> String {
    format!(
        "data: {}\n\n",
        serde_json::json!({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]})
    )
}

/// A short, proper reply.
fn proper(mut c: TcpStream) {
    let end = serde_json::json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                                 "usage": {"prompt_tokens": 5, "completion_tokens": 1}});
    let _ = write!(
        c,
        "{SSE_HEAD}{}data: {end}\n\ndata: [DONE]\n\n",
        chunk("fine")
    );
}

#[test]
fn an_endless_stream_stops_at_max_tokens_in_bounded_memory() {
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counter = std::sync::Arc::clone(&sent);
    // "Endless" to the client: five million pieces (about 100 MB) without a finish_reason, then
    // a close. A client that did not stop at max_tokens would take them all into its reply.
    let url = fake_server(move |_, mut c| {
        let _ = c.write_all(SSE_HEAD.as_bytes());
        let piece = chunk("x");
        for _ in 0..5_000_000 {
            if c.write_all(piece.as_bytes()).is_err() {
                return;
            }
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });
    let (out, _t) = chat(&["--remote", &url, "--max-tokens", "50"], "hello\n", &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let lines = jsonl(&out);
    assert_eq!(lines.len(), 1, "{}", stderr(&out));
    // Exactly max_tokens pieces are taken, the reply is not added to the history.
    assert_eq!(lines[0]["reply"], "x".repeat(50));
    assert_eq!(lines[0]["generated_tokens"], 50);
    assert_eq!(lines[0]["stop"], "MaxTokens");
    let peak = lines[0]["peak_rss_bytes"].as_u64().unwrap();
    assert!(peak < 100_000_000, "peak RSS {peak}");
    // The client hung up rather than draining the stream.
    let sent = sent.load(std::sync::atomic::Ordering::Relaxed);
    assert!(sent < 5_000_000, "the server wrote all {sent} pieces");
}

#[test]
fn a_line_that_never_ends_is_refused_at_the_cap() {
    let url = fake_server(|n, mut c| {
        if n > 0 {
            return proper(c);
        }
        // 200 MB of one line, sent until the client hangs up.
        let _ = c.write_all(format!("{SSE_HEAD}data: ").as_bytes());
        let block = vec![b'x'; 64 << 10];
        for _ in 0..(200_000_000 / block.len()) {
            if c.write_all(&block).is_err() {
                return;
            }
        }
    });
    let (out, _t) = chat(&["--remote", &url, "--model", "m"], "hello\nagain\n", &[]);
    let err = stderr(&out);
    assert!(err.contains("a line of more than 1048576 bytes"), "{err}");
    // The next turn is answered; the process held a bounded amount of memory meanwhile.
    let lines = jsonl(&out);
    assert_eq!(lines.len(), 1, "{err}");
    assert_eq!(lines[0]["reply"], "fine");
    let peak = lines[0]["peak_rss_bytes"].as_u64().unwrap();
    assert!(peak < 100_000_000, "peak RSS {peak}");
    // A script learns that a turn failed.
    assert_eq!(out.status.code(), Some(1), "{err}");
}

#[test]
fn a_silent_server_times_out_and_the_conversation_is_journaled() {
    let url = fake_server(|n, mut c| match n {
        0 => proper(c),
        // Takes the request, never answers.
        1 => std::thread::sleep(Duration::from_secs(30)),
        // Starts the reply, then goes silent.
        _ => {
            let _ = write!(c, "{SSE_HEAD}{}", chunk("par"));
            std::thread::sleep(Duration::from_secs(30));
        }
    });
    let t0 = Instant::now();
    let (out, tmp) = chat(
        &["--remote", &url, "--read-timeout", "1"],
        "first question\nsecond\nthird\n",
        &[],
    );
    let err = stderr(&out);
    assert!(t0.elapsed() < Duration::from_secs(20), "{err}");
    assert!(
        err.contains("sent no answer within 1 s (--read-timeout"),
        "{err}"
    );
    assert!(
        err.contains("sent nothing for 1 s in the middle of the reply"),
        "{err}"
    );
    assert_eq!(out.status.code(), Some(1), "{err}");
    // The answered turn is in the journal, and --resume recovers it.
    let journals: Vec<_> = std::fs::read_dir(tmp.path().join("sessions"))
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".k3remote-journal"))
        .collect();
    assert_eq!(journals.len(), 1, "{journals:?}");
    let name = journals[0].trim_end_matches(".k3remote-journal");
    assert!(name.starts_with("first-question-"), "{name}");
    assert!(err.contains("NOT saved; its turns are kept in"), "{err}");
    let export = tmp.path().join("out.json");
    let mut cmd = crate::common::k3_command();
    let resumed = cmd
        .args(["chat", "--plain", "--remote", &url, "--resume", name])
        .arg("--session-dir")
        .arg(tmp.path().join("sessions"))
        .env("XDG_CONFIG_HOME", tmp.path().join("no-config"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut resumed = resumed;
    writeln!(
        resumed.stdin.take().unwrap(),
        "/export json {}",
        export.display()
    )
    .unwrap();
    let r = resumed.wait_with_output().unwrap();
    assert!(
        stderr(&r).contains("recovered unsaved changes"),
        "{}",
        stderr(&r)
    );
    let saved: Value = serde_json::from_slice(&std::fs::read(&export).unwrap()).unwrap();
    let entries = saved["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 2, "{saved}");
    assert_eq!(entries[0]["content"], "first question");
    assert_eq!(entries[1]["content"], "fine");
    // A bad timeout is a usage error.
    let (bad, _t) = chat(&["--remote", &url, "--read-timeout", "0"], "", &[]);
    assert_eq!(bad.status.code(), Some(2));
}
