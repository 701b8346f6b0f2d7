//! One conversation's text side: the tokenizer (and, later, the chat template and saved
//! sessions).

pub mod tokenizer;
