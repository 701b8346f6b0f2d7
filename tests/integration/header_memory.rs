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

/// `model.safetensors.index.json` with a million `weight_map` entries over four shards (about
/// 98 MB) is opened within a few times its size: the map is read entry by entry into one
/// compact record per tensor, with names borrowed from the file's bytes (a JSON value tree
/// of it took 4.1 times its size, 405 MB, for the same checkpoint).
#[test]
fn a_million_entry_index_opens_within_a_few_times_its_size() {
    let dir = tempfile::tempdir().unwrap();
    let (n, shards) = (1_000_000u64, 4u64);
    let per = n / shards;
    let name = |k: u64| {
        format!(
            "language_model.model.layers.{}.mlp.experts.{}.weight",
            k / 10_000,
            k % 10_000
        )
    };
    let index_path = dir.path().join("model.safetensors.index.json");
    let mut index = std::io::BufWriter::new(std::fs::File::create(&index_path).unwrap());
    write!(
        index,
        "{{\n  \"metadata\": {{\"total_size\": {n}}},\n  \"weight_map\": {{\n"
    )
    .unwrap();
    for s in 0..shards {
        let file = format!("model-{:05}-of-{shards:05}.safetensors", s + 1);
        let mut header = String::with_capacity(100 * per as usize);
        header.push('{');
        for i in 0..per {
            let k = s * per + i;
            if i > 0 {
                header.push(',');
            }
            header.push_str(&format!(
                "\"{}\":{{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[{i},{}]}}",
                name(k),
                i + 1
            ));
            let sep = if k + 1 < n { "," } else { "" };
            writeln!(index, "    \"{}\": \"{file}\"{sep}", name(k)).unwrap();
        }
        header.push('}');
        let mut w = std::io::BufWriter::new(std::fs::File::create(dir.path().join(&file)).unwrap());
        w.write_all(&(header.len() as u64).to_le_bytes()).unwrap();
        w.write_all(header.as_bytes()).unwrap();
        w.write_all(&vec![1u8; per as usize]).unwrap();
        w.flush().unwrap();
    }
    index.write_all(b"  }\n}\n").unwrap();
    index.flush().unwrap();
    drop(index);
    let index_bytes = std::fs::metadata(&index_path).unwrap().len();
    let out = k3_command()
        .arg("verify")
        .arg(dir.path())
        .arg("--json")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // The checkpoint opens and every tensor is read; only the config and tokenizer are missing.
    assert_eq!(out.status.code(), Some(3), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["tensors"].as_u64(), Some(n), "{v}");
    assert_eq!(v["shards"].as_u64(), Some(shards), "{v}");
    assert_eq!(v["problem_count"].as_u64(), Some(2), "{v}");
    let peak = v["peak_rss_bytes"].as_u64().unwrap();
    println!(
        "index {index_bytes} bytes, {n} entries: peak RSS {peak} bytes ({:.2}x the index)",
        peak as f64 / index_bytes as f64
    );
    assert!(peak > 0, "no peak RSS reported");
    assert!(
        peak * 2 <= 7 * index_bytes,
        "peak RSS {peak} is more than 3.5x the {index_bytes}-byte index"
    );
}
