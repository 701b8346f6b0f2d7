//! The safetensors reader on the C reference's torture shards (`tests/fixtures/ops/st`):
//! `__metadata__`, every dtype, odd F16 length, a scalar, an empty tensor, rank 3 and 4, a second
//! shard, and a name with quotes and a backslash.

use crate::common::fixture;
use k3::stream::{Checkpoint, Dtype, TensorData};

#[test]
fn torture_shards_index_and_read() {
    let ck = Checkpoint::open(&fixture("ops/st")).unwrap();
    assert_eq!(
        ck.index().len(),
        13,
        "{:?}",
        ck.index().names().collect::<Vec<_>>()
    );
    assert!(ck.info("__metadata__").is_none());
    let (info, data) = ck.read("scalar.f32").unwrap();
    assert!(info.shape.is_empty());
    assert_eq!(data, TensorData::F32(vec![3.5]));
    let (info, data) = ck.read("empty.f32").unwrap();
    assert_eq!(info.shape, vec![0, 8]);
    assert_eq!(data, TensorData::F32(vec![]));
    let (_, data) = ck.read("weird\\name.\"with\"quotes").unwrap();
    assert_eq!(data, TensorData::F32(vec![1.0, 2.0, 3.0]));
    let (info, data) = ck.read("rank4.u8").unwrap();
    assert_eq!(
        (info.dtype, info.shape.clone()),
        (Dtype::U8, vec![2, 2, 2, 2])
    );
    assert!(matches!(data, TensorData::U8(v) if v.len() == 16));
    // BF16 and F16 special values widen exactly.
    let TensorData::Bf16(b) = ck.read("plain.bf16.1d").unwrap().1 else {
        panic!("bf16")
    };
    let w: Vec<f32> = b.iter().map(|&x| k3::kernels::bf16_to_f32(x)).collect();
    assert!(w[0] == f32::INFINITY && w[1] == f32::NEG_INFINITY && w[2].is_nan());
    assert!(w[4] == 0.0 && w[4].is_sign_negative());
    assert_eq!(w[5], f32::MIN_POSITIVE);
    let TensorData::F32(h) = ck.read("tricky.f16.1d").unwrap().1 else {
        panic!("f16")
    };
    assert_eq!(h.len(), 64);
    assert!(h[0] == f32::INFINITY && h[1] == f32::NEG_INFINITY && h[2].is_nan());
    assert_eq!(h[5], 2f32.powi(-24), "smallest f16 subnormal");
    assert_eq!(h[6], 6.097_555e-5, "largest f16 subnormal");
    assert_eq!(h[7], 2f32.powi(-14), "smallest f16 normal");
    let (info, _) = ck.read("second.shard.u8").unwrap();
    assert_eq!(info.shard, 1);
    assert_eq!(ck.bytes_read(), 4 + 12 + 16 + 256 + 128 + 300);
}

#[test]
fn tiny_checkpoint_names_resolve_with_their_prefixes() {
    let ck = Checkpoint::open(&fixture("tiny")).unwrap();
    assert!(ck.info("language_model.lm_head.weight").is_some());
    assert!(ck.info("language_model.model.lm_head.weight").is_none());
    assert!(ck.info("lm_head.weight").is_none());
    assert!(ck.info("model.embed_tokens.weight").is_none());
    assert!(ck
        .info("language_model.model.embed_tokens.weight")
        .is_some());
}

/// A span read into the caller's buffer goes through the device in bounded pieces when reads
/// are direct: a span of several pieces, at an offset no 4 KiB boundary meets, gives the
/// bytes of the file (direct and buffered alike).
#[test]
fn a_long_unaligned_span_reads_the_same_direct_or_buffered() {
    // Under the build directory: a file system that takes direct reads where /tmp may not.
    let base = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let tmp = tempfile::tempdir_in(base).unwrap();
    let n_big = (20 << 20) + 12_345;
    let header = format!(
        "{{\"small.u8\":{{\"dtype\":\"U8\",\"shape\":[7],\"data_offsets\":[0,7]}},\
         \"big.u8\":{{\"dtype\":\"U8\",\"shape\":[{n_big}],\"data_offsets\":[7,{}]}}}}",
        7 + n_big
    );
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend((0..7 + n_big).map(|i| (i * 7 + i / 4093) as u8));
    std::fs::write(tmp.path().join("model.safetensors"), &file).unwrap();
    let data_at = 8 + header.len() + 7;
    let want = |from: usize, len: usize| file[data_at + from..data_at + from + len].to_vec();
    for direct in [true, false] {
        let mut ck = Checkpoint::open(tmp.path()).unwrap();
        ck.set_direct(direct);
        let info = ck.info("big.u8").unwrap().clone();
        for (from, len) in [(777usize, (17 << 20) + 5), (0, n_big), (4096, 300_001)] {
            let mut out = vec![0u8; len];
            ck.read_span_into(&info, "big.u8", from as u64, &mut out)
                .unwrap();
            assert!(out == want(from, len), "direct {direct}: {from}+{len}");
        }
    }
}
