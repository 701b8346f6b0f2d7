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
mod tests;
