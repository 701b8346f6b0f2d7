//! Kimi K3 chat template ("XTML"): rendering a conversation into prompt
//! token ids, and parsing the model's completion back into a turn.
//!
//! Rendering produces a list of [`Segment`]s, each tokenized on its own and
//! concatenated: the four structural markers (`<|open|>`, `<|close|>`,
//! `<|sep|>`, `<|end_of_msg|>`) are the only segments encoded with special
//! tokens recognized, so message text can never forge structure, and BPE
//! never merges across a segment boundary.
//!
//! Parsing comes in two forms. [`parse_strict`] works on token ids and
//! accepts only a well-formed, complete turn; it is what goes into the
//! history. [`TolerantParser`] works on decoded text as it streams in and
//! splits it into reasoning and answer for display, withholding any trailing
//! text that could be the start of a marker.
//!
//! Raw continuation mode ([`render_raw`]) bypasses the template: the text is
//! encoded as-is with special-token strings recognized.

use std::fmt;
use std::str::FromStr;

use super::tokenizer::Tokenizer;

pub mod tools;

/// XTML opening bracket.
pub const OPEN: &str = "<|open|>";
/// XTML closing bracket.
pub const CLOSE: &str = "<|close|>";
/// XTML end of a tag header.
pub const SEP: &str = "<|sep|>";
/// Terminates every rendered message; `config.json`'s `eos_token_id`.
pub const END_OF_MSG: &str = "<|end_of_msg|>";
/// `tokenizer_config.json`'s `eos_token`; the released model ends its turns
/// with it.
pub const EOS: &str = "[EOS]";

/// Number of BPE ranks of the released tokenizer.
pub const RELEASED_N_BASE: u32 = 163_584;

/// Released id of `[EOS]`.
pub const RELEASED_EOS_ID: u32 = 163_585;
/// Released id of `<|end_of_msg|>`.
pub const RELEASED_END_OF_MSG_ID: u32 = 163_586;
/// Released id of `<|open|>`.
pub const RELEASED_OPEN_ID: u32 = 163_587;
/// Released id of `<|close|>`.
pub const RELEASED_CLOSE_ID: u32 = 163_588;
/// Released id of `<|sep|>`.
pub const RELEASED_SEP_ID: u32 = 163_589;

/// Tag of a message element.
const TAG_MESSAGE: &str = "message";
/// Tag of the reasoning channel.
const TAG_THINK: &str = "think";
/// Tag of the answer channel.
const TAG_RESPONSE: &str = "response";

/// Released ids of the channel words, as single BPE ranks.
const RELEASED_WORD_IDS: [(&str, u32); 3] = [
    (TAG_THINK, 39_964),
    (TAG_RESPONSE, 12_092),
    (TAG_MESSAGE, 2_778),
];

/// Longest excerpt of caller-supplied text quoted in an error, in chars.
const EXCERPT_CHARS: usize = 40;

/// Everything that can go wrong while rendering a conversation or checking
/// a tokenizer for chat use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TemplateError {
    /// The tokenizer has no special token with this name.
    #[error(
        "the tokenizer has no special token {name:?}; chat mode needs `<|open|>`, \
         `<|close|>`, `<|sep|>`, `<|end_of_msg|>` and `[EOS]`"
    )]
    MissingMarker {
        /// The marker's string.
        name: &'static str,
    },

    /// A marker string does not encode to its own single id.
    #[error("the special token {name:?} encodes to {ids:?}, expected exactly [{id}]")]
    MarkerNotSingleId {
        /// The marker's string.
        name: &'static str,
        /// Its id in the special table.
        id: u32,
        /// What encoding the string produced.
        ids: Vec<u32>,
    },

    /// The released vocabulary size, but a marker sits at another id.
    #[error(
        "the special token {name:?} has id {found}, but a tokenizer with the released \
         {RELEASED_N_BASE} ranks must have it at {expected}"
    )]
    MarkerId {
        /// The marker's string.
        name: &'static str,
        /// The released id.
        expected: u32,
        /// The id in this tokenizer.
        found: u32,
    },

    /// A structural segment did not encode to one marker id.
    #[error("the control segment {text:?} encodes to {ids:?}, expected one marker id")]
    ControlSegment {
        /// The segment's text.
        text: String,
        /// What it encoded to.
        ids: Vec<u32>,
    },

    /// A thinking-effort name that is not `low`, `high` or `max`.
    #[error("unknown thinking effort {found:?}: expected `low`, `high` or `max`")]
    UnknownEffort {
        /// The rejected text (shortened).
        found: String,
    },

    /// `medium`, which the prompt text mentions but the release refuses.
    #[error(
        "thinking effort `medium` is not accepted by Kimi K3 (the released encoder rejects \
         it): use `low`, `high` or `max`"
    )]
    MediumEffort,

    /// A role name that is not `system`, `user` or `assistant`.
    #[error("unknown message role {found:?}: expected `system`, `user` or `assistant`")]
    UnknownRole {
        /// The rejected text (shortened).
        found: String,
    },

    /// A JSON part of a request (tools, a schema) that does not parse.
    #[error("{what} is not valid JSON: {reason}")]
    BadJson {
        /// Which part.
        what: String,
        /// The parser's message.
        reason: String,
    },

    /// Reasoning attached to a message that has no reasoning channel.
    #[error(
        "message {index} has role `{role}` but carries reasoning; only assistant messages may"
    )]
    ReasoningOnNonAssistant {
        /// Zero-based index of the message.
        index: usize,
        /// Its role.
        role: Role,
    },
}

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Instructions from the operator.
    System,
    /// The person chatting.
    User,
    /// The model.
    Assistant,
}

impl Role {
    /// The role's name as rendered in the `role` attribute.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = TemplateError;

    /// Parses exactly `system`, `user` or `assistant`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "system" => Ok(Role::System),
            "user" => Ok(Role::User),
            "assistant" => Ok(Role::Assistant),
            _ => Err(TemplateError::UnknownRole { found: excerpt(s) }),
        }
    }
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Who wrote it.
    pub role: Role,
    /// The message text, rendered verbatim.
    pub content: String,
    /// The assistant's reasoning (`reasoning_content`); only assistant
    /// messages may carry it.
    pub reasoning: Option<String>,
}

impl Message {
    /// A system message.
    pub fn system(content: impl Into<String>) -> Message {
        Message {
            role: Role::System,
            content: content.into(),
            reasoning: None,
        }
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Message {
        Message {
            role: Role::User,
            content: content.into(),
            reasoning: None,
        }
    }

    /// An assistant message with optional reasoning.
    pub fn assistant(content: impl Into<String>, reasoning: Option<String>) -> Message {
        Message {
            role: Role::Assistant,
            content: content.into(),
            reasoning,
        }
    }
}

/// How much the model is told to think. `medium` is deliberately absent:
/// the release rejects it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Effort {
    /// `low`.
    Low,
    /// `high`.
    High,
    /// `max`, the release's default.
    #[default]
    Max,
}

impl Effort {
    /// Parses `low`, `high` or `max` (ASCII case ignored); `medium` is
    /// refused with [`TemplateError::MediumEffort`].
    pub fn parse(s: &str) -> Result<Effort, TemplateError> {
        s.parse()
    }

    /// The value as written into the thinking-effort system message.
    pub fn as_str(self) -> &'static str {
        match self {
            Effort::Low => "low",
            Effort::High => "high",
            Effort::Max => "max",
        }
    }
}

impl fmt::Display for Effort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Effort {
    type Err = TemplateError;

    /// Parses `low`, `high` or `max` (ASCII case ignored); `medium` is
    /// refused with its own error.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.eq_ignore_ascii_case("low") {
            Ok(Effort::Low)
        } else if s.eq_ignore_ascii_case("high") {
            Ok(Effort::High)
        } else if s.eq_ignore_ascii_case("max") {
            Ok(Effort::Max)
        } else if s.eq_ignore_ascii_case("medium") {
            Err(TemplateError::MediumEffort)
        } else {
            Err(TemplateError::UnknownEffort { found: excerpt(s) })
        }
    }
}

/// Options that change the rendered prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RenderOptions {
    /// Render the reasoning channel and the thinking-effort message.
    pub thinking: bool,
    /// Thinking effort; ignored when `thinking` is off.
    pub effort: Effort,
}

impl Default for RenderOptions {
    /// Thinking on, effort `max` (the tokenizer entry point's defaults).
    fn default() -> Self {
        RenderOptions {
            thinking: true,
            effort: Effort::Max,
        }
    }
}

/// Ids of the structural markers and of both end-of-turn ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Markers {
    /// `<|open|>`.
    pub open: u32,
    /// `<|close|>`.
    pub close: u32,
    /// `<|sep|>`.
    pub sep: u32,
    /// `<|end_of_msg|>`.
    pub end_of_msg: u32,
    /// `[EOS]`.
    pub eos: u32,
}

impl Markers {
    /// The released ids.
    pub const RELEASED: Markers = Markers {
        open: RELEASED_OPEN_ID,
        close: RELEASED_CLOSE_ID,
        sep: RELEASED_SEP_ID,
        end_of_msg: RELEASED_END_OF_MSG_ID,
        eos: RELEASED_EOS_ID,
    };

    /// Looks the markers up by name. Refuses a tokenizer that lacks one,
    /// whose marker string does not encode to that single id, or that has
    /// the released number of ranks but a marker at another id than the
    /// release's.
    pub fn resolve(tok: &Tokenizer) -> Result<Markers, TemplateError> {
        let lookup = |name: &'static str, released: u32| -> Result<u32, TemplateError> {
            let id = tok
                .special_id(name)
                .ok_or(TemplateError::MissingMarker { name })?;
            let ids = tok.encode(name, true);
            if ids != [id] {
                return Err(TemplateError::MarkerNotSingleId { name, id, ids });
            }
            if tok.n_base() == RELEASED_N_BASE && id != released {
                return Err(TemplateError::MarkerId {
                    name,
                    expected: released,
                    found: id,
                });
            }
            Ok(id)
        };
        Ok(Markers {
            open: lookup(OPEN, RELEASED_OPEN_ID)?,
            close: lookup(CLOSE, RELEASED_CLOSE_ID)?,
            sep: lookup(SEP, RELEASED_SEP_ID)?,
            end_of_msg: lookup(END_OF_MSG, RELEASED_END_OF_MSG_ID)?,
            eos: lookup(EOS, RELEASED_EOS_ID)?,
        })
    }

    /// Both ids that end an assistant turn: `[EOS]` and `<|end_of_msg|>`.
    pub fn stop_ids(&self) -> [u32; 2] {
        [self.eos, self.end_of_msg]
    }

    /// Whether `id` ends an assistant turn.
    pub fn is_stop(&self, id: u32) -> bool {
        id == self.eos || id == self.end_of_msg
    }

    /// Whether `id` is one of the four structural markers.
    fn is_structural(&self, id: u32) -> bool {
        id == self.open || id == self.close || id == self.sep || id == self.end_of_msg
    }
}

/// One piece of rendered prompt, tokenized on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// The text.
    pub text: String,
    /// Whether special-token strings in `text` become their ids (true only
    /// for the structural markers).
    pub allow_special: bool,
}

impl Segment {
    /// A structural segment (specials recognized).
    pub fn control(text: impl Into<String>) -> Segment {
        Segment {
            text: text.into(),
            allow_special: true,
        }
    }

    /// An ordinary text segment (specials are plain text).
    pub fn text(text: impl Into<String>) -> Segment {
        Segment {
            text: text.into(),
            allow_special: false,
        }
    }
}

/// Accumulates segments with the XTML primitives.
#[derive(Default)]
struct Builder {
    segments: Vec<Segment>,
}

impl Builder {
    fn control(&mut self, marker: &str) {
        self.segments.push(Segment::control(marker));
    }

    /// Ordinary text; an empty string produces no segment.
    fn text(&mut self, text: &str) {
        if !text.is_empty() {
            self.segments.push(Segment::text(text));
        }
    }

    /// `<|open|>` tag, then ` key`, `="`, escaped value, `"` per attribute
    /// (four text segments), then `<|sep|>`.
    fn open_tag(&mut self, tag: &str, attrs: &[(&str, &str)]) {
        self.control(OPEN);
        self.text(tag);
        for (key, value) in attrs {
            self.text(&format!(" {key}"));
            self.text("=\"");
            self.text(&escape_attr(value));
            self.text("\"");
        }
        self.control(SEP);
    }

    fn close_tag(&mut self, tag: &str) {
        self.control(CLOSE);
        self.text(tag);
        self.control(SEP);
    }

    fn end_of_msg(&mut self) {
        self.control(END_OF_MSG);
    }

    /// A complete message element with a plain body.
    fn message(&mut self, attrs: &[(&str, &str)], body: &str) {
        self.open_tag(TAG_MESSAGE, attrs);
        self.text(body);
        self.close_tag(TAG_MESSAGE);
        self.end_of_msg();
    }
}

/// Escapes an attribute value: `&` first, then `"`; `<` and `>` stay.
fn escape_attr(value: &str) -> String {
    value.replace('&', "&amp;").replace('"', "&quot;")
}

/// Python `str.isspace()`: Unicode `White_Space` plus U+001C..U+001F.
fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Body of the thinking-effort system message.
pub fn effort_message_body(effort: Effort) -> String {
    format!(
        "`thinking_effort` guides on how much to think in your thinking channel (not \
         including the response channel), supported values include `low`, `medium`, \
         `high`, and `max`.\nNow the system is invoked with `thinking_effort={}`.",
        effort.as_str()
    )
}

/// Renders a conversation into segments: the thinking-effort message (when
/// thinking is on), every message in order, and with
/// `add_generation_prompt` an unclosed assistant message opening the
/// `think` (thinking on) or `response` channel.
///
/// Bodies are inserted verbatim. An assistant's reasoning is rendered only
/// with thinking on and only if it is not whitespace-only; the `think`
/// channel is emitted even when empty. Reasoning on a system or user
/// message is refused.
pub fn render_segments(
    messages: &[Message],
    opts: &RenderOptions,
    add_generation_prompt: bool,
) -> Result<Vec<Segment>, TemplateError> {
    let mut b = Builder::default();
    if opts.thinking {
        b.message(
            &[("role", "system"), ("type", "thinking-effort")],
            &effort_message_body(opts.effort),
        );
    }
    for (index, msg) in messages.iter().enumerate() {
        let role = msg.role.as_str();
        match msg.role {
            Role::System | Role::User => {
                if msg.reasoning.is_some() {
                    return Err(TemplateError::ReasoningOnNonAssistant {
                        index,
                        role: msg.role,
                    });
                }
                b.message(&[("role", role)], &msg.content);
            }
            Role::Assistant => {
                b.open_tag(TAG_MESSAGE, &[("role", role)]);
                if opts.thinking {
                    b.open_tag(TAG_THINK, &[]);
                    if let Some(reasoning) = &msg.reasoning {
                        if !reasoning.chars().all(is_python_space) {
                            b.text(reasoning);
                        }
                    }
                    b.close_tag(TAG_THINK);
                }
                b.open_tag(TAG_RESPONSE, &[]);
                b.text(&msg.content);
                b.close_tag(TAG_RESPONSE);
                b.close_tag(TAG_MESSAGE);
                b.end_of_msg();
            }
        }
    }
    if add_generation_prompt {
        b.open_tag(TAG_MESSAGE, &[("role", Role::Assistant.as_str())]);
        let channel = if opts.thinking {
            TAG_THINK
        } else {
            TAG_RESPONSE
        };
        b.open_tag(channel, &[]);
    }
    Ok(b.segments)
}

/// Tokenizes segments one by one and concatenates the ids. Every control
/// segment must encode to exactly one structural marker id.
pub fn encode_segments(
    tok: &Tokenizer,
    markers: &Markers,
    segments: &[Segment],
) -> Result<Vec<u32>, TemplateError> {
    let mut ids = Vec::with_capacity(segments.iter().map(|s| s.text.len() / 3 + 1).sum());
    for seg in segments {
        let part = tok.encode(&seg.text, seg.allow_special);
        if seg.allow_special {
            match part.as_slice() {
                [id] if markers.is_structural(*id) => {}
                _ => {
                    return Err(TemplateError::ControlSegment {
                        text: excerpt(&seg.text),
                        ids: part,
                    })
                }
            }
        }
        ids.extend_from_slice(&part);
    }
    Ok(ids)
}

/// Renders a conversation into prompt ids (see [`render_segments`]),
/// after checking the tokenizer's markers with [`Markers::resolve`].
pub fn render(
    tok: &Tokenizer,
    messages: &[Message],
    opts: &RenderOptions,
    add_generation_prompt: bool,
) -> Result<Vec<u32>, TemplateError> {
    let markers = Markers::resolve(tok)?;
    let segments = render_segments(messages, opts, add_generation_prompt)?;
    encode_segments(tok, &markers, &segments)
}

/// Raw continuation mode: the text as-is, special-token strings recognized,
/// no template and no BOS.
pub fn render_raw(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.encode(text, true)
}

/// A parsed assistant turn.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedTurn {
    /// The reasoning channel; `None` when thinking is off.
    pub reasoning: Option<String>,
    /// The answer.
    pub content: String,
}

impl ParsedTurn {
    /// The turn as an assistant message for the history.
    pub fn into_message(self) -> Message {
        Message::assistant(self.content, self.reasoning)
    }
}

/// Which payload of a completion an error refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Channel {
    /// The reasoning before `<|close|>think<|sep|>`.
    Reasoning,
    /// The answer inside the `response` channel.
    Response,
}

impl fmt::Display for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Channel::Reasoning => "reasoning",
            Channel::Response => "response",
        })
    }
}

/// Why a completion was not accepted as a turn. Every variant except
/// [`ParseError::ChannelWord`] carries the text decoded so far, for display.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ParseError {
    /// The completion stops before the turn's closing sequence (typically
    /// the token limit was reached).
    #[error(
        "incomplete turn: the completion ({len} ids) stops before \
         `<|close|>response<|sep|><|close|>message<|sep|>` and an end id"
    )]
    Incomplete {
        /// Number of ids in the completion.
        len: usize,
        /// The text so far.
        partial: ParsedTurn,
    },

    /// The completion ends with an end id before the turn was closed.
    #[error("the turn ended (id {end_id}) before it was closed")]
    Unclosed {
        /// The end id found.
        end_id: u32,
        /// The text so far.
        partial: ParsedTurn,
    },

    /// The turn is closed but no end id follows.
    #[error("the turn is closed but the completion stops before its end id")]
    MissingEndId {
        /// The complete text of the turn.
        partial: ParsedTurn,
    },

    /// The id after the closing sequence is not an end id.
    #[error("expected an end id after `<|close|>message<|sep|>`, found id {found}")]
    WrongEndId {
        /// The id found.
        found: u32,
        /// The complete text of the turn.
        partial: ParsedTurn,
    },

    /// Ids follow the end id.
    #[error("{extra} ids follow the end id")]
    TrailingIds {
        /// How many ids follow it.
        extra: usize,
        /// The complete text of the turn.
        partial: ParsedTurn,
    },

    /// A special (or unknown) id inside a payload, e.g. a tool-call block
    /// or a stray marker.
    #[error("id {id} at position {index} is not ordinary text but lies inside the {channel}")]
    SpecialInPayload {
        /// The offending id.
        id: u32,
        /// Its position in the completion.
        index: usize,
        /// The payload it lies in.
        channel: Channel,
        /// The text so far.
        partial: ParsedTurn,
    },

    /// A `tools` block after the answer that does not follow the released layout.
    #[error("malformed tool call: {reason}")]
    BadToolCall {
        /// What is wrong.
        reason: String,
        /// The reasoning and answer before the block.
        partial: ParsedTurn,
    },

    /// The tokenizer does not encode a channel word as the release does.
    #[error(
        "the tokenizer encodes the channel word {word:?} as {ids:?}, which cannot delimit a \
         channel (with the released {RELEASED_N_BASE} ranks it must be the released single id)"
    )]
    ChannelWord {
        /// The word (`think`, `response` or `message`).
        word: &'static str,
        /// What it encoded to.
        ids: Vec<u32>,
    },
}

impl ParseError {
    /// The text decoded so far, if the error carries it.
    pub fn partial(&self) -> Option<&ParsedTurn> {
        match self {
            ParseError::Incomplete { partial, .. }
            | ParseError::Unclosed { partial, .. }
            | ParseError::MissingEndId { partial }
            | ParseError::WrongEndId { partial, .. }
            | ParseError::TrailingIds { partial, .. }
            | ParseError::SpecialInPayload { partial, .. }
            | ParseError::BadToolCall { partial, .. } => Some(partial),
            ParseError::ChannelWord { .. } => None,
        }
    }
}

/// Encodes a channel word as ordinary text; with the released vocabulary it
/// must be the released single id.
/// The ids that close the thinking channel and open the answer:
/// `<|close|>think<|sep|><|open|>response<|sep|>` (the pattern [`parse_strict`] splits a
/// completion at).
pub fn think_close_ids(tok: &Tokenizer, markers: &Markers) -> Result<Vec<u32>, ParseError> {
    let mut ids = vec![markers.close];
    ids.extend(channel_word(tok, TAG_THINK)?);
    ids.extend([markers.sep, markers.open]);
    ids.extend(channel_word(tok, TAG_RESPONSE)?);
    ids.push(markers.sep);
    Ok(ids)
}

fn channel_word(tok: &Tokenizer, word: &'static str) -> Result<Vec<u32>, ParseError> {
    let ids = tok.encode(word, false);
    let released = RELEASED_WORD_IDS
        .iter()
        .find(|(w, _)| *w == word)
        .map(|&(_, id)| id);
    let ok = if tok.n_base() == RELEASED_N_BASE {
        released.is_some_and(|id| ids == [id])
    } else {
        !ids.is_empty() && ids.iter().all(|&id| id < tok.n_base())
    };
    if ok {
        Ok(ids)
    } else {
        Err(ParseError::ChannelWord { word, ids })
    }
}

/// First index at or after `from` where `needle` occurs in `hay`.
fn find_seq(hay: &[u32], needle: &[u32], from: usize) -> Option<usize> {
    if needle.is_empty() {
        return Some(from.min(hay.len()));
    }
    hay.get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|p| p + from)
}

/// Length of the longest proper prefix of `needle` that `hay` ends with.
fn suffix_prefix_len(hay: &[u32], needle: &[u32]) -> usize {
    let max = needle.len().saturating_sub(1).min(hay.len());
    (1..=max)
        .rev()
        .find(|&k| needle.get(..k).is_some_and(|p| hay.ends_with(p)))
        .unwrap_or(0)
}

/// Decodes ids to text with replacement; an id outside the vocabulary
/// becomes U+FFFD.
fn decode_text(tok: &Tokenizer, ids: &[u32]) -> String {
    let mut bytes = Vec::with_capacity(ids.len() * 4);
    for &id in ids {
        match tok.token_bytes(id) {
            Some(b) => bytes.extend_from_slice(b),
            None => bytes.extend_from_slice("\u{FFFD}".as_bytes()),
        }
    }
    match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
    }
}

/// What a display would show for `completion`: the decoded text split by
/// the tolerant parser, flushed.
fn partial_turn(tok: &Tokenizer, completion: &[u32], thinking: bool) -> ParsedTurn {
    let mut parser = TolerantParser::new(thinking);
    parser.push(&decode_text(tok, completion));
    parser.finish();
    ParsedTurn {
        reasoning: thinking.then(|| parser.reasoning().to_owned()),
        content: parser.content().to_owned(),
    }
}

/// Parses a completion (the ids generated after the generation prompt)
/// into a turn, accepting only a well-formed, complete one.
///
/// With `thinking`, the reasoning is everything before the first
/// `<|close|>think<|sep|><|open|>response<|sep|>`; without it there is no
/// reasoning and the answer starts at the first id. The answer runs to the
/// first `<|close|>response<|sep|><|close|>message<|sep|>`, which must be
/// followed by exactly one id, either end id. A special id inside either
/// payload rejects the turn. Channel words are matched as the id sequences
/// this tokenizer gives them.
pub fn parse_strict(
    tok: &Tokenizer,
    markers: &Markers,
    completion: &[u32],
    thinking: bool,
) -> Result<ParsedTurn, ParseError> {
    let think = channel_word(tok, TAG_THINK)?;
    let response = channel_word(tok, TAG_RESPONSE)?;
    let message = channel_word(tok, TAG_MESSAGE)?;

    let mut think_close = vec![markers.close];
    think_close.extend_from_slice(&think);
    think_close.extend_from_slice(&[markers.sep, markers.open]);
    think_close.extend_from_slice(&response);
    think_close.push(markers.sep);

    let mut turn_close = vec![markers.close];
    turn_close.extend_from_slice(&response);
    turn_close.extend_from_slice(&[markers.sep, markers.close]);
    turn_close.extend_from_slice(&message);
    turn_close.push(markers.sep);

    let n_base = tok.n_base();
    let partial = || partial_turn(tok, completion, thinking);
    let check_payload = |start: usize, end: usize, channel: Channel| -> Result<(), ParseError> {
        let span = completion.get(start..end).unwrap_or(&[]);
        match span.iter().position(|&id| id >= n_base) {
            Some(p) => Err(ParseError::SpecialInPayload {
                id: span.get(p).copied().unwrap_or_default(),
                index: start + p,
                channel,
                partial: partial(),
            }),
            None => Ok(()),
        }
    };
    // Closure not found: a trailing partial closure or a lone end id is
    // tolerated when classifying, anything special before it is not.
    let unclosed = |start: usize, pattern: &[u32], channel: Channel| -> ParseError {
        let rest = completion.get(start..).unwrap_or(&[]);
        let last_stop = rest.last().copied().filter(|&id| markers.is_stop(id));
        let body_end = match last_stop {
            Some(_) => completion.len() - 1,
            None => completion.len() - suffix_prefix_len(rest, pattern),
        };
        if let Err(e) = check_payload(start, body_end, channel) {
            return e;
        }
        match last_stop {
            Some(end_id) => ParseError::Unclosed {
                end_id,
                partial: partial(),
            },
            None => ParseError::Incomplete {
                len: completion.len(),
                partial: partial(),
            },
        }
    };

    let (reasoning, response_start) = if thinking {
        match find_seq(completion, &think_close, 0) {
            Some(at) => {
                check_payload(0, at, Channel::Reasoning)?;
                let text = decode_text(tok, completion.get(..at).unwrap_or(&[]));
                (Some(text), at + think_close.len())
            }
            None => return Err(unclosed(0, &think_close, Channel::Reasoning)),
        }
    } else {
        (None, 0)
    };

    let Some(at) = find_seq(completion, &turn_close, response_start) else {
        return Err(unclosed(response_start, &turn_close, Channel::Response));
    };
    check_payload(response_start, at, Channel::Response)?;
    let turn = ParsedTurn {
        reasoning,
        content: decode_text(tok, completion.get(response_start..at).unwrap_or(&[])),
    };
    match completion.get(at + turn_close.len()..).unwrap_or(&[]) {
        [] => Err(ParseError::MissingEndId { partial: turn }),
        [id] if markers.is_stop(*id) => Ok(turn),
        [first, rest @ ..] if markers.is_stop(*first) => Err(ParseError::TrailingIds {
            extra: rest.len(),
            partial: turn,
        }),
        [first, ..] => Err(ParseError::WrongEndId {
            found: *first,
            partial: turn,
        }),
    }
}

/// Where the tolerant parser is in the assistant message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Inside the reasoning channel.
    Reasoning,
    /// After the reasoning closed, before the answer opened.
    BetweenChannels,
    /// Inside the answer.
    Response,
    /// After the answer closed, before the message closed.
    AfterResponse,
    /// Inside a tool-call block (not shown).
    Tools,
    /// The message is closed; further text is ignored.
    Done,
}

const M_THINK_OPEN: &str = "<|open|>think<|sep|>";
const M_THINK_CLOSE: &str = "<|close|>think<|sep|>";
const M_RESPONSE_OPEN: &str = "<|open|>response<|sep|>";
const M_RESPONSE_CLOSE: &str = "<|close|>response<|sep|>";
const M_TOOLS_OPEN: &str = "<|open|>tools<|sep|>";
const M_MESSAGE_CLOSE: &str = "<|close|>message<|sep|>";

/// Every marker string whose start is withheld at the end of the text.
const HELD_MARKERS: [&str; 7] = [
    M_THINK_OPEN,
    M_THINK_CLOSE,
    M_RESPONSE_OPEN,
    M_RESPONSE_CLOSE,
    M_TOOLS_OPEN,
    M_MESSAGE_CLOSE,
    END_OF_MSG,
];

/// The markers that move the parser on from a phase, with the next phase.
fn transitions(phase: Phase) -> &'static [(&'static str, Phase)] {
    match phase {
        Phase::Reasoning => &[
            (M_THINK_CLOSE, Phase::BetweenChannels),
            (M_RESPONSE_OPEN, Phase::Response),
            (M_TOOLS_OPEN, Phase::Tools),
            (M_MESSAGE_CLOSE, Phase::Done),
            (END_OF_MSG, Phase::Done),
        ],
        Phase::BetweenChannels => &[
            (M_RESPONSE_OPEN, Phase::Response),
            (M_TOOLS_OPEN, Phase::Tools),
            (M_MESSAGE_CLOSE, Phase::Done),
            (END_OF_MSG, Phase::Done),
        ],
        Phase::Response => &[
            (M_RESPONSE_CLOSE, Phase::AfterResponse),
            (M_TOOLS_OPEN, Phase::Tools),
            (M_MESSAGE_CLOSE, Phase::Done),
            (END_OF_MSG, Phase::Done),
        ],
        Phase::AfterResponse => &[
            (M_TOOLS_OPEN, Phase::Tools),
            (M_MESSAGE_CLOSE, Phase::Done),
            (END_OF_MSG, Phase::Done),
        ],
        Phase::Tools => &[(M_MESSAGE_CLOSE, Phase::Done), (END_OF_MSG, Phase::Done)],
        Phase::Done => &[],
    }
}

/// Length of the longest proper prefix of any held marker that `text`
/// ends with. Markers are ASCII, so the cut is always a char boundary.
fn held_suffix_len(text: &str) -> usize {
    HELD_MARKERS
        .iter()
        .filter_map(|m| {
            (1..m.len())
                .rev()
                .find(|&k| m.get(..k).is_some_and(|p| text.ends_with(p)))
        })
        .max()
        .unwrap_or(0)
}

/// Splits streamed, decoded completion text into reasoning and answer for
/// display.
///
/// With thinking on, one leading `<|open|>think<|sep|>` is dropped and text
/// is reasoning until `<|close|>think<|sep|>` (or until an answer or tools
/// opener, if the model skips the close). The answer is the text after
/// `<|open|>response<|sep|>` (from the start with thinking off) up to the
/// first `<|close|>response<|sep|>`, `<|open|>tools<|sep|>`,
/// `<|close|>message<|sep|>` or `<|end_of_msg|>`. A trailing fragment that
/// could be the start of a marker is withheld until more text decides it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TolerantParser {
    phase: Phase,
    /// Whether a leading `<|open|>think<|sep|>` may still be stripped.
    at_start: bool,
    /// Text not yet assigned to a channel.
    pending: String,
    reasoning: String,
    content: String,
}

impl TolerantParser {
    /// A parser for a completion that starts inside the reasoning channel
    /// (`thinking`) or inside the answer.
    pub fn new(thinking: bool) -> TolerantParser {
        TolerantParser {
            phase: if thinking {
                Phase::Reasoning
            } else {
                Phase::Response
            },
            at_start: thinking,
            pending: String::new(),
            reasoning: String::new(),
            content: String::new(),
        }
    }

    /// Adds decoded text.
    pub fn push(&mut self, text: &str) {
        self.pending.push_str(text);
        self.process(false);
    }

    /// Releases any withheld text (end of generation).
    pub fn finish(&mut self) {
        self.process(true);
    }

    /// Reasoning shown so far.
    pub fn reasoning(&self) -> &str {
        &self.reasoning
    }

    /// Answer shown so far.
    pub fn content(&self) -> &str {
        &self.content
    }

    /// Current position in the message.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Text withheld because it may be the start of a marker.
    pub fn held_back(&self) -> &str {
        &self.pending
    }

    fn emit(&mut self, upto: usize) {
        let mut cut = upto.min(self.pending.len());
        while !self.pending.is_char_boundary(cut) {
            cut -= 1;
        }
        let text: String = self.pending.drain(..cut).collect();
        match self.phase {
            Phase::Reasoning => self.reasoning.push_str(&text),
            Phase::Response => self.content.push_str(&text),
            Phase::BetweenChannels | Phase::AfterResponse | Phase::Tools | Phase::Done => {}
        }
    }

    fn process(&mut self, flush: bool) {
        loop {
            if self.at_start {
                if self.pending.starts_with(M_THINK_OPEN) {
                    self.pending.drain(..M_THINK_OPEN.len());
                    self.at_start = false;
                    continue;
                }
                if !flush && M_THINK_OPEN.starts_with(self.pending.as_str()) {
                    return;
                }
                self.at_start = false;
            }
            if self.phase == Phase::Done {
                self.pending.clear();
                return;
            }
            let next = transitions(self.phase)
                .iter()
                .filter_map(|&(marker, phase)| {
                    self.pending
                        .find(marker)
                        .map(|at| (at, marker.len(), phase))
                })
                .min_by_key(|&(at, _, _)| at);
            match next {
                Some((at, len, phase)) => {
                    self.emit(at);
                    self.pending.drain(..len.min(self.pending.len()));
                    self.phase = phase;
                }
                None => {
                    let hold = if flush {
                        0
                    } else {
                        held_suffix_len(&self.pending)
                    };
                    self.emit(self.pending.len() - hold);
                    return;
                }
            }
        }
    }
}

/// At most [`EXCERPT_CHARS`] chars of `s`, with an ellipsis if cut.
fn excerpt(s: &str) -> String {
    let mut out: String = s.chars().take(EXCERPT_CHARS).collect();
    if s.chars().nth(EXCERPT_CHARS).is_some() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::fs;
    use std::path::{Path, PathBuf};
    use std::sync::OnceLock;

    use base64::Engine as _;

    use crate::session::tokenizer::{CONFIG_FILE, RANK_FILE};

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

    fn fixture(rel: &str) -> PathBuf {
        PathBuf::from(format!("{FIXTURES}/{rel}"))
    }

    fn tiny() -> Tokenizer {
        Tokenizer::load(&fixture("tiny")).expect("tiny fixture loads")
    }

    // ---- A synthetic tokenizer with the released vocabulary size and ids ----

    /// Regex pieces of the worked example, the effort message, the other
    /// goldens and a few tokenizer test vectors, at their released ranks.
    const RELEASED_PIECES: &[(&str, u32)] = &[
        ("message", 2778),
        (" role", 6244),
        ("=\"", 878),
        ("system", 14062),
        ("user", 2482),
        ("assistant", 69702),
        ("think", 39964),
        ("response", 12092),
        (" type", 1798),
        ("thinking", 130400),
        ("-eff", 59991),
        ("ort", 470),
        ("_eff", 123074),
        (" guides", 28560),
        (" on", 418),
        (" how", 1632),
        (" much", 2455),
        (" to", 308),
        (" think", 2704),
        (" in", 306),
        (" your", 651),
        (" thinking", 9545),
        (" channel", 8491),
        (" (", 347),
        ("not", 2976),
        (" including", 3411),
        (" the", 276),
        (" response", 4503),
        ("),", 904),
        (" supported", 9141),
        (" values", 4661),
        (" include", 3867),
        (" `", 1268),
        ("low", 1332),
        ("`,", 5713),
        ("medium", 50004),
        ("high", 19421),
        (" and", 316),
        ("max", 5354),
        ("`.\n", 16518),
        ("Now", 10048),
        (" system", 2403),
        (" is", 387),
        (" invoked", 42070),
        (" with", 472),
        ("=max", 105281),
        ("`.", 11369),
        ("Numbers", 38587),
        ("473", 42780),
        ("921", 49114),
        ("235", 23782),
        ("What", 5376),
        (" were", 1646),
        (" other", 1356),
        (" two", 2069),
        ("You", 3900),
        (" are", 554),
        (" helpful", 13205),
        ("Hello", 19180),
        ("hello", 22931),
        ("The", 1008),
        (" capital", 10484),
        (" of", 318),
        (" France", 15383),
        (" Paris", 17374),
        ("123", 6694),
        ("456", 12972),
        ("789", 16242),
    ];

    /// Tokens that must also be reachable by merging inside a longer piece
    /// (`` `thinking`` → `` ` ``, `thinking`; `_effort` → `_eff`, `ort`;
    /// `-effort` → `-eff`, `ort`; `=low` → `=`, `low`): every proper prefix
    /// of length ≥ 2 is added as a rank so the merge chain exists.
    const MERGE_BUILT: &[&str] = &["thinking", "_eff", "-eff", "ort", "low"];

    /// First rank tried for the merge-chain prefixes.
    const CHAIN_RANK_BASE: u32 = 150_000;

    /// Single-byte ranks in the usual tiktoken layout: printable bytes
    /// (33..=126, 161..=172, 174..=255) first, then the other 68 in byte
    /// order, so `!` is 0 and space is 220.
    fn byte_rank(b: u8) -> u32 {
        let printable = |c: u8| (33..=126).contains(&c) || (161..=172).contains(&c) || c >= 174;
        if printable(b) {
            (0..b).filter(|&c| printable(c)).count() as u32
        } else {
            188 + (0..b).filter(|&c| !printable(c)).count() as u32
        }
    }

    /// The 16 named specials at their released ids, taken from the tiny
    /// fixture's table (same names and order, 256 ranks instead of 163,584).
    fn released_specials() -> Vec<(u32, String, bool)> {
        tiny()
            .special_tokens()
            .iter()
            .filter(|s| s.named)
            .map(|s| (s.id - 256 + RELEASED_N_BASE, s.name.clone(), s.special))
            .collect()
    }

    /// Writes `tiktoken.model` with 163,584 dense ranks and a
    /// `tokenizer_config.json` with the given specials.
    fn write_synthetic_release(dir: &Path, specials: &[(u32, String, bool)]) {
        let n = RELEASED_N_BASE as usize;
        let mut by_rank: Vec<Option<Vec<u8>>> = vec![None; n];
        let mut ranks: HashMap<Vec<u8>, u32> = HashMap::new();
        fn assign(
            by_rank: &mut [Option<Vec<u8>>],
            ranks: &mut HashMap<Vec<u8>, u32>,
            bytes: Vec<u8>,
            rank: u32,
        ) {
            if let Some(&old) = ranks.get(&bytes) {
                assert_eq!(old, rank, "{bytes:?} placed twice");
                return;
            }
            let slot = &mut by_rank[rank as usize];
            assert!(slot.is_none(), "rank {rank} used twice");
            *slot = Some(bytes.clone());
            ranks.insert(bytes, rank);
        }
        for b in 0..=255u8 {
            assign(&mut by_rank, &mut ranks, vec![b], byte_rank(b));
        }
        for &(piece, rank) in RELEASED_PIECES {
            assign(&mut by_rank, &mut ranks, piece.as_bytes().to_vec(), rank);
        }
        let mut next_free = CHAIN_RANK_BASE;
        for word in MERGE_BUILT {
            for k in 2..word.len() {
                let prefix = word.as_bytes()[..k].to_vec();
                if ranks.contains_key(&prefix) {
                    continue;
                }
                while by_rank[next_free as usize].is_some() {
                    next_free += 1;
                }
                assign(&mut by_rank, &mut ranks, prefix, next_free);
            }
        }
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut file = String::with_capacity(n * 18);
        for (rank, slot) in by_rank.iter().enumerate() {
            // Fill-ins start with 0xFF, which never occurs in UTF-8 text.
            let bytes = slot.clone().unwrap_or_else(|| {
                vec![
                    0xFF,
                    0xFE,
                    (rank >> 16) as u8,
                    (rank >> 8) as u8,
                    rank as u8,
                ]
            });
            file.push_str(&b64.encode(&bytes));
            file.push(' ');
            file.push_str(&rank.to_string());
            file.push('\n');
        }
        fs::write(dir.join(RANK_FILE), file).expect("write rank file");

        let mut decoder = serde_json::Map::new();
        for (id, name, special) in specials {
            decoder.insert(
                id.to_string(),
                serde_json::json!({
                    "content": name, "lstrip": false, "normalized": false,
                    "rstrip": false, "single_word": false, "special": special,
                }),
            );
        }
        let config = serde_json::json!({
            "added_tokens_decoder": decoder,
            "bos_token": "[BOS]",
            "eos_token": "[EOS]",
            "pad_token": "[PAD]",
            "unk_token": "[UNK]",
            "tokenizer_class": "TikTokenTokenizer",
        });
        fs::write(dir.join(CONFIG_FILE), config.to_string()).expect("write config");
    }

    fn load_synthetic(specials: &[(u32, String, bool)]) -> Tokenizer {
        let dir = tempfile::tempdir().expect("tempdir");
        write_synthetic_release(dir.path(), specials);
        Tokenizer::load(dir.path()).expect("synthetic release tokenizer loads")
    }

    /// The synthetic tokenizer with the released ids (built once).
    fn release() -> &'static Tokenizer {
        static TOK: OnceLock<Tokenizer> = OnceLock::new();
        TOK.get_or_init(|| load_synthetic(&released_specials()))
    }

    // ---- Goldens (docs/runtime.md#worked-example) ----

    const PREAMBLE_MAX: [u32; 67] = [
        163587, 2778, 6244, 878, 14062, 1, 1798, 878, 130400, 59991, 470, 1, 163589, 63, 130400,
        123074, 470, 63, 28560, 418, 1632, 2455, 308, 2704, 306, 651, 9545, 8491, 347, 2976, 3411,
        276, 4503, 8491, 904, 9141, 4661, 3867, 1268, 1332, 5713, 1268, 50004, 5713, 1268, 19421,
        5713, 316, 1268, 5354, 16518, 10048, 276, 2403, 387, 42070, 472, 1268, 130400, 123074, 470,
        105281, 11369, 163588, 2778, 163589, 163586,
    ];
    const USER1: [u32; 13] = [
        163587, 2778, 6244, 878, 2482, 1, 163589, 38587, 30, 163588, 2778, 163589, 163586,
    ];
    const ASSISTANT1_HEAD: [u32; 10] = [
        163587, 2778, 6244, 878, 69702, 1, 163589, 163587, 39964, 163589,
    ];
    const ASSISTANT1_TAIL: [u32; 20] = [
        163588, 39964, 163589, 163587, 12092, 163589, 42780, 11, 220, 49114, 11, 220, 23782,
        163588, 12092, 163589, 163588, 2778, 163589, 163586,
    ];
    const USER2: [u32; 17] = [
        163587, 2778, 6244, 878, 2482, 1, 163589, 5376, 1646, 276, 1356, 2069, 30, 163588, 2778,
        163589, 163586,
    ];
    const PROMPT_THINK: [u32; 10] = [
        163587, 2778, 6244, 878, 69702, 1, 163589, 163587, 39964, 163589,
    ];
    const SKELETON: [u32; 32] = [
        163587, 163589, 163588, 163589, 163586, // preamble
        163587, 163589, 163588, 163589, 163586, // user
        163587, 163589, 163587, 163589, 163588, 163589, 163587, 163589, 163588, 163589, 163588,
        163589, 163586, // assistant
        163587, 163589, 163588, 163589, 163586, // user
        163587, 163589, 163587, 163589, // prompt
    ];
    const THINKING_OFF_64: [u32; 64] = [
        163587, 2778, 6244, 878, 2482, 1, 163589, 38587, 30, 163588, 2778, 163589, 163586, //
        163587, 2778, 6244, 878, 69702, 1, 163589, 163587, 12092, 163589, 42780, 11, 220, 49114,
        11, 220, 23782, 163588, 12092, 163589, 163588, 2778, 163589, 163586, //
        163587, 2778, 6244, 878, 2482, 1, 163589, 5376, 1646, 276, 1356, 2069, 30, 163588, 2778,
        163589, 163586, //
        163587, 2778, 6244, 878, 69702, 1, 163589, 163587, 12092, 163589,
    ];
    const SYSTEM_USER_37: [u32; 37] = [
        163587, 2778, 6244, 878, 14062, 1, 163589, 3900, 554, 13205, 13, 163588, 2778, 163589,
        163586, 163587, 2778, 6244, 878, 2482, 1, 163589, 19180, 163588, 2778, 163589, 163586,
        163587, 2778, 6244, 878, 69702, 1, 163589, 163587, 12092, 163589,
    ];

    const REASONING: &str = "I'll remember 215 and 222.";

    fn worked_example() -> Vec<Message> {
        vec![
            Message::user("Numbers?"),
            Message::assistant("473, 921, 235", Some(REASONING.to_owned())),
            Message::user("What were the other two?"),
        ]
    }

    fn off() -> RenderOptions {
        RenderOptions {
            thinking: false,
            effort: Effort::Max,
        }
    }

    #[test]
    fn synthetic_release_tokenizer_matches_released_vectors() {
        let tok = release();
        assert_eq!(tok.n_base(), RELEASED_N_BASE);
        assert_eq!(tok.vocab_size(), 163_840);
        let cases: &[(&str, &[u32])] = &[
            ("The capital of France is", &[1008, 10484, 318, 15383, 387]),
            ("$%&'(", &[3, 4, 5, 6, 7]),
            ("Hello", &[19180]),
            ("hello", &[22931]),
            ("You are helpful.", &[3900, 554, 13205, 13]),
            ("Numbers?", &[38587, 30]),
            ("473, 921, 235", &[42780, 11, 220, 49114, 11, 220, 23782]),
            (
                "What were the other two?",
                &[5376, 1646, 276, 1356, 2069, 30],
            ),
            ("1234567890", &[6694, 12972, 16242, 15]),
            ("thinking-effort", &[130400, 59991, 470]),
            (" response", &[4503]),
            (" Paris", &[17374]),
        ];
        for (text, ids) in cases {
            assert_eq!(tok.encode(text, false), *ids, "{text:?}");
        }
    }

    // ---- Rendering ----

    #[test]
    fn thinking_off_worked_example_is_token_exact() {
        let ids = render(release(), &worked_example(), &off(), true).expect("render");
        assert_eq!(ids, THINKING_OFF_64);
    }

    #[test]
    fn system_user_goldens_are_token_exact() {
        let conv = [Message::system("You are helpful."), Message::user("Hello")];
        let ids = render(release(), &conv, &off(), true).expect("render");
        assert_eq!(ids, SYSTEM_USER_37);

        let ids = render(release(), &conv, &RenderOptions::default(), true).expect("render");
        let mut want = PREAMBLE_MAX.to_vec();
        want.extend_from_slice(&SYSTEM_USER_37[..27]);
        want.extend_from_slice(&PROMPT_THINK);
        assert_eq!(ids.len(), 104);
        assert_eq!(ids, want);
    }

    #[test]
    fn thinking_on_worked_example_is_token_exact_outside_the_reasoning() {
        let tok = release();
        let ids = render(tok, &worked_example(), &RenderOptions::default(), true).expect("render");
        let prefix: Vec<u32> = [&PREAMBLE_MAX[..], &USER1, &ASSISTANT1_HEAD].concat();
        let suffix: Vec<u32> = [&ASSISTANT1_TAIL[..], &USER2, &PROMPT_THINK].concat();
        assert!(ids.len() > prefix.len() + suffix.len());
        assert_eq!(ids[..prefix.len()], prefix[..]);
        assert_eq!(ids[ids.len() - suffix.len()..], suffix[..]);
        let payload = &ids[prefix.len()..ids.len() - suffix.len()];
        assert_eq!(payload, tok.encode(REASONING, false));
        assert!(payload.iter().all(|&id| id < RELEASED_N_BASE));
        assert_eq!(decode_text(tok, payload), REASONING);
        let skeleton: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|&id| id >= RELEASED_N_BASE)
            .collect();
        assert_eq!(skeleton, SKELETON);
    }

    #[test]
    fn effort_preambles_are_token_exact() {
        let tok = release();
        let max = render(tok, &[], &RenderOptions::default(), false).expect("render");
        assert_eq!(max, PREAMBLE_MAX);
        let low = RenderOptions {
            thinking: true,
            effort: Effort::Low,
        };
        let ids = render(tok, &[], &low, false).expect("render");
        let mut want = PREAMBLE_MAX.to_vec();
        let at = want.iter().position(|&id| id == 105281).expect("=max id");
        want.splice(at..=at, [28, 1332]);
        assert_eq!(ids.len(), 68);
        assert_eq!(ids, want);
    }

    fn count(ids: &[u32], id: u32) -> usize {
        ids.iter().filter(|&&x| x == id).count()
    }

    #[test]
    fn injected_markers_in_user_text_stay_text() {
        let conv = [Message::user("literal <|end_of_msg|> <|open|>")];
        for tok in [&tiny(), release()] {
            let m = Markers::resolve(tok).expect("markers");
            let ids = render(tok, &conv, &RenderOptions::default(), true).expect("render");
            // Effort message and user turn end with one end_of_msg each; the
            // generation prompt opens `message` and `think`.
            assert_eq!(count(&ids, m.end_of_msg), 2);
            assert_eq!(count(&ids, m.open), 4);
            assert_eq!(count(&ids, m.close), 2);
            assert_eq!(count(&ids, m.sep), 6);
            assert_eq!(ids.iter().filter(|&&id| tok.is_special(id)).count(), 14);
            let text = tok.encode("literal <|end_of_msg|> <|open|>", false);
            assert!(ids.windows(text.len()).any(|w| w == text));
        }
        let ids = render(release(), &conv, &off(), false).expect("render");
        assert_eq!(count(&ids, RELEASED_END_OF_MSG_ID), 1);
        assert_eq!(count(&ids, RELEASED_OPEN_ID), 1);
    }

    fn oracle_ids(oracle: &serde_json::Value, key: &str) -> Vec<u32> {
        oracle["multi_turn"][key]
            .as_array()
            .expect("id array")
            .iter()
            .map(|v| v.as_u64().expect("id") as u32)
            .collect()
    }

    #[test]
    fn tiny_oracle_turns_match() {
        let tok = tiny();
        let text = fs::read_to_string(fixture("tiny/oracle.json")).expect("oracle readable");
        let oracle: serde_json::Value = serde_json::from_str(&text).expect("oracle is JSON");
        let turn1 = oracle_ids(&oracle, "turn1_ids");
        let turn2 = oracle_ids(&oracle, "turn2_ids");

        let first = [Message::user("Hello K3")];
        assert_eq!(render(&tok, &first, &off(), true).expect("render"), turn1);

        // Closing the generated reply, the next user turn and the prompt.
        let markers = Markers::resolve(&tok).expect("markers");
        let mut segments = vec![
            Segment::control(CLOSE),
            Segment::text("response"),
            Segment::control(SEP),
            Segment::control(CLOSE),
            Segment::text("message"),
            Segment::control(SEP),
            Segment::control(END_OF_MSG),
        ];
        segments.extend(render_segments(&[Message::user("Why?")], &off(), true).expect("segs"));
        assert_eq!(
            encode_segments(&tok, &markers, &segments).expect("encode"),
            turn2
        );

        // An empty reply renders no payload segment, so the re-render of the
        // whole history is exactly turn 1 followed by turn 2.
        let history = [
            Message::user("Hello K3"),
            Message::assistant("", None),
            Message::user("Why?"),
        ];
        let full = render(&tok, &history, &off(), true).expect("render");
        assert_eq!(full, [turn1.clone(), turn2].concat());

        // The random reply holds special ids: never a valid turn.
        let reply = oracle_ids(&oracle, "turn1_reply_ids");
        let err = parse_strict(&tok, &markers, &reply, false).expect_err("malformed reply");
        assert!(err.partial().is_some());
    }

    #[test]
    fn segments_follow_the_primitives() {
        let segs = render_segments(&[Message::user("hi")], &off(), false).expect("segments");
        let want = vec![
            Segment::control(OPEN),
            Segment::text("message"),
            Segment::text(" role"),
            Segment::text("=\""),
            Segment::text("user"),
            Segment::text("\""),
            Segment::control(SEP),
            Segment::text("hi"),
            Segment::control(CLOSE),
            Segment::text("message"),
            Segment::control(SEP),
            Segment::control(END_OF_MSG),
        ];
        assert_eq!(segs, want);

        // Empty content: no text segment at all.
        let segs = render_segments(&[Message::user("")], &off(), false).expect("segments");
        assert_eq!(segs.len(), want.len() - 1);
        assert!(segs.iter().all(|s| !s.text.is_empty()));

        // The effort message: role then type, four segments each.
        let segs = render_segments(&[], &RenderOptions::default(), false).expect("segments");
        let texts: Vec<&str> = segs.iter().map(|s| s.text.as_str()).collect();
        assert_eq!(
            texts[..12],
            [
                OPEN,
                "message",
                " role",
                "=\"",
                "system",
                "\"",
                " type",
                "=\"",
                "thinking-effort",
                "\"",
                SEP,
                texts[11]
            ]
        );
        assert_eq!(texts[11], effort_message_body(Effort::Max));
        assert!(texts[11].contains("\nNow the system is invoked with `thinking_effort=max`."));
    }

    #[test]
    fn attribute_values_are_escaped() {
        assert_eq!(escape_attr("a&\"b<c>&amp;"), "a&amp;&quot;b<c>&amp;amp;");
        let mut b = Builder::default();
        b.open_tag("x", &[("k", "")]);
        let texts: Vec<&str> = b.segments.iter().map(|s| s.text.as_str()).collect();
        assert_eq!(texts, [OPEN, "x", " k", "=\"", "\"", SEP]);
    }

    fn texts(segs: &[Segment]) -> Vec<&str> {
        segs.iter().map(|s| s.text.as_str()).collect()
    }

    #[test]
    fn assistant_think_channel_rules() {
        let on = RenderOptions::default();
        // Whitespace-only reasoning (Python isspace, incl. U+001F) is dropped,
        // the empty think channel still renders.
        for reasoning in [None, Some(" \n\t\u{1f} ".to_owned())] {
            let conv = [Message::assistant("A", reasoning)];
            let segs = render_segments(&conv, &on, false).expect("segments");
            let t = texts(&segs);
            let think = t.iter().position(|&s| s == "think").expect("think");
            assert_eq!(t[think..think + 5], ["think", SEP, CLOSE, "think", SEP]);
        }
        // Non-blank reasoning is kept unstripped.
        let conv = [Message::assistant("A", Some("  r \n".to_owned()))];
        let segs = render_segments(&conv, &on, false).expect("segments");
        assert!(texts(&segs).contains(&"  r \n"));
        // Thinking off: no think channel at all, reasoning dropped.
        let segs = render_segments(&conv, &off(), false).expect("segments");
        let t = texts(&segs);
        assert!(!t.contains(&"think") && !t.contains(&"  r \n"));
        assert_eq!(
            t,
            [
                OPEN,
                "message",
                " role",
                "=\"",
                "assistant",
                "\"",
                SEP,
                OPEN,
                "response",
                SEP,
                "A",
                CLOSE,
                "response",
                SEP,
                CLOSE,
                "message",
                SEP,
                END_OF_MSG
            ]
        );
        // Generation prompt opens think or response and stays open.
        let segs = render_segments(&[], &on, true).expect("segments");
        assert_eq!(texts(&segs)[texts(&segs).len() - 3..], [OPEN, "think", SEP]);
        let segs = render_segments(&[], &off(), true).expect("segments");
        assert_eq!(
            texts(&segs)[texts(&segs).len() - 3..],
            [OPEN, "response", SEP]
        );
        // Reasoning on a user message is refused.
        let mut bad = Message::user("u");
        bad.reasoning = Some("r".to_owned());
        let err = render_segments(&[Message::system("s"), bad], &on, true).expect_err("refused");
        assert_eq!(
            err,
            TemplateError::ReasoningOnNonAssistant {
                index: 1,
                role: Role::User
            }
        );
    }

    #[test]
    fn raw_mode_recognizes_specials() {
        let tok = tiny();
        assert_eq!(render_raw(&tok, "<|open|>!"), [259, 0]);
        assert_eq!(render_raw(&tok, ""), Vec::<u32>::new());
    }

    // ---- Markers ----

    #[test]
    fn markers_resolve_by_name() {
        let m = Markers::resolve(&tiny()).expect("tiny markers");
        assert_eq!(
            m,
            Markers {
                open: 259,
                close: 260,
                sep: 261,
                end_of_msg: 258,
                eos: 257
            }
        );
        assert_eq!(m.stop_ids(), [257, 258]);
        assert_eq!(
            Markers::resolve(release()).expect("release"),
            Markers::RELEASED
        );
        assert_eq!(Markers::RELEASED.stop_ids(), [163585, 163586]);
    }

    #[test]
    fn markers_refuse_missing_or_moved_ids() {
        // Tiny tokenizer without `<|sep|>`.
        let dir = tempfile::tempdir().expect("tempdir");
        fs::copy(fixture("tiny/tiktoken.model"), dir.path().join(RANK_FILE)).expect("copy");
        let config = fs::read_to_string(fixture("tiny/tokenizer_config.json")).expect("config");
        let mut json: serde_json::Value = serde_json::from_str(&config).expect("json");
        json["added_tokens_decoder"]
            .as_object_mut()
            .expect("object")
            .remove("261");
        fs::write(dir.path().join(CONFIG_FILE), json.to_string()).expect("write");
        let tok = Tokenizer::load(dir.path()).expect("loads");
        assert_eq!(
            Markers::resolve(&tok),
            Err(TemplateError::MissingMarker { name: SEP })
        );
        assert!(render(&tok, &[Message::user("x")], &off(), true).is_err());

        // Released size with `<|open|>` and `<|close|>` swapped.
        let swapped: Vec<(u32, String, bool)> = released_specials()
            .into_iter()
            .map(|(id, name, special)| match id {
                RELEASED_OPEN_ID => (RELEASED_CLOSE_ID, name, special),
                RELEASED_CLOSE_ID => (RELEASED_OPEN_ID, name, special),
                _ => (id, name, special),
            })
            .collect();
        let tok = load_synthetic(&swapped);
        assert_eq!(
            Markers::resolve(&tok),
            Err(TemplateError::MarkerId {
                name: OPEN,
                expected: RELEASED_OPEN_ID,
                found: RELEASED_CLOSE_ID
            })
        );
    }

    // ---- Options ----

    #[test]
    fn effort_parsing() {
        assert_eq!(Effort::parse("low"), Ok(Effort::Low));
        assert_eq!("high".parse::<Effort>(), Ok(Effort::High));
        assert_eq!("max".parse::<Effort>(), Ok(Effort::Max));
        assert_eq!("MAX".parse::<Effort>(), Ok(Effort::Max));
        let err = "medium".parse::<Effort>().expect_err("medium refused");
        assert_eq!(err, TemplateError::MediumEffort);
        assert!(err.to_string().contains("`medium` is not accepted"));
        assert!(matches!(
            "".parse::<Effort>(),
            Err(TemplateError::UnknownEffort { .. })
        ));
        assert_eq!(Effort::default(), Effort::Max);
        assert_eq!(
            RenderOptions::default(),
            RenderOptions {
                thinking: true,
                effort: Effort::Max
            }
        );
        assert_eq!("assistant".parse::<Role>(), Ok(Role::Assistant));
        assert!(matches!(
            "tool".parse::<Role>(),
            Err(TemplateError::UnknownRole { .. })
        ));
    }

    // ---- Strict parsing ----

    /// A completion as the model would produce it after the generation
    /// prompt, with channel words tokenized by `tok`.
    fn completion(tok: &Tokenizer, reasoning: Option<&str>, content: &str, end: u32) -> Vec<u32> {
        let m = Markers::resolve(tok).expect("markers");
        let word = |w: &str| tok.encode(w, false);
        let mut ids = Vec::new();
        if let Some(r) = reasoning {
            ids.extend(tok.encode(r, false));
            ids.push(m.close);
            ids.extend(word("think"));
            ids.extend([m.sep, m.open]);
            ids.extend(word("response"));
            ids.push(m.sep);
        }
        ids.extend(tok.encode(content, false));
        ids.push(m.close);
        ids.extend(word("response"));
        ids.extend([m.sep, m.close]);
        ids.extend(word("message"));
        ids.push(m.sep);
        ids.push(end);
        ids
    }

    #[test]
    fn strict_parse_accepts_well_formed_turns() {
        let tiny = tiny();
        for tok in [release(), &tiny] {
            let m = Markers::resolve(tok).expect("markers");
            for end in m.stop_ids() {
                let ids = completion(tok, Some(REASONING), "473, 921, 235", end);
                let turn = parse_strict(tok, &m, &ids, true).expect("thinking-on turn");
                assert_eq!(turn.reasoning.as_deref(), Some(REASONING));
                assert_eq!(turn.content, "473, 921, 235");

                let ids = completion(tok, None, "473, 921, 235", end);
                let turn = parse_strict(tok, &m, &ids, false).expect("thinking-off turn");
                assert_eq!(
                    turn,
                    ParsedTurn {
                        reasoning: None,
                        content: "473, 921, 235".to_owned()
                    }
                );

                // Empty reasoning and marker strings typed as plain text.
                let text = "<|close|>response<|sep|><|close|>message<|sep|>[EOS]";
                let ids = completion(tok, Some(""), text, end);
                let turn = parse_strict(tok, &m, &ids, true).expect("plain-text markers");
                assert_eq!(turn.reasoning.as_deref(), Some(""));
                assert_eq!(turn.content, text);
            }
        }
        // The released pattern ids.
        let ids = completion(release(), Some("r"), "c", RELEASED_EOS_ID);
        assert!(ids
            .windows(6)
            .any(|w| w == [163588, 39964, 163589, 163587, 12092, 163589]));
        assert!(ids
            .windows(6)
            .any(|w| w == [163588, 12092, 163589, 163588, 2778, 163589]));
    }

    #[test]
    fn strict_parse_rejects_bad_endings() {
        let tiny = tiny();
        for tok in [release(), &tiny] {
            let m = Markers::resolve(tok).expect("markers");
            let good = completion(tok, Some(REASONING), "473", m.eos);
            let want = ParsedTurn {
                reasoning: Some(REASONING.to_owned()),
                content: "473".to_owned(),
            };

            let missing = &good[..good.len() - 1];
            assert_eq!(
                parse_strict(tok, &m, missing, true),
                Err(ParseError::MissingEndId {
                    partial: want.clone()
                })
            );

            let mut wrong = good.clone();
            *wrong.last_mut().expect("non-empty") = m.open;
            assert_eq!(
                parse_strict(tok, &m, &wrong, true),
                Err(ParseError::WrongEndId {
                    found: m.open,
                    partial: want.clone()
                })
            );

            let mut trailing = good.clone();
            trailing.extend([0, m.end_of_msg]);
            assert_eq!(
                parse_strict(tok, &m, &trailing, true),
                Err(ParseError::TrailingIds {
                    extra: 2,
                    partial: want.clone()
                })
            );

            // Stopped with an end id before closing the turn.
            let mut early = tok.encode("473", false);
            early.push(m.end_of_msg);
            let err = parse_strict(tok, &m, &early, false).expect_err("unclosed");
            assert!(matches!(err, ParseError::Unclosed { end_id, .. } if end_id == m.end_of_msg));
            assert_eq!(err.partial().map(|p| p.content.as_str()), Some("473"));
        }
    }

    #[test]
    fn strict_parse_rejects_specials_in_payloads() {
        let tiny = tiny();
        for tok in [release(), &tiny] {
            let m = Markers::resolve(tok).expect("markers");
            let good = completion(tok, Some("ab"), "cd", m.eos);
            let r_len = tok.encode("ab", false).len();

            // In the reasoning.
            let mut ids = good.clone();
            ids.insert(1, m.open);
            let err = parse_strict(tok, &m, &ids, true).expect_err("special in reasoning");
            assert!(matches!(
                err,
                ParseError::SpecialInPayload { index: 1, channel: Channel::Reasoning, id, .. }
                    if id == m.open
            ));

            // In the response (the byte tokenizer spells words with several ids).
            let head =
                r_len + 4 + tok.encode("think", false).len() + tok.encode("response", false).len();
            let mut ids = good.clone();
            ids.insert(head + 1, m.eos);
            let err = parse_strict(tok, &m, &ids, true).expect_err("special in response");
            assert!(matches!(
                err,
                ParseError::SpecialInPayload { channel: Channel::Response, id, index, .. }
                    if id == m.eos && index == head + 1
            ));
            assert_eq!(
                err.partial().and_then(|p| p.reasoning.as_deref()),
                Some("ab")
            );

            // An unknown id is not text either.
            let mut ids = good.clone();
            ids.insert(0, tok.vocab_size());
            let err = parse_strict(tok, &m, &ids, true).expect_err("unknown id");
            assert!(matches!(err, ParseError::SpecialInPayload { index: 0, .. }));

            // A tool-call block between the answer and the message closure.
            let mut ids = tok.encode("cd", false);
            ids.push(m.close);
            ids.extend(tok.encode("response", false));
            ids.extend([m.sep, m.open]);
            ids.extend(tok.encode("tools", false));
            ids.push(m.sep);
            let err = parse_strict(tok, &m, &ids, false).expect_err("tools block");
            assert!(matches!(err, ParseError::SpecialInPayload { .. }));
        }
    }

    #[test]
    fn strict_parse_reports_truncation_with_partial_text() {
        let tiny = tiny();
        for tok in [release(), &tiny] {
            let m = Markers::resolve(tok).expect("markers");
            let full = completion(tok, Some(REASONING), "473, 921, 235", m.end_of_msg);
            for cut in 0..full.len() - 1 {
                let err = parse_strict(tok, &m, &full[..cut], true).expect_err("truncated");
                assert!(
                    matches!(err, ParseError::Incomplete { len, .. } if len == cut),
                    "cut {cut}: {err:?}"
                );
                assert!(err.partial().is_some());
            }
            // Cut inside the answer: reasoning complete, answer partial.
            let r = tok.encode(REASONING, false).len();
            let head =
                r + 4 + tok.encode("think", false).len() + tok.encode("response", false).len();
            let cut = head + tok.encode("473, ", false).len();
            let err = parse_strict(tok, &m, &full[..cut], true).expect_err("truncated");
            assert_eq!(
                err.partial(),
                Some(&ParsedTurn {
                    reasoning: Some(REASONING.to_owned()),
                    content: "473, ".to_owned()
                })
            );
            // Cut inside the reasoning.
            let cut = tok.encode("I'll remember", false).len();
            let err = parse_strict(tok, &m, &full[..cut], true).expect_err("truncated");
            assert_eq!(
                err.partial(),
                Some(&ParsedTurn {
                    reasoning: Some("I'll remember".to_owned()),
                    content: String::new()
                })
            );
            assert!(err.to_string().contains("incomplete"));
        }
    }

    #[test]
    fn channel_words_follow_the_tokenizer() {
        let tok = release();
        assert_eq!(channel_word(tok, TAG_THINK), Ok(vec![39964]));
        assert_eq!(channel_word(tok, TAG_RESPONSE), Ok(vec![12092]));
        assert_eq!(channel_word(tok, TAG_MESSAGE), Ok(vec![2778]));
        let tiny = tiny();
        assert_eq!(channel_word(&tiny, TAG_THINK).expect("bytes").len(), 5);
    }

    // ---- Tolerant parsing ----

    const STREAM: &str = "<|open|>think<|sep|>I think <b>.<|close|>think<|sep|>\
        <|open|>response<|sep|>Answer <|x> <|close|>respons.<|close|>response<|sep|>\
        <|close|>message<|sep|>";

    fn has_marker_fragment(s: &str) -> bool {
        HELD_MARKERS.iter().any(|m| s.contains(m)) || s.ends_with('<') || s.ends_with("<|")
    }

    #[test]
    fn tolerant_parser_never_shows_a_split_marker() {
        let mut p = TolerantParser::new(true);
        let final_reasoning = "I think <b>.";
        let final_content = "Answer <|x> <|close|>respons.";
        for c in STREAM.chars() {
            p.push(&c.to_string());
            assert!(
                final_reasoning.starts_with(p.reasoning()),
                "{:?}",
                p.reasoning()
            );
            assert!(final_content.starts_with(p.content()), "{:?}", p.content());
            assert!(!has_marker_fragment(p.reasoning()));
        }
        assert_eq!(p.reasoning(), final_reasoning);
        assert_eq!(p.content(), final_content);
        assert_eq!(p.phase(), Phase::Done);
        assert_eq!(p.held_back(), "");
    }

    #[test]
    fn tolerant_parser_phases_and_holdback() {
        let mut p = TolerantParser::new(true);
        p.push("<|open|>thi");
        assert_eq!((p.reasoning(), p.held_back()), ("", "<|open|>thi"));
        p.push("nk<|sep|>abc<|clo");
        assert_eq!(p.reasoning(), "abc");
        assert_eq!(p.held_back(), "<|clo");
        assert_eq!(p.phase(), Phase::Reasoning);
        p.push("se|>think<|sep|>");
        assert_eq!(p.phase(), Phase::BetweenChannels);
        p.push("<|open|>response<|sep|>x <|");
        assert_eq!((p.phase(), p.content()), (Phase::Response, "x "));
        p.push("open|>tools<|sep|>call");
        assert_eq!((p.phase(), p.content()), (Phase::Tools, "x "));
        p.push("<|end_of_msg|>more");
        assert_eq!(p.phase(), Phase::Done);
        assert_eq!(p.content(), "x ");

        // A think opener is stripped only at the very start.
        let mut p = TolerantParser::new(true);
        p.push("a<|open|>think<|sep|>b");
        p.finish();
        assert_eq!(p.reasoning(), "a<|open|>think<|sep|>b");

        // No think closure, but an answer opener: reasoning is what came before.
        let mut p = TolerantParser::new(true);
        p.push("r<|open|>response<|sep|>c");
        assert_eq!((p.reasoning(), p.content()), ("r", "c"));

        // Thinking off starts in the answer; finish releases held text.
        let mut p = TolerantParser::new(false);
        p.push("hi <|clo");
        assert_eq!(p.content(), "hi ");
        p.finish();
        assert_eq!(p.content(), "hi <|clo");
        assert_eq!(p.reasoning(), "");

        let mut p = TolerantParser::new(false);
        p.push("ok<|close|>response<|sep|>");
        assert_eq!(p.phase(), Phase::AfterResponse);
        p.push("<|close|>message<|sep|>");
        assert_eq!((p.phase(), p.content()), (Phase::Done, "ok"));
    }

    #[test]
    fn tolerant_parser_handles_multibyte_text() {
        let mut p = TolerantParser::new(false);
        for c in "héllo 你好 <|end_of_msg|>".chars() {
            p.push(&c.to_string());
        }
        assert_eq!(p.content(), "héllo 你好 ");
        assert_eq!(p.phase(), Phase::Done);
    }

    /// Small deterministic generator for the robustness tests.
    struct Lcg(u64);

    impl Lcg {
        fn next(&mut self, n: usize) -> usize {
            self.0 = self
                .0
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((self.0 >> 33) as usize) % n.max(1)
        }
    }

    #[test]
    fn parsers_never_panic_on_arbitrary_input() {
        let tok = tiny();
        let m = Markers::resolve(&tok).expect("markers");
        let good = completion(&tok, Some("r"), "c", m.eos);
        let mut pool: Vec<u32> = good.clone();
        pool.extend([0, 1, 255, 256, 257, 258, 259, 260, 261, 511, 512, u32::MAX]);
        let pieces = [
            "<",
            "<|",
            "|>",
            "<|open|>",
            "<|close|>",
            "<|sep|>",
            "think",
            "response",
            "tools",
            "message",
            "<|end_of_msg|>",
            "é",
            "你",
            "🚀",
            "x",
            " ",
        ];
        let mut rng = Lcg(7);
        for _ in 0..3000 {
            let len = rng.next(40);
            let ids: Vec<u32> = (0..len).map(|_| pool[rng.next(pool.len())]).collect();
            let thinking = rng.next(2) == 0;
            if let Err(e) = parse_strict(&tok, &m, &ids, thinking) {
                let _ = e.to_string();
            }
            let mut p = TolerantParser::new(thinking);
            let mut shown = String::new();
            for _ in 0..rng.next(30) {
                p.push(pieces[rng.next(pieces.len())]);
                let now = format!("{}\u{0}{}", p.reasoning(), p.content());
                assert!(now.len() >= shown.len());
                shown = now;
            }
            p.finish();
            assert_eq!(p.held_back(), "");
        }
    }

    // ---- API requests: tools, tool choice, response format ----

    use super::tools::{
        parse_api_completion, render_api_segments, ApiMessage, ApiOptions, ApiRole, ResponseFormat,
        ToolCall, ToolChoice,
    };

    fn api(msgs: &[Message]) -> Vec<ApiMessage> {
        msgs.iter()
            .map(|m| {
                let role = match m.role {
                    Role::System => ApiRole::System,
                    Role::User => ApiRole::User,
                    Role::Assistant => ApiRole::Assistant,
                };
                let mut a = ApiMessage::new(role, m.content.clone());
                a.reasoning.clone_from(&m.reasoning);
                a
            })
            .collect()
    }

    fn with(render: RenderOptions) -> ApiOptions {
        ApiOptions {
            render,
            ..ApiOptions::default()
        }
    }

    #[test]
    fn an_api_request_without_tools_renders_as_the_chat_does() {
        let tok = release();
        let m = Markers::resolve(tok).expect("markers");
        for opts in [RenderOptions::default(), off()] {
            for gen in [true, false] {
                let chat = render(tok, &worked_example(), &opts, gen).expect("chat");
                let segs =
                    render_api_segments(&api(&worked_example()), &with(opts), gen).expect("api");
                assert_eq!(encode_segments(tok, &m, &segs).expect("ids"), chat);
            }
        }
        // The golden of docs/runtime.md#worked-example, thinking off, through the API renderer.
        let segs = render_api_segments(&api(&worked_example()), &with(off()), true).expect("api");
        assert_eq!(
            encode_segments(tok, &m, &segs).expect("ids"),
            THINKING_OFF_64
        );
    }

    const WEATHER: &str = r#"[{"type":"function","function":{"name":"get_weather","description":"Weather — now","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]"#;

    #[test]
    fn tools_choice_and_format_messages_follow_the_release() {
        let opts = ApiOptions {
            render: off(),
            tools: Some(WEATHER.into()),
            tool_choice: ToolChoice::Required,
            response_format: ResponseFormat::JsonSchema(r#"{"type":"object","a":1}"#.into()),
        };
        let msgs = [ApiMessage::new(ApiRole::User, "Weather in Paris?")];
        let segs = render_api_segments(&msgs, &opts, true).expect("segments");
        let t = texts(&segs);
        // The declaration first: role, type, then the body.
        assert_eq!(
            t[..11],
            [
                OPEN,
                "message",
                " role",
                "=\"",
                "system",
                "\"",
                " type",
                "=\"",
                "tool-declare",
                "\"",
                SEP
            ]
        );
        assert_eq!(
            t[11],
            "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n\
             [{\"function\":{\"description\":\"Weather — now\",\"name\":\"get_weather\",\
             \"parameters\":{\"properties\":{\"city\":{\"type\":\"string\"}},\"type\":\"object\"}},\
             \"type\":\"function\"}]\n```"
        );
        let bodies: Vec<&str> = segs
            .iter()
            .filter(|s| !s.allow_special && s.text.len() > 40)
            .map(|s| s.text.as_str())
            .collect();
        assert_eq!(bodies.len(), 3, "{bodies:?}");
        assert_eq!(
            bodies[1],
            "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next \
             message."
        );
        assert!(bodies[2].starts_with("The system is invoked with `response_format=json_object`."));
        assert!(bodies[2].ends_with(
            "\nThe JSON data must match the following schema:\n```json\n{\"a\":1,\"type\":\"object\"}\n```"
        ));
        // Order: declaration, the user message, tool choice, format, generation prompt.
        let user_at = t
            .iter()
            .position(|x| *x == "Weather in Paris?")
            .expect("user");
        let choice_at = t.iter().position(|x| *x == bodies[1]).expect("choice");
        assert!(user_at < choice_at);
        assert_eq!(t[t.len() - 3..], [OPEN, "response", SEP]);
        // Bad JSON is refused with its part named.
        let bad = ApiOptions {
            tools: Some("[{".into()),
            ..with(off())
        };
        let e = render_api_segments(&msgs, &bad, true).expect_err("bad tools");
        assert!(e.to_string().starts_with("tools is not valid JSON"), "{e}");
    }

    #[test]
    fn tool_calls_render_and_parse_back_on_the_released_layout() {
        let tok = release();
        let m = Markers::resolve(tok).expect("markers");
        let calls = vec![
            ToolCall {
                id: "call_1".into(),
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris","days":3,"opts":{"b":1,"a":[true,null]}}"#.into(),
            },
            ToolCall {
                id: "call_2".into(),
                name: "free_form".into(),
                arguments: "not json at all".into(),
            },
        ];
        for thinking in [true, false] {
            let opts = with(RenderOptions {
                thinking,
                effort: Effort::Max,
            });
            let user = ApiMessage::new(ApiRole::User, "Weather?");
            let mut reply = ApiMessage::new(ApiRole::Assistant, "Let me look.");
            reply.reasoning = Some(REASONING.into());
            reply.tool_calls.clone_from(&calls);
            let prompt = encode_segments(
                tok,
                &m,
                &render_api_segments(std::slice::from_ref(&user), &opts, true).expect("prompt"),
            )
            .expect("ids");
            let all = encode_segments(
                tok,
                &m,
                &render_api_segments(&[user, reply], &opts, false).expect("history"),
            )
            .expect("ids");
            assert!(all.starts_with(&prompt));
            let completion = &all[prompt.len()..];
            // The released ids of the block's skeleton.
            assert!(completion
                .windows(4)
                .any(|w| w == [163588, 12092, 163589, 163587]));
            assert_eq!(completion.last(), Some(&RELEASED_END_OF_MSG_ID));
            // The strict parser of a text-only turn refuses the tools block …
            assert!(parse_strict(tok, &m, completion, thinking).is_err());
            // … the API parser reads it.
            let turn = parse_api_completion(tok, &m, completion, thinking).expect("tool turn");
            assert_eq!(turn.turn.content, "Let me look.");
            assert_eq!(
                turn.turn.reasoning.as_deref(),
                thinking.then_some(REASONING)
            );
            assert_eq!(turn.tool_calls, calls);
            // Ended with [EOS] instead: accepted too.
            let mut eos = completion.to_vec();
            *eos.last_mut().expect("end id") = RELEASED_EOS_ID;
            assert!(parse_api_completion(tok, &m, &eos, thinking).is_ok());
            // Cut inside the block: refused, the answer kept for display.
            let cut = &completion[..completion.len() - 8];
            let e = parse_api_completion(tok, &m, cut, thinking).expect_err("cut");
            assert_eq!(
                e.partial().map(|p| p.content.as_str()),
                Some("Let me look.")
            );
        }
        // A plain turn still parses, with no calls.
        let plain = completion(tok, Some("r"), "c", RELEASED_EOS_ID);
        let turn = parse_api_completion(tok, &m, &plain, true).expect("plain");
        assert!(turn.tool_calls.is_empty());
        assert_eq!(turn.turn.content, "c");
    }

    #[test]
    fn argument_values_are_typed_and_tool_results_follow_the_calls() {
        let mut b = Builder::default();
        super::tools::render_arguments(
            &mut b,
            r#"{"s":"é \"q\"","n":1.5,"o":{"z":1,"a":"é"},"l":[1,"x"],"t":true,"u":null}"#,
        );
        let t = texts(&b.segments);
        let value = |key: &str| {
            let at = t
                .windows(3)
                .position(|w| w[0] == " key" && w[2] == key)
                .unwrap_or_else(|| panic!("{key} missing: {t:?}"));
            (t[at + 6], t[at + 9])
        };
        assert_eq!(value("s"), ("string", "é \"q\""));
        assert_eq!(value("n"), ("number", "1.5"));
        assert_eq!(value("o"), ("object", "{\"z\": 1, \"a\": \"\\u00e9\"}"));
        assert_eq!(value("l"), ("array", "[1, \"x\"]"));
        assert_eq!(value("t"), ("boolean", "true"));
        assert_eq!(value("u").0, "null");

        let mut call = ApiMessage::new(ApiRole::Assistant, "");
        for (id, name) in [("x", "first"), ("y", "second")] {
            call.tool_calls.push(ToolCall {
                id: id.into(),
                name: name.into(),
                arguments: "{}".into(),
            });
        }
        let result = |id: &str, text: &str| {
            let mut r = ApiMessage::new(ApiRole::Tool, text);
            r.tool_call_id = Some(id.into());
            r
        };
        let msgs = [call, result("y", "two"), result("x", "one")];
        let t_segs = render_api_segments(&msgs, &with(off()), false).expect("segments");
        let t = texts(&t_segs);
        let one = t.iter().position(|x| *x == "one").expect("one");
        let two = t.iter().position(|x| *x == "two").expect("two");
        assert!(one < two, "results follow the order of the calls");
        assert_eq!(
            t[one - 13..one - 4],
            [" role", "=\"", "tool", "\"", " tool", "=\"", "first", "\"", " index"]
        );
        assert_eq!(t[one - 3], "1");
        assert_eq!(t[two - 3], "2");
        assert!(ApiRole::parse("wizard").is_err());
    }
}
