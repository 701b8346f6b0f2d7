//! The streaming reader: every length checked before anything is allocated, every CRC verified.

use super::encode::*;
use super::error::*;
use super::format::*;
use crate::session::naming::validate_name;
use std::io::{self, Read};

use crate::engine::config::{ModelConfig, MAX_LAYERS};
use crate::engine::kda::KdaState;
use crate::engine::layer::{kda_params, mla_params};
use crate::engine::sampling::SamplerConfig;
use crate::engine::state::{LayerState, SeqState, Snapshot};

// ---------------------------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------------------------

pub(super) enum Fail {
    Refused(Refusal),
    Io(io::Error),
    NoMemory(u64),
}

impl From<Refusal> for Fail {
    fn from(r: Refusal) -> Self {
        Fail::Refused(r)
    }
}

pub(super) fn len_err(what: impl Into<String>, found: u64, expected: impl Into<String>) -> Fail {
    Fail::Refused(Refusal::Length {
        what: what.into(),
        found,
        expected: expected.into(),
    })
}

pub(super) fn malformed(at: u64, what: impl Into<String>) -> Fail {
    Fail::Refused(Refusal::Malformed {
        at,
        what: what.into(),
    })
}

/// Streaming reader with position tracking and the running CRC of the open section.
pub(super) struct Decoder<'r, R: Read + ?Sized> {
    pub(super) r: &'r mut R,
    pub(super) pos: u64,
    pub(super) total: u64,
    pub(super) crc: crc32fast::Hasher,
    pub(super) scratch: Vec<u8>,
}

impl<'r, R: Read + ?Sized> Decoder<'r, R> {
    pub(super) fn new(r: &'r mut R, total: u64) -> Self {
        Decoder {
            r,
            pos: 0,
            total,
            crc: crc32fast::Hasher::new(),
            scratch: Vec::new(),
        }
    }

    /// Reads until `buf` is full or the stream ends; returns the bytes read.
    pub(super) fn fill(&mut self, buf: &mut [u8]) -> Result<usize, Fail> {
        let mut got = 0;
        while got < buf.len() {
            let rest = buf.get_mut(got..).unwrap_or_default();
            match self.r.read(rest) {
                Ok(0) => break,
                Ok(n) => got += n.min(rest.len()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Fail::Io(e)),
            }
        }
        self.pos += got as u64;
        Ok(got)
    }

    pub(super) fn exact(&mut self, buf: &mut [u8]) -> Result<(), Fail> {
        let got = self.fill(buf)?;
        if got < buf.len() {
            return Err(Refusal::Truncated {
                at: self.pos,
                of: self.total,
            }
            .into());
        }
        Ok(())
    }

    /// Reads a section header, checks its tag and index, and bounds its length by the bytes
    /// left in the file.
    pub(super) fn open(&mut self, s: Sect, index: u32, name: &str) -> Result<u64, Fail> {
        let at = self.pos;
        let mut h = [0u8; SECTION_HEAD as usize];
        self.exact(&mut h)?;
        self.crc = crc32fast::Hasher::new();
        self.crc.update(&h);
        let mut c = Cursor::new(&h);
        let tag: [u8; 4] = c.array().unwrap_or_default();
        let idx = c.u32().unwrap_or_default();
        let len = c.u64().unwrap_or_default();
        if tag != s.tag() || idx != index {
            return Err(malformed(
                at,
                format!(
                    "expected the {name} section (tag {}, index {index}), found tag \"{}\" index {idx}",
                    s.tag().escape_ascii(),
                    tag.escape_ascii()
                ),
            ));
        }
        let room = self
            .total
            .saturating_sub(self.pos)
            .saturating_sub(SECTION_CRC);
        if len > room {
            return Err(len_err(
                format!("{name} section length (at byte {})", at + 8),
                len,
                format!("at most {room}, the bytes left in the file"),
            ));
        }
        Ok(len)
    }

    pub(super) fn payload(&mut self, buf: &mut [u8]) -> Result<(), Fail> {
        self.exact(buf)?;
        self.crc.update(buf);
        Ok(())
    }

    /// Reads `len` payload bytes, growing the buffer as data arrives.
    pub(super) fn bytes(&mut self, len: u64) -> Result<Vec<u8>, Fail> {
        let n = usize::try_from(len).map_err(|_| Fail::NoMemory(len))?;
        let mut v = Vec::new();
        v.try_reserve_exact(n.min(1 << 20))
            .map_err(|_| Fail::NoMemory(len))?;
        let mut buf = std::mem::take(&mut self.scratch);
        buf.resize(IO_CHUNK, 0);
        let mut left = n;
        let res = loop {
            if left == 0 {
                break Ok(());
            }
            let k = left.min(IO_CHUNK);
            let chunk = buf.get_mut(..k).unwrap_or_default();
            if let Err(e) = self.payload(chunk) {
                break Err(e);
            }
            if v.try_reserve(k).is_err() {
                break Err(Fail::NoMemory(len));
            }
            v.extend_from_slice(chunk);
            left -= k;
        };
        self.scratch = buf;
        res.map(|()| v)
    }

    /// Reads `n` 4-byte words into a vector reserved once at its exact, already checked size.
    pub(super) fn words<T>(&mut self, n: u64, conv: impl Fn([u8; 4]) -> T) -> Result<Vec<T>, Fail> {
        let bytes = n.saturating_mul(4);
        let count = usize::try_from(n).map_err(|_| Fail::NoMemory(bytes))?;
        let mut v = Vec::new();
        v.try_reserve_exact(count)
            .map_err(|_| Fail::NoMemory(bytes))?;
        self.words_into(&mut v, n, conv)?;
        Ok(v)
    }

    /// Appends `n` 4-byte words to `v` (reserved by the caller at its checked size).
    pub(super) fn words_into<T>(
        &mut self,
        v: &mut Vec<T>,
        n: u64,
        conv: impl Fn([u8; 4]) -> T,
    ) -> Result<(), Fail> {
        let count = usize::try_from(n).map_err(|_| Fail::NoMemory(n.saturating_mul(4)))?;
        let mut buf = std::mem::take(&mut self.scratch);
        buf.resize(IO_CHUNK, 0);
        let mut left = count;
        let res = loop {
            if left == 0 {
                break Ok(());
            }
            let k = left.min(IO_CHUNK / 4);
            let chunk = buf.get_mut(..k * 4).unwrap_or_default();
            if let Err(e) = self.payload(chunk) {
                break Err(e);
            }
            v.extend(
                chunk
                    .chunks_exact(4)
                    .map(|w| conv([w[0], w[1], w[2], w[3]])),
            );
            left -= k;
        };
        self.scratch = buf;
        res
    }

    pub(super) fn f32s(&mut self, n: u64) -> Result<Vec<f32>, Fail> {
        self.words(n, |w| f32::from_bits(u32::from_le_bytes(w)))
    }

    /// Reads the stored CRC and compares it with the bytes read since `open`.
    pub(super) fn close(&mut self, name: &str) -> Result<(), Fail> {
        let computed = std::mem::replace(&mut self.crc, crc32fast::Hasher::new()).finalize();
        let mut c = [0u8; 4];
        self.exact(&mut c)?;
        let stored = u32::from_le_bytes(c);
        if stored != computed {
            return Err(Refusal::Checksum {
                section: name.to_string(),
                stored,
                computed,
            }
            .into());
        }
        Ok(())
    }

    /// Reads and checks the fixed header, field by field in file order (over 100 lines: one
    /// check and one message per field).
    pub(super) fn header(&mut self, file_len: u64) -> Result<Header, Fail> {
        let want = usize::try_from(file_len.min(HEADER_LEN)).unwrap_or(0);
        let mut b = [0u8; HEADER_LEN as usize];
        let got = self.fill(b.get_mut(..want).unwrap_or_default())?;
        let present = b.get(..got).unwrap_or_default();
        let mut c = Cursor::new(&b);
        let magic: [u8; 8] = c.array().unwrap_or_default();
        if got < MAGIC.len() {
            return Err(if MAGIC.starts_with(present) {
                Refusal::Truncated {
                    at: got as u64,
                    of: HEADER_LEN,
                }
            } else {
                Refusal::BadMagic {
                    found: present.to_vec(),
                }
            }
            .into());
        }
        if magic != MAGIC {
            return Err(Refusal::BadMagic {
                found: magic.to_vec(),
            }
            .into());
        }
        if got < 12 {
            return Err(Refusal::Truncated {
                at: got as u64,
                of: HEADER_LEN,
            }
            .into());
        }
        let version = c.u32().unwrap_or_default();
        let flags = c.u32().unwrap_or_default();
        let fields: [u64; 7] = std::array::from_fn(|_| c.u64().unwrap_or_default());
        let stored_crc = c.u32().unwrap_or_default();
        let computed_crc = crc32fast::hash(&b[..72]);
        if !(OLDEST_VERSION..=FORMAT_VERSION).contains(&version) {
            // A damaged version field: the checksum matches once a version read here is
            // restored.
            for v in OLDEST_VERSION..=FORMAT_VERSION {
                let mut fixed = b;
                fixed[8..12].copy_from_slice(&v.to_le_bytes());
                if got == HEADER_LEN as usize && crc32fast::hash(&fixed[..72]) == stored_crc {
                    return Err(Refusal::Checksum {
                        section: "header".into(),
                        stored: stored_crc,
                        computed: computed_crc,
                    }
                    .into());
                }
            }
            return Err(Refusal::Version { found: version }.into());
        }
        if got < HEADER_LEN as usize {
            let of = if got >= 24 {
                fields[0].max(HEADER_LEN)
            } else {
                HEADER_LEN
            };
            return Err(Refusal::Truncated { at: got as u64, of }.into());
        }
        if stored_crc != computed_crc {
            return Err(Refusal::Checksum {
                section: "header".into(),
                stored: stored_crc,
                computed: computed_crc,
            }
            .into());
        }
        let [total, sections, n_pos, n_layers, bpp, created, saved] = fields;
        if flags != 0 {
            return Err(malformed(12, format!("flags are {flags:#x}, expected 0")));
        }
        if file_len < total {
            return Err(Refusal::Truncated {
                at: file_len,
                of: total,
            }
            .into());
        }
        if file_len > total {
            return Err(Refusal::Trailing {
                declared: total,
                actual: file_len,
            }
            .into());
        }
        self.total = total;
        if n_layers > MAX_LAYERS as u64 {
            return Err(len_err(
                "layer count (header byte 40)",
                n_layers,
                format!("at most {MAX_LAYERS}"),
            ));
        }
        if version == 1 && sections != FIXED_SECTIONS + n_layers {
            return Err(len_err(
                "section count (header byte 24)",
                sections,
                format!("{} (7 + {n_layers} layers)", FIXED_SECTIONS + n_layers),
            ));
        }
        let least = FIXED_SECTIONS + 1 + n_layers;
        if version > 1 && !(least..=least + MAX_SNAPSHOTS as u64).contains(&sections) {
            return Err(len_err(
                "section count (header byte 24)",
                sections,
                format!(
                    "between {least} and {} (8 + {n_layers} layers + at most {MAX_SNAPSHOTS} \
                     snapshots)",
                    least + MAX_SNAPSHOTS as u64
                ),
            ));
        }
        if n_pos > total / 4 {
            return Err(len_err(
                "position count (header byte 32)",
                n_pos,
                format!("at most {} for a file of {total} bytes", total / 4),
            ));
        }
        Ok(Header {
            version,
            total,
            sections,
            n_pos,
            n_layers,
            bpp,
            created,
            saved,
        })
    }

    pub(super) fn identity(&mut self) -> Result<ModelIdentity, Fail> {
        let name = Sect::Identity.label();
        let len = self.open(Sect::Identity, 0, name)?;
        if len != IDENTITY_LEN {
            return Err(len_err(
                "identity section length",
                len,
                format!("exactly {IDENTITY_LEN}"),
            ));
        }
        let mut hash = [0u8; 32];
        self.payload(&mut hash)?;
        self.close(name)?;
        Ok(ModelIdentity { hash })
    }

    pub(super) fn summary(&mut self) -> Result<(String, Summary), Fail> {
        let name = Sect::Summary.label();
        let at = self.pos;
        let len = self.open(Sect::Summary, 0, name)?;
        if !(SUMMARY_MIN..=SUMMARY_MAX).contains(&len) {
            return Err(len_err(
                "summary section length",
                len,
                format!("between {SUMMARY_MIN} and {SUMMARY_MAX}"),
            ));
        }
        let b = self.bytes(len)?;
        self.close(name)?;
        let mut c = Cursor::new(&b);
        let turns = c.u32();
        let name_bytes = c.u32().and_then(|n| c.take(usize::try_from(n).ok()?));
        let mode_bytes = c.u32().and_then(|n| c.take(usize::try_from(n).ok()?));
        let (Some(turns), Some(name_bytes), Some(mode_bytes)) = (turns, name_bytes, mode_bytes)
        else {
            return Err(malformed(at, "summary fields overrun the section"));
        };
        if !c.done() {
            return Err(malformed(at, "summary section has unused bytes"));
        }
        let session_name = std::str::from_utf8(name_bytes)
            .ok()
            .filter(|n| validate_name(n).is_ok())
            .ok_or_else(|| {
                malformed(
                    at,
                    format!("stored name \"{}\" is not valid", name_bytes.escape_ascii()),
                )
            })?;
        let mode = std::str::from_utf8(mode_bytes)
            .ok()
            .filter(|m| m.len() <= MAX_MODE_LEN && !m.chars().any(char::is_control))
            .ok_or_else(|| malformed(at, "summary mode is not printable UTF-8"))?;
        Ok((
            session_name.to_string(),
            Summary {
                turns,
                mode: mode.to_string(),
            },
        ))
    }

    pub(super) fn text(&mut self, s: Sect) -> Result<Vec<u8>, Fail> {
        let at = self.pos;
        let len = self.open(s, 0, s.label())?;
        let t = self.bytes(len)?;
        self.close(s.label())?;
        if let Err(e) = std::str::from_utf8(&t) {
            return Err(malformed(
                at,
                format!(
                    "{} text is not UTF-8 (invalid byte at {})",
                    s.label(),
                    e.valid_up_to()
                ),
            ));
        }
        Ok(t)
    }
}

/// What verified before a refusal and can still be offered.
#[derive(Default)]
pub(super) struct Recovered {
    pub(super) transcript: Option<Vec<u8>>,
    pub(super) settings: Option<Vec<u8>>,
}

/// The layer sizes the current config implies for `n_pos` positions.
pub(super) fn expected_layers(
    cfg: &ModelConfig,
    n_pos: u64,
) -> Result<(Vec<LayerDesc>, u64), Fail> {
    let overflow = || {
        Fail::Refused(Refusal::Layout {
            problems: vec![format!(
                "{n_pos} positions overflow the sizes the current config implies"
            )],
        })
    };
    let kp = kda_params(cfg);
    let heads = kp.heads as u64;
    let hd = kp.head_dim as u64;
    let s = heads
        .checked_mul(hd)
        .and_then(|x| x.checked_mul(hd))
        .ok_or_else(overflow)?;
    let conv = heads
        .checked_mul(hd)
        .and_then(|x| x.checked_mul((kp.kernel as u64).saturating_sub(1)))
        .ok_or_else(overflow)?;
    let width = mla_params(cfg).cache_width() as u64;
    let floats = n_pos.checked_mul(width).ok_or_else(overflow)?;
    let layers: Vec<LayerDesc> = cfg
        .is_mla
        .iter()
        .map(|&m| {
            if m {
                LayerDesc::Mla {
                    rows: n_pos,
                    floats,
                }
            } else {
                LayerDesc::Kda { s, conv: [conv; 3] }
            }
        })
        .collect();
    let n_mla = cfg.is_mla.iter().filter(|&&m| m).count() as u64;
    let bpp = if n_pos == 0 {
        0
    } else {
        n_mla
            .checked_mul(width)
            .and_then(|f| f.checked_add(1))
            .and_then(|f| f.checked_mul(4))
            .ok_or_else(overflow)?
    };
    Ok((layers, bpp))
}

pub(super) fn layout_problems(file: &[LayerDesc], want: &[LayerDesc], n_pos: u64) -> Vec<String> {
    let mut out = Vec::new();
    for (i, (f, w)) in file.iter().zip(want).enumerate() {
        match (*f, *w) {
            (LayerDesc::Kda { s, conv }, LayerDesc::Kda { s: ws, conv: wc }) => {
                if s != ws {
                    out.push(format!(
                        "layer {i} (KDA): recurrent state of {s} floats, the config implies {ws}"
                    ));
                }
                for (j, (c, wcj)) in conv.iter().zip(wc).enumerate() {
                    if *c != wcj {
                        out.push(format!(
                            "layer {i} (KDA): conv window {j} of {c} floats, the config implies {wcj}"
                        ));
                    }
                }
            }
            (LayerDesc::Mla { rows, floats }, LayerDesc::Mla { floats: wf, .. }) => {
                if rows != n_pos {
                    out.push(format!(
                        "layer {i} (MLA): {rows} cache rows for {n_pos} positions"
                    ));
                } else if floats != wf {
                    out.push(format!(
                        "layer {i} (MLA): cache of {floats} floats, the config implies {wf} \
                         ({n_pos} rows × {} wide)",
                        wf.checked_div(n_pos).unwrap_or(0)
                    ));
                }
            }
            _ => out.push(format!(
                "layer {i}: the file holds a {} layer, the config has {} (different layer map)",
                f.kind(),
                w.kind()
            )),
        }
    }
    const SHOWN: usize = 8;
    if out.len() > SHOWN {
        let more = out.len() - SHOWN;
        out.truncate(SHOWN);
        out.push(format!("and {more} more"));
    }
    out
}

/// Decodes the sections in file order. Kept as one function (over 100 lines) on purpose: each
/// section's checks use the counts and lengths read before it, and pieces would each need the
/// decoder, the partial record and the running expectations.
pub(super) fn decode_inner<R: Read + ?Sized>(
    r: &mut R,
    file_len: u64,
    expect: &ModelConfig,
    identity: &ModelIdentity,
    rec: &mut Recovered,
) -> Result<SessionRecord, Fail> {
    let mut d = Decoder::new(r, file_len);
    let h = d.header(file_len)?;
    let file_identity = d.identity()?;
    let (name, summary) = d.summary()?;
    rec.transcript = Some(d.text(Sect::Transcript)?);
    if file_identity != *identity {
        return Err(Refusal::Identity {
            file: Box::new(file_identity),
            current: Box::new(*identity),
        }
        .into());
    }
    rec.settings = Some(d.text(Sect::Settings)?);

    // Tokens.
    let label = Sect::Tokens.label();
    let at = d.pos;
    let len = d.open(Sect::Tokens, 0, label)?;
    let want = h.n_pos.saturating_mul(4);
    if len != want {
        return Err(len_err(
            "tokens section length",
            len,
            format!("exactly {want} ({} positions × 4)", h.n_pos),
        ));
    }
    let tokens = d.words(h.n_pos, u32::from_le_bytes)?;
    d.close(label)?;
    if let Some((i, t)) = tokens
        .iter()
        .enumerate()
        .find(|&(_, &t)| t as usize >= expect.vocab_size)
    {
        return Err(malformed(
            at,
            format!(
                "token {i} is id {t}, outside the vocabulary of {}",
                expect.vocab_size
            ),
        ));
    }

    // Sampler.
    let label = Sect::Sampler.label();
    let at = d.pos;
    let len = d.open(Sect::Sampler, 0, label)?;
    if len != SAMPLER_LEN {
        return Err(len_err(
            "sampler section length",
            len,
            format!("exactly {SAMPLER_LEN}"),
        ));
    }
    let mut sb = [0u8; SAMPLER_LEN as usize];
    d.payload(&mut sb)?;
    d.close(label)?;
    let mut c = Cursor::new(&sb);
    let (Some(temperature), Some(top_k), Some(top_p), Some(min_p), Some(repeat_penalty)) =
        (c.f32(), c.u64(), c.f32(), c.f32(), c.f32())
    else {
        return Err(malformed(at, "short sampler section"));
    };
    let (Some(seed), Some(rng_state)) = (c.u64(), c.u64()) else {
        return Err(malformed(at, "short sampler section"));
    };
    let top_k = usize::try_from(top_k)
        .map_err(|_| malformed(at, format!("sampler top_k {top_k} does not fit")))?;
    let sampler = SamplerConfig {
        temperature,
        top_k,
        top_p,
        min_p,
        repeat_penalty,
        seed,
    };
    if let Err(e) = sampler.validate() {
        return Err(malformed(at, format!("sampler settings refused: {e}")));
    }
    if rng_state == 0 {
        return Err(malformed(at, "sampler rng state is 0"));
    }

    // State layout, checked against the current config before any float is allocated.
    let label = Sect::State.label();
    let n_cfg = expect.is_mla.len() as u64;
    if h.n_layers != n_cfg {
        return Err(Refusal::Layout {
            problems: vec![format!(
                "the file holds {} layers, the config has {n_cfg}",
                h.n_layers
            )],
        }
        .into());
    }
    let at = d.pos;
    let len = d.open(Sect::State, 0, label)?;
    let want_len = LAYER_DESC_LEN * h.n_layers;
    if len != want_len {
        return Err(len_err(
            "state layout section length",
            len,
            format!(
                "exactly {want_len} ({} layers × {LAYER_DESC_LEN})",
                h.n_layers
            ),
        ));
    }
    let descs = d.bytes(len)?;
    d.close(label)?;
    let mut file_layers = Vec::new();
    for (i, chunk) in descs.chunks_exact(LAYER_DESC_LEN as usize).enumerate() {
        let desc = LayerDesc::parse(chunk).map_err(|e| {
            malformed(
                at + SECTION_HEAD + LAYER_DESC_LEN * i as u64,
                format!("layer {i} descriptor: {e}"),
            )
        })?;
        file_layers.push(desc);
    }
    let (want_layers, want_bpp) = expected_layers(expect, h.n_pos)?;
    let mut problems = layout_problems(&file_layers, &want_layers, h.n_pos);
    if problems.is_empty() && h.bpp != want_bpp {
        problems.push(format!(
            "the header's {} bytes per position differ from the {want_bpp} the config implies",
            h.bpp
        ));
    }
    if !problems.is_empty() {
        return Err(Refusal::Layout { problems }.into());
    }

    // Layers.
    let n_pos = usize::try_from(h.n_pos).map_err(|_| Fail::NoMemory(h.n_pos))?;
    let mut layers = Vec::with_capacity(want_layers.len());
    for (i, desc) in want_layers.iter().enumerate() {
        let label = format!("layer {i} ({})", desc.kind());
        let index = u32::try_from(i).unwrap_or(u32::MAX);
        let len = d.open(Sect::Layer, index, &label)?;
        let want = desc.bytes().unwrap_or(u64::MAX);
        if len != want {
            return Err(len_err(
                format!("{label} section length"),
                len,
                format!("exactly {want}, as the config implies"),
            ));
        }
        let state = match *desc {
            LayerDesc::Kda { s, conv } => {
                let s = d.f32s(s)?;
                let c0 = d.f32s(conv[0])?;
                let c1 = d.f32s(conv[1])?;
                let c2 = d.f32s(conv[2])?;
                LayerState::Kda(KdaState {
                    s,
                    conv: [c0, c1, c2],
                })
            }
            LayerDesc::Mla { floats, .. } => LayerState::Mla(d.f32s(floats)?),
        };
        d.close(&label)?;
        layers.push(state);
    }
    let state = SeqState { n_pos, layers };
    let snapshots = if h.version >= 2 {
        read_snapshots(&mut d, &h, expect, &want_layers, &tokens, &state)?
    } else {
        Vec::new()
    };
    if d.pos != d.total {
        return Err(malformed(
            d.pos,
            format!(
                "the sections end at byte {} but the header declares {}",
                d.pos, d.total
            ),
        ));
    }
    let mut probe = [0u8; 1];
    if d.fill(&mut probe)? > 0 {
        return Err(Refusal::Trailing {
            declared: d.total,
            actual: d.pos,
        }
        .into());
    }
    Ok(SessionRecord {
        name,
        created_unix: h.created,
        saved_unix: h.saved,
        identity: file_identity,
        summary,
        transcript_json: rec.transcript.take().unwrap_or_default(),
        settings_json: rec.settings.take().unwrap_or_default(),
        tokens,
        state,
        snapshots,
        sampler,
        rng_state,
    })
}

/// One snapshot's entry in the directory, checked.
pub(super) struct SnapDesc {
    pub(super) positions: u64,
    pub(super) shared: u64,
    pub(super) logits: u64,
    pub(super) len: u64,
}

/// Reads the snapshot directory and the snapshots (format 2). Every count is checked against
/// the config and the live state, and the sections' lengths together against the bytes left
/// in the file, before anything is allocated; the shared ids and rows are copied from the live
/// state. One function (over 100 lines) for the same reason as [`decode_inner`]: the checks
/// run in file order on what was read before.
pub(super) fn read_snapshots<R: Read + ?Sized>(
    d: &mut Decoder<'_, R>,
    h: &Header,
    expect: &ModelConfig,
    want_layers: &[LayerDesc],
    live_tokens: &[u32],
    live: &SeqState,
) -> Result<Vec<Snapshot>, Fail> {
    let count = h.sections.saturating_sub(FIXED_SECTIONS + 1 + h.n_layers);
    let label = Sect::SnapDir.label();
    let at = d.pos;
    let len = d.open(Sect::SnapDir, 0, label)?;
    let want = SNAP_DIR_HEAD + SNAP_DESC_LEN * count;
    if len != want {
        return Err(len_err(
            "snapshot directory length",
            len,
            format!("exactly {want} ({count} snapshots × {SNAP_DESC_LEN} + {SNAP_DIR_HEAD})"),
        ));
    }
    let dir = d.bytes(len)?;
    d.close(label)?;
    let mut c = Cursor::new(&dir);
    let (Some(n), Some(reserved)) = (c.u32(), c.u32()) else {
        return Err(malformed(at, "short snapshot directory"));
    };
    if u64::from(n) != count {
        return Err(malformed(
            at,
            format!("the directory lists {n} snapshots, the header's section count {count}"),
        ));
    }
    if reserved != 0 {
        return Err(malformed(
            at,
            format!("snapshot directory reserved field is {reserved}, expected 0"),
        ));
    }
    let overflow = || len_err("snapshot size", u64::MAX, "a size that fits in 64 bits");
    let width = mla_params(expect).cache_width() as u64;
    let n_mla = want_layers
        .iter()
        .filter(|l| matches!(l, LayerDesc::Mla { .. }))
        .count() as u64;
    let kda_floats = want_layers
        .iter()
        .filter(|l| matches!(l, LayerDesc::Kda { .. }))
        .try_fold(0u64, |acc, l| acc.checked_add(l.floats()?))
        .ok_or_else(overflow)?;
    let row = n_mla
        .checked_mul(width)
        .and_then(|f| f.checked_add(1))
        .ok_or_else(overflow)?;
    let vocab = expect.vocab_size as u64;
    let mut descs = Vec::new();
    let mut need: u64 = 0;
    for j in 0..count {
        let entry = at + SECTION_HEAD + SNAP_DIR_HEAD + SNAP_DESC_LEN * j;
        let (Some(positions), Some(shared), Some(logits)) = (c.u64(), c.u64(), c.u64()) else {
            return Err(malformed(entry, "short snapshot directory"));
        };
        if positions == 0 {
            return Err(malformed(
                entry,
                format!("snapshot {j} covers no positions"),
            ));
        }
        if shared > positions || shared > h.n_pos {
            return Err(malformed(
                entry,
                format!(
                    "snapshot {j} shares {shared} positions with the live state, which has {}, \
                     and covers {positions}",
                    h.n_pos
                ),
            ));
        }
        if logits != vocab {
            return Err(len_err(
                format!("snapshot {j} logits"),
                logits,
                format!("exactly {vocab}, the vocabulary"),
            ));
        }
        let len = row
            .checked_mul(positions - shared)
            .and_then(|f| f.checked_add(kda_floats))
            .and_then(|f| f.checked_add(logits))
            .and_then(|f| f.checked_mul(4))
            .ok_or_else(overflow)?;
        need = section_size(len)
            .and_then(|l| need.checked_add(l))
            .ok_or_else(overflow)?;
        descs.push(SnapDesc {
            positions,
            shared,
            logits,
            len,
        });
    }
    let left = d.total.saturating_sub(d.pos);
    if need != left {
        return Err(len_err(
            "the snapshot sections' length",
            need,
            format!("exactly {left}, the bytes left in the file"),
        ));
    }
    let no_memory = |n: u64| Fail::NoMemory(n.saturating_mul(4));
    let mut out = Vec::with_capacity(descs.len());
    for (j, desc) in descs.iter().enumerate() {
        let label = format!("snapshot {j}");
        let index = u32::try_from(j).unwrap_or(u32::MAX);
        let at = d.pos;
        let len = d.open(Sect::Snap, index, &label)?;
        if len != desc.len {
            return Err(len_err(
                format!("{label} section length"),
                len,
                format!(
                    "exactly {}, as its directory entry and the config imply",
                    desc.len
                ),
            ));
        }
        let positions = usize::try_from(desc.positions).map_err(|_| no_memory(desc.positions))?;
        let shared = usize::try_from(desc.shared).map_err(|_| no_memory(desc.shared))?;
        let tail = desc.positions - desc.shared;
        let mut tokens: Vec<u32> = Vec::new();
        tokens
            .try_reserve_exact(positions)
            .map_err(|_| no_memory(desc.positions))?;
        tokens.extend_from_slice(live_tokens.get(..shared).unwrap_or_default());
        d.words_into(&mut tokens, tail, u32::from_le_bytes)?;
        if let Some((i, t)) = tokens
            .iter()
            .enumerate()
            .skip(shared)
            .find(|&(_, &t)| u64::from(t) >= vocab)
        {
            return Err(malformed(
                at,
                format!("{label}: token {i} is id {t}, outside the vocabulary of {vocab}"),
            ));
        }
        let logits = d.f32s(desc.logits)?;
        let mut layers = Vec::with_capacity(want_layers.len());
        for (i, l) in want_layers.iter().enumerate() {
            layers.push(match *l {
                LayerDesc::Kda { s, conv } => {
                    let s = d.f32s(s)?;
                    let c0 = d.f32s(conv[0])?;
                    let c1 = d.f32s(conv[1])?;
                    let c2 = d.f32s(conv[2])?;
                    LayerState::Kda(KdaState {
                        s,
                        conv: [c0, c1, c2],
                    })
                }
                LayerDesc::Mla { .. } => {
                    let floats = desc.positions.saturating_mul(width);
                    let n = usize::try_from(floats).map_err(|_| no_memory(floats))?;
                    let mut v: Vec<f32> = Vec::new();
                    v.try_reserve_exact(n).map_err(|_| no_memory(floats))?;
                    if let Some(LayerState::Mla(c)) = live.layers.get(i) {
                        let w = usize::try_from(width).unwrap_or(usize::MAX);
                        v.extend_from_slice(c.get(..shared.saturating_mul(w)).unwrap_or_default());
                    }
                    d.words_into(&mut v, tail.saturating_mul(width), |w| {
                        f32::from_bits(u32::from_le_bytes(w))
                    })?;
                    LayerState::Mla(v)
                }
            });
        }
        d.close(&label)?;
        out.push(Snapshot {
            tokens,
            state: SeqState {
                n_pos: positions,
                layers,
            },
            logits,
        });
    }
    Ok(out)
}

pub(super) fn decode_labeled<R: Read + ?Sized>(
    r: &mut R,
    file_len: u64,
    expect: &ModelConfig,
    identity: &ModelIdentity,
    label: &str,
) -> Result<SessionRecord, LoadError> {
    let mut rec = Recovered::default();
    let res = decode_inner(r, file_len, expect, identity, &mut rec);
    res.map_err(|f| match f {
        Fail::Io(source) => LoadError::Io {
            name: label.to_string(),
            source,
        },
        Fail::NoMemory(bytes) => LoadError::OutOfMemory {
            name: label.to_string(),
            bytes,
        },
        Fail::Refused(reason) => match rec.transcript.take() {
            Some(transcript_json) => LoadError::StateRefused {
                reason: Box::new(reason),
                transcript_json,
            },
            None => LoadError::Refused {
                name: label.to_string(),
                reason: Box::new(reason),
            },
        },
    })
}

/// Decodes a session file of `file_len` bytes from `reader`, streaming, and checks it against
/// the current model: every length is checked against what `expect` implies before anything is
/// allocated, every section's CRC32 is verified, and trailing bytes are refused. A refusal after
/// the transcript verified is [`LoadError::StateRefused`], which carries the transcript.
pub fn decode<R: Read + ?Sized>(
    reader: &mut R,
    file_len: u64,
    expect: &ModelConfig,
    identity: &ModelIdentity,
) -> Result<SessionRecord, LoadError> {
    decode_labeled(reader, file_len, expect, identity, "(stream)")
}
