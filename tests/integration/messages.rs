//! Messages that used to mislead, through the binary: each now names what is wrong.

use crate::bad_inputs::{copy_tiny, join, shard, split};

#[test]
fn a_budget_too_large_is_not_called_non_positive() {
    let out = crate::common::k3_command()
        .args(["run"])
        .arg(crate::common::fixture("tiny"))
        .args(["--ids", "1,2", "--gen", "1", "--mem", "1e30"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--mem") && err.contains("above the largest budget"),
        "{err}"
    );
    assert!(!err.contains("not a positive number"), "{err}");
}

#[test]
fn a_missing_a_log_names_both_shapes_it_may_have() {
    let (_t, dir) = copy_tiny();
    std::fs::remove_file(dir.join("model.safetensors.index.json")).unwrap();
    let p = shard(&dir, 1);
    let (mut h, data) = split(&p);
    let name = "language_model.model.layers.0.self_attn.A_log";
    let v = h.remove(name).unwrap();
    h.insert(format!("{name}_renamed"), v);
    join(&p, &h, &data);
    let out = crate::common::k3_command()
        .arg("run")
        .arg(&dir)
        .args(["--ids", "1,2", "--gen", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    // The tiny model: 4 KDA heads of dimension 16.
    assert!(
        err.contains(&format!(
            "missing tensor {name} (expected shape [4], or [16]"
        )),
        "{err}"
    );
}

#[test]
fn an_infinite_temperature_in_the_config_file_is_refused_with_its_line() {
    let cfg = tempfile::tempdir().unwrap();
    let k3dir = cfg.path().join("k3");
    std::fs::create_dir(&k3dir).unwrap();
    std::fs::write(k3dir.join("config.toml"), "[sampling]\ntemperature = inf\n").unwrap();
    let out = crate::common::k3_command()
        .args(["config", "show"])
        .env("XDG_CONFIG_HOME", cfg.path())
        .env_remove("K3_CONFIG")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("config.toml:2:") && err.contains("sampling.temperature: must be a finite"),
        "{err}"
    );
}
