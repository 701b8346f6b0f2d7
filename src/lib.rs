//! k3: a Kimi K3 inference engine.
//!
//! Layers, lowest first: [`kernels`] (numeric kernels with runtime SIMD dispatch), [`stream`]
//! (checkpoint files, validation, reads), [`engine`] (config, weights, forward pass, sampling),
//! [`session`] (tokenizer), [`app`] (command line). Dependencies point downwards only.

#![recursion_limit = "256"]

pub mod app;
pub mod engine;
pub mod error;
pub mod kernels;
pub mod serve;
pub mod session;
pub mod stream;
pub mod ui;

pub use error::{Error, Result};
