//! `k3 pack`: write a checkpoint's packed trunk (see [`crate::stream::trunk`]), with a
//! progress bar on stderr and a one-line summary.

use super::progress::ByteBar;
use crate::engine::config::ModelConfig;
use crate::stream::budget::gb;
use crate::stream::codec::Coding;
use crate::stream::trunk;
use crate::stream::Checkpoint;
use crate::Result;
use clap::Args;
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `k3 pack`.
#[derive(Debug, Args)]
pub struct PackArgs {
    /// Checkpoint directory to pack.
    pub model_dir: PathBuf,
    /// Output directory for `trunk.bin` and `trunk.json` (created if missing).
    pub trunk_dir: PathBuf,
    /// Replace a trunk already in TRUNK_DIR.
    #[arg(long)]
    pub force: bool,
    /// Store BF16 tensors with the lossless trunk codec (the default; docs/trunk-codec.md):
    /// about 0.75x their size (0.68x with `--codec entropy`), decoded bit for bit as layers
    /// are read.
    #[arg(long, conflicts_with = "raw")]
    pub encode: bool,
    /// Store every tensor as in the checkpoint: nothing to decode, about 1.33x the bytes of
    /// the encoded trunk to read.
    #[arg(long)]
    pub raw: bool,
    /// How BF16 tensors are coded: `nibble` (the default) stores about 0.75x and decodes at
    /// about 10 GB/s per core; `entropy` stores the fewest bytes (about 0.68x) but decodes at
    /// about 3.5 GB/s per core, which on few cores costs more time than its bytes save
    /// (docs/trunk-codec.md says which to choose).
    #[arg(long, value_enum, default_value_t = CodecArg::Nibble, conflicts_with = "raw")]
    pub codec: CodecArg,
}

/// The values of `k3 pack --codec`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CodecArg {
    /// A Huffman code of the high bytes per block.
    Entropy,
    /// A 4-bit dictionary code of the high bytes per block.
    Nibble,
}

impl CodecArg {
    fn coding(self) -> Coding {
        match self {
            CodecArg::Entropy => Coding::Entropy,
            CodecArg::Nibble => Coding::Nibble,
        }
    }
}

/// Run `k3 pack`.
pub fn run(args: &PackArgs) -> Result<()> {
    let cfg = ModelConfig::load(&args.model_dir.join("config.json"))?;
    let ck = Checkpoint::open(&args.model_dir)?;
    // Refuse a checkpoint whose graph does not bind before writing gigabytes.
    crate::engine::weights::check_graph(&cfg, &ck)?;
    let bar = ByteBar::new("k3 pack".into());
    let start = Instant::now();
    let progress = |done: u64, total: u64| bar.update(done, total);
    let result = trunk::pack(
        &ck,
        cfg.num_hidden_layers,
        Some(crate::engine::bind::names::LM_HEAD),
        &args.trunk_dir,
        args.force,
        (!args.raw).then(|| args.codec.coding()),
        &progress,
    );
    bar.finish();
    let r = result?;
    let secs = start.elapsed().as_secs_f64();
    let m = &r.manifest;
    let largest = m.layers.iter().map(|l| l.nbytes).max().unwrap_or(0);
    let layout = if args.raw {
        format!("{} copied as one run, {} gathered", r.verbatim, r.gathered)
    } else {
        let (bf16, stored) = r.bf16;
        format!(
            "BF16 tensors encoded ({}): {} in {}, {:.3}x",
            args.codec.coding().name(),
            gb(bf16),
            gb(stored),
            stored as f64 / bf16.max(1) as f64
        )
    };
    eprintln!(
        "k3 pack: {} layers{} ({layout}) -> {}: {} in trunk.bin ({:.3}x of the raw {}), \
         largest layer {}, {:.1} s ({:.0} MB/s of source)",
        m.n_layers,
        if m.head.is_some() {
            " and the output head"
        } else {
            ""
        },
        crate::stream::shown(&args.trunk_dir),
        gb(m.total_bytes),
        m.total_bytes as f64 / r.raw_bytes.max(1) as f64,
        gb(r.raw_bytes),
        gb(largest),
        secs,
        r.raw_bytes as f64 / 1e6 / secs.max(1e-9)
    );
    Ok(())
}
