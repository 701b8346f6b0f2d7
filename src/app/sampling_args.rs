//! Sampling flags shared by `k3 run` and `k3 chat`: each is unset unless given, and a given one
//! overrides the user config file's `[sampling]`, which overrides the model's
//! `generation_config.json`, which overrides the command's built-in default
//! (docs/runtime.md#sampling).

use crate::session::defaults::SamplingLayer;
use clap::Args;

/// The sampler's flags, as given on the command line.
#[derive(Clone, Debug, Default, Args)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 is greedy [default: the config file's, else the model's
    /// generation_config.json's, else 0 for `k3 run` and 1.0 for `k3 chat`; likewise for the
    /// sampling flags below, whose last defaults are the same for both].
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Keep only the K most likely tokens (0 = off) [default: 0].
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Nucleus sampling threshold in (0, 1] [default: 1].
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Drop tokens whose probability is below P × the largest (0 = off) [default: 0].
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Repetition penalty over the ids already in the sequence (1 = off) [default: 1].
    #[arg(long)]
    pub repeat_penalty: Option<f32>,
    /// Random seed for sampling [default: 1].
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// The flags as a settings layer (the sampler's keys only; the lengths are left unset).
    #[must_use]
    pub fn layer(&self) -> SamplingLayer {
        SamplingLayer {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            seed: self.seed,
            ..SamplingLayer::default()
        }
    }
}
