//! A shard header of a million tensors (about 79 MB of JSON) is opened within a few times its
//! own size: the header is parsed entry by entry into the compact index, with no JSON value
//! tree of the whole header (which took 1.38 GB).

use crate::common::k3_command;
use std::io::Write;

#[test]
fn a_million_tensor_header_opens_within_a_few_times_its_size() {
    let dir = tempfile::tempdir().unwrap();
    let n = 1_000_000u64;
    let mut header = String::with_capacity(80 * n as usize);
    header.push('{');
    for i in 0..n {
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            "\"blk.{i:07}.weight\":{{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[{i},{}]}}",
            i + 1
        ));
    }
    header.push('}');
    let header_bytes = header.len() as u64;
    {
        let f = std::fs::File::create(dir.path().join("model.safetensors")).unwrap();
        let mut w = std::io::BufWriter::new(f);
        w.write_all(&header_bytes.to_le_bytes()).unwrap();
        w.write_all(header.as_bytes()).unwrap();
        w.write_all(&vec![1u8; n as usize]).unwrap();
        w.flush().unwrap();
    }
    drop(header);
    // `k3 verify` opens the checkpoint (every header validated, the index built), reads each
    // tensor once and reports its own peak RSS; the missing config and tokenizer are problems.
    let out = k3_command()
        .arg("verify")
        .arg(dir.path())
        .arg("--json")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["tensors"].as_u64(), Some(n), "{v}");
    let peak = v["peak_rss_bytes"].as_u64().unwrap();
    println!(
        "header {header_bytes} bytes, {n} tensors: peak RSS {peak} bytes ({:.2}x the header)",
        peak as f64 / header_bytes as f64
    );
    assert!(peak > 0, "no peak RSS reported");
    assert!(
        peak <= 4 * header_bytes,
        "peak RSS {peak} is more than 4x the {header_bytes}-byte header"
    );
}
