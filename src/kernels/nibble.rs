//! BF16 matrices held as the packed trunk stores them, nibble-coded (docs/trunk-codec.md,
//! `k3n1`), and multiplied without being decoded first: each step puts 32 values' BF16 bits
//! together in registers from their low bytes and their 4-bit codes looked up in the block's
//! dictionary, and accumulates them into the lanes a BF16 row would use. A pinned layer held
//! this way takes three quarters of the memory, and a product reads three quarters of the bytes.
//!
//! Every value lands in the lane, and in the order, [`generic::dot_bf16`] gives it, so a product
//! is bit for bit the product of the decoded matrix on every path. That needs the pieces of a
//! row (a row may run over into the next block, whose dictionary differs) to start at a
//! multiple of 16 values: a matrix is held this way only when its row length is a multiple of
//! 32 ([`NibbleMatrix::new`]).

use super::{generic, Isa};
use rayon::prelude::*;

/// Values per block (the codec's, `stream::codec::BLOCK_ELEMS`): every block but a matrix's
/// last holds this many.
pub const NIBBLE_BLOCK: usize = 1 << 18;

/// Where one block of a nibble-coded matrix lies in its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NibbleBlock {
    /// Coded values: the dictionary, and the offsets of the low bytes (one per value), the
    /// codes (two per byte) and the `escapes` escaped high bytes.
    Coded {
        /// The block's 15 high bytes, entry 15 (the escape) 0.
        dict: [u8; 16],
        /// Offset of the low bytes.
        low: usize,
        /// Offset of the codes.
        nib: usize,
        /// Offset of the escaped high bytes.
        esc: usize,
        /// Escaped values in the block.
        escapes: usize,
    },
    /// Values stored as they are (little-endian BF16) from offset `at`.
    Raw {
        /// Offset of the values.
        at: usize,
    },
}

/// A row-major BF16 matrix `[rows, cols]` held nibble-coded: `bytes` holds its blocks,
/// located by `blocks`; `row_esc[r]` is the number of escaped values of row `r`'s block
/// before the row's first value (where the row's escapes start).
#[derive(Clone, Copy, Debug)]
pub struct NibbleMatrix<'a> {
    bytes: &'a [u8],
    blocks: &'a [NibbleBlock],
    row_esc: &'a [u32],
    rows: usize,
    cols: usize,
}

/// A piece of a row: the part of it in one block.
struct Piece<'a> {
    block: NibbleBlock,
    /// The row's values in the piece, from value `at` of the block.
    at: usize,
    len: usize,
    /// The escapes of the block before the piece.
    esc_from: usize,
    bytes: &'a [u8],
}

impl<'a> NibbleMatrix<'a> {
    /// The matrix, when its parts are consistent: `cols` a multiple of 32, one block per
    /// [`NIBBLE_BLOCK`] values, one escape start per row, and every block's parts inside
    /// `bytes`. None otherwise (such a matrix is decoded instead of held coded).
    #[must_use]
    pub fn new(
        bytes: &'a [u8],
        blocks: &'a [NibbleBlock],
        row_esc: &'a [u32],
        rows: usize,
        cols: usize,
    ) -> Option<Self> {
        let total = rows.checked_mul(cols)?;
        if cols == 0 || !cols.is_multiple_of(32) || row_esc.len() != rows {
            return None;
        }
        if blocks.len() != total.div_ceil(NIBBLE_BLOCK) {
            return None;
        }
        for (b, block) in blocks.iter().enumerate() {
            let n = NIBBLE_BLOCK.min(total - b * NIBBLE_BLOCK);
            let fits =
                |at: usize, len: usize| at.checked_add(len).is_some_and(|e| e <= bytes.len());
            let ok = match *block {
                NibbleBlock::Coded {
                    dict,
                    low,
                    nib,
                    esc,
                    escapes,
                } => {
                    dict[15] == 0 && fits(low, n) && fits(nib, n.div_ceil(2)) && fits(esc, escapes)
                }
                NibbleBlock::Raw { at } => fits(at, 2 * n),
            };
            if !ok {
                return None;
            }
        }
        Some(NibbleMatrix {
            bytes,
            blocks,
            row_esc,
            rows,
            cols,
        })
    }

    /// The matrix from parts [`NibbleMatrix::new`] accepted before and that have not changed
    /// since, without walking the block table again: a holder checks its parts once, when it
    /// is made, and then takes a view for every product. Parts that were never accepted can
    /// only make a product panic on a slice bound (every access is bounds-checked), and debug
    /// builds check them again.
    #[must_use]
    pub fn from_checked(
        bytes: &'a [u8],
        blocks: &'a [NibbleBlock],
        row_esc: &'a [u32],
        rows: usize,
        cols: usize,
    ) -> Self {
        debug_assert!(
            Self::new(bytes, blocks, row_esc, rows, cols).is_some(),
            "nibble matrix: parts never checked"
        );
        NibbleMatrix {
            bytes,
            blocks,
            row_esc,
            rows,
            cols,
        }
    }

    /// Rows.
    #[must_use]
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    #[must_use]
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The pieces of row `r`, in order, each with the values of `x` it multiplies.
    fn pieces(&self, r: usize) -> impl Iterator<Item = Piece<'a>> + '_ {
        let start = r * self.cols;
        let end = start + self.cols;
        let mut v = start;
        let first_esc = self.row_esc.get(r).map_or(0, |&e| e as usize);
        std::iter::from_fn(move || {
            if v >= end {
                return None;
            }
            let (b, at) = (v / NIBBLE_BLOCK, v % NIBBLE_BLOCK);
            let len = (NIBBLE_BLOCK - at).min(end - v);
            let piece = Piece {
                block: *self.blocks.get(b)?,
                at,
                len,
                esc_from: if v == start { first_esc } else { 0 },
                bytes: self.bytes,
            };
            v += len;
            Some(piece)
        })
    }

    /// Accumulate row `r` times `x` into the 16 lanes of a dot product, on `isa`.
    fn row_acc(&self, isa: Isa, r: usize, x: &[f32], acc: &mut [f32; 16]) {
        let mut done = 0;
        for p in self.pieces(r) {
            let xs = &x[done..done + p.len];
            if let Some(c) = p.coded() {
                nibble_dot_acc(isa, &c.dict, c.low, c.nib, c.esc, xs, acc);
            } else if let Some(w) = p.raw() {
                generic::bf16_bytes_dot_acc(w, xs, acc);
            }
            done += p.len;
        }
    }

    /// Row `r` dotted with `x` (`cols` values): exactly [`super::dot_bf16_with`] of the
    /// decoded row on the same path.
    #[must_use]
    pub fn row_dot(&self, isa: Isa, r: usize, x: &[f32]) -> f32 {
        assert!(
            r < self.rows && x.len() >= self.cols,
            "nibble row_dot: size"
        );
        let mut acc = [0f32; 16];
        self.row_acc(isa, r, x, &mut acc);
        generic::fold16(&acc)
    }

    /// Rows `r` and `r + 1` dotted with `x` at once, each exactly its
    /// [`row_dot`](Self::row_dot) on the same path: None where either row is not one coded
    /// piece, or the path has no two-row kernel.
    fn row_dot2(&self, isa: Isa, r: usize, x: &[f32]) -> Option<[f32; 2]> {
        #[cfg(target_arch = "x86_64")]
        {
            let one = |r: usize| {
                let mut pieces = self.pieces(r);
                let first = pieces.next()?;
                pieces.next().is_none().then(|| first.coded()).flatten()
            };
            let (a, b) = (one(r)?, one(r + 1)?);
            fn row<'b>(c: &'b Coded<'_>) -> super::x86::CodedRow<'b> {
                super::x86::CodedRow {
                    dict: &c.dict,
                    low: c.low,
                    nib: c.nib,
                    esc: c.esc,
                }
            }
            let (mut acc0, mut acc1) = ([0f32; 16], [0f32; 16]);
            let x = &x[..self.cols];
            if !super::x86::nibble_dot_acc2(isa, [&row(&a), &row(&b)], x, [&mut acc0, &mut acc1]) {
                return None;
            }
            Some([generic::fold16(&acc0), generic::fold16(&acc1)])
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (isa, r, x);
            None
        }
    }

    /// Decode row `r` into `out` (`cols` BF16 values).
    pub fn decode_row(&self, r: usize, out: &mut [u16]) {
        assert!(
            r < self.rows && out.len() >= self.cols,
            "nibble decode_row: size"
        );
        let mut done = 0;
        for p in self.pieces(r) {
            let o = &mut out[done..done + p.len];
            if let Some(c) = p.coded() {
                let o: &mut [u8] = bytemuck::cast_slice_mut(o);
                // A checked matrix has every escape its codes need; were one missing, the
                // value's high byte would read as 0, as in the products.
                if super::nibble_bf16(&c.dict, c.low, c.nib, c.esc, o).is_none() {
                    generic::nibble_bf16_lenient(&c.dict, c.low, c.nib, c.esc, o);
                }
            } else if let Some(w) = p.raw() {
                for (v, b) in o.iter_mut().zip(w.chunks_exact(2)) {
                    *v = u16::from_le_bytes([b[0], b[1]]);
                }
            }
            done += p.len;
        }
    }

    /// `y ← y + alpha · row r` with fma, exactly [`super::axpy_bf16`] of the decoded row: the
    /// row is decoded [`AXPY_CHUNK`] values at a time on the stack, by the same decoder as
    /// [`decode_row`](Self::decode_row) (the update is element-wise, so the chunks change no
    /// bit).
    pub fn row_axpy(&self, r: usize, alpha: f32, y: &mut [f32]) {
        assert!(
            r < self.rows && y.len() >= self.cols,
            "nibble row_axpy: size"
        );
        let mut buf = [0u16; AXPY_CHUNK];
        let mut done = 0;
        for p in self.pieces(r) {
            let coded = p.coded();
            let mut used = 0;
            for c in (0..p.len).step_by(AXPY_CHUNK) {
                let m = AXPY_CHUNK.min(p.len - c);
                let o = &mut buf[..m];
                if let Some(k) = &coded {
                    let (low, nib) = (&k.low[c..c + m], &k.nib[c / 2..(c + m).div_ceil(2)]);
                    let esc = k.esc.get(used..).unwrap_or_default();
                    let o: &mut [u8] = bytemuck::cast_slice_mut(o);
                    // A checked matrix has every escape its codes need; were one missing, the
                    // value's high byte would read as 0, as in the products.
                    used += match super::nibble_bf16(&k.dict, low, nib, esc, o) {
                        Some(n) => n,
                        None => generic::nibble_bf16_lenient(&k.dict, low, nib, esc, o),
                    };
                } else if let Some(w) = p.raw() {
                    for (v, b) in o.iter_mut().zip(w[2 * c..2 * (c + m)].chunks_exact(2)) {
                        *v = u16::from_le_bytes([b[0], b[1]]);
                    }
                }
                super::axpy_bf16(alpha, o, &mut y[done + c..done + c + m]);
            }
            done += p.len;
        }
    }
}

/// Values [`NibbleMatrix::row_axpy`] decodes at a time (1 KiB on the stack; even, so a chunk
/// starts on a code byte).
const AXPY_CHUNK: usize = 512;

/// A coded piece's dictionary, and the low bytes, codes and escapes of its values.
struct Coded<'a> {
    dict: [u8; 16],
    low: &'a [u8],
    nib: &'a [u8],
    esc: &'a [u8],
}

impl<'a> Piece<'a> {
    /// A coded piece's parts (None for a raw piece).
    fn coded(&self) -> Option<Coded<'a>> {
        let NibbleBlock::Coded {
            dict,
            low,
            nib,
            esc,
            escapes,
        } = self.block
        else {
            return None;
        };
        let (from, to) = (self.at, self.at + self.len);
        let esc = self.bytes[esc..esc + escapes]
            .get(self.esc_from..)
            .unwrap_or_default();
        Some(Coded {
            dict,
            low: &self.bytes[low + from..low + to],
            nib: &self.bytes[nib + from / 2..nib + to.div_ceil(2)],
            esc,
        })
    }

    /// A raw piece's bytes (None for a coded piece).
    fn raw(&self) -> Option<&'a [u8]> {
        match self.block {
            NibbleBlock::Raw { at } => {
                Some(&self.bytes[at + 2 * self.at..at + 2 * (self.at + self.len)])
            }
            NibbleBlock::Coded { .. } => None,
        }
    }
}

/// [`generic::nibble_dot_acc`] on `isa`.
fn nibble_dot_acc(
    isa: Isa,
    dict: &[u8; 16],
    low: &[u8],
    nib: &[u8],
    esc: &[u8],
    x: &[f32],
    acc: &mut [f32; 16],
) -> usize {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => super::x86::nibble_dot_acc(isa, dict, low, nib, esc, x, acc),
        _ => generic::nibble_dot_acc(dict, low, nib, esc, x, acc),
    }
}

/// Products of a nibble-coded matrix with a batch of vectors: `x` `[n_tok, cols]`, `y`
/// `[n_tok, rows]` (overwritten), each output exactly [`super::matmul_with`]'s for the
/// decoded matrix. One token is multiplied straight from the codes; a batch decodes four rows
/// at a time into a small buffer of each thread and multiplies them with the BF16 kernels, so
/// a row is decoded once for all the tokens.
pub fn matmul_nibble_with(isa: Isa, w: &NibbleMatrix<'_>, x: &[f32], y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    assert!(x.len().is_multiple_of(cols), "nibble matmul: input size");
    let n_tok = x.len() / cols;
    assert_eq!(y.len(), n_tok * rows, "nibble matmul: output size");
    let per_task = super::rows_per_task(rows, cols).next_multiple_of(4);
    if n_tok == 1 {
        y.par_chunks_mut(per_task)
            .enumerate()
            .for_each(|(ci, out)| {
                let mut k = 0;
                while k < out.len() {
                    let r = ci * per_task + k;
                    if let Some(pair) = (k + 1 < out.len()).then(|| w.row_dot2(isa, r, x)).flatten()
                    {
                        out[k..k + 2].copy_from_slice(&pair);
                        k += 2;
                    } else {
                        out[k] = w.row_dot(isa, r, x);
                        k += 1;
                    }
                }
            });
        return;
    }
    thread_local! {
        static ROWS: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    super::with_scratch(rows * n_tok, |tmp| {
        tmp.par_chunks_mut(per_task * n_tok)
            .enumerate()
            .for_each(|(ci, out)| {
                ROWS.with_borrow_mut(|buf| {
                    if buf.len() < 4 * cols {
                        buf.resize(4 * cols, 0);
                    }
                    let base = ci * per_task;
                    for (c, part) in out.chunks_mut(4 * n_tok).enumerate() {
                        let k = part.len() / n_tok;
                        for j in 0..k {
                            w.decode_row(base + 4 * c + j, &mut buf[j * cols..(j + 1) * cols]);
                        }
                        let dec = super::DenseRef::Bf16(&buf[..k * cols]);
                        super::fill_rows(isa, super::RowOrder::Fours, dec, 0, cols, x, n_tok, part);
                    }
                });
            });
        super::transpose_into(tmp, rows, n_tok, y);
    });
}
