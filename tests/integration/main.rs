//! The single integration-test binary.

mod common;
mod bad_inputs;
mod config;
mod oracle_tiny;
mod ops;
