//! One conversation's text side: tokenizer, chat template, slash commands, the session with its
//! carried engine state, and saved session files.

pub mod chat;
pub mod commands;
pub mod defaults;
pub mod journal;
pub mod naming;
pub mod store;
pub mod template;
pub mod tokenizer;
