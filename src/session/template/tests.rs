//! Tests of the chat template: token-exact goldens against the release, the strict and tolerant
//! parsers, markers, effort preambles, and the API request layout with tools.

use super::*;
use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use base64::Engine as _;

use crate::session::tokenizer::{CONFIG_FILE, RANK_FILE};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(format!("{FIXTURES}/{rel}"))
}

fn tiny() -> Tokenizer {
    Tokenizer::load(&fixture("tiny")).expect("tiny fixture loads")
}

// ---- A synthetic tokenizer with the released vocabulary size and ids ----

/// Regex pieces of the worked example, the effort message, the other
/// goldens and a few tokenizer test vectors, at their released ranks.
const RELEASED_PIECES: &[(&str, u32)] = &[
    ("message", 2778),
    (" role", 6244),
    ("=\"", 878),
    ("system", 14062),
    ("user", 2482),
    ("assistant", 69702),
    ("think", 39964),
    ("response", 12092),
    (" type", 1798),
    ("thinking", 130400),
    ("-eff", 59991),
    ("ort", 470),
    ("_eff", 123074),
    (" guides", 28560),
    (" on", 418),
    (" how", 1632),
    (" much", 2455),
    (" to", 308),
    (" think", 2704),
    (" in", 306),
    (" your", 651),
    (" thinking", 9545),
    (" channel", 8491),
    (" (", 347),
    ("not", 2976),
    (" including", 3411),
    (" the", 276),
    (" response", 4503),
    ("),", 904),
    (" supported", 9141),
    (" values", 4661),
    (" include", 3867),
    (" `", 1268),
    ("low", 1332),
    ("`,", 5713),
    ("medium", 50004),
    ("high", 19421),
    (" and", 316),
    ("max", 5354),
    ("`.\n", 16518),
    ("Now", 10048),
    (" system", 2403),
    (" is", 387),
    (" invoked", 42070),
    (" with", 472),
    ("=max", 105281),
    ("`.", 11369),
    ("Numbers", 38587),
    ("473", 42780),
    ("921", 49114),
    ("235", 23782),
    ("What", 5376),
    (" were", 1646),
    (" other", 1356),
    (" two", 2069),
    ("You", 3900),
    (" are", 554),
    (" helpful", 13205),
    ("Hello", 19180),
    ("hello", 22931),
    ("The", 1008),
    (" capital", 10484),
    (" of", 318),
    (" France", 15383),
    (" Paris", 17374),
    ("123", 6694),
    ("456", 12972),
    ("789", 16242),
];

/// Tokens that must also be reachable by merging inside a longer piece
/// (`` `thinking`` → `` ` ``, `thinking`; `_effort` → `_eff`, `ort`;
/// `-effort` → `-eff`, `ort`; `=low` → `=`, `low`): every proper prefix
/// of length ≥ 2 is added as a rank so the merge chain exists.
const MERGE_BUILT: &[&str] = &["thinking", "_eff", "-eff", "ort", "low"];

/// First rank tried for the merge-chain prefixes.
const CHAIN_RANK_BASE: u32 = 150_000;

/// Single-byte ranks in the usual tiktoken layout: printable bytes
/// (33..=126, 161..=172, 174..=255) first, then the other 68 in byte
/// order, so `!` is 0 and space is 220.
fn byte_rank(b: u8) -> u32 {
    let printable = |c: u8| (33..=126).contains(&c) || (161..=172).contains(&c) || c >= 174;
    if printable(b) {
        (0..b).filter(|&c| printable(c)).count() as u32
    } else {
        188 + (0..b).filter(|&c| !printable(c)).count() as u32
    }
}

/// The 16 named specials at their released ids, taken from the tiny
/// fixture's table (same names and order, 256 ranks instead of 163,584).
fn released_specials() -> Vec<(u32, String, bool)> {
    tiny()
        .special_tokens()
        .iter()
        .filter(|s| s.named)
        .map(|s| (s.id - 256 + RELEASED_N_BASE, s.name.clone(), s.special))
        .collect()
}

/// Writes `tiktoken.model` with 163,584 dense ranks and a
/// `tokenizer_config.json` with the given specials.
fn write_synthetic_release(dir: &Path, specials: &[(u32, String, bool)]) {
    let n = RELEASED_N_BASE as usize;
    let mut by_rank: Vec<Option<Vec<u8>>> = vec![None; n];
    let mut ranks: HashMap<Vec<u8>, u32> = HashMap::new();
    fn assign(
        by_rank: &mut [Option<Vec<u8>>],
        ranks: &mut HashMap<Vec<u8>, u32>,
        bytes: Vec<u8>,
        rank: u32,
    ) {
        if let Some(&old) = ranks.get(&bytes) {
            assert_eq!(old, rank, "{bytes:?} placed twice");
            return;
        }
        let slot = &mut by_rank[rank as usize];
        assert!(slot.is_none(), "rank {rank} used twice");
        *slot = Some(bytes.clone());
        ranks.insert(bytes, rank);
    }
    for b in 0..=255u8 {
        assign(&mut by_rank, &mut ranks, vec![b], byte_rank(b));
    }
    for &(piece, rank) in RELEASED_PIECES {
        assign(&mut by_rank, &mut ranks, piece.as_bytes().to_vec(), rank);
    }
    let mut next_free = CHAIN_RANK_BASE;
    for word in MERGE_BUILT {
        for k in 2..word.len() {
            let prefix = word.as_bytes()[..k].to_vec();
            if ranks.contains_key(&prefix) {
                continue;
            }
            while by_rank[next_free as usize].is_some() {
                next_free += 1;
            }
            assign(&mut by_rank, &mut ranks, prefix, next_free);
        }
    }
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut file = String::with_capacity(n * 18);
    for (rank, slot) in by_rank.iter().enumerate() {
        // Fill-ins start with 0xFF, which never occurs in UTF-8 text.
        let bytes = slot.clone().unwrap_or_else(|| {
            vec![
                0xFF,
                0xFE,
                (rank >> 16) as u8,
                (rank >> 8) as u8,
                rank as u8,
            ]
        });
        file.push_str(&b64.encode(&bytes));
        file.push(' ');
        file.push_str(&rank.to_string());
        file.push('\n');
    }
    fs::write(dir.join(RANK_FILE), file).expect("write rank file");

    let mut decoder = serde_json::Map::new();
    for (id, name, special) in specials {
        decoder.insert(
            id.to_string(),
            serde_json::json!({
                "content": name, "lstrip": false, "normalized": false,
                "rstrip": false, "single_word": false, "special": special,
            }),
        );
    }
    let config = serde_json::json!({
        "added_tokens_decoder": decoder,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "tokenizer_class": "TikTokenTokenizer",
    });
    fs::write(dir.join(CONFIG_FILE), config.to_string()).expect("write config");
}

fn load_synthetic(specials: &[(u32, String, bool)]) -> Tokenizer {
    let dir = tempfile::tempdir().expect("tempdir");
    write_synthetic_release(dir.path(), specials);
    Tokenizer::load(dir.path()).expect("synthetic release tokenizer loads")
}

/// The synthetic tokenizer with the released ids (built once).
fn release() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| load_synthetic(&released_specials()))
}

// ---- Goldens (docs/runtime.md#worked-example) ----

const PREAMBLE_MAX: [u32; 67] = [
    163587, 2778, 6244, 878, 14062, 1, 1798, 878, 130400, 59991, 470, 1, 163589, 63, 130400,
    123074, 470, 63, 28560, 418, 1632, 2455, 308, 2704, 306, 651, 9545, 8491, 347, 2976, 3411, 276,
    4503, 8491, 904, 9141, 4661, 3867, 1268, 1332, 5713, 1268, 50004, 5713, 1268, 19421, 5713, 316,
    1268, 5354, 16518, 10048, 276, 2403, 387, 42070, 472, 1268, 130400, 123074, 470, 105281, 11369,
    163588, 2778, 163589, 163586,
];
const USER1: [u32; 13] = [
    163587, 2778, 6244, 878, 2482, 1, 163589, 38587, 30, 163588, 2778, 163589, 163586,
];
const ASSISTANT1_HEAD: [u32; 10] = [
    163587, 2778, 6244, 878, 69702, 1, 163589, 163587, 39964, 163589,
];
const ASSISTANT1_TAIL: [u32; 20] = [
    163588, 39964, 163589, 163587, 12092, 163589, 42780, 11, 220, 49114, 11, 220, 23782, 163588,
    12092, 163589, 163588, 2778, 163589, 163586,
];
const USER2: [u32; 17] = [
    163587, 2778, 6244, 878, 2482, 1, 163589, 5376, 1646, 276, 1356, 2069, 30, 163588, 2778,
    163589, 163586,
];
const PROMPT_THINK: [u32; 10] = [
    163587, 2778, 6244, 878, 69702, 1, 163589, 163587, 39964, 163589,
];
const SKELETON: [u32; 32] = [
    163587, 163589, 163588, 163589, 163586, // preamble
    163587, 163589, 163588, 163589, 163586, // user
    163587, 163589, 163587, 163589, 163588, 163589, 163587, 163589, 163588, 163589, 163588, 163589,
    163586, // assistant
    163587, 163589, 163588, 163589, 163586, // user
    163587, 163589, 163587, 163589, // prompt
];
const THINKING_OFF_64: [u32; 64] = [
    163587, 2778, 6244, 878, 2482, 1, 163589, 38587, 30, 163588, 2778, 163589, 163586, //
    163587, 2778, 6244, 878, 69702, 1, 163589, 163587, 12092, 163589, 42780, 11, 220, 49114, 11,
    220, 23782, 163588, 12092, 163589, 163588, 2778, 163589, 163586, //
    163587, 2778, 6244, 878, 2482, 1, 163589, 5376, 1646, 276, 1356, 2069, 30, 163588, 2778,
    163589, 163586, //
    163587, 2778, 6244, 878, 69702, 1, 163589, 163587, 12092, 163589,
];
const SYSTEM_USER_37: [u32; 37] = [
    163587, 2778, 6244, 878, 14062, 1, 163589, 3900, 554, 13205, 13, 163588, 2778, 163589, 163586,
    163587, 2778, 6244, 878, 2482, 1, 163589, 19180, 163588, 2778, 163589, 163586, 163587, 2778,
    6244, 878, 69702, 1, 163589, 163587, 12092, 163589,
];

const REASONING: &str = "I'll remember 215 and 222.";

fn worked_example() -> Vec<Message> {
    vec![
        Message::user("Numbers?"),
        Message::assistant("473, 921, 235", Some(REASONING.to_owned())),
        Message::user("What were the other two?"),
    ]
}

fn off() -> RenderOptions {
    RenderOptions {
        thinking: false,
        effort: Effort::Max,
    }
}

#[test]
fn synthetic_release_tokenizer_matches_released_vectors() {
    let tok = release();
    assert_eq!(tok.n_base(), RELEASED_N_BASE);
    assert_eq!(tok.vocab_size(), 163_840);
    let cases: &[(&str, &[u32])] = &[
        ("The capital of France is", &[1008, 10484, 318, 15383, 387]),
        ("$%&'(", &[3, 4, 5, 6, 7]),
        ("Hello", &[19180]),
        ("hello", &[22931]),
        ("You are helpful.", &[3900, 554, 13205, 13]),
        ("Numbers?", &[38587, 30]),
        ("473, 921, 235", &[42780, 11, 220, 49114, 11, 220, 23782]),
        (
            "What were the other two?",
            &[5376, 1646, 276, 1356, 2069, 30],
        ),
        ("1234567890", &[6694, 12972, 16242, 15]),
        ("thinking-effort", &[130400, 59991, 470]),
        (" response", &[4503]),
        (" Paris", &[17374]),
    ];
    for (text, ids) in cases {
        assert_eq!(tok.encode(text, false), *ids, "{text:?}");
    }
}

// ---- Rendering ----

#[test]
fn thinking_off_worked_example_is_token_exact() {
    let ids = render(release(), &worked_example(), &off(), true).expect("render");
    assert_eq!(ids, THINKING_OFF_64);
}

#[test]
fn system_user_goldens_are_token_exact() {
    let conv = [Message::system("You are helpful."), Message::user("Hello")];
    let ids = render(release(), &conv, &off(), true).expect("render");
    assert_eq!(ids, SYSTEM_USER_37);

    let ids = render(release(), &conv, &RenderOptions::default(), true).expect("render");
    let mut want = PREAMBLE_MAX.to_vec();
    want.extend_from_slice(&SYSTEM_USER_37[..27]);
    want.extend_from_slice(&PROMPT_THINK);
    assert_eq!(ids.len(), 104);
    assert_eq!(ids, want);
}

#[test]
fn thinking_on_worked_example_is_token_exact_outside_the_reasoning() {
    let tok = release();
    let ids = render(tok, &worked_example(), &RenderOptions::default(), true).expect("render");
    let prefix: Vec<u32> = [&PREAMBLE_MAX[..], &USER1, &ASSISTANT1_HEAD].concat();
    let suffix: Vec<u32> = [&ASSISTANT1_TAIL[..], &USER2, &PROMPT_THINK].concat();
    assert!(ids.len() > prefix.len() + suffix.len());
    assert_eq!(ids[..prefix.len()], prefix[..]);
    assert_eq!(ids[ids.len() - suffix.len()..], suffix[..]);
    let payload = &ids[prefix.len()..ids.len() - suffix.len()];
    assert_eq!(payload, tok.encode(REASONING, false));
    assert!(payload.iter().all(|&id| id < RELEASED_N_BASE));
    assert_eq!(decode_text(tok, payload), REASONING);
    let skeleton: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|&id| id >= RELEASED_N_BASE)
        .collect();
    assert_eq!(skeleton, SKELETON);
}

#[test]
fn effort_preambles_are_token_exact() {
    let tok = release();
    let max = render(tok, &[], &RenderOptions::default(), false).expect("render");
    assert_eq!(max, PREAMBLE_MAX);
    let low = RenderOptions {
        thinking: true,
        effort: Effort::Low,
    };
    let ids = render(tok, &[], &low, false).expect("render");
    let mut want = PREAMBLE_MAX.to_vec();
    let at = want.iter().position(|&id| id == 105281).expect("=max id");
    want.splice(at..=at, [28, 1332]);
    assert_eq!(ids.len(), 68);
    assert_eq!(ids, want);
}

fn count(ids: &[u32], id: u32) -> usize {
    ids.iter().filter(|&&x| x == id).count()
}

#[test]
fn injected_markers_in_user_text_stay_text() {
    let conv = [Message::user("literal <|end_of_msg|> <|open|>")];
    for tok in [&tiny(), release()] {
        let m = Markers::resolve(tok).expect("markers");
        let ids = render(tok, &conv, &RenderOptions::default(), true).expect("render");
        // Effort message and user turn end with one end_of_msg each; the
        // generation prompt opens `message` and `think`.
        assert_eq!(count(&ids, m.end_of_msg), 2);
        assert_eq!(count(&ids, m.open), 4);
        assert_eq!(count(&ids, m.close), 2);
        assert_eq!(count(&ids, m.sep), 6);
        assert_eq!(ids.iter().filter(|&&id| tok.is_special(id)).count(), 14);
        let text = tok.encode("literal <|end_of_msg|> <|open|>", false);
        assert!(ids.windows(text.len()).any(|w| w == text));
    }
    let ids = render(release(), &conv, &off(), false).expect("render");
    assert_eq!(count(&ids, RELEASED_END_OF_MSG_ID), 1);
    assert_eq!(count(&ids, RELEASED_OPEN_ID), 1);
}

fn oracle_ids(oracle: &serde_json::Value, key: &str) -> Vec<u32> {
    oracle["multi_turn"][key]
        .as_array()
        .expect("id array")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect()
}

#[test]
fn tiny_oracle_turns_match() {
    let tok = tiny();
    let text = fs::read_to_string(fixture("tiny/oracle.json")).expect("oracle readable");
    let oracle: serde_json::Value = serde_json::from_str(&text).expect("oracle is JSON");
    let turn1 = oracle_ids(&oracle, "turn1_ids");
    let turn2 = oracle_ids(&oracle, "turn2_ids");

    let first = [Message::user("Hello K3")];
    assert_eq!(render(&tok, &first, &off(), true).expect("render"), turn1);

    // Closing the generated reply, the next user turn and the prompt.
    let markers = Markers::resolve(&tok).expect("markers");
    let mut segments = vec![
        Segment::control(CLOSE),
        Segment::text("response"),
        Segment::control(SEP),
        Segment::control(CLOSE),
        Segment::text("message"),
        Segment::control(SEP),
        Segment::control(END_OF_MSG),
    ];
    segments.extend(render_segments(&[Message::user("Why?")], &off(), true).expect("segs"));
    assert_eq!(
        encode_segments(&tok, &markers, &segments).expect("encode"),
        turn2
    );

    // An empty reply renders no payload segment, so the re-render of the
    // whole history is exactly turn 1 followed by turn 2.
    let history = [
        Message::user("Hello K3"),
        Message::assistant("", None),
        Message::user("Why?"),
    ];
    let full = render(&tok, &history, &off(), true).expect("render");
    assert_eq!(full, [turn1.clone(), turn2].concat());

    // The random reply holds special ids: never a valid turn.
    let reply = oracle_ids(&oracle, "turn1_reply_ids");
    let err = parse_strict(&tok, &markers, &reply, false).expect_err("malformed reply");
    assert!(err.partial().is_some());
}

#[test]
fn segments_follow_the_primitives() {
    let segs = render_segments(&[Message::user("hi")], &off(), false).expect("segments");
    let want = vec![
        Segment::control(OPEN),
        Segment::text("message"),
        Segment::text(" role"),
        Segment::text("=\""),
        Segment::text("user"),
        Segment::text("\""),
        Segment::control(SEP),
        Segment::text("hi"),
        Segment::control(CLOSE),
        Segment::text("message"),
        Segment::control(SEP),
        Segment::control(END_OF_MSG),
    ];
    assert_eq!(segs, want);

    // Empty content: no text segment at all.
    let segs = render_segments(&[Message::user("")], &off(), false).expect("segments");
    assert_eq!(segs.len(), want.len() - 1);
    assert!(segs.iter().all(|s| !s.text.is_empty()));

    // The effort message: role then type, four segments each.
    let segs = render_segments(&[], &RenderOptions::default(), false).expect("segments");
    let texts: Vec<&str> = segs.iter().map(|s| s.text.as_str()).collect();
    assert_eq!(
        texts[..12],
        [
            OPEN,
            "message",
            " role",
            "=\"",
            "system",
            "\"",
            " type",
            "=\"",
            "thinking-effort",
            "\"",
            SEP,
            texts[11]
        ]
    );
    assert_eq!(texts[11], effort_message_body(Effort::Max));
    assert!(texts[11].contains("\nNow the system is invoked with `thinking_effort=max`."));
}

#[test]
fn attribute_values_are_escaped() {
    assert_eq!(escape_attr("a&\"b<c>&amp;"), "a&amp;&quot;b<c>&amp;amp;");
    let mut b = Builder::default();
    b.open_tag("x", &[("k", "")]);
    let texts: Vec<&str> = b.segments.iter().map(|s| s.text.as_str()).collect();
    assert_eq!(texts, [OPEN, "x", " k", "=\"", "\"", SEP]);
}

fn texts(segs: &[Segment]) -> Vec<&str> {
    segs.iter().map(|s| s.text.as_str()).collect()
}

#[test]
fn assistant_think_channel_rules() {
    let on = RenderOptions::default();
    // Whitespace-only reasoning (Python isspace, incl. U+001F) is dropped,
    // the empty think channel still renders.
    for reasoning in [None, Some(" \n\t\u{1f} ".to_owned())] {
        let conv = [Message::assistant("A", reasoning)];
        let segs = render_segments(&conv, &on, false).expect("segments");
        let t = texts(&segs);
        let think = t.iter().position(|&s| s == "think").expect("think");
        assert_eq!(t[think..think + 5], ["think", SEP, CLOSE, "think", SEP]);
    }
    // Non-blank reasoning is kept unstripped.
    let conv = [Message::assistant("A", Some("  r \n".to_owned()))];
    let segs = render_segments(&conv, &on, false).expect("segments");
    assert!(texts(&segs).contains(&"  r \n"));
    // Thinking off: no think channel at all, reasoning dropped.
    let segs = render_segments(&conv, &off(), false).expect("segments");
    let t = texts(&segs);
    assert!(!t.contains(&"think") && !t.contains(&"  r \n"));
    assert_eq!(
        t,
        [
            OPEN,
            "message",
            " role",
            "=\"",
            "assistant",
            "\"",
            SEP,
            OPEN,
            "response",
            SEP,
            "A",
            CLOSE,
            "response",
            SEP,
            CLOSE,
            "message",
            SEP,
            END_OF_MSG
        ]
    );
    // Generation prompt opens think or response and stays open.
    let segs = render_segments(&[], &on, true).expect("segments");
    assert_eq!(texts(&segs)[texts(&segs).len() - 3..], [OPEN, "think", SEP]);
    let segs = render_segments(&[], &off(), true).expect("segments");
    assert_eq!(
        texts(&segs)[texts(&segs).len() - 3..],
        [OPEN, "response", SEP]
    );
    // Reasoning on a user message is refused.
    let mut bad = Message::user("u");
    bad.reasoning = Some("r".to_owned());
    let err = render_segments(&[Message::system("s"), bad], &on, true).expect_err("refused");
    assert_eq!(
        err,
        TemplateError::ReasoningOnNonAssistant {
            index: 1,
            role: Role::User
        }
    );
}

#[test]
fn raw_mode_recognizes_specials() {
    let tok = tiny();
    assert_eq!(render_raw(&tok, "<|open|>!"), [259, 0]);
    assert_eq!(render_raw(&tok, ""), Vec::<u32>::new());
}

// ---- Markers ----

#[test]
fn markers_resolve_by_name() {
    let m = Markers::resolve(&tiny()).expect("tiny markers");
    assert_eq!(
        m,
        Markers {
            open: 259,
            close: 260,
            sep: 261,
            end_of_msg: 258,
            eos: 257
        }
    );
    assert_eq!(m.stop_ids(), [257, 258]);
    assert_eq!(
        Markers::resolve(release()).expect("release"),
        Markers::RELEASED
    );
    assert_eq!(Markers::RELEASED.stop_ids(), [163585, 163586]);
}

#[test]
fn markers_refuse_missing_or_moved_ids() {
    // Tiny tokenizer without `<|sep|>`.
    let dir = tempfile::tempdir().expect("tempdir");
    fs::copy(fixture("tiny/tiktoken.model"), dir.path().join(RANK_FILE)).expect("copy");
    let config = fs::read_to_string(fixture("tiny/tokenizer_config.json")).expect("config");
    let mut json: serde_json::Value = serde_json::from_str(&config).expect("json");
    json["added_tokens_decoder"]
        .as_object_mut()
        .expect("object")
        .remove("261");
    fs::write(dir.path().join(CONFIG_FILE), json.to_string()).expect("write");
    let tok = Tokenizer::load(dir.path()).expect("loads");
    assert_eq!(
        Markers::resolve(&tok),
        Err(TemplateError::MissingMarker { name: SEP })
    );
    assert!(render(&tok, &[Message::user("x")], &off(), true).is_err());

    // Released size with `<|open|>` and `<|close|>` swapped.
    let swapped: Vec<(u32, String, bool)> = released_specials()
        .into_iter()
        .map(|(id, name, special)| match id {
            RELEASED_OPEN_ID => (RELEASED_CLOSE_ID, name, special),
            RELEASED_CLOSE_ID => (RELEASED_OPEN_ID, name, special),
            _ => (id, name, special),
        })
        .collect();
    let tok = load_synthetic(&swapped);
    assert_eq!(
        Markers::resolve(&tok),
        Err(TemplateError::MarkerId {
            name: OPEN,
            expected: RELEASED_OPEN_ID,
            found: RELEASED_CLOSE_ID
        })
    );
}

// ---- Options ----

#[test]
fn effort_parsing() {
    assert_eq!(Effort::parse("low"), Ok(Effort::Low));
    assert_eq!("high".parse::<Effort>(), Ok(Effort::High));
    assert_eq!("max".parse::<Effort>(), Ok(Effort::Max));
    assert_eq!("MAX".parse::<Effort>(), Ok(Effort::Max));
    let err = "medium".parse::<Effort>().expect_err("medium refused");
    assert_eq!(err, TemplateError::MediumEffort);
    assert!(err.to_string().contains("`medium` is not accepted"));
    assert!(matches!(
        "".parse::<Effort>(),
        Err(TemplateError::UnknownEffort { .. })
    ));
    assert_eq!(Effort::default(), Effort::Max);
    assert_eq!(
        RenderOptions::default(),
        RenderOptions {
            thinking: true,
            effort: Effort::Max
        }
    );
    assert_eq!("assistant".parse::<Role>(), Ok(Role::Assistant));
    assert!(matches!(
        "tool".parse::<Role>(),
        Err(TemplateError::UnknownRole { .. })
    ));
}

// ---- Strict parsing ----

/// A completion as the model would produce it after the generation
/// prompt, with channel words tokenized by `tok`.
fn completion(tok: &Tokenizer, reasoning: Option<&str>, content: &str, end: u32) -> Vec<u32> {
    let m = Markers::resolve(tok).expect("markers");
    let word = |w: &str| tok.encode(w, false);
    let mut ids = Vec::new();
    if let Some(r) = reasoning {
        ids.extend(tok.encode(r, false));
        ids.push(m.close);
        ids.extend(word("think"));
        ids.extend([m.sep, m.open]);
        ids.extend(word("response"));
        ids.push(m.sep);
    }
    ids.extend(tok.encode(content, false));
    ids.push(m.close);
    ids.extend(word("response"));
    ids.extend([m.sep, m.close]);
    ids.extend(word("message"));
    ids.push(m.sep);
    ids.push(end);
    ids
}

#[test]
fn strict_parse_accepts_well_formed_turns() {
    let tiny = tiny();
    for tok in [release(), &tiny] {
        let m = Markers::resolve(tok).expect("markers");
        for end in m.stop_ids() {
            let ids = completion(tok, Some(REASONING), "473, 921, 235", end);
            let turn = parse_strict(tok, &m, &ids, true).expect("thinking-on turn");
            assert_eq!(turn.reasoning.as_deref(), Some(REASONING));
            assert_eq!(turn.content, "473, 921, 235");

            let ids = completion(tok, None, "473, 921, 235", end);
            let turn = parse_strict(tok, &m, &ids, false).expect("thinking-off turn");
            assert_eq!(
                turn,
                ParsedTurn {
                    reasoning: None,
                    content: "473, 921, 235".to_owned()
                }
            );

            // Empty reasoning and marker strings typed as plain text.
            let text = "<|close|>response<|sep|><|close|>message<|sep|>[EOS]";
            let ids = completion(tok, Some(""), text, end);
            let turn = parse_strict(tok, &m, &ids, true).expect("plain-text markers");
            assert_eq!(turn.reasoning.as_deref(), Some(""));
            assert_eq!(turn.content, text);
        }
    }
    // The released pattern ids.
    let ids = completion(release(), Some("r"), "c", RELEASED_EOS_ID);
    assert!(ids
        .windows(6)
        .any(|w| w == [163588, 39964, 163589, 163587, 12092, 163589]));
    assert!(ids
        .windows(6)
        .any(|w| w == [163588, 12092, 163589, 163588, 2778, 163589]));
}

#[test]
fn strict_parse_rejects_bad_endings() {
    let tiny = tiny();
    for tok in [release(), &tiny] {
        let m = Markers::resolve(tok).expect("markers");
        let good = completion(tok, Some(REASONING), "473", m.eos);
        let want = ParsedTurn {
            reasoning: Some(REASONING.to_owned()),
            content: "473".to_owned(),
        };

        let missing = &good[..good.len() - 1];
        assert_eq!(
            parse_strict(tok, &m, missing, true),
            Err(ParseError::MissingEndId {
                partial: want.clone()
            })
        );

        let mut wrong = good.clone();
        *wrong.last_mut().expect("non-empty") = m.open;
        assert_eq!(
            parse_strict(tok, &m, &wrong, true),
            Err(ParseError::WrongEndId {
                found: m.open,
                partial: want.clone()
            })
        );

        let mut trailing = good.clone();
        trailing.extend([0, m.end_of_msg]);
        assert_eq!(
            parse_strict(tok, &m, &trailing, true),
            Err(ParseError::TrailingIds {
                extra: 2,
                partial: want.clone()
            })
        );

        // Stopped with an end id before closing the turn.
        let mut early = tok.encode("473", false);
        early.push(m.end_of_msg);
        let err = parse_strict(tok, &m, &early, false).expect_err("unclosed");
        assert!(matches!(err, ParseError::Unclosed { end_id, .. } if end_id == m.end_of_msg));
        assert_eq!(err.partial().map(|p| p.content.as_str()), Some("473"));
    }
}

#[test]
fn strict_parse_rejects_specials_in_payloads() {
    let tiny = tiny();
    for tok in [release(), &tiny] {
        let m = Markers::resolve(tok).expect("markers");
        let good = completion(tok, Some("ab"), "cd", m.eos);
        let r_len = tok.encode("ab", false).len();

        // In the reasoning.
        let mut ids = good.clone();
        ids.insert(1, m.open);
        let err = parse_strict(tok, &m, &ids, true).expect_err("special in reasoning");
        assert!(matches!(
            err,
            ParseError::SpecialInPayload { index: 1, channel: Channel::Reasoning, id, .. }
                if id == m.open
        ));

        // In the response (the byte tokenizer spells words with several ids).
        let head =
            r_len + 4 + tok.encode("think", false).len() + tok.encode("response", false).len();
        let mut ids = good.clone();
        ids.insert(head + 1, m.eos);
        let err = parse_strict(tok, &m, &ids, true).expect_err("special in response");
        assert!(matches!(
            err,
            ParseError::SpecialInPayload { channel: Channel::Response, id, index, .. }
                if id == m.eos && index == head + 1
        ));
        assert_eq!(
            err.partial().and_then(|p| p.reasoning.as_deref()),
            Some("ab")
        );

        // An unknown id is not text either.
        let mut ids = good.clone();
        ids.insert(0, tok.vocab_size());
        let err = parse_strict(tok, &m, &ids, true).expect_err("unknown id");
        assert!(matches!(err, ParseError::SpecialInPayload { index: 0, .. }));

        // A tool-call block between the answer and the message closure.
        let mut ids = tok.encode("cd", false);
        ids.push(m.close);
        ids.extend(tok.encode("response", false));
        ids.extend([m.sep, m.open]);
        ids.extend(tok.encode("tools", false));
        ids.push(m.sep);
        let err = parse_strict(tok, &m, &ids, false).expect_err("tools block");
        assert!(matches!(err, ParseError::SpecialInPayload { .. }));
    }
}

#[test]
fn strict_parse_reports_truncation_with_partial_text() {
    let tiny = tiny();
    for tok in [release(), &tiny] {
        let m = Markers::resolve(tok).expect("markers");
        let full = completion(tok, Some(REASONING), "473, 921, 235", m.end_of_msg);
        for cut in 0..full.len() - 1 {
            let err = parse_strict(tok, &m, &full[..cut], true).expect_err("truncated");
            assert!(
                matches!(err, ParseError::Incomplete { len, .. } if len == cut),
                "cut {cut}: {err:?}"
            );
            assert!(err.partial().is_some());
        }
        // Cut inside the answer: reasoning complete, answer partial.
        let r = tok.encode(REASONING, false).len();
        let head = r + 4 + tok.encode("think", false).len() + tok.encode("response", false).len();
        let cut = head + tok.encode("473, ", false).len();
        let err = parse_strict(tok, &m, &full[..cut], true).expect_err("truncated");
        assert_eq!(
            err.partial(),
            Some(&ParsedTurn {
                reasoning: Some(REASONING.to_owned()),
                content: "473, ".to_owned()
            })
        );
        // Cut inside the reasoning.
        let cut = tok.encode("I'll remember", false).len();
        let err = parse_strict(tok, &m, &full[..cut], true).expect_err("truncated");
        assert_eq!(
            err.partial(),
            Some(&ParsedTurn {
                reasoning: Some("I'll remember".to_owned()),
                content: String::new()
            })
        );
        assert!(err.to_string().contains("incomplete"));
    }
}

#[test]
fn channel_words_follow_the_tokenizer() {
    let tok = release();
    assert_eq!(channel_word(tok, TAG_THINK), Ok(vec![39964]));
    assert_eq!(channel_word(tok, TAG_RESPONSE), Ok(vec![12092]));
    assert_eq!(channel_word(tok, TAG_MESSAGE), Ok(vec![2778]));
    let tiny = tiny();
    assert_eq!(channel_word(&tiny, TAG_THINK).expect("bytes").len(), 5);
}

// ---- Tolerant parsing ----

const STREAM: &str = "<|open|>think<|sep|>I think <b>.<|close|>think<|sep|>\
        <|open|>response<|sep|>Answer <|x> <|close|>respons.<|close|>response<|sep|>\
        <|close|>message<|sep|>";

fn has_marker_fragment(s: &str) -> bool {
    HELD_MARKERS.iter().any(|m| s.contains(m)) || s.ends_with('<') || s.ends_with("<|")
}

#[test]
fn tolerant_parser_never_shows_a_split_marker() {
    let mut p = TolerantParser::new(true);
    let final_reasoning = "I think <b>.";
    let final_content = "Answer <|x> <|close|>respons.";
    for c in STREAM.chars() {
        p.push(&c.to_string());
        assert!(
            final_reasoning.starts_with(p.reasoning()),
            "{:?}",
            p.reasoning()
        );
        assert!(final_content.starts_with(p.content()), "{:?}", p.content());
        assert!(!has_marker_fragment(p.reasoning()));
    }
    assert_eq!(p.reasoning(), final_reasoning);
    assert_eq!(p.content(), final_content);
    assert_eq!(p.phase(), Phase::Done);
    assert_eq!(p.held_back(), "");
}

#[test]
fn tolerant_parser_phases_and_holdback() {
    let mut p = TolerantParser::new(true);
    p.push("<|open|>thi");
    assert_eq!((p.reasoning(), p.held_back()), ("", "<|open|>thi"));
    p.push("nk<|sep|>abc<|clo");
    assert_eq!(p.reasoning(), "abc");
    assert_eq!(p.held_back(), "<|clo");
    assert_eq!(p.phase(), Phase::Reasoning);
    p.push("se|>think<|sep|>");
    assert_eq!(p.phase(), Phase::BetweenChannels);
    p.push("<|open|>response<|sep|>x <|");
    assert_eq!((p.phase(), p.content()), (Phase::Response, "x "));
    p.push("open|>tools<|sep|>call");
    assert_eq!((p.phase(), p.content()), (Phase::Tools, "x "));
    p.push("<|end_of_msg|>more");
    assert_eq!(p.phase(), Phase::Done);
    assert_eq!(p.content(), "x ");

    // A think opener is stripped only at the very start.
    let mut p = TolerantParser::new(true);
    p.push("a<|open|>think<|sep|>b");
    p.finish();
    assert_eq!(p.reasoning(), "a<|open|>think<|sep|>b");

    // No think closure, but an answer opener: reasoning is what came before.
    let mut p = TolerantParser::new(true);
    p.push("r<|open|>response<|sep|>c");
    assert_eq!((p.reasoning(), p.content()), ("r", "c"));

    // Thinking off starts in the answer; finish releases held text.
    let mut p = TolerantParser::new(false);
    p.push("hi <|clo");
    assert_eq!(p.content(), "hi ");
    p.finish();
    assert_eq!(p.content(), "hi <|clo");
    assert_eq!(p.reasoning(), "");

    let mut p = TolerantParser::new(false);
    p.push("ok<|close|>response<|sep|>");
    assert_eq!(p.phase(), Phase::AfterResponse);
    p.push("<|close|>message<|sep|>");
    assert_eq!((p.phase(), p.content()), (Phase::Done, "ok"));
}

#[test]
fn tolerant_parser_handles_multibyte_text() {
    let mut p = TolerantParser::new(false);
    for c in "héllo 你好 <|end_of_msg|>".chars() {
        p.push(&c.to_string());
    }
    assert_eq!(p.content(), "héllo 你好 ");
    assert_eq!(p.phase(), Phase::Done);
}

/// Small deterministic generator for the robustness tests.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) as usize) % n.max(1)
    }
}

#[test]
fn parsers_never_panic_on_arbitrary_input() {
    let tok = tiny();
    let m = Markers::resolve(&tok).expect("markers");
    let good = completion(&tok, Some("r"), "c", m.eos);
    let mut pool: Vec<u32> = good.clone();
    pool.extend([0, 1, 255, 256, 257, 258, 259, 260, 261, 511, 512, u32::MAX]);
    let pieces = [
        "<",
        "<|",
        "|>",
        "<|open|>",
        "<|close|>",
        "<|sep|>",
        "think",
        "response",
        "tools",
        "message",
        "<|end_of_msg|>",
        "é",
        "你",
        "🚀",
        "x",
        " ",
    ];
    let mut rng = Lcg(7);
    for _ in 0..3000 {
        let len = rng.next(40);
        let ids: Vec<u32> = (0..len).map(|_| pool[rng.next(pool.len())]).collect();
        let thinking = rng.next(2) == 0;
        if let Err(e) = parse_strict(&tok, &m, &ids, thinking) {
            let _ = e.to_string();
        }
        let mut p = TolerantParser::new(thinking);
        let mut shown = String::new();
        for _ in 0..rng.next(30) {
            p.push(pieces[rng.next(pieces.len())]);
            let now = format!("{}\u{0}{}", p.reasoning(), p.content());
            assert!(now.len() >= shown.len());
            shown = now;
        }
        p.finish();
        assert_eq!(p.held_back(), "");
    }
}

// ---- API requests: tools, tool choice, response format ----

use super::tools::{
    parse_api_completion, render_api_segments, ApiMessage, ApiOptions, ApiRole, ResponseFormat,
    ToolCall, ToolChoice,
};

fn api(msgs: &[Message]) -> Vec<ApiMessage> {
    msgs.iter()
        .map(|m| {
            let role = match m.role {
                Role::System => ApiRole::System,
                Role::User => ApiRole::User,
                Role::Assistant => ApiRole::Assistant,
            };
            let mut a = ApiMessage::new(role, m.content.clone());
            a.reasoning.clone_from(&m.reasoning);
            a
        })
        .collect()
}

fn with(render: RenderOptions) -> ApiOptions {
    ApiOptions {
        render,
        ..ApiOptions::default()
    }
}

#[test]
fn an_api_request_without_tools_renders_as_the_chat_does() {
    let tok = release();
    let m = Markers::resolve(tok).expect("markers");
    for opts in [RenderOptions::default(), off()] {
        for gen in [true, false] {
            let chat = render(tok, &worked_example(), &opts, gen).expect("chat");
            let segs = render_api_segments(&api(&worked_example()), &with(opts), gen).expect("api");
            assert_eq!(encode_segments(tok, &m, &segs).expect("ids"), chat);
        }
    }
    // The golden of docs/runtime.md#worked-example, thinking off, through the API renderer.
    let segs = render_api_segments(&api(&worked_example()), &with(off()), true).expect("api");
    assert_eq!(
        encode_segments(tok, &m, &segs).expect("ids"),
        THINKING_OFF_64
    );
}

const WEATHER: &str = r#"[{"type":"function","function":{"name":"get_weather","description":"Weather — now","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]"#;

#[test]
fn tools_choice_and_format_messages_follow_the_release() {
    let opts = ApiOptions {
        render: off(),
        tools: Some(WEATHER.into()),
        tool_choice: ToolChoice::Required,
        response_format: ResponseFormat::JsonSchema(r#"{"type":"object","a":1}"#.into()),
    };
    let msgs = [ApiMessage::new(ApiRole::User, "Weather in Paris?")];
    let segs = render_api_segments(&msgs, &opts, true).expect("segments");
    let t = texts(&segs);
    // The declaration first: role, type, then the body.
    assert_eq!(
        t[..11],
        [
            OPEN,
            "message",
            " role",
            "=\"",
            "system",
            "\"",
            " type",
            "=\"",
            "tool-declare",
            "\"",
            SEP
        ]
    );
    assert_eq!(
        t[11],
        "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n\
             [{\"function\":{\"description\":\"Weather — now\",\"name\":\"get_weather\",\
             \"parameters\":{\"properties\":{\"city\":{\"type\":\"string\"}},\"type\":\"object\"}},\
             \"type\":\"function\"}]\n```"
    );
    let bodies: Vec<&str> = segs
        .iter()
        .filter(|s| !s.allow_special && s.text.len() > 40)
        .map(|s| s.text.as_str())
        .collect();
    assert_eq!(bodies.len(), 3, "{bodies:?}");
    assert_eq!(
        bodies[1],
        "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next \
             message."
    );
    assert!(bodies[2].starts_with("The system is invoked with `response_format=json_object`."));
    assert!(bodies[2].ends_with(
            "\nThe JSON data must match the following schema:\n```json\n{\"a\":1,\"type\":\"object\"}\n```"
        ));
    // Order: declaration, the user message, tool choice, format, generation prompt.
    let user_at = t
        .iter()
        .position(|x| *x == "Weather in Paris?")
        .expect("user");
    let choice_at = t.iter().position(|x| *x == bodies[1]).expect("choice");
    assert!(user_at < choice_at);
    assert_eq!(t[t.len() - 3..], [OPEN, "response", SEP]);
    // Bad JSON is refused with its part named.
    let bad = ApiOptions {
        tools: Some("[{".into()),
        ..with(off())
    };
    let e = render_api_segments(&msgs, &bad, true).expect_err("bad tools");
    assert!(e.to_string().starts_with("tools is not valid JSON"), "{e}");
}

#[test]
fn tool_calls_render_and_parse_back_on_the_released_layout() {
    let tok = release();
    let m = Markers::resolve(tok).expect("markers");
    let calls = vec![
        ToolCall {
            id: "call_1".into(),
            name: "get_weather".into(),
            arguments: r#"{"city":"Paris","days":3,"opts":{"b":1,"a":[true,null]}}"#.into(),
        },
        ToolCall {
            id: "call_2".into(),
            name: "free_form".into(),
            arguments: "not json at all".into(),
        },
    ];
    for thinking in [true, false] {
        let opts = with(RenderOptions {
            thinking,
            effort: Effort::Max,
        });
        let user = ApiMessage::new(ApiRole::User, "Weather?");
        let mut reply = ApiMessage::new(ApiRole::Assistant, "Let me look.");
        reply.reasoning = Some(REASONING.into());
        reply.tool_calls.clone_from(&calls);
        let prompt = encode_segments(
            tok,
            &m,
            &render_api_segments(std::slice::from_ref(&user), &opts, true).expect("prompt"),
        )
        .expect("ids");
        let all = encode_segments(
            tok,
            &m,
            &render_api_segments(&[user, reply], &opts, false).expect("history"),
        )
        .expect("ids");
        assert!(all.starts_with(&prompt));
        let completion = &all[prompt.len()..];
        // The released ids of the block's skeleton.
        assert!(completion
            .windows(4)
            .any(|w| w == [163588, 12092, 163589, 163587]));
        assert_eq!(completion.last(), Some(&RELEASED_END_OF_MSG_ID));
        // The strict parser of a text-only turn refuses the tools block …
        assert!(parse_strict(tok, &m, completion, thinking).is_err());
        // … the API parser reads it.
        let turn = parse_api_completion(tok, &m, completion, thinking).expect("tool turn");
        assert_eq!(turn.turn.content, "Let me look.");
        assert_eq!(
            turn.turn.reasoning.as_deref(),
            thinking.then_some(REASONING)
        );
        assert_eq!(turn.tool_calls, calls);
        // Ended with [EOS] instead: accepted too.
        let mut eos = completion.to_vec();
        *eos.last_mut().expect("end id") = RELEASED_EOS_ID;
        assert!(parse_api_completion(tok, &m, &eos, thinking).is_ok());
        // Cut inside the block: refused, the answer kept for display.
        let cut = &completion[..completion.len() - 8];
        let e = parse_api_completion(tok, &m, cut, thinking).expect_err("cut");
        assert_eq!(
            e.partial().map(|p| p.content.as_str()),
            Some("Let me look.")
        );
    }
    // A plain turn still parses, with no calls.
    let plain = completion(tok, Some("r"), "c", RELEASED_EOS_ID);
    let turn = parse_api_completion(tok, &m, &plain, true).expect("plain");
    assert!(turn.tool_calls.is_empty());
    assert_eq!(turn.turn.content, "c");
}

#[test]
fn argument_values_are_typed_and_tool_results_follow_the_calls() {
    let mut b = Builder::default();
    super::tools::render_arguments(
        &mut b,
        r#"{"s":"é \"q\"","n":1.5,"o":{"z":1,"a":"é"},"l":[1,"x"],"t":true,"u":null}"#,
    );
    let t = texts(&b.segments);
    let value = |key: &str| {
        let at = t
            .windows(3)
            .position(|w| w[0] == " key" && w[2] == key)
            .unwrap_or_else(|| panic!("{key} missing: {t:?}"));
        (t[at + 6], t[at + 9])
    };
    assert_eq!(value("s"), ("string", "é \"q\""));
    assert_eq!(value("n"), ("number", "1.5"));
    assert_eq!(value("o"), ("object", "{\"z\": 1, \"a\": \"\\u00e9\"}"));
    assert_eq!(value("l"), ("array", "[1, \"x\"]"));
    assert_eq!(value("t"), ("boolean", "true"));
    assert_eq!(value("u").0, "null");

    let mut call = ApiMessage::new(ApiRole::Assistant, "");
    for (id, name) in [("x", "first"), ("y", "second")] {
        call.tool_calls.push(ToolCall {
            id: id.into(),
            name: name.into(),
            arguments: "{}".into(),
        });
    }
    let result = |id: &str, text: &str| {
        let mut r = ApiMessage::new(ApiRole::Tool, text);
        r.tool_call_id = Some(id.into());
        r
    };
    let msgs = [call, result("y", "two"), result("x", "one")];
    let t_segs = render_api_segments(&msgs, &with(off()), false).expect("segments");
    let t = texts(&t_segs);
    let one = t.iter().position(|x| *x == "one").expect("one");
    let two = t.iter().position(|x| *x == "two").expect("two");
    assert!(one < two, "results follow the order of the calls");
    assert_eq!(
        t[one - 13..one - 4],
        [" role", "=\"", "tool", "\"", " tool", "=\"", "first", "\"", " index"]
    );
    assert_eq!(t[one - 3], "1");
    assert_eq!(t[two - 3], "2");
    assert!(ApiRole::parse("wizard").is_err());
}
