//! `k3 run --prompts FILE`: prompts decoded several at a time give each prompt the ids and
//! text `k3 run` gives it alone, in input order; bad lines are refused naming their line.

use crate::common::{fixture, k3_command, run_ok};
use std::io::Write;

fn tiny() -> String {
    fixture("tiny").to_str().unwrap().to_string()
}

fn prompts_file(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f
}

/// The lines of a `--prompts` file and, for each prompt, the `k3 run` flags that run it alone.
fn cases() -> (String, Vec<Vec<String>>) {
    let lines: Vec<(&str, Vec<&str>)> = vec![
        ("The cat sat on", vec!["--prompt", "The cat sat on"]),
        ("", vec![]),
        (
            r#"{"ids": [256, 3, 17, 42], "max_tokens": 5}"#,
            vec!["--ids", "256,3,17,42", "--gen", "5"],
        ),
        (
            r#"{"prompt": "Once upon a time", "temperature": 0.9, "seed": 7, "top_k": 20}"#,
            vec![
                "--prompt",
                "Once upon a time",
                "--temperature",
                "0.9",
                "--seed",
                "7",
                "--top-k",
                "20",
            ],
        ),
        (
            r#"{"ids": [5], "max_tokens": 11, "temperature": 1.2, "seed": 3}"#,
            vec![
                "--ids",
                "5",
                "--gen",
                "11",
                "--temperature",
                "1.2",
                "--seed",
                "3",
            ],
        ),
        ("hello world, hello", vec!["--prompt", "hello world, hello"]),
        (
            r#"{"ids": [9, 8, 7, 6, 5, 4, 3], "max_tokens": 2}"#,
            vec!["--ids", "9,8,7,6,5,4,3", "--gen", "2"],
        ),
        (
            r#"{"prompt": "a b c", "max_tokens": 0}"#,
            vec!["--prompt", "a b c", "--gen", "0"],
        ),
    ];
    let text = lines.iter().map(|(l, _)| *l).collect::<Vec<_>>().join("\n");
    let alone = lines
        .into_iter()
        .filter(|(_, a)| !a.is_empty())
        .map(|(_, a)| a.into_iter().map(String::from).collect())
        .collect();
    (text, alone)
}

#[test]
fn k3_run_prompts_gives_each_prompt_its_lone_ids_in_input_order() {
    let (text, alone) = cases();
    let want: Vec<serde_json::Value> = alone
        .iter()
        .map(|flags| {
            let mut cmd = k3_command();
            cmd.args(["run", &tiny(), "--json"]).args(flags);
            if !flags.iter().any(|f| f == "--gen") {
                cmd.args(["--gen", "9"]);
            }
            let out = run_ok(&mut cmd);
            serde_json::from_slice(&out.stdout).unwrap()
        })
        .collect();
    let file = prompts_file(&text);
    // A budget just above the floor for 8 sequences (the refusal of a smaller one names it):
    // the layers and experts stream.
    let refused = k3_command()
        .args([
            "run",
            &tiny(),
            "--gen",
            "9",
            "--parallel",
            "8",
            "--mem",
            "0.001",
            "--prompts",
        ])
        .arg(file.path())
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    let err = String::from_utf8_lossy(&refused.stderr);
    let floor_mb: f64 = err
        .split("give at least ")
        .nth(1)
        .and_then(|r| r.split(" MB").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{err}"));
    let streamed = format!("{:.4}", (floor_mb + 0.6) / 1000.0);
    for extra in [
        &["--parallel", "3"][..],
        &["--parallel", "1"],
        &["--parallel", "8", "--mem", &streamed],
    ] {
        let out = k3_command()
            .args(["run", &tiny(), "--gen", "9", "--prompts"])
            .arg(file.path())
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{extra:?}: {err}");
        let got: Vec<serde_json::Value> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(got.len(), want.len(), "{extra:?}: one line per prompt");
        let lines: Vec<u64> = got.iter().map(|g| g["line"].as_u64().unwrap()).collect();
        assert_eq!(
            lines,
            [1, 3, 4, 5, 6, 7, 8],
            "{extra:?}: input order, blank line skipped"
        );
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(
                g["generated_ids"], w["generated_ids"],
                "{extra:?}: {g} vs {w}"
            );
            assert_eq!(g["text"], w["text"], "{extra:?}");
            assert_eq!(
                g["prompt_tokens"].as_u64().unwrap() as usize,
                w["prompt_ids"].as_array().unwrap().len()
            );
            let n = g["generated_ids"].as_array().unwrap().len();
            assert_eq!(g["generated_tokens"].as_u64().unwrap() as usize, n);
        }
        assert!(err.contains("batched step"), "{extra:?}: {err}");
        let read_mb: f64 = err
            .split("; ")
            .find_map(|p| p.strip_suffix(" MB read per generated token\n"))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{err}"));
        assert_eq!(read_mb > 0.0, extra.contains(&"--mem"), "{extra:?}: {err}");
    }
}

#[test]
fn bad_prompt_lines_are_refused_naming_the_line() {
    let cases: [(&str, &str); 7] = [
        (
            "good\n{\"ids\": [1, 2]\n",
            "line 2: not a valid prompt object",
        ),
        (
            "{\"ids\": [1], \"tempreature\": 1}",
            "line 1: not a valid prompt object",
        ),
        (
            "a\nb\n\n{\"ids\": [1, 99999]}",
            "line 4: token id 99999 is outside the vocabulary",
        ),
        (
            "{\"ids\": [1], \"prompt\": \"x\"}",
            "line 1: give \"prompt\" or \"ids\", not both",
        ),
        ("x\n{\"max_tokens\": 3}", "line 2: no \"prompt\" or \"ids\""),
        ("{\"ids\": [1], \"temperature\": -1}", "line 1: temperature"),
        ("\n\n", "holds no prompt"),
    ];
    for (text, want) in cases {
        let file = prompts_file(text);
        let out = k3_command()
            .args(["run", &tiny(), "--prompts"])
            .arg(file.path())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text:?}: {err}");
        assert!(err.contains(want), "{text:?}: {err}");
        assert!(out.stdout.is_empty(), "{text:?}: nothing decoded");
    }
    let file = prompts_file("{\"ids\": [1], \"max_tokens\": 100}");
    let out = k3_command()
        .args(["run", &tiny(), "--context", "50", "--prompts"])
        .arg(file.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("line 1") && err.contains("exceed --context 50"),
        "{err}"
    );
    // Past the 64 rows whose activations the plan reserves, --parallel is refused.
    for flags in [
        &["--parallel", "0"][..],
        &["--parallel", "65"],
        &["--dump-logits", "/dev/null"],
    ] {
        let out = k3_command()
            .args(["run", &tiny(), "--prompts"])
            .arg(file.path())
            .args(flags)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{flags:?}");
    }
    // --parallel belongs to --prompts.
    let out = k3_command()
        .args(["run", &tiny(), "--ids", "1", "--parallel", "2"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}
