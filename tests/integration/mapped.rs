//! Resident weights mapped from the shards (`K3_MMAP=1`): the same logits as weights read
//! into memory, the shard really mapped, and a shard truncated while mapped is an error exit
//! with a message, never a crash.

use crate::common::{argmax, fixture, json, k3_command, u32s};
use k3::engine::model::Logits;
use k3::engine::weights::OpenOptions;
use k3::engine::{Model, SeqState};
use std::io::{BufRead, Write};

fn greedy_logits(m: &Model, prompt: &[u32], n: usize) -> Vec<Vec<u32>> {
    let mut st = SeqState::new(&m.cfg);
    let mut logits = m.forward(&mut st, prompt, Logits::Last).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(logits.iter().map(|v| v.to_bits()).collect());
        let next = argmax(&logits);
        logits = m.forward(&mut st, &[next], Logits::Last).unwrap();
    }
    out
}

/// The lines of /proc/self/maps that name a file under `dir`.
fn maps_under(dir: &std::path::Path) -> usize {
    let dir = dir.canonicalize().unwrap();
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains(dir.to_str().unwrap()) && l.contains(".safetensors"))
        .count()
}

#[test]
fn mapped_weights_give_the_same_logits_as_read_ones() {
    for set in ["tiny", "tiny2"] {
        let o = json(&format!("{set}/oracle.json"));
        let prompt = u32s(&o["prompt_ids"]);
        let dir = fixture(set);
        let open = |mapped: bool| {
            Model::open_with(
                &dir,
                &OpenOptions {
                    mapped,
                    ..OpenOptions::default()
                },
            )
            .unwrap()
            .0
        };
        let read = open(false);
        let want = greedy_logits(&read, &prompt, 8);
        drop(read);
        let before = maps_under(&dir);
        let mapped = open(true);
        assert!(
            maps_under(&dir) > before,
            "{set}: no shard of {} is mapped",
            dir.display()
        );
        assert_eq!(greedy_logits(&mapped, &prompt, 8), want, "{set}");
        drop(mapped);
        assert_eq!(
            maps_under(&dir),
            before,
            "{set}: the mapping outlived the model"
        );
    }
    // The binary on a larger checkpoint: same ids and dumped logits either way.
    let small = crate::streaming::small().join("small");
    let run = |mapped: &str| {
        let dump = tempfile::NamedTempFile::new().unwrap();
        let out = crate::common::run_ok(
            k3_command()
                .arg("run")
                .arg(&small)
                .args(["--ids", "1,2,3,4,5,6,7,8", "--gen", "4", "--json"])
                .arg("--dump-logits")
                .arg(dump.path())
                .env("K3_MMAP", mapped),
        );
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (
            j["generated_ids"].clone(),
            std::fs::read(dump.path()).unwrap(),
        )
    };
    assert!(run("1") == run("0"), "small: mapped and read runs differ");
}

#[test]
fn a_shard_truncated_while_mapped_stops_with_exit_3_and_a_message() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = k3::app::demo::materialise_in(tmp.path()).unwrap();
    let mut child = k3_command()
        .args([
            "chat",
            "--plain",
            "--jsonl",
            "--greedy",
            "--no-think",
            "--max-tokens",
            "4",
        ])
        .arg(&dir)
        .arg("--session-dir")
        .arg(tmp.path().join("sessions"))
        .env("K3_MMAP", "1")
        .env("K3_CACHE_DIR", tmp.path().join("cache"))
        .env("XDG_CONFIG_HOME", tmp.path().join("no-config"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    writeln!(stdin, "hello").unwrap();
    // The first turn runs on the mapped weights.
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    let turn: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert!(
        turn["generated_ids"]
            .as_array()
            .is_some_and(|g| !g.is_empty()),
        "{line}"
    );
    // Another process cuts the first shard (layer weights, mapped) short; the next turn
    // touches pages past its new end. (Embedding rows are read per turn, not mapped: a
    // truncated embedding is a read error, tested elsewhere.)
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("model-00001-of-000002.safetensors"))
        .unwrap()
        .set_len(4096)
        .unwrap();
    writeln!(stdin, "and again").unwrap();
    drop(stdin);
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut stdout, &mut rest);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "stderr: {stderr}");
    assert!(
        stderr.contains("mapped model file shrank"),
        "no message naming the problem: {stderr}"
    );
}
