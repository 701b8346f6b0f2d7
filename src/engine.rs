//! The model: configuration, weight binding, and the forward pass (attention residuals, KDA,
//! MLA, latent MoE), plus sampling. Numbers in, numbers out: no terminal, no file format.

pub mod attnres;
pub mod bind;
pub mod config;
pub mod kda;
pub mod layer;
pub mod logit_adjust;
pub mod mla;
pub mod model;
pub mod moe;
pub mod residency;
pub mod run_state;
pub mod sampling;
pub mod spec;
pub mod state;
pub mod store;
pub mod tensor;
pub mod weights;

pub use config::ModelConfig;
pub use model::{Logits, Model, Rollback, Trace};
pub use run_state::{activation_sizes, ActivationSizes, RunState};
pub use state::{SeqState, Snapshot};
pub use store::{ResidentWeights, WeightStore};
