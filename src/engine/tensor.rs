//! Owned weight matrices as the engine holds them: dense (F32 or BF16, never widened in memory)
//! and MXFP4 (packed nibbles and scales, multiplied in place).

use crate::kernels::{self, DenseRef, Mxfp4Matrix};
use crate::stream::bytes::{Bytes, U16s};
use crate::stream::trunk::CodedMatrix;

/// Storage of a dense matrix.
#[derive(Clone, Debug)]
pub enum DenseData {
    /// float32.
    F32(Vec<f32>),
    /// bfloat16 raw bits (in place in the buffer they were read into).
    Bf16(U16s),
    /// bfloat16 nibble-coded as the packed trunk stores it, multiplied without being decoded
    /// (a pinned layer's matrices; docs/trunk-codec.md).
    Coded(Box<CodedMatrix>),
}

/// A dense row-major matrix `[rows, cols]`, applied as `y = W x`.
#[derive(Clone, Debug)]
pub struct Dense {
    /// Elements.
    pub data: DenseData,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
}

impl Dense {
    /// A float32 matrix (panics if the size is wrong; for fixtures and tests).
    #[must_use]
    pub fn f32(data: Vec<f32>, rows: usize, cols: usize) -> Self {
        assert_eq!(data.len(), rows * cols, "Dense::f32 size");
        Dense {
            data: DenseData::F32(data),
            rows,
            cols,
        }
    }

    /// Bytes the matrix holds.
    #[must_use]
    pub fn held_bytes(&self) -> usize {
        match &self.data {
            DenseData::F32(v) => 4 * v.len(),
            DenseData::Bf16(v) => 2 * v.len(),
            DenseData::Coded(m) => m.held_bytes(),
        }
    }

    /// `y[t] = W x[t]` for a batch: `x` `[n_tok, cols]` → new `[n_tok, rows]`.
    #[must_use]
    pub fn apply(&self, x: &[f32]) -> Vec<f32> {
        let n_tok = x.len() / self.cols;
        let mut y = vec![0f32; n_tok * self.rows];
        self.apply_into(x, &mut y);
        y
    }

    /// [`Dense::apply`] into `y` `[n_tok, rows]` (overwritten).
    pub fn apply_into(&self, x: &[f32], y: &mut [f32]) {
        let (rows, cols) = (self.rows, self.cols);
        match &self.data {
            DenseData::F32(v) => kernels::matmul(DenseRef::F32(v), rows, cols, x, y),
            DenseData::Bf16(v) => kernels::matmul(DenseRef::Bf16(v.as_slice()), rows, cols, x, y),
            DenseData::Coded(m) => kernels::matmul_nibble_with(kernels::isa(), &m.matrix(), x, y),
        }
    }

    /// Dot product of row `r` with `x`.
    #[must_use]
    pub fn row_dot(&self, r: usize, x: &[f32]) -> f32 {
        let (a, b) = (r * self.cols, (r + 1) * self.cols);
        match &self.data {
            DenseData::F32(v) => kernels::dot(&v[a..b], x),
            DenseData::Bf16(v) => kernels::dot_bf16_with(kernels::isa(), &v[a..b], x),
            DenseData::Coded(m) => m.matrix().row_dot(kernels::isa(), r, x),
        }
    }

    /// `y += alpha · W[r, :]`.
    pub fn row_axpy(&self, r: usize, alpha: f32, y: &mut [f32]) {
        let (a, b) = (r * self.cols, (r + 1) * self.cols);
        match &self.data {
            DenseData::F32(v) => kernels::axpy(alpha, &v[a..b], y),
            DenseData::Bf16(v) => kernels::axpy_bf16(alpha, &v[a..b], y),
            DenseData::Coded(m) => m.matrix().row_axpy(r, alpha, y),
        }
    }

    /// Copy row `r` widened to f32 into `out`.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let (a, b) = (r * self.cols, (r + 1) * self.cols);
        match &self.data {
            DenseData::F32(v) => out.copy_from_slice(&v[a..b]),
            DenseData::Bf16(v) => {
                for (o, &w) in out.iter_mut().zip(&v[a..b]) {
                    *o = kernels::bf16_to_f32(w);
                }
            }
            DenseData::Coded(m) => {
                let mut row = [0u16; 32];
                let mut whole = Vec::new();
                let row: &mut [u16] = if self.cols <= row.len() {
                    &mut row[..self.cols]
                } else {
                    whole.resize(self.cols, 0);
                    &mut whole
                };
                m.matrix().decode_row(r, row);
                for (o, &w) in out.iter_mut().zip(row.iter()) {
                    *o = kernels::bf16_to_f32(w);
                }
            }
        }
    }
}

/// An MXFP4 matrix `[rows, cols]`, its bytes in place in the buffer they were read into.
#[derive(Clone, Debug)]
pub struct Mxfp4 {
    /// `[rows, cols/2]` nibbles.
    pub packed: Bytes,
    /// `[rows, cols/32]` scale bytes.
    pub scales: Bytes,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
}

/// A weight matrix of either kind (routed experts are MXFP4 in the release; dense in some
/// fixtures).
#[derive(Clone, Debug)]
pub enum Matrix {
    /// Dense.
    Dense(Dense),
    /// MXFP4.
    Mxfp4(Mxfp4),
}

impl Matrix {
    /// Output features.
    #[must_use]
    pub fn rows(&self) -> usize {
        match self {
            Matrix::Dense(d) => d.rows,
            Matrix::Mxfp4(m) => m.rows,
        }
    }

    /// `y[t] = W x[t]` for a batch.
    #[must_use]
    pub fn apply(&self, x: &[f32]) -> Vec<f32> {
        let n_tok = x.len() / self.cols();
        let mut y = vec![0f32; n_tok * self.rows()];
        self.apply_into(x, &mut y);
        y
    }

    /// Input features.
    #[must_use]
    pub fn cols(&self) -> usize {
        match self {
            Matrix::Dense(d) => d.cols,
            Matrix::Mxfp4(m) => m.cols,
        }
    }

    /// [`Matrix::apply`] into `y` `[n_tok, rows]` (overwritten).
    pub fn apply_into(&self, x: &[f32], y: &mut [f32]) {
        match self {
            Matrix::Dense(d) => d.apply_into(x, y),
            Matrix::Mxfp4(m) => {
                let view = Mxfp4Matrix {
                    packed: &m.packed,
                    scales: &m.scales,
                    rows: m.rows,
                    cols: m.cols,
                };
                kernels::matmul_mxfp4(&view, x, y);
            }
        }
    }
}

/// The first `n` elements of `buf`, grown (never shrunk) to hold them: a reusable buffer
/// whose contents the caller overwrites. It allocates only when `n` exceeds every earlier
/// request, and then to exactly `n` (not by doubling: the memory plan counts what the
/// buffers of a chunk hold, [`super::run_state::activation_sizes`]).
pub fn fit<T: Clone + Default>(buf: &mut Vec<T>, n: usize) -> &mut [T] {
    if buf.len() < n {
        buf.reserve_exact(n - buf.len());
        buf.resize(n, T::default());
    }
    &mut buf[..n]
}
