//! Command-line wiring.
