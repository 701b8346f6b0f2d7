//! AVX2+FMA and AVX-512F implementations of the fast kernels.
//!
//! Each function reproduces the lane partition and reduction tree of its twin in
//! [`super::generic`] exactly (see [`crate::kernels`]), so results are bitwise identical. The
//! safe wrappers check the CPU feature once; the `unsafe` is confined to this file.
#![allow(unsafe_code)]

use super::generic::fold8;
use super::mxfp4::scale_half_units;
use std::arch::x86_64::*;

/// Whether AVX2 and FMA are available.
pub(super) fn has_avx2_fma() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// Whether AVX-512F is available (with AVX2 and FMA).
pub(super) fn has_avx512() -> bool {
    has_avx2_fma() && is_x86_feature_detected!("avx512f")
}

macro_rules! avx2_wrapper {
    ($(#[$m:meta])* $name:ident, $inner:ident, ($($arg:ident: $ty:ty),*) -> $ret:ty, $fallback:expr) => {
        $(#[$m])*
        pub(super) fn $name($($arg: $ty),*) -> $ret {
            if has_avx2_fma() {
                // SAFETY: the CPU supports AVX2 and FMA (checked just above).
                unsafe { $inner($($arg),*) }
            } else {
                $fallback($($arg),*)
            }
        }
    };
}

macro_rules! avx512_wrapper {
    ($(#[$m:meta])* $name:ident, $inner:ident, ($($arg:ident: $ty:ty),*) -> $ret:ty, $fallback:expr) => {
        $(#[$m])*
        pub(super) fn $name($($arg: $ty),*) -> $ret {
            if has_avx512() {
                // SAFETY: the CPU supports AVX-512F, AVX2 and FMA (checked just above).
                unsafe { $inner($($arg),*) }
            } else {
                $fallback($($arg),*)
            }
        }
    };
}

avx2_wrapper!(
    /// f32 dot product, AVX2.
    dot_f32_avx2, dot_f32_avx2_impl, (a: &[f32], b: &[f32]) -> f32, super::generic::dot_f32
);
avx2_wrapper!(
    /// BF16·f32 dot product, AVX2.
    dot_bf16_avx2, dot_bf16_avx2_impl, (w: &[u16], x: &[f32]) -> f32, super::generic::dot_bf16
);
avx512_wrapper!(
    /// f32 dot product, AVX-512.
    dot_f32_avx512, dot_f32_avx512_impl, (a: &[f32], b: &[f32]) -> f32, dot_f32_avx2
);
avx512_wrapper!(
    /// BF16·f32 dot product, AVX-512.
    dot_bf16_avx512, dot_bf16_avx512_impl, (w: &[u16], x: &[f32]) -> f32, dot_bf16_avx2
);
avx2_wrapper!(
    /// Attention scores over cached rows, AVX2.
    scores_avx2, scores_avx2_impl,
    (qa: &[f32], qr: &[f32], rows: &[f32], stride: usize, scale: f32, out: &mut [f32]) -> (),
    super::generic::scores
);
avx512_wrapper!(
    /// Attention scores over cached rows, AVX-512.
    scores_avx512, scores_avx512_impl,
    (qa: &[f32], qr: &[f32], rows: &[f32], stride: usize, scale: f32, out: &mut [f32]) -> (),
    scores_avx2
);
avx2_wrapper!(
    /// `y ← y + Σ a[t]·rows[t]`, AVX2.
    axpy_rows_avx2, axpy_rows_avx2_impl, (a: &[f32], rows: &[f32], stride: usize, y: &mut [f32]) -> (),
    super::generic::axpy_rows
);
avx2_wrapper!(
    /// `y ← a·x + y`, AVX2.
    axpy_f32_avx2, axpy_f32_avx2_impl, (a: f32, x: &[f32], y: &mut [f32]) -> (),
    super::generic::axpy_f32
);
avx2_wrapper!(
    /// `y ← a·widen(w) + y`, AVX2.
    axpy_bf16_avx2, axpy_bf16_avx2_impl, (a: f32, w: &[u16], y: &mut [f32]) -> (),
    super::generic::axpy_bf16
);
avx2_wrapper!(
    /// One MXFP4 row times x, AVX2.
    mxfp4_row_avx2, mxfp4_row_avx2_impl, (packed: &[u8], scales: &[u8], x: &[f32]) -> f32,
    super::generic::mxfp4_row
);

/// Horizontal fold of 8 lanes with the fixed tree `c[k]=b[k]+b[k+4]`, `d[k]=c[k]+c[k+2]`,
/// `d[0]+d[1]`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum8(b: __m256) -> f32 {
    let c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps::<1>(b));
    let d = _mm_add_ps(c, _mm_movehl_ps(c, c));
    let s = _mm_add_ss(d, _mm_shuffle_ps::<0b01>(d, d));
    _mm_cvtss_f32(s)
}

/// Widen 8 BF16 values at `p` to f32.
///
/// # Safety
/// `p` must be valid for reading 8 `u16` values; AVX2 must be available.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load_bf16x8(p: *const u16) -> __m256 {
    // SAFETY: the caller guarantees 16 readable bytes at `p`.
    let h = unsafe { _mm_loadu_si128(p.cast()) };
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
}

/// # Safety
/// AVX2 and FMA must be available.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_f32_avx2_impl(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let full = n - n % 16;
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    while i < full {
        // SAFETY: i + 16 ≤ full ≤ n, so all 16 loads from each slice are in bounds.
        unsafe {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            acc1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i + 8)),
                _mm256_loadu_ps(pb.add(i + 8)),
                acc1,
            );
        }
        i += 16;
    }
    let mut s = hsum8(_mm256_add_ps(acc0, acc1));
    for k in full..n {
        s = a[k].mul_add(b[k], s);
    }
    s
}

/// # Safety
/// AVX2 and FMA must be available.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_bf16_avx2_impl(w: &[u16], x: &[f32]) -> f32 {
    let n = w.len().min(x.len());
    let full = n - n % 16;
    let (pw, px) = (w.as_ptr(), x.as_ptr());
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    while i < full {
        // SAFETY: i + 16 ≤ full ≤ n, so all loads are in bounds of both slices.
        unsafe {
            acc0 = _mm256_fmadd_ps(load_bf16x8(pw.add(i)), _mm256_loadu_ps(px.add(i)), acc0);
            acc1 = _mm256_fmadd_ps(
                load_bf16x8(pw.add(i + 8)),
                _mm256_loadu_ps(px.add(i + 8)),
                acc1,
            );
        }
        i += 16;
    }
    let mut s = hsum8(_mm256_add_ps(acc0, acc1));
    for k in full..n {
        s = super::bf16_to_f32(w[k]).mul_add(x[k], s);
    }
    s
}

/// Fold 16 AVX-512 lanes: `b[k]=a[k]+a[k+8]`, then [`hsum8`].
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn hsum16(a: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(a);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
    hsum8(_mm256_add_ps(lo, hi))
}

/// # Safety
/// AVX-512F, AVX2 and FMA must be available.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn dot_f32_avx512_impl(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let full = n - n % 16;
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i < full {
        // SAFETY: i + 16 ≤ full ≤ n.
        unsafe {
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc);
        }
        i += 16;
    }
    let mut s = hsum16(acc);
    for k in full..n {
        s = a[k].mul_add(b[k], s);
    }
    s
}

/// # Safety
/// AVX-512F, AVX2 and FMA must be available.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn dot_bf16_avx512_impl(w: &[u16], x: &[f32]) -> f32 {
    let n = w.len().min(x.len());
    let full = n - n % 16;
    let (pw, px) = (w.as_ptr(), x.as_ptr());
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i < full {
        // SAFETY: i + 16 ≤ full ≤ n.
        unsafe {
            let h = _mm256_loadu_si256(pw.add(i).cast());
            let wv = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
            acc = _mm512_fmadd_ps(wv, _mm512_loadu_ps(px.add(i)), acc);
        }
        i += 16;
    }
    let mut s = hsum16(acc);
    for k in full..n {
        s = super::bf16_to_f32(w[k]).mul_add(x[k], s);
    }
    s
}

/// Scores of one query against `out.len()` rows `stride` apart, each two
/// [`dot_f32_avx2_impl`] calls, as the generic twin computes them.
///
/// # Safety
/// AVX2 and FMA must be available.
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_avx2_impl(
    qa: &[f32],
    qr: &[f32],
    rows: &[f32],
    stride: usize,
    scale: f32,
    out: &mut [f32],
) {
    for (t, o) in out.iter_mut().enumerate() {
        let (c, r) = rows[t * stride..(t + 1) * stride].split_at(qa.len());
        // SAFETY: AVX2 and FMA are available (this function's own requirement).
        *o = unsafe { dot_f32_avx2_impl(qa, c) + dot_f32_avx2_impl(qr, r) } * scale;
    }
}

/// As [`scores_avx2_impl`] through [`dot_f32_avx512_impl`].
///
/// # Safety
/// AVX-512F, AVX2 and FMA must be available.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn scores_avx512_impl(
    qa: &[f32],
    qr: &[f32],
    rows: &[f32],
    stride: usize,
    scale: f32,
    out: &mut [f32],
) {
    for (t, o) in out.iter_mut().enumerate() {
        let (c, r) = rows[t * stride..(t + 1) * stride].split_at(qa.len());
        // SAFETY: AVX-512F, AVX2 and FMA are available (this function's own requirement).
        *o = unsafe { dot_f32_avx512_impl(qa, c) + dot_f32_avx512_impl(qr, r) } * scale;
    }
}

/// Rows of `y` kept in registers per block.
const AXPY_ROWS_BLOCK: usize = 64;
/// Rows of the source walked per tile, so that a wide `y` revisits them from L2.
const AXPY_ROWS_TILE: usize = 64;

/// `y ← y + Σ_t a[t]·rows[t]`: for each tile of rows, each 64-float block of `y` is loaded
/// into registers, gets one fma per row in row order and is stored back; the `y.len() mod 8`
/// last elements get scalar fmas in the same order. Every element therefore sees the same
/// fma sequence as row-after-row [`axpy_f32_avx2_impl`] calls give it.
///
/// # Safety
/// AVX2 and FMA must be available; `rows` must hold `a.len()` rows of `y.len()` floats,
/// `stride` apart (the safe wrapper's caller checks it).
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_rows_avx2_impl(a: &[f32], rows: &[f32], stride: usize, y: &mut [f32]) {
    let w = y.len();
    let full = w - w % 8;
    assert!(
        a.is_empty() || rows.len() >= (a.len() - 1) * stride + w,
        "axpy_rows: rows"
    );
    let (pr, py) = (rows.as_ptr(), y.as_mut_ptr());
    for t0 in (0..a.len()).step_by(AXPY_ROWS_TILE) {
        let tile = &a[t0..(t0 + AXPY_ROWS_TILE).min(a.len())];
        let mut b0 = 0;
        while b0 < full {
            let nv = ((full - b0) / 8).min(AXPY_ROWS_BLOCK / 8);
            // SAFETY: b0 + 8·nv ≤ full ≤ w = y.len(); row t's floats [b0, b0 + 8·nv) are at
            // t·stride + b0 + … < (a.len() − 1)·stride + w ≤ rows.len() (asserted above).
            unsafe {
                if nv == AXPY_ROWS_BLOCK / 8 {
                    let mut acc = [_mm256_setzero_ps(); AXPY_ROWS_BLOCK / 8];
                    for (v, r) in acc.iter_mut().enumerate() {
                        *r = _mm256_loadu_ps(py.add(b0 + 8 * v));
                    }
                    for (j, &at) in tile.iter().enumerate() {
                        let av = _mm256_set1_ps(at);
                        let p = pr.add((t0 + j) * stride + b0);
                        for (v, r) in acc.iter_mut().enumerate() {
                            *r = _mm256_fmadd_ps(av, _mm256_loadu_ps(p.add(8 * v)), *r);
                        }
                    }
                    for (v, r) in acc.iter().enumerate() {
                        _mm256_storeu_ps(py.add(b0 + 8 * v), *r);
                    }
                } else {
                    for (j, &at) in tile.iter().enumerate() {
                        let av = _mm256_set1_ps(at);
                        let p = pr.add((t0 + j) * stride + b0);
                        for v in 0..nv {
                            let q = py.add(b0 + 8 * v);
                            let r = _mm256_fmadd_ps(
                                av,
                                _mm256_loadu_ps(p.add(8 * v)),
                                _mm256_loadu_ps(q),
                            );
                            _mm256_storeu_ps(q, r);
                        }
                    }
                }
            }
            b0 += 8 * nv;
        }
        for k in full..w {
            for (j, &at) in tile.iter().enumerate() {
                y[k] = at.mul_add(rows[(t0 + j) * stride + k], y[k]);
            }
        }
    }
}

/// # Safety
/// AVX2 and FMA must be available.
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_f32_avx2_impl(a: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    let full = n - n % 8;
    let av = _mm256_set1_ps(a);
    let (px, py) = (x.as_ptr(), y.as_mut_ptr());
    let mut i = 0;
    while i < full {
        // SAFETY: i + 8 ≤ full ≤ n for both slices; x and y do not alias (& vs &mut).
        unsafe {
            let r = _mm256_fmadd_ps(av, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i)));
            _mm256_storeu_ps(py.add(i), r);
        }
        i += 8;
    }
    for k in full..n {
        y[k] = a.mul_add(x[k], y[k]);
    }
}

/// # Safety
/// AVX2 and FMA must be available.
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_bf16_avx2_impl(a: f32, w: &[u16], y: &mut [f32]) {
    let n = w.len().min(y.len());
    let full = n - n % 8;
    let av = _mm256_set1_ps(a);
    let (pw, py) = (w.as_ptr(), y.as_mut_ptr());
    let mut i = 0;
    while i < full {
        // SAFETY: i + 8 ≤ full ≤ n for both slices.
        unsafe {
            let r = _mm256_fmadd_ps(av, load_bf16x8(pw.add(i)), _mm256_loadu_ps(py.add(i)));
            _mm256_storeu_ps(py.add(i), r);
        }
        i += 8;
    }
    for k in full..n {
        y[k] = a.mul_add(super::bf16_to_f32(w[k]), y[k]);
    }
}

/// # Safety
/// AVX2 and FMA must be available.
#[target_feature(enable = "avx2,fma")]
unsafe fn mxfp4_row_avx2_impl(packed: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    // SAFETY: the caller guarantees AVX2 and FMA, which the multi-vector kernel needs.
    let [y] = unsafe { mxfp4_row_multi_avx2_impl::<1>(packed, scales, [x]) };
    y
}

/// One MXFP4 row times `N` vectors: each group's nibbles are decoded once and applied to every
/// vector. Per vector the operations are those of one vector alone (`N = 1` is the one-row
/// kernel), so each result is independent of `N`, bit for bit.
///
/// # Safety
/// AVX2 and FMA must be available.
#[target_feature(enable = "avx2,fma")]
unsafe fn mxfp4_row_multi_avx2_impl<const N: usize>(
    packed: &[u8],
    scales: &[u8],
    xs: [&[f32]; N],
) -> [f32; N] {
    let mut n_group = scales.len().min(packed.len() / 16);
    for x in &xs {
        n_group = n_group.min(x.len() / 32);
    }
    let lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    let low = _mm_set1_epi8(0x0f);
    let mut acc = [_mm256_setzero_ps(); N];
    let pp = packed.as_ptr();
    let px = xs.map(<[f32]>::as_ptr);
    // The rows of a matrix are consecutive: request the lines four rows ahead (the next 4 KiB
    // page of a 2048-column matrix, which the hardware prefetcher does not cross) while this
    // row computes.
    let ahead = 4 * packed.len();
    for (g, &s) in scales.iter().take(n_group).enumerate() {
        if g % 4 == 0 {
            // A prefetch never faults; the address is computed with wrapping arithmetic and
            // never dereferenced.
            _mm_prefetch::<_MM_HINT_T0>(pp.wrapping_add(16 * g + ahead).cast());
        }
        // SAFETY: g < n_group, so bytes [16g, 16g+16) of packed and floats [32g, 32g+32) of
        // every x are in bounds.
        unsafe {
            let bytes = _mm_loadu_si128(pp.add(16 * g).cast());
            let lo = _mm_and_si128(bytes, low);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(bytes), low);
            let e0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
            let e1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi));
            let w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e0));
            let w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(e0)));
            let w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e1));
            let w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(e1)));
            let sc = _mm256_set1_ps(scale_half_units(s));
            for t in 0..N {
                let xg = px[t].add(32 * g);
                let mut p = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
                p = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg.add(8)), p);
                p = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg.add(16)), p);
                p = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg.add(24)), p);
                acc[t] = _mm256_fmadd_ps(p, sc, acc[t]);
            }
        }
    }
    let mut out = [0f32; N];
    for (o, a) in out.iter_mut().zip(acc) {
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds exactly 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), a) };
        *o = fold8(&lanes);
    }
    out
}

/// One MXFP4 row times `N` vectors, AVX2 (each result equals [`mxfp4_row_avx2`]'s).
pub(super) fn mxfp4_row_multi_avx2<const N: usize>(
    packed: &[u8],
    scales: &[u8],
    xs: [&[f32]; N],
) -> [f32; N] {
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked just above).
        unsafe { mxfp4_row_multi_avx2_impl::<N>(packed, scales, xs) }
    } else {
        xs.map(|x| super::generic::mxfp4_row(packed, scales, x))
    }
}

/// Two MXFP4 rows times `N` vectors, AVX-512: lanes 0–7 of every register carry row 0 and
/// lanes 8–15 row 1, each lane with exactly the operations of the same lane of
/// [`mxfp4_row_multi_avx2_impl`] (the group's four products in element order, then one FMA
/// with the group's scale), so each result equals the one-row kernel's, bit for bit.
///
/// The nibbles are decoded without byte shuffles: the four bytes of a group's eighth `m`
/// (elements `8m..8m+8`) are one dword, broadcast to the row's eight lanes, shifted right by
/// `4·lane` and looked up in a 16-entry table by `vpermps` (which reads the low four bits of
/// each index). The vector's eighth is broadcast to both halves.
///
/// The two rows' broadcasts (and their scales) meet in one register through a bitwise select
/// (`vpternlogd` with a selector whose lanes 8–15 are all ones) rather than a lane blend. The
/// register holds the same bits either way (row 0's dword in lanes 0–7, row 1's in lanes
/// 8–15), so every value that meets the arithmetic is unchanged, bit for bit; only the
/// instructions differ. LLVM turns a blend of two broadcast loads into a two-source permute
/// (`vpermt2d`) or a merge-masked broadcast, and on Zen 4 both compete for the shuffle pipes
/// that the table look-ups and the vector's 256-bit broadcasts already keep busy; the select
/// is one `vpternlogd` with the second load folded in as an embedded broadcast, which competes
/// with them less (measured on AMD EPYC, Zen 4: the one-vector product of a 3072×3584 matrix
/// 16% faster, batches 5–8%; decoding through VBMI byte permutes was slower than either, as
/// it adds shuffles).
///
/// # Safety
/// AVX-512F, AVX2 and FMA must be available.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn mxfp4_rows2_multi_avx512_impl<const N: usize>(
    rows: [(&[u8], &[u8]); 2],
    xs: [&[f32]; N],
) -> [[f32; 2]; N] {
    let mut n_group = rows
        .iter()
        .map(|(p, s)| s.len().min(p.len() / 16))
        .min()
        .unwrap_or(0);
    for x in &xs {
        n_group = n_group.min(x.len() / 32);
    }
    let lut = _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, -0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0,
    );
    let shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    let row1 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1, -1, -1, -1, -1);
    // Bitwise `row1 ? b : a` (truth table 0xD8 over a, b, row1): `a` in lanes 0–7, `b` in 8–15.
    let pick = |a: __m512i, b: __m512i| _mm512_ternarylogic_epi32::<0xD8>(a, b, row1);
    let mut acc = [_mm512_setzero_ps(); N];
    let [p0, p1] = rows.map(|(p, _)| p.as_ptr());
    let [s0, s1] = rows.map(|(_, s)| &s[..n_group]);
    let px = xs.map(<[f32]>::as_ptr);
    // As in the AVX2 kernel: request the lines four rows ahead while these rows compute.
    let ahead = 4 * rows[0].0.len();
    for (g, (&s0, &s1)) in s0.iter().zip(s1).enumerate() {
        if g % 4 == 0 {
            // A prefetch never faults; the addresses are computed with wrapping arithmetic and
            // never dereferenced.
            _mm_prefetch::<_MM_HINT_T0>(p0.wrapping_add(16 * g + ahead).cast());
            _mm_prefetch::<_MM_HINT_T0>(p1.wrapping_add(16 * g + ahead).cast());
        }
        let sc = _mm512_castsi512_ps(pick(
            _mm512_castps_si512(_mm512_set1_ps(scale_half_units(s0))),
            _mm512_castps_si512(_mm512_set1_ps(scale_half_units(s1))),
        ));
        // SAFETY: g < n_group, so bytes [16g, 16g+16) of both rows and floats [32g, 32g+32) of
        // every x are in bounds; the dword reads are unaligned reads within those bytes.
        unsafe {
            let w = [0, 1, 2, 3].map(|m| {
                let d0 = p0.add(16 * g + 4 * m).cast::<i32>().read_unaligned();
                let d1 = p1.add(16 * g + 4 * m).cast::<i32>().read_unaligned();
                let both = pick(_mm512_set1_epi32(d0), _mm512_set1_epi32(d1));
                _mm512_permutexvar_ps(_mm512_srlv_epi32(both, shifts), lut)
            });
            for t in 0..N {
                let xg = px[t].add(32 * g);
                let xv = |m: usize| {
                    _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(
                        xg.add(8 * m).cast::<f64>(),
                    )))
                };
                let mut p = _mm512_mul_ps(w[0], xv(0));
                p = _mm512_fmadd_ps(w[1], xv(1), p);
                p = _mm512_fmadd_ps(w[2], xv(2), p);
                p = _mm512_fmadd_ps(w[3], xv(3), p);
                acc[t] = _mm512_fmadd_ps(p, sc, acc[t]);
            }
        }
    }
    let mut out = [[0f32; 2]; N];
    for (o, a) in out.iter_mut().zip(acc) {
        let mut lanes = [[0f32; 8]; 2];
        // SAFETY: `lanes` is 16 contiguous floats.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr().cast(), a) };
        *o = lanes.map(|l| fold8(&l));
    }
    out
}

/// Two MXFP4 rows times `N` vectors, AVX-512 (each result equals [`mxfp4_row_avx2`]'s).
pub(super) fn mxfp4_rows2_multi_avx512<const N: usize>(
    rows: [(&[u8], &[u8]); 2],
    xs: [&[f32]; N],
) -> [[f32; 2]; N] {
    if has_avx512() {
        // SAFETY: the CPU supports AVX-512F, AVX2 and FMA (checked just above).
        unsafe { mxfp4_rows2_multi_avx512_impl::<N>(rows, xs) }
    } else {
        let [a, b] = rows.map(|(p, s)| mxfp4_row_multi_avx2::<N>(p, s, xs));
        std::array::from_fn(|t| [a[t], b[t]])
    }
}

/// Weights widened to f32 eight or sixteen at a time.
pub(super) trait Elem: Copy {
    /// Widen one element.
    fn widen(self) -> f32;
    /// # Safety
    /// `p` must be valid for 8 elements; AVX2 must be available.
    unsafe fn load8(p: *const Self) -> __m256;
    /// # Safety
    /// `p` must be valid for 16 elements; AVX-512F must be available.
    unsafe fn load16(p: *const Self) -> __m512;
}

impl Elem for f32 {
    #[inline]
    fn widen(self) -> f32 {
        self
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: the caller guarantees 8 readable floats.
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn load16(p: *const f32) -> __m512 {
        // SAFETY: the caller guarantees 16 readable floats.
        unsafe { _mm512_loadu_ps(p) }
    }
}

impl Elem for u16 {
    #[inline]
    fn widen(self) -> f32 {
        super::bf16_to_f32(self)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load8(p: *const u16) -> __m256 {
        // SAFETY: the caller guarantees 8 readable values.
        unsafe { load_bf16x8(p) }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn load16(p: *const u16) -> __m512 {
        // SAFETY: the caller guarantees 16 readable values.
        let h = unsafe { _mm256_loadu_si256(p.cast()) };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }
}

/// Add the `n mod 16` tail of each row sequentially, as the single-row kernels do.
fn finish_rows<E: Elem>(
    sums: [f32; 4],
    w: [&[E]; 4],
    x: &[f32],
    full: usize,
    n: usize,
) -> [f32; 4] {
    let mut out = sums;
    for (r, o) in out.iter_mut().enumerate() {
        for k in full..n {
            *o = w[r][k].widen().mul_add(x[k], *o);
        }
    }
    out
}

/// # Safety
/// AVX-512F, AVX2 and FMA must be available.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn dot4_avx512_impl<E: Elem>(w: [&[E]; 4], x: &[f32]) -> [f32; 4] {
    let n = w.iter().map(|r| r.len()).min().unwrap_or(0).min(x.len());
    let full = n - n % 16;
    let px = x.as_ptr();
    let pw = w.map(<[E]>::as_ptr);
    let mut acc = [_mm512_setzero_ps(); 4];
    // The rows of a matrix are consecutive, so the four rows the next call takes start `4n`
    // elements after these: their lines are requested while this block computes (a page
    // boundary stops the hardware prefetcher at every 4 KiB row of a 2048-column matrix).
    let ahead = 4 * n;
    macro_rules! step {
        ($i:expr) => {
            // SAFETY: the loops below keep $i + 16 ≤ full ≤ n ≤ every row's length and x's.
            unsafe {
                let xv = _mm512_loadu_ps(px.add($i));
                for r in 0..4 {
                    acc[r] = _mm512_fmadd_ps(E::load16(pw[r].add($i)), xv, acc[r]);
                }
            }
        };
    }
    let mut i = 0;
    while i + 32 <= full {
        for p in pw {
            // A prefetch never faults; the address is computed with wrapping arithmetic and
            // never dereferenced. 32 elements are one line of BF16 and two of F32.
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(i + ahead).cast());
            if std::mem::size_of::<E>() > 2 {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(i + 16 + ahead).cast());
            }
        }
        step!(i);
        step!(i + 16);
        i += 32;
    }
    if i < full {
        step!(i);
    }
    finish_rows(acc.map(|a| hsum16(a)), w, x, full, n)
}

/// Four rows against `T` vectors: each widened weight vector is used for every vector, and
/// each (row, vector) pair is reduced exactly as [`dot4_avx512_impl`] reduces it.
///
/// # Safety
/// AVX-512F, AVX2 and FMA must be available.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn dot4_multi_avx512_impl<E: Elem, const T: usize>(
    w: [&[E]; 4],
    xs: [&[f32]; T],
) -> [[f32; 4]; T] {
    let mut n = w.iter().map(|r| r.len()).min().unwrap_or(0);
    for x in &xs {
        n = n.min(x.len());
    }
    let full = n - n % 16;
    let px = xs.map(<[f32]>::as_ptr);
    let pw = w.map(<[E]>::as_ptr);
    let mut acc = [[_mm512_setzero_ps(); 4]; T];
    let mut i = 0;
    while i < full {
        // SAFETY: i + 16 ≤ full ≤ n ≤ every row's and every vector's length.
        unsafe {
            let wv = [0, 1, 2, 3].map(|r| E::load16(pw[r].add(i)));
            for t in 0..T {
                let xv = _mm512_loadu_ps(px[t].add(i));
                for r in 0..4 {
                    acc[t][r] = _mm512_fmadd_ps(wv[r], xv, acc[t][r]);
                }
            }
        }
        i += 16;
    }
    let mut out = [[0f32; 4]; T];
    for t in 0..T {
        let sums = [0, 1, 2, 3].map(|r| hsum16(acc[t][r]));
        out[t] = finish_rows(sums, w, xs[t], full, n);
    }
    out
}

/// # Safety
/// AVX2 and FMA must be available.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot4_avx2_impl<E: Elem>(w: [&[E]; 4], x: &[f32]) -> [f32; 4] {
    let n = w.iter().map(|r| r.len()).min().unwrap_or(0).min(x.len());
    let full = n - n % 16;
    let px = x.as_ptr();
    let pw = w.map(<[E]>::as_ptr);
    let mut lo = [_mm256_setzero_ps(); 4];
    let mut hi = [_mm256_setzero_ps(); 4];
    // As in the AVX-512 kernel: the next four rows' lines are requested ahead of their call.
    let ahead = 4 * n;
    let line = 64 / std::mem::size_of::<E>();
    let mut i = 0;
    while i < full {
        if i % line == 0 {
            for p in pw {
                // A prefetch never faults; the address is computed with wrapping arithmetic
                // and never dereferenced.
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(i + ahead).cast());
            }
        }
        // SAFETY: i + 16 ≤ full ≤ n ≤ every row's length and x's length.
        unsafe {
            let x0 = _mm256_loadu_ps(px.add(i));
            let x1 = _mm256_loadu_ps(px.add(i + 8));
            for r in 0..4 {
                lo[r] = _mm256_fmadd_ps(E::load8(pw[r].add(i)), x0, lo[r]);
                hi[r] = _mm256_fmadd_ps(E::load8(pw[r].add(i + 8)), x1, hi[r]);
            }
        }
        i += 16;
    }
    let sums = [0, 1, 2, 3].map(|r| hsum8(_mm256_add_ps(lo[r], hi[r])));
    finish_rows(sums, w, x, full, n)
}

/// Four rows (F32 or BF16) against `T` vectors at once, each (row, vector) reduced exactly as
/// the single-row kernel reduces it; `None` off the AVX-512 path (the other paths take the
/// vectors one at a time through [`dot4`]).
pub(super) fn dot4_multi<E: Elem, const T: usize>(
    isa: super::Isa,
    w: [&[E]; 4],
    xs: [&[f32]; T],
) -> Option<[[f32; 4]; T]> {
    match isa {
        super::Isa::Avx512 if has_avx512() => {
            // SAFETY: AVX-512F, AVX2 and FMA are available (checked in this arm's guard).
            Some(unsafe { dot4_multi_avx512_impl(w, xs) })
        }
        _ => None,
    }
}

/// Four rows (F32 or BF16) against one vector, each reduced exactly as the single-row kernel
/// reduces it; `None` when this CPU lacks the path.
pub(super) fn dot4<E: Elem>(isa: super::Isa, w: [&[E]; 4], x: &[f32]) -> Option<[f32; 4]> {
    match isa {
        super::Isa::Avx512 if has_avx512() => {
            // SAFETY: AVX-512F, AVX2 and FMA are available (checked in this arm's guard).
            Some(unsafe { dot4_avx512_impl(w, x) })
        }
        super::Isa::Avx2 | super::Isa::Avx512 if has_avx2_fma() => {
            // SAFETY: AVX2 and FMA are available (checked in this arm's guard).
            Some(unsafe { dot4_avx2_impl(w, x) })
        }
        _ => None,
    }
}

/// [`super::generic::nibble_bf16`] with SSSE3 byte shuffles, 32 values at a time. A group's
/// high bytes are looked up together (the escape code's entry is 0), the escaped ones patched
/// in value order from `esc`, then the group is written. Into a 16-byte aligned `out` the
/// writes are non-temporal: the decoded layer is far larger than the caches and is read back
/// by the matrix kernels later, so reading each line before writing it would only add memory
/// traffic.
///
/// # Safety
/// AVX2 must be available.
#[target_feature(enable = "avx2")]
unsafe fn nibble_bf16_avx2_impl<T: super::Byte>(
    dict: &[u8; 16],
    low: &[u8],
    nib: &[u8],
    esc: &[u8],
    out: &mut [T],
) -> Option<usize> {
    let n = low.len().min(out.len() / 2).min(2 * nib.len());
    let groups = n / 32;
    // SAFETY: `dict` is 16 readable bytes.
    let d = unsafe { _mm_loadu_si128(dict.as_ptr().cast()) };
    let m = _mm_set1_epi8(15);
    let stream = (out.as_ptr() as usize).is_multiple_of(16);
    let mut used = 0usize;
    for g in 0..groups {
        // SAFETY: 32·(g + 1) ≤ n ≤ 2·nib.len(), so nib[16g..16g + 16] is in bounds.
        let v = unsafe { _mm_loadu_si128(nib.as_ptr().add(16 * g).cast()) };
        let lo = _mm_and_si128(v, m);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m);
        // High bytes of values 2k (lo) and 2k + 1 (hi); interleaved they are in value order.
        let hl = _mm_shuffle_epi8(d, lo);
        let hh = _mm_shuffle_epi8(d, hi);
        let mut h0 = _mm_unpacklo_epi8(hl, hh);
        let mut h1 = _mm_unpackhi_epi8(hl, hh);
        let (el, eh) = (_mm_cmpeq_epi8(lo, m), _mm_cmpeq_epi8(hi, m));
        if _mm_movemask_epi8(_mm_or_si128(el, eh)) != 0 {
            // Bit i: value 32g + i has the escape code (interleaved like the high bytes).
            let e0 = _mm_movemask_epi8(_mm_unpacklo_epi8(el, eh)) as u32 & 0xffff;
            let e1 = _mm_movemask_epi8(_mm_unpackhi_epi8(el, eh)) as u32 & 0xffff;
            let mut escaped = e0 | e1 << 16;
            let mut h = [0u8; 32];
            // SAFETY: `h` is 32 writable bytes.
            unsafe {
                _mm_storeu_si128(h.as_mut_ptr().cast(), h0);
                _mm_storeu_si128(h.as_mut_ptr().add(16).cast(), h1);
            }
            while escaped != 0 {
                let Some(&e) = esc.get(used) else {
                    _mm_sfence();
                    return None;
                };
                h[escaped.trailing_zeros() as usize] = e;
                used += 1;
                escaped &= escaped - 1;
            }
            // SAFETY: `h` is 32 readable bytes.
            unsafe {
                h0 = _mm_loadu_si128(h.as_ptr().cast());
                h1 = _mm_loadu_si128(h.as_ptr().add(16).cast());
            }
        }
        // SAFETY: 32·(g + 1) ≤ n ≤ low.len() and 64·(g + 1) ≤ 2n ≤ out.len(), so the 32
        // bytes read from `low` and the 64 written to `out` are in bounds, and when `stream`
        // holds `out` is 16-byte aligned, as are its offsets 64g + 16j; `T` is `u8` or
        // `MaybeUninit<u8>`, one byte each, so storing initialized bytes into it is sound.
        unsafe {
            let l0 = _mm_loadu_si128(low.as_ptr().add(32 * g).cast());
            let l1 = _mm_loadu_si128(low.as_ptr().add(32 * g + 16).cast());
            let o = out.as_mut_ptr().add(64 * g).cast::<__m128i>();
            let v = [
                _mm_unpacklo_epi8(l0, h0),
                _mm_unpackhi_epi8(l0, h0),
                _mm_unpacklo_epi8(l1, h1),
                _mm_unpackhi_epi8(l1, h1),
            ];
            for (j, v) in v.into_iter().enumerate() {
                if stream {
                    _mm_stream_si128(o.add(j), v);
                } else {
                    _mm_storeu_si128(o.add(j), v);
                }
            }
        }
    }
    decode_tail(stream, dict, low, nib, esc, used, 32 * groups, n, out)
}

/// [`super::generic::nibble_bf16`] with AVX-512 VBMI, 32 values at a time: the codes look up
/// their high bytes in one byte shuffle, escaped values are patched in value order from `esc`,
/// and one byte permute puts the 32 values' low and high bytes together. Into a 64-byte
/// aligned `out` the writes are non-temporal, as in [`nibble_bf16_avx2_impl`].
///
/// # Safety
/// AVX-512F, AVX-512BW, AVX-512 VBMI and AVX2 must be available.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx2")]
unsafe fn nibble_bf16_avx512_impl<T: super::Byte>(
    dict: &[u8; 16],
    low: &[u8],
    nib: &[u8],
    esc: &[u8],
    out: &mut [T],
) -> Option<usize> {
    /// Output byte `2t` is value `t`'s low byte (source byte `t`), byte `2t + 1` its high
    /// byte (the even values' at 32 + t/2, the odd ones' at 48 + t/2).
    const WORDS: [u8; 64] = {
        let mut idx = [0u8; 64];
        let mut t = 0;
        while t < 32 {
            idx[2 * t] = t as u8;
            idx[2 * t + 1] = (32 + 16 * (t % 2) + t / 2) as u8;
            t += 1;
        }
        idx
    };
    let n = low.len().min(out.len() / 2).min(2 * nib.len());
    let groups = n / 32;
    // SAFETY: `dict` is 16 readable bytes, `WORDS` 64.
    let (d, words) = unsafe {
        (
            _mm256_broadcastsi128_si256(_mm_loadu_si128(dict.as_ptr().cast())),
            _mm512_loadu_si512(WORDS.as_ptr().cast()),
        )
    };
    let m = _mm256_set1_epi8(15);
    let stream = (out.as_ptr() as usize).is_multiple_of(64);
    let mut used = 0usize;
    for g in 0..groups {
        // SAFETY: 32·(g + 1) ≤ n ≤ 2·nib.len(), so nib[16g..16g + 16] is in bounds.
        let v = unsafe { _mm_loadu_si128(nib.as_ptr().add(16 * g).cast()) };
        let c = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(v), v), m);
        let mut h = _mm256_shuffle_epi8(d, c);
        let escaped = _mm256_movemask_epi8(_mm256_cmpeq_epi8(c, m)) as u32;
        if escaped != 0 {
            let wanted = escaped.count_ones() as usize;
            if esc.len() < used + wanted {
                if stream {
                    _mm_sfence();
                }
                return None;
            }
            h = patch_escapes(h, escaped, esc, &mut used);
        }
        // SAFETY: 32·(g + 1) ≤ n ≤ low.len() and 64·(g + 1) ≤ 2n ≤ out.len(), so the 32
        // bytes read from `low` and the 64 written to `out` are in bounds, and when `stream`
        // holds `out` and its offsets 64g are 64-byte aligned; `T` is `u8` or
        // `MaybeUninit<u8>`, one byte each, so storing initialized bytes into it is sound.
        unsafe {
            let src = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_loadu_si256(low.as_ptr().add(32 * g).cast())),
                h,
            );
            let w = _mm512_permutexvar_epi8(words, src);
            let o = out.as_mut_ptr().add(64 * g).cast::<__m512i>();
            if stream {
                _mm512_stream_si512(o, w);
            } else {
                _mm512_storeu_si512(o, w);
            }
        }
    }
    decode_tail(stream, dict, low, nib, esc, used, 32 * groups, n, out)
}

/// The end of a SIMD [`super::generic::nibble_bf16`]: the non-temporal writes fenced (where
/// `stream`), then values `at..n` (`used` escapes taken before them) through the scalar twin.
#[allow(clippy::too_many_arguments)]
fn decode_tail<T: super::Byte>(
    stream: bool,
    dict: &[u8; 16],
    low: &[u8],
    nib: &[u8],
    esc: &[u8],
    used: usize,
    at: usize,
    n: usize,
    out: &mut [T],
) -> Option<usize> {
    if stream {
        // Non-temporal writes are ordered before whatever this thread writes next (the
        // release that hands the decoded bytes to another thread).
        // SAFETY: SSE2 is part of x86_64.
        unsafe { _mm_sfence() };
    }
    let tail = super::generic::nibble_bf16(
        dict,
        &low[at..n],
        &nib[at / 2..],
        esc.get(used..)?,
        &mut out[2 * at..2 * n],
    )?;
    Some(used + tail)
}

/// [`super::generic::nibble_bf16`] on `isa`: byte permutes on the AVX-512 path where the CPU
/// has VBMI, SSSE3 shuffles where it has AVX2.
pub(super) fn nibble_bf16<T: super::Byte>(
    isa: super::Isa,
    dict: &[u8; 16],
    low: &[u8],
    nib: &[u8],
    esc: &[u8],
    out: &mut [T],
) -> Option<usize> {
    if isa == super::Isa::Avx512 && has_avx512_vbmi() {
        // SAFETY: the CPU supports AVX-512F/BW/VBMI and AVX2 (checked just above).
        unsafe { nibble_bf16_avx512_impl(dict, low, nib, esc, out) }
    } else if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        unsafe { nibble_bf16_avx2_impl(dict, low, nib, esc, out) }
    } else {
        super::generic::nibble_bf16(dict, low, nib, esc, out)
    }
}

/// The high bytes of 32 nibble-coded values: `dict` looked up by the 16 code bytes at `v`
/// (value `2k` in the low half of byte `k`), escaped values patched in value order from
/// `esc[*used..]` (a byte past its end reads as 0; a checked matrix has none). Values 0–15 in
/// the first register, 16–31 in the second.
#[inline]
#[target_feature(enable = "avx2")]
fn nibble_high32(d: __m128i, v: __m128i, esc: &[u8], used: &mut usize) -> (__m128i, __m128i) {
    let m = _mm_set1_epi8(15);
    let lo = _mm_and_si128(v, m);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m);
    let hl = _mm_shuffle_epi8(d, lo);
    let hh = _mm_shuffle_epi8(d, hi);
    let h0 = _mm_unpacklo_epi8(hl, hh);
    let h1 = _mm_unpackhi_epi8(hl, hh);
    let (el, eh) = (_mm_cmpeq_epi8(lo, m), _mm_cmpeq_epi8(hi, m));
    if _mm_movemask_epi8(_mm_or_si128(el, eh)) == 0 {
        return (h0, h1);
    }
    let e0 = _mm_movemask_epi8(_mm_unpacklo_epi8(el, eh)) as u32 & 0xffff;
    let e1 = _mm_movemask_epi8(_mm_unpackhi_epi8(el, eh)) as u32 & 0xffff;
    let mut escaped = e0 | e1 << 16;
    let mut h = [0u8; 32];
    // SAFETY: `h` is 32 writable bytes.
    unsafe {
        _mm_storeu_si128(h.as_mut_ptr().cast(), h0);
        _mm_storeu_si128(h.as_mut_ptr().add(16).cast(), h1);
    }
    while escaped != 0 {
        h[escaped.trailing_zeros() as usize] = esc.get(*used).copied().unwrap_or(0);
        *used += 1;
        escaped &= escaped - 1;
    }
    // SAFETY: `h` is 32 readable bytes.
    unsafe {
        (
            _mm_loadu_si128(h.as_ptr().cast()),
            _mm_loadu_si128(h.as_ptr().add(16).cast()),
        )
    }
}

/// Whether AVX-512 VBMI byte permutes are available (with AVX-512F/BW, AVX2 and FMA): the
/// coded product's AVX-512 path needs them.
fn has_avx512_vbmi() -> bool {
    has_avx512() && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vbmi")
}

/// Byte indices that put 16 values' BF16 bits into f32 lanes, from a register holding the
/// low bytes of 32 values (bytes 0–31), the high bytes of the even ones (32–47) and of the
/// odd ones (48–63): lane `t` takes value `16·half + t`, its low byte into byte 2 of the lane
/// and its high byte into byte 3 (bytes 0 and 1 are masked to zero).
const fn bf16_lane_index(half: usize) -> [u8; 64] {
    let mut idx = [0u8; 64];
    let mut t = 0;
    while t < 16 {
        let v = 16 * half + t;
        idx[4 * t + 2] = v as u8;
        idx[4 * t + 3] = (32 + 16 * (v % 2) + v / 2) as u8;
        t += 1;
    }
    idx
}

/// Bits `0..16` of `x` spread to the even bits of the result.
fn spread_even(x: u32) -> u32 {
    let mut x = x & 0xffff;
    x = (x | x << 8) & 0x00ff_00ff;
    x = (x | x << 4) & 0x0f0f_0f0f;
    x = (x | x << 2) & 0x3333_3333;
    (x | x << 1) & 0x5555_5555
}

/// One nibble-coded row's parts for the coded products: its piece's dictionary, and the low
/// bytes, codes and escapes of its values.
pub(super) struct CodedRow<'a> {
    pub dict: &'a [u8; 16],
    pub low: &'a [u8],
    pub nib: &'a [u8],
    pub esc: &'a [u8],
}

/// The registers the AVX-512 coded product keeps for a loop: the dictionary in both halves,
/// and the byte indices of values 0–15 and 16–31 (see [`bf16_lane_index`]).
#[derive(Clone, Copy)]
struct Avx512Coded {
    dict: __m256i,
    lanes0: __m512i,
    lanes1: __m512i,
}

impl Avx512Coded {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx2")]
    fn new(dict: &[u8; 16]) -> Self {
        const LANES0: [u8; 64] = bf16_lane_index(0);
        const LANES1: [u8; 64] = bf16_lane_index(1);
        // SAFETY: `dict` is 16 readable bytes, the indices 64 bytes each.
        unsafe {
            Avx512Coded {
                dict: _mm256_broadcastsi128_si256(_mm_loadu_si128(dict.as_ptr().cast())),
                lanes0: _mm512_loadu_si512(LANES0.as_ptr().cast()),
                lanes1: _mm512_loadu_si512(LANES1.as_ptr().cast()),
            }
        }
    }

    /// `a` plus group `g` (values 32g to 32g + 31) of `row` times `x`: the codes look up their
    /// high bytes in one byte shuffle (escapes patched from `row.esc[*used..]`), two byte
    /// permutes put the BF16 bits of values 0–15 and 16–31 into f32 lanes, each accumulated
    /// into the lane a BF16 row gives it.
    ///
    /// # Safety
    /// `32·(g + 1)` must be at most `row.low.len()`, `2·row.nib.len()` and `x.len()`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx2,fma")]
    unsafe fn step(
        self,
        row: &CodedRow<'_>,
        g: usize,
        x: &[f32],
        used: &mut usize,
        a: __m512,
    ) -> __m512 {
        // Bytes 2 and 3 of every f32 lane.
        const HIGH_HALVES: __mmask64 = 0xcccc_cccc_cccc_cccc;
        let m = _mm256_set1_epi8(15);
        // SAFETY: 32·(g + 1) is at most `low.len()`, `x.len()` and `2·nib.len()` (this
        // function's requirement), so every load is in bounds.
        unsafe {
            let v = _mm_loadu_si128(row.nib.as_ptr().add(16 * g).cast());
            prefetch_rows_ahead(row.low, row.nib, g);
            // Codes of the even values (low halves of the code bytes), then of the odd ones.
            let c = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(v), v), m);
            let mut h = _mm256_shuffle_epi8(self.dict, c);
            let escaped = _mm256_movemask_epi8(_mm256_cmpeq_epi8(c, m)) as u32;
            if escaped != 0 {
                h = patch_escapes(h, escaped, row.esc, used);
            }
            let src = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_loadu_si256(row.low.as_ptr().add(32 * g).cast())),
                h,
            );
            let w0 = _mm512_maskz_permutexvar_epi8(HIGH_HALVES, self.lanes0, src);
            let w1 = _mm512_maskz_permutexvar_epi8(HIGH_HALVES, self.lanes1, src);
            let px = x.as_ptr().add(32 * g);
            let a = _mm512_fmadd_ps(_mm512_castsi512_ps(w0), _mm512_loadu_ps(px), a);
            _mm512_fmadd_ps(_mm512_castsi512_ps(w1), _mm512_loadu_ps(px.add(16)), a)
        }
    }
}

/// [`super::generic::nibble_dot_acc`] with AVX-512 VBMI, 32 values per step
/// ([`Avx512Coded::step`]).
///
/// # Safety
/// AVX-512F, AVX-512BW, AVX-512 VBMI, AVX2 and FMA must be available.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx2,fma")]
unsafe fn nibble_dot_acc_avx512_impl(row: &CodedRow<'_>, x: &[f32], acc: &mut [f32; 16]) -> usize {
    let n = row.low.len().min(2 * row.nib.len()).min(x.len());
    let k = Avx512Coded::new(row.dict);
    // SAFETY: `acc` is 16 floats.
    let mut a = unsafe { _mm512_loadu_ps(acc.as_ptr()) };
    let mut used = 0usize;
    for g in 0..n / 32 {
        // SAFETY: 32·(g + 1) ≤ n, which is at most the lengths `step` needs.
        a = unsafe { k.step(row, g, x, &mut used, a) };
    }
    // SAFETY: `acc` is 16 writable floats.
    unsafe { _mm512_storeu_ps(acc.as_mut_ptr(), a) };
    used + tail_row(row, used, x, n - n % 32, acc)
}

/// Two rows' [`nibble_dot_acc_avx512_impl`] at once, their steps interleaved: two chains of
/// fused multiply-adds instead of one, so neither waits on the other's latency. Each row's
/// lanes take the same values in the same order as on its own.
///
/// # Safety
/// AVX-512F, AVX-512BW, AVX-512 VBMI, AVX2 and FMA must be available.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx2,fma")]
unsafe fn nibble_dot_acc2_avx512_impl(
    rows: [&CodedRow<'_>; 2],
    x: &[f32],
    acc: [&mut [f32; 16]; 2],
) {
    let [r0, r1] = rows;
    let [acc0, acc1] = acc;
    let len = |r: &CodedRow<'_>| r.low.len().min(2 * r.nib.len()).min(x.len());
    let (n0, n1) = (len(r0), len(r1));
    let (k0, k1) = (Avx512Coded::new(r0.dict), Avx512Coded::new(r1.dict));
    // SAFETY: `acc0` and `acc1` are 16 floats each.
    let (mut a0, mut a1) = unsafe {
        (
            _mm512_loadu_ps(acc0.as_ptr()),
            _mm512_loadu_ps(acc1.as_ptr()),
        )
    };
    let (mut u0, mut u1) = (0usize, 0usize);
    let both = n0.min(n1) / 32;
    for g in 0..both {
        // SAFETY: 32·(g + 1) ≤ min(n0, n1), which is at most the lengths `step` needs for
        // either row.
        unsafe {
            a0 = k0.step(r0, g, x, &mut u0, a0);
            a1 = k1.step(r1, g, x, &mut u1, a1);
        }
    }
    for (k, r, n, a, u) in [
        (k0, r0, n0, &mut a0, &mut u0),
        (k1, r1, n1, &mut a1, &mut u1),
    ] {
        for g in both..n / 32 {
            // SAFETY: 32·(g + 1) ≤ n, which is at most the lengths `step` needs.
            *a = unsafe { k.step(r, g, x, u, *a) };
        }
    }
    // SAFETY: `acc0` and `acc1` are 16 writable floats each.
    unsafe {
        _mm512_storeu_ps(acc0.as_mut_ptr(), a0);
        _mm512_storeu_ps(acc1.as_mut_ptr(), a1);
    }
    tail_row(r0, u0, x, n0 - n0 % 32, acc0);
    tail_row(r1, u1, x, n1 - n1 % 32, acc1);
}

/// `row`'s values from `at` on (a multiple of 32; `used` escapes taken before it) through
/// the scalar twin: lane `i mod 16` is the same lane from there as from the start.
fn tail_row(row: &CodedRow<'_>, used: usize, x: &[f32], at: usize, acc: &mut [f32; 16]) -> usize {
    tail_acc(
        row.dict,
        row.low,
        row.nib,
        row.esc.get(used..).unwrap_or_default(),
        x,
        at,
        acc,
    )
}

/// Prefetch for group `g` (values `32g` on) of a coded row whose parts are `low` and `nib`:
/// the rows of a matrix are consecutive, so request the lines of the row four rows ahead, one
/// prefetch per 64 bytes of each part. Without it the AVX-512 coded product waits on memory
/// (two thirds of the speed, measured on `coded_matvec`).
#[inline]
#[target_feature(enable = "avx2")]
fn prefetch_rows_ahead(low: &[u8], nib: &[u8], g: usize) {
    let ahead = 4 * low.len();
    // A prefetch never faults; the addresses are computed with wrapping arithmetic and never
    // dereferenced.
    if g.is_multiple_of(2) {
        _mm_prefetch::<_MM_HINT_T0>(low.as_ptr().wrapping_add(32 * g + ahead).cast());
    }
    if g.is_multiple_of(4) {
        _mm_prefetch::<_MM_HINT_T0>(nib.as_ptr().wrapping_add(16 * g + ahead / 2).cast());
    }
}

/// `h` (the looked-up high bytes of 32 values, the even values' in bytes 0–15, the odd ones'
/// in 16–31) with the values escaped in `escaped` (bit `k`: byte `k` of `h`) given the next
/// escape bytes from `esc[*used..]` in value order (a byte past its end reads as 0; a checked
/// matrix has none).
#[inline]
#[target_feature(enable = "avx2")]
fn patch_escapes(h: __m256i, escaped: u32, esc: &[u8], used: &mut usize) -> __m256i {
    // Bit i: value i (value 2k is byte k, value 2k + 1 byte 16 + k).
    let mut values = spread_even(escaped) | spread_even(escaped >> 16) << 1;
    let mut b = [0u8; 32];
    // SAFETY: `b` is 32 writable bytes.
    unsafe { _mm256_storeu_si256(b.as_mut_ptr().cast(), h) };
    while values != 0 {
        let i = values.trailing_zeros() as usize;
        b[16 * (i % 2) + i / 2] = esc.get(*used).copied().unwrap_or(0);
        *used += 1;
        values &= values - 1;
    }
    // SAFETY: `b` is 32 readable bytes.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

/// [`super::generic::nibble_dot_acc`] with AVX2: lanes 0–7 and 8–15 in two registers, as
/// [`dot_bf16_avx2_impl`] keeps them.
///
/// # Safety
/// AVX2 and FMA must be available.
#[target_feature(enable = "avx2,fma")]
unsafe fn nibble_dot_acc_avx2_impl(
    dict: &[u8; 16],
    low: &[u8],
    nib: &[u8],
    esc: &[u8],
    x: &[f32],
    acc: &mut [f32; 16],
) -> usize {
    let n = low.len().min(2 * nib.len()).min(x.len());
    let groups = n / 32;
    // SAFETY: `dict` is 16 readable bytes, `acc` 16 floats.
    let (d, mut a0, mut a1) = unsafe {
        (
            _mm_loadu_si128(dict.as_ptr().cast()),
            _mm256_loadu_ps(acc.as_ptr()),
            _mm256_loadu_ps(acc.as_ptr().add(8)),
        )
    };
    let mut used = 0usize;
    for g in 0..groups {
        // SAFETY: 32·(g + 1) ≤ n, which is at most `low.len()`, `x.len()` and
        // `2·nib.len()`, so every load is in bounds.
        unsafe {
            prefetch_rows_ahead(low, nib, g);
            let v = _mm_loadu_si128(nib.as_ptr().add(16 * g).cast());
            let (h0, h1) = nibble_high32(d, v, esc, &mut used);
            let l0 = _mm_loadu_si128(low.as_ptr().add(32 * g).cast());
            let l1 = _mm_loadu_si128(low.as_ptr().add(32 * g + 16).cast());
            let px = x.as_ptr().add(32 * g);
            let (w0, w1) = widen16(l0, h0);
            let (w2, w3) = widen16(l1, h1);
            a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(px), a0);
            a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(px.add(8)), a1);
            a0 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(px.add(16)), a0);
            a1 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(px.add(24)), a1);
        }
    }
    // SAFETY: `acc` is 16 writable floats.
    unsafe {
        _mm256_storeu_ps(acc.as_mut_ptr(), a0);
        _mm256_storeu_ps(acc.as_mut_ptr().add(8), a1);
    }
    let at = 32 * groups;
    used + tail_acc(
        dict,
        low,
        nib,
        esc.get(used..).unwrap_or_default(),
        x,
        at,
        acc,
    )
}

/// Sixteen values' BF16 bits as f32, values 0–7 and 8–15: their low bytes `l` and high
/// bytes `h` interleaved into BF16 words (one byte shuffle for eight values), each word
/// widened into the top half of its lane.
#[inline]
#[target_feature(enable = "avx2")]
fn widen16(l: __m128i, h: __m128i) -> (__m256, __m256) {
    (
        words_f32(_mm_unpacklo_epi8(l, h)),
        words_f32(_mm_unpackhi_epi8(l, h)),
    )
}

/// Eight BF16 words as f32.
#[inline]
#[target_feature(enable = "avx2")]
fn words_f32(w: __m128i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(w)))
}

/// The values from `at` (a multiple of 32) on, through the scalar twin: lane `i mod 16` is
/// the same lane from there as from the start.
fn tail_acc(
    dict: &[u8; 16],
    low: &[u8],
    nib: &[u8],
    esc: &[u8],
    x: &[f32],
    at: usize,
    acc: &mut [f32; 16],
) -> usize {
    super::generic::nibble_dot_acc(
        dict,
        low.get(at..).unwrap_or_default(),
        nib.get(at / 2..).unwrap_or_default(),
        esc,
        x.get(at..).unwrap_or_default(),
        acc,
    )
}

/// [`super::generic::nibble_dot_acc`] on `isa` (the scalar twin where the CPU lacks it).
pub(super) fn nibble_dot_acc(
    isa: super::Isa,
    dict: &[u8; 16],
    low: &[u8],
    nib: &[u8],
    esc: &[u8],
    x: &[f32],
    acc: &mut [f32; 16],
) -> usize {
    match isa {
        super::Isa::Avx512 if has_avx512_vbmi() => {
            let row = CodedRow {
                dict,
                low,
                nib,
                esc,
            };
            // SAFETY: AVX-512F/BW/VBMI, AVX2 and FMA are available (checked in this arm's
            // guard).
            unsafe { nibble_dot_acc_avx512_impl(&row, x, acc) }
        }
        super::Isa::Avx2 | super::Isa::Avx512 if has_avx2_fma() => {
            // SAFETY: AVX2 and FMA are available (checked in this arm's guard).
            unsafe { nibble_dot_acc_avx2_impl(dict, low, nib, esc, x, acc) }
        }
        _ => super::generic::nibble_dot_acc(dict, low, nib, esc, x, acc),
    }
}

/// Two rows' [`nibble_dot_acc`] at once on the AVX-512 path, where the CPU has VBMI; false
/// (nothing done) elsewhere.
pub(super) fn nibble_dot_acc2(
    isa: super::Isa,
    rows: [&CodedRow<'_>; 2],
    x: &[f32],
    acc: [&mut [f32; 16]; 2],
) -> bool {
    if isa != super::Isa::Avx512 || !has_avx512_vbmi() {
        return false;
    }
    // SAFETY: AVX-512F/BW/VBMI, AVX2 and FMA are available (checked just above).
    unsafe { nibble_dot_acc2_avx512_impl(rows, x, acc) };
    true
}
