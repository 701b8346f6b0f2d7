//! `config.json` acceptance and refusal (MODEL.md §1.2–1.4).

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
