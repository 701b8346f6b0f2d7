//! MXFP4 (OCP microscaling FP4) weights: E2M1 nibbles with one E8M0 scale byte per 32
//! consecutive elements of a row.
//!
//! Byte `packed[r, j]` holds element `(r, 2j)` in its **low** nibble and `(r, 2j+1)` in its
//! high nibble. Value = `E2M1[nibble] · 2^(scale − 127)`; a scale byte of 255 (NaN in the OCP
//! spec) contributes nothing. The kernels work in half units (`2·E2M1`, small integers) and
//! halve the scale instead, an exact rescaling.

/// E2M1 code table: codes 0..7 positive, 8..15 negative (bit 3 is the sign).
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The E2M1 table in half units (`2·E2M1`).
pub(crate) const E2M1_HALF: [f32; 16] = [
    0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, -0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0,
];

/// `2^(e)` as an exact f32 for −149 ≤ e ≤ 127 (subnormals included).
const fn pow2(e: i32) -> f32 {
    if e >= -126 {
        f32::from_bits(((e + 127) as u32) << 23)
    } else {
        f32::from_bits(1u32 << (e + 149))
    }
}

const fn build_scale_table(bias: i32) -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut s = 0;
    while s < 255 {
        t[s] = pow2(s as i32 - bias);
        s += 1;
    }
    t
}

/// `2^(s−127)` per scale byte (255 → 0).
pub const SCALE: [f32; 256] = build_scale_table(127);
/// `2^(s−128)` per scale byte (255 → 0): the multiplier for half-unit sums.
pub(crate) const SCALE_HALF: [f32; 256] = build_scale_table(128);

/// Multiplier applied to a half-unit group sum.
#[inline]
pub(crate) fn scale_half_units(s: u8) -> f32 {
    SCALE_HALF[usize::from(s)]
}

/// Dequantised value of one element (for tests and diagnostics; kernels never materialise).
#[must_use]
pub fn element(packed: &[u8], scales: &[u8], i: usize) -> f32 {
    let byte = packed[i / 2];
    let nib = if i.is_multiple_of(2) {
        byte & 0x0f
    } else {
        byte >> 4
    };
    E2M1[usize::from(nib)] * SCALE[usize::from(scales[i / 32])]
}

/// A borrowed MXFP4 matrix `[rows, cols]` (logical shape).
#[derive(Clone, Copy, Debug)]
pub struct Mxfp4Matrix<'a> {
    /// `[rows, cols/2]` packed nibbles.
    pub packed: &'a [u8],
    /// `[rows, cols/32]` E8M0 scale bytes.
    pub scales: &'a [u8],
    /// Output features.
    pub rows: usize,
    /// Input features (multiple of 32).
    pub cols: usize,
}

impl<'a> Mxfp4Matrix<'a> {
    /// Wrap packed bytes and scales; `None` unless the sizes agree with `[rows, cols]` and
    /// `cols` is a multiple of 32.
    #[must_use]
    pub fn new(packed: &'a [u8], scales: &'a [u8], rows: usize, cols: usize) -> Option<Self> {
        (cols.is_multiple_of(32)
            && packed.len() == rows * cols / 2
            && scales.len() == rows * cols / 32)
            .then_some(Self {
                packed,
                scales,
                rows,
                cols,
            })
    }

    /// The packed bytes and scales of row `r`.
    #[inline]
    #[must_use]
    pub fn row(&self, r: usize) -> (&'a [u8], &'a [u8]) {
        let pb = self.cols / 2;
        let sb = self.cols / 32;
        (
            &self.packed[r * pb..(r + 1) * pb],
            &self.scales[r * sb..(r + 1) * sb],
        )
    }
}
