//! `k3 plan --chat` plans what `k3 chat` plans (its context and its sequence states): a budget
//! just above the plan's floor opens the chat, one just below is refused with the floor.

use serde_json::Value;
use std::process::{Output, Stdio};

fn run(args: &[&str], config_home: &std::path::Path) -> Output {
    crate::common::k3_command()
        .args(args)
        .env("XDG_CONFIG_HOME", config_home)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

#[test]
fn plan_chat_plans_what_chat_plans() {
    let demo = crate::common::demo_model().to_str().unwrap().to_string();
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("no-config");
    let plan = |extra: &[&str]| -> u64 {
        let mut args = vec!["plan", demo.as_str(), "--chat", "--json", "--mem", "2"];
        args.extend_from_slice(extra);
        let out = run(&args, &home);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let j: Value = serde_json::from_slice(&out.stdout).unwrap();
        j["floor_bytes"].as_u64().unwrap()
    };
    let floor = plan(&[]);
    // The default is the chat's context, not the 4,096 positions `k3 run` plans for.
    assert!(floor > plan(&["--context", "4096"]), "{floor}");
    assert_eq!(floor, plan(&["--context", "32768"]));
    let sessions = tmp.path().join("sessions");
    let chat = |bytes: u64| {
        let mem = format!("{:.4}", bytes as f64 / 1e9);
        run(
            &[
                "chat",
                demo.as_str(),
                "--plain",
                "--mem",
                &mem,
                "--session-dir",
                sessions.to_str().unwrap(),
            ],
            &home,
        )
    };
    let below = chat(floor - 2_000_000);
    let err = String::from_utf8_lossy(&below.stderr);
    assert_eq!(below.status.code(), Some(2), "{err}");
    assert!(err.contains("positions and 5 sequence states;"), "{err}");
    let above = chat(floor + 2_000_000);
    assert!(
        above.status.success(),
        "{}",
        String::from_utf8_lossy(&above.stderr)
    );
}

/// With an entropy-coded packed trunk the chat's floor counts the staging of its largest run
/// (its layers are decoded, not read in place), as `k3 plan --chat --trunk` does: a budget
/// between the two floors is refused before the chat starts, one just above the trunk's floor
/// opens it.
#[test]
fn plan_chat_counts_an_encoded_trunks_staging() {
    let demo = crate::common::demo_model().to_str().unwrap().to_string();
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("no-config");
    let trunk = tmp.path().join("trunk");
    let trunk = trunk.to_str().unwrap();
    let packed = run(
        &[
            "pack",
            demo.as_str(),
            trunk,
            "--encode",
            "--codec",
            "entropy",
        ],
        &home,
    );
    assert!(packed.status.success(), "{packed:?}");
    let plan = |extra: &[&str]| -> Value {
        let mut args = vec!["plan", demo.as_str(), "--chat", "--json", "--mem", "2"];
        args.extend_from_slice(extra);
        let out = run(&args, &home);
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let (plain, with) = (plan(&[]), plan(&["--trunk", trunk]));
    let staged = (with["sizes"]["layer_window"].as_array().unwrap().iter())
        .filter_map(Value::as_u64)
        .max()
        .unwrap();
    assert!(staged > 800_000, "{staged}");
    let floor = with["floor_bytes"].as_u64().unwrap();
    assert_eq!(floor, plain["floor_bytes"].as_u64().unwrap() + staged);
    let sessions = tmp.path().join("sessions");
    let chat = |bytes: u64| {
        let mem = format!("{:.4}", bytes as f64 / 1e9);
        let sessions = sessions.to_str().unwrap();
        let args = [
            "chat",
            &demo,
            "--plain",
            "--mem",
            &mem,
            "--trunk",
            trunk,
            "--session-dir",
            sessions,
        ];
        run(&args, &home)
    };
    let below = chat(floor - staged / 2);
    let err = String::from_utf8_lossy(&below.stderr);
    assert_eq!(below.status.code(), Some(2), "{err}");
    assert!(err.contains("positions and 5 sequence states;"), "{err}");
    let above = chat(floor + staged / 2);
    assert!(above.status.success(), "{above:?}");
}
