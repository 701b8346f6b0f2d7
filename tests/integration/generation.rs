//! The model directory's `generation_config.json`: its settings sit between the user config
//! file and the built-in defaults for `k3 chat` and `k3 run`, the start-up line and `/stats`
//! say where each value came from, and a malformed file is refused naming its key.

use std::path::Path;

/// Run `k3 ARGS` with `input` on stdin and the user config file `config`; (exit code, stdout
/// and stderr together).
fn k3(args: &[&str], input: &str, config: &Path, data: &Path) -> (i32, String) {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = crate::common::k3_command()
        .args(args)
        .env("K3_CONFIG", config)
        .env("K3_DATA_DIR", data)
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
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!text.contains("panicked"), "panic: {text}");
    (out.status.code().unwrap_or(-1), text)
}

/// The `sampling:` line of `k3 chat`'s start-up output.
fn sampling_line(text: &str) -> &str {
    text.lines()
        .find(|l| l.starts_with("sampling: "))
        .unwrap_or_else(|| panic!("no sampling line in {text}"))
}

#[test]
fn each_level_overrides_the_one_below_and_the_start_up_line_says_which() {
    let (_t, model) = crate::bad_inputs::copy_tiny();
    let m = model.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let no_config = dir.path().join("none.toml");
    let config = dir.path().join("config.toml");
    std::fs::write(&config, "[sampling]\ntop_p = 0.8\ntop_k = 30\n").unwrap();
    let chat = |config: &Path, flags: &[&str], input: &str| {
        let mut args = vec!["chat", m, "--plain", "--no-think"];
        args.extend_from_slice(flags);
        let (code, text) = k3(&args, input, config, &data);
        assert_eq!(code, 0, "{text}");
        text
    };

    // Built-in alone.
    let text = chat(&no_config, &[], "");
    let line = sampling_line(&text);
    for part in [
        "temperature 1 (built-in)",
        "top_k 0 (built-in)",
        "top_p 1 (built-in)",
        "seed 1 (built-in)",
        "max_tokens 512 (built-in)",
    ] {
        assert!(line.contains(part), "{part}: {line}");
    }

    // generation_config.json over the built-in.
    std::fs::write(
        model.join("generation_config.json"),
        r#"{"temperature": 0.5, "top_p": 0.9, "top_k": 40, "max_new_tokens": 33,
            "eos_token_id": [1, 2], "custom_knob": 3}"#,
    )
    .unwrap();
    let text = chat(&no_config, &[], "");
    let line = sampling_line(&text);
    for part in [
        "temperature 0.5 (generation_config.json)",
        "top_k 40 (generation_config.json)",
        "top_p 0.9 (generation_config.json)",
        "max_tokens 33 (generation_config.json)",
        "seed 1 (built-in)",
    ] {
        assert!(line.contains(part), "{part}: {line}");
    }
    // The key k3 does not use is named, once.
    assert!(
        text.contains("ignored key(s) k3 does not use: \"custom_knob\""),
        "{text}"
    );

    // The user config file over generation_config.json.
    let text = chat(&config, &[], "");
    let line = sampling_line(&text);
    for part in [
        "temperature 0.5 (generation_config.json)",
        "top_k 30 (config file)",
        "top_p 0.8 (config file)",
    ] {
        assert!(line.contains(part), "{part}: {line}");
    }

    // A flag over the config file; /set over everything, and /stats says so.
    let text = chat(
        &config,
        &["--top-k", "3", "--seed", "9"],
        "/set temperature 0.25\n/stats\n",
    );
    let line = sampling_line(&text);
    for part in [
        "temperature 0.5 (generation_config.json)",
        "top_k 3 (flag)",
        "top_p 0.8 (config file)",
        "seed 9 (flag)",
    ] {
        assert!(line.contains(part), "{part}: {line}");
    }
    let stats = text
        .lines()
        .filter(|l| l.starts_with("sampling: "))
        .nth(1)
        .unwrap_or_else(|| panic!("/stats has no sampling line: {text}"));
    assert!(stats.contains("temperature 0.25 (/set)"), "{stats}");
    assert!(stats.contains("top_k 3 (flag)"), "{stats}");

    // k3 run: the same order over its own built-in, greedy decoding.
    let run = |config: &Path, flags: &[&str]| {
        let mut args = vec!["run", m, "--ids", "1,2,3", "--gen", "2", "--json"];
        args.extend_from_slice(flags);
        let (code, text) = k3(&args, "", config, &data);
        assert_eq!(code, 0, "{text}");
        let j: serde_json::Value = serde_json::from_str(
            text.lines()
                .find(|l| l.starts_with('{'))
                .unwrap_or_else(|| panic!("{text}")),
        )
        .unwrap();
        j["sampling"].as_str().unwrap().to_string()
    };
    let line = run(&config, &["--temperature", "0"]);
    assert!(line.contains("temperature 0 (flag)"), "{line}");
    assert!(line.contains("top_p 0.8 (config file)"), "{line}");
    assert!(!line.contains("max_tokens"), "{line}");
    std::fs::remove_file(model.join("generation_config.json")).unwrap();
    let line = run(&no_config, &[]);
    assert!(line.contains("temperature 0 (built-in)"), "{line}");
}

#[test]
fn a_malformed_generation_config_is_refused_naming_its_key() {
    let (_t, model) = crate::bad_inputs::copy_tiny();
    let m = model.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let no_config = dir.path().join("none.toml");
    let file = model.join("generation_config.json");
    let cases: [(&[u8], &str); 5] = [
        (
            br#"{"temperature": "hot"}"#,
            "generation_config.json: temperature: expected a number, found a string",
        ),
        (
            br#"{"top_p": 1.5}"#,
            "generation_config.json: top_p: 1.5 is not in (0, 1]",
        ),
        (
            br#"{"max_new_tokens": 0}"#,
            "generation_config.json: max_new_tokens: 0 is not a whole number",
        ),
        (b"[0.7]", "generation_config.json: not a JSON object"),
        (
            b"{\"temperature\": 0.7",
            "generation_config.json: not a JSON object",
        ),
    ];
    for (bytes, want) in cases {
        std::fs::write(&file, bytes).unwrap();
        for args in [
            &["chat", m, "--plain"][..],
            &["run", m, "--ids", "1,2", "--gen", "1"][..],
            &["serve", m, "--port", "0"][..],
        ] {
            let (code, text) = k3(args, "", &no_config, &data);
            assert_eq!(code, 3, "{args:?} {want}: {text}");
            assert!(text.contains(want), "{args:?} {want}: {text}");
        }
    }
    // Not a regular file.
    std::fs::remove_file(&file).unwrap();
    std::fs::create_dir(&file).unwrap();
    let (code, text) = k3(&["chat", m, "--plain"], "", &no_config, &data);
    assert_eq!(code, 3, "{text}");
    assert!(
        text.contains("generation_config.json: not a regular file"),
        "{text}"
    );
}
