//! `k3 synth`: write a synthetic checkpoint in the released format (see
//! [`crate::synth`]), with a progress bar on stderr and a one-line summary.

use super::progress::ByteBar;
use crate::synth::{self, Shape, SynthError};
use crate::{Error, Result};
use clap::{Args, ValueEnum};
use std::path::PathBuf;
use std::time::Instant;

/// Shapes on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ShapeArg {
    /// The oracle's shape: hidden 128, 13 layers, 8 experts top-2 (a few MB, seconds).
    Tiny,
    /// About 400 MB: hidden 512, 25 layers, 64 experts top-4 (for tests).
    Small,
    /// About 6 GB: hidden 2048, 21 layers, 128 experts top-8 (for benchmarks).
    Bench,
    /// The released dimensions as sparse files: a header-true replica using ~150 MB of disk.
    K3,
}

impl From<ShapeArg> for Shape {
    fn from(s: ShapeArg) -> Shape {
        match s {
            ShapeArg::Tiny => Shape::Tiny,
            ShapeArg::Small => Shape::Small,
            ShapeArg::Bench => Shape::Bench,
            ShapeArg::K3 => Shape::K3,
        }
    }
}

/// Arguments of `k3 synth`.
#[derive(Debug, Args)]
pub struct SynthArgs {
    /// Model shape to write.
    #[arg(value_enum)]
    pub shape: ShapeArg,
    /// Output directory: created; refused if it exists and is not empty.
    pub out_dir: PathBuf,
    /// Seed of the weights: the same seed writes byte-identical files.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write a checkpoint whose continuation repeats: every id continues with the next id of
    /// its run of N consecutive ids, cyclically (the output head is the embedding, rows
    /// permuted; the projections into the residual stream are damped). For measuring
    /// speculative decoding on text that repeats. Not for the sparse `k3` shape.
    #[arg(long, value_name = "N")]
    pub cycle: Option<usize>,
}

impl From<SynthError> for Error {
    fn from(e: SynthError) -> Self {
        match e {
            SynthError::Exists { .. } => Error::Usage(e.to_string()),
            SynthError::Io { path, source } => Error::Write {
                path: path.display().to_string(),
                source,
            },
        }
    }
}

/// Run `k3 synth`.
pub fn run(args: &SynthArgs) -> Result<()> {
    let shape = Shape::from(args.shape);
    let mut dims = shape.dims();
    if let Some(n) = args.cycle {
        if dims.sparse {
            return Err(Error::Usage(format!(
                "--cycle needs the weights written out; the {} shape is a sparse replica",
                shape.name()
            )));
        }
        if n < 2 || n > dims.vocab() {
            return Err(Error::Usage(format!(
                "--cycle {n}: a cycle has from 2 to {} ids (the vocabulary)",
                dims.vocab()
            )));
        }
        dims.cycle = Some(n);
    }
    let bar = ByteBar::new(format!("k3 synth {}", shape.name()));
    let start = Instant::now();
    let progress = |done: u64, total: u64| bar.update(done, total);
    let result = synth::write_dims(shape, &dims, &args.out_dir, args.seed, &progress);
    bar.finish();
    let s = result?;
    let d = &s.dims;
    eprintln!(
        "k3 synth: wrote {} (seed {}) to {}: hidden {}, {} layers, {} experts top-{}, vocab {}; \
         {} shards, {} tensors, {:.1} MB of tensors, {:.1} MB on disk{}{}, in {:.1} s",
        shape.name(),
        s.seed,
        crate::stream::shown(&args.out_dir),
        d.hidden,
        d.layers,
        d.experts,
        d.top_k,
        d.vocab(),
        s.shards,
        s.tensors,
        s.tensor_bytes as f64 / 1e6,
        s.disk_bytes as f64 / 1e6,
        if d.sparse { " (sparse)" } else { "" },
        d.cycle
            .map(|n| format!("; each id continues with the next of its cycle of {n}"))
            .unwrap_or_default(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
