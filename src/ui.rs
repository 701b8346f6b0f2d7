//! Front ends. `repl` is the plain line-mode client (rustyline, or plain stdin when not a
//! terminal); it talks to the engine worker only through [`crate::app::protocol`].

pub mod repl;
