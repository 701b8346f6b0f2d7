//! The embedded demo model, run by the Rust engine: its logits agree with the training
//! framework's, it answers held-out facts, recalls in turn 3 what turn 1 said (also across
//! save and resume), and continues raw text without leaking special tokens.

use crate::common::fixture;
use k3::engine::model::Logits;
use k3::engine::{Model, SeqState};
use k3::session::chat::{Mode, Session, Settings};
use k3::session::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::OnceLock;

/// The embedded model, materialised once into a scratch cache directory.
fn demo_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let scratch = crate::common::process_scratch("demo");
        k3::app::demo::materialise_in(&scratch).unwrap()
    })
}

fn model() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| Model::load(demo_dir()).unwrap())
}

fn tok() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::load(demo_dir()).unwrap())
}

/// Held-out fact questions the demo must answer (of 50).
const FACTS_MIN: usize = 45;
/// Recall conversations (of 10: 6 names, 4 numbers) the demo must get right in turn 3.
const RECALL_MIN: usize = 9;
/// Raw prompts (of 5) whose continuation must be all corpus words.
const RAW_MIN: usize = 5;

fn heldout() -> serde_json::Value {
    crate::common::json("demo/heldout.json")
}

fn greedy() -> Settings {
    Settings {
        sampler: k3::engine::sampling::SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        },
        max_tokens: 64,
        thinking: false,
        ..Settings::default()
    }
}

/// Lowercase, every character that is not a letter, digit or space becomes a space, runs of
/// spaces collapse (the held-out set's scoring rule).
fn normalise(s: &str) -> String {
    let t: String = s
        .to_lowercase()
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || c == ' ' {
                c
            } else {
                ' '
            }
        })
        .collect();
    t.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A reply is correct when it ends with `expect` at a word boundary and mentions every word
/// of `mention`.
fn score(reply: &str, expect: &str, mention: &[String]) -> bool {
    let (r, e) = (normalise(reply), normalise(expect));
    if !(r == e || r.ends_with(&format!(" {e}"))) {
        return false;
    }
    let words: Vec<&str> = r.split(' ').collect();
    mention
        .iter()
        .all(|m| words.contains(&normalise(m).as_str()))
}

fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .map(|a| a.iter().map(|x| x.as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

fn no_cancel() -> AtomicBool {
    AtomicBool::new(false)
}

#[test]
fn logits_agree_with_the_training_framework() {
    let doc = crate::common::json("demo/expected_logits.json");
    let tol = doc["tolerance"].as_f64().unwrap();
    let m = model();
    let mut worst = 0.0f64;
    for p in doc["prompts"].as_array().unwrap() {
        let ids = crate::common::u32s(&p["ids"]);
        let want: Vec<f64> = p["logits_last"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let mut st = SeqState::new(&m.cfg);
        let got = m.forward(&mut st, &ids, Logits::Last).unwrap();
        assert_eq!(got.len(), want.len());
        let scale = want.iter().fold(0.0f64, |a, &b| a.max(b.abs()));
        let err = got
            .iter()
            .zip(&want)
            .fold(0.0f64, |a, (&g, &w)| a.max((f64::from(g) - w).abs()))
            / scale;
        worst = worst.max(err);
        let name = p["name"].as_str().unwrap();
        assert!(err <= tol, "{name}: relative error {err:e} above {tol:e}");
        assert_eq!(
            u64::from(crate::common::argmax(&got)),
            p["argmax"].as_u64().unwrap(),
            "{name}"
        );
    }
    println!("demo logits: worst relative error {worst:.2e} (tolerance {tol:e})");
}

#[test]
fn answers_held_out_facts_and_recalls_what_turn_one_said() {
    let held = heldout();
    let facts = held["facts"].as_array().unwrap();
    let mut sess = Session::new(model(), tok(), greedy()).unwrap();
    let mut right = 0;
    for f in facts {
        sess.reset().unwrap();
        let q = f["question"].as_str().unwrap();
        let r = sess.send(q, &no_cancel(), &mut |_, _| {}).unwrap();
        let ok = score(
            &r.reply,
            f["expect"].as_str().unwrap(),
            &strings(&f["mention"]),
        );
        if !ok {
            println!("miss: {q:?} -> {:?}", r.reply);
        }
        right += usize::from(ok);
        assert!(r.generated_ids.iter().all(|&id| id < tok().vocab_size()));
    }
    println!("held-out facts: {right}/{}", facts.len());
    assert!(right >= FACTS_MIN, "{right}/{} held-out facts", facts.len());

    let recall = held["recall"].as_array().unwrap();
    let mut remembered = 0;
    for c in recall {
        sess.reset().unwrap();
        let turns = strings(&c["turns"]);
        let mut last = String::new();
        for t in &turns {
            last = sess.send(t, &no_cancel(), &mut |_, _| {}).unwrap().reply;
        }
        let ok = score(&last, c["expect"].as_str().unwrap(), &[]);
        if !ok {
            println!("miss: {turns:?} -> {last:?}");
        }
        remembered += usize::from(ok);
    }
    println!("recall in turn 3: {remembered}/{}", recall.len());
    assert!(
        remembered >= RECALL_MIN,
        "{remembered}/{} recalled",
        recall.len()
    );
}

/// The demo's own sampling defaults (its generation_config.json, chosen by measurement: see
/// docs/sampling.md#the-demo-models-defaults) greet by name and recall it in turn 3 across
/// seeds that were not used to choose them.
#[test]
fn the_demo_defaults_greet_and_recall_held_out_names_across_seeds() {
    use k3::session::defaults::{self, GenerationConfig, Source};
    let gen = GenerationConfig::load(demo_dir())
        .unwrap()
        .expect("the demo ships one");
    assert!(gen.notes.is_empty(), "{:?}", gen.notes);
    let (base, from) = defaults::resolve(defaults::built_in(), &[(Source::Model, &gen.layer)]);
    assert_eq!(from.of("temperature"), Source::Model);
    assert!(base.sampler.temperature > 0.0, "the demo samples");
    let held = heldout();
    let recall = held["recall"].as_array().unwrap();
    let names = recall.iter().filter(|c| c["slot"] == "name").count();
    let (mut greeted_all, mut recalled_all, mut runs) = (0, 0, 0);
    for seed in [21, 22, 23, 24] {
        let settings = Settings {
            sampler: k3::engine::sampling::SamplerConfig {
                seed,
                ..base.sampler
            },
            max_tokens: 64,
            ..base.clone()
        };
        let mut sess = Session::new(model(), tok(), settings).unwrap();
        let (mut greeted, mut recalled) = (0, 0);
        for c in recall {
            sess.reset().unwrap();
            let turns = strings(&c["turns"]);
            let mut replies = Vec::new();
            for t in &turns {
                replies.push(sess.send(t, &no_cancel(), &mut |_, _| {}).unwrap().reply);
            }
            let value = c["value"].as_str().unwrap();
            if c["slot"] == "name" {
                let ok = normalise(&replies[0])
                    .split(' ')
                    .any(|w| w == normalise(value));
                if !ok {
                    println!(
                        "seed {seed}: no greeting by name: {:?} -> {:?}",
                        turns[0], replies[0]
                    );
                }
                greeted += usize::from(ok);
            }
            let ok = score(&replies[2], c["expect"].as_str().unwrap(), &[]);
            if !ok {
                println!("seed {seed}: miss: {turns:?} -> {:?}", replies[2]);
            }
            recalled += usize::from(ok);
        }
        println!(
            "seed {seed}: greeted {greeted}/{names}, recalled {recalled}/{}",
            recall.len()
        );
        assert!(
            greeted + 2 >= names,
            "seed {seed}: greeted {greeted}/{names}"
        );
        assert!(
            recalled + 2 >= recall.len(),
            "seed {seed}: recalled {recalled}/{}",
            recall.len()
        );
        greeted_all += greeted;
        recalled_all += recalled;
        runs += 1;
    }
    // Over the seeds, close to the measurement that chose the settings (83% of greetings, 89%
    // of recalls over 8 seeds; temperature 1.0 gave 54% and 72%).
    assert!(
        greeted_all * 100 >= 75 * names * runs,
        "greeted {greeted_all}/{}",
        names * runs
    );
    assert!(
        recalled_all * 100 >= 85 * recall.len() * runs,
        "recalled {recalled_all}/{}",
        recall.len() * runs
    );
}

/// Run `k3 chat --plain --jsonl --greedy --no-think` on the embedded model with `input`.
fn chat(args: &[&str], input: &str, sessions: &Path, cache: &Path) -> Vec<serde_json::Value> {
    crate::common::jsonl_with_input(
        crate::common::k3_command()
            .args(["chat", "--plain", "--jsonl", "--greedy", "--no-think"])
            .arg("--session-dir")
            .arg(sessions)
            .args(args)
            .env("K3_CACHE_DIR", cache)
            .env("XDG_CONFIG_HOME", cache.join("no-config")),
        input,
    )
}

#[test]
fn recall_survives_save_and_resume_between_turns_two_and_three() {
    let held = heldout();
    let tmp = tempfile::tempdir().unwrap();
    let (sessions, cache) = (tmp.path().join("sessions"), tmp.path().join("cache"));
    let mut remembered = 0;
    let recall = held["recall"].as_array().unwrap();
    for (i, c) in recall.iter().enumerate() {
        let turns = strings(&c["turns"]);
        let whole = chat(&[], &format!("{}\n", turns.join("\n")), &sessions, &cache);
        assert_eq!(whole.len(), 3);
        let name = format!("recall-{i}");
        let first = chat(
            &[],
            &format!("{}\n{}\n/save {name}\n", turns[0], turns[1]),
            &sessions,
            &cache,
        );
        assert_eq!(first.len(), 2);
        let rest = chat(
            &["--resume", &name],
            &format!("{}\n", turns[2]),
            &sessions,
            &cache,
        );
        assert_eq!(rest.len(), 1);
        assert_eq!(
            rest[0]["generated_ids"], whole[2]["generated_ids"],
            "{turns:?}"
        );
        let (prefilled, prompt) = (
            rest[0]["prefilled_tokens"].as_u64().unwrap(),
            rest[0]["prompt_ids"].as_array().unwrap().len() as u64,
        );
        assert!(
            prefilled * 2 < prompt,
            "the resumed turn re-reads only its own tail ({prefilled} of {prompt})"
        );
        let reply = rest[0]["reply"].as_str().unwrap();
        remembered += usize::from(score(reply, c["expect"].as_str().unwrap(), &[]));
    }
    println!("recall after save/resume: {remembered}/{}", recall.len());
    assert!(
        remembered >= RECALL_MIN,
        "{remembered}/{} recalled after resume",
        recall.len()
    );
}

#[test]
fn raw_mode_continues_held_out_text_in_vocabulary() {
    let words: std::collections::HashSet<String> =
        std::fs::read_to_string(fixture("demo/words.txt"))
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect();
    let held = heldout();
    let mut sess = Session::new(
        model(),
        tok(),
        Settings {
            raw_max_tokens: 24,
            ..greedy()
        },
    )
    .unwrap();
    let mut clean = 0;
    for p in strings(&held["raw_prompts"]) {
        sess.reset().unwrap();
        sess.set_mode(Mode::Raw);
        let r = sess.send(&p, &no_cancel(), &mut |_, _| {}).unwrap();
        // 24 tokens, or fewer ending on an end-of-text id (not shown).
        let n_ranks = tok().vocab_size() - 256;
        let body = match r.generated_ids.split_last() {
            Some((&last, body)) if last >= n_ranks => {
                let ends = [
                    tok().special_id("[EOS]"),
                    tok().special_id("<|end_of_msg|>"),
                ];
                assert!(ends.contains(&Some(last)), "{p:?}: ended on {last}");
                body
            }
            _ => {
                assert_eq!(r.generated_ids.len(), 24);
                &r.generated_ids[..]
            }
        };
        assert!(
            body.iter().all(|&id| id < n_ranks),
            "{p:?}: a special token in {:?}",
            r.reply
        );
        assert!(!r.reply.contains("<|"), "{p:?} -> {:?}", r.reply);
        // Lowercase words come from the training vocabulary; capitalised ones may be sentence
        // starts or names the model makes up, as the corpus taught it. The prompt's last word
        // is read together with the continuation, so a word the model splices on counts.
        let spliced = r.reply.starts_with(|c: char| c.is_ascii_alphabetic());
        let last = if spliced {
            p.rsplit(' ').next().unwrap_or("")
        } else {
            ""
        };
        let text = format!("{last}{}", r.reply);
        let words_seen: Vec<&str> = text
            .split(|c: char| !c.is_ascii_alphabetic())
            .filter(|w| !w.is_empty())
            .collect();
        // The token cap can cut the last word short: a trailing fragment must begin some
        // corpus word.
        let cut = text.ends_with(|c: char| c.is_ascii_alphabetic());
        let unknown: Vec<&str> = words_seen
            .iter()
            .enumerate()
            .filter(|&(i, w)| {
                let known = if cut && i + 1 == words_seen.len() {
                    words.iter().any(|v| v.starts_with(w))
                } else {
                    words.contains(*w)
                };
                w.starts_with(|c: char| c.is_ascii_lowercase()) && !known
            })
            .map(|(_, w)| *w)
            .collect();
        assert!(words_seen.len() >= 4, "{p:?} -> {:?}", r.reply);
        if unknown.is_empty() {
            clean += 1;
        }
        println!("raw: {p:?} ->{:?} unknown words {unknown:?}", r.reply);
    }
    assert!(
        clean >= RAW_MIN,
        "{clean} raw continuations of 5 in vocabulary"
    );
}

#[test]
fn chat_with_no_model_dir_opens_the_demo() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let out = chat(
        &[],
        "What is the capital of France?\n",
        &tmp.path().join("s"),
        &cache,
    );
    assert!(
        score(out[0]["reply"].as_str().unwrap(), "Paris", &[]),
        "{}",
        out[0]["reply"]
    );
    let run = crate::common::run_ok(
        crate::common::k3_command()
            .args([
                "run",
                "--prompt",
                "The capital of Peru is Lima. The capital of Kenya is",
                "--gen",
                "3",
                "--temperature",
                "0",
            ])
            .env("K3_CACHE_DIR", &cache),
    );
    assert!(String::from_utf8_lossy(&run.stdout).contains("Nairobi"));
}

#[test]
fn answer_now_closes_the_thinking_channel_and_the_model_answers() {
    let settings = Settings {
        thinking: true,
        max_tokens: 160,
        ..greedy()
    };
    let mut sess = Session::new(model(), tok(), settings.clone()).unwrap();
    let flag = sess.answer_now_flag();
    let mut text = String::new();
    let mut n = 0;
    let r = sess
        .send(
            "What is the capital of Japan?",
            &no_cancel(),
            &mut |_, t| {
                n += 1;
                text.push_str(t);
                if n == 2 {
                    flag.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            },
        )
        .unwrap();
    // The tokens after the key are the template's close of the thinking channel and the
    // opening of the answer, then the model's own.
    let close = k3::session::template::think_close_ids(tok(), &sess.markers()).unwrap();
    assert_eq!(&r.generated_ids[2..2 + close.len()], close.as_slice());
    let mut p = k3::session::template::TolerantParser::new(true);
    p.push(&text);
    p.finish();
    println!(
        "answer now after 2 thinking tokens: reasoning {:?}, answer {:?}",
        p.reasoning(),
        p.content()
    );
    assert!(!p.content().trim().is_empty(), "no answer after {text:?}");
    if r.accepted {
        assert_eq!(r.reply, p.content());
    }
    // Without the key the same question thinks first; the flag is spent and does not leak
    // into the next reply.
    assert!(!flag.load(std::sync::atomic::Ordering::Relaxed));
}

/// `k3 run` gives the same tokens and the same logits, bit for bit, whichever row order the
/// one-token products walk (fixed by `K3_ROW_ORDER`, or left to the probe), and reports it.
#[test]
fn the_row_order_of_one_token_products_changes_no_token_and_no_logit() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let mut seen: Option<(serde_json::Value, Vec<u8>)> = None;
    for order in ["fours", "single", "auto"] {
        let dump = tmp.path().join(format!("logits-{order}.f32"));
        let out = crate::common::run_ok(
            crate::common::k3_command()
                .args(["run", "--prompt", "The capital of Peru is", "--gen", "24"])
                .args(["--spec", "off", "--json", "--dump-logits"])
                .arg(&dump)
                .env("K3_CACHE_DIR", &cache)
                .env("K3_ROW_ORDER", order),
        );
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let reported = j["kernels"]["row_order"].as_str().unwrap().to_string();
        if order == "auto" {
            assert!(
                ["fours", "single", "probing"].contains(&reported.as_str()),
                "{reported}"
            );
        } else if j["kernels"]["isa"] != "generic" {
            assert_eq!(reported, order);
        }
        crate::common::assert_steal_is_a_fraction(&j);
        let logits = std::fs::read(&dump).unwrap();
        assert_eq!(logits.len(), 24 * 4352 * 4, "{order}: one row per step");
        let ids = j["generated_ids"].clone();
        match &seen {
            None => seen = Some((ids, logits)),
            Some((want_ids, want_logits)) => {
                assert_eq!(&ids, want_ids, "{order}: tokens");
                assert!(&logits == want_logits, "{order}: logits differ");
            }
        }
    }
}
