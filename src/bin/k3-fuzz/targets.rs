//! The fuzz targets: every parser of bytes k3 does not control. Each returns a short outcome
//! signature (used to keep inputs that reach new outcomes) and asserts the invariants that
//! hold whenever the parser accepts.

use k3::engine::config::ModelConfig;
use k3::session::store::{self, ModelIdentity};
use k3::stream::index::TensorIndex;
use k3::stream::safetensors;
use std::path::Path;
use std::sync::OnceLock;

/// One fuzz target.
pub struct Target {
    /// Name (also the corpus folder's).
    pub name: &'static str,
    /// What it parses.
    pub about: &'static str,
    /// Tokens the mutator splices in.
    pub dict: &'static [&'static [u8]],
    /// Run one input.
    pub run: fn(&[u8]) -> String,
    /// Make a mutant's checksums (and declared size) right again, so that it reaches the
    /// checks behind them; applied to most mutants.
    pub fixup: Option<fn(&mut [u8])>,
}

/// Session files: the declared total size (sometimes), the header CRC and every section's CRC
/// that lies inside the input, recomputed.
fn fix_session(b: &mut [u8]) {
    if b.len() < 76 {
        return;
    }
    if b[0] & 1 == 0 {
        let len = (b.len() as u64).to_le_bytes();
        b[16..24].copy_from_slice(&len);
    }
    let crc = crc32fast::hash(&b[..72]);
    b[72..76].copy_from_slice(&crc.to_le_bytes());
    let mut at = 76usize;
    while at + 16 <= b.len() {
        let mut len = [0u8; 8];
        len.copy_from_slice(&b[at + 8..at + 16]);
        let Some(end) = usize::try_from(u64::from_le_bytes(len))
            .ok()
            .and_then(|l| (at + 16).checked_add(l))
            .filter(|&e| e + 4 <= b.len())
        else {
            return;
        };
        let crc = crc32fast::hash(&b[at..end]);
        b[end..end + 4].copy_from_slice(&crc.to_le_bytes());
        at = end + 4;
    }
}

/// Journals: every complete record's CRC recomputed.
fn fix_journal(b: &mut [u8]) {
    let mut at = 8usize;
    while at + 8 <= b.len() {
        let len = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as usize;
        let Some(end) = (at + 8).checked_add(len).filter(|&e| e <= b.len()) else {
            return;
        };
        let mut h = crc32fast::Hasher::new();
        h.update(&b[at..at + 4]);
        h.update(&b[at + 8..end]);
        b[at + 4..at + 8].copy_from_slice(&h.finalize().to_le_bytes());
        at = end;
    }
}

/// Encoded trunk blocks (after the 4-byte decoded length): every block's CRC-32 that lies
/// inside the input, recomputed.
fn fix_trunk_blocks(b: &mut [u8]) {
    let mut at = 4usize;
    while at + 16 <= b.len() {
        let len = u32::from_le_bytes([b[at + 8], b[at + 9], b[at + 10], b[at + 11]]) as usize;
        let Some(end) = (at + 16).checked_add(len).filter(|&e| e <= b.len()) else {
            return;
        };
        let mut h = crc32fast::Hasher::new();
        h.update(&b[at..at + 12]);
        h.update(&b[at + 16..end]);
        b[at + 12..at + 16].copy_from_slice(&h.finalize().to_le_bytes());
        at = end.next_multiple_of(8);
    }
}

/// An encoded BF16 tensor of the packed trunk: a little-endian u32 giving the decoded length
/// (capped at 4 MiB), then the blocks. The fast decoder, on one thread and on the pool, agrees
/// with the one-code reference decoder (the same bytes or the same error), and a decode fills
/// exactly the length asked for; decoding it rows at a time gives the same rows or refuses
/// with it ([`rows_agree`]). Where the values make rows of a multiple of 32, the tensor
/// located for the kernels that multiply it coded gives the same error, or rows that decode to
/// the same bytes and products equal to the decoded rows' ([`coded_rows_agree`]).
fn trunk_blocks(data: &[u8]) -> String {
    let Some((len, enc)) = data.split_first_chunk::<4>() else {
        return "short".into();
    };
    let want = (u32::from_le_bytes(*len) as usize) % (4 << 20);
    let got = k3::stream::codec::decode_to_vec(enc, want);
    assert!(
        got == k3::stream::codec::decode_reference(enc, want),
        "the fast decoder disagrees with the reference"
    );
    rows_agree(enc, got.as_deref().ok(), want);
    match got {
        Ok(v) => {
            assert_eq!(v.len(), want);
            let mut par = vec![0u8; want];
            assert!(k3::stream::codec::decode(enc, &mut par).is_ok());
            assert!(par == v, "the parallel decoder disagrees");
            coded_rows_agree(enc, Ok(&v), want);
            format!("ok:{}", (want / 2).min(3))
        }
        Err(e) => {
            let mut par = vec![0u8; want];
            assert!(k3::stream::codec::decode(enc, &mut par).is_err());
            coded_rows_agree(enc, Err(&e), want);
            sig("blocks", &e.to_string())
        }
    }
}

/// The tensor `enc` (which decodes to `dec`, None where it does not decode) decoded rows at a
/// time as a streamed output head is ([`k3::stream::trunk::decode_rows`], stored bytes read a
/// few at a time): the same rows in order, or a refusal where the decoder refuses.
fn rows_agree(enc: &[u8], dec: Option<&[u8]>, want: usize) {
    use k3::stream::trunk::{decode_rows, RowShape, RowsError};
    if !want.is_multiple_of(2) {
        return;
    }
    let values = want / 2;
    let cols = [96, 64, 32, 7, 1]
        .into_iter()
        .find(|&c| values.is_multiple_of(c))
        .unwrap_or(1);
    let shape = RowShape {
        values,
        stored: enc.len(),
        rows: 1 + want % 5,
        cols,
    };
    let read = |at: usize, area: &mut [u8]| -> Result<(), ()> {
        area.copy_from_slice(&enc[at..at + area.len()]);
        Ok(())
    };
    let mut rows = Vec::new();
    let mut next = 0;
    let (mut e, mut d) = (Vec::new(), Vec::new());
    let got = decode_rows(shape, read, &mut e, &mut d, |r0, v| {
        assert_eq!(r0, next, "rows out of order");
        assert!(v.len().is_multiple_of(cols) && v.len() <= shape.rows * cols);
        next += v.len() / cols;
        rows.extend(v.iter().flat_map(|x| x.to_le_bytes()));
    });
    match (got, dec) {
        (Ok(()), Some(dec)) => assert!(rows == dec, "the rows decode differently"),
        (Err(RowsError::Corrupt(_)), None) => {}
        (got, dec) => panic!(
            "decoding rows gives {:?}, the decoder {}",
            got.err(),
            if dec.is_some() { "decodes" } else { "refuses" }
        ),
    }
}

/// The tensor `enc` (which decodes to `dec`) as rows of 32, 64 or 96 values where its length
/// allows, checked and located for the kernels that multiply it coded: the decoder's error, or
/// (unless a block is Huffman-coded) a matrix whose rows decode to `dec`'s and whose products
/// with a vector equal the decoded rows' on the scalar path (on the fast path too, where the
/// products are numbers).
fn coded_rows_agree(enc: &[u8], dec: Result<&[u8], &k3::stream::codec::CodecError>, want: usize) {
    use k3::kernels::{detected_isa, dot_bf16_with, Isa, NibbleMatrix};
    let n = want / 2;
    let Some(cols) = [96, 64, 32]
        .into_iter()
        .find(|&c| want.is_multiple_of(2) && n > 0 && n.is_multiple_of(c))
    else {
        return;
    };
    let rows = n / cols;
    let mut scratch = Vec::new();
    let got = k3::stream::codec::nibble_index(enc, rows, cols, &mut scratch);
    let (index, dec) = match (got, dec) {
        (Err(a), Err(b)) => {
            assert_eq!(&a, b, "the index and the decoder refuse differently");
            return;
        }
        (Ok(Some(index)), Ok(dec)) => (index, dec),
        (Ok(None), Ok(_)) => return,
        (got, dec) => panic!("the index gives {got:?}, the decoder {:?}", dec.err()),
    };
    let m = NibbleMatrix::new(enc, &index.blocks, &index.row_esc, rows, cols)
        .expect("a located tensor makes a matrix");
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 - 40.0) / 64.0).collect();
    let mut row = vec![0u16; cols];
    for r in 0..rows {
        m.decode_row(r, &mut row);
        let want_row: Vec<u16> = dec[2 * r * cols..2 * (r + 1) * cols]
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        assert_eq!(row, want_row, "row {r} decodes differently");
        let (got, want) = (
            m.row_dot(Isa::Generic, r, &x),
            dot_bf16_with(Isa::Generic, &row, &x),
        );
        assert_eq!(got.to_bits(), want.to_bits(), "row {r}: scalar product");
        let isa = detected_isa();
        let (got, want) = (m.row_dot(isa, r, &x), dot_bf16_with(isa, &row, &x));
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "row {r}: {isa:?} product"
        );
    }
}

/// An outcome's signature: the message with its numbers and quoted parts taken out, so that
/// one kind of refusal is one signature whatever the input's values.
fn sig(kind: &str, msg: &str) -> String {
    let mut out = String::with_capacity(kind.len() + 64);
    out.push_str(kind);
    let mut quoted = false;
    let mut word = String::with_capacity(32);
    let flush = |word: &mut String, out: &mut String| {
        if !word.is_empty() && !word.bytes().any(|b| b.is_ascii_digit()) {
            out.push(' ');
            out.push_str(word);
        }
        word.clear();
    };
    for c in msg.chars().take(160) {
        match c {
            '"' | '`' => quoted = !quoted,
            _ if quoted => {}
            c if c.is_whitespace() => flush(&mut word, &mut out),
            c => word.push(c),
        }
    }
    flush(&mut word, &mut out);
    out
}

const JSON_DICT: &[&[u8]] = &[
    b"{",
    b"}",
    b"[",
    b"]",
    b"\"",
    b",",
    b":",
    b"null",
    b"true",
    b"false",
    b"\"\"",
    b"{}",
    b"[]",
    b"\\u0000",
    b"\\ud800",
    b"\\u00e9",
    b"\\\"",
    b"\x1b]0;x\x07",
    b"[[[[[[[[[[[[[[[[",
];

const ST_DICT: &[&[u8]] = &[
    b"\"dtype\"",
    b"\"shape\"",
    b"\"data_offsets\"",
    b"\"F32\"",
    b"\"BF16\"",
    b"\"F16\"",
    b"\"U8\"",
    b"\"I64\"",
    b"\"__metadata__\"",
    b"{\"format\":\"pt\"}",
    b"[0,0]",
    b"[1,1,1,1,1]",
    b"[4,9223372036854775807]",
    b"\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}",
    b"version https://git-lfs",
    b"<!DOCTYPE html>",
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b"\\u0000",
    b"\\u00e9",
];

fn st_header(data: &[u8]) -> String {
    let file_len = data.len() as u64;
    let n = match safetensors::header_len(data, file_len) {
        Ok(n) => n,
        Err(e) => return sig("len", &e.to_string()),
    };
    let json = &data[8..8 + n as usize];
    let data_len = file_len - 8 - n;
    let entries = match safetensors::parse_header(json, data_len) {
        Ok(e) => e,
        Err(e) => return sig("header", &e.to_string()),
    };
    // Accepted: sorted, inside the data region, exactly covering it, spans match the shapes.
    let mut covered = 0u64;
    for e in &entries {
        assert!(
            e.begin <= e.end && e.end <= data_len,
            "{e:?} outside {data_len}"
        );
        let numel = e.shape().iter().product::<u64>();
        assert_eq!(numel * e.dtype.size(), e.end - e.begin, "{e:?}");
        if e.begin < e.end {
            assert_eq!(e.begin, covered, "{e:?} after {covered}");
            covered = e.end;
        }
    }
    assert_eq!(covered, data_len);
    let mut idx = TensorIndex::default();
    let Ok(shard) = idx.add_shard("model.safetensors") else {
        return "index:shard".into();
    };
    for e in &entries {
        if let Err(err) = idx.push(shard, &e.name, e.dtype, e.shape(), 8 + n + e.begin) {
            return sig("index", &err.to_string());
        }
    }
    if let Err(err) = idx.finish() {
        return sig("index", &err.to_string());
    }
    for e in &entries {
        let info = idx
            .get(&e.name)
            .expect("every accepted tensor is in the index");
        assert_eq!(info.offset, 8 + n + e.begin);
        assert_eq!(
            info.shape.iter().map(|&d| d as u64).collect::<Vec<_>>(),
            e.shape()
        );
    }
    assert_eq!(idx.len(), entries.len());
    format!("ok:{}", entries.len().min(4))
}

fn st_index_json(data: &[u8]) -> String {
    match k3::stream::checkpoint::parse_weight_map(data) {
        Ok(map) => {
            // Accepted: plain file names, sorted and distinct, each with its tensors sorted
            // and distinct, and no tensor in two files.
            let mut total = 0;
            let mut last_file: Option<&str> = None;
            let mut all: Vec<&str> = Vec::new();
            for (file, tensors) in map.files() {
                assert!(!file.is_empty() && !file.contains('/') && file != "..");
                assert!(last_file.is_none_or(|l| l < file), "{last_file:?} {file:?}");
                last_file = Some(file);
                assert!(!tensors.is_empty());
                assert!(map.contains_file(file));
                total += tensors.len();
                all.extend(tensors.names());
            }
            assert_eq!(total, map.len());
            all.sort_unstable();
            assert!(all.windows(2).all(|w| w[0] < w[1]), "a tensor named twice");
            format!("ok:{}", map.n_files().min(4))
        }
        Err(e) => sig("index", &e),
    }
}

fn config_json(data: &[u8]) -> String {
    let Ok(text) = std::str::from_utf8(data) else {
        return "utf8".into();
    };
    match ModelConfig::parse(text, Path::new("config.json")) {
        Ok(c) => {
            assert!(
                c.num_hidden_layers >= 1 && c.num_hidden_layers <= k3::engine::config::MAX_LAYERS
            );
            "ok".into()
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.len() < 64 << 10,
                "a config message of {} bytes",
                msg.len()
            );
            sig("config", &msg)
        }
    }
}

fn trunk_manifest(data: &[u8]) -> String {
    match k3::stream::trunk::parse_manifest(data, Path::new("trunk")) {
        Ok(m) => format!("ok:{}", m.layers.len().min(4)),
        Err(e) => sig("manifest", &e),
    }
}

/// The tiny model's config, and the identity its sessions carry (read from the first seed).
fn tiny() -> &'static (ModelConfig, OnceLock<ModelIdentity>) {
    static TINY: OnceLock<(ModelConfig, OnceLock<ModelIdentity>)> = OnceLock::new();
    TINY.get_or_init(|| {
        let text = include_str!("../../../tests/fixtures/tiny/config.json");
        let cfg = ModelConfig::parse(text, Path::new("tiny/config.json"))
            .expect("the tiny fixture's config parses");
        (cfg, OnceLock::new())
    })
}

/// Where the model identity sits in a session file (after the header and the IDEN section's
/// 16-byte head).
const IDENTITY_AT: usize = 92;

/// Take the identity the session seeds were saved with.
pub fn learn_identity(seed: &[u8]) {
    if let Some(id) = seed.get(IDENTITY_AT..IDENTITY_AT + 32) {
        let mut hash = [0u8; 32];
        hash.copy_from_slice(id);
        let _ = tiny().1.set(ModelIdentity { hash });
    }
}

fn session_decode(data: &[u8]) -> String {
    let (cfg, id) = tiny();
    let identity = id.get().copied().unwrap_or(ModelIdentity { hash: [0; 32] });
    let mut r = data;
    match store::decode(&mut r, data.len() as u64, cfg, &identity) {
        Ok(rec) => {
            assert_eq!(rec.tokens.len() as u64, rec.state.n_pos as u64);
            assert!(rec.rng_state != 0);
            assert!(rec.snapshots.len() <= store::MAX_SNAPSHOTS);
            for s in &rec.snapshots {
                assert_eq!(s.tokens.len(), s.state.n_pos);
                assert_eq!(s.logits.len(), cfg.vocab_size);
            }
            let again = store::encode(&rec).expect("a decoded record encodes");
            let version = u32::from_le_bytes([data[8], data[9], data[10], data[11]]);
            if version == store::FORMAT_VERSION {
                // What decodes encodes back to the same bytes (timestamps and all).
                assert_eq!(again, data, "decode/encode round trip");
                if rec.snapshots.is_empty() {
                    "ok".into()
                } else {
                    "ok with snapshots".into()
                }
            } else {
                // An older file is written in the current format, which reads back the same.
                let mut r = &again[..];
                let back = store::decode(&mut r, again.len() as u64, cfg, &identity)
                    .expect("a re-encoded older file decodes");
                assert_eq!(
                    store::encode(&back).ok(),
                    Some(again),
                    "re-encoded round trip"
                );
                "ok from an older version".into()
            }
        }
        Err(e) => sig("session", &e.to_string()),
    }
}

fn tiktoken_ranks(data: &[u8]) -> String {
    match k3::session::tokenizer::parse_ranks(Path::new("tiktoken.model"), data) {
        Ok(n) => {
            assert!(n >= 256, "{n} ranks accepted without all 256 bytes");
            "ok".into()
        }
        Err(e) => sig("ranks", &e.to_string()),
    }
}

fn user_toml(data: &[u8]) -> String {
    let Ok(text) = std::str::from_utf8(data) else {
        return "utf8".into();
    };
    match k3::app::config::Config::parse(text, Path::new("config.toml")) {
        Ok(c) => {
            // What is accepted writes back out as a file that is accepted again.
            let again = c.to_toml();
            assert!(
                k3::app::config::Config::parse(&again, Path::new("config.toml")).is_ok(),
                "to_toml of an accepted config is refused:\n{again}"
            );
            "ok".into()
        }
        Err(e) => {
            let msg = e.to_string();
            sig("toml", &msg)
        }
    }
}

fn generation_config(data: &[u8]) -> String {
    use k3::session::defaults::GenerationConfig;
    match GenerationConfig::parse(data, Path::new("generation_config.json")) {
        Ok(g) => {
            // What is accepted is in range for the sampler.
            let l = &g.layer;
            assert!(
                l.temperature.is_none_or(|t| t.is_finite() && t >= 0.0),
                "{l:?}"
            );
            assert!(l.top_p.is_none_or(|p| p > 0.0 && p <= 1.0), "{l:?}");
            assert!(l.min_p.is_none_or(|p| (0.0..=1.0).contains(&p)), "{l:?}");
            assert!(
                l.repeat_penalty.is_none_or(|r| r.is_finite() && r > 0.0),
                "{l:?}"
            );
            assert!(l.max_tokens.is_none_or(|n| n >= 1), "{l:?}");
            let (s, _) = k3::session::defaults::resolve(
                k3::session::defaults::built_in(),
                &[(k3::session::defaults::Source::Model, l)],
            );
            assert!(s.sampler.validate().is_ok(), "{l:?}");
            format!("ok:{}", g.notes.len())
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.len() < 4 << 10, "a message of {} bytes", msg.len());
            sig("generation", &msg)
        }
    }
}

/// A server's streamed reply (`k3 chat --remote`): the line buffer gives the same lines
/// whether the bytes arrive at once or in two pieces, and the events parse or are refused.
fn sse_stream(data: &[u8]) -> String {
    use k3::app::remote::sse;
    let cut = data
        .first()
        .map_or(0, |&b| usize::from(b) % (data.len() + 1));
    let whole = sse::LineBuffer::new(sse::MAX_LINE).push(data);
    let mut two = sse::LineBuffer::new(sse::MAX_LINE);
    let parts = two.push(&data[..cut]).and_then(|mut a| {
        a.extend(two.push(&data[cut..])?);
        Ok(a)
    });
    if let (Ok(w), Ok(p)) = (&whole, &parts) {
        assert_eq!(w, p, "lines depend on where the bytes were split ({cut})");
    }
    match sse::parse_stream(data) {
        Ok(events) => {
            let done = events.iter().position(|e| *e == sse::SseEvent::Done);
            assert!(
                done.is_none_or(|i| i + 1 == events.len()),
                "events after [DONE]"
            );
            format!("ok:{}:{}", events.len().min(3), done.is_some())
        }
        Err(e) => sig("sse", &e.to_string()),
    }
}

/// A request body of `k3 serve`: the first byte picks the endpoint (even: chat completions,
/// odd: completions). What is accepted has a reply length within the limit and valid sampling.
fn serve_request(data: &[u8]) -> String {
    use k3::serve::wire::{self, Limits};
    let limits = Limits {
        max_tokens: 256,
        context: 4096,
        sampler: k3::engine::sampling::SamplerConfig {
            temperature: 1.0,
            ..Default::default()
        },
        default_max_tokens: 128,
        vocab: 4096,
    };
    let (chat, body) = match data.split_first() {
        Some((b, rest)) => (b & 1 == 0, rest),
        None => (true, data),
    };
    let r = if chat {
        wire::parse_chat(body, limits)
    } else {
        wire::parse_completion(body, limits)
    };
    match r {
        Ok(p) => {
            let s = &p.settings;
            assert!((1..=limits.max_tokens).contains(&s.max_tokens), "{s:?}");
            assert!(s.sampler.validate().is_ok(), "{s:?}");
            assert!(s.context_limit <= limits.context, "{s:?}");
            format!("ok:{chat}")
        }
        Err(e) => {
            assert!((400..600).contains(&e.status), "status {}", e.status);
            sig("request", &e.message)
        }
    }
}

fn journal(data: &[u8]) -> String {
    match k3::session::journal::decode(data) {
        Ok(r) => {
            let sum: u64 = r.records.iter().map(|x| 8 + x.len() as u64).sum();
            assert_eq!(8 + sum, r.good_len);
            assert_eq!(r.torn.is_some(), r.good_len < data.len() as u64);
            format!("ok:{}:{}", r.records.len().min(3), r.torn.is_some())
        }
        Err(_) => "magic".into(),
    }
}

const TOML_DICT: &[&[u8]] = &[
    b"[sampling]",
    b"[memory]",
    b"[thinking]",
    b"[keys]",
    b"[theme]",
    b"model_dir = ",
    b"temperature = ",
    b"top_k = ",
    b"top_p = ",
    b"context = ",
    b"budget_gb = ",
    b"quit = ",
    b"\"ctrl-q\"",
    b"\"ctrl-ctrl-q\"",
    b"\"alt-\"",
    b"= 1e400",
    b"= -1",
    b"= nan",
    b"= inf",
    b"\"\"\"",
    b"'''",
    b"[[x]]",
    b"= {a = 1}",
    b"= [1, 2]",
    b"\n",
    b"#",
];

const GENERATION_DICT: &[&[u8]] = &[
    b"\"temperature\"",
    b"\"top_p\"",
    b"\"top_k\"",
    b"\"min_p\"",
    b"\"repetition_penalty\"",
    b"\"max_new_tokens\"",
    b"\"do_sample\"",
    b"\"eos_token_id\"",
    b"\"transformers_version\"",
    b"1e400",
    b"-0.0",
    b"4294967296",
    b"2.5",
    b"null",
    b"true",
    b"[1, 2]",
    b"{",
    b"}",
    b",",
    b":",
];

const SSE_DICT: &[&[u8]] = &[
    b"data: ",
    b"data: [DONE]\n",
    b"\r\n",
    b"\n\n",
    b": keep-alive\n",
    b"event: message\n",
    b"{\"choices\":[{\"delta\":{\"content\":\"x\"}}]}",
    b"\"reasoning_content\"",
    b"\"finish_reason\"",
    b"\"usage\"",
    b"\"error\"",
    b"null",
];

const SESSION_DICT: &[&[u8]] = &[
    b"\x89K3SESS\n",
    b"IDEN",
    b"SUMM",
    b"TRAN",
    b"SETT",
    b"TOKS",
    b"SAMP",
    b"STAT",
    b"LAYR",
    b"SNAP",
    b"SNPS",
    b"\xff\xff\xff\xff\xff\xff\xff\xff",
    b"\0\0\0\0\0\0\0\0",
    b"\0\0\0\x80",
];

const RANKS_DICT: &[&[u8]] = &[
    b"\n",
    b"\r\n",
    b" ",
    b"AA== ",
    b"AA== 0\n",
    b"=",
    b"-1",
    b" 999999",
    b"QUJD",
    b"version https://git-lfs.github.com/spec/v1\n",
    b"\xef\xbb\xbf",
    b"  ",
    b"\t",
];

const BLOCK_DICT: &[&[u8]] = &[
    b"\x00\x00\x00\x00",
    b"\x01\x00\x00\x00",
    b"\x00\x00\x04\x00",
    b"\xff\xff\xff\xff",
    b"\x11\x11\x11\x11",
];

const JOURNAL_DICT: &[&[u8]] = &[
    b"\x89K3JRNL\n",
    b"\0\0\0\0",
    b"\xff\xff\xff\xff",
    b"{\"kind\":\"turn\"}",
];

/// Every target, in the order `all` runs them.
pub const TARGETS: &[Target] = &[
    Target {
        name: "st_header",
        about: "a safetensors file: header length, header JSON, the tensor index built from it",
        dict: ST_DICT,
        run: st_header,
        fixup: None,
    },
    Target {
        name: "st_index_json",
        about: "model.safetensors.index.json (weight_map)",
        dict: JSON_DICT,
        run: st_index_json,
        fixup: None,
    },
    Target {
        name: "config_json",
        about: "the model's config.json",
        dict: JSON_DICT,
        run: config_json,
        fixup: None,
    },
    Target {
        name: "trunk_manifest",
        about: "a packed trunk's trunk.json",
        dict: JSON_DICT,
        run: trunk_manifest,
        fixup: None,
    },
    Target {
        name: "trunk_blocks",
        about: "an encoded BF16 tensor of trunk.bin (docs/trunk-codec.md)",
        dict: BLOCK_DICT,
        run: trunk_blocks,
        fixup: Some(fix_trunk_blocks),
    },
    Target {
        name: "session_decode",
        about: "a session file, decoded against the tiny model",
        dict: SESSION_DICT,
        run: session_decode,
        fixup: Some(fix_session),
    },
    Target {
        name: "tiktoken_ranks",
        about: "the tokenizer's rank file (tiktoken.model)",
        dict: RANKS_DICT,
        run: tiktoken_ranks,
        fixup: None,
    },
    Target {
        name: "user_toml",
        about: "the user's config.toml",
        dict: TOML_DICT,
        run: user_toml,
        fixup: None,
    },
    Target {
        name: "generation_config",
        about: "the model's generation_config.json",
        dict: GENERATION_DICT,
        run: generation_config,
        fixup: None,
    },
    Target {
        name: "sse_stream",
        about: "a server's streamed reply (SSE) read by k3 chat --remote",
        dict: SSE_DICT,
        run: sse_stream,
        fixup: None,
    },
    Target {
        name: "serve_request",
        about: "a request body of k3 serve (chat completions, completions)",
        dict: JSON_DICT,
        run: serve_request,
        fixup: None,
    },
    Target {
        name: "journal",
        about: "a session journal's records",
        dict: JOURNAL_DICT,
        run: journal,
        fixup: Some(fix_journal),
    },
];
