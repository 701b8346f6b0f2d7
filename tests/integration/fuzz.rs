//! A short bounded run of every fuzz target (`k3-fuzz`), from the committed seed corpus: no
//! panic, and no input allocating more than the harness's bound.

#[test]
fn every_fuzz_target_runs_clean_for_a_bounded_number_of_inputs() {
    let crashes = tempfile::tempdir().unwrap();
    let list = std::process::Command::new(env!("CARGO_BIN_EXE_k3-fuzz"))
        .arg("list")
        .output()
        .unwrap();
    let names: Vec<String> = String::from_utf8_lossy(&list.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect();
    for want in [
        "st_header",
        "st_index_json",
        "config_json",
        "trunk_manifest",
        "trunk_blocks",
        "session_decode",
        "tiktoken_ranks",
        "user_toml",
        "generation_config",
        "sse_stream",
        "serve_request",
        "journal",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} in {names:?}");
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_k3-fuzz"))
        .args([
            "all",
            "--execs",
            "30000",
            "--seed",
            "7",
            "--max-alloc-mb",
            "64",
        ])
        .arg("--crashes")
        .arg(crashes.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}\n{err}");
    for n in &names {
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("k3-fuzz {n}: 30000 execs"))
                    && l.contains("0 crashes")),
            "{n}: {text}"
        );
    }
    assert_eq!(std::fs::read_dir(crashes.path()).unwrap().count(), 0);
}

#[test]
fn the_harness_refuses_an_empty_corpus_and_replays_inputs() {
    // The harness itself: a seed folder with nothing in it is refused, and replaying a seed
    // prints its outcome.
    let empty = tempfile::tempdir().unwrap();
    std::fs::create_dir(empty.path().join("journal")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_k3-fuzz"))
        .args(["journal", "--execs", "10", "--corpus"])
        .arg(empty.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no seed files"));
    let seed = crate::common::fixture("../fuzz/corpus/journal/one_turn.k3journal");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_k3-fuzz"))
        .args(["journal", "--replay"])
        .arg(&seed)
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains(": ok:"));
    // An input that allocates past the bound (here 0 bytes) is a crash, written out.
    let crashes = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_k3-fuzz"))
        .args([
            "config_json",
            "--execs",
            "10",
            "--max-alloc-mb",
            "0",
            "--crashes",
        ])
        .arg(crashes.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("above the bound of 0 bytes"), "{err}");
    assert_eq!(std::fs::read_dir(crashes.path()).unwrap().count(), 1);
}
