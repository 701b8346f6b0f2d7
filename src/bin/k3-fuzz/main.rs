//! `k3-fuzz`: a fuzz harness for every parser of untrusted bytes, on the stable toolchain.
//!
//! A seeded, structure-aware mutation loop (`mutate.rs`) over a committed seed corpus
//! (`tests/fuzz/corpus/TARGET/`): each input is run under `catch_unwind` (a panic is a crash,
//! and the input is written out), and every allocation is counted by a global allocator that
//! keeps a high-water mark which the harness lowers to the current usage before each input
//! (the `peak_alloc` crate), so that an input whose parse holds more than the bound at once,
//! beyond the harness's own memory, is a crash too. Inputs that reach a new outcome (a new kind
//! of refusal, or acceptance) join the corpus. No coverage instrumentation: the toolchain's
//! sanitizer and coverage hooks need nightly or an AFL/libFuzzer build, which cannot be
//! fetched here.
//!
//! `k3-fuzz TARGET|all [--execs N] [--seed S] [--max-alloc-mb M] [--corpus DIR]
//! [--crashes DIR] [--outcomes]`, `k3-fuzz TARGET --replay FILE…`, `k3-fuzz list`.

mod mutate;
mod targets;

use clap::Parser;
use peak_alloc::PeakAlloc;
use rustc_hash::FxHashSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

/// Largest input the mutator makes: this, or twice the largest seed.
const MAX_INPUT: usize = 64 << 10;
/// Most inputs kept per target.
const MAX_CORPUS: usize = 2048;
/// A progress line on stderr every this many inputs.
const PROGRESS_EVERY: u64 = 1_000_000;

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "k3-fuzz",
    about = "A fuzz harness for every parser of untrusted bytes (docs/fuzzing.md)",
    after_help = "`k3-fuzz list` names the targets; `k3-fuzz TARGET --replay FILE...` runs saved inputs."
)]
struct Options {
    /// A target (`k3-fuzz list` names them), `all` for every target, or `list`.
    target: String,
    /// Inputs to run per target, the seeds included.
    #[arg(long, value_name = "N", default_value = "100000", value_parser = number)]
    execs: u64,
    /// Seed of the mutator's random stream.
    #[arg(long, value_name = "S", default_value = "1", value_parser = number)]
    seed: u64,
    /// Most one input may hold allocated at once, in MiB, beyond what the harness holds; more
    /// is a crash.
    #[arg(long = "max-alloc-mb", value_name = "M", default_value = "64", value_parser = number)]
    max_alloc_mb: u64,
    /// The seed corpus: one folder per target.
    #[arg(long, value_name = "DIR", default_value_os_t = default_corpus())]
    corpus: PathBuf,
    /// Where a crashing input is written.
    #[arg(long, value_name = "DIR", default_value = "fuzz-crashes")]
    crashes: PathBuf,
    /// Print every distinct outcome reached at the end.
    #[arg(long = "outcomes")]
    show_outcomes: bool,
    /// Run these inputs once each and print their outcomes instead of fuzzing.
    #[arg(long, value_name = "FILE", num_args = 1..)]
    replay: Vec<PathBuf>,
}

impl Options {
    /// The allocation bound in bytes.
    fn max_alloc(&self) -> usize {
        usize::try_from(self.max_alloc_mb)
            .unwrap_or(usize::MAX)
            .saturating_mul(1 << 20)
    }
}

/// The committed seed corpus.
fn default_corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz/corpus")
}

/// A count, with `_` allowed between digits (`10_000_000`).
fn number(s: &str) -> Result<u64, String> {
    s.replace('_', "")
        .parse::<u64>()
        .map_err(|_| format!("{s:?} is not a number"))
}

/// The last panic's message (the hook stores it instead of printing).
static PANIC: Mutex<String> = Mutex::new(String::new());

/// Why an input failed.
enum Crash {
    Panic(String),
    Alloc(usize),
}

struct Stats {
    execs: u64,
    kept: usize,
    outcomes: usize,
    peak_alloc: usize,
}

/// Run one input: its outcome, or the crash. `bound` is the allocation allowed beyond what
/// the harness holds before the input; `peak` keeps the largest seen.
///
/// The high-water mark is lowered to what the harness holds before the input, so it then
/// rises by exactly the input's own peak, and nothing the harness allocates for the
/// measurement grows from one input to the next.
fn exec(
    t: &targets::Target,
    input: &[u8],
    bound: usize,
    peak: &mut usize,
) -> Result<String, Crash> {
    let base = ALLOC.current_usage();
    ALLOC.reset_peak_usage();
    let r = std::panic::catch_unwind(|| (t.run)(input));
    let used = ALLOC.peak_usage().saturating_sub(base);
    *peak = (*peak).max(used);
    if used > bound {
        return Err(Crash::Alloc(used));
    }
    r.map_err(|_| {
        Crash::Panic(
            PANIC
                .lock()
                .map(|m| m.clone())
                .unwrap_or_else(|e| e.into_inner().clone()),
        )
    })
}

fn report_crash(o: &Options, t: &targets::Target, input: &[u8], crash: &Crash) -> ! {
    let _ = std::fs::create_dir_all(&o.crashes);
    let digest = crc32fast::hash(input);
    let path = o.crashes.join(format!("{}-{digest:08x}.bin", t.name));
    let _ = std::fs::write(&path, input);
    let what = match crash {
        Crash::Panic(m) => format!("panic: {m}"),
        Crash::Alloc(n) => format!(
            "allocated {n} bytes for one input, above the bound of {} bytes",
            o.max_alloc()
        ),
    };
    let preview: String = input
        .iter()
        .take(200)
        .map(|&b| b.escape_ascii().to_string())
        .collect();
    eprintln!(
        "k3-fuzz {}: CRASH — {what}\n  input ({} bytes) written to {}\n  starts: {preview}",
        t.name,
        input.len(),
        path.display()
    );
    std::process::exit(1);
}

fn load_seeds(dir: &Path) -> Vec<Vec<u8>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.sort();
    files
        .iter()
        .filter(|p| p.is_file())
        .filter_map(|p| std::fs::read(p).ok())
        .collect()
}

fn fuzz(o: &Options, t: &targets::Target) -> Stats {
    let start = Instant::now();
    let seeds = load_seeds(&o.corpus.join(t.name));
    if seeds.is_empty() {
        eprintln!(
            "k3-fuzz {}: no seed files in {}",
            t.name,
            o.corpus.join(t.name).display()
        );
        std::process::exit(2);
    }
    if t.name == "session_decode" {
        targets::learn_identity(&seeds[0]);
    }
    let max_len = seeds
        .iter()
        .map(Vec::len)
        .max()
        .unwrap_or(0)
        .saturating_mul(2)
        .max(MAX_INPUT);
    let mut corpus = seeds;
    corpus.reserve(MAX_CORPUS);
    let mut seen: FxHashSet<String> = FxHashSet::default();
    let mut peak = 0usize;
    // Room for the longest mutant and the largest single insertion, so that mutating never
    // reallocates.
    let mut input = Vec::with_capacity(2 * max_len + 4096);
    for s in &corpus {
        match exec(t, s, o.max_alloc(), &mut peak) {
            Ok(sig) => {
                seen.insert(sig);
            }
            Err(c) => report_crash(o, t, s, &c),
        }
    }
    let mut rng = mutate::Rng::new(o.seed ^ crc32fast::hash(t.name.as_bytes()) as u64);
    let mut execs = corpus.len() as u64;
    while execs < o.execs {
        let parent = rng.below(corpus.len());
        let other = rng.below(corpus.len());
        mutate::mutate(
            &mut input,
            &corpus[parent],
            &corpus[other],
            t.dict,
            max_len,
            &mut rng,
        );
        if let Some(fix) = t.fixup.filter(|_| rng.below(4) != 0) {
            fix(&mut input);
        }
        execs += 1;
        if execs.is_multiple_of(PROGRESS_EVERY) && execs < o.execs {
            let secs = start.elapsed().as_secs_f64();
            eprintln!(
                "k3-fuzz {}: {execs} execs in {secs:.1} s ({:.0}/s), 0 crashes so far; {} \
                 outcomes, corpus {}",
                t.name,
                execs as f64 / secs.max(1e-9),
                seen.len(),
                corpus.len()
            );
        }
        match exec(t, &input, o.max_alloc(), &mut peak) {
            Ok(sig) => {
                if corpus.len() < MAX_CORPUS && seen.insert(sig) {
                    corpus.push(input.clone());
                }
            }
            Err(c) => report_crash(o, t, &input, &c),
        }
    }
    if o.show_outcomes {
        let mut all: Vec<&String> = seen.iter().collect();
        all.sort();
        for s in all {
            println!("  {s}");
        }
    }
    Stats {
        execs,
        kept: corpus.len(),
        outcomes: seen.len(),
        peak_alloc: peak,
    }
}

fn main() {
    let o = Options::parse();
    if o.target == "list" {
        for t in targets::TARGETS {
            println!("{:<16} {}", t.name, t.about);
        }
        return;
    }
    let chosen: Vec<&targets::Target> = targets::TARGETS
        .iter()
        .filter(|t| o.target == "all" || t.name == o.target)
        .collect();
    if chosen.is_empty() {
        eprintln!("k3-fuzz: no target {:?} (k3-fuzz list)", o.target);
        std::process::exit(2);
    }
    std::panic::set_hook(Box::new(|info| {
        if let Ok(mut m) = PANIC.lock() {
            *m = info.to_string();
        }
    }));
    for t in chosen {
        if !o.replay.is_empty() {
            if t.name == "session_decode" {
                targets::learn_identity(&load_seeds(&o.corpus.join(t.name))[0]);
            }
            let mut peak = 0;
            for f in &o.replay {
                let input = std::fs::read(f).unwrap_or_else(|e| {
                    eprintln!("k3-fuzz: {}: {e}", f.display());
                    std::process::exit(2);
                });
                match exec(t, &input, o.max_alloc(), &mut peak) {
                    Ok(sig) => println!("{}: {sig}", f.display()),
                    Err(c) => report_crash(&o, t, &input, &c),
                }
            }
            continue;
        }
        let start = Instant::now();
        let s = fuzz(&o, t);
        let secs = start.elapsed().as_secs_f64();
        println!(
            "k3-fuzz {}: {} execs in {secs:.1} s ({:.0}/s), 0 crashes; {} outcomes, corpus {}, \
             largest allocation by one input {:.1} KiB (bound {} MiB)",
            t.name,
            s.execs,
            s.execs as f64 / secs.max(1e-9),
            s.outcomes,
            s.kept,
            s.peak_alloc as f64 / 1024.0,
            o.max_alloc_mb
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOLD: usize = 1 << 30;
    const SLACK: usize = 1 << 20;

    /// Holds 1 GiB (address space only: never written) while it runs.
    fn hold_1_gib(_: &[u8]) -> String {
        let v: Vec<u8> = Vec::with_capacity(HOLD);
        std::hint::black_box(&v);
        String::from("held")
    }

    #[test]
    fn each_input_is_measured_alone_and_the_measurement_does_not_grow() {
        // 200 inputs of 1 GiB each: were the measurement to carry each input's peak into the
        // next (a block lifting usage up to a mark that only rises), the harness itself would
        // hold k GiB during input k, and ask for 200 GiB by the end.
        let t = targets::Target {
            name: "hold",
            about: "",
            dict: &[],
            run: hold_1_gib,
            fixup: None,
        };
        let before = ALLOC.current_usage();
        for _ in 0..200 {
            let mut peak = 0;
            match exec(&t, b"", usize::MAX, &mut peak) {
                Ok(sig) => assert_eq!(sig, "held"),
                Err(_) => panic!("the input crashed"),
            }
            // Other tests' threads allocate and free too: a MiB of slack either way.
            assert!((HOLD - SLACK..HOLD + SLACK).contains(&peak), "{peak}");
            // The most held at once during that input: the input's block and nothing else.
            let held = ALLOC.peak_usage().saturating_sub(before);
            assert!(
                held < HOLD + SLACK,
                "{held} bytes held for one input of {HOLD}"
            );
        }
        let after = ALLOC.current_usage();
        assert!(after < before + SLACK, "{before} → {after}");
        // Past the bound is a crash, with what was held.
        let mut peak = 0;
        match exec(&t, b"", SLACK, &mut peak) {
            Err(Crash::Alloc(n)) => assert!(n >= HOLD - SLACK, "{n}"),
            _ => panic!("1 GiB passed a 1 MiB bound"),
        }
    }
}
