//! Tests of the session file format and the store.

use super::decode::*;
use super::dir::*;
use super::encode::*;
use super::error::*;
use super::format::*;
use super::lock::*;
use crate::session::naming::validate_name;
use sha2::{Digest, Sha256};
use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::engine::config::ModelConfig;
use crate::engine::sampling::SamplerConfig;
use crate::engine::state::{LayerState, SeqState, Snapshot};
use std::sync::{Arc, Barrier};

const TINY: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/tiny/config.json"
);

fn tiny() -> ModelConfig {
    ModelConfig::load(Path::new(TINY)).expect("tiny config")
}

/// splitmix64, for reproducible test data.
struct Prng(u64);

impl Prng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn f32(&mut self) -> f32 {
        f32::from_bits(self.next() as u32)
    }
}

fn identity() -> ModelIdentity {
    ModelIdentity::compute(b"{\"tiny\":1}", &[b"ranks", b"tokenizer_config"], b"index")
}

fn record(cfg: &ModelConfig, name: &str, n_pos: usize, seed: u64) -> SessionRecord {
    let mut rng = Prng(seed);
    let mut state = SeqState::new(cfg);
    state.n_pos = n_pos;
    let width = SeqState::mla_floats_per_position(cfg);
    for layer in &mut state.layers {
        match layer {
            LayerState::Kda(k) => {
                for x in k.s.iter_mut().chain(k.conv.iter_mut().flatten()) {
                    *x = rng.f32();
                }
            }
            LayerState::Mla(c) => *c = (0..n_pos * width).map(|_| rng.f32()).collect(),
        }
    }
    let Some(LayerState::Kda(k)) = state.layers.first_mut() else {
        panic!("layer 0 of the tiny config is KDA");
    };
    k.s[0] = -0.0;
    k.s[1] = f32::from_bits(0x7fa0_0001); // signalling NaN with a payload
    k.s[2] = f32::from_bits(0xffc1_2345); // negative quiet NaN with a payload
    k.s[3] = f32::INFINITY;
    k.s[4] = f32::from_bits(1); // smallest subnormal
    SessionRecord {
        name: name.into(),
        created_unix: 1_700_000_000 + seed,
        saved_unix: 1_700_000_100 + seed,
        identity: identity(),
        summary: Summary {
            turns: 3,
            mode: "chat".into(),
        },
        transcript_json: format!(r#"{{"messages":[{{"role":"user","content":"hello {seed}"}}]}}"#)
            .into_bytes(),
        settings_json: br#"{"thinking":true,"effort":"high"}"#.to_vec(),
        tokens: (0..n_pos)
            .map(|_| rng.below(cfg.vocab_size as u64) as u32)
            .collect(),
        state,
        snapshots: Vec::new(),
        sampler: SamplerConfig {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            repeat_penalty: 1.1,
            seed,
        },
        rng_state: rng.next() | 1,
    }
}

/// `rec` with four snapshots: a prefix of the live state (every row shared), one that
/// leaves the live ids after 2 positions, one longer than the live state, and one whose ids
/// are a prefix but whose rows differ after position 1 (so only 1 is shared).
fn with_snapshots(mut rec: SessionRecord, cfg: &ModelConfig, seed: u64) -> SessionRecord {
    let mut rng = Prng(seed ^ 0x5eed);
    let width = SeqState::mla_floats_per_position(cfg);
    let n = rec.state.n_pos;
    assert!(n >= 4, "the live state has at least 4 positions");
    let mut make = |len: usize, keep: usize, rows_kept: usize| {
        let mut tokens = rec.tokens[..keep].to_vec();
        while tokens.len() < len {
            let t = if tokens.len() < n {
                // Another id than the live state's at this position.
                (rec.tokens[tokens.len()] + 1) % cfg.vocab_size as u32
            } else {
                rng.below(cfg.vocab_size as u64) as u32
            };
            tokens.push(t);
        }
        let mut state = SeqState::new(cfg);
        state.n_pos = len;
        for (l, live) in state.layers.iter_mut().zip(&rec.state.layers) {
            match (l, live) {
                (LayerState::Kda(k), _) => {
                    for x in k.s.iter_mut().chain(k.conv.iter_mut().flatten()) {
                        *x = rng.f32();
                    }
                }
                (LayerState::Mla(c), LayerState::Mla(lc)) => {
                    *c = lc[..rows_kept * width].to_vec();
                    c.extend((rows_kept * width..len * width).map(|_| rng.f32()));
                }
                _ => unreachable!("same layer map"),
            }
        }
        let logits = (0..cfg.vocab_size).map(|_| rng.f32()).collect();
        Snapshot {
            tokens,
            state,
            logits,
        }
    };
    let snaps = vec![
        make(3, 3, 3),
        make(n, 2, 2),
        make(n + 2, n, n),
        make(4, 4, 1),
    ];
    rec.snapshots = snaps;
    rec
}

fn bits(xs: &[f32]) -> Vec<u32> {
    xs.iter().map(|x| x.to_bits()).collect()
}

/// Bit-for-bit equality of two states.
fn same_state(a: &SeqState, b: &SeqState) -> bool {
    a.n_pos == b.n_pos
        && a.layers.len() == b.layers.len()
        && a.layers.iter().zip(&b.layers).all(|(x, y)| match (x, y) {
            (LayerState::Kda(p), LayerState::Kda(q)) => {
                bits(&p.s) == bits(&q.s) && (0..3).all(|i| bits(&p.conv[i]) == bits(&q.conv[i]))
            }
            (LayerState::Mla(p), LayerState::Mla(q)) => bits(p) == bits(q),
            _ => false,
        })
}

/// Field-by-field equality with floats compared by their bits.
fn same(a: &SessionRecord, b: &SessionRecord) -> bool {
    let layers = same_state(&a.state, &b.state)
        && a.snapshots.len() == b.snapshots.len()
        && a.snapshots.iter().zip(&b.snapshots).all(|(x, y)| {
            x.tokens == y.tokens
                && bits(&x.logits) == bits(&y.logits)
                && same_state(&x.state, &y.state)
        });
    let s = |c: &SamplerConfig| {
        (
            c.temperature.to_bits(),
            c.top_k,
            c.top_p.to_bits(),
            c.min_p.to_bits(),
            c.repeat_penalty.to_bits(),
            c.seed,
        )
    };
    layers
        && a.state.n_pos == b.state.n_pos
        && a.name == b.name
        && a.created_unix == b.created_unix
        && a.saved_unix == b.saved_unix
        && a.identity == b.identity
        && a.summary == b.summary
        && a.transcript_json == b.transcript_json
        && a.settings_json == b.settings_json
        && a.tokens == b.tokens
        && s(&a.sampler) == s(&b.sampler)
        && a.rng_state == b.rng_state
}

fn dec(bytes: &[u8], cfg: &ModelConfig) -> Result<SessionRecord, LoadError> {
    decode(&mut &bytes[..], bytes.len() as u64, cfg, &identity())
}

fn refusal(e: &LoadError) -> Refusal {
    e.refusal()
        .cloned()
        .unwrap_or_else(|| panic!("not a refusal: {e}"))
}

fn sha(path: &Path) -> [u8; 32] {
    Sha256::digest(fs::read(path).expect("read")).into()
}

/// `(start, tag, payload length)` of every section.
fn sections(bytes: &[u8]) -> Vec<(usize, [u8; 4], usize)> {
    let mut out = Vec::new();
    let mut pos = HEADER_LEN as usize;
    while pos < bytes.len() {
        let tag: [u8; 4] = bytes[pos..pos + 4].try_into().unwrap();
        let len = u64::from_le_bytes(bytes[pos + 8..pos + 16].try_into().unwrap()) as usize;
        out.push((pos, tag, len));
        pos += 16 + len + 4;
    }
    assert_eq!(pos, bytes.len());
    out
}

/// The name a refusal uses for section `k` of a tiny-config file.
fn section_name(cfg: &ModelConfig, k: usize) -> String {
    let fixed = [
        "identity",
        "summary",
        "transcript",
        "settings",
        "tokens",
        "sampler",
        "state layout",
    ];
    let layers = cfg.is_mla.len();
    match fixed.get(k) {
        Some(n) => n.to_string(),
        None if k < fixed.len() + layers => {
            let i = k - fixed.len();
            format!("layer {i} ({})", if cfg.is_mla[i] { "MLA" } else { "KDA" })
        }
        None if k == fixed.len() + layers => "snapshot directory".to_string(),
        None => format!("snapshot {}", k - fixed.len() - layers - 1),
    }
}

fn fix_header_crc(b: &mut [u8]) {
    let crc = crc32fast::hash(&b[..72]);
    b[72..76].copy_from_slice(&crc.to_le_bytes());
}

fn setup() -> (tempfile::TempDir, SessionStore, ModelConfig) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SessionStore::new(dir.path().join("sessions"));
    fs::create_dir_all(store.dir()).unwrap();
    (dir, store, tiny())
}

fn temps(store: &SessionStore) -> Vec<String> {
    fs::read_dir(store.dir())
        .unwrap()
        .filter_map(|e| e.unwrap().file_name().into_string().ok())
        .filter(|n| parse_temp_name(n).is_some())
        .collect()
}

#[test]
fn round_trip_is_bit_exact() {
    let cfg = tiny();
    for n_pos in [0, 1, 7] {
        let rec = record(&cfg, "alpha", n_pos, 11 + n_pos as u64);
        let bytes = encode(&rec).unwrap();
        assert_eq!(bytes.len() as u64, rec.encoded_len().unwrap());
        let mut streamed = Vec::new();
        assert_eq!(rec.write_to(&mut streamed).unwrap(), bytes.len() as u64);
        assert_eq!(streamed, bytes);
        let back = dec(&bytes, &cfg).unwrap();
        assert!(same(&rec, &back), "n_pos {n_pos}");
        assert_eq!(encode(&back).unwrap(), bytes);
    }
    let (_dir, store, cfg) = setup();
    let rec = record(&cfg, "alpha", 7, 5);
    let n = store.save(&rec).unwrap();
    assert_eq!(
        n,
        fs::metadata(store.path_of("alpha").unwrap()).unwrap().len()
    );
    let back = store.load("alpha", &cfg, &identity()).unwrap();
    assert!(same(&rec, &back));
    fs::copy(
        store.path_of("alpha").unwrap(),
        store.path_of("beta").unwrap(),
    )
    .unwrap();
    let copy = store.load("beta", &cfg, &identity()).unwrap();
    assert_eq!(copy.name, "beta");
    let LayerState::Kda(k) = &back.state.layers[0] else {
        panic!("layer 0 is KDA")
    };
    assert_eq!(k.s[0].to_bits(), 0x8000_0000);
    assert_eq!(k.s[1].to_bits(), 0x7fa0_0001);
    assert_eq!(k.s[2].to_bits(), 0xffc1_2345);
}

#[test]
fn snapshots_round_trip_bit_exact_and_store_shared_rows_once() {
    let cfg = tiny();
    let rec = with_snapshots(record(&cfg, "snaps", 7, 21), &cfg, 21);
    let bytes = encode(&rec).unwrap();
    assert_eq!(bytes.len() as u64, rec.encoded_len().unwrap());
    let back = dec(&bytes, &cfg).unwrap();
    assert!(same(&rec, &back));
    assert_eq!(encode(&back).unwrap(), bytes);
    // Each snapshot section holds its KDA state, its logits and only the ids and rows past
    // what it shares with the live state: 3, 2, 7 and 1 positions shared.
    let width = SeqState::mla_floats_per_position(&cfg);
    let n_mla = cfg.is_mla.iter().filter(|&&m| m).count();
    let kda: usize = match &rec.state.layers[0] {
        LayerState::Kda(k) => k.s.len() + k.conv.iter().map(Vec::len).sum::<usize>(),
        LayerState::Mla(_) => unreachable!("layer 0 is KDA"),
    } * (cfg.is_mla.len() - n_mla);
    let secs = sections(&bytes);
    assert_eq!(secs.len(), 8 + cfg.is_mla.len() + 4);
    let snap_lens: Vec<usize> = secs[secs.len() - 4..].iter().map(|s| s.2).collect();
    let want = |tail: usize| 4 * (kda + cfg.vocab_size + tail * (1 + n_mla * width));
    assert_eq!(snap_lens, vec![want(0), want(5), want(2), want(3)]);
    let without = encode(&record(&cfg, "snaps", 7, 21)).unwrap();
    assert_eq!(
        bytes.len() - without.len(),
        snap_lens.iter().map(|l| l + 20).sum::<usize>() + 4 * 24
    );
    // Through the store as well.
    let (_dir, store, cfg) = setup();
    store.save(&rec).unwrap();
    assert!(same(&rec, &store.load("snaps", &cfg, &identity()).unwrap()));
}

#[test]
fn a_version_1_file_written_before_snapshots_is_read() {
    // Written by the build before format 2 (`k3 chat` on the tiny model, two turns).
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/sessions/v1-tiny.k3session"
    );
    let bytes = fs::read(path).unwrap();
    assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 1);
    let cfg = tiny();
    let mut id = [0u8; 32];
    id.copy_from_slice(&bytes[92..124]);
    let rec = decode(
        &mut &bytes[..],
        bytes.len() as u64,
        &cfg,
        &ModelIdentity { hash: id },
    )
    .unwrap();
    assert_eq!(rec.name, "v1-tiny");
    assert_eq!(rec.tokens.len(), 118);
    assert_eq!(rec.state.n_pos, 118);
    assert!(rec.snapshots.is_empty());
    // Written again, it is a version 2 file that reads back the same.
    let again = encode(&rec).unwrap();
    assert_eq!(u32::from_le_bytes(again[8..12].try_into().unwrap()), 2);
    let back = decode(
        &mut &again[..],
        again.len() as u64,
        &cfg,
        &ModelIdentity { hash: id },
    )
    .unwrap();
    assert!(same(&rec, &back));
    // A version 1 header with a snapshot directory after its layers is refused.
    let mut b = again.clone();
    b[8..12].copy_from_slice(&1u32.to_le_bytes());
    b[24..32].copy_from_slice(&(7 + cfg.is_mla.len() as u64 + 1).to_le_bytes());
    fix_header_crc(&mut b);
    assert!(matches!(
        refusal(
            &decode(
                &mut &b[..],
                b.len() as u64,
                &cfg,
                &ModelIdentity { hash: id }
            )
            .unwrap_err()
        ),
        Refusal::Length { .. }
    ));
}

#[test]
fn lying_snapshot_directories_are_refused_before_allocating() {
    let cfg = tiny();
    let rec = with_snapshots(record(&cfg, "lie", 7, 8), &cfg, 8);
    let bytes = encode(&rec).unwrap();
    let secs = sections(&bytes);
    let (dir_at, tag, dir_len) = secs[7 + cfg.is_mla.len()];
    assert_eq!(&tag, b"SNAP");
    let entry = dir_at + 16 + 8;
    let patched = |field: usize, snap: usize, v: u64| {
        let mut b = bytes.clone();
        let at = entry + 24 * snap + 8 * field;
        b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        let end = dir_at + 16 + dir_len;
        let crc = crc32fast::hash(&b[dir_at..end]);
        b[end..end + 4].copy_from_slice(&crc.to_le_bytes());
        b
    };
    for (field, values) in [
        (0usize, vec![0u64, 6, 8, 1 << 40, u64::MAX]),
        (1, vec![4, 8, 1 << 40, u64::MAX]),
        (2, vec![0, 511, 513, u64::MAX]),
    ] {
        for v in values {
            let e = dec(&patched(field, 0, v), &cfg).unwrap_err();
            let r = refusal(&e);
            assert!(
                matches!(r, Refusal::Length { .. } | Refusal::Malformed { .. }),
                "field {field} = {v}: {r}"
            );
            assert!(e.transcript_json().is_some(), "{e}");
        }
    }
    // The count in the directory must match the header's section count.
    let mut b = bytes.clone();
    b[dir_at + 16] = 3;
    let end = dir_at + 16 + dir_len;
    let crc = crc32fast::hash(&b[dir_at..end]);
    b[end..end + 4].copy_from_slice(&crc.to_le_bytes());
    assert!(matches!(
        refusal(&dec(&b, &cfg).unwrap_err()),
        Refusal::Malformed { .. }
    ));
    // More snapshots than a session keeps.
    let mut b = bytes.clone();
    let n = 8 + cfg.is_mla.len() as u64 + MAX_SNAPSHOTS as u64 + 1;
    b[24..32].copy_from_slice(&n.to_le_bytes());
    fix_header_crc(&mut b);
    assert!(matches!(
        refusal(&dec(&b, &cfg).unwrap_err()),
        Refusal::Length { .. }
    ));
    // A record with too many snapshots, or one that does not fit the live state, is not
    // written.
    let mut r = rec.clone();
    r.snapshots.push(r.snapshots[0].clone());
    assert_eq!(
        encode(&r).unwrap_err(),
        RecordError::TooManySnapshots { n: 5 }
    );
    let mut r = rec.clone();
    r.snapshots[1].tokens.pop();
    assert!(matches!(
        encode(&r).unwrap_err(),
        RecordError::Snapshot { index: 1, .. }
    ));
    let mut r = rec;
    r.snapshots[2].state.layers.swap(0, 3);
    assert!(matches!(
        encode(&r).unwrap_err(),
        RecordError::Snapshot { index: 2, .. }
    ));
}

#[test]
fn write_to_streams_in_bounded_chunks() {
    struct Largest(usize, u64);
    impl Write for Largest {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0 = self.0.max(buf.len());
            self.1 += buf.len() as u64;
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    let cfg = tiny();
    let mut rec = record(&cfg, "big", 300, 9);
    rec.transcript_json = vec![b' '; 3 << 20];
    let mut w = Largest(0, 0);
    let n = rec.write_to(&mut w).unwrap();
    assert_eq!(n, w.1);
    assert!(w.0 <= 2 * IO_CHUNK, "largest write {}", w.0);
    assert_eq!(n, rec.encoded_len().unwrap());
}

#[test]
fn wrong_magic_refused_and_file_unchanged() {
    let (_dir, store, cfg) = setup();
    let bytes = encode(&record(&cfg, "m", 7, 1)).unwrap();
    let path = store.path_of("m").unwrap();
    let mut cases: Vec<Vec<u8>> = Vec::new();
    for magic in [
        &b"K3ST\x01\0\0\0"[..],
        b"\x89K3SESS\r",
        &[0u8; 8],
        b"\x89K3SESs\n",
    ] {
        let mut b = bytes.clone();
        b[..8].copy_from_slice(magic);
        cases.push(b);
    }
    cases.push(b"{}".to_vec());
    cases.push(b"\x89K3X".to_vec());
    for b in cases {
        fs::write(&path, &b).unwrap();
        let before = sha(&path);
        let e = store.load("m", &cfg, &identity()).unwrap_err();
        assert!(matches!(refusal(&e), Refusal::BadMagic { .. }), "{e}");
        assert!(e.to_string().contains("not a k3 session file"), "{e}");
        assert_eq!(e.exit_code(), 3);
        assert_eq!(sha(&path), before);
    }
    let mut k3st = bytes.clone();
    k3st[..4].copy_from_slice(b"K3ST");
    let e = dec(&k3st, &cfg).unwrap_err();
    assert!(e.to_string().contains("raw engine state file"), "{e}");
    fs::write(&path, b"").unwrap();
    let e = store.load("m", &cfg, &identity()).unwrap_err();
    assert_eq!(
        refusal(&e),
        Refusal::Truncated {
            at: 0,
            of: HEADER_LEN
        }
    );
    assert!(fs::read(&path).unwrap().is_empty());
}

#[test]
fn every_truncation_is_refused() {
    let (_dir, store, cfg) = setup();
    let bytes = encode(&record(&cfg, "t", 7, 3)).unwrap();
    let secs = sections(&bytes);
    let (start, _, len) = secs[6];
    let limit = start + 16 + len + 4 + 64;
    let mut lens: Vec<usize> = (0..=limit).collect();
    let mut rng = Prng(99);
    for _ in 0..200 {
        lens.push(limit + rng.below((bytes.len() - limit) as u64) as usize);
    }
    let path = store.path_of("t").unwrap();
    for (i, &n) in lens.iter().enumerate() {
        // The file as the OS reports it.
        let e = decode(&mut &bytes[..n], n as u64, &cfg, &identity()).unwrap_err();
        match refusal(&e) {
            Refusal::Truncated { at, of } => {
                assert_eq!(at, n as u64);
                assert!(of > at);
            }
            r => panic!("length {n}: {r}"),
        }
        assert!(
            e.to_string()
                .contains(&format!("truncated at byte {n} of ")),
            "{e}"
        );
        // A stream that ends before the length it was announced with.
        let e = decode(&mut &bytes[..n], bytes.len() as u64, &cfg, &identity()).unwrap_err();
        assert!(
            matches!(refusal(&e), Refusal::Truncated { at, .. } if at == n as u64),
            "short stream {n}: {e}"
        );
        if i % 16 == 0 || n > limit {
            fs::write(&path, &bytes[..n]).unwrap();
            let before = sha(&path);
            let e = store.load("t", &cfg, &identity()).unwrap_err();
            assert!(matches!(refusal(&e), Refusal::Truncated { .. }), "{e}");
            assert_eq!(e.exit_code(), 3);
            assert_eq!(sha(&path), before);
        }
    }
}

#[test]
fn bit_flips_are_refused_and_name_the_section() {
    let (_dir, store, cfg) = setup();
    let rec = with_snapshots(record(&cfg, "f", 7, 4), &cfg, 4);
    let bytes = encode(&rec).unwrap();
    let secs = sections(&bytes);
    assert_eq!(secs.len(), 8 + cfg.num_hidden_layers + 4);
    let path = store.path_of("f").unwrap();
    for (k, &(start, _, len)) in secs.iter().enumerate() {
        let name = section_name(&cfg, k);
        let mut spots = vec![start + 16 + len / 2, start + 16 + len + 1];
        if len > 0 {
            spots.push(start + 16);
        }
        for at in spots {
            let mut b = bytes.clone();
            b[at] ^= 0x10;
            fs::write(&path, &b).unwrap();
            let before = sha(&path);
            let e = store.load("f", &cfg, &identity()).unwrap_err();
            assert_eq!(sha(&path), before);
            match refusal(&e) {
                Refusal::Checksum { section, .. } => assert_eq!(section, name, "byte {at}"),
                r => panic!("section {name} byte {at}: {r}"),
            }
            assert!(e.to_string().contains("checksum mismatch (stored "), "{e}");
            if k >= 3 {
                assert_eq!(e.transcript_json(), Some(&rec.transcript_json[..]));
            } else {
                assert!(e.transcript_json().is_none());
            }
        }
        // The section header itself: tag and length.
        for at in [start, start + 9] {
            let mut b = bytes.clone();
            b[at] ^= 0x01;
            assert!(dec(&b, &cfg).is_err(), "section {name} header byte {at}");
        }
    }
    for at in 0..HEADER_LEN as usize {
        for bit in [0, 7] {
            let mut b = bytes.clone();
            b[at] ^= 1 << bit;
            assert!(dec(&b, &cfg).is_err(), "header byte {at} bit {bit}");
        }
    }
    let mut rng = Prng(2024);
    for _ in 0..2000 {
        let at = rng.below(bytes.len() as u64) as usize;
        let mut b = bytes.clone();
        b[at] ^= 1 << rng.below(8);
        assert!(dec(&b, &cfg).is_err(), "flip at {at}");
    }
    for _ in 0..300 {
        let at = rng.below(bytes.len() as u64) as usize;
        let n = 1 + rng.below(64.min((bytes.len() - at) as u64)) as usize;
        let mut b = bytes.clone();
        for x in &mut b[at..at + n] {
            *x = rng.next() as u8;
        }
        if b != bytes {
            assert!(dec(&b, &cfg).is_err(), "overwrite {at}+{n}");
        }
    }
}

#[test]
fn arbitrary_bytes_are_refused_without_panicking() {
    let cfg = tiny();
    let valid = encode(&record(&cfg, "r", 2, 12)).unwrap();
    let mut rng = Prng(31337);
    for i in 0..3000 {
        let n = rng.below(400) as usize;
        let mut b: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
        match i % 3 {
            // Random bytes after a valid magic and version.
            0 if n >= 12 => b[..12].copy_from_slice(&valid[..12]),
            // A valid header followed by noise, with the size field matching.
            1 if n >= HEADER_LEN as usize => {
                b[..HEADER_LEN as usize].copy_from_slice(&valid[..HEADER_LEN as usize]);
                b[16..24].copy_from_slice(&(n as u64).to_le_bytes());
                fix_header_crc(&mut b);
            }
            _ => {}
        }
        assert!(dec(&b, &cfg).is_err(), "input {i}");
    }
}

#[test]
fn a_damaged_version_field_is_reported_as_damage() {
    let cfg = tiny();
    let mut b = encode(&record(&cfg, "v", 7, 4)).unwrap();
    b[8] ^= 0x02;
    let e = dec(&b, &cfg).unwrap_err();
    assert!(
        matches!(refusal(&e), Refusal::Checksum { ref section, .. } if section == "header"),
        "{e}"
    );
}

#[test]
fn lying_lengths_are_refused_before_allocating() {
    let cfg = tiny();
    let bytes = encode(&with_snapshots(record(&cfg, "l", 7, 5), &cfg, 5)).unwrap();
    let variants = |v: u64| {
        let mut out = vec![
            v.wrapping_add(1),
            v.wrapping_sub(1),
            v.wrapping_add(4),
            0,
            v.wrapping_mul(2),
            1 << 62,
            1 << 63,
            u64::MAX,
        ];
        out.retain(|&x| x != v);
        out
    };
    // Header fields: total size, section count, positions, layers, bytes per position.
    for at in [16usize, 24, 32, 40, 48] {
        let v = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
        for x in variants(v) {
            let mut b = bytes.clone();
            b[at..at + 8].copy_from_slice(&x.to_le_bytes());
            fix_header_crc(&mut b);
            let e = dec(&b, &cfg).unwrap_err();
            let r = refusal(&e);
            assert!(
                !matches!(r, Refusal::Checksum { .. }),
                "header byte {at} = {x}: {r}"
            );
        }
    }
    // Section length fields, with the section checksum recomputed over the original payload.
    for (k, &(start, _, len)) in sections(&bytes).iter().enumerate() {
        for x in variants(len as u64) {
            let mut b = bytes.clone();
            b[start + 8..start + 16].copy_from_slice(&x.to_le_bytes());
            let end = start + 16 + len;
            let crc = crc32fast::hash(&b[start..end]);
            b[end..end + 4].copy_from_slice(&crc.to_le_bytes());
            let e = dec(&b, &cfg).unwrap_err();
            let r = refusal(&e);
            let fixed_size = !matches!(k, 1..=3);
            if fixed_size || x > len as u64 + 1_000_000 {
                assert!(
                    matches!(r, Refusal::Length { .. }),
                    "section {k} length {x}: {r}"
                );
            }
        }
    }
    // The stored flags word.
    let mut b = bytes.clone();
    b[12] = 1;
    fix_header_crc(&mut b);
    assert!(matches!(
        refusal(&dec(&b, &cfg).unwrap_err()),
        Refusal::Malformed { at: 12, .. }
    ));
}

#[test]
fn a_different_config_refuses_the_state_but_offers_the_transcript() {
    let cfg = tiny();
    let rec = record(&cfg, "c", 7, 6);
    let bytes = encode(&rec).unwrap();
    let mut variants = Vec::new();
    let mut c = cfg.clone();
    c.is_mla.swap(0, 3);
    variants.push(("layer map", c));
    let mut c = cfg.clone();
    c.kv_lora_rank += 1;
    variants.push(("MLA width", c));
    let mut c = cfg.clone();
    c.kda_head_dim = 8;
    variants.push(("KDA head dim", c));
    let mut c = cfg.clone();
    c.short_conv_kernel_size = 3;
    variants.push(("conv taps", c));
    let mut c = cfg.clone();
    c.num_hidden_layers += 1;
    c.is_mla.push(false);
    variants.push(("layer count", c));
    for (what, c) in variants {
        let e = dec(&bytes, &c).unwrap_err();
        assert!(matches!(refusal(&e), Refusal::Layout { .. }), "{what}: {e}");
        assert_eq!(
            e.transcript_json(),
            Some(&rec.transcript_json[..]),
            "{what}"
        );
        assert_eq!(e.exit_code(), 3);
        assert!(e.to_string().contains("re-prefilled"), "{e}");
    }
    let mut c = cfg.clone();
    c.vocab_size = 1;
    let e = dec(&bytes, &c).unwrap_err();
    assert!(
        matches!(refusal(&e), Refusal::Malformed { ref what, .. } if what.contains("vocabulary")),
        "{e}"
    );
}

#[test]
fn another_models_session_is_refused_with_both_identities() {
    let (_dir, store, cfg) = setup();
    let rec = record(&cfg, "other", 7, 7);
    store.save(&rec).unwrap();
    let path = store.path_of("other").unwrap();
    let before = sha(&path);
    let current =
        ModelIdentity::compute(b"{\"tiny\":2}", &[b"ranks", b"tokenizer_config"], b"index");
    let e = store.load("other", &cfg, &current).unwrap_err();
    assert!(matches!(refusal(&e), Refusal::Identity { .. }), "{e}");
    let text = e.to_string();
    assert!(text.contains(&identity().short()), "{text}");
    assert!(text.contains(&current.short()), "{text}");
    assert!(
        text.contains("restoring would produce fluent, wrong output"),
        "{text}"
    );
    assert_eq!(e.transcript_json(), Some(&rec.transcript_json[..]));
    assert_eq!(e.exit_code(), 3);
    assert_eq!(sha(&path), before);
}

#[test]
fn other_format_versions_are_refused() {
    let (_dir, store, cfg) = setup();
    let bytes = encode(&record(&cfg, "ver", 7, 8)).unwrap();
    let path = store.path_of("ver").unwrap();
    for v in [0u32, 3, 4, u32::MAX] {
        let mut b = bytes.clone();
        b[8..12].copy_from_slice(&v.to_le_bytes());
        fix_header_crc(&mut b);
        fs::write(&path, &b).unwrap();
        let before = sha(&path);
        let e = store.load("ver", &cfg, &identity()).unwrap_err();
        assert_eq!(refusal(&e), Refusal::Version { found: v });
        assert!(
            e.to_string().contains(&format!(
                "written by format v{v}, this build reads v1 to v2"
            )),
            "{e}"
        );
        assert_eq!(e.exit_code(), 3);
        assert_eq!(sha(&path), before);
    }
}

#[test]
fn trailing_bytes_are_refused() {
    let cfg = tiny();
    let bytes = encode(&record(&cfg, "tr", 7, 9)).unwrap();
    let mut longer = bytes.clone();
    longer.push(0);
    let e = dec(&longer, &cfg).unwrap_err();
    assert_eq!(
        refusal(&e),
        Refusal::Trailing {
            declared: bytes.len() as u64,
            actual: longer.len() as u64
        }
    );
    // A stream with more bytes than announced.
    let e = decode(&mut &longer[..], bytes.len() as u64, &cfg, &identity()).unwrap_err();
    assert!(matches!(refusal(&e), Refusal::Trailing { .. }), "{e}");
}

#[test]
fn inconsistent_records_are_not_written() {
    let (_dir, store, cfg) = setup();
    let good = record(&cfg, "bad", 7, 10);
    let mut cases = Vec::new();
    let mut r = good.clone();
    r.tokens.pop();
    cases.push(r);
    let mut r = good.clone();
    r.rng_state = 0;
    cases.push(r);
    let mut r = good.clone();
    r.summary.mode = "x".repeat(MAX_MODE_LEN + 1);
    cases.push(r);
    let mut r = good.clone();
    r.summary.mode = "chat\u{1b}[2J".into();
    cases.push(r);
    let mut r = good.clone();
    r.transcript_json = vec![0xff, 0xfe];
    cases.push(r);
    let mut r = good.clone();
    r.sampler.top_p = 0.0;
    cases.push(r);
    let mut r = good.clone();
    if let Some(LayerState::Mla(c)) = r.state.layers.get_mut(3) {
        c.pop();
    }
    cases.push(r);
    for r in cases {
        assert!(encode(&r).is_err());
        let e = store.save(&r).unwrap_err();
        assert!(matches!(e, SaveError::Record { .. }), "{e}");
        assert_eq!(e.exit_code(), 5);
        assert!(!store.path_of("bad").unwrap().exists());
    }
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    None,
    Fail {
        at: usize,
        errno: i32,
        persistent: bool,
    },
    Crash {
        at: usize,
    },
    CrashAtByte(u64),
}

/// Real file operations that fail, or stop for good ("crash"), at a chosen point.
struct FaultIo {
    fault: Fault,
    ops: usize,
    bytes: u64,
    dead: bool,
    renamed: bool,
    log: Vec<&'static str>,
}

impl FaultIo {
    fn new(fault: Fault) -> Self {
        FaultIo {
            fault,
            ops: 0,
            bytes: 0,
            dead: false,
            renamed: false,
            log: Vec::new(),
        }
    }

    fn step(&mut self, what: &'static str) -> io::Result<()> {
        if self.dead {
            return Err(io::Error::other("crashed"));
        }
        let k = self.ops;
        self.ops += 1;
        self.log.push(what);
        match self.fault {
            Fault::Fail {
                at,
                errno,
                persistent,
            } if k == at || (persistent && k > at) => Err(io::Error::from_raw_os_error(errno)),
            Fault::Crash { at } if k == at => {
                self.dead = true;
                Err(io::Error::other("crashed"))
            }
            _ => Ok(()),
        }
    }
}

impl SaveIo for FaultIo {
    type File = File;

    fn create_temp(&mut self, dir: &Path, prefix: &str) -> io::Result<(PathBuf, File)> {
        self.step("create")?;
        OsIo.create_temp(dir, prefix)
    }

    fn write(&mut self, file: &mut File, buf: &[u8]) -> io::Result<()> {
        self.step("write")?;
        if let Fault::CrashAtByte(off) = self.fault {
            if self.bytes + buf.len() as u64 > off {
                file.write_all(&buf[..(off - self.bytes) as usize])?;
                self.dead = true;
                return Err(io::Error::other("crashed"));
            }
        }
        file.write_all(buf)?;
        self.bytes += buf.len() as u64;
        Ok(())
    }

    fn sync(&mut self, file: &mut File) -> io::Result<()> {
        self.step("sync")?;
        file.sync_all()
    }

    fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()> {
        self.step("rename")?;
        fs::rename(from, to)?;
        self.renamed = true;
        Ok(())
    }

    fn sync_dir(&mut self, dir: &Path) -> io::Result<()> {
        self.step("sync_dir")?;
        OsIo.sync_dir(dir)
    }

    fn remove(&mut self, path: &Path) -> io::Result<()> {
        self.step("remove")?;
        fs::remove_file(path)
    }
}

#[test]
fn failed_or_interrupted_saves_leave_the_old_or_the_new_session() {
    let (_dir, store, cfg) = setup();
    let old = record(&cfg, "run", 7, 1);
    let new = record(&cfg, "run", 150, 2);
    store.save(&old).unwrap();
    let mut probe = FaultIo::new(Fault::None);
    store.save_with(&new, &mut probe).unwrap();
    let n_ops = probe.ops;
    assert_eq!(probe.log.first(), Some(&"create"));
    assert_eq!(&probe.log[n_ops - 3..], &["sync", "rename", "sync_dir"]);
    let mut cases = Vec::new();
    for at in 0..n_ops {
        for errno in [28, 5] {
            for persistent in [false, true] {
                cases.push(Fault::Fail {
                    at,
                    errno,
                    persistent,
                });
            }
        }
        cases.push(Fault::Crash { at });
    }
    let total = new.encoded_len().unwrap();
    let mut rng = Prng(77);
    for _ in 0..200 {
        cases.push(Fault::CrashAtByte(rng.below(total)));
    }
    let (mut olds, mut news, mut removed_total) = (0, 0, 0);
    for fault in cases {
        store.save(&old).unwrap();
        let mut io = FaultIo::new(fault);
        let e = store.save_with(&new, &mut io).unwrap_err();
        assert_eq!(e.exit_code(), 5);
        let text = e.to_string();
        assert!(text.contains("NOT saved"), "{text}");
        if let Fault::Fail { errno: 28, .. } = fault {
            assert!(text.contains("disk full (need "), "{text}");
        }
        let loaded = store
            .load("run", &cfg, &identity())
            .unwrap_or_else(|e| panic!("{fault:?}: {e}"));
        if io.renamed {
            assert!(same(&loaded, &new), "{fault:?}: expected the new session");
            news += 1;
        } else {
            assert!(same(&loaded, &old), "{fault:?}: expected the old session");
            assert!(
                text.contains("the previous session file is intact"),
                "{text}"
            );
            olds += 1;
        }
        if let Fault::Fail {
            persistent: false, ..
        } = fault
        {
            assert!(temps(&store).is_empty(), "{fault:?}: temp file left");
        }
        let removed = store.remove_stale_temps().unwrap();
        assert!(removed <= 1);
        if let Fault::CrashAtByte(_) = fault {
            assert_eq!(
                removed, 1,
                "{fault:?}: the partial file should be left behind"
            );
        }
        removed_total += removed;
        assert!(temps(&store).is_empty(), "{fault:?}: temp file left");
    }
    assert!(olds > 200 && news > 0, "old {olds}, new {news}");
    eprintln!(
        "{n_ops} save steps; {olds} faults left the old session, {news} the new; \
             {removed_total} stale temporary files removed"
    );
}

#[test]
#[cfg(unix)]
fn a_link_at_the_target_is_replaced_not_followed() {
    let (dir, store, cfg) = setup();
    let sentinel = dir.path().join("sentinel.txt");
    fs::write(&sentinel, b"outside the session directory").unwrap();
    let before = sha(&sentinel);
    let target = store.path_of("victim").unwrap();
    std::os::unix::fs::symlink(&sentinel, &target).unwrap();
    let e = store.load("victim", &cfg, &identity()).unwrap_err();
    assert!(matches!(e, LoadError::NotRegular { .. }), "{e}");
    let rec = record(&cfg, "victim", 7, 3);
    store.save(&rec).unwrap();
    assert_eq!(sha(&sentinel), before);
    assert!(fs::symlink_metadata(&target).unwrap().file_type().is_file());
    assert!(same(
        &store.load("victim", &cfg, &identity()).unwrap(),
        &rec
    ));
    // A link planted at the lock file is not written through either.
    std::os::unix::fs::symlink(&sentinel, store.dir().join(".victim2.lock")).unwrap();
    let mut rec2 = rec.clone();
    rec2.name = "victim2".into();
    let e = store.save(&rec2).unwrap_err();
    assert!(
        matches!(
            e,
            SaveError::Io {
                step: SaveStep::Lock,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(sha(&sentinel), before);
}

#[test]
fn bad_names_are_refused() {
    let (_dir, store, cfg) = setup();
    let long = "a".repeat(65);
    for name in [
        "",
        "a/b",
        "/etc/passwd",
        "..",
        "../x",
        "a..b",
        ".hidden",
        "a\0b",
        "a b",
        "é",
        "a\u{1b}[31m",
        "a\\b",
        &long,
    ] {
        assert!(validate_name(name).is_err(), "{name:?}");
        let mut rec = record(&cfg, "x", 1, 1);
        rec.name = name.to_string();
        let e = store.save(&rec).unwrap_err();
        assert!(matches!(e, SaveError::BadName(_)), "{name:?}: {e}");
        assert_eq!(e.exit_code(), 2);
        assert!(!e.to_string().contains('\u{1b}'));
        let e = store.load(name, &cfg, &identity()).unwrap_err();
        assert!(matches!(e, LoadError::BadName(_)), "{name:?}: {e}");
    }
    assert!(fs::read_dir(store.dir()).unwrap().next().is_none());
    for name in ["a", "my-session_1.v2", &"z".repeat(64)] {
        assert!(validate_name(name).is_ok(), "{name:?}");
    }
    let e = store.load("absent", &cfg, &identity()).unwrap_err();
    assert!(matches!(e, LoadError::NotFound { .. }), "{e}");
    assert_eq!(e.exit_code(), 2);
}

/// Runs a second save of the same session while the first holds the lock.
struct NestedSave<'a> {
    store: &'a SessionStore,
    other: &'a SessionRecord,
    result: Option<Result<u64, SaveError>>,
}

impl SaveIo for NestedSave<'_> {
    type File = File;

    fn create_temp(&mut self, dir: &Path, prefix: &str) -> io::Result<(PathBuf, File)> {
        self.result = Some(self.store.save(self.other));
        OsIo.create_temp(dir, prefix)
    }

    fn write(&mut self, file: &mut File, buf: &[u8]) -> io::Result<()> {
        OsIo.write(file, buf)
    }

    fn sync(&mut self, file: &mut File) -> io::Result<()> {
        OsIo.sync(file)
    }

    fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()> {
        OsIo.rename(from, to)
    }

    fn sync_dir(&mut self, dir: &Path) -> io::Result<()> {
        OsIo.sync_dir(dir)
    }

    fn remove(&mut self, path: &Path) -> io::Result<()> {
        OsIo.remove(path)
    }
}

#[test]
fn a_second_writer_gets_session_in_use() {
    let (_dir, store, cfg) = setup();
    let first = record(&cfg, "shared", 7, 1);
    let second = record(&cfg, "shared", 8, 2);
    let mut io = NestedSave {
        store: &store,
        other: &second,
        result: None,
    };
    store.save_with(&first, &mut io).unwrap();
    let e = io.result.unwrap().unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, SaveError::InUse { .. }), "{text}");
    assert!(text.contains("session in use by pid "), "{text}");
    assert!(text.contains(&std::process::id().to_string()), "{text}");
    assert_eq!(e.exit_code(), 5);
    assert!(same(
        &store.load("shared", &cfg, &identity()).unwrap(),
        &first
    ));
}

#[test]
fn a_held_session_lock_refuses_every_other_claim_until_dropped() {
    let (_dir, store, cfg) = setup();
    let first = record(&cfg, "held", 7, 1);
    let lock = store.lock("held").unwrap();
    assert_eq!(lock.name(), "held");
    // Saves through the claim go through; everyone else is refused with the holder's pid.
    store.save_locked(&first, &lock).unwrap();
    let e = store.lock("held").unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, LockError::InUse { .. }), "{text}");
    assert!(
        text.contains(&format!("pid {}", std::process::id())),
        "{text}"
    );
    assert_eq!(e.exit_code(), 2);
    let e = store.save(&record(&cfg, "held", 8, 2)).unwrap_err();
    assert!(matches!(e, SaveError::InUse { .. }), "{e}");
    // A claim on another name does not cover this one.
    let other = store.lock("other").unwrap();
    let e = store
        .save_locked(&record(&cfg, "held", 8, 2), &other)
        .unwrap_err();
    assert!(matches!(e, SaveError::InUse { .. }), "{e}");
    assert!(same(
        &store.load("held", &cfg, &identity()).unwrap(),
        &first
    ));
    drop(lock);
    let again = store.lock("held").unwrap();
    assert!(again.is_held());
    assert!(store.exists("held") && !store.exists("other"));
    let bad = store.lock("../x").unwrap_err();
    assert_eq!(bad.exit_code(), 2);
}

#[test]
fn new_names_skip_saved_and_locked_sessions() {
    let (_dir, store, cfg) = setup();
    store.save(&record(&cfg, "talk", 3, 1)).unwrap();
    let held = store.lock("talk-2").unwrap();
    let first = store.claim_new("talk").unwrap().unwrap();
    assert_eq!(first.name(), "talk-3");
    let second = store.claim_new("talk").unwrap().unwrap();
    assert_eq!(second.name(), "talk-4");
    drop((held, first));
    let third = store.claim_new("talk").unwrap().unwrap();
    assert_eq!(third.name(), "talk-2");
    assert!(store.claim_new("../up").is_err());
}

#[test]
fn racing_writers_and_readers_see_only_whole_sessions() {
    let (_dir, store, cfg) = setup();
    let store = Arc::new(store);
    let cfg = Arc::new(cfg);
    let records: Arc<Vec<SessionRecord>> = Arc::new(
        (0..4u64)
            .flat_map(|t| (0..8u64).map(move |i| (t, i)))
            .map(|(t, i)| record(&cfg, "race", 5 + (i as usize % 3), 100 * t + i))
            .collect(),
    );
    store.save(&records[0]).unwrap();
    let barrier = Arc::new(Barrier::new(5));
    let mut handles = Vec::new();
    for t in 0..4usize {
        let (store, records, barrier) = (store.clone(), records.clone(), barrier.clone());
        handles.push(std::thread::spawn(move || {
            barrier.wait();
            let mut wins = 0;
            for rec in &records[t * 8..t * 8 + 8] {
                match store.save(rec) {
                    Ok(_) => wins += 1,
                    Err(SaveError::InUse { .. }) => {}
                    Err(e) => panic!("{e}"),
                }
            }
            wins
        }));
    }
    let reader = {
        let (store, records, cfg, barrier) =
            (store.clone(), records.clone(), cfg.clone(), barrier.clone());
        std::thread::spawn(move || {
            barrier.wait();
            for _ in 0..100 {
                let got = store.load("race", &cfg, &identity()).unwrap();
                assert!(records.iter().any(|r| same(r, &got)));
            }
        })
    };
    let wins: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    reader.join().unwrap();
    assert!(wins >= 1);
    let last = store.load("race", &cfg, &identity()).unwrap();
    assert!(records.iter().any(|r| same(r, &last)));
    assert!(temps(&store).is_empty());
}

#[test]
fn list_reports_size_per_position() {
    let (_dir, store, cfg) = setup();
    store.save(&record(&cfg, "a", 7, 1)).unwrap();
    store.save(&record(&cfg, "b", 8, 2)).unwrap();
    store.save(&record(&cfg, "c", 0, 3)).unwrap();
    fs::write(store.dir().join("junk.k3session"), b"not a session").unwrap();
    fs::write(store.dir().join(".a.k3session.tmp.1.1"), b"partial").unwrap();
    let list = store.list().unwrap();
    let names: Vec<&str> = list.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names.len(), 4, "{names:?}");
    let get = |n: &str| list.iter().find(|i| i.name == n).unwrap();
    let (a, b, c) = (get("a"), get("b"), get("c"));
    let width = SeqState::mla_floats_per_position(&cfg) as u64;
    let n_mla = cfg.is_mla.iter().filter(|&&m| m).count() as u64;
    let per_position = 4 + 4 * n_mla * width;
    assert_eq!(per_position, 644);
    assert_eq!(a.bytes_per_position, per_position);
    assert_eq!(b.bytes - a.bytes, per_position);
    assert_eq!(a.bytes - c.bytes, 7 * per_position);
    assert_eq!((a.positions, b.positions, c.positions), (7, 8, 0));
    assert_eq!(c.bytes_per_position, 0);
    assert_eq!(a.turns, 3);
    assert_eq!(a.mode, "chat");
    assert_eq!(a.identity, Some(identity()));
    assert_eq!(
        a.bytes,
        fs::metadata(store.path_of("a").unwrap()).unwrap().len()
    );
    assert!(a.problem.is_none());
    assert_eq!(b.saved_unix, 1_700_000_102);
    assert!(get("junk")
        .problem
        .as_deref()
        .unwrap()
        .contains("not a k3 session"));
    eprintln!(
        "tiny config: {} bytes at 0 positions, {} at 7, {} bytes per position",
        c.bytes, a.bytes, a.bytes_per_position
    );
}

#[test]
fn stale_temps_are_removed_unless_their_session_is_locked() {
    let (_dir, store, _cfg) = setup();
    let d = store.dir().to_path_buf();
    for f in [
        ".x.k3session.tmp.123.4",
        ".y.k3session.tmp.1.2",
        ".z.k3session.tmp.9.9",
        ".hidden",
        "foo.tmp",
        ".x.k3session.tmp.abc.1",
    ] {
        fs::write(d.join(f), b"partial").unwrap();
    }
    let held = acquire_lock(&store.lock_path("z")).unwrap();
    assert!(matches!(held, Lock::Held(_)));
    assert_eq!(store.remove_stale_temps().unwrap(), 2);
    assert!(d.join(".z.k3session.tmp.9.9").exists());
    assert!(d.join(".hidden").exists());
    assert!(d.join("foo.tmp").exists());
    assert!(d.join(".x.k3session.tmp.abc.1").exists());
    drop(held);
    assert_eq!(store.remove_stale_temps().unwrap(), 1);
    assert_eq!(
        SessionStore::new(d.join("missing"))
            .remove_stale_temps()
            .unwrap(),
        0
    );
}

#[test]
fn default_dir_honours_the_environment_override() {
    assert_eq!(
        sessions_dir_from(Some("/data/k3".into())),
        PathBuf::from("/data/k3/sessions")
    );
    let platform = sessions_dir_from(None);
    assert!(platform.ends_with("sessions"));
    assert_eq!(sessions_dir_from(Some(OsString::new())), platform);
}

#[test]
fn identity_is_length_prefixed() {
    let a = ModelIdentity::compute(b"ab", &[b"c"], b"");
    assert_ne!(a, ModelIdentity::compute(b"a", &[b"bc"], b""));
    assert_ne!(a, ModelIdentity::compute(b"ab", &[b"c", b""], b""));
    assert_ne!(a, ModelIdentity::compute(b"ab", &[], b"c"));
    assert_eq!(a, ModelIdentity::compute(b"ab", &[b"c"], b""));
    assert_eq!(a.short().len(), 12);
    assert!(a.to_hex().starts_with(&a.short()));
}
