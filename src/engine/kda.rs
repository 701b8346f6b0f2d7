//! Kimi Delta Attention: gated delta-rule linear attention with a short causal convolution
//! (docs/model.md#kimi-delta-attention). Tokens are processed strictly in order; heads run in parallel, each owning
//! its slice of the recurrent state, so the result does not depend on the thread count.

use super::tensor::{fit, Dense};
use crate::kernels::{self, ops};
use rayon::prelude::*;

/// Weights of one KDA attention block. `P = heads · head_dim`.
#[derive(Clone, Debug)]
pub struct KdaWeights {
    /// `[P, hidden]`.
    pub q_proj: Dense,
    /// `[P, hidden]`.
    pub k_proj: Dense,
    /// `[P, hidden]`.
    pub v_proj: Dense,
    /// `[P, K]` conv taps for q (tap K−1 multiplies the current input).
    pub q_conv: Vec<f32>,
    /// `[P, K]`.
    pub k_conv: Vec<f32>,
    /// `[P, K]`.
    pub v_conv: Vec<f32>,
    /// `[head_dim, hidden]` decay low-rank down.
    pub f_a: Dense,
    /// `[P, head_dim]` decay low-rank up.
    pub f_b: Dense,
    /// `[heads]` per-head log scale (first `heads` values of the checkpoint tensor).
    pub a_log: Vec<f32>,
    /// `[P]` per-channel decay bias.
    pub dt_bias: Vec<f32>,
    /// `[heads, hidden]` write-strength logits.
    pub b_proj: Dense,
    /// `[P, hidden]` output gate.
    pub g_proj: Dense,
    /// `[head_dim]` head-wise output norm gain.
    pub o_norm: Vec<f32>,
    /// `[hidden, P]`.
    pub o_proj: Dense,
}

/// Shape and constants of a KDA block.
#[derive(Clone, Copy, Debug)]
pub struct KdaParams {
    /// Heads.
    pub heads: usize,
    /// d_k = d_v.
    pub head_dim: usize,
    /// Conv taps.
    pub kernel: usize,
    /// g_min (negative).
    pub lower_bound: f32,
    /// Epsilon of the head-wise output RMSNorm.
    pub rms_eps: f32,
    /// Epsilon of the q/k L2 norm.
    pub l2_eps: f32,
}

/// Carried state of one KDA layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KdaState {
    /// `[heads, head_dim (key), head_dim (value)]` recurrent matrices.
    pub s: Vec<f32>,
    /// `[3][P, K−1]` last K−1 pre-convolution inputs of q, k, v (oldest first).
    pub conv: [Vec<f32>; 3],
}

impl KdaState {
    /// Zero state for a fresh sequence.
    #[must_use]
    pub fn new(p: &KdaParams) -> Self {
        let width = p.heads * p.head_dim;
        let hist = width * (p.kernel - 1);
        KdaState {
            s: vec![0.0; p.heads * p.head_dim * p.head_dim],
            conv: [vec![0.0; hist], vec![0.0; hist], vec![0.0; hist]],
        }
    }
}

/// Decay `α = exp(g_min · σ(exp(A_log[h]) · (z + dt_bias)))` for one token's `z` `[P]`.
pub fn decay(z: &[f32], a_log: &[f32], dt_bias: &[f32], p: &KdaParams, alpha: &mut [f32]) {
    for (c, a) in alpha.iter_mut().enumerate() {
        let h = c / p.head_dim;
        let g = p.lower_bound * ops::sigmoid(a_log[h].exp() * (z[c] + dt_bias[c]));
        *a = g.exp();
    }
}

/// The delta-rule recurrence of one head over `n_tok` steps.
///
/// `q, k, v, alpha` are `[n_tok, d]` for this head (q already scaled), `beta` is `[n_tok]`;
/// `s` is `[d, d]` (key rows, value columns); returns `o` `[n_tok, d]`.
#[must_use]
pub fn recur_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    alpha: &[f32],
    beta: &[f32],
    s: &mut [f32],
    d: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; beta.len() * d];
    let mut uw = vec![0f32; 2 * d];
    recur_head_into(q, k, v, alpha, beta, s, d, &mut out, &mut uw);
    out
}

/// [`recur_head`] into `out` `[n_tok, d]` (overwritten), with `uw` (`2·d`) as scratch.
#[allow(clippy::too_many_arguments)]
pub fn recur_head_into(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    alpha: &[f32],
    beta: &[f32],
    s: &mut [f32],
    d: usize,
    out: &mut [f32],
    uw: &mut [f32],
) {
    let (u, w) = uw.split_at_mut(d);
    out.fill(0.0);
    for (t, (o, &bt)) in out.chunks_mut(d).zip(beta).enumerate() {
        let row = t * d..(t + 1) * d;
        let (qt, kt, vt, at) = (
            &q[row.clone()],
            &k[row.clone()],
            &v[row.clone()],
            &alpha[row],
        );
        // a + b: decay the key rows, then read u = Sᵀk.
        u.fill(0.0);
        for ((si, &ai), &ki) in s.chunks_mut(d).zip(at).zip(kt) {
            for x in si.iter_mut() {
                *x *= ai;
            }
            kernels::axpy(ki, si, u);
        }
        // c: delta write S += k (β (v − u))ᵀ; d: o = Sᵀ q̂ from the updated state.
        for ((wj, &vj), &uj) in w.iter_mut().zip(vt).zip(u.iter()) {
            *wj = bt * (vj - uj);
        }
        for ((si, &ki), &qi) in s.chunks_mut(d).zip(kt).zip(qt) {
            kernels::axpy(ki, w, si);
            kernels::axpy(qi, si, o);
        }
    }
}

/// Copy `[n_tok, heads·d]` into per-head `[heads][n_tok, d]` order.
fn per_head_into(x: &[f32], n_tok: usize, heads: usize, d: usize, out: &mut [f32]) {
    for h in 0..heads {
        for t in 0..n_tok {
            let src = t * heads * d + h * d;
            let dst = (h * n_tok + t) * d;
            out[dst..dst + d].copy_from_slice(&x[src..src + d]);
        }
    }
}

/// Causal conv + SiLU over a chunk into `out`, advancing `state`.
fn conv_chunk(
    x: &[f32],
    w: &[f32],
    state: &mut [f32],
    kernel: usize,
    width: usize,
    out: &mut [f32],
) {
    for (xt, ot) in x.chunks(width).zip(out.chunks_mut(width)) {
        ops::shortconv_step(xt, w, state, kernel, ot);
    }
}

/// What one KDA block consumed per position of a chunk, kept so that the state after any
/// prefix of the chunk can be built from the state before it without the weights
/// ([`KdaRecord::replay`]): the pre-convolution q/k/v rows (for the conv windows), the inputs
/// of the recurrence per head (normalised q and k, v, the decay α and the write strength β).
/// A record is refilled in place by the next chunk, so a caller that keeps it allocates
/// nothing once it has seen its longest chunk.
#[derive(Clone, Debug, Default)]
pub struct KdaRecord {
    /// `[3][n_tok, P]` projected q, k, v before the convolution.
    raw: [Vec<f32>; 3],
    /// `[4][heads][n_tok, head_dim]` the recurrence's q (scaled), k, v and α, head by head.
    per_head: [Vec<f32>; 4],
    /// `[heads][n_tok]` β, head by head.
    beta: Vec<f32>,
    /// Positions recorded.
    n_tok: usize,
}

/// The buffers [`KdaRecord::replay`] computes in, shared by the layers of a rollback.
#[derive(Clone, Debug, Default)]
pub struct ReplayScratch {
    /// `[heads][keep, head_dim]` recurrence outputs and `[heads][2·head_dim]` its scratch.
    outs: Vec<f32>,
    uw: Vec<f32>,
}

/// `dst` := `src`, reusing `dst`'s buffers.
fn refill(dst: &mut Vec<f32>, src: &[f32]) {
    dst.clear();
    dst.extend_from_slice(src);
}

impl KdaRecord {
    /// Positions recorded.
    #[must_use]
    pub fn len(&self) -> usize {
        self.n_tok
    }

    /// Whether nothing was recorded.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.n_tok == 0
    }

    /// Floats a record holds per position (`7·P + heads`), for the memory plan.
    #[must_use]
    pub fn floats_per_position(p: &KdaParams) -> usize {
        7 * p.heads * p.head_dim + p.heads
    }

    /// Advance `state` (the state before the recorded chunk) over the chunk's first `keep`
    /// positions by running the same recurrence steps on the recorded inputs: bit for bit the
    /// state a forward pass over only those positions leaves. `scratch` is reused between
    /// calls (the recurrence's outputs, which are dropped).
    pub fn replay(
        &self,
        p: &KdaParams,
        keep: usize,
        state: &mut KdaState,
        scratch: &mut ReplayScratch,
    ) {
        assert!(keep <= self.len(), "cannot keep more than the chunk");
        let (heads, d) = (p.heads, p.head_dim);
        let width = heads * d;
        let hist = p.kernel - 1;
        for (win, raw) in state.conv.iter_mut().zip(&self.raw) {
            for ch in 0..width {
                let st = &mut win[ch * hist..(ch + 1) * hist];
                for t in 0..keep {
                    if hist > 0 {
                        st.copy_within(1.., 0);
                        st[hist - 1] = raw[t * width + ch];
                    }
                }
            }
        }
        if keep == 0 {
            return;
        }
        let n = self.n_tok;
        let per = n * d;
        let [qh, kh, vh, ah] = &self.per_head;
        let bh = &self.beta;
        let outs = fit(&mut scratch.outs, heads * keep * d);
        let uw = fit(&mut scratch.uw, heads * 2 * d);
        state
            .s
            .par_chunks_mut(d * d)
            .zip(outs.par_chunks_mut(keep * d))
            .zip(uw.par_chunks_mut(2 * d))
            .enumerate()
            .for_each(|(h, ((s, o), uw))| {
                let r = h * per..h * per + keep * d;
                recur_head_into(
                    &qh[r.clone()],
                    &kh[r.clone()],
                    &vh[r.clone()],
                    &ah[r],
                    &bh[h * n..h * n + keep],
                    s,
                    d,
                    o,
                    uw,
                );
            });
    }
}

/// The buffers one KDA block needs, reused between calls: after the first call of a given
/// chunk length, a call allocates nothing (unless it records).
#[derive(Clone, Debug, Default)]
pub struct KdaScratch {
    /// `[3][n_tok, P]` q, k, v projections before the convolution.
    raw: [Vec<f32>; 3],
    /// `[3][n_tok, P]` after the convolution (q, k normalised, q scaled).
    conv: [Vec<f32>; 3],
    /// `[n_tok, heads]` write strengths.
    beta: Vec<f32>,
    /// `[n_tok, head_dim]` and `[n_tok, P]`: the decay's low-rank path.
    fa: Vec<f32>,
    z: Vec<f32>,
    /// `[n_tok, P]` output gate logits.
    gate: Vec<f32>,
    /// `[n_tok, P]` decays.
    alpha: Vec<f32>,
    /// `[4][heads][n_tok, head_dim]` q, k, v, α per head.
    heads: [Vec<f32>; 4],
    /// `[heads][n_tok]` β per head.
    beta_h: Vec<f32>,
    /// `[heads][n_tok, head_dim]` recurrence outputs.
    outs: Vec<f32>,
    /// `[heads][2·head_dim]` recurrence scratch.
    uw: Vec<f32>,
    /// `[n_tok, P]` gated, normalised outputs before `o_proj`.
    o: Vec<f32>,
    /// The copy of the state a recorded chunk is computed on.
    state: KdaState,
}

impl KdaScratch {
    /// Bytes the buffers hold (their capacity).
    #[must_use]
    pub fn bytes(&self) -> usize {
        let f = |v: &Vec<f32>| v.capacity() * 4;
        self.raw
            .iter()
            .chain(&self.conv)
            .chain(&self.heads)
            .map(f)
            .sum::<usize>()
            + [
                &self.beta,
                &self.fa,
                &self.z,
                &self.gate,
                &self.alpha,
                &self.beta_h,
                &self.outs,
                &self.uw,
                &self.o,
                &self.state.s,
            ]
            .into_iter()
            .chain(&self.state.conv)
            .map(f)
            .sum::<usize>()
    }
}

/// One KDA block over a chunk: `x` `[n_tok, hidden]` (normalised input) → `[n_tok, hidden]`.
#[must_use]
pub fn forward(w: &KdaWeights, p: &KdaParams, x: &[f32], state: &mut KdaState) -> Vec<f32> {
    forward_recorded(w, p, x, state, None)
}

/// [`forward`] that, given a `record`, leaves `state` as it was and keeps in the record what
/// the chunk's positions consumed, so that any prefix of the chunk can be applied to the state
/// afterwards ([`KdaRecord::replay`]); the chunk is computed on a scratch copy of the state.
#[must_use]
pub fn forward_recorded(
    w: &KdaWeights,
    p: &KdaParams,
    x: &[f32],
    state: &mut KdaState,
    record: Option<&mut Option<KdaRecord>>,
) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    forward_into(w, p, x, state, record, &mut KdaScratch::default(), &mut out);
    out
}

/// [`forward_recorded`] into `out` `[n_tok, hidden]` with the buffers of `sc`.
/// Over 100 lines: the KDA block's steps over one set of scratch buffers (projections,
/// convolution, gates, the chunked recurrence, output) in one place, so the order of the
/// operations, which fixes the bits, stays in view.
pub fn forward_into(
    w: &KdaWeights,
    p: &KdaParams,
    x: &[f32],
    state: &mut KdaState,
    record: Option<&mut Option<KdaRecord>>,
    sc: &mut KdaScratch,
    out: &mut [f32],
) {
    // Recording, the chunk is computed on a scratch copy of the state and `state` is left as
    // it was.
    let record = record.map(|slot| slot.get_or_insert_with(KdaRecord::default));
    let mut copy = record.is_some().then(|| {
        let mut c = std::mem::take(&mut sc.state);
        c.s.clone_from(&state.s);
        for (dst, src) in c.conv.iter_mut().zip(&state.conv) {
            dst.clone_from(src);
        }
        c
    });
    let state = copy.as_mut().unwrap_or(state);
    let (heads, d) = (p.heads, p.head_dim);
    let width = heads * d;
    let n_tok = x.len() / w.q_proj.cols;
    let nw = n_tok * width;
    let [rq, rk, rv] = &mut sc.raw;
    let (rq, rk, rv) = (fit(rq, nw), fit(rk, nw), fit(rv, nw));
    w.q_proj.apply_into(x, rq);
    w.k_proj.apply_into(x, rk);
    w.v_proj.apply_into(x, rv);
    let [cq, ck, cv] = &mut sc.conv;
    let (q, k, v) = (fit(cq, nw), fit(ck, nw), fit(cv, nw));
    conv_chunk(rq, &w.q_conv, &mut state.conv[0], p.kernel, width, q);
    conv_chunk(rk, &w.k_conv, &mut state.conv[1], p.kernel, width, k);
    conv_chunk(rv, &w.v_conv, &mut state.conv[2], p.kernel, width, v);
    let beta = fit(&mut sc.beta, n_tok * heads);
    w.b_proj.apply_into(x, beta);
    for b in beta.iter_mut() {
        *b = ops::sigmoid(*b);
    }
    let fa = fit(&mut sc.fa, n_tok * w.f_a.rows);
    w.f_a.apply_into(x, fa);
    let z = fit(&mut sc.z, nw);
    w.f_b.apply_into(fa, z);
    let gate = fit(&mut sc.gate, nw);
    w.g_proj.apply_into(x, gate);
    let q_scale = 1.0 / (d as f32).sqrt();
    let alpha = fit(&mut sc.alpha, nw);
    for t in 0..n_tok {
        let row = t * width..(t + 1) * width;
        for h in 0..heads {
            let hr = t * width + h * d..t * width + (h + 1) * d;
            ops::l2norm(&mut q[hr.clone()], p.l2_eps);
            ops::l2norm(&mut k[hr.clone()], p.l2_eps);
            for x in &mut q[hr] {
                *x *= q_scale;
            }
        }
        decay(&z[row.clone()], &w.a_log, &w.dt_bias, p, &mut alpha[row]);
    }
    let [hq, hk, hv, ha] = &mut sc.heads;
    let (qh, kh, vh, ah) = (fit(hq, nw), fit(hk, nw), fit(hv, nw), fit(ha, nw));
    per_head_into(q, n_tok, heads, d, qh);
    per_head_into(k, n_tok, heads, d, kh);
    per_head_into(v, n_tok, heads, d, vh);
    per_head_into(alpha, n_tok, heads, d, ah);
    let bh = fit(&mut sc.beta_h, n_tok * heads);
    for h in 0..heads {
        for t in 0..n_tok {
            bh[h * n_tok + t] = beta[t * heads + h];
        }
    }
    if let Some(r) = record {
        for (dst, src) in r.raw.iter_mut().zip([&*rq, &*rk, &*rv]) {
            refill(dst, src);
        }
        for (dst, src) in r.per_head.iter_mut().zip([&*qh, &*kh, &*vh, &*ah]) {
            refill(dst, src);
        }
        refill(&mut r.beta, bh);
        r.n_tok = n_tok;
    }
    let outs = fit(&mut sc.outs, nw);
    let uw = fit(&mut sc.uw, heads * 2 * d);
    let (qh, kh, vh, ah, bh) = (&*qh, &*kh, &*vh, &*ah, &*bh);
    let per = n_tok * d;
    state
        .s
        .par_chunks_mut(d * d)
        .zip(outs.par_chunks_mut(per.max(1)))
        .zip(uw.par_chunks_mut(2 * d))
        .enumerate()
        .for_each(|(h, ((s, o), uw))| {
            let r = h * per..(h + 1) * per;
            let b = &bh[h * n_tok..(h + 1) * n_tok];
            recur_head_into(
                &qh[r.clone()],
                &kh[r.clone()],
                &vh[r.clone()],
                &ah[r],
                b,
                s,
                d,
                o,
                uw,
            );
        });
    if let Some(c) = copy {
        sc.state = c;
    }
    // Head-wise RMSNorm, then the sigmoid gate, then the output projection.
    let o = fit(&mut sc.o, nw);
    for t in 0..n_tok {
        for h in 0..heads {
            let dst = &mut o[t * width + h * d..t * width + (h + 1) * d];
            dst.copy_from_slice(&outs[h * per + t * d..h * per + (t + 1) * d]);
            ops::rmsnorm(dst, &w.o_norm, p.rms_eps);
        }
    }
    for (oi, &g) in o.iter_mut().zip(gate.iter()) {
        *oi *= ops::sigmoid(g);
    }
    w.o_proj.apply_into(o, out);
}

/// One KDA block over `n_rows` rows that belong to different sequences, one position each
/// (a batched decoding step): `x` `[n_rows, hidden]` → `out` `[n_rows, hidden]`, row `t`
/// against the state `states` yields `t`-th. The projections take every row in one call; the
/// convolution and the recurrence run row by row on that row's own state. Each row's output and
/// state are bitwise those of [`forward_into`] over that row alone: every step is per row,
/// and the matrix products give a row the same bits whatever rows share the call.
///
/// # Panics
/// If `states` yields fewer states than `x` has rows.
pub fn forward_rows_into<'s>(
    w: &KdaWeights,
    p: &KdaParams,
    x: &[f32],
    states: impl Iterator<Item = &'s mut KdaState>,
    sc: &mut KdaScratch,
    out: &mut [f32],
) {
    let (heads, d) = (p.heads, p.head_dim);
    let width = heads * d;
    let n_rows = x.len() / w.q_proj.cols;
    let nw = n_rows * width;
    let [rq, rk, rv] = &mut sc.raw;
    let (rq, rk, rv) = (fit(rq, nw), fit(rk, nw), fit(rv, nw));
    w.q_proj.apply_into(x, rq);
    w.k_proj.apply_into(x, rk);
    w.v_proj.apply_into(x, rv);
    let beta = fit(&mut sc.beta, n_rows * heads);
    w.b_proj.apply_into(x, beta);
    for b in beta.iter_mut() {
        *b = ops::sigmoid(*b);
    }
    let fa = fit(&mut sc.fa, n_rows * w.f_a.rows);
    w.f_a.apply_into(x, fa);
    let z = fit(&mut sc.z, nw);
    w.f_b.apply_into(fa, z);
    let gate = fit(&mut sc.gate, nw);
    w.g_proj.apply_into(x, gate);
    let [cq, ck, cv] = &mut sc.conv;
    let (q, k, v) = (fit(cq, nw), fit(ck, nw), fit(cv, nw));
    let alpha = fit(&mut sc.alpha, nw);
    let o = fit(&mut sc.o, nw);
    let uw = fit(&mut sc.uw, heads * 2 * d);
    let q_scale = 1.0 / (d as f32).sqrt();
    let mut states = states;
    for t in 0..n_rows {
        let Some(state) = states.next() else {
            panic!("forward_rows_into: a state for every row");
        };
        let row = t * width..(t + 1) * width;
        let (qt, kt, vt) = (
            &mut q[row.clone()],
            &mut k[row.clone()],
            &mut v[row.clone()],
        );
        conv_chunk(
            &rq[row.clone()],
            &w.q_conv,
            &mut state.conv[0],
            p.kernel,
            width,
            qt,
        );
        conv_chunk(
            &rk[row.clone()],
            &w.k_conv,
            &mut state.conv[1],
            p.kernel,
            width,
            kt,
        );
        conv_chunk(
            &rv[row.clone()],
            &w.v_conv,
            &mut state.conv[2],
            p.kernel,
            width,
            vt,
        );
        for h in 0..heads {
            let hr = h * d..(h + 1) * d;
            ops::l2norm(&mut qt[hr.clone()], p.l2_eps);
            ops::l2norm(&mut kt[hr.clone()], p.l2_eps);
            for x in &mut qt[hr] {
                *x *= q_scale;
            }
        }
        let at = &mut alpha[row.clone()];
        decay(&z[row.clone()], &w.a_log, &w.dt_bias, p, at);
        // One position: a head's rows of q, k, v, α are its slice of the row, and the
        // recurrence's output for it lands where the output norm reads it.
        let (qt, kt, vt, at) = (&*qt, &*kt, &*vt, &*at);
        let bt = &beta[t * heads..(t + 1) * heads];
        state
            .s
            .par_chunks_mut(d * d)
            .zip(o[row].par_chunks_mut(d))
            .zip(uw.par_chunks_mut(2 * d))
            .enumerate()
            .for_each(|(h, ((s, oh), uw))| {
                let r = h * d..(h + 1) * d;
                recur_head_into(
                    &qt[r.clone()],
                    &kt[r.clone()],
                    &vt[r.clone()],
                    &at[r],
                    &bt[h..=h],
                    s,
                    d,
                    oh,
                    uw,
                );
            });
    }
    // Head-wise RMSNorm, then the sigmoid gate, then the output projection.
    for head in o.chunks_mut(d) {
        ops::rmsnorm(head, &w.o_norm, p.rms_eps);
    }
    for (oi, &g) in o.iter_mut().zip(gate.iter()) {
        *oi *= ops::sigmoid(g);
    }
    w.o_proj.apply_into(o, out);
}
