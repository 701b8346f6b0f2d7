//! `k3 pack`: write a checkpoint's packed trunk (see [`crate::stream::trunk`]), with a
//! progress bar on stderr and a one-line summary.

use super::progress::ByteBar;
use crate::engine::config::ModelConfig;
use crate::stream::budget::gb;
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
        &args.trunk_dir,
        args.force,
        &progress,
    );
    bar.finish();
    let r = result?;
    let secs = start.elapsed().as_secs_f64();
    let m = &r.manifest;
    let largest = m.layers.iter().map(|l| l.nbytes).max().unwrap_or(0);
    eprintln!(
        "k3 pack: {} layers ({} copied as one run, {} gathered) -> {}: {} in trunk.bin, largest \
         layer {}, {:.1} s ({:.0} MB/s)",
        m.n_layers,
        r.verbatim,
        r.gathered,
        crate::stream::shown(&args.trunk_dir),
        gb(m.total_bytes),
        gb(largest),
        secs,
        m.total_bytes as f64 / 1e6 / secs.max(1e-9)
    );
    Ok(())
}
