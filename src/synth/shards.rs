//! Shard layout (which tensors go in which file, in the standard writer's order, headers padded
//! to 8 bytes) and the parallel generation and writing of the tensor data.

use super::*;

pub(super) fn dtype_rank(d: Dtype) -> u8 {
    match d {
        Dtype::F32 => 0,
        Dtype::Bf16 | Dtype::F16 => 1,
        Dtype::U8 => 2,
    }
}

/// Sort into the standard writer's order: F32, then BF16, then U8, each by name.
pub(super) fn sort_specs(specs: &mut [Spec]) {
    specs.sort_by(|a, b| (dtype_rank(a.dtype), &a.name).cmp(&(dtype_rank(b.dtype), &b.name)));
}

/// The compact header JSON of sorted `specs`, padded with spaces to a multiple of 8.
pub(super) fn header_json(specs: &[Spec]) -> Vec<u8> {
    let mut s = String::with_capacity(specs.len() * 120 + 2);
    s.push('{');
    let mut off = 0u64;
    for (i, t) in specs.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let end = off + t.bytes();
        let shape: Vec<String> = t.shape.iter().map(u64::to_string).collect();
        // Names are plain ASCII; serde_json escapes anything else correctly.
        let name = serde_json::to_string(&t.name).unwrap_or_default();
        s.push_str(&format!(
            "{name}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{off},{end}]}}",
            t.dtype.name(),
            shape.join(",")
        ));
        off = end;
    }
    s.push('}');
    while !s.len().is_multiple_of(8) {
        s.push(' ');
    }
    s.into_bytes()
}

/// One shard ready to write.
pub(super) struct Shard {
    pub(super) specs: Vec<Spec>,
    pub(super) header: Vec<u8>,
    pub(super) data_bytes: u64,
}

impl Shard {
    pub(super) fn new(mut specs: Vec<Spec>) -> Shard {
        sort_specs(&mut specs);
        let header = header_json(&specs);
        let data_bytes = specs.iter().map(Spec::bytes).sum();
        Shard {
            specs,
            header,
            data_bytes,
        }
    }

    pub(super) fn file_bytes(&self) -> u64 {
        8 + self.header.len() as u64 + self.data_bytes
    }

    /// A placeholder shard whose last (1-D BF16) tensor is sized so that the file is exactly
    /// `target` bytes.
    pub(super) fn sized(fixed: Vec<Spec>, filler: &str, target: u64) -> Option<Shard> {
        let mut n = 1u64;
        for _ in 0..16 {
            let mut specs = fixed.clone();
            specs.push(Spec {
                name: filler.to_string(),
                dtype: Dtype::Bf16,
                shape: vec![n],
                init: Init::Zero,
            });
            let s = Shard::new(specs);
            if s.file_bytes() == target {
                return Some(s);
            }
            let rest = s.data_bytes - 2 * n;
            let room = target.checked_sub(8 + s.header.len() as u64 + rest)?;
            if room < 2 || room % 2 != 0 {
                return None;
            }
            n = room / 2;
        }
        None
    }
}

/// Shard file name in the released spelling (five digits, then six).
pub(super) fn shard_name(k: usize, n: usize) -> String {
    format!("model-{k:05}-of-{n:06}.safetensors")
}

/// Number of shard files of a shape.
pub(super) fn shard_count(d: &Dims) -> usize {
    d.layers + 1 + if d.sparse { 2 } else { 0 }
}

/// Shard `k` (zero-based) of a shape.
pub(super) fn build_shard(d: &Dims, k: usize) -> Result<Shard, String> {
    if k < d.layers {
        Ok(Shard::new(layer_specs(d, k)))
    } else if k == d.layers {
        Ok(Shard::new(model_specs(d)))
    } else {
        let which = k - d.layers - 1;
        let (fixed, filler) = vision_specs(which);
        Shard::sized(fixed, &filler, K3_VISION_SHARD_BYTES[which])
            .ok_or_else(|| "cannot size the vision placeholder shard".to_string())
    }
}

// ------------------------------------------------------------------------------------ data

/// A unit of generation: one tensor, or both halves of an MXFP4 matrix.
pub(super) enum Item<'a> {
    One(&'a Spec),
    Pair(&'a Spec, &'a Spec),
}

impl Item<'_> {
    pub(super) fn bytes(&self) -> u64 {
        match self {
            Item::One(s) => s.bytes(),
            Item::Pair(a, b) => a.bytes() + b.bytes(),
        }
    }
}

pub(super) fn items(specs: &[Spec]) -> Vec<Item<'_>> {
    let mut out = Vec::with_capacity(specs.len());
    let mut i = 0;
    while i < specs.len() {
        let s = &specs[i];
        let pair = matches!(s.init, Init::Mx { .. })
            && s.name.ends_with(".weight_packed")
            && specs.get(i + 1).is_some_and(|t| {
                t.name.strip_suffix(".weight_scale") == s.name.strip_suffix(".weight_packed")
            });
        if pair {
            out.push(Item::Pair(s, &specs[i + 1]));
            i += 2;
        } else {
            out.push(Item::One(s));
            i += 1;
        }
    }
    out
}

/// Bytes of a non-MXFP4 tensor.
pub(super) fn gen_dense(seed: u64, s: &Spec) -> Vec<u8> {
    let n = s.numel() as usize;
    let es = s.dtype.size() as usize;
    let key = tensor_key(seed, &s.name);
    let mut out = vec![0u8; n * es];
    let put = |o: &mut [u8], v: f32| match s.dtype {
        Dtype::F32 => o.copy_from_slice(&v.to_le_bytes()),
        Dtype::Bf16 | Dtype::F16 => o.copy_from_slice(&f32_to_bf16(v).to_le_bytes()),
        Dtype::U8 => o[0] = 0,
    };
    match s.init {
        Init::RouterBias | Init::ALog { .. } => {
            let vals: Vec<f32> = match s.init {
                Init::RouterBias => {
                    let r = 0.15 * (8.0 / n.max(1) as f64).sqrt().min(1.0);
                    let mut v = linspace(-r, r, n);
                    let mut r = chunk_rng(key, 0);
                    for i in (1..n).rev() {
                        v.swap(i, r.below(i + 1));
                    }
                    v
                }
                Init::ALog { heads } => {
                    let mut v = linspace(-0.4, 1.2, heads.min(n));
                    v.resize(n, 0.0);
                    v
                }
                _ => Vec::new(),
            };
            for (o, v) in out.chunks_exact_mut(es).zip(vals) {
                put(o, v);
            }
        }
        Init::CycledHead { cycle } => {
            let (v, h) = (s.shape[0] as usize, s.shape[1] as usize);
            let embed = Spec {
                name: s
                    .name
                    .replace("lm_head.weight", "model.embed_tokens.weight"),
                dtype: s.dtype,
                shape: s.shape.clone(),
                init: Init::Normal {
                    mean: 0.0,
                    std: scale::EMBED_STD,
                },
            };
            let rows = gen_dense(seed, &embed);
            let row = h * es;
            for from in 0..v {
                let to = cycle_successor(from, cycle, v);
                out[to * row..(to + 1) * row].copy_from_slice(&rows[from * row..(from + 1) * row]);
            }
        }
        Init::Zero | Init::Mx { .. } => {}
        Init::Normal { .. } | Init::Split { .. } | Init::Gain => {
            out.par_chunks_mut(CHUNK * es)
                .enumerate()
                .for_each(|(k, buf)| {
                    let mut r = chunk_rng(key, k);
                    let base = (k * CHUNK) as u64;
                    let mut spare: Option<f32> = None;
                    for (j, o) in buf.chunks_exact_mut(es).enumerate() {
                        let z = spare.take().unwrap_or_else(|| {
                            let [a, b] = r.normal2();
                            spare = Some(b);
                            a
                        });
                        let v = match s.init {
                            Init::Normal { mean, std } => mean + std * z,
                            Init::Split { at, std, std2 } => {
                                if base + (j as u64) < at {
                                    std * z
                                } else {
                                    std2 * z
                                }
                            }
                            _ => 1.0 + 0.02 * z,
                        };
                        put(o, v);
                    }
                });
        }
    }
    out
}

pub(super) fn linspace(lo: f64, hi: f64, n: usize) -> Vec<f32> {
    match n {
        0 => Vec::new(),
        1 => vec![lo as f32],
        _ => (0..n)
            .map(|i| (lo + (hi - lo) * i as f64 / (n - 1) as f64) as f32)
            .collect(),
    }
}

/// Packed and scale bytes of an MXFP4 matrix (`packed` names the pair's stream).
pub(super) fn gen_mx(seed: u64, packed: &Spec, scale_spec: &Spec) -> (Vec<u8>, Vec<u8>) {
    let std = match packed.init {
        Init::Mx { std } => std,
        _ => 0.0,
    };
    let prefix = packed
        .name
        .strip_suffix(".weight_packed")
        .unwrap_or(&packed.name);
    let key = tensor_key(seed, prefix);
    let mut p = vec![0u8; packed.bytes() as usize];
    let mut s = vec![0u8; scale_spec.bytes() as usize];
    p.par_chunks_mut(CHUNK / 2)
        .zip(s.par_chunks_mut(CHUNK / 32))
        .enumerate()
        .for_each(|(k, (pc, sc))| {
            let mut r = chunk_rng(key, k);
            let mut w = [0f32; 32];
            for (g, sb) in sc.iter_mut().enumerate() {
                for pair in w.chunks_exact_mut(2) {
                    let [a, b] = r.normal2();
                    pair[0] = std * a;
                    pair[1] = std * b;
                }
                *sb = quantise_group(&w, &mut pc[16 * g..16 * g + 16]);
            }
        });
    (p, s)
}

pub(super) fn gen_item(seed: u64, it: &Item) -> Vec<Vec<u8>> {
    match it {
        Item::One(s) => vec![gen_dense(seed, s)],
        Item::Pair(a, b) => {
            let (p, s) = gen_mx(seed, a, b);
            vec![p, s]
        }
    }
}

/// What the generating thread hands the writer thread.
pub(super) enum Msg {
    /// Create this file; later bytes go into it.
    Open(PathBuf),
    /// Append these buffers.
    Bytes(Vec<Vec<u8>>),
    /// Finish the file: extend it to this length (a hole) if given, then sync it.
    Close(Option<u64>),
}

/// The writer thread: performs the file operations in order; stops at the first failure (the
/// generating side then sees its channel closed and collects this error).
pub(super) fn writer(rx: &std::sync::mpsc::Receiver<Msg>) -> Result<(), SynthError> {
    let mut cur: Option<(PathBuf, BufWriter<File>)> = None;
    for m in rx {
        match m {
            Msg::Open(path) => {
                let f = File::create(&path).map_err(io_err(&path))?;
                cur = Some((path, BufWriter::with_capacity(4 << 20, f)));
            }
            Msg::Bytes(bufs) => {
                if let Some((path, w)) = cur.as_mut() {
                    for b in &bufs {
                        w.write_all(b).map_err(io_err(path))?;
                    }
                }
            }
            Msg::Close(len) => {
                if let Some((path, w)) = cur.take() {
                    let f = w.into_inner().map_err(|e| SynthError::Io {
                        path: path.clone(),
                        source: e.into_error(),
                    })?;
                    if let Some(len) = len {
                        f.set_len(len).map_err(io_err(&path))?;
                    }
                    f.sync_all().map_err(io_err(&path))?;
                }
            }
        }
    }
    Ok(())
}

/// Generate one shard (header, then data, or a hole when sparse) and queue it for the writer.
/// Returns false when the writer has stopped (its error is collected by the caller).
pub(super) fn send_shard(
    tx: &std::sync::mpsc::SyncSender<Msg>,
    path: PathBuf,
    sh: &Shard,
    seed: u64,
    sparse: bool,
    mut advance: impl FnMut(u64),
) -> bool {
    let mut head = (sh.header.len() as u64).to_le_bytes().to_vec();
    head.extend_from_slice(&sh.header);
    let head_len = head.len() as u64;
    if tx.send(Msg::Open(path)).is_err() || tx.send(Msg::Bytes(vec![head])).is_err() {
        return false;
    }
    advance(head_len);
    if !sparse {
        let all = items(&sh.specs);
        let mut rest: &[Item] = &all;
        while !rest.is_empty() {
            let mut take = 0;
            let mut bytes = 0;
            while take < rest.len() && (take == 0 || bytes + rest[take].bytes() <= BATCH_BYTES) {
                bytes += rest[take].bytes();
                take += 1;
            }
            let (batch, tail) = rest.split_at(take);
            let bufs: Vec<Vec<u8>> = batch
                .par_iter()
                .map(|it| gen_item(seed, it))
                .collect::<Vec<_>>()
                .into_iter()
                .flatten()
                .collect();
            if tx.send(Msg::Bytes(bufs)).is_err() {
                return false;
            }
            advance(bytes);
            rest = tail;
        }
    }
    tx.send(Msg::Close(sparse.then(|| sh.file_bytes()))).is_ok()
}
