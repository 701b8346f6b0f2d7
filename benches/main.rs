//! Kernel benchmarks at real Kimi K3 sizes (criterion; `cargo bench`).
//!
//! Decoding is bandwidth-bound, so each benchmark reports bytes of weights streamed per second;
//! GFLOP/s follows as 2·rows·cols / time. `stream_read` measures what this machine's memory
//! delivers to one streaming pass so the kernels can be compared with it.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use k3::kernels::{self, DenseRef, Isa, Mxfp4Matrix};
use rayon::prelude::*;
use std::hint::black_box;
use std::time::Duration;

fn lcg(seed: &mut u64) -> u32 {
    *seed = seed
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    (*seed >> 33) as u32
}

fn paths() -> Vec<Isa> {
    let mut v = vec![kernels::detected_isa()];
    if v[0] == Isa::Avx512 {
        v.push(Isa::Avx2);
    }
    if v[0] != Isa::Generic {
        v.push(Isa::Generic);
    }
    v
}

/// Trunk projections times one vector (one decode step): BF16 `[7168, 7168]` (the released
/// model's hidden size) and `[32768, 2048]` (rows of 4 KiB, one page each, as at hidden 2048).
fn bf16_matvec(c: &mut Criterion) {
    bf16_matvec_shape(c, 7168, 7168);
    bf16_matvec_shape(c, 32768, 2048);
}

/// A BF16 `[rows, cols]` matrix (larger than the caches) times one vector.
fn bf16_matvec_shape(c: &mut Criterion, rows: usize, cols: usize) {
    let mut s = 1u64;
    let w: Vec<u16> = (0..rows * cols)
        .map(|_| kernels::f32_to_bf16((lcg(&mut s) as f32 / 4e9) - 0.5))
        .collect();
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.001).sin()).collect();
    let mut y = vec![0f32; rows];
    let mut g = c.benchmark_group(format!("bf16_matvec_{rows}x{cols}"));
    g.throughput(Throughput::Bytes((rows * cols * 2) as u64));
    g.sample_size(20).measurement_time(Duration::from_secs(4));
    for isa in paths() {
        g.bench_with_input(BenchmarkId::from_parameter(isa.name()), &isa, |b, &isa| {
            b.iter(|| {
                kernels::matmul_with(isa, DenseRef::Bf16(&w), rows, cols, black_box(&x), &mut y)
            });
        });
    }
    g.finish();
}

/// A routed expert's gate projection: MXFP4 `[3072, 3584]` times one latent vector.
fn mxfp4_matvec(c: &mut Criterion) {
    let (rows, cols) = (3072usize, 3584usize);
    let mut s = 7u64;
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| lcg(&mut s) as u8).collect();
    let scales: Vec<u8> = (0..rows * cols / 32)
        .map(|_| 120 + (lcg(&mut s) % 3) as u8)
        .collect();
    let m = Mxfp4Matrix::new(&packed, &scales, rows, cols).expect("sizes");
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.003).cos()).collect();
    let mut y = vec![0f32; rows];
    let mut g = c.benchmark_group("mxfp4_matvec_3072x3584");
    g.throughput(Throughput::Bytes((packed.len() + scales.len()) as u64));
    g.sample_size(30).measurement_time(Duration::from_secs(3));
    for isa in paths() {
        g.bench_with_input(BenchmarkId::from_parameter(isa.name()), &isa, |b, &isa| {
            b.iter(|| kernels::matmul_mxfp4_with(isa, &m, black_box(&x), &mut y));
        });
    }
    g.finish();
}

/// A routed expert's gate projection against 16 tokens of a prefill chunk: one batched product
/// (each group decoded once for four tokens) beside 16 one-token products.
fn mxfp4_batch(c: &mut Criterion) {
    let (rows, cols, n_tok) = (3072usize, 3584usize, 16usize);
    let mut s = 11u64;
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| lcg(&mut s) as u8).collect();
    let scales: Vec<u8> = (0..rows * cols / 32)
        .map(|_| 120 + (lcg(&mut s) % 3) as u8)
        .collect();
    let m = Mxfp4Matrix::new(&packed, &scales, rows, cols).expect("sizes");
    let x: Vec<f32> = (0..n_tok * cols)
        .map(|i| (i as f32 * 0.003).cos())
        .collect();
    let mut y = vec![0f32; n_tok * rows];
    let mut g = c.benchmark_group("mxfp4_3072x3584_16tok");
    g.sample_size(20).measurement_time(Duration::from_secs(3));
    let isa = kernels::detected_isa();
    g.bench_function("batched", |b| {
        b.iter(|| kernels::matmul_mxfp4_with(isa, &m, black_box(&x), &mut y));
    });
    g.bench_function("four_tokens_at_a_time", |b| {
        b.iter(|| {
            for (xt, yt) in x.chunks(4 * cols).zip(y.chunks_mut(4 * rows)) {
                kernels::matmul_mxfp4_with(isa, &m, black_box(xt), yt);
            }
        });
    });
    g.bench_function("one_token_at_a_time", |b| {
        b.iter(|| {
            for (xt, yt) in x.chunks(cols).zip(y.chunks_mut(rows)) {
                kernels::matmul_mxfp4_with(isa, &m, black_box(xt), yt);
            }
        });
    });
    g.finish();
}

/// Memory bandwidth reference: one pass over 2 × 128 MiB of f32 (dot products on every thread).
fn stream_read(c: &mut Criterion) {
    let n = 32 << 20;
    let a = vec![1.0f32; n];
    let b = vec![0.5f32; n];
    let mut g = c.benchmark_group("stream_read_256MiB");
    g.throughput(Throughput::Bytes((2 * n * 4) as u64));
    g.sample_size(10).measurement_time(Duration::from_secs(4));
    g.bench_function("dot_all_threads", |bch| {
        bch.iter(|| {
            a.par_chunks(1 << 20)
                .zip(b.par_chunks(1 << 20))
                .map(|(x, y)| kernels::dot(black_box(x), black_box(y)))
                .collect::<Vec<f32>>()
        });
    });
    g.finish();
}

/// One eviction of the routed-expert cache, the scanning `LayerCycle` beside `CycleQueue`, at
/// 1k and 64k slots: requests go round the released model's 92 MoE layers, 16 random experts
/// each, and one iteration runs requests until one of them evicts.
fn expert_eviction(c: &mut Criterion) {
    use k3::stream::cache_policy::{
        CycleQueue, ExpertKey, KeySpace, LayerCycle, Policy, SlotTable,
    };
    let mut s = 5u64;
    let trace: Vec<ExpertKey> = (0..(1usize << 21))
        .map(|i| ExpertKey::new(1 + ((i / 16) % 92) as u16, (lcg(&mut s) % 896) as u16))
        .collect();
    fn run<P: Policy>(t: &mut SlotTable<P>, trace: &[ExpertKey], at: &mut usize) {
        let before = t.stats().evictions;
        while t.stats().evictions == before {
            let key = trace[*at % trace.len()];
            let _ = t.access(key, *at as u64);
            *at += 1;
        }
    }
    let mut g = c.benchmark_group("expert_eviction");
    g.sample_size(10).measurement_time(Duration::from_secs(3));
    for slots in [1usize << 10, 1 << 16] {
        let mut at = 0;
        let mut scan = SlotTable::new(KeySpace::K3, slots, LayerCycle::new(KeySpace::K3));
        while scan.occupied() < slots {
            run_fill(&mut scan, &trace, &mut at);
        }
        g.bench_with_input(BenchmarkId::new("layer-cycle", slots), &slots, |b, _| {
            b.iter(|| run(&mut scan, &trace, &mut at));
        });
        let mut at = 0;
        let mut queue = SlotTable::new(KeySpace::K3, slots, CycleQueue::new(KeySpace::K3));
        while queue.occupied() < slots {
            run_fill(&mut queue, &trace, &mut at);
        }
        g.bench_with_input(BenchmarkId::new("cycle-queue", slots), &slots, |b, _| {
            b.iter(|| run(&mut queue, &trace, &mut at));
        });
    }
    g.finish();
}

fn run_fill<P: k3::stream::cache_policy::Policy>(
    t: &mut k3::stream::cache_policy::SlotTable<P>,
    trace: &[k3::stream::cache_policy::ExpertKey],
    at: &mut usize,
) {
    let _ = t.access(trace[*at % trace.len()], *at as u64);
    *at += 1;
}

/// The trunk codec (docs/trunk-codec.md): decoding 32 MiB of BF16 drawn like trained weights
/// (N(0, 0.02), one value in 1000 fifty times larger), with each coding, on one core and on
/// the rayon pool; throughput is BF16 bytes written. The stored ratios are printed.
/// `n` trained-like BF16 values as little-endian bytes: roughly normal, one in 1000 an
/// outlier 50 times larger, like the synthetic weights.
fn trained_like(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed;
    (0..n)
        .flat_map(|_| {
            // A sum of four uniforms: approximately normal.
            let u: f32 = (0..4)
                .map(|_| lcg(&mut s) as f32 / u32::MAX as f32)
                .sum::<f32>()
                - 2.0;
            let big = if lcg(&mut s).is_multiple_of(1000) {
                50.0
            } else {
                1.0
            };
            kernels::f32_to_bf16(u * 0.035 * big).to_le_bytes()
        })
        .collect()
}

fn trunk_decode(c: &mut Criterion) {
    use k3::stream::codec;
    let src = trained_like(16 << 20, 5);
    let mut g = c.benchmark_group("trunk_decode");
    g.throughput(Throughput::Bytes(src.len() as u64));
    g.sample_size(10).measurement_time(Duration::from_secs(4));
    let mut out = vec![0u8; src.len()];
    for coding in [codec::Coding::Entropy, codec::Coding::Nibble] {
        let mut enc = Vec::new();
        assert!(codec::encode_as(coding, &src, &mut enc));
        let name = coding.name();
        eprintln!(
            "trunk_decode {name}: {} BF16 bytes stored in {} ({:.4}x)",
            src.len(),
            enc.len(),
            enc.len() as f64 / src.len() as f64
        );
        g.bench_function(format!("{name}/one_core"), |b| {
            b.iter(|| codec::decode_into(black_box(&enc), &mut out).expect("decodes"));
        });
        g.bench_function(format!("{name}/rayon"), |b| {
            b.iter(|| codec::decode(black_box(&enc), &mut out).expect("decodes"));
        });
        // Checked here too, where a filter skipped the timed decodes.
        codec::decode(&enc, &mut out).expect("decodes");
        assert_eq!(out, src);
    }
    g.finish();
}

/// A pinned layer's matrix, trained-like BF16 `[7168, 7168]` (larger than the caches), times
/// one vector: as BF16, and nibble-coded as `k3 pack` stores it, multiplied as stored.
/// Throughput counts the BF16 bytes in both, so the ratio is the speed-up.
fn coded_matvec(c: &mut Criterion) {
    use k3::stream::codec;
    let (rows, cols) = (7168usize, 7168usize);
    let src = trained_like(rows * cols, 11);
    let w: Vec<u16> = src
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    let mut enc = Vec::new();
    assert!(codec::encode_as(codec::Coding::Nibble, &src, &mut enc));
    let index = codec::nibble_index(&enc, rows, cols, &mut Vec::new())
        .expect("decodes")
        .expect("nibble-coded");
    let m = kernels::NibbleMatrix::new(&enc, &index.blocks, &index.row_esc, rows, cols)
        .expect("consistent");
    eprintln!(
        "coded_matvec: {} BF16 bytes held in {} ({:.4}x)",
        src.len(),
        enc.len(),
        enc.len() as f64 / src.len() as f64
    );
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.001).sin()).collect();
    let (mut y, mut z) = (vec![0f32; rows], vec![0f32; rows]);
    let mut g = c.benchmark_group(format!("coded_matvec_{rows}x{cols}"));
    g.throughput(Throughput::Bytes((rows * cols * 2) as u64));
    g.sample_size(20).measurement_time(Duration::from_secs(4));
    for isa in paths() {
        g.bench_with_input(BenchmarkId::new("bf16", isa.name()), &isa, |b, &isa| {
            b.iter(|| {
                kernels::matmul_with(isa, DenseRef::Bf16(&w), rows, cols, black_box(&x), &mut y)
            });
        });
        g.bench_with_input(BenchmarkId::new("coded", isa.name()), &isa, |b, &isa| {
            b.iter(|| kernels::matmul_nibble_with(isa, &m, black_box(&x), &mut z));
        });
        kernels::matmul_with(isa, DenseRef::Bf16(&w), rows, cols, &x, &mut y);
        kernels::matmul_nibble_with(isa, &m, &x, &mut z);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&y), bits(&z), "{isa:?}: the coded product differs");
    }
    g.finish();
}

criterion_group!(
    benches,
    trunk_decode,
    coded_matvec,
    bf16_matvec,
    mxfp4_matvec,
    mxfp4_batch,
    stream_read,
    expert_eviction
);
criterion_main!(benches);
