//! `config.json` values checked against the graph, through the binary: token ids outside the
//! vocabulary, inconsistent expert groups, an unknown routing method, a position limit that
//! cannot hold a prompt, and a tensor whose dtype its role never has.

use crate::bad_inputs::{copy_tiny, set_config, shard, split};
use serde_json::json;
use std::path::Path;

/// `k3 run DIR --ids 1,2 --gen 1`: (exit code, stderr).
fn run(dir: &Path) -> (i32, String) {
    let out = crate::common::k3_command()
        .args(["run", dir.to_str().unwrap(), "--ids", "1,2", "--gen", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "panic: {err}");
    (out.status.code().unwrap_or(-1), err)
}

#[test]
fn config_values_outside_the_graph_are_refused_by_key() {
    // The tiny model's vocabulary is 512 tokens, with 8 experts in one group.
    let cases = [
        ("text_config.eos_token_id", json!(-1), "not a token id"),
        (
            "text_config.eos_token_id",
            json!(1u64 << 40),
            "not a token id",
        ),
        ("bos_token_id", json!(512), "not a token id"),
        ("text_config.pad_token_id", json!(99999), "not a token id"),
        ("eos_token_id", json!([258, 600]), "not a token id"),
        (
            "text_config.max_position_embeddings",
            json!(1),
            "must be an integer in 2..=",
        ),
        (
            "text_config.num_expert_group",
            json!(0),
            "must be an integer in 1..=",
        ),
        ("text_config.num_expert_group", json!(3), "does not divide"),
        (
            "text_config.topk_group",
            json!(2),
            "more than the 1 expert group",
        ),
        (
            "text_config.topk_method",
            json!("greedy"),
            "only `noaux_tc`",
        ),
    ];
    for (key, value, needle) in cases {
        let (_t, dir) = copy_tiny();
        set_config(&dir, key, value.clone());
        let (code, err) = run(&dir);
        assert_eq!(code, 2, "{key} = {value}: {err}");
        assert!(
            err.contains(key) && err.contains(needle),
            "{key} = {value}: {err}"
        );
    }
    // The values the release states still load.
    let (_t, dir) = copy_tiny();
    set_config(&dir, "eos_token_id", json!([258]));
    set_config(&dir, "text_config.pad_token_id", serde_json::Value::Null);
    let (code, err) = run(&dir);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn a_bf16_tensor_relabelled_f16_is_refused() {
    let (_t, dir) = copy_tiny();
    let p = shard(&dir, 1);
    let (mut h, data) = split(&p);
    let name = h
        .iter()
        .find(|(k, v)| k.ends_with("q_a_proj.weight") && v["dtype"] == "BF16")
        .map(|(k, _)| k.clone())
        .expect("a BF16 projection in the first shard");
    h.get_mut(&name).unwrap()["dtype"] = json!("F16");
    crate::bad_inputs::join(&p, &h, &data);
    let (code, err) = run(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains(&name) && err.contains("dtype F16, expected BF16 or F32"),
        "{err}"
    );
}
