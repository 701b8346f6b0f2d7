//! k3: a Kimi K3 inference engine.
//!
//! Layers, lowest first: [`kernels`] (numeric kernels with runtime SIMD dispatch), [`stream`]
//! (checkpoint files, validation, reads), [`engine`] (config, weights, forward pass, sampling),
//! [`session`] (tokenizer, template, conversation, session files), [`app`] (each subcommand's
//! work, the engine worker, the chat client's state machine), [`ui`] (the front ends), [`cli`]
//! (the command line, above them all). Dependencies point downwards only.

#![recursion_limit = "256"]

pub mod app;
pub mod cli;
pub mod engine;
pub mod error;
pub mod kernels;
pub mod serve;
pub mod session;
pub mod stream;
pub mod ui;

pub use error::{Error, Result};
