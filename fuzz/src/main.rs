//! `k3-afl TARGET`: one coverage-guided fuzz target under AFL++ (`cargo afl fuzz … --
//! target/release/k3-afl TARGET`). The targets are `k3-fuzz`'s (`src/bin/k3-fuzz/targets.rs`,
//! compiled in here), with the same invariants asserted on every accepted input; a panic is a
//! crash, and so is an input whose parse holds more than 64 MiB at once. `k3-afl list` names
//! the targets. See docs/fuzzing.md.

#[path = "../../src/bin/k3-fuzz/targets.rs"]
#[allow(dead_code)]
mod targets;

use peak_alloc::PeakAlloc;

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

/// Most bytes one input's parse may hold at once, beyond what was held before it.
const MAX_ALLOC: usize = 64 << 20;

fn main() {
    let name = std::env::args().nth(1).unwrap_or_default();
    if name == "list" || name.is_empty() {
        for t in targets::TARGETS {
            println!("{}\t{}", t.name, t.about);
        }
        std::process::exit(if name.is_empty() { 2 } else { 0 });
    }
    let Some(target) = targets::TARGETS.iter().find(|t| t.name == name) else {
        eprintln!("k3-afl: no target {name:?} (k3-afl list names them)");
        std::process::exit(2);
    };
    if target.name == "session_decode" {
        // Session seeds carry the identity of the model they were saved with.
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fuzz/corpus/session_decode");
        if let Some(seed) = std::fs::read_dir(dir)
            .ok()
            .and_then(|mut d| d.next())
            .and_then(|e| e.ok())
            .and_then(|e| std::fs::read(e.path()).ok())
        {
            targets::learn_identity(&seed);
        }
    }
    let run = target.run;
    afl::fuzz!(|data: &[u8]| {
        let before = ALLOC.current_usage();
        ALLOC.reset_peak_usage();
        let _ = run(data);
        let held = ALLOC.peak_usage().saturating_sub(before);
        assert!(
            held <= MAX_ALLOC,
            "one input held {held} bytes at once (bound {MAX_ALLOC})"
        );
    });
}
