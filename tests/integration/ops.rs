//! Per-kernel oracle tests against the third-party fixtures in `tests/fixtures/ops`
//! (docs/model.md#mxfp4-experts, docs/model.md#forward-pass,
//! docs/model.md#numerics), plus bitwise checks of the SIMD paths against their scalar twins.
//!
//! Every float comparison uses the MANIFEST tolerance element-wise,
//! `|got − want| ≤ fp32_abs + fp32_rel·|want|`, and prints the worst ratio
//! `|got − want| / (fp32_abs + fp32_rel·|want|)`, which must be ≤ 1. The exceptions
//! (docs/model.md#numerics) are exact: MXFP4 decode, BF16 vs widened-F32 products, router selected sets.

use crate::common::json;
use k3::engine::attnres;
use k3::engine::kda::{self, KdaParams, KdaState, KdaWeights};
use k3::engine::mla::{self, MlaParams, MlaWeights};
use k3::engine::moe::{self, Expert, MoeParams, MoeWeights};
use k3::engine::tensor::{Dense, DenseData, Matrix};
use k3::kernels::mxfp4::{element, E2M1};
use k3::kernels::ops::{rmsnorm, shortconv_step, situ_glu};
use k3::kernels::{
    axpy_rows_with, axpy_with, bf16_to_f32, detected_isa, dot_bf16_with, dot_with, f32_to_bf16,
    matmul_mxfp4_with, matmul_ordered, matmul_with, row_order, scores_with, DenseRef, Isa,
    Mxfp4Matrix, RowOrder,
};
use serde_json::Value;
use std::sync::OnceLock;

// ---------------------------------------------------------------------------------------------
// Fixture access and the tolerance report
// ---------------------------------------------------------------------------------------------

fn manifest() -> &'static Value {
    static M: OnceLock<Value> = OnceLock::new();
    M.get_or_init(|| json("ops/MANIFEST.json"))
}

/// `(fp32_abs, fp32_rel)` from MANIFEST.json.
fn tolerance() -> (f64, f64) {
    let t = &manifest()["tolerance"];
    (
        t["fp32_abs"].as_f64().unwrap(),
        t["fp32_rel"].as_f64().unwrap(),
    )
}

fn cfg(key: &str) -> &'static Value {
    let v = &manifest()["config"][key];
    assert!(!v.is_null(), "MANIFEST config lacks {key}");
    v
}

fn fx(name: &str) -> Value {
    json(&format!("ops/{name}.json"))
}

/// A scalar field.
fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// A scalar field as usize.
fn int(v: &Value) -> usize {
    let x = num(v);
    assert!(x >= 0.0 && x.fract() == 0.0, "not an index: {x}");
    x as usize
}

/// `data` of a `{shape, data}` tensor as f32.
fn t(v: &Value) -> Vec<f32> {
    let d = v["data"]
        .as_array()
        .unwrap_or_else(|| panic!("not a tensor: {v:.80}"));
    let out: Vec<f32> = d.iter().map(|x| x.as_f64().unwrap() as f32).collect();
    assert_eq!(
        out.len(),
        shape(v).iter().product::<usize>(),
        "tensor size vs shape"
    );
    out
}

/// `data` of a U8 tensor.
fn t_u8(v: &Value) -> Vec<u8> {
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            let f = x.as_f64().unwrap();
            assert!(
                (0.0..=255.0).contains(&f) && f.fract() == 0.0,
                "not a byte: {f}"
            );
            f as u8
        })
        .collect()
}

fn shape(v: &Value) -> Vec<usize> {
    v["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect()
}

/// A 2-D `[out, in]` weight as an F32 dense matrix.
fn dense(v: &Value) -> Dense {
    let s = shape(v);
    assert_eq!(s.len(), 2, "dense weight must be 2-D, got {s:?}");
    Dense::f32(t(v), s[0], s[1])
}

/// Collects tolerance checks of one test; `finish` prints the worst ratio and asserts.
struct Report {
    test: &'static str,
    worst: f64,
    failures: Vec<String>,
}

impl Report {
    fn new(test: &'static str) -> Self {
        Report {
            test,
            worst: 0.0,
            failures: Vec::new(),
        }
    }

    /// Element-wise tolerance comparison.
    fn cmp(&mut self, what: &str, got: &[f32], want: &[f32]) -> f64 {
        assert_eq!(got.len(), want.len(), "{} {what}: length", self.test);
        let (abs, rel) = tolerance();
        let mut worst = 0.0f64;
        let mut at = 0;
        let mut over = 0;
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let r = (f64::from(g) - f64::from(w)).abs() / (abs + rel * f64::from(w).abs());
            let r = if r.is_nan() { f64::INFINITY } else { r };
            if r > 1.0 {
                over += 1;
            }
            if r > worst {
                worst = r;
                at = i;
            }
        }
        let (g, w) = (
            got.get(at).copied().unwrap_or(0.0),
            want.get(at).copied().unwrap_or(0.0),
        );
        println!(
            "{} {what}: worst ratio {worst:.3e} at [{at}] (got {g:e}, want {w:e}); {over}/{} over",
            self.test,
            got.len()
        );
        if over > 0 {
            self.failures.push(format!(
                "{what}: {over}/{} elements over tolerance; worst [{at}] ratio {worst:.3} \
                 got {g:e} want {w:e}",
                got.len()
            ));
        }
        self.worst = self.worst.max(worst);
        worst
    }

    /// An exact (non-tolerance) condition.
    fn require(&mut self, ok: bool, msg: impl FnOnce() -> String) {
        if !ok {
            let m = msg();
            println!("{} FAILED: {m}", self.test);
            self.failures.push(m);
        }
    }

    fn finish(self) {
        println!("{}: WORST RATIO {:.3e}", self.test, self.worst);
        assert!(
            self.failures.is_empty(),
            "{}: {:#?}",
            self.test,
            self.failures
        );
        assert!(self.worst <= 1.0);
    }
}

/// Bitwise equality of two f32 slices; returns the first differing index.
fn first_bit_diff(a: &[f32], b: &[f32]) -> Option<usize> {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())
}

/// `[n_tok, n_snap, d]` (token, snapshot, hidden) → one `[n_tok, d]` buffer per snapshot.
fn split_snapshots(v: &Value) -> Vec<Vec<f32>> {
    let s = shape(v);
    assert_eq!(s.len(), 3);
    let (n_tok, n_snap, d) = (s[0], s[1], s[2]);
    let data = t(v);
    (0..n_snap)
        .map(|k| {
            let mut out = Vec::with_capacity(n_tok * d);
            for tok in 0..n_tok {
                let base = (tok * n_snap + k) * d;
                out.extend_from_slice(&data[base..base + d]);
            }
            out
        })
        .collect()
}

/// Inverse of [`split_snapshots`].
fn join_snapshots(snaps: &[Vec<f32>], d: usize) -> Vec<f32> {
    let n_tok = snaps.first().map_or(0, |s| s.len() / d);
    let mut out = Vec::with_capacity(n_tok * snaps.len() * d);
    for tok in 0..n_tok {
        for s in snaps {
            out.extend_from_slice(&s[tok * d..(tok + 1) * d]);
        }
    }
    out
}

/// Deterministic pseudo-random numbers (splitmix64).
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }

    /// Uniform in [-1, 1) times 2^e, e in [-6, 6]: mixed magnitudes make reduction-order
    /// differences visible in the last bits.
    fn mixed(&mut self) -> f32 {
        let e = (self.next_u64() % 13) as i32 - 6;
        self.unit() * 2f32.powi(e)
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.mixed()).collect()
    }
}

/// Every path this CPU can run, scalar first.
fn paths() -> Vec<Isa> {
    match detected_isa() {
        Isa::Generic => vec![Isa::Generic],
        Isa::Avx2 => vec![Isa::Generic, Isa::Avx2],
        Isa::Avx512 => vec![Isa::Generic, Isa::Avx2, Isa::Avx512],
    }
}

// ---------------------------------------------------------------------------------------------
// Block builders
// ---------------------------------------------------------------------------------------------

/// KDA weights; `key` maps the short names of `kda_layer*.json` to the fixture's keys.
fn kda_weights(f: &Value, key: &dyn Fn(&str) -> String) -> KdaWeights {
    let g = |name: &str| {
        let k = key(name);
        let v = &f[k.as_str()];
        assert!(!v.is_null(), "fixture lacks {k}");
        v
    };
    // Conv weights are [C, 1, K] = [C][K] row-major, the engine's [P, K] layout.
    let conv = |name: &str| {
        let v = g(name);
        let s = shape(v);
        assert!(s.len() == 3 && s[1] == 1, "conv weight shape {s:?}");
        t(v)
    };
    KdaWeights {
        q_proj: dense(g("q_proj")),
        k_proj: dense(g("k_proj")),
        v_proj: dense(g("v_proj")),
        q_conv: conv("q_conv"),
        k_conv: conv("k_conv"),
        v_conv: conv("v_conv"),
        f_a: dense(g("f_a")),
        f_b: dense(g("f_b")),
        a_log: t(g("A_log")),
        dt_bias: t(g("dt_bias")),
        b_proj: dense(g("b_proj")),
        g_proj: dense(g("g_proj")),
        o_norm: t(g("o_norm")),
        o_proj: dense(g("o_proj")),
    }
}

/// Key names of the `self_attn_*` KDA weights in `layer_kda.json`.
fn layer_kda_key(name: &str) -> String {
    match name {
        "A_log" | "dt_bias" => format!("self_attn_{name}"),
        "q_conv" | "k_conv" | "v_conv" => format!("self_attn_{}_conv1d_weight", &name[..1]),
        "f_a" | "f_b" => format!("self_attn_{name}_proj_weight"),
        _ => format!("self_attn_{name}_weight"),
    }
}

fn mla_weights(f: &Value, prefix: &str) -> MlaWeights {
    let g = |name: &str| {
        let v = &f[format!("{prefix}{name}").as_str()];
        assert!(!v.is_null(), "fixture lacks {prefix}{name}");
        v
    };
    MlaWeights {
        q_a: dense(g("q_a_proj_weight")),
        q_a_norm: t(g("q_a_layernorm_weight")),
        q_b: dense(g("q_b_proj_weight")),
        kv_a: dense(g("kv_a_proj_with_mqa_weight")),
        kv_a_norm: t(g("kv_a_layernorm_weight")),
        kv_b: dense(g("kv_b_proj_weight")),
        g_proj: dense(g("g_proj_weight")),
        o_proj: dense(g("o_proj_weight")),
    }
}

fn moe_weights(f: &Value, prefix: &str, n_experts: usize) -> MoeWeights {
    let g = |name: &str| {
        let v = &f[format!("{prefix}{name}").as_str()];
        assert!(!v.is_null(), "fixture lacks {prefix}{name}");
        v
    };
    let experts = (0..n_experts)
        .map(|e| {
            std::sync::Arc::new(Expert {
                w1: Matrix::Dense(dense(g(&format!("experts_{e}_w1_weight")))),
                w2: Matrix::Dense(dense(g(&format!("experts_{e}_w2_weight")))),
                w3: Matrix::Dense(dense(g(&format!("experts_{e}_w3_weight")))),
            })
        })
        .collect();
    MoeWeights {
        gate: dense(g("gate_weight")),
        bias: t(g("e_score_correction_bias")),
        down: dense(g("down_weight")),
        up: dense(g("up_weight")),
        norm: t(g("norm_weight")),
        shared_gate: dense(g("shared_w1_weight")),
        shared_up: dense(g("shared_w3_weight")),
        shared_down: dense(g("shared_w2_weight")),
        experts,
    }
}

/// MoE constants of the tiny model (MANIFEST config).
fn cfg_moe_params(rms_eps: f32) -> MoeParams {
    MoeParams {
        top_k: int(cfg("num_experts_per_token")),
        renormalize: cfg("moe_renormalize").as_bool().unwrap(),
        scaling: num(cfg("routed_scaling_factor")) as f32,
        rms_eps,
        beta1: num(cfg("situ_beta")) as f32,
        beta2: num(cfg("situ_linear_beta")) as f32,
    }
}

/// KDA q/k L2-norm epsilon (docs/model.md#primitives-and-epsilons; not carried by the fixtures).
const L2_EPS: f32 = 1e-6;

/// Round to BF16 and widen back.
fn bf16_round(w: &[f32]) -> (Vec<u16>, Vec<f32>) {
    let bits: Vec<u16> = w.iter().map(|&x| f32_to_bf16(x)).collect();
    let wide = bits.iter().map(|&b| bf16_to_f32(b)).collect();
    (bits, wide)
}

// ---------------------------------------------------------------------------------------------
// Element-wise operators
// ---------------------------------------------------------------------------------------------

#[test]
fn rmsnorm_fixture() {
    let f = fx("rmsnorm");
    let mut rep = Report::new("rmsnorm");
    let eps = num(&f["eps"]) as f32;
    let w = t(&f["weight"]);
    let mut got = t(&f["in"]);
    for row in got.chunks_mut(w.len()) {
        rmsnorm(row, &w, eps);
    }
    rep.cmp("out", &got, &t(&f["out"]));
    rep.finish();
}

#[test]
fn situ_glu_fixture() {
    let f = fx("situ_glu");
    let mut rep = Report::new("situ_glu");
    let (b1, b2) = (num(&f["beta"]) as f32, num(&f["linear_beta"]) as f32);
    let s = shape(&f["in"]);
    let x = t(&f["in"]);
    let n = s[1] / 2;
    let mut got = vec![0f32; s[0] * n];
    for (xi, oi) in x.chunks(2 * n).zip(got.chunks_mut(n)) {
        situ_glu(xi, oi, b1, b2);
    }
    rep.cmp("out", &got, &t(&f["out"]));
    let bound = num(&f["max_abs"]) as f32;
    assert_eq!(bound, b1 * b2);
    let max_abs = got.iter().fold(0f32, |m, v| m.max(v.abs()));
    println!("situ_glu: max |out| = {max_abs} (bound {bound})");
    rep.require(got.iter().all(|v| v.abs() <= bound), || {
        format!("|out| exceeds {bound}: max {max_abs}")
    });
    rep.finish();
}

#[test]
fn shortconv_fixture() {
    let f = fx("shortconv");
    let mut rep = Report::new("shortconv");
    let k = int(&f["kernel"]);
    let c = int(&f["channels"]);
    assert_eq!(shape(&f["weight"]), vec![c, 1, k]);
    let w = t(&f["weight"]); // [C,1,K] = [C][K]
    let x = t(&f["in"]);
    let mut state = vec![0f32; c * (k - 1)];
    let mut out = vec![0f32; x.len()];
    for (xt, ot) in x.chunks(c).zip(out.chunks_mut(c)) {
        shortconv_step(xt, &w, &mut state, k, ot);
    }
    rep.cmp("out", &out, &t(&f["out"]));
    rep.cmp("state_after", &state, &t(&f["state_after"]));
    // One decode step continuing from the carried state.
    let xn = t(&f["in_next"]);
    let mut on = vec![0f32; c];
    shortconv_step(&xn, &w, &mut state, k, &mut on);
    rep.cmp("out_next", &on, &t(&f["out_next"]));
    // After it the state holds exactly the last K−1 inputs, oldest first.
    let n_t = x.len() / c;
    let mut want_state = vec![0f32; c * (k - 1)];
    for ch in 0..c {
        for j in 0..k - 1 {
            // Inputs in time order: x[0..n_t], then xn; the last K−1 of them.
            let time = n_t + 1 - (k - 1) + j;
            want_state[ch * (k - 1) + j] = if time < n_t { x[time * c + ch] } else { xn[ch] };
        }
    }
    rep.require(first_bit_diff(&state, &want_state).is_none(), || {
        "state after the continuation step is not the last K-1 raw inputs".into()
    });
    rep.finish();
}

// ---------------------------------------------------------------------------------------------
// KDA
// ---------------------------------------------------------------------------------------------

#[test]
fn kda_decay_fixture() {
    let f = fx("kda_decay");
    let mut rep = Report::new("kda_decay");
    let a_log = t(&f["A_log"]);
    let dt_bias = t(&f["dt_bias"]);
    let z = t(&f["z"]);
    let s = shape(&f["alpha"]); // [1, T, H, D]
    let (heads, d) = (s[2], s[3]);
    assert_eq!(a_log.len(), heads);
    let width = heads * d;
    let p = KdaParams {
        heads,
        head_dim: d,
        kernel: 4,
        lower_bound: num(&f["lower_bound"]) as f32,
        rms_eps: 1e-5,
        l2_eps: L2_EPS,
    };
    let mut alpha = vec![0f32; z.len()];
    for (zt, at) in z.chunks(width).zip(alpha.chunks_mut(width)) {
        kda::decay(zt, &a_log, &dt_bias, &p, at);
    }
    rep.cmp("alpha", &alpha, &t(&f["alpha"]));
    let g: Vec<f32> = alpha.iter().map(|a| a.ln()).collect();
    rep.cmp("g (= ln alpha)", &g, &t(&f["g"]));
    // Range: mathematically (e^lb, 1); in float32 σ can round to 1 (α = e^lb exactly) and
    // g = lb·σ ≈ −3e-9 rounds α to 1.0, so both ends are closed here.
    let lo = p.lower_bound.exp();
    let (a_min, a_max) = alpha
        .iter()
        .fold((f32::MAX, f32::MIN), |(m, x), &a| (m.min(a), x.max(a)));
    println!("kda_decay: alpha in [{a_min:e}, {a_max:e}], e^lb = {lo:e}");
    rep.require(alpha.iter().all(|&a| a >= lo && a <= 1.0), || {
        format!("alpha outside [e^lb, 1]: [{a_min:e}, {a_max:e}]")
    });
    rep.cmp("alpha_min", &[a_min], &[num(&f["alpha_min"]) as f32]);
    rep.cmp("alpha_max", &[a_max], &[num(&f["alpha_max"]) as f32]);
    // Channels where α rounds to exactly 1.0 are those of the fixture's data. (Its
    // `n_alpha_saturated_at_1` = 0 counts g == 0 exactly, i.e. σ underflowed; its own `alpha`
    // data holds six 1.0 values where g ≈ −3e-9, which exp rounds to 1.0 in float32.)
    let want_alpha = t(&f["alpha"]);
    let ones = |v: &[f32]| -> Vec<usize> { (0..v.len()).filter(|&i| v[i] == 1.0).collect() };
    let (got_ones, want_ones) = (ones(&alpha), ones(&want_alpha));
    println!("kda_decay: alpha == 1.0 at {got_ones:?} (fixture data: {want_ones:?})");
    rep.require(got_ones == want_ones, || {
        format!("alpha == 1 at {got_ones:?}, fixture {want_ones:?}")
    });
    rep.require(alpha.len() == int(&f["n_alpha_total"]), || {
        "alpha count".into()
    });
    rep.finish();
}

fn kda_recur_fixture(name: &'static str) {
    let f = fx(name);
    let mut rep = Report::new(name);
    let (n_t, heads, dk, dv) = (int(&f["T"]), int(&f["H"]), int(&f["d_k"]), int(&f["d_v"]));
    assert_eq!(dk, dv, "recur_head takes d_k = d_v");
    let d = dk;
    let q_scale = num(&f["q_scale"]) as f32;
    let (q, k, v, a, beta) = (
        t(&f["q"]),
        t(&f["k"]),
        t(&f["v"]),
        t(&f["alpha"]),
        t(&f["beta"]),
    );
    assert_eq!(q.len(), n_t * heads * d);
    assert_eq!(beta.len(), n_t * heads);
    let mut out = vec![0f32; n_t * heads * d];
    let mut state = vec![0f32; heads * d * d];
    for h in 0..heads {
        let gather = |x: &[f32], scale: f32| -> Vec<f32> {
            (0..n_t)
                .flat_map(|tt| {
                    x[(tt * heads + h) * d..(tt * heads + h + 1) * d]
                        .iter()
                        .map(move |&e| e * scale)
                })
                .collect()
        };
        let bh: Vec<f32> = (0..n_t).map(|tt| beta[tt * heads + h]).collect();
        let s = &mut state[h * d * d..(h + 1) * d * d];
        let o = kda::recur_head(
            &gather(&q, q_scale),
            &gather(&k, 1.0),
            &gather(&v, 1.0),
            &gather(&a, 1.0),
            &bh,
            s,
            d,
        );
        for tt in 0..n_t {
            out[(tt * heads + h) * d..(tt * heads + h + 1) * d]
                .copy_from_slice(&o[tt * d..(tt + 1) * d]);
        }
    }
    rep.cmp("out", &out, &t(&f["out"]));
    rep.cmp("state_out", &state, &t(&f["state_out"]));
    rep.finish();
}

#[test]
fn kda_recur1_fixture() {
    kda_recur_fixture("kda_recur1");
}

#[test]
fn kda_recur8_fixture() {
    kda_recur_fixture("kda_recur8");
}

fn kda_layer_fixture(name: &'static str) {
    let f = fx(name);
    let mut rep = Report::new(name);
    let w = kda_weights(&f, &|n: &str| n.to_string());
    let p = KdaParams {
        heads: int(&f["H"]),
        head_dim: int(&f["d_k"]),
        kernel: int(&f["conv_k"]),
        lower_bound: num(&f["lower_bound"]) as f32,
        rms_eps: num(&f["rms_eps"]) as f32,
        l2_eps: L2_EPS,
    };
    let x = t(&f["in"]);
    let n_t = int(&f["T"]);
    assert_eq!(x.len(), n_t * w.q_proj.cols);
    let mut st = KdaState::new(&p);
    let out = kda::forward(&w, &p, &x, &mut st);
    rep.cmp("out", &out, &t(&f["out"]));
    rep.cmp("state_out", &st.s, &t(&f["state_out"]));
    // Token-by-token decode gives the same bits as the chunk (docs/model.md#prefill-and-decode).
    let hidden = w.q_proj.cols;
    let mut st1 = KdaState::new(&p);
    let mut out1 = Vec::with_capacity(out.len());
    for xt in x.chunks(hidden) {
        out1.extend(kda::forward(&w, &p, xt, &mut st1));
    }
    rep.require(first_bit_diff(&out, &out1).is_none() && st == st1, || {
        format!(
            "token-by-token differs from chunk (first out diff {:?})",
            first_bit_diff(&out, &out1)
        )
    });
    rep.finish();
}

#[test]
fn kda_layer1_fixture() {
    kda_layer_fixture("kda_layer1");
}

#[test]
fn kda_layer8_fixture() {
    kda_layer_fixture("kda_layer8");
}

// ---------------------------------------------------------------------------------------------
// Router, AttnRes, MLA, MoE
// ---------------------------------------------------------------------------------------------

#[test]
fn router_fixture() {
    let f = fx("router");
    let mut rep = Report::new("router");
    let top_k = int(&f["top_k"]);
    let n_exp = int(&f["n_experts"]);
    let gw = t(&f["gate_weight"]);
    let bias = t(&f["bias"]);
    let x = t(&f["in"]);
    let cols = shape(&f["gate_weight"])[1];
    let n_tok = x.len() / cols;
    let p = MoeParams {
        top_k,
        renormalize: cfg("moe_renormalize").as_bool().unwrap(),
        scaling: num(cfg("routed_scaling_factor")) as f32,
        rms_eps: 1e-5,
        beta1: 4.0,
        beta2: 25.0,
    };
    let want_idx = t(&f["topk_idx"]);
    let want_w = t(&f["topk_weight"]);
    let mut logits = vec![0f32; n_tok * n_exp];
    matmul_with(
        detected_isa(),
        DenseRef::F32(&gw),
        n_exp,
        cols,
        &x,
        &mut logits,
    );
    let (mut got_w, mut exp_w) = (Vec::new(), Vec::new());
    let mut changed = 0;
    for tok in 0..n_tok {
        let l = &logits[tok * n_exp..(tok + 1) * n_exp];
        let (idx, w) = moe::route(l, &bias, &p);
        let mut want: Vec<usize> = want_idx[tok * top_k..(tok + 1) * top_k]
            .iter()
            .map(|&e| e as usize)
            .collect();
        let mut got = idx.clone();
        got.sort_unstable();
        want.sort_unstable();
        rep.require(got == want, || {
            format!("token {tok}: selected {got:?}, want {want:?}")
        });
        for j in 0..top_k {
            let e = want_idx[tok * top_k + j] as usize;
            if let Some(pos) = idx.iter().position(|&i| i == e) {
                got_w.push(w[pos]);
                exp_w.push(want_w[tok * top_k + j]);
            }
        }
        // How often the bias changed the selection (fixture says 5 of 6 rows).
        let (mut unb, _) = moe::route(l, &vec![0.0; n_exp], &p);
        unb.sort_unstable();
        if unb != got {
            changed += 1;
        }
    }
    rep.cmp("topk_weight (per expert)", &got_w, &exp_w);
    rep.require(got_w.len() == n_tok * top_k, || {
        "not every expected expert selected".into()
    });
    rep.require(
        changed == int(&f["rows_where_bias_changed_selection"]),
        || format!("bias changed {changed} rows"),
    );

    // A BF16-typed router is bit-identical to an F32 router on the widened weights, on every
    // path, through the kernels and through `Dense`.
    let (bits, wide) = bf16_round(&gw);
    let mut reference: Option<Vec<f32>> = None;
    for isa in paths() {
        let (mut yb, mut yf) = (vec![0f32; n_tok * n_exp], vec![0f32; n_tok * n_exp]);
        matmul_with(isa, DenseRef::Bf16(&bits), n_exp, cols, &x, &mut yb);
        matmul_with(isa, DenseRef::F32(&wide), n_exp, cols, &x, &mut yf);
        rep.require(first_bit_diff(&yb, &yf).is_none(), || {
            format!("{isa:?}: BF16 router logits != F32-widened")
        });
        match &reference {
            None => reference = Some(yb),
            Some(r) => rep.require(first_bit_diff(r, &yb).is_none(), || {
                format!("{isa:?}: BF16 logits differ from Generic")
            }),
        }
    }
    let db = Dense {
        data: DenseData::Bf16(k3::stream::bytes::U16s::from_vec(&bits)),
        rows: n_exp,
        cols,
    };
    let df = Dense::f32(wide, n_exp, cols);
    let (lb, lf) = (db.apply(&x), df.apply(&x));
    rep.require(first_bit_diff(&lb, &lf).is_none(), || {
        "Dense BF16 apply != F32-widened".into()
    });
    for tok in 0..n_tok {
        let (ib, wb) = moe::route(&lb[tok * n_exp..(tok + 1) * n_exp], &bias, &p);
        let (i_f, wf) = moe::route(&lf[tok * n_exp..(tok + 1) * n_exp], &bias, &p);
        rep.require(ib == i_f && first_bit_diff(&wb, &wf).is_none(), || {
            format!("token {tok}: BF16 routing differs")
        });
    }
    println!(
        "router: BF16 vs F32-widened logits and routing bit-identical on {:?}",
        paths()
    );
    rep.finish();
}

#[test]
fn attnres_fixture() {
    let f = fx("attnres");
    let mut rep = Report::new("attnres");
    let eps = num(&f["eps"]) as f32;
    let d = shape(&f["prefix_sum"])[1];
    let norm = t(&f["norm_weight"]);
    let proj = t(&f["proj_weight"]);
    let fold: Vec<f32> = norm.iter().zip(&proj).map(|(a, b)| a * b).collect();
    rep.cmp("fold", &fold, &t(&f["fold_hint"]));
    let snaps = split_snapshots(&f["block_residual"]);
    let prefix = t(&f["prefix_sum"]);
    let mut srcs: Vec<&[f32]> = snaps.iter().map(Vec::as_slice).collect();
    srcs.push(&prefix);
    assert_eq!(srcs.len(), int(&f["n_sources"]));
    let mut out = vec![0f32; prefix.len()];
    attnres::aggregate(&srcs, &fold, eps, d, &mut out);
    rep.cmp("out", &out, &t(&f["out"]));
    rep.finish();
}

#[test]
fn mla_fixture() {
    let f = fx("mla");
    let mut rep = Report::new("mla");
    let w = mla_weights(&f, "");
    let p = MlaParams {
        heads: int(&f["n_heads"]),
        nope: int(&f["qk_nope"]),
        rope: int(&f["qk_rope"]),
        v: int(&f["v_head"]),
        kv_lora: int(&f["kv_lora"]),
        lora_eps: num(&f["rms_eps"]) as f32,
    };
    assert_eq!(w.q_a.rows, int(&f["q_lora"]));
    // The engine scales by (nope + rope)^-0.5; the fixture's scale must be that.
    let scale = num(&f["scale"]);
    assert!(
        (scale - 1.0 / ((p.nope + p.rope) as f64).sqrt()).abs() < 1e-7,
        "scale {scale}"
    );
    let x = t(&f["in"]);
    let mut cache = Vec::new();
    let out = mla::forward(&w, &p, &x, &mut cache);
    rep.cmp("out", &out, &t(&f["out"]));
    let cw = p.cache_width();
    let n_tok = x.len() / w.q_a.cols;
    assert_eq!(cache.len(), n_tok * cw, "cache rows appended");
    let lat: Vec<f32> = cache
        .chunks(cw)
        .flat_map(|r| r[..p.kv_lora].to_vec())
        .collect();
    let rope: Vec<f32> = cache
        .chunks(cw)
        .flat_map(|r| r[p.kv_lora..].to_vec())
        .collect();
    rep.cmp("cache kv_latent", &lat, &t(&f["kv_latent"]));
    rep.cmp("cache k_rope", &rope, &t(&f["k_rope"]));
    // Token-by-token decode over the growing cache gives the same bits as the chunk.
    let hidden = w.q_a.cols;
    let mut cache1 = Vec::new();
    let mut out1 = Vec::with_capacity(out.len());
    for xt in x.chunks(hidden) {
        out1.extend(mla::forward(&w, &p, xt, &mut cache1));
    }
    rep.require(
        first_bit_diff(&out, &out1).is_none() && first_bit_diff(&cache, &cache1).is_none(),
        || {
            format!(
                "token-by-token differs from chunk (first out diff {:?})",
                first_bit_diff(&out, &out1)
            )
        },
    );
    rep.finish();
}

#[test]
fn moe_fixture() {
    let f = fx("moe");
    let mut rep = Report::new("moe");
    let n_exp = int(&f["n_experts"]);
    assert_eq!(
        int(&f["latent_norm"]),
        1,
        "the engine always norms the routed aggregate"
    );
    let w = moe_weights(&f, "", n_exp);
    assert_eq!(w.down.rows, int(&f["latent"]));
    assert_eq!(
        w.shared_gate.rows,
        int(&f["n_shared"]) * int(&f["moe_inter"])
    );
    let p = MoeParams {
        top_k: int(&f["top_k"]),
        renormalize: int(&f["renorm"]) == 1,
        scaling: num(&f["routed_scale"]) as f32,
        rms_eps: num(&f["rms_eps"]) as f32,
        beta1: num(&f["situ_b1"]) as f32,
        beta2: num(&f["situ_b2"]) as f32,
    };
    let x = t(&f["in"]);
    let (out, routing) = moe::forward(&w, &p, &x);
    println!("moe: routing {routing:?}");
    rep.cmp("out", &out, &t(&f["out"]));
    // BF16 router: bit-identical to the F32 router on the widened weights, through the block.
    let gw = match &w.gate.data {
        DenseData::F32(v) => v.clone(),
        DenseData::Bf16(_) | DenseData::Coded(_) => unreachable!(),
    };
    let (bits, wide) = bf16_round(&gw);
    let (rows, cols) = (w.gate.rows, w.gate.cols);
    let mut wb = w.clone();
    wb.gate = Dense {
        data: DenseData::Bf16(k3::stream::bytes::U16s::from_vec(&bits)),
        rows,
        cols,
    };
    let mut wf = w;
    wf.gate = Dense::f32(wide, rows, cols);
    let (ob, rb) = moe::forward(&wb, &p, &x);
    let (of, rf) = moe::forward(&wf, &p, &x);
    let same_routing = rb.len() == rf.len()
        && rb
            .iter()
            .zip(&rf)
            .all(|(a, b)| a.0 == b.0 && first_bit_diff(&a.1, &b.1).is_none());
    rep.require(same_routing && first_bit_diff(&ob, &of).is_none(), || {
        "BF16-gated MoE differs from F32-widened gate".into()
    });
    rep.finish();
}

// ---------------------------------------------------------------------------------------------
// Whole layers (docs/model.md#decoder-layer, reproduced with the public blocks)
// ---------------------------------------------------------------------------------------------

fn layer_fixture(name: &'static str) {
    let f = fx(name);
    let mut rep = Report::new(name);
    let il = int(&f["layer_idx"]);
    let block = int(&f["attn_res_block_size"]);
    let eps = num(&f["rms_eps"]) as f32;
    let d = int(&f["hidden"]);
    let is_mla = f["is_mla"].as_bool().unwrap();
    let fold = |which: &str| -> Vec<f32> {
        let n = t(&f[format!("{which}_res_norm_weight").as_str()]);
        let p = t(&f[format!("{which}_res_proj_weight").as_str()]);
        assert_eq!(n.len(), d);
        assert_eq!(p.len(), d);
        n.iter().zip(&p).map(|(a, b)| a * b).collect()
    };
    let (attn_fold, mlp_fold) = (fold("self_attention"), fold("mlp"));
    let input_norm = t(&f["input_layernorm_weight"]);
    let post_norm = t(&f["post_attention_layernorm_weight"]);
    let mix = |blocks: &[Vec<f32>], partial: Option<&Vec<f32>>, fold: &[f32]| -> Vec<f32> {
        let mut srcs: Vec<&[f32]> = blocks.iter().map(Vec::as_slice).collect();
        if let Some(p) = partial {
            srcs.push(p);
        }
        let mut out = vec![0f32; srcs[0].len()];
        attnres::aggregate(&srcs, fold, eps, d, &mut out);
        out
    };

    let mut blocks = split_snapshots(&f["block_residual_in"]);
    // 1. p ← h.
    let p_in = t(&f["in"]);
    // 2. Pre-attention mix when B is non-empty.
    let mut h = if blocks.is_empty() {
        p_in.clone()
    } else {
        mix(&blocks, Some(&p_in), &attn_fold)
    };
    // 3. Block boundary: push p, clear it.
    let mut partial = if il.is_multiple_of(block) {
        blocks.push(p_in);
        None
    } else {
        Some(p_in)
    };
    // 4. Input norm.
    for row in h.chunks_mut(d) {
        rmsnorm(row, &input_norm, eps);
    }
    // 5. Attention.
    let a = if is_mla {
        let w = mla_weights(&f, "self_attn_");
        let p = MlaParams {
            heads: int(cfg("num_attention_heads")),
            nope: int(cfg("qk_nope_head_dim")),
            rope: int(cfg("qk_rope_head_dim")),
            v: int(cfg("v_head_dim")),
            kv_lora: int(cfg("kv_lora_rank")),
            lora_eps: eps, // the fixtures use rms_eps in the MLA LoRA norms
        };
        mla::forward(&w, &p, &h, &mut Vec::new())
    } else {
        let w = kda_weights(&f, &layer_kda_key);
        let p = KdaParams {
            heads: int(cfg("kda_num_heads")),
            head_dim: int(cfg("kda_head_dim")),
            kernel: int(cfg("short_conv_kernel_size")),
            lower_bound: num(cfg("gate_lower_bound")) as f32,
            rms_eps: eps,
            l2_eps: L2_EPS,
        };
        let mut st = KdaState::new(&p);
        kda::forward(&w, &p, &h, &mut st)
    };
    // 6. p ← a or p + a.
    let mut partial = match partial.take() {
        None => a,
        Some(mut p) => {
            for (x, y) in p.iter_mut().zip(&a) {
                *x += y;
            }
            p
        }
    };
    // 7–8. Pre-FFN mix (always), post-attention norm.
    let mut h = mix(&blocks, Some(&partial), &mlp_fold);
    for row in h.chunks_mut(d) {
        rmsnorm(row, &post_norm, eps);
    }
    // 9–10. MoE, added to the partial sum.
    let n_exp = int(cfg("num_experts"));
    let mw = moe_weights(&f, "mlp_", n_exp);
    let (ff, _) = moe::forward(&mw, &cfg_moe_params(eps), &h);
    for (x, y) in partial.iter_mut().zip(&ff) {
        *x += y;
    }
    rep.cmp("out", &partial, &t(&f["out"]));
    let want_blocks = &f["block_residual_out"];
    rep.require(blocks.len() == shape(want_blocks)[1], || {
        format!(
            "{} snapshots after the layer, want {}",
            blocks.len(),
            shape(want_blocks)[1]
        )
    });
    if blocks.len() == shape(want_blocks)[1] {
        rep.cmp(
            "block_residual_out",
            &join_snapshots(&blocks, d),
            &t(want_blocks),
        );
    }
    rep.finish();
}

#[test]
fn layer_kda_fixture() {
    layer_fixture("layer_kda");
}

#[test]
fn layer_mla_fixture() {
    layer_fixture("layer_mla");
}

// ---------------------------------------------------------------------------------------------
// MXFP4
// ---------------------------------------------------------------------------------------------

#[test]
fn mxfp4_fixture() {
    let f = fx("mxfp4");
    let mut rep = Report::new("mxfp4");
    let rows = int(&f["rows"]);
    let cols = int(&f["logical_width"]);
    assert_eq!(int(&f["group_size"]), 32);
    assert_eq!(int(&f["packed_cols"]) * 2, cols);
    assert_eq!(int(&f["scale_cols"]) * 32, cols);
    let lut: Vec<f32> = f["e2m1_lut"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    rep.require(
        lut.iter()
            .zip(E2M1.iter())
            .all(|(a, b)| a.to_bits() == b.to_bits())
            && lut.len() == 16,
        || format!("E2M1 table {E2M1:?} != fixture {lut:?}"),
    );
    let packed = t_u8(&f["packed"]);
    let scales = t_u8(&f["scales"]);
    let expected = t(&f["expected"]);
    assert_eq!(expected.len(), rows * cols);

    // Exact decode, element by element, including the sign of zero.
    let decoded: Vec<f32> = (0..rows * cols)
        .map(|i| element(&packed, &scales, i))
        .collect();
    let n_diff = decoded
        .iter()
        .zip(&expected)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    let first = first_bit_diff(&decoded, &expected);
    println!(
        "mxfp4: decode {n_diff}/{} elements differ bitwise",
        rows * cols
    );
    rep.require(n_diff == 0, || {
        let i = first.unwrap_or(0);
        format!(
            "decode: {n_diff} differ; first [{i}] got {} want {}",
            decoded[i], expected[i]
        )
    });
    // Worked example of docs/model.md#mxfp4-experts.
    let worked = [
        0.0625f32, 0.0078125, -0.0078125, -0.0234375, -0.0625, -0.03125,
    ];
    rep.require(decoded[..6] == worked, || {
        format!("worked example: {:?}", &decoded[..6])
    });
    // The swapped nibble order gives different values, and is what the fixture records.
    let swapped = t(&serde_json::json!({
        "shape": [f["expected_swapped_nibbles"]["first64"].as_array().unwrap().len()],
        "data": f["expected_swapped_nibbles"]["first64"].clone(),
    }));
    let n = swapped.len();
    rep.require(first_bit_diff(&decoded[..n], &swapped).is_some(), || {
        "swapped nibbles equal the decode".into()
    });
    let mine_swapped: Vec<f32> = (0..n).map(|i| element(&packed, &scales, i ^ 1)).collect();
    rep.require(first_bit_diff(&mine_swapped, &swapped).is_none(), || {
        "swapped-nibble record not reproduced".into()
    });

    // Fused products on every path vs an f64 reference on the decoded matrix.
    let m = Mxfp4Matrix::new(&packed, &scales, rows, cols).expect("mxfp4 geometry");
    let mut rng = Rng(0x4d58_4650_3421);
    let x: Vec<f32> = (0..cols).map(|_| rng.unit()).collect();
    let (mut max_d, mut max_ref, mut worst_cond) = (0f64, 0f64, 0f64);
    let mut ys: Vec<(Isa, Vec<f32>)> = Vec::new();
    for isa in [Isa::Generic, detected_isa()].into_iter().chain(paths()) {
        let mut y = vec![0f32; rows];
        matmul_mxfp4_with(isa, &m, &x, &mut y);
        ys.push((isa, y));
    }
    let y = &ys[0].1;
    for r in 0..rows {
        let row = &expected[r * cols..(r + 1) * cols];
        let reference: f64 = row
            .iter()
            .zip(&x)
            .map(|(&w, &xi)| f64::from(w) * f64::from(xi))
            .sum();
        let mag: f64 = row
            .iter()
            .zip(&x)
            .map(|(&w, &xi)| (f64::from(w) * f64::from(xi)).abs())
            .sum();
        let dlt = (f64::from(y[r]) - reference).abs();
        max_d = max_d.max(dlt);
        max_ref = max_ref.max(reference.abs());
        worst_cond = worst_cond.max(dlt / mag);
    }
    let rel = max_d / max_ref;
    println!("mxfp4: matmul vs f64 reference: max|d| {max_d:.3e}, max|d|/max|ref| {rel:.3e}, worst |d|/sum|w x| {worst_cond:.3e}");
    rep.require(rel <= 1e-5, || format!("matmul relative error {rel:e}"));
    rep.require(worst_cond <= 1e-5, || {
        format!("matmul per-row error {worst_cond:e} of sum|w x|")
    });
    for (isa, yi) in &ys[1..] {
        rep.require(first_bit_diff(y, yi).is_none(), || {
            format!("mxfp4 matmul {isa:?} differs from Generic")
        });
    }
    // A batch equals its single products, bit for bit, on every path: batches below, at and
    // beyond the four vectors the multi-vector kernel takes at once, with remainders.
    for n_tok in [3, 4, 5, 8, 11] {
        let xb: Vec<f32> = (0..n_tok * cols).map(|_| rng.unit()).collect();
        for isa in paths() {
            let mut yb = vec![0f32; n_tok * rows];
            matmul_mxfp4_with(isa, &m, &xb, &mut yb);
            for tok in 0..n_tok {
                let mut y1 = vec![0f32; rows];
                matmul_mxfp4_with(Isa::Generic, &m, &xb[tok * cols..(tok + 1) * cols], &mut y1);
                rep.require(
                    first_bit_diff(&yb[tok * rows..(tok + 1) * rows], &y1).is_none(),
                    || format!("mxfp4 {isa:?}: batch of {n_tok}, row {tok} != single generic"),
                );
            }
        }
    }
    println!("mxfp4: paths {:?} bitwise equal", paths());
    rep.finish();
}

// ---------------------------------------------------------------------------------------------
// Kernel paths: SIMD vs scalar twin, bit for bit
// ---------------------------------------------------------------------------------------------

const WIDTHS: [usize; 12] = [1, 15, 16, 17, 31, 33, 100, 448, 1792, 3584, 7168, 7168 + 15];

#[test]
fn kernel_paths_bitwise() {
    let mut rng = Rng(0x6b33_6b65_726e);
    let isas = paths();
    println!("kernels: detected {:?}, comparing {isas:?}", detected_isa());
    let mut n_cmp = 0usize;
    for &n in &WIDTHS {
        // Dot products.
        let (a, b) = (rng.vec(n), rng.vec(n));
        let (wb, wide) = bf16_round(&rng.vec(n));
        let d0 = dot_with(Isa::Generic, &a, &b);
        let e0 = dot_bf16_with(Isa::Generic, &wb, &b);
        for &isa in &isas {
            let d = dot_with(isa, &a, &b);
            assert_eq!(
                d.to_bits(),
                d0.to_bits(),
                "dot f32 width {n} {isa:?}: {d} vs {d0}"
            );
            let e = dot_bf16_with(isa, &wb, &b);
            assert_eq!(
                e.to_bits(),
                e0.to_bits(),
                "dot bf16 width {n} {isa:?}: {e} vs {e0}"
            );
            let ew = dot_with(isa, &wide, &b);
            assert_eq!(
                e.to_bits(),
                ew.to_bits(),
                "dot bf16 vs widened f32 width {n} {isa:?}"
            );
            n_cmp += 3;
        }
        // axpy.
        let mut y0 = b.clone();
        axpy_with(Isa::Generic, 0.37, &a, &mut y0);
        for &isa in &isas {
            let mut y = b.clone();
            axpy_with(isa, 0.37, &a, &mut y);
            assert!(first_bit_diff(&y, &y0).is_none(), "axpy width {n} {isa:?}");
            n_cmp += 1;
        }
        // Matrix products: single vector and a batch of 5 vs 5 single calls.
        for rows in [1usize, 9, 37] {
            let wf = rng.vec(rows * n);
            let (wbits, wwide) = bf16_round(&rng.vec(rows * n));
            let x5 = rng.vec(5 * n);
            let mut ref_f: Option<Vec<f32>> = None;
            let mut ref_b: Option<Vec<f32>> = None;
            for &isa in &isas {
                for (kind, w) in [
                    ("f32", DenseRef::F32(&wf)),
                    ("bf16", DenseRef::Bf16(&wbits)),
                ] {
                    let mut y5 = vec![0f32; 5 * rows];
                    matmul_with(isa, w, rows, n, &x5, &mut y5);
                    for tok in 0..5 {
                        let mut y1 = vec![0f32; rows];
                        matmul_with(isa, w, rows, n, &x5[tok * n..(tok + 1) * n], &mut y1);
                        assert!(
                            first_bit_diff(&y5[tok * rows..(tok + 1) * rows], &y1).is_none(),
                            "matmul {kind} {rows}x{n} {isa:?}: batch row {tok} != single call"
                        );
                        // Each output is the same fixed-order dot product.
                        for r in 0..rows {
                            let dr = match w {
                                DenseRef::F32(m) => dot_with(
                                    isa,
                                    &m[r * n..(r + 1) * n],
                                    &x5[tok * n..(tok + 1) * n],
                                ),
                                DenseRef::Bf16(m) => dot_bf16_with(
                                    isa,
                                    &m[r * n..(r + 1) * n],
                                    &x5[tok * n..(tok + 1) * n],
                                ),
                            };
                            assert_eq!(
                                dr.to_bits(),
                                y1[r].to_bits(),
                                "matmul {kind} {rows}x{n} {isa:?} row {r} != dot"
                            );
                        }
                    }
                    let slot = if kind == "f32" {
                        &mut ref_f
                    } else {
                        &mut ref_b
                    };
                    match slot {
                        None => *slot = Some(y5),
                        Some(r0) => assert!(
                            first_bit_diff(r0, &y5).is_none(),
                            "matmul {kind} {rows}x{n}: {isa:?} != Generic"
                        ),
                    }
                    n_cmp += 1;
                }
                // BF16 equals F32 on the widened weights, bit for bit.
                let (mut yb, mut yw) = (vec![0f32; 5 * rows], vec![0f32; 5 * rows]);
                matmul_with(isa, DenseRef::Bf16(&wbits), rows, n, &x5, &mut yb);
                matmul_with(isa, DenseRef::F32(&wwide), rows, n, &x5, &mut yw);
                assert!(
                    first_bit_diff(&yb, &yw).is_none(),
                    "matmul bf16 vs widened f32 {rows}x{n} {isa:?}"
                );
                n_cmp += 1;
            }
        }
    }
    println!("kernels: {n_cmp} path comparisons over widths {WIDTHS:?}, all bitwise equal");
}

/// MXFP4 products on every path equal the scalar twin's bit for bit: odd and even row counts
/// (the AVX-512 kernel takes rows two at a time and leaves an odd one to the one-row kernel),
/// widths of one to 56 groups, every scale byte (255 included, which contributes nothing),
/// every nibble, batches of one to 19 vectors (each kernel width and remainder), and one to
/// three threads (so tasks hold odd and even numbers of rows).
#[test]
fn mxfp4_products_are_bitwise_equal_on_every_path_row_pairing_batch_and_thread_count() {
    let mut rng = Rng(0x4d58_3450_6169);
    let isas = paths();
    let mut n_cmp = 0usize;
    for (rows, cols) in [
        (1usize, 32usize),
        (2, 64),
        (3, 96),
        (7, 1024),
        (13, 160),
        (64, 1792),
        (37, 448),
    ] {
        let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next_u64() as u8).collect();
        // Every scale byte appears (0..=255 cycled from a random start), so 255 and the
        // extremes meet every nibble.
        let start = rng.next_u64() as usize;
        let scales: Vec<u8> = (0..rows * cols / 32)
            .map(|i| {
                if rows * cols / 32 >= 256 {
                    ((start + i) % 256) as u8
                } else {
                    // Small matrices: scales near 127 keep products finite, with 0 and 255 in.
                    [0u8, 255, 120, 127, 134, 140][(start + i) % 6]
                }
            })
            .collect();
        let m = Mxfp4Matrix::new(&packed, &scales, rows, cols).expect("geometry");
        for n_tok in [1usize, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 19] {
            let x = rng.vec(n_tok * cols);
            let mut want = vec![0f32; n_tok * rows];
            for t in 0..n_tok {
                matmul_mxfp4_with(
                    Isa::Generic,
                    &m,
                    &x[t * cols..(t + 1) * cols],
                    &mut want[t * rows..(t + 1) * rows],
                );
            }
            for threads in [1usize, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .expect("pool");
                for &isa in &isas {
                    let mut y = vec![0f32; n_tok * rows];
                    pool.install(|| matmul_mxfp4_with(isa, &m, &x, &mut y));
                    if let Some(i) = first_bit_diff(&y, &want) {
                        panic!(
                            "mxfp4 {rows}x{cols}, {n_tok} vectors, {threads} threads, {isa:?}: \
                             [{i}] = {} against the scalar twin's {}",
                            y[i], want[i]
                        );
                    }
                    n_cmp += 1;
                }
            }
        }
    }
    println!("mxfp4: {n_cmp} products on paths {isas:?}, all bitwise equal to the scalar twin");
}

/// A one-token product gives the same bits whichever row order walks the matrix, on every path,
/// and each output is the single-row dot product; the order chosen once per process (timed on
/// a synthetic matrix, or fixed by `K3_ROW_ORDER`) is then the one in force, and products in
/// it give the same bits too. The orders are passed as parameters: nothing here changes what
/// other tests multiply with.
#[test]
fn one_token_products_are_bitwise_equal_in_both_row_orders_and_the_order_is_chosen_once() {
    let mut rng = Rng(0x5eed_0417);
    for &isa in &paths() {
        for (rows, n) in [(5usize, 16usize), (64, 37), (130, 2048), (9, 300)] {
            let wf = rng.vec(rows * n);
            let (wbits, _) = bf16_round(&rng.vec(rows * n));
            let x = rng.vec(n);
            for (kind, w) in [
                ("f32", DenseRef::F32(&wf)),
                ("bf16", DenseRef::Bf16(&wbits)),
            ] {
                let mut by_order = Vec::new();
                for order in [RowOrder::Fours, RowOrder::Single] {
                    let mut y = vec![0f32; rows];
                    matmul_ordered(isa, order, w, rows, n, &x, &mut y);
                    by_order.push(y);
                }
                assert!(
                    first_bit_diff(&by_order[0], &by_order[1]).is_none(),
                    "matmul {kind} {rows}x{n} {isa:?}: row orders differ"
                );
                let mut in_force = vec![0f32; rows];
                matmul_with(isa, w, rows, n, &x, &mut in_force);
                assert!(first_bit_diff(&by_order[0], &in_force).is_none());
                for (r, &got) in by_order[0].iter().enumerate() {
                    let want = match w {
                        DenseRef::F32(m) => dot_with(isa, &m[r * n..(r + 1) * n], &x),
                        DenseRef::Bf16(m) => dot_bf16_with(isa, &m[r * n..(r + 1) * n], &x),
                    };
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{kind} {rows}x{n} {isa:?} row {r}"
                    );
                }
            }
        }
    }
    // Chosen once: the same answer every time, and in force afterwards.
    let chosen = k3::kernels::calibrate_row_order();
    assert_eq!(k3::kernels::calibrate_row_order(), chosen);
    assert_eq!(row_order(), Some(chosen));
    if detected_isa() == Isa::Generic {
        assert_eq!(chosen, RowOrder::Single, "the scalar path has one order");
    }
}

/// The attention kernels over cached rows give, on every path, bitwise what the per-position
/// calls give: `scores` = two `dot`s times the scale per row, `axpy_rows` = `axpy` row after row
/// (widths with and without a tail of fewer than 8, and more rows than one tile).
#[test]
fn attention_scores_and_weighted_rows_equal_the_per_position_calls_on_every_path() {
    let mut rng = Rng(0xa77e_0001);
    for (la, lr, n_rows) in [
        (64usize, 32usize, 150usize),
        (37, 11, 70),
        (512, 64, 9),
        (16, 0, 1),
    ] {
        let stride = la + lr;
        let rows = rng.vec(n_rows * stride);
        let qa = rng.vec(la);
        let qr = rng.vec(lr);
        let scale = 0.125f32;
        for &isa in &paths() {
            let mut got = vec![0f32; n_rows];
            scores_with(isa, &qa, &qr, &rows, stride, scale, &mut got);
            for (t, &g) in got.iter().enumerate() {
                let row = &rows[t * stride..(t + 1) * stride];
                let want =
                    (dot_with(isa, &qa, &row[..la]) + dot_with(isa, &qr, &row[la..])) * scale;
                assert_eq!(
                    g.to_bits(),
                    want.to_bits(),
                    "scores {la}+{lr} {isa:?} row {t}"
                );
            }
            for width in [la, la.min(7), la.saturating_sub(3).max(1)] {
                let a = rng.vec(n_rows);
                let y0 = rng.vec(width);
                let mut want = y0.clone();
                for (t, &at) in a.iter().enumerate() {
                    axpy_with(isa, at, &rows[t * stride..t * stride + width], &mut want);
                }
                let mut y = y0.clone();
                axpy_rows_with(isa, &a, &rows, stride, &mut y);
                assert!(
                    first_bit_diff(&y, &want).is_none(),
                    "axpy_rows width {width} stride {stride} rows {n_rows} {isa:?}"
                );
            }
        }
    }
}
