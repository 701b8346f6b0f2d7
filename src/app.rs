//! Each subcommand's arguments (clap) and its work below the front ends: loading, planning,
//! the engine worker and its protocol, the chat client's state machine. No terminal types;
//! errors are values until [`crate::cli::main`] turns them into an exit status.

pub mod bench;
pub mod budget_args;
pub mod chat;
pub mod config;
pub mod demo;
pub mod pack;
pub mod plan;
pub mod progress;
pub mod prompts;
pub mod protocol;
pub mod remote;
pub mod run;
pub mod sampling_args;
pub mod serve;
pub mod state;
pub mod synth;
pub mod verify;
pub mod words;
pub mod worker;
