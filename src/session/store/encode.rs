//! The section layout of a session file and the streaming writer.

use super::error::*;
use super::format::*;
use crate::session::naming::validate_name;
use std::io::{self, Write};

use crate::engine::config::MAX_LAYERS;
use crate::engine::state::{LayerState, Snapshot};

// ---------------------------------------------------------------------------------------------
// Layout
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Sect {
    Identity,
    Summary,
    Transcript,
    Settings,
    Tokens,
    Sampler,
    State,
    Layer,
    SnapDir,
    Snap,
}

impl Sect {
    pub(super) fn tag(self) -> [u8; 4] {
        match self {
            Sect::Identity => *b"IDEN",
            Sect::Summary => *b"SUMM",
            Sect::Transcript => *b"TRAN",
            Sect::Settings => *b"SETT",
            Sect::Tokens => *b"TOKS",
            Sect::Sampler => *b"SAMP",
            Sect::State => *b"STAT",
            Sect::Layer => *b"LAYR",
            Sect::SnapDir => *b"SNAP",
            Sect::Snap => *b"SNPS",
        }
    }

    pub(super) fn label(self) -> &'static str {
        match self {
            Sect::Identity => "identity",
            Sect::Summary => "summary",
            Sect::Transcript => "transcript",
            Sect::Settings => "settings",
            Sect::Tokens => "tokens",
            Sect::Sampler => "sampler",
            Sect::State => "state layout",
            Sect::Layer => "layer",
            Sect::SnapDir => "snapshot directory",
            Sect::Snap => "snapshot",
        }
    }
}

/// Float counts of one layer's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LayerDesc {
    Kda { s: u64, conv: [u64; 3] },
    Mla { rows: u64, floats: u64 },
}

impl LayerDesc {
    pub(super) fn kind(self) -> &'static str {
        match self {
            LayerDesc::Kda { .. } => "KDA",
            LayerDesc::Mla { .. } => "MLA",
        }
    }

    pub(super) fn floats(self) -> Option<u64> {
        match self {
            LayerDesc::Kda { s, conv } => s
                .checked_add(conv[0])?
                .checked_add(conv[1])?
                .checked_add(conv[2]),
            LayerDesc::Mla { floats, .. } => Some(floats),
        }
    }

    pub(super) fn bytes(self) -> Option<u64> {
        self.floats()?.checked_mul(4)
    }

    pub(super) fn encode(self) -> [u8; LAYER_DESC_LEN as usize] {
        let (kind, v) = match self {
            LayerDesc::Kda { s, conv } => (KIND_KDA, [s, conv[0], conv[1], conv[2]]),
            LayerDesc::Mla { rows, floats } => (KIND_MLA, [rows, floats, 0, 0]),
        };
        let mut b = [0u8; LAYER_DESC_LEN as usize];
        b[0..4].copy_from_slice(&kind.to_le_bytes());
        for (i, x) in v.iter().enumerate() {
            b[8 + 8 * i..16 + 8 * i].copy_from_slice(&x.to_le_bytes());
        }
        b
    }

    pub(super) fn parse(b: &[u8]) -> Result<Self, String> {
        let mut c = Cursor::new(b);
        let (Some(kind), Some(reserved), Some(a), Some(bb), Some(cc), Some(d)) =
            (c.u32(), c.u32(), c.u64(), c.u64(), c.u64(), c.u64())
        else {
            return Err("short layer descriptor".into());
        };
        if reserved != 0 {
            return Err(format!("reserved field is {reserved}, expected 0"));
        }
        match kind {
            KIND_KDA => Ok(LayerDesc::Kda {
                s: a,
                conv: [bb, cc, d],
            }),
            KIND_MLA if cc == 0 && d == 0 => Ok(LayerDesc::Mla {
                rows: a,
                floats: bb,
            }),
            KIND_MLA => Err("unused MLA descriptor fields are not 0".into()),
            k => Err(format!(
                "unknown layer kind {k} (0 KDA, 1 MLA latent cache)"
            )),
        }
    }
}

/// Sizes of a record about to be written.
pub(super) struct Plan {
    pub(super) n_pos: u64,
    pub(super) layers: Vec<LayerDesc>,
    pub(super) bpp: u64,
    pub(super) summary_len: u64,
    pub(super) snaps: Vec<SnapPlan>,
    pub(super) total: u64,
}

/// One snapshot as it is written: its positions, those it shares with the live state, its
/// logits, the MLA width of each layer (0 for KDA) and its section's length.
pub(super) struct SnapPlan {
    pub(super) positions: u64,
    pub(super) shared: u64,
    pub(super) logits: u64,
    pub(super) widths: Vec<usize>,
    pub(super) len: u64,
}

/// Leading positions of `snap` whose ids and MLA rows equal the live state's, bit for bit.
pub(super) fn shared_prefix(rec: &SessionRecord, snap: &Snapshot, widths: &[usize]) -> usize {
    let mut n = snap
        .tokens
        .iter()
        .zip(&rec.tokens)
        .take_while(|(a, b)| a == b)
        .count();
    for ((a, b), &w) in snap.state.layers.iter().zip(&rec.state.layers).zip(widths) {
        if let (LayerState::Mla(a), LayerState::Mla(b)) = (a, b) {
            if w == 0 {
                continue;
            }
            let same = a
                .iter()
                .zip(b)
                .take(n * w)
                .take_while(|(x, y)| x.to_bits() == y.to_bits())
                .count();
            n = n.min(same / w);
        }
    }
    n
}

pub(super) fn plan_snapshot(
    rec: &SessionRecord,
    index: usize,
    snap: &Snapshot,
) -> Result<SnapPlan, RecordError> {
    let bad = |what: String| RecordError::Snapshot { index, what };
    let positions = snap.state.n_pos;
    if positions == 0 || snap.tokens.len() != positions {
        return Err(bad(format!(
            "{} token ids for a state of {positions} positions (at least 1)",
            snap.tokens.len()
        )));
    }
    if snap.state.layers.len() != rec.state.layers.len() {
        return Err(bad(format!(
            "{} layers, the live state has {}",
            snap.state.layers.len(),
            rec.state.layers.len()
        )));
    }
    let mut widths = Vec::with_capacity(snap.state.layers.len());
    let mut floats: u64 = 0;
    let mut row_floats: u64 = 0;
    for (layer, (a, b)) in snap.state.layers.iter().zip(&rec.state.layers).enumerate() {
        match (a, b) {
            (LayerState::Kda(k), LayerState::Kda(l)) => {
                if k.s.len() != l.s.len() || (0..3).any(|j| k.conv[j].len() != l.conv[j].len()) {
                    return Err(bad(format!(
                        "layer {layer}: KDA sizes differ from the live state's"
                    )));
                }
                widths.push(0);
                let n = k.s.len() + k.conv.iter().map(Vec::len).sum::<usize>();
                floats = floats.checked_add(n as u64).ok_or(RecordError::TooLarge)?;
            }
            (LayerState::Mla(c), LayerState::Mla(l)) => {
                let w = c.len() / positions;
                let live_w = l.len().checked_div(rec.state.n_pos).unwrap_or(w);
                if c.len() % positions != 0 || w != live_w {
                    return Err(bad(format!(
                        "layer {layer}: MLA cache of {} floats is not {positions} rows of {live_w}",
                        c.len()
                    )));
                }
                widths.push(w);
                row_floats = row_floats
                    .checked_add(w as u64)
                    .ok_or(RecordError::TooLarge)?;
            }
            _ => return Err(bad(format!("layer {layer}: a different layer kind"))),
        }
    }
    let shared = shared_prefix(rec, snap, &widths) as u64;
    let tail = positions as u64 - shared;
    let logits = snap.logits.len() as u64;
    let len = row_floats
        .checked_add(1)
        .and_then(|f| f.checked_mul(tail))
        .and_then(|f| f.checked_add(floats))
        .and_then(|f| f.checked_add(logits))
        .and_then(|f| f.checked_mul(4))
        .ok_or(RecordError::TooLarge)?;
    Ok(SnapPlan {
        positions: positions as u64,
        shared,
        logits,
        widths,
        len,
    })
}

pub(super) fn section_size(len: u64) -> Option<u64> {
    SECTION_HEAD.checked_add(len)?.checked_add(SECTION_CRC)
}

/// The sizes of everything a record writes, each checked with checked arithmetic before a
/// byte is written (over 100 lines: one check and one message per section, in file order).
pub(super) fn plan_record(rec: &SessionRecord) -> Result<Plan, RecordError> {
    validate_name(&rec.name)?;
    if rec.summary.mode.len() > MAX_MODE_LEN {
        return Err(RecordError::ModeTooLong {
            len: rec.summary.mode.len(),
        });
    }
    if rec.summary.mode.chars().any(char::is_control) {
        return Err(RecordError::ModeNotPrintable);
    }
    for (what, text) in [
        ("transcript", &rec.transcript_json),
        ("settings", &rec.settings_json),
    ] {
        if let Err(e) = std::str::from_utf8(text) {
            return Err(RecordError::NotUtf8 {
                what,
                at: e.valid_up_to(),
            });
        }
    }
    rec.sampler.validate().map_err(RecordError::Sampler)?;
    if rec.rng_state == 0 {
        return Err(RecordError::ZeroRngState);
    }
    let n_pos = rec.state.n_pos;
    if rec.tokens.len() != n_pos {
        return Err(RecordError::TokensMismatch {
            tokens: rec.tokens.len(),
            n_pos,
        });
    }
    if rec.state.layers.len() > MAX_LAYERS {
        return Err(RecordError::TooManyLayers {
            n: rec.state.layers.len(),
        });
    }
    let mut layers = Vec::with_capacity(rec.state.layers.len());
    let mut row_floats: u64 = 0;
    for (layer, l) in rec.state.layers.iter().enumerate() {
        layers.push(match l {
            LayerState::Kda(k) => LayerDesc::Kda {
                s: k.s.len() as u64,
                conv: [
                    k.conv[0].len() as u64,
                    k.conv[1].len() as u64,
                    k.conv[2].len() as u64,
                ],
            },
            LayerState::Mla(c) => {
                let whole = if n_pos == 0 {
                    c.is_empty()
                } else {
                    c.len() % n_pos == 0
                };
                if !whole {
                    return Err(RecordError::MlaRows {
                        layer,
                        floats: c.len(),
                        n_pos,
                    });
                }
                if let Some(width) = c.len().checked_div(n_pos) {
                    row_floats = row_floats
                        .checked_add(width as u64)
                        .ok_or(RecordError::TooLarge)?;
                }
                LayerDesc::Mla {
                    rows: n_pos as u64,
                    floats: c.len() as u64,
                }
            }
        });
    }
    let n_pos = n_pos as u64;
    let bpp = if n_pos == 0 {
        0
    } else {
        row_floats
            .checked_add(1)
            .and_then(|f| f.checked_mul(4))
            .ok_or(RecordError::TooLarge)?
    };
    let summary_len = SUMMARY_MIN + rec.name.len() as u64 + rec.summary.mode.len() as u64;
    let mut lens = vec![
        IDENTITY_LEN,
        summary_len,
        rec.transcript_json.len() as u64,
        rec.settings_json.len() as u64,
        n_pos.checked_mul(4).ok_or(RecordError::TooLarge)?,
        SAMPLER_LEN,
        LAYER_DESC_LEN * layers.len() as u64,
    ];
    for d in &layers {
        lens.push(d.bytes().ok_or(RecordError::TooLarge)?);
    }
    if rec.snapshots.len() > MAX_SNAPSHOTS {
        return Err(RecordError::TooManySnapshots {
            n: rec.snapshots.len(),
        });
    }
    let snaps = rec
        .snapshots
        .iter()
        .enumerate()
        .map(|(i, sn)| plan_snapshot(rec, i, sn))
        .collect::<Result<Vec<_>, _>>()?;
    lens.push(SNAP_DIR_HEAD + SNAP_DESC_LEN * snaps.len() as u64);
    lens.extend(snaps.iter().map(|p| p.len));
    let total = lens.iter().try_fold(HEADER_LEN, |acc, &l| {
        section_size(l).and_then(|s| acc.checked_add(s))
    });
    Ok(Plan {
        n_pos,
        layers,
        bpp,
        summary_len,
        snaps,
        total: total.ok_or(RecordError::TooLarge)?,
    })
}

/// The fixed header fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Header {
    pub(super) version: u32,
    pub(super) total: u64,
    pub(super) sections: u64,
    pub(super) n_pos: u64,
    pub(super) n_layers: u64,
    pub(super) bpp: u64,
    pub(super) created: u64,
    pub(super) saved: u64,
}

pub(super) fn header_bytes(h: &Header) -> [u8; HEADER_LEN as usize] {
    let mut b = [0u8; HEADER_LEN as usize];
    b[0..8].copy_from_slice(&MAGIC);
    b[8..12].copy_from_slice(&h.version.to_le_bytes());
    // 12..16: flags, zero.
    let fields = [
        h.total, h.sections, h.n_pos, h.n_layers, h.bpp, h.created, h.saved,
    ];
    for (i, x) in fields.iter().enumerate() {
        b[16 + 8 * i..24 + 8 * i].copy_from_slice(&x.to_le_bytes());
    }
    let crc = crc32fast::hash(&b[..72]);
    b[72..76].copy_from_slice(&crc.to_le_bytes());
    b
}

/// Bounds-checked little-endian reads over a byte slice.
pub(super) struct Cursor<'a> {
    pub(super) b: &'a [u8],
    pub(super) at: usize,
}

impl<'a> Cursor<'a> {
    pub(super) fn new(b: &'a [u8]) -> Self {
        Cursor { b, at: 0 }
    }

    pub(super) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let s = self.b.get(self.at..end)?;
        self.at = end;
        Some(s)
    }

    pub(super) fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    pub(super) fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_le_bytes)
    }

    pub(super) fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }

    pub(super) fn f32(&mut self) -> Option<f32> {
        self.u32().map(f32::from_bits)
    }

    pub(super) fn done(&self) -> bool {
        self.at == self.b.len()
    }
}

// ---------------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------------

/// Buffered section writer: keeps the running CRC and the bytes left in the open section.
pub(super) struct Out<'w, W: Write + ?Sized> {
    pub(super) w: &'w mut W,
    pub(super) buf: Vec<u8>,
    pub(super) crc: crc32fast::Hasher,
    pub(super) left: u64,
    pub(super) count: u64,
}

pub(super) fn internal(what: &str) -> io::Error {
    io::Error::other(format!("internal session encoder error: {what}"))
}

impl<'w, W: Write + ?Sized> Out<'w, W> {
    pub(super) fn new(w: &'w mut W) -> Self {
        Out {
            w,
            buf: Vec::with_capacity(IO_CHUNK + 64),
            crc: crc32fast::Hasher::new(),
            left: 0,
            count: 0,
        }
    }

    pub(super) fn flush(&mut self) -> io::Result<()> {
        if !self.buf.is_empty() {
            self.w.write_all(&self.buf)?;
            self.buf.clear();
        }
        Ok(())
    }

    pub(super) fn raw(&mut self, b: &[u8]) -> io::Result<()> {
        self.buf.extend_from_slice(b);
        self.count += b.len() as u64;
        if self.buf.len() >= IO_CHUNK {
            self.flush()?;
        }
        Ok(())
    }

    pub(super) fn take_left(&mut self, n: usize) -> io::Result<()> {
        self.left = self
            .left
            .checked_sub(n as u64)
            .ok_or_else(|| internal("section overrun"))?;
        Ok(())
    }

    pub(super) fn begin(&mut self, s: Sect, index: u32, len: u64) -> io::Result<()> {
        let mut h = [0u8; SECTION_HEAD as usize];
        h[0..4].copy_from_slice(&s.tag());
        h[4..8].copy_from_slice(&index.to_le_bytes());
        h[8..16].copy_from_slice(&len.to_le_bytes());
        self.crc = crc32fast::Hasher::new();
        self.crc.update(&h);
        self.left = len;
        self.raw(&h)
    }

    pub(super) fn put(&mut self, b: &[u8]) -> io::Result<()> {
        for chunk in b.chunks(IO_CHUNK) {
            self.take_left(chunk.len())?;
            self.crc.update(chunk);
            self.raw(chunk)?;
        }
        Ok(())
    }

    pub(super) fn put_words<T: Copy>(
        &mut self,
        xs: &[T],
        bytes: impl Fn(T) -> [u8; 4],
    ) -> io::Result<()> {
        for chunk in xs.chunks(IO_CHUNK / 4) {
            self.take_left(chunk.len() * 4)?;
            let start = self.buf.len();
            for &x in chunk {
                self.buf.extend_from_slice(&bytes(x));
            }
            self.crc.update(&self.buf[start..]);
            self.count += (chunk.len() * 4) as u64;
            if self.buf.len() >= IO_CHUNK {
                self.flush()?;
            }
        }
        Ok(())
    }

    pub(super) fn end(&mut self) -> io::Result<()> {
        if self.left != 0 {
            return Err(internal("section shorter than declared"));
        }
        let crc = std::mem::replace(&mut self.crc, crc32fast::Hasher::new()).finalize();
        self.raw(&crc.to_le_bytes())
    }
}

pub(super) fn f32_le(x: f32) -> [u8; 4] {
    x.to_bits().to_le_bytes()
}

/// Writes a planned record, section by section in file order (over 100 lines: the sections
/// are written in one pass through one buffered writer).
pub(super) fn write_planned<W: Write + ?Sized>(
    rec: &SessionRecord,
    plan: &Plan,
    w: &mut W,
) -> io::Result<u64> {
    let mut out = Out::new(w);
    out.raw(&header_bytes(&Header {
        version: FORMAT_VERSION,
        total: plan.total,
        sections: FIXED_SECTIONS + 1 + plan.layers.len() as u64 + plan.snaps.len() as u64,
        n_pos: plan.n_pos,
        n_layers: plan.layers.len() as u64,
        bpp: plan.bpp,
        created: rec.created_unix,
        saved: rec.saved_unix,
    }))?;

    out.begin(Sect::Identity, 0, IDENTITY_LEN)?;
    out.put(&rec.identity.hash)?;
    out.end()?;

    out.begin(Sect::Summary, 0, plan.summary_len)?;
    out.put(&rec.summary.turns.to_le_bytes())?;
    out.put(&(rec.name.len() as u32).to_le_bytes())?;
    out.put(rec.name.as_bytes())?;
    out.put(&(rec.summary.mode.len() as u32).to_le_bytes())?;
    out.put(rec.summary.mode.as_bytes())?;
    out.end()?;

    for (s, text) in [
        (Sect::Transcript, &rec.transcript_json),
        (Sect::Settings, &rec.settings_json),
    ] {
        out.begin(s, 0, text.len() as u64)?;
        out.put(text)?;
        out.end()?;
    }

    out.begin(Sect::Tokens, 0, plan.n_pos * 4)?;
    out.put_words(&rec.tokens, u32::to_le_bytes)?;
    out.end()?;

    let sc = &rec.sampler;
    out.begin(Sect::Sampler, 0, SAMPLER_LEN)?;
    out.put(&f32_le(sc.temperature))?;
    out.put(&(sc.top_k as u64).to_le_bytes())?;
    out.put(&f32_le(sc.top_p))?;
    out.put(&f32_le(sc.min_p))?;
    out.put(&f32_le(sc.repeat_penalty))?;
    out.put(&sc.seed.to_le_bytes())?;
    out.put(&rec.rng_state.to_le_bytes())?;
    out.end()?;

    out.begin(Sect::State, 0, LAYER_DESC_LEN * plan.layers.len() as u64)?;
    for d in &plan.layers {
        out.put(&d.encode())?;
    }
    out.end()?;

    for (i, (layer, d)) in rec.state.layers.iter().zip(&plan.layers).enumerate() {
        let bytes = d.bytes().ok_or_else(|| internal("layer size"))?;
        let index = u32::try_from(i).map_err(|_| internal("layer index"))?;
        out.begin(Sect::Layer, index, bytes)?;
        match layer {
            LayerState::Kda(k) => {
                out.put_words(&k.s, f32_le)?;
                for c in &k.conv {
                    out.put_words(c, f32_le)?;
                }
            }
            LayerState::Mla(c) => out.put_words(c, f32_le)?,
        }
        out.end()?;
    }

    out.begin(
        Sect::SnapDir,
        0,
        SNAP_DIR_HEAD + SNAP_DESC_LEN * plan.snaps.len() as u64,
    )?;
    out.put(&(plan.snaps.len() as u32).to_le_bytes())?;
    out.put(&0u32.to_le_bytes())?;
    for p in &plan.snaps {
        for x in [p.positions, p.shared, p.logits] {
            out.put(&x.to_le_bytes())?;
        }
    }
    out.end()?;
    for (i, (snap, p)) in rec.snapshots.iter().zip(&plan.snaps).enumerate() {
        let index = u32::try_from(i).map_err(|_| internal("snapshot index"))?;
        let shared = usize::try_from(p.shared).map_err(|_| internal("snapshot size"))?;
        out.begin(Sect::Snap, index, p.len)?;
        out.put_words(&snap.tokens[shared..], u32::to_le_bytes)?;
        out.put_words(&snap.logits, f32_le)?;
        for (layer, &w) in snap.state.layers.iter().zip(&p.widths) {
            match layer {
                LayerState::Kda(k) => {
                    out.put_words(&k.s, f32_le)?;
                    for c in &k.conv {
                        out.put_words(c, f32_le)?;
                    }
                }
                LayerState::Mla(c) => out.put_words(&c[shared * w..], f32_le)?,
            }
        }
        out.end()?;
    }
    out.flush()?;
    if out.count != plan.total {
        return Err(internal("file size differs from the plan"));
    }
    Ok(out.count)
}

impl SessionRecord {
    /// Streams the encoded file into `w` (through a 64 KiB buffer) and returns its size. The
    /// record is checked for consistency first; nothing is written if it fails.
    pub fn write_to<W: Write + ?Sized>(&self, w: &mut W) -> Result<u64, WriteError> {
        let plan = plan_record(self)?;
        Ok(write_planned(self, &plan, w)?)
    }

    /// The size [`SessionRecord::write_to`] would write.
    pub fn encoded_len(&self) -> Result<u64, RecordError> {
        Ok(plan_record(self)?.total)
    }
}

/// Encodes a record into memory (for small states; use [`SessionRecord::write_to`] for large).
pub fn encode(rec: &SessionRecord) -> Result<Vec<u8>, RecordError> {
    let plan = plan_record(rec)?;
    let mut v = Vec::with_capacity(usize::try_from(plan.total).unwrap_or(0));
    match write_planned(rec, &plan, &mut v) {
        Ok(_) => Ok(v),
        // Writing into a Vec only fails on an encoder inconsistency.
        Err(_) => Err(RecordError::TooLarge),
    }
}
