//! `config.json` acceptance and refusal (docs/model.md#configjson).

use crate::common::fixture;
use k3::engine::config::{ConfigError, ModelConfig};

fn problems(path: &std::path::Path) -> Vec<String> {
    match ModelConfig::load(path) {
        Err(ConfigError::Invalid { problems, .. }) => problems,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn released_nested_shape_loads_with_the_one_based_map() {
    let c = ModelConfig::load(&fixture("tiny/config.json")).unwrap();
    let mla: Vec<usize> = (0..c.num_hidden_layers).filter(|&l| c.is_mla[l]).collect();
    assert_eq!(mla, vec![3, 7, 11, 12]);
    assert_eq!(c.kda_num_heads, 4);
    assert_eq!(c.kda_head_dim, 16);
    assert_eq!(c.situ_beta, 4.0);
    assert_eq!(c.situ_linear_beta, 25.0);
    assert_eq!(c.mla_lora_norm_eps, 1e-6);
}

#[test]
fn flat_fixture_shape_loads_with_aliases() {
    let text = std::fs::read_to_string(fixture("ops/MANIFEST.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let c = ModelConfig::parse(
        &v["config"].to_string(),
        std::path::Path::new("MANIFEST.json"),
    )
    .unwrap();
    assert_eq!(c.kda_num_heads, 4);
    assert_eq!(c.moe_intermediate_size, 48);
    assert_eq!(c.situ_beta, 4.0);
}

#[test]
fn peer_refusal_fixtures_are_refused() {
    let p = problems(&fixture("ops/cfg/no_layermap.json"));
    assert!(p.iter().any(|m| m.contains("full_attn_layers")), "{p:?}");
    let p = problems(&fixture("ops/cfg/bad_layer_index.json"));
    assert!(p.iter().any(|m| m.contains("999")), "{p:?}");
    let p = problems(&fixture("ops/cfg/bad_topk.json"));
    assert!(
        p.iter().any(|m| m.contains("num_experts_per_token")),
        "{p:?}"
    );
}

fn tiny_with(edit: impl FnOnce(&mut serde_json::Value)) -> Result<ModelConfig, ConfigError> {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("tiny/config.json")).unwrap())
            .unwrap();
    edit(&mut v);
    ModelConfig::parse(&v.to_string(), std::path::Path::new("config.json"))
}

/// One edit of the tiny config.
type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;

#[test]
fn contradictions_and_unsupported_semantics_are_refused() {
    let cases: Vec<(&str, Edit)> = vec![
        (
            "kda_layers",
            Box::new(|v| {
                v["text_config"]["linear_attn_config"]["kda_layers"] = serde_json::json!([1, 2])
            }),
        ),
        (
            "gate_lower_bound",
            Box::new(|v| {
                v["text_config"]["linear_attn_config"]["gate_lower_bound"] = serde_json::Value::Null
            }),
        ),
        (
            "mla_use_nope",
            Box::new(|v| v["text_config"]["mla_use_nope"] = serde_json::json!(false)),
        ),
        (
            "hidden_act",
            Box::new(|v| v["text_config"]["hidden_act"] = serde_json::json!("silu")),
        ),
        (
            "tie_word_embeddings",
            Box::new(|v| v["text_config"]["tie_word_embeddings"] = serde_json::json!(true)),
        ),
        (
            "group_size",
            Box::new(|v| {
                v["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]
                    ["group_size"] = serde_json::json!(16)
            }),
        ),
        (
            "num_key_value_heads",
            Box::new(|v| v["text_config"]["num_key_value_heads"] = serde_json::json!(2)),
        ),
        (
            "attn_res_block_size",
            Box::new(|v| v["text_config"]["attn_res_block_size"] = serde_json::json!(0)),
        ),
        (
            "covers every layer",
            Box::new(|v| {
                v["text_config"]["linear_attn_config"]["full_attn_layers"] =
                    serde_json::json!((1..=13).collect::<Vec<_>>())
            }),
        ),
    ];
    for (needle, edit) in cases {
        match tiny_with(edit) {
            Err(ConfigError::Invalid { problems, .. }) => {
                assert!(
                    problems.iter().any(|p| p.contains(needle)),
                    "{needle}: {problems:?}"
                );
            }
            other => panic!("{needle}: expected a refusal, got {other:?}"),
        }
    }
}

#[test]
fn kda_shape_is_never_read_from_elsewhere() {
    // A root-level `num_heads` must not stand in for linear_attn_config.num_heads.
    let r = tiny_with(|v| {
        let lin = v["text_config"]["linear_attn_config"]
            .as_object_mut()
            .unwrap();
        lin.remove("num_heads");
        v["text_config"]["num_heads"] = serde_json::json!(4);
    });
    assert!(matches!(r, Err(ConfigError::Invalid { .. })));
}

#[test]
fn unknown_keys_are_tolerated() {
    let c = tiny_with(|v| {
        v["text_config"]["some_future_key"] = serde_json::json!({"x": 1});
        v["another"] = serde_json::json!(true);
    });
    assert!(c.is_ok());
}

/// Run `k3 ARGS` with `K3_CONFIG=file`; returns (exit code, stderr).
fn k3_with_user_config(file: &std::path::Path, args: &[&str]) -> (i32, String) {
    let out = crate::common::k3_command()
        .args(args)
        .env("K3_CONFIG", file)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "panic: {err}");
    (out.status.code().unwrap_or(-1), err)
}

#[test]
fn user_config_refusals_carry_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.toml");
    let cases = [
        (
            "[keys]\nquit = \"ctrl-ctrl-q\"\n",
            "config.toml:2:8: keys.quit",
            "twice",
        ),
        (
            "theme = \"dark\"\n[sampling]\ntop_p = 2.0\n",
            "config.toml:3:9",
            "sampling.top_p",
        ),
        (
            "[sampling]\n  context = 1\n",
            "config.toml:2:13",
            "sampling.context",
        ),
        ("[sampling]\ntop_k = -1\n", "config.toml:2:9", "-1"),
        // The collision is reported on the default it hits, placed at the line that caused it.
        (
            "[keys]\nhelp = \"ctrl-q\"\n",
            "config.toml:2:8: keys.quit",
            "bound to help",
        ),
    ];
    for (text, at, what) in cases {
        std::fs::write(&file, text).unwrap();
        let (code, err) = k3_with_user_config(&file, &["config", "show"]);
        assert_eq!(code, 2, "{text}: {err}");
        assert!(err.contains(at) && err.contains(what), "{text}: {err}");
    }
    // A byte that is not UTF-8 is placed by line and column too.
    std::fs::write(&file, b"theme = \"dark\"\n[keys]\nquit = \"ctrl-\xff\"\n").unwrap();
    let (code, err) = k3_with_user_config(&file, &["config", "show"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("config.toml:3:14: not UTF-8 (byte 0xff)"),
        "{err}"
    );
    // A doubled modifier is refused wherever it appears, a single one still works.
    std::fs::write(&file, "[keys]\ncopy = \"alt-ALT-c\"\n").unwrap();
    let (code, err) = k3_with_user_config(&file, &["config", "show"]);
    assert_eq!(code, 2, "{err}");
    std::fs::write(&file, "[keys]\ncopy = \"alt-c\"\n").unwrap();
    let (code, err) = k3_with_user_config(&file, &["config", "show"]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn oversized_config_files_are_refused_unread() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.toml");
    std::fs::write(&file, "# padding\n".repeat(200_000)).unwrap();
    let (code, err) = k3_with_user_config(&file, &["config", "show"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("2000000 bytes, above the limit of 1048576 bytes"),
        "{err}"
    );
    // The model's config.json: valid JSON padded past 16 MiB (under a sound user config,
    // which every command reads first for its [tuning] table).
    std::fs::write(&file, "# nothing set\n").unwrap();
    let (_t, model) = crate::bad_inputs::copy_tiny();
    let p = model.join("config.json");
    let mut text = std::fs::read(&p).unwrap();
    text.extend(std::iter::repeat_n(b' ', 17 << 20));
    std::fs::write(&p, &text).unwrap();
    let (code, err) = k3_with_user_config(
        &file,
        &["run", model.to_str().unwrap(), "--ids", "1", "--gen", "1"],
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("config.json") && err.contains("above the limit of 16777216 bytes"),
        "{err}"
    );
}
