//! The released shape's packed trunk, measured rather than estimated: `cargo bench --bench
//! released_trunk` (about 11 minutes on 2 cores; 150 MB of disk).
//!
//! `k3 synth k3` writes the released dimensions as a sparse, header-true replica: its data
//! regions are holes, so `k3 pack` cannot measure what the codec stores on them, and a
//! written-out trunk (108.8 GB of BF16) does not fit most disks. This benchmark writes the
//! sparse replica, draws every BF16 tensor of its trunk and output head as `k3 synth` draws
//! them for the shapes it writes out (N(0, s) per tensor, trained-like exponents), encodes
//! them with each codec exactly as `k3 pack` does (`stream::trunk::encoded_manifest`, the
//! same layout and encoder; nothing is written), and prints:
//! - per codec, the trunk's and the head's stored size against their BF16 size;
//! - per budget, the plan `k3 plan --mem GB` makes on the checkpoint alone and on each
//!   trunk: layers pinned and the bytes they are held in (", coded" where their nibble-coded
//!   matrices are held as stored), trunk bytes read a token, whether the head is held.
//!
//! `K3_RELEASED_CODECS=nibble` (or `entropy`) encodes with one codec only.

use k3::engine::config::ModelConfig;
use k3::engine::weights::{model_sizes, names};
use k3::stream::budget::{plan_states, BudgetRequest, ModelSizes};
use k3::stream::codec::Coding;
use k3::stream::trunk::encoded_manifest;
use k3::stream::{Checkpoint, StreamError};
use k3::synth::{self, Draws, Shape};
use std::time::Instant;

/// Budgets planned, GB.
const BUDGETS: [u64; 6] = [8, 12, 16, 32, 64, 100];
/// Positions `k3 plan` reserves by default.
const CONTEXT: u64 = 4096;
/// The seed `k3 synth` writes with by default.
const SEED: u64 = 1;

fn main() {
    if let Err(e) = run() {
        eprintln!("released_trunk: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("k3-released-trunk-{}", std::process::id()));
    let result = measure(&dir);
    // The replica is only headers and holes; it goes whether or not the run succeeded.
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn measure(dir: &std::path::Path) -> Result<(), String> {
    let t0 = Instant::now();
    synth::write(Shape::K3, dir, SEED, &|_, _| {}).map_err(|e| e.to_string())?;
    let cfg = ModelConfig::load(&dir.join("config.json")).map_err(|e| e.to_string())?;
    let ck = Checkpoint::open(dir).map_err(|e| e.to_string())?;
    let raw = model_sizes(&cfg, &ck);
    println!(
        "released shape: {} layers, sparse replica written in {:.1} s",
        cfg.num_hidden_layers,
        t0.elapsed().as_secs_f64()
    );
    let codecs: Vec<Coding> = match std::env::var("K3_RELEASED_CODECS") {
        Ok(v) => (v.split(','))
            .map(|n| match n {
                "nibble" => Ok(Coding::Nibble),
                "entropy" => Ok(Coding::Entropy),
                _ => Err(format!(
                    "K3_RELEASED_CODECS: unknown codec {n:?} (nibble, entropy)"
                )),
            })
            .collect::<Result<_, _>>()?,
        Err(_) => vec![Coding::Nibble, Coding::Entropy],
    };
    let mut rows = vec![("checkpoint (raw)".to_string(), raw.clone(), false)];
    for coding in codecs {
        let t = Instant::now();
        let mut draws = Draws::new(&Shape::K3.dims(), SEED);
        let mut drawn: (String, Vec<u8>) = (String::new(), Vec::new());
        let mut read = |name: &str, at: u64, len: u64, piece: &mut Vec<u8>| {
            if drawn.0 != name {
                let bytes = draws
                    .tensor(name)
                    .ok_or_else(|| StreamError::NoSuchTensor(name.into()))?;
                drawn = (name.to_string(), bytes);
            }
            piece.clear();
            piece.extend_from_slice(&drawn.1[at as usize..(at + len) as usize]);
            Ok(())
        };
        let last = std::cell::Cell::new(0u64);
        let progress = |done: u64, total: u64| {
            let tenth = done * 10 / total.max(1);
            if tenth > last.get() {
                last.set(tenth);
                eprint!("{}: {}0% ", coding.name(), tenth);
            }
        };
        let m = encoded_manifest(
            &ck,
            cfg.num_hidden_layers,
            Some(names::LM_HEAD),
            coding,
            &mut read,
            &progress,
        )
        .map_err(|e| e.to_string())?;
        eprintln!();
        let sum = |runs: &[&k3::stream::trunk::TrunkLayer]| {
            runs.iter()
                .flat_map(|l| l.tensors.values())
                .filter(|t| t.dtype == "BF16")
                .fold((0u64, 0u64), |(a, b), t| (a + t.nbytes, b + t.stored))
        };
        let layers: Vec<_> = m.layers.iter().collect();
        let (lb, ls) = sum(&layers);
        let (hb, hs) = sum(&m.head.iter().collect::<Vec<_>>());
        println!(
            "{} ({}): trunk layers' BF16 {:.2} GB stored in {:.2} GB ({:.4}x); output head \
             {:.3} GB in {:.3} GB ({:.4}x); trunk.bin {:.2} GB; encoded in {:.0} s",
            coding.name(),
            codec_word(coding),
            lb as f64 / 1e9,
            ls as f64 / 1e9,
            ls as f64 / lb.max(1) as f64,
            hb as f64 / 1e9,
            hs as f64 / 1e9,
            hs as f64 / hb.max(1) as f64,
            m.total_bytes as f64 / 1e9,
            t.elapsed().as_secs_f64()
        );
        let mut sizes = raw.clone();
        m.sizes_into(&mut sizes, names::LM_HEAD);
        rows.push((
            format!("{} trunk", codec_word(coding)),
            sizes,
            coding == Coding::Nibble,
        ));
    }
    println!("\nplans (`k3 plan --mem GB`, context {CONTEXT}):");
    for gb in BUDGETS {
        for (what, sizes, nibble) in &rows {
            println!(
                "  {gb:>3} GB, {what:<17} {}",
                plan_line(sizes, *nibble, gb)?
            );
        }
    }
    Ok(())
}

fn codec_word(c: Coding) -> &'static str {
    match c {
        Coding::Entropy => "entropy",
        Coding::Nibble => "nibble",
    }
}

/// Layers pinned, trunk bytes read a token and where the head is, at `gb` GB (`nibble`: the
/// trunk's matrices are nibble-coded, so pinned layers may hold them coded).
fn plan_line(sizes: &ModelSizes, nibble: bool, gb: u64) -> Result<String, String> {
    let req = BudgetRequest::Total(gb * 1_000_000_000);
    let p = plan_states(sizes, req, CONTEXT, 1, None).map_err(|e| e.to_string())?;
    Ok(format!(
        "{:>2} of {} layers pinned ({:5.1} GB held{}), {:6.1} GB of trunk read a token, head {}",
        p.n_pinned(),
        p.pinned.len(),
        p.pinned_bytes as f64 / 1e9,
        if p.pin_coded && nibble { ", coded" } else { "" },
        p.trunk_read_bytes(sizes) as f64 / 1e9,
        if p.head_resident { "held" } else { "streamed" }
    ))
}
