//! Helpers shared by the integration tests.

use std::path::PathBuf;

/// Path of a fixture under `tests/fixtures`.
pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// Read and parse a JSON fixture.
pub fn json(rel: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixture(rel)).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A JSON array of numbers as u32.
pub fn u32s(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A JSON array of float32 bit patterns as f32.
pub fn f32_bits(v: &serde_json::Value) -> Vec<f32> {
    u32s(v).into_iter().map(f32::from_bits).collect()
}

/// `max|got − want| / max|want|`.
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num = got
        .iter()
        .zip(want)
        .map(|(a, b)| f64::from((a - b).abs()))
        .fold(0.0, f64::max);
    let den = want.iter().map(|b| f64::from(b.abs())).fold(0.0, f64::max);
    num / den
}

/// Index of the first maximum.
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// A command running the `k3` binary.
pub fn k3_command() -> std::process::Command {
    std::process::Command::new(env!("CARGO_BIN_EXE_k3"))
}

/// Run `cmd` and assert it succeeded (stderr in the message); its output.
pub fn run_ok(cmd: &mut std::process::Command) -> std::process::Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Run `cmd` with `input` on stdin and assert it succeeded; each stdout line parsed as JSON
/// (`k3 chat --jsonl`).
pub fn jsonl_with_input(cmd: &mut std::process::Command, input: &str) -> Vec<serde_json::Value> {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A scratch directory, `NAME-PID` under the target directory, for data that the tests of this
/// process share through a static (which is never dropped). Directories of the same name left
/// by processes that are gone are removed first, so at most one copy per live run remains.
pub fn process_scratch(name: &str) -> PathBuf {
    let root = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let pid = std::process::id();
    let prefix = format!("{name}-");
    if let Ok(entries) = std::fs::read_dir(root) {
        for e in entries.flatten() {
            let file = e.file_name();
            let other = file
                .to_str()
                .and_then(|n| n.strip_prefix(&prefix))
                .and_then(|p| p.parse::<u32>().ok());
            if let Some(other) = other {
                if other != pid && !std::path::Path::new(&format!("/proc/{other}")).exists() {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    }
    let dir = root.join(format!("{name}-{pid}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The embedded demo model, materialised once into a scratch directory (its replies end with
/// an end id, so a conversation on it has accepted replies as well as replies cut off).
pub fn demo_model() -> &'static std::path::Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let scratch = process_scratch("demo-chat");
        k3::app::demo::materialise_in(&scratch).unwrap()
    })
}

/// `cpu_steal_fraction` is a fraction of the machine's CPU time; it is null only where
/// `/proc/stat` is not there, or where decoding ended within about one clock tick (10 ms), too
/// soon for the counters to move.
pub fn assert_steal_is_a_fraction(j: &serde_json::Value) {
    let steal = &j["cpu_steal_fraction"];
    if let Some(f) = steal.as_f64() {
        assert!((0.0..=1.0).contains(&f), "cpu_steal_fraction: {steal}");
        return;
    }
    assert!(steal.is_null(), "cpu_steal_fraction: {steal}");
    let decoding = j["decode_seconds_per_token"].as_f64().unwrap_or(0.0)
        * j["generated_ids"].as_array().map_or(0, Vec::len) as f64;
    assert!(
        !std::path::Path::new("/proc/stat").exists() || decoding < 0.05,
        "no cpu_steal_fraction after {decoding} s of decoding"
    );
}
