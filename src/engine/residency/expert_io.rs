//! Where each routed expert lies in the checkpoint (found once at open) and how a miss reads
//! it: one ranged read into a slot of the expert arena, its six tensors views of that read.

use crate::engine::bind::{bind_expert, names, Binder};
use crate::engine::config::ModelConfig;
use crate::engine::moe::Expert;
use crate::engine::tensor::{Dense, DenseData, Matrix, Mxfp4};
use crate::stream::arena::Arena;
use crate::stream::bytes::{self as bytes, Bytes, U16s};
use crate::stream::index::TensorInfo;
use crate::stream::{Checkpoint, Dtype, StreamError};
use std::sync::Arc;

/// Where one routed expert's six MXFP4 tensors lie (w1, w2, w3; each packed nibbles then
/// scales, in that order here): one contiguous range of a shard. Found once when the model
/// opens, so a miss reads by offset instead of formatting and looking up six names.
#[derive(Clone, Copy, Debug)]
pub(super) struct ExpertSpan {
    pub(super) shard: usize,
    pub(super) offset: u64,
    pub(super) len: u64,
    /// Per tensor: (offset within the range, bytes).
    pub(super) parts: [(usize, usize); 6],
}

/// The spans of every routed expert, `[layer * num_experts + expert]`; None where an expert's
/// tensors are not one contiguous range of MXFP4 bytes of the expected sizes (it is then
/// bound by name, which also names what is wrong).
#[derive(Debug)]
pub(super) struct ExpertTable {
    pub(super) experts: usize,
    pub(super) spans: Vec<Option<ExpertSpan>>,
}

impl ExpertTable {
    pub(super) fn new(ck: &Checkpoint, cfg: &ModelConfig) -> Self {
        let (lat, inter) = (cfg.routed_expert_hidden_size, cfg.moe_intermediate_size);
        let n_exp = cfg.num_experts;
        let mut spans = Vec::with_capacity(cfg.num_hidden_layers * n_exp);
        for il in 0..cfg.num_hidden_layers {
            for e in 0..n_exp {
                let span = (!cfg.is_dense(il) && lat % 32 == 0 && inter % 32 == 0)
                    .then(|| Self::span(ck, il, e, lat, inter))
                    .flatten();
                spans.push(span);
            }
        }
        ExpertTable {
            experts: n_exp,
            spans,
        }
    }

    pub(super) fn span(
        ck: &Checkpoint,
        il: usize,
        e: usize,
        lat: usize,
        inter: usize,
    ) -> Option<ExpertSpan> {
        let mut found = Vec::with_capacity(6);
        for (w, rows, cols) in [("w1", inter, lat), ("w2", lat, inter), ("w3", inter, lat)] {
            for (suffix, bytes) in [
                ("weight_packed", rows * cols / 2),
                ("weight_scale", rows * cols / 32),
            ] {
                let name = names::layer(il, &format!("block_sparse_moe.experts.{e}.{w}.{suffix}"));
                let info = ck.info(&name)?;
                if info.dtype != Dtype::U8 || info.n_bytes() != bytes as u64 {
                    return None;
                }
                found.push(info);
            }
        }
        let shard = found[0].shard;
        let start = found.iter().map(|i| i.offset).min()?;
        let end = found.iter().map(|i| i.offset + i.n_bytes()).max()?;
        let total: u64 = found.iter().map(TensorInfo::n_bytes).sum();
        if found.iter().any(|i| i.shard != shard) || end - start != total {
            return None;
        }
        let mut parts = [(0, 0); 6];
        for (p, i) in parts.iter_mut().zip(&found) {
            *p = ((i.offset - start) as usize, i.n_bytes() as usize);
        }
        Some(ExpertSpan {
            shard,
            offset: start,
            len: total,
            parts,
        })
    }
}

/// Read routed expert `e` of layer `il`: by its span when it has one (one read into a slot of
/// the expert arena, the six tensors ranges of it), else bound by name.
pub(super) fn read_expert(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    table: &ExpertTable,
    il: usize,
    e: usize,
) -> Result<Expert, StreamError> {
    let Some(span) = table.spans.get(il * table.experts + e).copied().flatten() else {
        return load_expert(ck, cfg, il, e);
    };
    let all = ck
        .read_range_shared(span.shard, span.offset, span.len, "a routed expert")
        .map_err(|err| expert_error(err, il, e))?;
    let part = |k: usize| {
        let (at, len) = span.parts[k];
        all.slice(at, len)
            .ok_or_else(|| StreamError::Unrepresentable {
                path: ck.dir().to_path_buf(),
                name: format!("layer {il} expert {e}"),
                reason: "a tensor outside its expert's read".into(),
            })
    };
    let (lat, inter) = (cfg.routed_expert_hidden_size, cfg.moe_intermediate_size);
    let m = |k: usize, rows: usize, cols: usize| -> Result<Matrix, StreamError> {
        Ok(Matrix::Mxfp4(Mxfp4 {
            packed: part(2 * k)?,
            scales: part(2 * k + 1)?,
            rows,
            cols,
        }))
    };
    Ok(Expert {
        w1: m(0, inter, lat)?,
        w2: m(1, lat, inter)?,
        w3: m(2, inter, lat)?,
    })
}

/// Read routed expert `e` of layer `il` in place into the arena slot `ex` (an expert the cache
/// let go) was read into: its six tensors then point at the new bytes, and nothing is
/// allocated. None, with nothing read, when that cannot be done: `e` has no span, `ex` is not
/// six MXFP4 ranges of one arena slot, or another handle to that slot exists.
pub(super) fn refill_expert(
    ck: &Checkpoint,
    table: &ExpertTable,
    il: usize,
    e: usize,
    ex: &mut Expert,
) -> Option<Result<(), StreamError>> {
    let span = table.spans.get(il * table.experts + e).copied().flatten()?;
    let Expert { w1, w2, w3 } = ex;
    let (Matrix::Mxfp4(a), Matrix::Mxfp4(b), Matrix::Mxfp4(c)) = (w1, w2, w3) else {
        return None;
    };
    let mut parts = [
        &mut a.packed,
        &mut a.scales,
        &mut b.packed,
        &mut b.scales,
        &mut c.packed,
        &mut c.scales,
    ];
    let lead = {
        let area = Bytes::refill_parts(&mut parts)?;
        match ck.read_range_into(span.shard, span.offset, span.len, "a routed expert", area) {
            Ok(lead) => lead,
            Err(err) => return Some(Err(expert_error(err, il, e))),
        }
    };
    for (p, &(at, len)) in parts.iter_mut().zip(&span.parts) {
        if !p.reslice(lead + at, len) {
            return Some(Err(StreamError::Unrepresentable {
                path: ck.dir().to_path_buf(),
                name: format!("layer {il} expert {e}"),
                reason: "a tensor outside its expert's read".into(),
            }));
        }
    }
    Some(Ok(()))
}

/// A read error of expert `e` of layer `il`, named as the expert.
fn expert_error(err: StreamError, il: usize, e: usize) -> StreamError {
    match err {
        StreamError::Read {
            path,
            offset,
            len,
            source,
            ..
        } => StreamError::Read {
            path,
            offset,
            len,
            name: names::layer(il, &format!("block_sparse_moe.experts.{e}")),
            source,
        },
        other => other,
    }
}

pub(super) fn load_expert(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    il: usize,
    e: usize,
) -> Result<Expert, StreamError> {
    let mut b = Binder::new(ck, true, true);
    let ex = bind_expert(&mut b, cfg, il, e)?;
    match (ex, b.into_result()) {
        (Some(x), Ok(())) => Ok(x),
        (_, r) => Err(StreamError::Unrepresentable {
            path: ck.dir().to_path_buf(),
            name: format!("layer {il} expert {e}"),
            reason: r
                .err()
                .map_or_else(|| "incomplete expert".into(), |e| e.to_string()),
        }),
    }
}

/// The byte ranges an expert's matrices are read from, in a fixed order.
pub(super) fn expert_parts(ex: &Expert) -> Vec<&Bytes> {
    let mut out = Vec::with_capacity(6);
    for m in [&ex.w1, &ex.w2, &ex.w3] {
        match m {
            Matrix::Mxfp4(q) => out.extend([&q.packed, &q.scales]),
            Matrix::Dense(Dense {
                data: DenseData::Bf16(v),
                ..
            }) => out.push(v.bytes()),
            Matrix::Dense(_) => {}
        }
    }
    out
}

/// `ex` with its bytes copied out of a slot of `arena` that the plan retired into a usable
/// one; None when it is not in such a slot (or no slot is free: it stays where it is until
/// evicted).
pub(super) fn rehome_expert(ex: &Expert, arena: &Arc<Arena>) -> Option<Expert> {
    let parts = expert_parts(ex);
    let mut moved = bytes::rehome(&parts, arena)?.into_iter();
    let mut matrix = |m: &Matrix| -> Option<Matrix> {
        Some(match m {
            Matrix::Mxfp4(q) => Matrix::Mxfp4(Mxfp4 {
                packed: moved.next()?,
                scales: moved.next()?,
                rows: q.rows,
                cols: q.cols,
            }),
            Matrix::Dense(Dense {
                data: DenseData::Bf16(_),
                rows,
                cols,
            }) => Matrix::Dense(Dense {
                data: DenseData::Bf16(U16s::new(moved.next()?)),
                rows: *rows,
                cols: *cols,
            }),
            Matrix::Dense(d) => Matrix::Dense(d.clone()),
        })
    };
    Some(Expert {
        w1: matrix(&ex.w1)?,
        w2: matrix(&ex.w2)?,
        w3: matrix(&ex.w3)?,
    })
}
