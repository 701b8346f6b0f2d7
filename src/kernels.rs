//! Numeric kernels: products of F32, BF16 and MXFP4 matrices with a vector or a small batch of
//! vectors, dot products, axpy, and the small element-wise operators of the forward pass.
//!
//! Every fast kernel has a scalar twin in [`generic`] that uses the same lane partition and the
//! same reduction tree, with an explicit fused multiply-add wherever the SIMD code fuses, so the
//! SIMD and scalar paths give **bitwise identical** results. Parallelism (rayon) only splits
//! independent output rows; each output is reduced by one thread in a fixed order, so the thread
//! count cannot change a bit either.
//!
//! The instruction set is detected once at start-up. `K3_KERNELS=generic|avx2|avx512` forces a
//! path (a request the CPU cannot honour falls back to the best available one), and
//! [`set_isa`] switches at run time, which the tests use to compare paths inside one process.
//!
//! A one-token product walks its matrix in one of two [`RowOrder`]s: four rows at a time with
//! the next four rows' lines requested ahead, or one row after another left to the hardware
//! prefetcher. Every row is reduced the same way in both, so the order changes speed only; which
//! is faster depends on the machine (measured: one row at a time streamed 33 GB/s on two AMD EPYC
//! vCPUs where four rows with prefetch streamed 23), so opening a model times both once on a
//! synthetic matrix and keeps the faster ([`calibrate_row_order`]; `K3_ROW_ORDER=fours|single`
//! fixes one). No product times anything.
//!
//! Reduction order of a dot product of length n (F32 or BF16 weights, F32 activations):
//! 16 lanes, element i of each full 16-block accumulated into lane i mod 16 with an fma; lanes
//! combined as `b[k]=a[k]+a[k+8]`, `c[k]=b[k]+b[k+4]`, `d[k]=c[k]+c[k+2]`, `s=d[0]+d[1]`; then
//! the `n mod 16` remaining elements are added in order with an fma.
//!
//! A nibble-coded BF16 matrix ([`nibble`], a pinned layer's as the packed trunk stores it) is
//! reduced exactly as its decoded BF16 rows: each value, put together in a register from its
//! low byte and its code, goes to the lane and the place in the order the BF16 row gives it.
//!
//! Reduction order of an MXFP4 row: 8 lanes; per 32-group, element k goes to lane k mod 8
//! (fma chain from zero, values in half units), the group's lanes are folded into 8 row
//! accumulators with one fma by the group scale `2^(s-128)`, and the 8 accumulators are
//! combined as `c[k]=a[k]+a[k+4]`, `d[k]=c[k]+c[k+2]`, `s=d[0]+d[1]`. The AVX-512 path takes
//! two rows per register (lanes 0–7 and 8–15), each lane doing what the AVX2 path's lane does.

pub mod generic;
pub mod mxfp4;
pub mod nibble;
pub mod ops;
pub mod warm;
#[cfg(target_arch = "x86_64")]
mod x86;

use crate::tuning::{KernelChoice, RowOrderChoice};
use rayon::prelude::*;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub use mxfp4::{Mxfp4Matrix, E2M1};
pub use nibble::{matmul_nibble_with, NibbleBlock, NibbleMatrix, NIBBLE_BLOCK};

/// An instruction-set path for the fast kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable scalar code (the reference twin of every fast kernel).
    Generic,
    /// AVX2 + FMA.
    Avx2,
    /// AVX-512F (dense kernels); MXFP4 uses the AVX2 code on this path.
    Avx512,
}

impl Isa {
    /// Short lowercase name, as accepted by `K3_KERNELS`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Isa::Generic => "generic",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

/// The best path this CPU supports.
#[must_use]
pub fn detected_isa() -> Isa {
    static DETECTED: OnceLock<Isa> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if x86::has_avx512() {
                return Isa::Avx512;
            }
            if x86::has_avx2_fma() {
                return Isa::Avx2;
            }
        }
        Isa::Generic
    })
}

const ISA_UNSET: u8 = u8::MAX;
static ISA: AtomicU8 = AtomicU8::new(ISA_UNSET);

fn isa_code(isa: Isa) -> u8 {
    match isa {
        Isa::Generic => 0,
        Isa::Avx2 => 1,
        Isa::Avx512 => 2,
    }
}

/// Clamp a requested path to what the CPU can run.
fn supported(requested: Isa) -> Isa {
    match (requested, detected_isa()) {
        (Isa::Generic, _) => Isa::Generic,
        (Isa::Avx2, Isa::Generic) => Isa::Generic,
        (Isa::Avx2, _) => Isa::Avx2,
        (Isa::Avx512, d) => d,
    }
}

/// The path the kernels use now: `K3_KERNELS` if set, else the detected one.
#[must_use]
pub fn isa() -> Isa {
    match ISA.load(Ordering::Relaxed) {
        0 => Isa::Generic,
        1 => Isa::Avx2,
        2 => Isa::Avx512,
        _ => {
            let chosen = match crate::tuning::Tuning::get().kernels {
                KernelChoice::Generic => Isa::Generic,
                KernelChoice::Avx2 => supported(Isa::Avx2),
                KernelChoice::Avx512 => supported(Isa::Avx512),
                KernelChoice::Auto => detected_isa(),
            };
            ISA.store(isa_code(chosen), Ordering::Relaxed);
            chosen
        }
    }
}

/// Switch the kernel path for the whole process (clamped to what the CPU supports). Results do
/// not depend on the path; only speed does.
pub fn set_isa(requested: Isa) -> Isa {
    let chosen = supported(requested);
    ISA.store(isa_code(chosen), Ordering::Relaxed);
    chosen
}

/// Row-major weights of a dense matrix `[rows, cols]`, borrowed.
#[derive(Clone, Copy, Debug)]
pub enum DenseRef<'a> {
    /// float32 elements.
    F32(&'a [f32]),
    /// bfloat16 elements as raw bits (widened exactly to f32 inside the kernels).
    Bf16(&'a [u16]),
}

impl DenseRef<'_> {
    /// Number of stored elements.
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            DenseRef::F32(w) => w.len(),
            DenseRef::Bf16(w) => w.len(),
        }
    }

    /// Bytes of the stored elements.
    #[must_use]
    pub fn bytes(&self) -> usize {
        match self {
            DenseRef::F32(w) => std::mem::size_of_val(*w),
            DenseRef::Bf16(w) => std::mem::size_of_val(*w),
        }
    }

    /// Whether the matrix holds no element.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `Σ a[i]·b[i]` in the fixed 16-lane order. `a` and `b` must have equal length.
#[must_use]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    dot_with(isa(), a, b)
}

/// [`dot`] on an explicit path.
#[must_use]
pub fn dot_with(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => x86::dot_f32_avx512(a, b),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::dot_f32_avx2(a, b),
        _ => generic::dot_f32(a, b),
    }
}

/// `Σ widen(w[i])·x[i]` for BF16 weights, in the fixed 16-lane order.
#[must_use]
pub fn dot_bf16_with(isa: Isa, w: &[u16], x: &[f32]) -> f32 {
    let n = w.len().min(x.len());
    let (w, x) = (&w[..n], &x[..n]);
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => x86::dot_bf16_avx512(w, x),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::dot_bf16_avx2(w, x),
        _ => generic::dot_bf16(w, x),
    }
}

/// `y[j] ← fma(a, x[j], y[j])` for every j.
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    match isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => x86::axpy_f32_avx2(a, &x[..n], &mut y[..n]),
        _ => generic::axpy_f32(a, &x[..n], &mut y[..n]),
    }
}

/// `y[j] ← fma(a, widen(w[j]), y[j])` for every j (BF16 row).
pub fn axpy_bf16(a: f32, w: &[u16], y: &mut [f32]) {
    let n = w.len().min(y.len());
    match isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => x86::axpy_bf16_avx2(a, &w[..n], &mut y[..n]),
        _ => generic::axpy_bf16(a, &w[..n], &mut y[..n]),
    }
}

/// A byte a kernel writes: `u8`, or `MaybeUninit<u8>` for a buffer not yet initialized (both
/// one byte, so SIMD code stores into either through a pointer).
pub trait Byte: byte_sealed::Sealed {
    /// Store `v`.
    fn set(&mut self, v: u8);
}

mod byte_sealed {
    pub trait Sealed {}
    impl Sealed for u8 {}
    impl Sealed for std::mem::MaybeUninit<u8> {}
}

impl Byte for u8 {
    #[inline(always)]
    fn set(&mut self, v: u8) {
        *self = v;
    }
}

impl Byte for std::mem::MaybeUninit<u8> {
    #[inline(always)]
    fn set(&mut self, v: u8) {
        self.write(v);
    }
}

/// Whether this process's kernels multiply a nibble-coded matrix faster than its BF16 twin
/// when the weights come from memory: on the SIMD paths the coded product reads three
/// quarters of the bytes and keeps up with them (a `[131072, 2048]` matrix, two threads of a
/// Xeon with AVX-512 VBMI: 33.5 against 26 GiB/s of BF16 on AVX-512, 29 against 26 on AVX2);
/// the scalar path is bound by its arithmetic, which is heavier coded (docs/trunk-codec.md).
#[must_use]
pub fn coded_outruns_bf16() -> bool {
    isa() != Isa::Generic
}

/// Rebuild BF16 values from the nibble codes of an encoded trunk block: value `i` is `low[i]`
/// and, as its high byte, `dict[c]` for its 4-bit code `c` (nibble `i` of `nib`, value `2k` in
/// the low half of byte `k`), or the next byte of `esc` when `c` is 15. `out` receives
/// `2 · low.len()` bytes (`nib` holds at least `low.len()` nibbles, `out` that many bytes).
/// Returns the escapes used, or `None` when `esc` runs out. Every path writes the same bytes.
pub fn nibble_bf16<T: Byte>(
    dict: &[u8; 16],
    low: &[u8],
    nib: &[u8],
    esc: &[u8],
    out: &mut [T],
) -> Option<usize> {
    nibble_bf16_with(isa(), dict, low, nib, esc, out)
}

/// [`nibble_bf16`] on an explicit path (for tests comparing paths).
pub fn nibble_bf16_with<T: Byte>(
    isa: Isa,
    dict: &[u8; 16],
    low: &[u8],
    nib: &[u8],
    esc: &[u8],
    out: &mut [T],
) -> Option<usize> {
    let n = low.len().min(out.len() / 2).min(2 * nib.len());
    let (low, out) = (&low[..n], &mut out[..2 * n]);
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => x86::nibble_bf16(isa, dict, low, nib, esc, out),
        _ => generic::nibble_bf16(dict, low, nib, esc, out),
    }
}

/// `axpy` on an explicit path (for tests comparing paths).
pub fn axpy_with(isa: Isa, a: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => x86::axpy_f32_avx2(a, &x[..n], &mut y[..n]),
        _ => generic::axpy_f32(a, &x[..n], &mut y[..n]),
    }
}

/// How a one-token dense product walks the matrix (see the module documentation). The results
/// are the same bits either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowOrder {
    /// Four rows at a time through the 4-row kernel, which requests the next four rows' lines
    /// while it computes (software prefetch).
    Fours,
    /// One row after another through the single-row kernel, left to the hardware prefetcher.
    Single,
}

impl RowOrder {
    /// Short lowercase name, as accepted by `K3_ROW_ORDER`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            RowOrder::Fours => "fours",
            RowOrder::Single => "single",
        }
    }
}

const ORDER_UNSET: u8 = 0;
const ORDER_FOURS: u8 = 2;
const ORDER_SINGLE: u8 = 3;
static ROW_ORDER: AtomicU8 = AtomicU8::new(ORDER_UNSET);

fn order_code(o: RowOrder) -> u8 {
    match o {
        RowOrder::Fours => ORDER_FOURS,
        RowOrder::Single => ORDER_SINGLE,
    }
}

/// The row order in force: the one `K3_ROW_ORDER` fixes, else the one
/// [`calibrate_row_order`] measured; `None` while neither has happened (products then walk
/// four rows at a time).
#[must_use]
pub fn row_order() -> Option<RowOrder> {
    match ROW_ORDER.load(Ordering::Relaxed) {
        ORDER_FOURS => Some(RowOrder::Fours),
        ORDER_SINGLE => Some(RowOrder::Single),
        _ => {
            let fixed = match crate::tuning::Tuning::get().row_order {
                RowOrderChoice::Fours => Some(RowOrder::Fours),
                RowOrderChoice::Single => Some(RowOrder::Single),
                RowOrderChoice::Auto => None,
            };
            if let Some(o) = fixed {
                ROW_ORDER.store(order_code(o), Ordering::Relaxed);
            }
            fixed
        }
    }
}

/// Choose the row order once for the process, outside any forward pass: the one
/// `K3_ROW_ORDER` fixes, else the faster of the two on a 4 MiB BF16 matrix (larger than the
/// caches that matter), timed in turn eight times each on the detected path. Later calls
/// return the order chosen. The order changes speed only, never a bit.
pub fn calibrate_row_order() -> RowOrder {
    static CHOSEN: OnceLock<RowOrder> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        if let Some(o) = row_order() {
            return o;
        }
        let isa = isa();
        let keep = if isa == Isa::Generic {
            // The scalar path has one order.
            RowOrder::Single
        } else {
            let (rows, cols) = (1024usize, 2048usize);
            let w: Vec<u16> = (0..rows * cols)
                .map(|i| f32_to_bf16(((i * 7919) % 1000) as f32 * 1e-3 - 0.5))
                .collect();
            let x: Vec<f32> = (0..cols).map(|i| ((i % 17) as f32) * 0.01).collect();
            let mut y = vec![0f32; rows];
            let mut took = [Duration::ZERO; 2];
            for round in 0..17 {
                for (k, order) in [RowOrder::Fours, RowOrder::Single].into_iter().enumerate() {
                    let t0 = Instant::now();
                    matmul_ordered(isa, order, DenseRef::Bf16(&w), rows, cols, &x, &mut y);
                    // The first round warms both up and is not counted.
                    if round > 0 {
                        took[k] += t0.elapsed();
                    }
                }
            }
            if took[1] < took[0] {
                RowOrder::Single
            } else {
                RowOrder::Fours
            }
        };
        ROW_ORDER.store(order_code(keep), Ordering::Relaxed);
        keep
    })
}

/// Number of whole rows of `width` floats, `stride` apart, that `len` floats hold.
fn rows_held(len: usize, stride: usize, width: usize) -> usize {
    if len < width {
        0
    } else {
        (len - width) / stride.max(1) + 1
    }
}

/// Attention scores of one query against cached rows `stride` floats apart:
/// `out[t] = (dot(qa, row_t[..qa.len()]) + dot(qr, row_t[qa.len()..stride])) · scale` for every
/// `t < out.len()` that `rows` holds, each `dot` the fixed-order [`dot`], so every score is
/// bitwise what those calls give. One call per query and head instead of two per position.
pub fn scores(qa: &[f32], qr: &[f32], rows: &[f32], stride: usize, scale: f32, out: &mut [f32]) {
    scores_with(isa(), qa, qr, rows, stride, scale, out);
}

/// [`scores`] on an explicit path.
pub fn scores_with(
    isa: Isa,
    qa: &[f32],
    qr: &[f32],
    rows: &[f32],
    stride: usize,
    scale: f32,
    out: &mut [f32],
) {
    let stride = stride.max(qa.len());
    let n = out.len().min(rows_held(rows.len(), stride, stride));
    let out = &mut out[..n];
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => x86::scores_avx512(qa, qr, rows, stride, scale, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::scores_avx2(qa, qr, rows, stride, scale, out),
        _ => generic::scores(qa, qr, rows, stride, scale, out),
    }
}

/// `y[j] ← y[j] + Σ_t a[t]·rows[t·stride + j]`, one fma per row and element in row order, for
/// every `t < a.len()` that `rows` holds: bitwise what [`axpy`] gives called row after row,
/// with `y` kept in registers across the rows.
pub fn axpy_rows(a: &[f32], rows: &[f32], stride: usize, y: &mut [f32]) {
    axpy_rows_with(isa(), a, rows, stride, y);
}

/// [`axpy_rows`] on an explicit path.
pub fn axpy_rows_with(isa: Isa, a: &[f32], rows: &[f32], stride: usize, y: &mut [f32]) {
    let stride = stride.max(y.len());
    let n = a.len().min(rows_held(rows.len(), stride, y.len()));
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => x86::axpy_rows_avx2(&a[..n], rows, stride, y),
        _ => generic::axpy_rows(&a[..n], rows, stride, y),
    }
}

/// Minimum number of weight elements one parallel task should cover.
const MIN_TASK_ELEMS: usize = 1 << 16;

fn rows_per_task(rows: usize, cols: usize) -> usize {
    let by_work = MIN_TASK_ELEMS.div_ceil(cols.max(1));
    let by_threads = rows.div_ceil(4 * rayon::current_num_threads().max(1));
    by_work.max(by_threads).clamp(1, rows.max(1))
}

/// Dot products of rows `r..r+4` of `w` with `x` through a 4-row kernel, when one exists for
/// this path. Each result equals the single-row kernel's bit for bit.
#[inline]
fn dot4_rows(isa: Isa, w: DenseRef<'_>, r: usize, cols: usize, x: &[f32]) -> Option<[f32; 4]> {
    #[cfg(target_arch = "x86_64")]
    {
        let span = |j: usize| (r + j) * cols..(r + j + 1) * cols;
        match w {
            DenseRef::Bf16(m) => x86::dot4(isa, [0, 1, 2, 3].map(|j| &m[span(j)]), x),
            DenseRef::F32(m) => x86::dot4(isa, [0, 1, 2, 3].map(|j| &m[span(j)]), x),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, w, r, cols, x);
        None
    }
}

/// Rows `r..r+4` of `w` against four vectors at once, when a kernel exists for this path.
/// Each result equals the single-row kernel's bit for bit.
#[inline]
fn dot4_rows_multi(
    isa: Isa,
    w: DenseRef<'_>,
    r: usize,
    cols: usize,
    xs: [&[f32]; 4],
) -> Option<[[f32; 4]; 4]> {
    #[cfg(target_arch = "x86_64")]
    {
        let span = |j: usize| (r + j) * cols..(r + j + 1) * cols;
        match w {
            DenseRef::Bf16(m) => x86::dot4_multi(isa, [0, 1, 2, 3].map(|j| &m[span(j)]), xs),
            DenseRef::F32(m) => x86::dot4_multi(isa, [0, 1, 2, 3].map(|j| &m[span(j)]), xs),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, w, r, cols, xs);
        None
    }
}

/// Products of one dense matrix `w` `[rows, cols]` with a batch of vectors.
///
/// `x` is `[n_tok, cols]`, `y` is `[n_tok, rows]` (overwritten). Each output element is one
/// fixed-order dot product, so the batch size, the thread count and the path cannot change it.
pub fn matmul(w: DenseRef<'_>, rows: usize, cols: usize, x: &[f32], y: &mut [f32]) {
    matmul_with(isa(), w, rows, cols, x, y);
}

/// [`matmul`] on an explicit path.
pub fn matmul_with(isa: Isa, w: DenseRef<'_>, rows: usize, cols: usize, x: &[f32], y: &mut [f32]) {
    let order = row_order().unwrap_or(RowOrder::Fours);
    matmul_ordered(isa, order, w, rows, cols, x, y);
}

/// [`matmul_with`] walking a one-token product in `order` (the same bits either way).
pub fn matmul_ordered(
    isa: Isa,
    order: RowOrder,
    w: DenseRef<'_>,
    rows: usize,
    cols: usize,
    x: &[f32],
    y: &mut [f32],
) {
    assert_eq!(w.len(), rows * cols, "matmul: weight size");
    assert!(
        cols > 0 && x.len().is_multiple_of(cols),
        "matmul: input size"
    );
    let n_tok = x.len() / cols;
    assert_eq!(y.len(), n_tok * rows, "matmul: output size");
    let per_task = rows_per_task(rows, cols).next_multiple_of(4);
    let fill = |ci: usize, out: &mut [f32], order: RowOrder| {
        fill_rows(isa, order, w, ci * per_task, cols, x, n_tok, out);
    };
    if n_tok == 1 {
        // The generic path has no 4-row kernel: every row goes through the single-row one.
        let order = if isa == Isa::Generic {
            RowOrder::Single
        } else {
            order
        };
        y.par_chunks_mut(per_task)
            .enumerate()
            .for_each(|(ci, out)| fill(ci, out, order));
        return;
    }
    with_scratch(rows * n_tok, |tmp| {
        tmp.par_chunks_mut(per_task * n_tok)
            .enumerate()
            .for_each(|(ci, out)| fill(ci, out, RowOrder::Fours));
        transpose_into(tmp, rows, n_tok, y);
    });
}

/// Rows `base..` of `w` (`cols` wide) against the `n_tok` vectors of `x`, into `out`
/// `[rows, n_tok]` (row-major; as many rows as `out` holds): four rows against four vectors at
/// once where a kernel takes them, one token at a time in `order` otherwise. Every result is
/// the single-row kernel's bit for bit.
#[allow(clippy::too_many_arguments)]
fn fill_rows(
    isa: Isa,
    order: RowOrder,
    w: DenseRef<'_>,
    base: usize,
    cols: usize,
    x: &[f32],
    n_tok: usize,
    out: &mut [f32],
) {
    let row_dot = |r: usize, xt: &[f32]| -> f32 {
        match w {
            DenseRef::F32(m) => dot_with(isa, &m[r * cols..(r + 1) * cols], xt),
            DenseRef::Bf16(m) => dot_bf16_with(isa, &m[r * cols..(r + 1) * cols], xt),
        }
    };
    let n_rows = out.len() / n_tok;
    // Blocks of four tokens, where a kernel takes four rows against four vectors at once.
    let mut t0 = 0;
    'blocks: while t0 + 4 <= n_tok && n_rows >= 4 {
        let xs: [&[f32]; 4] = std::array::from_fn(|j| &x[(t0 + j) * cols..(t0 + j + 1) * cols]);
        let mut k = 0;
        while k + 4 <= n_rows {
            let Some(v) = dot4_rows_multi(isa, w, base + k, cols, xs) else {
                break 'blocks;
            };
            for (j, vt) in v.into_iter().enumerate() {
                for (i, vi) in vt.into_iter().enumerate() {
                    out[(k + i) * n_tok + t0 + j] = vi;
                }
            }
            k += 4;
        }
        for kk in k..n_rows {
            for (j, xt) in xs.iter().enumerate() {
                out[kk * n_tok + t0 + j] = row_dot(base + kk, xt);
            }
        }
        t0 += 4;
    }
    for t in t0..n_tok {
        let xt = &x[t * cols..(t + 1) * cols];
        let mut k = 0;
        while order == RowOrder::Fours && k + 4 <= n_rows {
            let Some(v) = dot4_rows(isa, w, base + k, cols, xt) else {
                break;
            };
            for (j, vj) in v.into_iter().enumerate() {
                out[(k + j) * n_tok + t] = vj;
            }
            k += 4;
        }
        for kk in k..n_rows {
            out[kk * n_tok + t] = row_dot(base + kk, xt);
        }
    }
}

/// Products of one MXFP4 matrix with a batch of vectors: `x` `[n_tok, cols]`, `y`
/// `[n_tok, rows]`, multiplied straight from the packed nibbles and scale bytes.
pub fn matmul_mxfp4(w: &Mxfp4Matrix<'_>, x: &[f32], y: &mut [f32]) {
    matmul_mxfp4_with(isa(), w, x, y);
}

/// [`matmul_mxfp4`] on an explicit path.
pub fn matmul_mxfp4_with(isa: Isa, w: &Mxfp4Matrix<'_>, x: &[f32], y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    assert!(
        cols > 0 && x.len().is_multiple_of(cols),
        "mxfp4: input size"
    );
    let n_tok = x.len() / cols;
    assert_eq!(y.len(), n_tok * rows, "mxfp4: output size");
    let per_task = rows_per_task(rows, cols / 2);
    let xt = |t: usize| &x[t * cols..(t + 1) * cols];
    let row_dot = |r: usize, t: usize| -> f32 {
        let (p, s) = w.row(r);
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 => x86::mxfp4_row_avx2(p, s, xt(t)),
            _ => generic::mxfp4_row(p, s, xt(t)),
        }
    };
    // Row `r` against `N` tokens from `t` with the nibbles decoded once, where a kernel
    // exists; every result equals `row_dot`'s bit for bit.
    fn multi<const N: usize>(
        isa: Isa,
        w: &Mxfp4Matrix<'_>,
        r: usize,
        xs: [&[f32]; N],
        out: &mut [f32],
    ) -> bool {
        #[cfg(target_arch = "x86_64")]
        if matches!(isa, Isa::Avx2 | Isa::Avx512) {
            let (p, s) = w.row(r);
            out.copy_from_slice(&x86::mxfp4_row_multi_avx2::<N>(p, s, xs));
            return true;
        }
        let _ = (isa, w, r, xs, out);
        false
    }
    // Rows of one task, each against every token: `out` is [rows of the task, n_tok]. On
    // AVX-512, rows go two at a time (a row left over takes the one-row kernels).
    let fill = |base: usize, out: &mut [f32]| {
        let paired = if isa == Isa::Avx512 {
            rows2(w, base, n_tok, xt, out)
        } else {
            0
        };
        for (k, row_out) in out.chunks_mut(n_tok).enumerate().skip(paired) {
            let r = base + k;
            let mut t = 0;
            while t + 8 <= n_tok {
                let xs = std::array::from_fn::<_, 8, _>(|j| xt(t + j));
                if !multi::<8>(isa, w, r, xs, &mut row_out[t..t + 8]) {
                    break;
                }
                t += 8;
            }
            while t + 4 <= n_tok {
                let xs = std::array::from_fn::<_, 4, _>(|j| xt(t + j));
                if !multi::<4>(isa, w, r, xs, &mut row_out[t..t + 4]) {
                    break;
                }
                t += 4;
            }
            let done = match n_tok - t {
                3 => multi::<3>(isa, w, r, [xt(t), xt(t + 1), xt(t + 2)], &mut row_out[t..]),
                2 => multi::<2>(isa, w, r, [xt(t), xt(t + 1)], &mut row_out[t..]),
                _ => false,
            };
            if done {
                t = n_tok;
            }
            for (tt, o) in row_out.iter_mut().enumerate().skip(t) {
                *o = row_dot(r, tt);
            }
        }
    };
    if n_tok == 1 {
        y.par_chunks_mut(per_task)
            .enumerate()
            .for_each(|(ci, out)| fill(ci * per_task, out));
        return;
    }
    with_scratch(rows * n_tok, |tmp| {
        tmp.par_chunks_mut(per_task * n_tok)
            .enumerate()
            .for_each(|(ci, out)| fill(ci * per_task, out));
        transpose_into(tmp, rows, n_tok, y);
    });
}

/// Rows `base, base+1, …` of `w` two at a time against every token, into `out` `[rows, n_tok]`
/// (row-major), through the two-row AVX-512 kernel; returns how many rows it filled (all but
/// a last odd one, or none where there is no such kernel). Every result equals the one-row
/// kernel's bit for bit.
fn rows2<'x>(
    w: &Mxfp4Matrix<'_>,
    base: usize,
    n_tok: usize,
    xt: impl Fn(usize) -> &'x [f32],
    out: &mut [f32],
) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        fn block<const N: usize>(
            w: &Mxfp4Matrix<'_>,
            r: usize,
            xs: [&[f32]; N],
            a: &mut [f32],
            b: &mut [f32],
        ) {
            let v = x86::mxfp4_rows2_multi_avx512::<N>([w.row(r), w.row(r + 1)], xs);
            for (j, [p, q]) in v.into_iter().enumerate() {
                a[j] = p;
                b[j] = q;
            }
        }
        let pairs = out.len() / n_tok / 2;
        for (i, two) in out.chunks_exact_mut(2 * n_tok).take(pairs).enumerate() {
            let r = base + 2 * i;
            let (a, b) = two.split_at_mut(n_tok);
            let mut t = 0;
            while t + 8 <= n_tok {
                let xs = std::array::from_fn::<_, 8, _>(|j| xt(t + j));
                block::<8>(w, r, xs, &mut a[t..t + 8], &mut b[t..t + 8]);
                t += 8;
            }
            if t + 4 <= n_tok {
                let xs = std::array::from_fn::<_, 4, _>(|j| xt(t + j));
                block::<4>(w, r, xs, &mut a[t..t + 4], &mut b[t..t + 4]);
                t += 4;
            }
            let (a, b) = (&mut a[t..], &mut b[t..]);
            match n_tok - t {
                3 => block::<3>(w, r, [xt(t), xt(t + 1), xt(t + 2)], a, b),
                2 => block::<2>(w, r, [xt(t), xt(t + 1)], a, b),
                1 => block::<1>(w, r, [xt(t)], a, b),
                _ => {}
            }
        }
        2 * pairs
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (w, base, n_tok, xt, out);
        0
    }
}

/// Buffers for the row-major products of a batch, shared by every thread: a call takes one
/// (or makes one) and gives it back, so the process holds as many as there were batched
/// products in progress at once (one per forward pass in flight), not one per thread that
/// ever ran one.
static SCRATCH: std::sync::Mutex<Vec<Vec<f32>>> = std::sync::Mutex::new(Vec::new());

fn scratch_pool() -> std::sync::MutexGuard<'static, Vec<Vec<f32>>> {
    // The pool is only pushed to and popped from; a panic between the two loses a buffer,
    // never leaves the list inconsistent.
    SCRATCH
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Run `f` on `n` floats of a scratch buffer (contents unspecified), kept between calls so
/// that a batch allocates nothing once the buffer is large enough. A nested call (a task
/// stolen while `f` waits) gets a buffer of its own. A buffer grows to exactly what is asked
/// ([`batch_scratch_bytes`] is what the memory plan counts), never by doubling.
fn with_scratch(n: usize, f: impl FnOnce(&mut [f32])) {
    let mut buf = scratch_pool().pop().unwrap_or_default();
    if buf.len() < n {
        buf.reserve_exact(n - buf.len());
        buf.resize(n, 0.0);
    }
    f(&mut buf[..n]);
    scratch_pool().push(buf);
}

/// Bytes the batch scratch buffers hold now.
#[must_use]
pub fn batch_scratch_bytes() -> usize {
    scratch_pool().iter().map(|b| b.capacity() * 4).sum()
}

/// Free the batch scratch buffers not in use (the next batched product makes one again).
pub fn release_batch_scratch() {
    let freed = std::mem::take(&mut *scratch_pool());
    drop(freed);
}

/// `y[t·rows + r] = tmp[r·n_tok + t]`.
fn transpose_into(tmp: &[f32], rows: usize, n_tok: usize, y: &mut [f32]) {
    for r in 0..rows {
        for t in 0..n_tok {
            y[t * rows + r] = tmp[r * n_tok + t];
        }
    }
}

/// Index of the first largest value (ties go to the lowest index); 0 for an empty slice.
#[must_use]
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Widen one BF16 value (raw bits) to f32 exactly.
#[inline]
#[must_use]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// Round an f32 to BF16 bits (round to nearest even; NaN stays NaN).
#[must_use]
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// Widen IEEE half-precision bits to f32 exactly.
#[must_use]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: renormalise.
            let shift = m.leading_zeros() - 21;
            let m = (m << shift) & 0x3ff;
            sign | ((127 - 15 + 1 - shift) << 23) | (m << 13)
        }
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}
