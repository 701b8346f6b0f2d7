//! k3: a Kimi K3 inference engine.
//!
//! Layers, lowest first: [`kernels`] (numeric kernels with runtime SIMD dispatch), [`stream`]
//! (checkpoint files, validation, reads), [`engine`] (config, weights, forward pass, sampling),
//! [`session`] (tokenizer, template, conversation, session files), [`app`] (each subcommand's
//! work, the engine worker, the chat client's state machine), [`ui`] (the front ends), [`cli`]
//! (the command line, above them all). Dependencies point downwards only. [`synth`] writes
//! synthetic checkpoints for `k3 synth` and the tests; only `app`, `cli` and tests use it.

#![recursion_limit = "256"]

pub mod app;
pub mod cli;
pub mod engine;
pub mod error;
pub mod kernels;
pub mod serve;
pub mod session;
pub mod stream;
pub mod synth;
pub mod tuning;
pub mod ui;

pub use error::{Error, Result};
