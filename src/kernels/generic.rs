//! Scalar twins of the fast kernels: the portable fallback and the test oracle.
//!
//! Each function follows exactly the lane partition and reduction tree documented in
//! [`crate::kernels`], with `mul_add` where the SIMD code uses a fused multiply-add, so its
//! results are bit-for-bit those of the SIMD paths.

use super::bf16_to_f32;
use super::mxfp4::{scale_half_units, E2M1_HALF};

/// Fold 16 lane accumulators with the fixed tree.
#[inline]
pub(crate) fn fold16(a: &[f32; 16]) -> f32 {
    let mut b = [0f32; 8];
    for k in 0..8 {
        b[k] = a[k] + a[k + 8];
    }
    fold8(&b)
}

/// Fold 8 lane accumulators with the fixed tree.
#[inline]
pub(crate) fn fold8(b: &[f32; 8]) -> f32 {
    let c = [b[0] + b[4], b[1] + b[5], b[2] + b[6], b[3] + b[7]];
    let d = [c[0] + c[2], c[1] + c[3]];
    d[0] + d[1]
}

/// Dot product of two f32 slices of equal length.
#[must_use]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let full = n - n % 16;
    let mut acc = [0f32; 16];
    for blk in (0..full).step_by(16) {
        for (l, lane) in acc.iter_mut().enumerate() {
            *lane = a[blk + l].mul_add(b[blk + l], *lane);
        }
    }
    let mut s = fold16(&acc);
    for i in full..n {
        s = a[i].mul_add(b[i], s);
    }
    s
}

/// Attention scores over rows `stride` apart (see [`crate::kernels::scores`]); `rows` holds
/// `out.len()` rows and `stride ≥ qa.len()`.
pub fn scores(qa: &[f32], qr: &[f32], rows: &[f32], stride: usize, scale: f32, out: &mut [f32]) {
    for (t, o) in out.iter_mut().enumerate() {
        let (c, r) = rows[t * stride..(t + 1) * stride].split_at(qa.len());
        let nr = qr.len().min(r.len());
        *o = (dot_f32(qa, c) + dot_f32(&qr[..nr], &r[..nr])) * scale;
    }
}

/// `y ← y + Σ_t a[t]·rows[t]` row after row (see [`crate::kernels::axpy_rows`]); `rows` holds
/// `a.len()` rows of at least `y.len()` floats, `stride` apart.
pub fn axpy_rows(a: &[f32], rows: &[f32], stride: usize, y: &mut [f32]) {
    for (t, &at) in a.iter().enumerate() {
        axpy_f32(at, &rows[t * stride..t * stride + y.len()], y);
    }
}

/// Dot product of a BF16 row with an f32 vector.
#[must_use]
pub fn dot_bf16(w: &[u16], x: &[f32]) -> f32 {
    let n = w.len();
    let full = n - n % 16;
    let mut acc = [0f32; 16];
    for blk in (0..full).step_by(16) {
        for (l, lane) in acc.iter_mut().enumerate() {
            *lane = bf16_to_f32(w[blk + l]).mul_add(x[blk + l], *lane);
        }
    }
    let mut s = fold16(&acc);
    for i in full..n {
        s = bf16_to_f32(w[i]).mul_add(x[i], s);
    }
    s
}

/// `y ← a·x + y` element-wise with fma.
pub fn axpy_f32(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi = a.mul_add(xi, *yi);
    }
}

/// `y ← a·widen(w) + y` element-wise with fma.
pub fn axpy_bf16(a: f32, w: &[u16], y: &mut [f32]) {
    for (yi, &wi) in y.iter_mut().zip(w) {
        *yi = a.mul_add(bf16_to_f32(wi), *yi);
    }
}

/// One MXFP4 row (`packed`: cols/2 bytes, `scales`: cols/32 bytes) times `x` (cols).
#[must_use]
pub fn mxfp4_row(packed: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (g, &s) in scales.iter().enumerate() {
        let bytes = &packed[16 * g..16 * g + 16];
        let xs = &x[32 * g..32 * g + 32];
        let nibble = |k: usize| {
            let byte = bytes[k / 2];
            usize::from(if k.is_multiple_of(2) {
                byte & 0x0f
            } else {
                byte >> 4
            })
        };
        let mut p = [0f32; 8];
        for k in 0..8 {
            p[k] = E2M1_HALF[nibble(k)] * xs[k];
        }
        for k in 8..32 {
            p[k % 8] = E2M1_HALF[nibble(k)].mul_add(xs[k], p[k % 8]);
        }
        let sc = scale_half_units(s);
        for l in 0..8 {
            acc[l] = p[l].mul_add(sc, acc[l]);
        }
    }
    fold8(&acc)
}

/// Rebuild BF16 values from nibble codes (docs/trunk-codec.md, "nibble blocks"): value `i` is
/// `low[i]` then, as its high byte, `dict[c]` where `c` is nibble `i` of `nib` (value `2k` in
/// the low half of byte `k`), or the next byte of `esc` when `c` is 15. `out` receives
/// `2 · low.len()` bytes. Returns the escapes used, or `None` when `esc` runs out.
pub fn nibble_bf16<T: super::Byte>(
    dict: &[u8; 16],
    low: &[u8],
    nib: &[u8],
    esc: &[u8],
    out: &mut [T],
) -> Option<usize> {
    let mut used = 0usize;
    for (i, (o, &l)) in out.chunks_exact_mut(2).zip(low).enumerate() {
        let c = (nib[i / 2] >> (4 * (i & 1))) & 15;
        let h = if c == 15 {
            let h = *esc.get(used)?;
            used += 1;
            h
        } else {
            dict[usize::from(c)]
        };
        o[0].set(l);
        o[1].set(h);
    }
    Some(used)
}

/// Accumulate the products of nibble-coded BF16 values (as [`nibble_bf16`] decodes them) with
/// `x` into the 16 lanes of a dot product: value `i` into lane `i mod 16` with an fma, so a row
/// whose pieces start at multiples of 16 and are accumulated in order, then folded with
/// [`fold16`], gives exactly [`dot_bf16`] of its decoded values (a length that is a multiple
/// of 16). An escape past the end of `esc` reads as 0 (a checked matrix has none). Returns the
/// escapes used.
pub fn nibble_dot_acc(
    dict: &[u8; 16],
    low: &[u8],
    nib: &[u8],
    esc: &[u8],
    x: &[f32],
    acc: &mut [f32; 16],
) -> usize {
    let n = low.len().min(2 * nib.len()).min(x.len());
    let mut used = 0usize;
    for i in 0..n {
        let h = nibble_high(dict, nib, esc, i, &mut used);
        let w = super::bf16_to_f32(u16::from(h) << 8 | u16::from(low[i]));
        acc[i % 16] = w.mul_add(x[i], acc[i % 16]);
    }
    used
}

/// Accumulate the products of raw BF16 values (little-endian bytes, two per value) with `x`
/// into the 16 lanes of a dot product, as [`nibble_dot_acc`] does for coded ones.
pub fn bf16_bytes_dot_acc(w: &[u8], x: &[f32], acc: &mut [f32; 16]) {
    for (i, (b, &xi)) in w.chunks_exact(2).zip(x).enumerate() {
        let v = super::bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
        acc[i % 16] = v.mul_add(xi, acc[i % 16]);
    }
}

/// The high byte of nibble-coded value `i`: `dict[c]` for its code `c`, or for the escape code
/// the next escape byte, `esc[*used]` (0 past the end of `esc`: a checked block has none),
/// counted in `used`.
#[inline]
fn nibble_high(dict: &[u8; 16], nib: &[u8], esc: &[u8], i: usize, used: &mut usize) -> u8 {
    let c = (nib[i / 2] >> (4 * (i & 1))) & 15;
    if c == 15 {
        *used += 1;
        esc.get(*used - 1).copied().unwrap_or(0)
    } else {
        dict[usize::from(c)]
    }
}

/// [`nibble_bf16`] where a missing escape reads as 0 (a checked block has none): the values
/// the coded products multiply ([`nibble_dot_acc`]). Returns the escape codes met.
pub fn nibble_bf16_lenient(
    dict: &[u8; 16],
    low: &[u8],
    nib: &[u8],
    esc: &[u8],
    out: &mut [u8],
) -> usize {
    let mut used = 0;
    for (i, (o, &l)) in out.chunks_exact_mut(2).zip(low).enumerate() {
        o[0] = l;
        o[1] = nibble_high(dict, nib, esc, i, &mut used);
    }
    used
}
