//! The single integration-test binary.
#![allow(clippy::unwrap_used)]

mod bad_inputs;
mod batch;
mod cache_policy;
mod ceilings;
mod cli_defaults;
mod common;
mod config;
mod config_values;
mod conversations;
mod demo;
mod docs;
mod fuzz;
mod generation;
mod header_memory;
mod input_files;
mod mapped;
mod messages;
mod ops;
mod oracle_tiny;
mod plan_chat;
mod prompts;
mod reader;
mod recovery;
mod remote;
mod serve;
mod serve_clients;
mod serve_limits;
mod serve_sampling;
mod session;
mod spec;
mod streaming;
mod synth;
mod trunk;
mod tui;
mod verify;
