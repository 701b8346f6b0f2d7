//! Lossless encoding of BF16 tensors for the packed trunk (docs/trunk-codec.md).
//!
//! The high byte of a trained BF16 weight (sign and seven exponent bits) carries about 2.6–2.8
//! bits of information; the low byte (last exponent bit and the mantissa) is close to random.
//! A tensor is cut into independent blocks of [`BLOCK_ELEMS`] values. Each block stores its
//! low bytes verbatim and its high bytes coded from that block's own histogram, as the
//! tensor's [`Coding`] says: a canonical Huffman code of at most [`MAX_LEN`] bits split into
//! [`STREAMS`] interleaved bit streams so the decoder keeps several lookups in flight, or a
//! 4-bit code into a dictionary of the block's 15 most frequent high bytes with an escape
//! (decoded by [`crate::kernels::nibble_bf16`]). A block the code would not shrink is stored
//! raw. Every block carries its length and a CRC-32 of its header
//! and payload, so a corrupt byte is refused, never decoded into different weights.
//!
//! Block layout (all integers little-endian), padded with zeros to a multiple of 8 bytes:
//!
//! ```text
//! 0  u8   kind: 0 raw, 1 Huffman, 2 nibble
//! 1  u8   0
//! 2  u16  0
//! 4  u32  values in the block (BLOCK_ELEMS except in a tensor's last block)
//! 8  u32  payload bytes (after this 16-byte header, before the padding)
//! 12 u32  CRC-32 of header bytes 0..12 and the payload
//! -- raw payload: the values' 2·n bytes as in the tensor
//! -- Huffman payload: 128 bytes of code lengths (two 4-bit lengths per byte, symbol 2k in the
//!    low nibble; 0 = symbol absent), STREAMS × u32 stream byte lengths, the n low bytes, then
//!    the streams. Stream k codes the high bytes of values [k·q, (k+1)·q) with q = ⌈n/STREAMS⌉
//!    (the last stream what remains), least significant bit first.
//! -- nibble payload: 16 dictionary bytes (entry 15, the escape, is 0), u32 escape count e,
//!    the n low bytes, ⌈n/2⌉ code bytes (value 2k in the low half of byte k, 0 after an odd
//!    last value), then the e high bytes of the values coded 15, in value order.
//! ```

use std::mem::MaybeUninit;

/// Name in `trunk.json` of a tensor encoded with [`Coding::Entropy`].
pub const NAME: &str = "k3h1";
/// Name in `trunk.json` of a tensor encoded with [`Coding::Nibble`].
pub const NAME_NIBBLE: &str = "k3n1";
/// Values per block (a block decodes to 512 KiB of BF16).
pub const BLOCK_ELEMS: usize = 1 << 18;
// The kernels that multiply a coded matrix walk it in blocks of the same size.
const _: () = assert!(BLOCK_ELEMS == crate::kernels::NIBBLE_BLOCK);
/// Longest code, in bits: the decode table has `1 << MAX_LEN` entries.
pub const MAX_LEN: u32 = 12;
/// Interleaved bit streams per Huffman block.
pub const STREAMS: usize = 4;
/// Block header bytes.
pub const HEADER: usize = 16;
/// Alignment of blocks in an encoded tensor.
pub const BLOCK_ALIGN: usize = 8;
const KIND_RAW: u8 = 0;
const KIND_HUFF: u8 = 1;
const KIND_NIBBLE: u8 = 2;
/// Bytes of a nibble block's payload before its low bytes: the dictionary and the escape count.
const NIBBLE_HEAD: usize = 16 + 4;
/// The nibble code whose high byte is the next escape byte.
const ESCAPE: u8 = 15;
const LENGTHS: usize = 128;
const TABLE: usize = 1 << MAX_LEN;
/// Flag of a decode table entry that matches no code.
const NO_CODE_FLAG: u16 = 1 << 12;
/// The decode table entry of a bit pattern that is no code: one bit long, flagged.
const NO_CODE: u16 = NO_CODE_FLAG | 1;

/// An encoded tensor that cannot be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// The input ends inside a block, or blocks are missing.
    #[error("block {block}: truncated ({reason})")]
    Truncated {
        /// Block index.
        block: usize,
        /// What is missing.
        reason: String,
    },
    /// A header field is impossible.
    #[error("block {block}: bad header ({reason})")]
    BadHeader {
        /// Block index.
        block: usize,
        /// Which field.
        reason: String,
    },
    /// The block's checksum does not match its bytes.
    #[error("block {block}: checksum {got:08x}, the block says {want:08x}")]
    Checksum {
        /// Block index.
        block: usize,
        /// Computed.
        got: u32,
        /// Stored.
        want: u32,
    },
    /// The code table or a bit stream is invalid.
    #[error("block {block}: bad code ({reason})")]
    BadCode {
        /// Block index.
        block: usize,
        /// What.
        reason: String,
    },
    /// The decoded length differs from the expected one.
    #[error("decodes to {got} bytes, expected {want}")]
    Length {
        /// Bytes the blocks describe.
        got: u64,
        /// Bytes expected.
        want: u64,
    },
}

fn le32(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

/// Code lengths of at most [`MAX_LEN`] bits for the symbol counts `freq` (0 for absent
/// symbols). Huffman's construction; when the longest code is too long the counts are
/// flattened (halved, rounding up) and the code rebuilt.
fn code_lengths(freq: &[u64; 256]) -> [u8; 256] {
    let mut f = *freq;
    loop {
        let lens = huffman_lengths(&f);
        if lens.iter().all(|&l| u32::from(l) <= MAX_LEN) {
            return lens;
        }
        for x in f.iter_mut().filter(|x| **x > 0) {
            *x = x.div_ceil(2);
        }
    }
}

fn huffman_lengths(f: &[u64; 256]) -> [u8; 256] {
    let mut lens = [0u8; 256];
    let used: Vec<usize> = (0..256).filter(|&s| f[s] > 0).collect();
    match used.len() {
        0 => return lens,
        1 => {
            lens[used[0]] = 1;
            return lens;
        }
        _ => {}
    }
    // Nodes: leaves 0..256, internal 256..; parent links give depths.
    let mut parent = vec![usize::MAX; 512];
    let mut heap: std::collections::BinaryHeap<std::cmp::Reverse<(u64, usize)>> =
        used.iter().map(|&s| std::cmp::Reverse((f[s], s))).collect();
    let mut next = 256;
    while heap.len() > 1 {
        let (Some(std::cmp::Reverse((wa, a))), Some(std::cmp::Reverse((wb, b)))) =
            (heap.pop(), heap.pop())
        else {
            break;
        };
        parent[a] = next;
        parent[b] = next;
        heap.push(std::cmp::Reverse((wa + wb, next)));
        next += 1;
    }
    for &s in &used {
        let mut d = 0u8;
        let mut n = s;
        while parent[n] != usize::MAX {
            n = parent[n];
            d = d.saturating_add(1);
        }
        lens[s] = d;
    }
    lens
}

/// Canonical codes for `lens`, bit-reversed for an LSB-first stream.
fn canonical(lens: &[u8; 256]) -> [u16; 256] {
    let mut count = [0u32; 16];
    for &l in lens {
        count[usize::from(l)] += 1;
    }
    count[0] = 0;
    let mut next = [0u32; 16];
    let mut code = 0u32;
    for l in 1..16 {
        code = (code + count[l - 1]) << 1;
        next[l] = code;
    }
    let mut out = [0u16; 256];
    for s in 0..256 {
        let l = u32::from(lens[s]);
        if l > 0 {
            let c = next[l as usize];
            next[l as usize] += 1;
            out[s] = (c.reverse_bits() >> (32 - l)) as u16;
        }
    }
    out
}

/// The decode table for `lens`: entry `bits & (TABLE − 1)` is `symbol << 4 | length`,
/// [`NO_CODE`] where no code matches. Refuses lengths that over-subscribe the code space (Kraft sum above 1).
fn decode_table(lens: &[u8; 256], table: &mut [u16; TABLE]) -> Result<(), String> {
    let mut kraft = 0u64;
    for &l in lens {
        if l > 0 {
            if u32::from(l) > MAX_LEN {
                return Err(format!("code length {l} above {MAX_LEN}"));
            }
            kraft += 1u64 << (MAX_LEN - u32::from(l));
        }
    }
    if kraft > TABLE as u64 {
        return Err("code lengths over-subscribe the code space".into());
    }
    table.fill(NO_CODE);
    let codes = canonical(lens);
    for s in 0..256 {
        let l = u32::from(lens[s]);
        if l == 0 {
            continue;
        }
        let entry = ((s as u16) << 4) | l as u16;
        let mut i = usize::from(codes[s]);
        while i < TABLE {
            table[i] = entry;
            i += 1 << l;
        }
    }
    Ok(())
}

/// LSB-first bit writer.
struct BitWriter<'a> {
    out: &'a mut Vec<u8>,
    acc: u64,
    n: u32,
}

impl BitWriter<'_> {
    fn put(&mut self, code: u16, len: u32) {
        self.acc |= u64::from(code) << self.n;
        self.n += len;
        while self.n >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.n -= 8;
        }
    }

    fn flush(&mut self) {
        if self.n > 0 {
            self.out.push(self.acc as u8);
        }
        self.acc = 0;
        self.n = 0;
    }
}

/// How [`encode_as`] codes the high bytes of a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coding {
    /// A canonical Huffman code per block: the fewest bytes (about 0.67x on trained-like
    /// weights), decoded at a few GB/s per core.
    Entropy,
    /// A 4-bit code per value from a 15-entry dictionary per block, with an escape for the
    /// other high bytes: about 0.75x, decoded with byte shuffles about three times as fast.
    Nibble,
}

impl Coding {
    /// The name a tensor encoded this way has in `trunk.json`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Coding::Entropy => NAME,
            Coding::Nibble => NAME_NIBBLE,
        }
    }

    /// The coding a `trunk.json` encoding name stands for.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Coding> {
        match name {
            NAME => Some(Coding::Entropy),
            NAME_NIBBLE => Some(Coding::Nibble),
            _ => None,
        }
    }
}

/// Append the encoding of the BF16 values `src` (little-endian, an even number of bytes) to
/// `out` with [`Coding::Entropy`] (the blocks encoded on the current rayon pool). Returns
/// false, appending nothing, when `src` has an odd length.
pub fn encode(src: &[u8], out: &mut Vec<u8>) -> bool {
    encode_as(Coding::Entropy, src, out)
}

/// [`encode`] with the given coding.
pub fn encode_as(coding: Coding, src: &[u8], out: &mut Vec<u8>) -> bool {
    if !src.len().is_multiple_of(2) {
        return false;
    }
    use rayon::prelude::*;
    let blocks: Vec<Vec<u8>> = src
        .par_chunks(BLOCK_ELEMS * 2)
        .map(|block| {
            let mut v = Vec::with_capacity(block.len() + HEADER + BLOCK_ALIGN);
            encode_block(coding, block, &mut v);
            v
        })
        .collect();
    for b in blocks {
        out.extend_from_slice(&b);
    }
    true
}

/// Append one block holding the BF16 values `src`.
fn encode_block(coding: Coding, src: &[u8], out: &mut Vec<u8>) {
    let n = src.len() / 2;
    let start = out.len();
    let mut freq = [0u64; 256];
    for v in src.chunks_exact(2) {
        freq[usize::from(v[1])] += 1;
    }
    out.extend_from_slice(&[0u8; HEADER]);
    let coded = match coding {
        Coding::Entropy => huffman_payload(src, &freq, out),
        Coding::Nibble => nibble_payload(src, &freq, out),
    };
    let kind = match coded {
        Some(kind) => kind,
        None => {
            out.extend_from_slice(src);
            KIND_RAW
        }
    };
    let payload = (out.len() - start - HEADER) as u32;
    out[start] = kind;
    out[start + 4..start + 8].copy_from_slice(&(n as u32).to_le_bytes());
    out[start + 8..start + 12].copy_from_slice(&payload.to_le_bytes());
    let mut h = crc32fast::Hasher::new();
    h.update(&out[start..start + 12]);
    h.update(&out[start + HEADER..]);
    let crc = h.finalize();
    out[start + 12..start + 16].copy_from_slice(&crc.to_le_bytes());
    while !(out.len() - start).is_multiple_of(BLOCK_ALIGN) {
        out.push(0);
    }
}

/// Append the Huffman payload of `src` (high-byte histogram `freq`) and return its kind, or
/// append nothing and return `None` when it would not be smaller than the values.
fn huffman_payload(src: &[u8], freq: &[u64; 256], out: &mut Vec<u8>) -> Option<u8> {
    let n = src.len() / 2;
    let lens = code_lengths(freq);
    let bits: u64 = (0..256).map(|s| freq[s] * u64::from(lens[s])).sum();
    // Each stream is padded to a whole byte.
    let huff = LENGTHS + 4 * STREAMS + n + (bits / 8) as usize + STREAMS;
    if huff >= 2 * n {
        return None;
    }
    let codes = canonical(&lens);
    for pair in lens.chunks_exact(2) {
        out.push(pair[0] | (pair[1] << 4));
    }
    let sizes_at = out.len();
    out.extend_from_slice(&[0u8; 4 * STREAMS]);
    out.extend(src.chunks_exact(2).map(|v| v[0]));
    let q = n.div_ceil(STREAMS);
    for k in 0..STREAMS {
        let from = out.len();
        let lo = (k * q).min(n);
        let hi = ((k + 1) * q).min(n);
        let mut w = BitWriter { out, acc: 0, n: 0 };
        for v in src[2 * lo..2 * hi].chunks_exact(2) {
            let s = usize::from(v[1]);
            w.put(codes[s], u32::from(lens[s]));
        }
        w.flush();
        let len = (out.len() - from) as u32;
        out[sizes_at + 4 * k..sizes_at + 4 * k + 4].copy_from_slice(&len.to_le_bytes());
    }
    Some(KIND_HUFF)
}

/// Append the nibble payload of `src` (high-byte histogram `freq`) and return its kind, or
/// append nothing and return `None` when it would not be smaller than the values. The
/// dictionary holds the 15 most frequent high bytes, most frequent first (ties by value).
fn nibble_payload(src: &[u8], freq: &[u64; 256], out: &mut Vec<u8>) -> Option<u8> {
    let n = src.len() / 2;
    let mut order: Vec<u8> = (0..=255).collect();
    order.sort_by_key(|&b| (std::cmp::Reverse(freq[usize::from(b)]), b));
    let mut dict = [0u8; 16];
    let mut code = [ESCAPE; 256];
    for (c, &b) in order.iter().take(usize::from(ESCAPE)).enumerate() {
        if freq[usize::from(b)] > 0 {
            dict[c] = b;
            code[usize::from(b)] = c as u8;
        }
    }
    let escapes: u64 = (0..256)
        .filter(|&b| code[b] == ESCAPE)
        .map(|b| freq[b])
        .sum();
    let size = NIBBLE_HEAD + n + n.div_ceil(2) + escapes as usize;
    if size >= 2 * n {
        return None;
    }
    out.extend_from_slice(&dict);
    out.extend_from_slice(&(escapes as u32).to_le_bytes());
    out.extend(src.chunks_exact(2).map(|v| v[0]));
    for pair in src.chunks(4) {
        let lo = code[usize::from(pair[1])];
        let hi = pair.get(3).map_or(0, |&h| code[usize::from(h)]);
        out.push(lo | (hi << 4));
    }
    out.extend(
        src.chunks_exact(2)
            .map(|v| v[1])
            .filter(|&h| code[usize::from(h)] == ESCAPE),
    );
    Some(KIND_NIBBLE)
}

/// One block located in an encoded tensor by [`locate`].
#[derive(Clone, Copy, Debug)]
pub struct Block {
    /// Index of the block in its tensor.
    index: usize,
    /// Offset of the header in the encoded bytes.
    at: usize,
    /// Values.
    n: usize,
    /// Payload bytes.
    payload: usize,
}

impl Block {
    /// Where the block's values start in the decoded tensor, in bytes.
    #[must_use]
    pub fn decoded_at(&self) -> usize {
        self.index * BLOCK_ELEMS * 2
    }

    /// Bytes the block decodes to.
    #[must_use]
    pub fn decoded_len(&self) -> usize {
        2 * self.n
    }

    /// Bytes the block takes where it is stored, its padding included.
    #[must_use]
    pub fn span(&self) -> usize {
        (HEADER + self.payload).next_multiple_of(BLOCK_ALIGN)
    }

    /// Decode the block from `enc` (the encoded tensor [`locate`] found it in) into `out`,
    /// which receives exactly [`Block::decoded_len`] bytes. Allocates nothing but an error.
    pub fn decode<T: Put>(&self, enc: &[u8], out: &mut [T]) -> Result<(), CodecError> {
        match enc.get(self.at..) {
            Some(e) if e.len() >= HEADER + self.payload => {
                decode_block(self.index, e, self, out, Pace::Fast)
            }
            _ => Err(CodecError::Truncated {
                block: self.index,
                reason: "the block lies outside the input".into(),
            }),
        }
    }
}

/// Walk the block headers of `enc`, which must decode to `want` bytes, calling `found` with
/// each block in order: every block but the last holds [`BLOCK_ELEMS`] values, the blocks
/// cover `enc` exactly (padding included). Allocates nothing but an error.
pub fn locate(enc: &[u8], want: usize, found: impl FnMut(Block)) -> Result<(), CodecError> {
    walk(enc, want, found)
}

/// The blocks of `enc` ([`locate`]) in a vector.
fn blocks(enc: &[u8], want: usize) -> Result<Vec<Block>, CodecError> {
    let mut out = Vec::with_capacity((want / 2).div_ceil(BLOCK_ELEMS));
    walk(enc, want, |b| out.push(b))?;
    Ok(out)
}

fn walk(enc: &[u8], want: usize, mut found: impl FnMut(Block)) -> Result<(), CodecError> {
    let total = values(want)?;
    let mut at = 0usize;
    for b in 0..total.div_ceil(BLOCK_ELEMS) {
        let blk = header(enc, at, b, total)?;
        at += blk.span();
        found(blk);
    }
    if at != enc.len() {
        return Err(CodecError::Length {
            got: enc.len() as u64,
            want: at as u64,
        });
    }
    Ok(())
}

/// Values in a tensor of `want` bytes (an odd length is no BF16 tensor).
fn values(want: usize) -> Result<usize, CodecError> {
    if !want.is_multiple_of(2) {
        return Err(CodecError::Length {
            got: 0,
            want: want as u64,
        });
    }
    Ok(want / 2)
}

/// Most bytes one block takes, its padding included (a payload is at most 4 bytes a value).
pub const MAX_BLOCK_SPAN: usize = (HEADER + 4 * BLOCK_ELEMS).next_multiple_of(BLOCK_ALIGN);

/// The bytes the block whose header starts `enc` says it takes, padding included; None when
/// `enc` is shorter than a header. Only a hint of how much to read: [`block_at`] checks it.
#[must_use]
pub fn stated_span(enc: &[u8]) -> Option<usize> {
    (enc.len() >= HEADER).then(|| (HEADER + le32(enc, 8) as usize).next_multiple_of(BLOCK_ALIGN))
}

/// Block `b` of a tensor of `want` bytes, its header at the start of `enc` (which holds at
/// least the block), checked as [`locate`] checks it; decode it with [`Block::decode`] from
/// `enc`. For reading a tensor's blocks in order as they arrive.
pub fn block_at(enc: &[u8], b: usize, want: usize) -> Result<Block, CodecError> {
    let total = values(want)?;
    if b >= total.div_ceil(BLOCK_ELEMS) {
        return Err(CodecError::Length {
            got: ((b + 1) * BLOCK_ELEMS * 2) as u64,
            want: want as u64,
        });
    }
    header(enc, 0, b, total)
}

/// Check the header of block `b` (of a tensor of `total` values) at `enc[at..]`, its padding,
/// and that the block lies inside `enc`.
fn header(enc: &[u8], at: usize, b: usize, total: usize) -> Result<Block, CodecError> {
    let count = total.div_ceil(BLOCK_ELEMS);
    if enc.len() - at < HEADER {
        return Err(CodecError::Truncated {
            block: b,
            reason: format!(
                "{} bytes end the input where a {HEADER}-byte header belongs",
                enc.len() - at
            ),
        });
    }
    let n = le32(enc, at + 4) as usize;
    let payload = le32(enc, at + 8) as usize;
    let expect = if b + 1 < count {
        BLOCK_ELEMS
    } else {
        total - b * BLOCK_ELEMS
    };
    if n != expect {
        return Err(CodecError::BadHeader {
            block: b,
            reason: format!("{n} values, expected {expect}"),
        });
    }
    if enc[at] > KIND_NIBBLE || enc[at + 1] != 0 || enc[at + 2] != 0 || enc[at + 3] != 0 {
        return Err(CodecError::BadHeader {
            block: b,
            reason: format!(
                "kind {} {} {} {}",
                enc[at],
                enc[at + 1],
                enc[at + 2],
                enc[at + 3]
            ),
        });
    }
    let span = (HEADER + payload).next_multiple_of(BLOCK_ALIGN);
    if payload > 4 * BLOCK_ELEMS || span > enc.len() - at {
        return Err(CodecError::Truncated {
            block: b,
            reason: format!(
                "a payload of {payload} bytes, {} bytes left",
                enc.len() - at - HEADER
            ),
        });
    }
    if enc[at + HEADER + payload..at + span]
        .iter()
        .any(|&x| x != 0)
    {
        return Err(CodecError::BadHeader {
            block: b,
            reason: "non-zero padding after the payload".into(),
        });
    }
    Ok(Block {
        index: b,
        at,
        n,
        payload,
    })
}

/// A nibble-coded matrix located for the kernels that multiply it as it is stored
/// ([`crate::kernels::NibbleMatrix`]): where each block's parts lie, and where each row's
/// escapes start.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NibbleIndex {
    /// Each block's parts, as offsets into the encoded tensor.
    pub blocks: Vec<crate::kernels::NibbleBlock>,
    /// Per row, the escaped values of its block before its first value.
    pub row_esc: Vec<u32>,
}

impl NibbleIndex {
    /// Bytes the index holds for a `[rows, cols]` matrix (what holding it coded costs beyond
    /// its stored bytes).
    #[must_use]
    pub fn bytes_for(rows: usize, cols: usize) -> usize {
        let blocks = (rows * cols).div_ceil(BLOCK_ELEMS);
        blocks * std::mem::size_of::<crate::kernels::NibbleBlock>() + rows * 4
    }
}

/// Check every block of `enc` (a `[rows, cols]` BF16 tensor as [`encode_as`] wrote it) as
/// decoding it would, decoding each into `scratch`, and locate it for the kernels that multiply
/// it coded: None when a block is Huffman-coded or `cols` is not a multiple of 32 (such a
/// tensor is decoded instead). A block that would not decode is the same error [`decode`]
/// gives.
///
/// # Errors
/// The blocks do not decode ([`CodecError`]).
pub fn nibble_index(
    enc: &[u8],
    rows: usize,
    cols: usize,
    scratch: &mut Vec<u8>,
) -> Result<Option<NibbleIndex>, CodecError> {
    use crate::kernels::NibbleBlock;
    let total = rows.checked_mul(cols).ok_or(CodecError::Length {
        got: 0,
        want: u64::MAX,
    })?;
    if cols == 0 || !cols.is_multiple_of(32) {
        return Ok(None);
    }
    let list = blocks(enc, 2 * total)?;
    let mut index = NibbleIndex {
        blocks: Vec::with_capacity(list.len()),
        row_esc: vec![0; rows],
    };
    let mut holdable = true;
    for blk in &list {
        scratch.resize(blk.decoded_len(), 0);
        blk.decode(enc, &mut scratch[..])?;
        let payload = blk.at + HEADER;
        let block = match enc[blk.at] {
            KIND_RAW => NibbleBlock::Raw { at: payload },
            KIND_NIBBLE => {
                let mut dict = [0u8; 16];
                dict.copy_from_slice(&enc[payload..payload + 16]);
                let low = payload + NIBBLE_HEAD;
                NibbleBlock::Coded {
                    dict,
                    low,
                    nib: low + blk.n,
                    esc: low + blk.n + blk.n.div_ceil(2),
                    escapes: le32(enc, payload + 16) as usize,
                }
            }
            _ => {
                holdable = false;
                NibbleBlock::Raw { at: payload }
            }
        };
        if !holdable {
            continue;
        }
        // The escapes before each row that starts in this block.
        if let NibbleBlock::Coded { nib, .. } = block {
            let start = blk.index * BLOCK_ELEMS;
            let codes = &enc[nib..nib + blk.n.div_ceil(2)];
            let (mut count, mut from) = (0usize, 0usize);
            let mut r = start.div_ceil(cols);
            while r < rows && r * cols < start + blk.n {
                let at = (r * cols - start) / 2;
                count += codes[from..at]
                    .iter()
                    .map(|&b| usize::from(b & 15 == 15) + usize::from(b >> 4 == 15))
                    .sum::<usize>();
                from = at;
                index.row_esc[r] = u32::try_from(count).unwrap_or(u32::MAX);
                r += 1;
            }
        }
        index.blocks.push(block);
    }
    Ok(holdable.then_some(index))
}

/// Decode `enc` into `dst`, which receives exactly `dst.len()` bytes of BF16 values; every
/// byte of `dst` is written when this returns Ok. The blocks are decoded on the current rayon
/// pool.
pub fn decode<T: Put + Send>(enc: &[u8], dst: &mut [T]) -> Result<(), CodecError> {
    use rayon::prelude::*;
    let list = blocks(enc, dst.len())?;
    dst.par_chunks_mut(BLOCK_ELEMS * 2)
        .zip(list.par_iter())
        .enumerate()
        .try_for_each(|(b, (out, blk))| decode_block(b, &enc[blk.at..], blk, out, Pace::Fast))
}

/// Decode `enc` into a new vector of `len` bytes.
pub fn decode_to_vec(enc: &[u8], len: usize) -> Result<Vec<u8>, CodecError> {
    let mut out = vec![0u8; len];
    decode_into(enc, &mut out)?;
    Ok(out)
}

/// [`decode`] on the calling thread only.
pub fn decode_into<T: Put>(enc: &[u8], dst: &mut [T]) -> Result<(), CodecError> {
    decode_serial(enc, dst, Pace::Fast)
}

/// The plain decoder: one code per table lookup, one stream after the other. It gives the same
/// result as [`decode`] on every input (the same bytes, or the same error); the tests and the
/// fuzz target hold the fast decoder to it.
pub fn decode_reference(enc: &[u8], len: usize) -> Result<Vec<u8>, CodecError> {
    let mut out = vec![0u8; len];
    decode_serial(enc, &mut out, Pace::Reference)?;
    Ok(out)
}

fn decode_serial<T: Put>(enc: &[u8], dst: &mut [T], pace: Pace) -> Result<(), CodecError> {
    let list = blocks(enc, dst.len())?;
    for (b, (out, blk)) in dst.chunks_mut(BLOCK_ELEMS * 2).zip(&list).enumerate() {
        decode_block(b, &enc[blk.at..], blk, out, pace)?;
    }
    Ok(())
}

/// Which decoding loop [`decode_block`] runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pace {
    /// Several codes per lookup, the four streams in lockstep, then [`Pace::Reference`] for
    /// the last values of each stream.
    Fast,
    /// One code per lookup.
    Reference,
}

/// A byte the decoder writes: `u8` or `MaybeUninit<u8>`.
pub trait Put: private::Sealed + crate::kernels::Byte {
    /// Store `v`.
    fn put(&mut self, v: u8);
}

mod private {
    pub trait Sealed {}
    impl Sealed for u8 {}
    impl Sealed for std::mem::MaybeUninit<u8> {}
}

impl Put for u8 {
    #[inline(always)]
    fn put(&mut self, v: u8) {
        *self = v;
    }
}

impl Put for MaybeUninit<u8> {
    #[inline(always)]
    fn put(&mut self, v: u8) {
        self.write(v);
    }
}

/// Decode block `b` into `out`.
fn decode_block<T: Put>(
    b: usize,
    enc: &[u8],
    blk: &Block,
    out: &mut [T],
    pace: Pace,
) -> Result<(), CodecError> {
    let n = blk.n;
    let payload = &enc[HEADER..HEADER + blk.payload];
    let want = le32(enc, 12);
    let mut h = crc32fast::Hasher::new();
    h.update(&enc[..12]);
    h.update(payload);
    let got = h.finalize();
    if got != want {
        return Err(CodecError::Checksum {
            block: b,
            got,
            want,
        });
    }
    if out.len() != 2 * n {
        return Err(CodecError::Length {
            got: 2 * n as u64,
            want: out.len() as u64,
        });
    }
    if enc[0] == KIND_RAW {
        if payload.len() != 2 * n {
            return Err(CodecError::BadHeader {
                block: b,
                reason: format!("a raw block of {n} values with {} bytes", payload.len()),
            });
        }
        for (d, &s) in out.iter_mut().zip(payload) {
            d.put(s);
        }
        return Ok(());
    }
    let bad = |reason: String| CodecError::BadCode { block: b, reason };
    if enc[0] == KIND_NIBBLE {
        return decode_nibble(b, n, payload, out, pace);
    }
    let fixed = LENGTHS + 4 * STREAMS + n;
    if payload.len() < fixed {
        return Err(CodecError::Truncated {
            block: b,
            reason: format!(
                "a Huffman block of {n} values needs at least {fixed} bytes, it has {}",
                payload.len()
            ),
        });
    }
    let mut lens = [0u8; 256];
    for (k, &byte) in payload[..LENGTHS].iter().enumerate() {
        lens[2 * k] = byte & 15;
        lens[2 * k + 1] = byte >> 4;
    }
    let mut table = [0u16; TABLE];
    decode_table(&lens, &mut table).map_err(bad)?;
    let low = &payload[LENGTHS + 4 * STREAMS..fixed];
    let mut streams: [&[u8]; STREAMS] = [&[]; STREAMS];
    let mut at = fixed;
    for (k, s) in streams.iter_mut().enumerate() {
        let len = le32(payload, LENGTHS + 4 * k) as usize;
        if len > payload.len() - at {
            return Err(CodecError::Truncated {
                block: b,
                reason: format!("stream {k} of {len} bytes runs past the payload"),
            });
        }
        *s = &payload[at..at + len];
        at += len;
    }
    if at != payload.len() {
        return Err(CodecError::Length {
            got: at as u64,
            want: payload.len() as u64,
        });
    }
    let q = n.div_ceil(STREAMS);
    let mut readers: [Reader; STREAMS] = std::array::from_fn(|k| Reader::new(streams[k]));
    // Stream k fills values [k·q, k·q + count(k)); `done[k]` of them are decoded.
    let count = |k: usize| q.min(n.saturating_sub(k * q));
    let mut done = [0usize; STREAMS];
    if pace == Pace::Fast {
        let mut multi = [0u32; TABLE];
        if multi_table(&table, &mut multi) {
            fast_rounds(&mut readers, &multi, low, out, q, n, &mut done);
        }
    }
    // The rest of each stream (all of it for the reference), one code per lookup.
    let mut hi = [0u8; 256];
    for (k, r) in readers.iter_mut().enumerate() {
        let c = count(k);
        let mut at = done[k];
        while at < c {
            let take = (c - at).min(hi.len());
            for x in &mut hi[..take] {
                r.refill();
                *x = r.symbol(&table);
            }
            let v = k * q + at;
            merge(
                &mut out[2 * v..2 * (v + take)],
                &low[v..v + take],
                &hi[..take],
            );
            at += take;
        }
    }
    for (k, r) in readers.iter().enumerate() {
        r.check_end().map_err(|e| bad(format!("stream {k}: {e}")))?;
    }
    Ok(())
}

/// Decode the payload of nibble block `b` of `n` values into `out` (`2n` bytes).
fn decode_nibble<T: Put>(
    b: usize,
    n: usize,
    payload: &[u8],
    out: &mut [T],
    pace: Pace,
) -> Result<(), CodecError> {
    let bad = |reason: String| CodecError::BadCode { block: b, reason };
    let fixed = NIBBLE_HEAD + n + n.div_ceil(2);
    if payload.len() < fixed {
        return Err(CodecError::Truncated {
            block: b,
            reason: format!(
                "a nibble block of {n} values needs at least {fixed} bytes, it has {}",
                payload.len()
            ),
        });
    }
    let escapes = le32(payload, 16) as usize;
    if payload.len() - fixed != escapes {
        return Err(CodecError::Length {
            got: payload.len() as u64,
            want: (fixed as u64) + escapes as u64,
        });
    }
    let mut dict = [0u8; 16];
    dict.copy_from_slice(&payload[..16]);
    if dict[usize::from(ESCAPE)] != 0 {
        return Err(bad(format!(
            "dictionary entry {ESCAPE} (the escape) is {}, not 0",
            dict[usize::from(ESCAPE)]
        )));
    }
    let low = &payload[NIBBLE_HEAD..NIBBLE_HEAD + n];
    let nib = &payload[NIBBLE_HEAD + n..fixed];
    if n % 2 == 1 && nib[n / 2] >> 4 != 0 {
        return Err(bad(
            "the padding nibble after the last value is not 0".into()
        ));
    }
    let esc = &payload[fixed..];
    let used = match pace {
        Pace::Fast => crate::kernels::nibble_bf16(&dict, low, nib, esc, out),
        Pace::Reference => crate::kernels::generic::nibble_bf16(&dict, low, nib, esc, out),
    };
    match used {
        Some(u) if u == escapes => Ok(()),
        Some(u) => Err(bad(format!("{u} escape codes for {escapes} escape bytes"))),
        None => Err(bad(format!(
            "more escape codes than the {escapes} escape bytes"
        ))),
    }
}

/// Lookups per stream in one round of [`fast_rounds`].
const ROUND: usize = 64;
/// Codes one multi-code table entry holds at most.
const MULTI: usize = 3;

/// The multi-code table built from the one-code `table`, or false when some pattern is no
/// code (an incomplete code, which only a one-symbol block has as written: those decode one
/// code per lookup). Entry `bits & (TABLE − 1)` holds the symbols of the 1 to [`MULTI`]
/// codes that `MAX_LEN` bits begin with in bytes 0..3 (the first code in byte 0), their
/// total length in bits 24..30 and their number in bits 30..32.
fn multi_table(table: &[u16; TABLE], multi: &mut [u32; TABLE]) -> bool {
    for (i, m) in multi.iter_mut().enumerate() {
        let e = table[i];
        if e & NO_CODE_FLAG != 0 {
            return false;
        }
        let mut used = u32::from(e & 15);
        let mut syms = u32::from(e >> 4);
        let mut k = 1u32;
        while (k as usize) < MULTI {
            // The bits after the first `used` ones, zeros where the window ends: a code no
            // longer than the bits known is the right one (no code is a prefix of another).
            let next = table[i >> used];
            let len = u32::from(next & 15);
            if used + len > MAX_LEN {
                break;
            }
            syms |= u32::from(next >> 4) << (8 * k);
            used += len;
            k += 1;
        }
        *m = syms | (used << 24) | (k << 30);
    }
    true
}

/// Decode the four streams in lockstep with the multi-code table while every stream has at
/// least a round's worth of values and input bytes left, advancing `done` (values decoded per
/// stream) and the readers exactly as one-code decoding would. The readers must be fresh.
fn fast_rounds<T: Put>(
    readers: &mut [Reader; STREAMS],
    multi: &[u32; TABLE],
    low: &[u8],
    out: &mut [T],
    q: usize,
    n: usize,
    done: &mut [usize; STREAMS],
) {
    // A refill loads 8 bytes at the first unread bit: at least 57 bits, room for four codes
    // of at most MAX_LEN bits. The staging index fits a byte: ROUND · MULTI ≤ 255.
    const REFILLS: usize = ROUND / 4;
    const _: () = assert!(ROUND * MULTI <= 255 && 4 * MAX_LEN as usize <= 57);
    let mut stage = [[0u8; 256 + 4]; STREAMS];
    let count = |k: usize| q.min(n.saturating_sub(k * q));
    // The streams' state in locals, so that it stays in registers: the bit position in the
    // stream and the bits buffered from there.
    let src: [&[u8]; STREAMS] = std::array::from_fn(|k| readers[k].src);
    let mut bitpos = [0usize; STREAMS];
    loop {
        let room = (0..STREAMS).all(|k| {
            count(k) - done[k] >= ROUND * MULTI
                && src[k].len() >= (bitpos[k] + ROUND * MAX_LEN as usize) / 8 + 8
        });
        if !room {
            break;
        }
        let mut staged = [0u8; STREAMS];
        for _ in 0..REFILLS {
            let mut buf = [0u64; STREAMS];
            for k in 0..STREAMS {
                let p = bitpos[k] >> 3;
                let mut a = [0u8; 8];
                a.copy_from_slice(&src[k][p..p + 8]);
                buf[k] = u64::from_le_bytes(a) >> (bitpos[k] & 7);
            }
            for _ in 0..4 {
                for k in 0..STREAMS {
                    let e = multi[(buf[k] as usize) & (TABLE - 1)];
                    let at = usize::from(staged[k]);
                    stage[k][at..at + 4].copy_from_slice(&e.to_le_bytes());
                    staged[k] += (e >> 30) as u8;
                    let len = (e >> 24) & 63;
                    buf[k] >>= len;
                    bitpos[k] += len as usize;
                }
            }
        }
        for k in 0..STREAMS {
            let v = k * q + done[k];
            let take = usize::from(staged[k]);
            merge(
                &mut out[2 * v..2 * (v + take)],
                &low[v..v + take],
                &stage[k][..take],
            );
            done[k] += take;
        }
    }
    for (r, &b) in readers.iter_mut().zip(&bitpos) {
        r.skip(b);
    }
}

/// Interleave low and high bytes into BF16 values.
#[inline(always)]
fn merge<T: Put>(out: &mut [T], low: &[u8], hi: &[u8]) {
    for ((d, &l), &h) in out.chunks_exact_mut(2).zip(low).zip(hi) {
        d[0].put(l);
        d[1].put(h);
    }
}

/// LSB-first bit reader that never reads past its slice: past the end it shifts in zeros and
/// counts them, and [`Reader::check_end`] refuses a stream that used them.
struct Reader<'a> {
    src: &'a [u8],
    pos: usize,
    buf: u64,
    bits: u32,
    /// Every table entry used, or-ed: [`NO_CODE`]'s flag when a pattern matched no code.
    flags: u16,
}

impl<'a> Reader<'a> {
    fn new(src: &'a [u8]) -> Reader<'a> {
        Reader {
            src,
            pos: 0,
            buf: 0,
            bits: 0,
            flags: 0,
        }
    }

    /// Move a fresh reader past the first `bits` bits of its stream, which must hold them.
    fn skip(&mut self, bits: usize) {
        self.pos = bits / 8;
        let rem = (bits % 8) as u32;
        if rem > 0 {
            self.buf = u64::from(self.src[self.pos] >> rem);
            self.bits = 8 - rem;
            self.pos += 1;
        }
    }

    /// Ensure at least 56 bits are buffered (zeros past the end of the stream): room for four
    /// codes.
    #[inline(always)]
    fn refill(&mut self) {
        if let Some(w) = self.src.get(self.pos..self.pos + 8) {
            let mut a = [0u8; 8];
            a.copy_from_slice(w);
            self.buf |= u64::from_le_bytes(a) << self.bits;
            self.pos += ((63 - self.bits) >> 3) as usize;
            self.bits |= 56;
        } else {
            while self.bits <= 56 {
                let byte = match self.src.get(self.pos) {
                    Some(&x) => x,
                    None => 0,
                };
                self.buf |= u64::from(byte) << self.bits;
                self.pos += 1;
                self.bits += 8;
            }
        }
    }

    #[inline(always)]
    fn symbol(&mut self, table: &[u16; TABLE]) -> u8 {
        let e = table[(self.buf as usize) & (TABLE - 1)];
        // A code that matches nothing has the entry [`NO_CODE`]: one bit is consumed and the
        // stream refused at its end.
        self.flags |= e;
        let len = u32::from(e & 15);
        self.buf >>= len;
        self.bits -= len;
        (e >> 4) as u8
    }

    /// Whether the stream decoded cleanly: only valid codes, no bits past its end, and no
    /// whole byte left over.
    fn check_end(&self) -> Result<(), String> {
        if self.flags & NO_CODE_FLAG != 0 {
            return Err("a bit pattern that is no code".into());
        }
        // Bits consumed = bytes pulled in minus bits still buffered.
        let pulled = 8 * self.pos as u64;
        let used = pulled - u64::from(self.bits);
        let avail = 8 * self.src.len() as u64;
        if used > avail {
            return Err(format!("{used} bits decoded from {avail}"));
        }
        if avail - used >= 8 {
            return Err(format!("{} bits left over", avail - used));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Lcg(u64);

    impl Lcg {
        fn next(&mut self) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            self.0 >> 11
        }

        fn unit(&mut self) -> f64 {
            (self.next() as f64 + 0.5) / (1u64 << 53) as f64
        }

        fn normal(&mut self) -> f64 {
            (-2.0 * self.unit().ln()).sqrt() * (std::f64::consts::TAU * self.unit()).cos()
        }
    }

    /// `n` BF16 values drawn from N(0, s) with one in 1000 scaled by 50 (outliers).
    pub(super) fn trained_like(n: usize, s: f64, seed: u64) -> Vec<u8> {
        let mut r = Lcg(seed);
        let mut out = Vec::with_capacity(2 * n);
        for _ in 0..n {
            let mut v = r.normal() * s;
            if r.next().is_multiple_of(1000) {
                v *= 50.0;
            }
            let bits = ((v as f32).to_bits() >> 16) as u16;
            out.extend_from_slice(&bits.to_le_bytes());
        }
        out
    }

    fn round_trip(src: &[u8]) -> Vec<u8> {
        let mut enc = Vec::new();
        assert!(encode(src, &mut enc));
        assert_eq!(enc.len() % BLOCK_ALIGN, 0);
        assert_eq!(decode_to_vec(&enc, src.len()).as_deref(), Ok(src));
        assert_eq!(decode_reference(&enc, src.len()).as_deref(), Ok(src));
        let mut par = vec![0xAAu8; src.len()];
        decode(&enc, &mut par).expect("parallel decode");
        assert_eq!(par, src);
        enc
    }

    #[test]
    fn trained_like_weights_round_trip_below_seven_tenths() {
        let src = trained_like(3 * BLOCK_ELEMS + 1234, 0.02, 7);
        let enc = round_trip(&src);
        let ratio = enc.len() as f64 / src.len() as f64;
        assert!(ratio < 0.70, "ratio {ratio}");
        assert!(ratio > 0.55, "ratio {ratio}");
    }

    #[test]
    fn all_equal_random_empty_and_odd_lengths() {
        let eq: Vec<u8> = [0x12u8, 0x3c].repeat(BLOCK_ELEMS + 5);
        let enc = round_trip(&eq);
        // One bit per high byte.
        assert!(enc.len() < eq.len() * 6 / 10, "{}", enc.len());
        let mut r = Lcg(3);
        let noise: Vec<u8> = (0..2 * 100_001).map(|_| r.next() as u8).collect();
        let enc = round_trip(&noise);
        // Incompressible: stored raw, the header and padding only.
        assert!(enc.len() <= noise.len() + HEADER + BLOCK_ALIGN);
        assert_eq!(enc[0], KIND_RAW);
        assert!(round_trip(&[]).is_empty());
        for n in [
            1usize,
            2,
            3,
            5,
            7,
            13,
            1001,
            BLOCK_ELEMS - 1,
            BLOCK_ELEMS + 1,
        ] {
            round_trip(&trained_like(n, 0.5, n as u64));
        }
        let mut enc = Vec::new();
        assert!(!encode(&[1, 2, 3], &mut enc));
        assert!(enc.is_empty());
    }

    #[test]
    fn long_codes_are_limited() {
        // Fibonacci-like counts force codes far above MAX_LEN without a limit.
        let mut src = Vec::new();
        let (mut a, mut b) = (1usize, 1usize);
        for s in 0..24u8 {
            for _ in 0..a {
                src.extend_from_slice(&[s, s]);
            }
            (a, b) = (b, a + b);
        }
        let mut freq = [0u64; 256];
        for v in src.chunks_exact(2) {
            freq[usize::from(v[1])] += 1;
        }
        assert!(huffman_lengths(&freq)
            .iter()
            .any(|&l| u32::from(l) > MAX_LEN));
        assert!(code_lengths(&freq).iter().all(|&l| u32::from(l) <= MAX_LEN));
        round_trip(&src);
    }

    #[test]
    fn corrupt_blocks_are_refused() {
        let src = trained_like(2 * BLOCK_ELEMS + 77, 0.02, 11);
        let mut enc = Vec::new();
        assert!(encode(&src, &mut enc));
        // Every single-byte change in a sample of positions, including headers: refused or
        // (never) decoded into different values.
        let step = enc.len() / 997;
        for at in (0..enc.len()).step_by(step).chain([0, 4, 8, 12, 16, 200]) {
            let mut bad = enc.clone();
            bad[at] ^= 0x41;
            assert_eq!(
                decode_to_vec(&bad, src.len()),
                decode_reference(&bad, src.len())
            );
            match decode_to_vec(&bad, src.len()) {
                Err(_) => {}
                Ok(v) => assert_eq!(v, src, "byte {at} changed the output silently"),
            }
        }
        // Truncated, extended, wrong expected length.
        assert!(matches!(
            decode_to_vec(&enc[..enc.len() - 8], src.len()),
            Err(CodecError::Truncated { .. })
        ));
        let mut longer = enc.clone();
        longer.extend_from_slice(&[0; 8]);
        assert!(matches!(
            decode_to_vec(&longer, src.len()),
            Err(CodecError::Length { .. })
        ));
        assert!(decode_to_vec(&enc, src.len() - 2).is_err());
        assert!(decode_to_vec(&enc, src.len() + 2).is_err());
        assert!(decode_to_vec(&enc, src.len() + 1).is_err());
    }

    /// A block whose checksum is right but whose code is wrong (as a buggy encoder would
    /// write it) is refused by the code checks themselves.
    #[test]
    fn bad_codes_with_good_checksums_are_refused() {
        let src = trained_like(5000, 0.02, 5);
        let mut enc = Vec::new();
        assert!(encode(&src, &mut enc));
        assert_eq!(enc[0], KIND_HUFF);
        let reseal = |e: &mut Vec<u8>| {
            let payload = le32(e, 8) as usize;
            let mut h = crc32fast::Hasher::new();
            h.update(&e[..12]);
            h.update(&e[HEADER..HEADER + payload]);
            let crc = h.finalize();
            e[12..16].copy_from_slice(&crc.to_le_bytes());
        };
        // Over-subscribed lengths: every symbol of length 1.
        let mut e = enc.clone();
        e[HEADER..HEADER + LENGTHS].fill(0x11);
        reseal(&mut e);
        assert!(matches!(
            decode_to_vec(&e, src.len()),
            Err(CodecError::BadCode { .. })
        ));
        // A length above MAX_LEN.
        let mut e = enc.clone();
        e[HEADER] = 0xFF;
        reseal(&mut e);
        assert!(decode_to_vec(&e, src.len()).is_err());
        // A stream with its bits flipped: some pattern decodes wrong or runs long.
        let mut e = enc.clone();
        let streams = HEADER + LENGTHS + 4 * STREAMS + 5000;
        for b in &mut e[streams..streams + 40] {
            *b = !*b;
        }
        reseal(&mut e);
        match decode_to_vec(&e, src.len()) {
            Err(_) => {}
            Ok(v) => assert_ne!(v, src),
        }
        // Stream lengths that do not add up to the payload.
        let mut e = enc.clone();
        let at = HEADER + LENGTHS;
        let l0 = le32(&e, at);
        e[at..at + 4].copy_from_slice(&(l0 + 1).to_le_bytes());
        reseal(&mut e);
        assert!(decode_to_vec(&e, src.len()).is_err());
        // A stream cut short (its bytes moved to the next).
        let mut e = enc.clone();
        let l1 = le32(&e, at + 4);
        e[at..at + 4].copy_from_slice(&(l0 - 1).to_le_bytes());
        e[at + 4..at + 8].copy_from_slice(&(l1 + 1).to_le_bytes());
        reseal(&mut e);
        assert!(decode_to_vec(&e, src.len()).is_err());
        // A huge value count and payload length.
        let mut e = enc.clone();
        e[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_to_vec(&e, src.len()).is_err());
        let mut e = enc.clone();
        e[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_to_vec(&e, src.len()).is_err());
    }

    /// The multi-code decoder against the one-code reference: the same bytes on every kind of
    /// block (narrow and wide distributions, outliers, codes limited to MAX_LEN bits, tails
    /// of every length), and the same verdict on streams whose bits were changed under a good
    /// checksum, wherever in the stream the change falls.
    #[test]
    fn fast_decoder_agrees_with_the_reference() {
        for (i, s) in [1e-4, 0.002, 0.02, 0.5, 30.0].into_iter().enumerate() {
            for n in [BLOCK_ELEMS, 4 * 64 * MULTI + 3, 2 * BLOCK_ELEMS - 4321] {
                let src = trained_like(n, s, 100 + i as u64);
                let mut enc = Vec::new();
                assert!(encode(&src, &mut enc));
                assert_eq!(decode_reference(&enc, src.len()).as_deref(), Ok(&src[..]));
                assert_eq!(decode_to_vec(&enc, src.len()).as_deref(), Ok(&src[..]));
            }
        }
        let src = trained_like(BLOCK_ELEMS, 0.02, 9);
        let mut enc = Vec::new();
        assert!(encode(&src, &mut enc));
        assert_eq!(enc[0], KIND_HUFF);
        let reseal = |e: &mut Vec<u8>| {
            let payload = le32(e, 8) as usize;
            let mut h = crc32fast::Hasher::new();
            h.update(&e[..12]);
            h.update(&e[HEADER..HEADER + payload]);
            let crc = h.finalize();
            e[12..16].copy_from_slice(&crc.to_le_bytes());
        };
        let streams = HEADER + LENGTHS + 4 * STREAMS + BLOCK_ELEMS;
        let mut r = Lcg(17);
        let mut refused = 0;
        for _ in 0..60 {
            let mut e = enc.clone();
            let at = streams + (r.next() as usize) % (enc.len() - streams - 8);
            e[at] ^= 1 << (r.next() % 8);
            reseal(&mut e);
            let want = decode_reference(&e, src.len());
            refused += usize::from(want.is_err());
            assert_eq!(
                decode_to_vec(&e, src.len()),
                want,
                "bit changed in byte {at}"
            );
            let mut par = vec![0u8; src.len()];
            assert_eq!(decode(&e, &mut par).is_ok(), want.is_ok());
        }
        eprintln!("{refused} of 60 refused");
    }

    fn round_trip_as(coding: Coding, src: &[u8]) -> Vec<u8> {
        let mut enc = Vec::new();
        assert!(encode_as(coding, src, &mut enc));
        assert_eq!(enc.len() % BLOCK_ALIGN, 0);
        assert_eq!(decode_to_vec(&enc, src.len()).as_deref(), Ok(src));
        assert_eq!(decode_reference(&enc, src.len()).as_deref(), Ok(src));
        let mut par = vec![0xAAu8; src.len()];
        decode(&enc, &mut par).expect("parallel decode");
        assert_eq!(par, src);
        enc
    }

    /// `n` values whose high bytes cycle through `distinct` values (some escaped when more
    /// than 15), in runs of `run`, low bytes counting.
    fn cycling(n: usize, distinct: usize, run: usize) -> Vec<u8> {
        (0..n)
            .flat_map(|i| [i as u8, (0x30 + (i / run) % distinct) as u8])
            .collect()
    }

    #[test]
    fn nibble_blocks_round_trip_near_three_quarters() {
        let src = trained_like(3 * BLOCK_ELEMS + 1234, 0.02, 7);
        let enc = round_trip_as(Coding::Nibble, &src);
        assert_eq!(enc[0], KIND_NIBBLE);
        let ratio = enc.len() as f64 / src.len() as f64;
        assert!((0.75..0.76).contains(&ratio), "ratio {ratio}");
        for n in [1usize, 2, 3, 31, 32, 33, 63, 64, 65, 1001, BLOCK_ELEMS + 1] {
            round_trip_as(Coding::Nibble, &trained_like(n, 0.5, n as u64));
        }
        // Escapes alone, in runs that fill whole 32-value groups or straddle them, and spread
        // one value in four; sixteen values never escape more than one.
        for (distinct, run) in [
            (16, 1),
            (17, 1),
            (20, 1),
            (20, 7),
            (20, 32),
            (24, 45),
            (2, 3),
        ] {
            for n in [5usize, 32, 100, 4099] {
                round_trip_as(Coding::Nibble, &cycling(n, distinct, run));
            }
        }
        // Too many escapes to pay: stored raw.
        let mut r = Lcg(3);
        let noise: Vec<u8> = (0..2 * 10_001).map(|_| r.next() as u8).collect();
        let enc = round_trip_as(Coding::Nibble, &noise);
        assert_eq!(enc[0], KIND_RAW);
        assert!(round_trip_as(Coding::Nibble, &[]).is_empty());
    }

    /// The shuffle kernel writes the scalar kernel's bytes, escapes anywhere included.
    /// Every path available here, the scalar one first.
    fn paths() -> Vec<crate::kernels::Isa> {
        use crate::kernels::{detected_isa, Isa};
        let mut v = vec![Isa::Generic, Isa::Avx2, detected_isa()];
        v.dedup();
        v
    }

    #[test]
    fn a_nibble_coded_matrix_multiplies_as_its_decoded_bf16() {
        use crate::kernels::{
            axpy_bf16, dot_bf16_with, matmul_nibble_with, matmul_with, DenseRef, NibbleBlock,
            NibbleMatrix,
        };
        // Rows that run over into the next block (3072 does not divide 2^18), a block stored
        // raw (random bytes do not code smaller), a block with many escapes (high bytes of 20
        // values), narrow rows, and a row length that is no multiple of 32 (not held coded).
        let mut r = Lcg(5);
        // Random finite values (exponents below 128): 7 bits of high byte do not code smaller.
        let random: Vec<u8> = (0..BLOCK_ELEMS)
            .flat_map(|_| [r.next() as u8, r.next() as u8 & 0xbf])
            .collect();
        let spread: Vec<u8> = (0..BLOCK_ELEMS)
            .flat_map(|_| [r.next() as u8, 0x30 + (r.next() % 20) as u8])
            .collect();
        let cases: Vec<(Vec<u8>, usize)> = vec![
            (trained_like(100 * 3072, 0.02, 1), 3072),
            ([trained_like(BLOCK_ELEMS, 0.05, 2), random].concat(), 4096),
            ([spread, trained_like(32 + 2 * 96, 0.01, 3)].concat(), 96),
            (trained_like(5 * 32, 1.0, 4), 32),
            (trained_like(7 * 48, 0.3, 5), 48),
        ];
        let mut scratch = Vec::new();
        for (k, (src, cols)) in cases.iter().enumerate() {
            let rows = src.len() / 2 / cols;
            let mut enc = Vec::new();
            encode_as(Coding::Nibble, src, &mut enc);
            let index = nibble_index(&enc, rows, *cols, &mut scratch).expect("decodes");
            let Some(index) = index else {
                assert!(!cols.is_multiple_of(32), "case {k}: not held coded");
                continue;
            };
            // The cases cover what they say: a raw block, and a block of many escapes.
            let escapes = |b: usize| match index.blocks[b] {
                NibbleBlock::Coded { escapes, .. } => Some(escapes),
                NibbleBlock::Raw { .. } => None,
            };
            match k {
                1 => assert_eq!((escapes(0).is_some(), escapes(1)), (true, None)),
                2 => assert!(escapes(0).unwrap() > BLOCK_ELEMS / 8),
                _ => assert!(escapes(0).is_some()),
            }
            let w = NibbleMatrix::new(&enc, &index.blocks, &index.row_esc, rows, *cols)
                .expect("consistent");
            let dec: Vec<u16> = src
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect();
            let x: Vec<f32> = (0..9 * cols).map(|_| (r.unit() - 0.5) as f32).collect();
            let mut row = vec![0u16; *cols];
            for i in 0..rows {
                let want_row = &dec[i * cols..(i + 1) * cols];
                w.decode_row(i, &mut row);
                assert_eq!(row, want_row, "case {k} row {i}: decoded");
                let mut want_y: Vec<f32> = x[..*cols].to_vec();
                axpy_bf16(0.375, want_row, &mut want_y);
                let mut got_y = x[..*cols].to_vec();
                w.row_axpy(i, 0.375, &mut got_y);
                assert_eq!(bits(&got_y), bits(&want_y), "case {k} row {i}: axpy");
                for isa in paths() {
                    let want = dot_bf16_with(isa, want_row, &x[..*cols]);
                    let got = w.row_dot(isa, i, &x[..*cols]);
                    assert_eq!(got.to_bits(), want.to_bits(), "case {k} row {i} {isa:?}");
                }
            }
            for isa in paths() {
                for n_tok in [1usize, 2, 4, 5, 9] {
                    let xs = &x[..n_tok * cols];
                    let mut want = vec![0f32; n_tok * rows];
                    matmul_with(isa, DenseRef::Bf16(&dec), rows, *cols, xs, &mut want);
                    let mut got = vec![f32::NAN; n_tok * rows];
                    matmul_nibble_with(isa, &w, xs, &mut got);
                    assert_eq!(bits(&got), bits(&want), "case {k} {isa:?} {n_tok} tokens");
                }
            }
        }
        // Huffman-coded blocks are not held coded; a corrupted block is the decoder's error.
        let src = trained_like(64 * 64, 0.02, 9);
        let mut enc = Vec::new();
        encode_as(Coding::Entropy, &src, &mut enc);
        assert_eq!(nibble_index(&enc, 64, 64, &mut scratch).unwrap(), None);
        let mut enc = Vec::new();
        encode_as(Coding::Nibble, &src, &mut enc);
        let last = enc.len() - 9;
        enc[last] ^= 1;
        let e = nibble_index(&enc, 64, 64, &mut scratch).unwrap_err();
        assert_eq!(e, decode_to_vec(&enc, src.len()).unwrap_err());
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    #[test]
    fn nibble_kernel_paths_agree() {
        use crate::kernels::{detected_isa, nibble_bf16_with, Isa};
        let mut r = Lcg(21);
        let dict: [u8; 16] = std::array::from_fn(|i| if i == 15 { 0 } else { 3 * i as u8 + 1 });
        for n in [0usize, 1, 31, 32, 33, 64, 95, 1000] {
            for escape_in in [0u64, 3, 40, 1000] {
                let low: Vec<u8> = (0..n).map(|_| r.next() as u8).collect();
                let mut nib: Vec<u8> = (0..n.div_ceil(2)).map(|_| r.next() as u8).collect();
                for b in &mut nib {
                    for half in [0, 4] {
                        if escape_in == 0 || !r.next().is_multiple_of(escape_in) {
                            if (*b >> half) & 15 == 15 {
                                *b ^= 1 << half;
                            }
                        } else {
                            *b |= 15 << half;
                        }
                    }
                }
                let codes = (0..n)
                    .filter(|&i| (nib[i / 2] >> (4 * (i & 1))) & 15 == 15)
                    .count();
                let esc: Vec<u8> = (0..codes + 2).map(|_| r.next() as u8).collect();
                let mut want = vec![0u8; 2 * n];
                let used = nibble_bf16_with(Isa::Generic, &dict, &low, &nib, &esc, &mut want);
                assert_eq!(used, Some(codes));
                // At offsets of 0, 16 and 1 byte from a 64-byte boundary: the shuffle path
                // writes a 16-byte aligned output with non-temporal stores, the permute path
                // (AVX-512 VBMI) a 64-byte aligned one, and any other with plain ones.
                for (isa, off) in [Isa::Avx2, detected_isa()]
                    .into_iter()
                    .flat_map(|i| [(i, 0), (i, 16), (i, 1)])
                {
                    let mut buf = vec![0x55u8; 2 * n + 128];
                    let at = buf.as_ptr().align_offset(64) + off;
                    let got = &mut buf[at..at + 2 * n];
                    let u = nibble_bf16_with(isa, &dict, &low, &nib, &esc, got);
                    assert_eq!((u, &*got), (used, &want[..]), "{isa:?} n {n} offset {off}");
                    if codes > 0 {
                        let short = &esc[..codes - 1];
                        assert_eq!(nibble_bf16_with(isa, &dict, &low, &nib, short, got), None);
                    }
                    // Nothing outside the output is written.
                    let mut outside = buf[..at].iter().chain(&buf[at + 2 * n..]);
                    assert!(outside.all(|&b| b == 0x55), "{isa:?} n {n}");
                }
            }
        }
    }

    /// A nibble block whose checksum is right but whose content is not (as a buggy encoder
    /// would write it) is refused by the block's own checks; a changed byte anywhere is
    /// refused by its checksum.
    #[test]
    fn bad_nibble_blocks_are_refused() {
        let n = 5001;
        let src = cycling(n, 18, 5);
        let mut enc = Vec::new();
        assert!(encode_as(Coding::Nibble, &src, &mut enc));
        assert_eq!(enc[0], KIND_NIBBLE);
        let reseal = |e: &mut Vec<u8>| {
            let payload = le32(e, 8) as usize;
            let mut h = crc32fast::Hasher::new();
            h.update(&e[..12]);
            h.update(&e[HEADER..HEADER + payload]);
            let crc = h.finalize();
            e[12..16].copy_from_slice(&crc.to_le_bytes());
        };
        let refused = |e: &[u8], what: &str| {
            let got = decode_to_vec(e, src.len());
            assert_eq!(got, decode_reference(e, src.len()), "{what}");
            assert!(got.is_err(), "{what}");
            got.unwrap_err()
        };
        let nib_at = HEADER + NIBBLE_HEAD + n;
        let escapes = le32(&enc, HEADER + 16) as usize;
        assert!(escapes > 0);
        // The escape's dictionary entry set.
        let mut e = enc.clone();
        e[HEADER + 15] = 7;
        reseal(&mut e);
        assert!(matches!(refused(&e, "dict"), CodecError::BadCode { .. }));
        // An escape count that does not match the payload.
        let mut e = enc.clone();
        e[HEADER + 16..HEADER + 20].copy_from_slice(&(escapes as u32 + 1).to_le_bytes());
        reseal(&mut e);
        assert!(matches!(refused(&e, "count"), CodecError::Length { .. }));
        // One escape code more than escape bytes, and one fewer.
        let first_plain = (0..n)
            .find(|&i| (e[nib_at + i / 2] >> (4 * (i & 1))) & 15 != 15)
            .unwrap();
        let mut e = enc.clone();
        e[nib_at + first_plain / 2] |= 15 << (4 * (first_plain & 1));
        reseal(&mut e);
        assert!(matches!(refused(&e, "more"), CodecError::BadCode { .. }));
        let first_escape = (0..n)
            .find(|&i| (enc[nib_at + i / 2] >> (4 * (i & 1))) & 15 == 15)
            .unwrap();
        let mut e = enc.clone();
        e[nib_at + first_escape / 2] &= !(15 << (4 * (first_escape & 1)));
        reseal(&mut e);
        assert!(matches!(refused(&e, "fewer"), CodecError::BadCode { .. }));
        // The padding nibble after the last (odd) value.
        let mut e = enc.clone();
        e[nib_at + n / 2] |= 0x10;
        reseal(&mut e);
        assert!(matches!(refused(&e, "padding"), CodecError::BadCode { .. }));
        // Cut short under a good checksum.
        let mut e = enc.clone();
        let payload = le32(&e, 8) - 1;
        e[8..12].copy_from_slice(&payload.to_le_bytes());
        e[HEADER + payload as usize] = 0;
        reseal(&mut e);
        assert!(decode_to_vec(&e, src.len()).is_err());
        // Any byte changed: refused, never decoded into other values.
        for at in (0..enc.len()).step_by(37).chain([0, 4, 8, 12, 16, 20, 200]) {
            let mut bad = enc.clone();
            bad[at] ^= 0x41;
            let got = decode_to_vec(&bad, src.len());
            assert_eq!(got, decode_reference(&bad, src.len()));
            if let Ok(v) = got {
                assert_eq!(v, src, "byte {at} changed the output silently");
            }
        }
    }
}
