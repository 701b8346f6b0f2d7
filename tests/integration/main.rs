//! The single integration-test binary.

mod common;
mod oracle_tiny;
