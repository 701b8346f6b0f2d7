//! Tests of the tokenizer: oracle cases and round trips, special tokens, input chunking, streamed
//! UTF-8 decoding, and a refusal with its line for each way a rank file or configuration breaks.

use super::*;
use std::fs;
use std::path::PathBuf;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

#[derive(Deserialize)]
struct Case {
    name: String,
    text: String,
    allow_special: bool,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct CaseFile {
    cases: Vec<Case>,
    #[serde(default)]
    num_base_tokens: Option<u32>,
}

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(format!("{FIXTURES}/{rel}"))
}

fn tiny() -> Tokenizer {
    Tokenizer::load(&fixture("tiny")).expect("tiny fixture loads")
}

fn merges() -> Tokenizer {
    Tokenizer::load(&fixture("tokenizer/merges")).expect("merges fixture loads")
}

fn read_cases(rel: &str) -> CaseFile {
    let text = fs::read_to_string(fixture(rel)).expect("case file readable");
    serde_json::from_str(&text).expect("case file is valid JSON")
}

fn tiny_rank_lines() -> Vec<String> {
    fs::read_to_string(fixture("tiny/tiktoken.model"))
        .expect("tiny rank file readable")
        .lines()
        .map(str::to_owned)
        .collect()
}

fn tiny_config_text() -> String {
    fs::read_to_string(fixture("tiny/tokenizer_config.json")).expect("tiny config readable")
}

fn join_lines(lines: &[String]) -> Vec<u8> {
    let mut out = lines.join("\n").into_bytes();
    out.push(b'\n');
    out
}

fn write_dir(rank_file: &[u8], config: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    fs::write(dir.path().join(RANK_FILE), rank_file).expect("write rank file");
    fs::write(dir.path().join(CONFIG_FILE), config).expect("write config");
    dir
}

fn refuse_ranks(rank_file: &[u8]) -> TokenizerError {
    let dir = write_dir(rank_file, &tiny_config_text());
    Tokenizer::load(dir.path()).expect_err("rank file must be refused")
}

fn refuse_mutated_line(line_no: usize, replacement: &str) -> TokenizerError {
    let mut lines = tiny_rank_lines();
    lines[line_no - 1] = replacement.to_owned();
    refuse_ranks(&join_lines(&lines))
}

fn assert_names_line(err: &TokenizerError, line: usize) {
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("line {line}:")),
        "message lacks line {line}: {msg}"
    );
    assert!(msg.contains(RANK_FILE), "message lacks file name: {msg}");
}

fn config_with_specials(
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> String {
    let mut config: serde_json::Value =
        serde_json::from_str(&tiny_config_text()).expect("tiny config is JSON");
    let decoder = config
        .get_mut("added_tokens_decoder")
        .and_then(serde_json::Value::as_object_mut)
        .expect("added_tokens_decoder object");
    edit(decoder);
    serde_json::to_string_pretty(&config).expect("serialize config")
}

fn special_entry(content: &str, special: bool) -> serde_json::Value {
    serde_json::json!({
        "content": content,
        "lstrip": false,
        "normalized": false,
        "rstrip": false,
        "single_word": false,
        "special": special
    })
}

fn refuse_config(config: &str) -> TokenizerError {
    let rank_file = fs::read(fixture("tiny/tiktoken.model")).expect("tiny rank file");
    let dir = write_dir(&rank_file, config);
    Tokenizer::load(dir.path()).expect_err("config must be refused")
}

fn load_with_config(config: &str) -> Tokenizer {
    let rank_file = fs::read(fixture("tiny/tiktoken.model")).expect("tiny rank file");
    let dir = write_dir(&rank_file, config);
    Tokenizer::load(dir.path()).expect("config accepted")
}

fn byte_ids(tok: &Tokenizer, text: &str) -> Vec<u32> {
    text.bytes()
        .map(|b| {
            *tok.bpe_rank_of(&[b])
                .as_ref()
                .expect("every byte has a rank")
        })
        .collect()
}

impl Tokenizer {
    fn bpe_rank_of(&self, bytes: &[u8]) -> Option<u32> {
        (0..self.n_base).find(|&id| self.token_bytes(id) == Some(bytes))
    }

    fn encode_pieces_unchunked(&self, pieces: &[&str]) -> Vec<u32> {
        pieces
            .iter()
            .flat_map(|p| self.bpe.encode_ordinary(p))
            .collect()
    }
}

/// Straightforward transcription of the chunking rule, for comparison.
fn reference_chunks(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    for slice in chars.chunks(MAX_ENCODE_CHARS) {
        let mut run_len = 0;
        let mut run_space = slice.first().is_some_and(|&c| is_python_space(c));
        let mut start = 0;
        for (i, &c) in slice.iter().enumerate() {
            let now_space = is_python_space(c);
            if run_space != now_space {
                run_len = 1;
                run_space = now_space;
            } else {
                run_len += 1;
                if run_len > MAX_SAME_CLASS_RUN {
                    out.push(slice[start..i].iter().collect());
                    start = i;
                    run_len = 1;
                }
            }
        }
        out.push(slice[start..].iter().collect());
    }
    out
}

#[test]
fn tokenizer_and_stream_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Tokenizer>();
    check::<Utf8Stream>();
    check::<TokenizerError>();
}

// ---- fixtures against stored ids -------------------------------------

#[test]
fn tiny_oracle_cases_match() {
    let tok = tiny();
    let file = read_cases("tokenizer/tiny_cases.json");
    assert_eq!(file.cases.len(), 7);
    for case in &file.cases {
        assert_eq!(
            tok.encode(&case.text, case.allow_special),
            case.ids,
            "case {}",
            case.name
        );
        let decoded = tok.decode_bytes(&case.ids).expect("decodes");
        assert_eq!(
            decoded,
            case.text.as_bytes(),
            "round trip of case {}",
            case.name
        );
    }
}

#[test]
fn merges_fixture_matches_python_tiktoken() {
    let tok = merges();
    let file = read_cases("tokenizer/merges/expected.json");
    assert_eq!(Some(tok.n_base()), file.num_base_tokens);
    assert!(file.cases.len() >= 40);
    let mut merged = 0;
    for case in &file.cases {
        let ids = tok.encode(&case.text, case.allow_special);
        assert_eq!(ids, case.ids, "case {} ({:?})", case.name, case.text);
        assert_eq!(
            tok.decode_bytes(&ids).expect("decodes"),
            case.text.as_bytes(),
            "round trip of case {}",
            case.name
        );
        if ids.len() < case.text.len() {
            merged += 1;
        }
    }
    assert!(merged >= 30, "fixture should exercise merges, got {merged}");
}

#[test]
fn pattern_is_the_one_in_the_fixtures() {
    let tiny_cases: serde_json::Value = serde_json::from_str(
        &fs::read_to_string(fixture("tokenizer/tiny_cases.json")).expect("readable"),
    )
    .expect("JSON");
    assert_eq!(tiny_cases["pat_str"].as_str(), Some(PAT_STR));
    let merges_cases: serde_json::Value = serde_json::from_str(
        &fs::read_to_string(fixture("tokenizer/merges/expected.json")).expect("readable"),
    )
    .expect("JSON");
    assert_eq!(merges_cases["pat_str"].as_str(), Some(PAT_STR));
}

// ---- vocabulary layout and specials ----------------------------------

#[test]
fn tiny_layout() {
    let tok = tiny();
    assert_eq!(tok.n_base(), 256);
    assert_eq!(tok.vocab_size(), 512);
    assert_eq!(tok.special_tokens().len(), 256);
    assert!(!tok.is_special(255));
    assert!(tok.is_special(256));
    assert!(tok.is_special(511));
    assert!(!tok.is_special(512));
    assert_eq!(tok.token_bytes(512), None);
    assert_eq!(tok.token_bytes(220), Some(&b" "[..]));
    assert_eq!(tok.token_bytes(0), Some(&b"!"[..]));
    assert_eq!(tok.token_bytes(259), Some(&b"<|open|>"[..]));
    assert_eq!(tok.special_tokens().iter().filter(|s| s.named).count(), 16);
    let debug = format!("{tok:?}");
    assert!(debug.contains("vocab_size: 512"), "{debug}");
}

#[test]
fn tiny_named_special_ids() {
    let tok = tiny();
    let expected = [
        (256, "[BOS]", true),
        (257, "[EOS]", true),
        (258, "<|end_of_msg|>", true),
        (259, "<|open|>", false),
        (260, "<|close|>", false),
        (261, "<|sep|>", false),
        (262, "[start_header_id]", true),
        (263, "[end_header_id]", true),
        (265, "[EOT]", true),
        (274, "<|media_begin|>", true),
        (275, "<|media_content|>", true),
        (276, "<|media_end|>", true),
        (277, "<|media_pad|>", true),
        (321, "<osagent_mode>", true),
        (510, "[UNK]", true),
        (511, "[PAD]", true),
    ];
    for (id, name, special) in expected {
        assert_eq!(tok.special_id(name), Some(id), "{name}");
        let slot = tok.special_token(id).expect("special slot");
        assert_eq!(slot.name, name);
        assert_eq!(slot.special, special, "{name}");
        assert!(slot.named);
        assert_eq!(tok.encode(name, true), vec![id], "{name}");
    }
    let reserved = tok.special_token(264).expect("slot 264");
    assert_eq!(reserved.name, "<|reserved_token_264|>");
    assert!(reserved.special && !reserved.named);
}

#[test]
fn open_marker_is_plain_text_without_allow_special() {
    let tok = tiny();
    let ids = tok.encode("<|open|>", false);
    assert_eq!(ids, byte_ids(&tok, "<|open|>"));
    assert!(ids.iter().all(|&id| !tok.is_special(id)));
    assert_eq!(tok.encode("<|open|>", true), vec![259]);
}

#[test]
fn reserved_token_300_maps_to_300() {
    let tok = tiny();
    assert_eq!(tok.special_id("<|reserved_token_300|>"), Some(300));
    assert_eq!(tok.encode("<|reserved_token_300|>", true), vec![300]);
    assert_eq!(
        tok.decode_bytes(&[300]).expect("decodes"),
        b"<|reserved_token_300|>"
    );
    assert_eq!(tok.special_id("<|reserved_token_511|>"), None);
    assert_eq!(tok.special_id("<|reserved_token_512|>"), None);
}

#[test]
fn specials_are_matched_longest_first() {
    let config = config_with_specials(|d| {
        d.insert("300".into(), special_entry("<|x|>", true));
        d.insert("301".into(), special_entry("<|x|>y", true));
    });
    let tok = load_with_config(&config);
    assert_eq!(tok.encode("<|x|>y", true), vec![301]);
    let mut expected = vec![300];
    expected.extend(byte_ids(&tok, "z"));
    assert_eq!(tok.encode("<|x|>z", true), expected);
}

#[test]
fn non_ascii_special_names_work_both_ways() {
    let config = config_with_specials(|d| {
        d.insert("300".into(), special_entry("é<|e|>", false));
    });
    let tok = load_with_config(&config);
    let mut expected = byte_ids(&tok, "aé");
    expected.push(300);
    expected.extend(byte_ids(&tok, "é"));
    assert_eq!(tok.encode("aéé<|e|>é", true), expected);
    assert_eq!(tok.encode("é<|e|>", false), byte_ids(&tok, "é<|e|>"));
}

// ---- decoding ----------------------------------------------------------

#[test]
fn decode_rejects_unknown_ids() {
    let tok = tiny();
    let err = tok.decode_bytes(&[39, 512]).expect_err("512 is outside");
    assert!(matches!(
        err,
        TokenizerError::UnknownId {
            id: 512,
            vocab_size: 512
        }
    ));
    assert!(err.to_string().contains("512"));
    assert!(tok.decode_lossy(&[u32::MAX]).is_err());
    assert!(tok.decode_bytes_skip_special(&[600]).is_err());
}

#[test]
fn decode_lossy_replaces_partial_sequences() {
    let tok = tiny();
    let ids = tok.encode("你好", false);
    assert_eq!(ids.len(), 6);
    assert_eq!(tok.decode_lossy(&ids).expect("decodes"), "你好");
    assert_eq!(tok.decode_lossy(&ids[..4]).expect("decodes"), "你\u{FFFD}");
}

#[test]
fn skip_special_decoding_follows_the_flag() {
    let tok = tiny();
    let ids = tok.encode(
        "<|open|>hi<|sep|>[EOS]<|end_of_msg|><|reserved_token_300|>",
        true,
    );
    let kept = tok.decode_bytes_skip_special(&ids).expect("decodes");
    assert_eq!(kept, b"<|open|>hi<|sep|>");
}

// ---- round trips ---------------------------------------------------------

fn roundtrip_texts() -> Vec<String> {
    let mut texts: Vec<String> = [
        "",
        "The capital of France is Paris.",
        "plain ASCII with punctuation!? (yes) [no] {maybe} <tag/> a+b=c",
        "中文和English混合，还有标点。",
        "日本語のテキスト、한국어 문장, Привет мир, مرحبا, Γειά σου",
        "emoji 😀🚀 and ZWJ 👩‍💻 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽",
        "accents: Café naïve e\u{301} a\u{308} Ångström",
        "whitespace  \t\t  \n\n\r\n \u{a0}\u{3000}\u{2009}\u{1c}\u{1f} end   ",
        "\u{0}\u{1}\u{7f}\u{85}\u{feff}\u{10ffff}",
        "<|open|>[EOS]<|reserved_token_300|> specials as text",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    texts.push(" ".repeat(30_000));
    texts.push(format!("x{}y", "\n".repeat(25_001)));
    texts.push("a".repeat(60_001));
    texts.push("中".repeat(26_000));
    texts.push(format!("{}!{}", "Ab".repeat(13_000), "\t ".repeat(13_000)));
    texts
}

#[test]
fn round_trips_are_byte_exact() {
    for tok in [tiny(), merges()] {
        for text in roundtrip_texts() {
            for allow_special in [false, true] {
                let ids = tok.encode(&text, allow_special);
                let back = tok.decode_bytes(&ids).expect("decodes");
                assert!(
                    back == text.as_bytes(),
                    "round trip failed for {:?}",
                    excerpt_str(&text)
                );
                assert_eq!(tok.decode_lossy(&ids).expect("decodes"), text);
            }
        }
    }
}

// ---- chunking ------------------------------------------------------------

fn lens(pieces: &[&str]) -> Vec<usize> {
    pieces.iter().map(|p| p.chars().count()).collect()
}

#[test]
fn python_isspace_table() {
    let expected: Vec<u32> = vec![
        0x9, 0xa, 0xb, 0xc, 0xd, 0x1c, 0x1d, 0x1e, 0x1f, 0x20, 0x85, 0xa0, 0x1680, 0x2000, 0x2001,
        0x2002, 0x2003, 0x2004, 0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200a, 0x2028, 0x2029,
        0x202f, 0x205f, 0x3000,
    ];
    let found: Vec<u32> = (0..=0x10ffff_u32)
        .filter_map(char::from_u32)
        .filter(|&c| is_python_space(c))
        .map(u32::from)
        .collect();
    assert_eq!(found, expected);
}

#[test]
fn chunking_splits_long_same_class_runs() {
    assert!(chunk_text("").is_empty());
    assert_eq!(lens(&chunk_text(&"a".repeat(25_000))), vec![25_000]);
    assert_eq!(lens(&chunk_text(&"a".repeat(25_001))), vec![25_000, 1]);
    assert_eq!(
        lens(&chunk_text(&" ".repeat(50_001))),
        vec![25_000, 25_000, 1]
    );
    let mixed = format!("{} {}", "a".repeat(24_999), "b".repeat(25_001));
    assert_eq!(lens(&chunk_text(&mixed)), vec![50_000, 1]);
    // U+001C..U+001F count as whitespace: alternating never forms a run.
    let alternating = "a\u{1c}b\u{1f}".repeat(10_000);
    assert_eq!(lens(&chunk_text(&alternating)), vec![40_000]);
    let unit_sep_run = "\u{1e}".repeat(25_001);
    assert_eq!(lens(&chunk_text(&unit_sep_run)), vec![25_000, 1]);
}

#[test]
fn chunking_slices_at_400k_chars() {
    let text = "ab 中".repeat(100_001);
    let pieces = chunk_text(&text);
    assert_eq!(lens(&pieces), vec![400_000, 4]);
    assert_eq!(pieces.concat(), text);
    let reference = reference_chunks(&text);
    assert_eq!(
        pieces,
        reference.iter().map(String::as_str).collect::<Vec<_>>()
    );
}

#[test]
fn chunking_matches_reference_transcription() {
    let texts = [
        format!(
            "{}{}{}",
            " ".repeat(30_000),
            "x".repeat(51_000),
            "\u{3000}".repeat(25_000)
        ),
        format!("{}é{}", "\u{1d}".repeat(25_000), "\u{2003}".repeat(25_002)),
        "héllo wörld ".repeat(5_000),
    ];
    for text in &texts {
        let pieces = chunk_text(text);
        let reference = reference_chunks(text);
        assert_eq!(
            pieces,
            reference.iter().map(String::as_str).collect::<Vec<_>>()
        );
    }
}

#[test]
fn long_runs_are_encoded_per_chunk() {
    let tok = merges();
    let spaces = " ".repeat(25_001);
    let pieces = chunk_text(&spaces);
    assert_eq!(lens(&pieces), vec![25_000, 1]);
    let chunked = tok.encode(&spaces, false);
    assert_eq!(chunked, tok.encode_pieces_unchunked(&pieces));
    assert_eq!(chunked.len(), 12_501);
    assert_eq!(
        tok.encode_pieces_unchunked(&[spaces.as_str()]).len(),
        12_500
    );

    let letters = format!("x{}", "ab".repeat(15_000));
    let pieces = chunk_text(&letters);
    assert_eq!(lens(&pieces), vec![25_000, 5_001]);
    let chunked = tok.encode(&letters, false);
    assert_eq!(chunked, tok.encode_pieces_unchunked(&pieces));
    assert_ne!(chunked, tok.encode_pieces_unchunked(&[letters.as_str()]));

    let newlines = format!("{}x", "\n".repeat(25_001));
    let chunked = tok.encode(&newlines, false);
    assert_eq!(chunked, tok.encode_pieces_unchunked(&chunk_text(&newlines)));
    assert_ne!(chunked, tok.encode_pieces_unchunked(&[newlines.as_str()]));
}

#[test]
fn special_scanning_restarts_at_chunk_cuts() {
    let tok = tiny();
    let split = format!("{}[EOS]", "a".repeat(24_998));
    assert_eq!(tok.encode(&split, true), byte_ids(&tok, &split));
    let whole = format!("{}[EOS]", "a".repeat(24_995));
    let ids = tok.encode(&whole, true);
    assert_eq!(ids.len(), 24_996);
    assert_eq!(ids.last(), Some(&257));
}

// ---- streaming decode ------------------------------------------------------

#[test]
fn utf8_stream_holds_back_incomplete_sequences() {
    let text = "héllo 你好 👩‍💻 ok";
    let mut stream = Utf8Stream::new();
    let mut out = String::new();
    for &b in text.as_bytes() {
        let piece = stream.push(&[b]);
        assert!(!piece.contains('\u{FFFD}'));
        assert!(stream.pending().len() <= 3);
        out.push_str(&piece);
    }
    out.push_str(&stream.finish());
    assert_eq!(out, text);

    let mut stream = Utf8Stream::new();
    assert_eq!(stream.push(&[0xe4, 0xbd]), "");
    assert_eq!(stream.pending(), &[0xe4, 0xbd]);
    assert_eq!(stream.push(&[0xa0, b'!']), "你!");
    assert_eq!(stream.push(&[0xf0, 0x9f]), "");
    assert_eq!(stream.finish(), "\u{FFFD}");
    assert!(stream.pending().is_empty());
}

#[test]
fn utf8_stream_replaces_invalid_bytes_immediately() {
    let mut stream = Utf8Stream::new();
    assert_eq!(stream.push(&[b'a', 0xff, b'b']), "a\u{FFFD}b");
    assert_eq!(stream.push(&[0xe4, b'x']), "\u{FFFD}x");
    assert_eq!(stream.push(&[0xc0]), "\u{FFFD}");
    assert!(stream.pending().is_empty());
}

#[test]
fn utf8_stream_matches_whole_lossy_decode() {
    let mut state: u64 = 0x1234_5678;
    let mut next = move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) as usize
    };
    let alphabet: &[&[u8]] = &[
        b"a",
        b" ",
        "é".as_bytes(),
        "你".as_bytes(),
        "😀".as_bytes(),
        &[0xff],
        &[0xe4, 0xbd],
        &[0xf0, 0x9f, 0x98],
        &[0x80],
        &[0xed, 0xa0, 0x80],
    ];
    for _ in 0..500 {
        let mut bytes = Vec::new();
        for _ in 0..(next() % 40) {
            bytes.extend_from_slice(alphabet[next() % alphabet.len()]);
        }
        let mut stream = Utf8Stream::new();
        let mut out = String::new();
        let mut rest = bytes.as_slice();
        while !rest.is_empty() {
            let take = (next() % 5 + 1).min(rest.len());
            let (head, tail) = rest.split_at(take);
            out.push_str(&stream.push(head));
            assert!(stream.pending().len() <= 3);
            rest = tail;
        }
        out.push_str(&stream.finish());
        assert_eq!(out, String::from_utf8_lossy(&bytes), "bytes {bytes:?}");
    }
}

// ---- rank-file refusals -------------------------------------------------

#[test]
fn crlf_and_blank_lines_are_accepted() {
    let lines = tiny_rank_lines();
    let mut crlf = lines.join("\r\n").into_bytes();
    crlf.extend_from_slice(b"\r\n\r\n\n");
    let dir = write_dir(&crlf, &tiny_config_text());
    let tok = Tokenizer::load(dir.path()).expect("CRLF accepted");
    assert_eq!(
        tok.encode("Hello, K3!", false),
        tiny().encode("Hello, K3!", false)
    );

    let mut spaced = lines.clone();
    spaced.insert(10, String::new());
    spaced.insert(0, String::new());
    let dir = write_dir(&join_lines(&spaced), &tiny_config_text());
    assert_eq!(
        Tokenizer::load(dir.path())
            .expect("blank lines skipped")
            .n_base(),
        256
    );
}

#[test]
fn refuses_missing_rank_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    fs::write(dir.path().join(CONFIG_FILE), tiny_config_text()).expect("write config");
    let err = Tokenizer::load(dir.path()).expect_err("missing file refused");
    assert!(
        matches!(&err, TokenizerError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    );
    assert!(err.to_string().contains(RANK_FILE));
}

#[test]
fn refuses_empty_rank_file() {
    assert!(matches!(
        refuse_ranks(b""),
        TokenizerError::EmptyFile { .. }
    ));
    let err = refuse_ranks(b"\n\r\n\n");
    assert!(matches!(err, TokenizerError::EmptyFile { .. }));
    assert!(err.to_string().contains("empty"));
}

#[test]
fn refuses_lfs_pointer() {
    let pointer = b"version https://git-lfs.github.com/spec/v1\n\
oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 2795286\n";
    let err = refuse_ranks(pointer);
    assert!(matches!(err, TokenizerError::LfsPointer { line: 1, .. }));
    assert_names_line(&err, 1);
    assert!(err.to_string().contains("git lfs pull"));
}

#[test]
fn refuses_html_page() {
    let err = refuse_ranks(b"\n<!DOCTYPE html>\n<html><body>404 Not Found</body></html>\n");
    assert!(matches!(err, TokenizerError::HtmlPage { line: 2, .. }));
    assert_names_line(&err, 2);
    assert!(err.to_string().contains("HTML"));
}

#[test]
fn refuses_line_without_space_separator() {
    let err = refuse_mutated_line(10, "KQ==\t9");
    assert!(matches!(
        err,
        TokenizerError::MissingSeparator { line: 10, .. }
    ));
    assert_names_line(&err, 10);
    assert!(err.to_string().contains(r#""KQ==\t9""#), "{err}");
}

#[test]
fn refuses_truncated_last_line() {
    let mut lines = tiny_rank_lines();
    let last = lines.pop().expect("non-empty");
    let cut = &last[..2];
    lines.push(cut.to_owned());
    let err = refuse_ranks(lines.join("\n").as_bytes());
    assert!(matches!(
        err,
        TokenizerError::MissingSeparator { line: 256, .. }
    ));
    assert_names_line(&err, 256);
}

#[test]
fn refuses_bad_base64() {
    let err = refuse_mutated_line(5, "J!== 4");
    assert!(matches!(err, TokenizerError::BadBase64 { line: 5, .. }));
    assert_names_line(&err, 5);
    let err = refuse_mutated_line(6, "Jg 5");
    assert!(matches!(err, TokenizerError::BadBase64 { line: 6, .. }));
}

#[test]
fn refuses_empty_token() {
    let err = refuse_mutated_line(6, " 5");
    assert!(matches!(err, TokenizerError::EmptyToken { line: 6, .. }));
    assert_names_line(&err, 6);
}

#[test]
fn refuses_non_decimal_rank() {
    let err = refuse_mutated_line(7, "Jw== abc");
    assert!(matches!(err, TokenizerError::BadRank { line: 7, .. }));
    assert_names_line(&err, 7);
    assert!(err.to_string().contains(r#"rank "abc""#), "{err}");
    let err = refuse_mutated_line(7, "Jw== 6.0");
    assert!(matches!(err, TokenizerError::BadRank { line: 7, .. }));
    let err = refuse_mutated_line(7, "Jw== ");
    assert!(matches!(err, TokenizerError::BadRank { line: 7, .. }));
}

#[test]
fn refuses_signed_rank() {
    let err = refuse_mutated_line(8, "KA== -7");
    assert!(matches!(err, TokenizerError::BadRank { line: 8, .. }));
    assert!(err.to_string().contains("no sign"), "{err}");
    let err = refuse_mutated_line(8, "KA== +7");
    assert!(matches!(err, TokenizerError::BadRank { line: 8, .. }));
    assert_names_line(&err, 8);
}

#[test]
fn refuses_trailing_garbage() {
    let err = refuse_mutated_line(9, "KQ== 8 extra");
    assert!(matches!(err, TokenizerError::BadRank { line: 9, .. }));
    assert_names_line(&err, 9);
    let err = refuse_mutated_line(9, "KQ==  8");
    assert!(matches!(err, TokenizerError::BadRank { line: 9, .. }));
}

#[test]
fn refuses_rank_out_of_range() {
    let err = refuse_mutated_line(11, "Kw== 99999999999999999999999");
    assert!(matches!(
        err,
        TokenizerError::RankOutOfRange { line: 11, .. }
    ));
    assert_names_line(&err, 11);
    let err = refuse_mutated_line(11, "Kw== 4294967295");
    assert!(matches!(
        err,
        TokenizerError::RankOutOfRange { line: 11, .. }
    ));
}

#[test]
fn refuses_duplicate_rank() {
    let err = refuse_mutated_line(20, "NA== 3");
    assert!(matches!(
        err,
        TokenizerError::DuplicateRank {
            line: 20,
            rank: 3,
            first_line: 4,
            ..
        }
    ));
    assert_names_line(&err, 20);
}

#[test]
fn refuses_duplicate_token_bytes() {
    let lines = tiny_rank_lines();
    let token_of_line_4 = lines[3].split(' ').next().expect("token field").to_owned();
    let err = refuse_mutated_line(20, &format!("{token_of_line_4} 19"));
    assert!(matches!(
        err,
        TokenizerError::DuplicateToken {
            line: 20,
            first_rank: 3,
            first_line: 4,
            ..
        }
    ));
    assert_names_line(&err, 20);
}

#[test]
fn refuses_rank_gap() {
    let mut lines = tiny_rank_lines();
    lines.push("QUI= 300".to_owned());
    let err = refuse_ranks(&join_lines(&lines));
    assert!(matches!(
        err,
        TokenizerError::RankGap {
            line: 257,
            entries: 257,
            found: 300,
            missing: 256,
            ..
        }
    ));
    assert_names_line(&err, 257);

    let mut lines = tiny_rank_lines();
    lines.remove(99);
    let err = refuse_ranks(&join_lines(&lines));
    assert!(matches!(
        err,
        TokenizerError::RankGap {
            line: 255,
            missing: 99,
            ..
        }
    ));
}

#[test]
fn refuses_missing_single_byte() {
    let lines = tiny_rank_lines();
    let mut kept: Vec<String> = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if i == 99 {
            continue;
        }
        let token = line.split(' ').next().expect("token field");
        kept.push(format!("{token} {}", kept.len()));
    }
    kept.push(format!("QUI= {}", kept.len()));
    let missing_byte = base64::engine::general_purpose::STANDARD
        .decode(lines[99].split(' ').next().expect("token field"))
        .expect("valid base64")[0];
    let err = refuse_ranks(&join_lines(&kept));
    assert!(matches!(err, TokenizerError::MissingByte { byte, .. } if byte == missing_byte));
    assert!(err.to_string().contains(&format!("0x{missing_byte:02x}")));
}

#[test]
fn refuses_overlong_line() {
    let err = refuse_mutated_line(12, &format!("{} 11", "A".repeat(MAX_LINE_BYTES + 4)));
    assert!(matches!(err, TokenizerError::LineTooLong { line: 12, .. }));
    assert_names_line(&err, 12);
}

#[test]
fn error_messages_escape_file_content() {
    let err = refuse_mutated_line(3, "\u{1b}[31mred 2");
    let msg = err.to_string();
    assert!(!msg.contains('\u{1b}'), "{msg}");
    assert!(msg.contains("\\u{1b}"), "{msg}");
    assert_names_line(&err, 3);
}

#[test]
fn expected_vocab_size_is_enforced() {
    let dir = fixture("tiny");
    assert_eq!(
        Tokenizer::load_expecting(&dir, 512)
            .expect("matches")
            .vocab_size(),
        512
    );
    let err = Tokenizer::load_expecting(&dir, 163_840).expect_err("mismatch refused");
    assert!(matches!(
        err,
        TokenizerError::VocabMismatch {
            expected: 163_840,
            found: 512,
            ..
        }
    ));
}

// ---- config refusals -----------------------------------------------------

#[test]
fn refuses_missing_or_broken_config() {
    let dir = tempfile::tempdir().expect("tempdir");
    fs::write(
        dir.path().join(RANK_FILE),
        fs::read(fixture("tiny/tiktoken.model")).expect("read"),
    )
    .expect("write");
    let err = Tokenizer::load(dir.path()).expect_err("missing config refused");
    assert!(matches!(err, TokenizerError::Io { .. }));
    assert!(err.to_string().contains(CONFIG_FILE));

    let err = refuse_config("{\n  \"added_tokens_decoder\": {\n    \"256\": \n}");
    assert!(
        matches!(err, TokenizerError::ConfigJson { line: 4, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("line 4"));

    let err = refuse_config("{\"bos_token\": \"[BOS]\"}");
    assert!(matches!(err, TokenizerError::ConfigJson { .. }));
    assert!(err.to_string().contains("added_tokens_decoder"));

    let err = refuse_config("<html><head><title>Sign in</title></head></html>");
    assert!(matches!(err, TokenizerError::HtmlPage { .. }));
    assert!(matches!(
        refuse_config(" \n"),
        TokenizerError::EmptyFile { .. }
    ));
}

#[test]
fn refuses_special_outside_special_range() {
    let config = config_with_specials(|d| {
        d.insert("100".into(), special_entry("<|low|>", true));
    });
    let err = refuse_config(&config);
    assert!(matches!(
        err,
        TokenizerError::SpecialOutOfRange {
            id: 100,
            start: 256,
            end: 512,
            ..
        }
    ));
    assert!(err.to_string().contains("<|low|>"));

    let config = config_with_specials(|d| {
        d.insert("163846".into(), special_entry("<|im_end|>", true));
    });
    let err = refuse_config(&config);
    assert!(matches!(
        err,
        TokenizerError::SpecialOutOfRange { id: 163_846, .. }
    ));
}

#[test]
fn refuses_non_decimal_special_key() {
    let config = config_with_specials(|d| {
        d.insert("0300".into(), special_entry("<|x|>", true));
    });
    assert!(matches!(
        refuse_config(&config),
        TokenizerError::SpecialBadKey { .. }
    ));
    let config = config_with_specials(|d| {
        d.insert("-1".into(), special_entry("<|x|>", true));
    });
    assert!(matches!(
        refuse_config(&config),
        TokenizerError::SpecialBadKey { .. }
    ));
}

#[test]
fn refuses_duplicated_special_id() {
    let text = tiny_config_text().replacen(
        "\"256\": {",
        "\"300\": {\"content\": \"<|dup|>\", \"special\": true},\n    \"300\": {",
        1,
    );
    let err = refuse_config(&text);
    assert!(
        matches!(err, TokenizerError::SpecialDuplicateId { id: 300, .. }),
        "{err}"
    );
}

#[test]
fn refuses_duplicated_special_name() {
    let config = config_with_specials(|d| {
        d.insert("300".into(), special_entry("[EOS]", true));
    });
    let err = refuse_config(&config);
    assert!(matches!(
        err,
        TokenizerError::SpecialDuplicateName {
            first_id: 257,
            id: 300,
            ..
        }
    ));
    assert!(err.to_string().contains("[EOS]"));

    let config = config_with_specials(|d| {
        d.insert("300".into(), special_entry("<|reserved_token_301|>", true));
    });
    let err = refuse_config(&config);
    assert!(matches!(
        err,
        TokenizerError::SpecialDuplicateName {
            first_id: 300,
            id: 301,
            ..
        }
    ));
}

#[test]
fn refuses_special_colliding_with_bpe_bytes() {
    let config = config_with_specials(|d| {
        d.insert("300".into(), special_entry("A", true));
    });
    let err = refuse_config(&config);
    assert!(matches!(
        err,
        TokenizerError::SpecialCollidesWithRank {
            id: 300,
            rank: 32,
            ..
        }
    ));
}

#[test]
fn refuses_empty_special_name() {
    let config = config_with_specials(|d| {
        d.insert("300".into(), special_entry("", true));
    });
    assert!(matches!(
        refuse_config(&config),
        TokenizerError::SpecialEmptyName { id: 300, .. }
    ));
}
