//! Element-wise and per-vector operators of the forward pass: RMSNorm, L2 norm, SiTU-GLU,
//! softmax, sigmoid, SiLU and the causal depthwise short convolution.
//!
//! Reductions (sums of squares) go through [`super::dot`], so they share its fixed order and are
//! identical on every path; everything else is element-wise.

use super::dot;

/// Logistic sigmoid `1/(1+e^-x)`.
#[inline]
#[must_use]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// SiLU `x·σ(x)`.
#[inline]
#[must_use]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `y_i = w_i · x_i / sqrt(mean(x²) + eps)` over the whole of `x` (in place).
pub fn rmsnorm(x: &mut [f32], w: &[f32], eps: f32) {
    debug_assert_eq!(x.len(), w.len());
    let inv = rms_inv(x, eps);
    for (xi, &wi) in x.iter_mut().zip(w) {
        *xi = (wi * *xi) * inv;
    }
}

/// `1/sqrt(mean(x²) + eps)`.
#[must_use]
pub fn rms_inv(x: &[f32], eps: f32) -> f32 {
    let ss = dot(x, x);
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

/// `x ← x / sqrt(Σ x² + eps)` (sum, not mean; no gain) in place.
pub fn l2norm(x: &mut [f32], eps: f32) {
    let ss = dot(x, x);
    let inv = 1.0 / (ss + eps).sqrt();
    for xi in x.iter_mut() {
        *xi *= inv;
    }
}

/// SiTU of one gate/up pair: `[β1·tanh(g/β1)·σ(g)] · [β2·tanh(u/β2)]` (σ on the uncapped gate).
#[inline]
#[must_use]
pub fn situ(g: f32, u: f32, beta1: f32, beta2: f32) -> f32 {
    (beta1 * (g / beta1).tanh() * sigmoid(g)) * (beta2 * (u / beta2).tanh())
}

/// SiTU-GLU over a `[gate ‖ up]` vector of length 2n into `out` (length n).
pub fn situ_glu(gate_up: &[f32], out: &mut [f32], beta1: f32, beta2: f32) {
    let n = out.len();
    debug_assert_eq!(gate_up.len(), 2 * n);
    let (g, u) = gate_up.split_at(n);
    for i in 0..n {
        out[i] = situ(g[i], u[i], beta1, beta2);
    }
}

/// SiTU over separate gate and up vectors, written into `gate` (in place).
pub fn situ_inplace(gate: &mut [f32], up: &[f32], beta1: f32, beta2: f32) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = situ(*g, u, beta1, beta2);
    }
}

/// Max-subtracted softmax in place; the denominator is summed in index order.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut z = 0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        z += *v;
    }
    let inv = 1.0 / z;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Causal depthwise convolution with SiLU for one time step and `c` channels.
///
/// `w` is `[c, k]` (tap `k−1` multiplies the current input), `state` is `[c, k−1]` holding the
/// last `k−1` **pre-convolution** inputs per channel, oldest first; it is advanced by one step.
/// `x` (the current projection output, length c) is read and `out` receives `SiLU(conv)`.
pub fn shortconv_step(x: &[f32], w: &[f32], state: &mut [f32], k: usize, out: &mut [f32]) {
    let c = x.len();
    let hist = k - 1;
    debug_assert_eq!(w.len(), c * k);
    debug_assert_eq!(state.len(), c * hist);
    for ch in 0..c {
        let taps = &w[ch * k..(ch + 1) * k];
        let st = &mut state[ch * hist..(ch + 1) * hist];
        let mut acc = 0f32;
        for j in 0..hist {
            acc = taps[j].mul_add(st[j], acc);
        }
        acc = taps[hist].mul_add(x[ch], acc);
        out[ch] = silu(acc);
        if hist > 0 {
            st.copy_within(1.., 0);
            st[hist - 1] = x[ch];
        }
    }
}
