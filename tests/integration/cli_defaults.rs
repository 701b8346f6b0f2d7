//! Small command-line behaviours: `k3 plan` and `k3 bench` default to the demo model as `k3 run`
//! and `k3 chat` do; counts of one read in the singular.

use crate::common::{demo_model, k3_command};

/// `k3 ARGS` with the demo model cached under `cache`: (exit code, stdout, stderr).
fn k3(args: &[&str], cache: &std::path::Path) -> (i32, String, String) {
    let out = k3_command()
        .args(args)
        .env("K3_CACHE_DIR", cache)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn plan_and_bench_default_to_the_demo_model() {
    let cache = tempfile::tempdir().unwrap();
    let demo = demo_model().to_str().unwrap();
    let (code, implicit, err) = k3(&["plan", "--mem", "1", "--json"], cache.path());
    assert_eq!(code, 0, "{implicit}{err}");
    let (code, explicit, err) = k3(&["plan", demo, "--mem", "1", "--json"], cache.path());
    assert_eq!(code, 0, "{explicit}{err}");
    let a: serde_json::Value = serde_json::from_str(&implicit).unwrap();
    let b: serde_json::Value = serde_json::from_str(&explicit).unwrap();
    for key in ["model_bytes", "budget_bytes", "floor_bytes", "fits"] {
        assert_eq!(a[key], b[key], "{key}: {a} / {b}");
    }
    let (code, out, err) = k3(
        &["bench", "--gen", "2", "--prompt-len", "2", "--json"],
        cache.path(),
    );
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim().lines().last().unwrap()).unwrap();
    assert!(v.is_object(), "{out}");
}

#[test]
fn a_one_token_prompt_reads_in_the_singular() {
    let cache = tempfile::tempdir().unwrap();
    let demo = demo_model().to_str().unwrap();
    let (code, _, err) = k3(
        &["run", demo, "--ids", "5", "--gen", "4", "--context", "4"],
        cache.path(),
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("the prompt is 1 token and --gen is 4: 5 positions exceed --context 4"),
        "{err}"
    );
    let (code, _, err) = k3(
        &["run", demo, "--ids", "5,6", "--gen", "4", "--context", "4"],
        cache.path(),
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("the prompt is 2 tokens and --gen is 4"),
        "{err}"
    );
}

/// On a terminal, `k3 run`'s summary (on stderr) starts a line of its own after the text it
/// generated (on stdout), which need not end with a newline: run under `script`, whose
/// pseudo-terminal carries both streams as a user sees them.
#[test]
fn the_run_summary_starts_its_own_line_on_a_terminal() {
    let cache = tempfile::tempdir().unwrap();
    let demo = demo_model().to_str().unwrap().to_string();
    let cmd = format!(
        "{} run {demo} --ids 5,6 --gen 6 --context 16",
        env!("CARGO_BIN_EXE_k3")
    );
    let out = std::process::Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .env("K3_CACHE_DIR", cache.path())
        .output()
        .expect("util-linux `script` runs the command on a pseudo-terminal");
    assert!(out.status.success(), "{:?}", out);
    let seen = String::from_utf8_lossy(&out.stdout);
    let at = seen.find("k3: loaded in").expect("the summary is shown");
    assert!(at > 0, "{seen:?}");
    // Everything the run says on stderr starts a line.
    for (i, _) in seen.match_indices("k3: ") {
        let before = seen[..i].chars().last();
        assert!(
            matches!(before, None | Some('\n' | '\r')),
            "a message glued to the text before it: {seen:?}"
        );
    }
}
