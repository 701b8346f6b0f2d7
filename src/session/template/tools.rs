//! The parts of the XTML template an API request adds to a plain conversation
//! (docs/runtime.md#api-requests-and-tools): tool declarations, `tool_choice` and `response_format` system messages, tool results,
//! the `name` attribute, assistant tool calls, and parsing the `tools` block the model writes
//! after its answer.
//!
//! [`render_api_segments`] renders a conversation without any of these exactly as
//! [`super::render_segments`] does (the same builder, in the same order), so a request from a
//! client and a `k3 chat` turn share their state-reuse prefixes.

use super::{
    excerpt, is_python_space, parse_strict, Builder, Markers, ParseError, ParsedTurn,
    RenderOptions, Segment, TemplateError, TAG_MESSAGE, TAG_RESPONSE, TAG_THINK,
};
use crate::session::tokenizer::Tokenizer;
use serde::de::{Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use std::fmt;

const TAG_TOOLS: &str = "tools";
const TAG_CALL: &str = "call";
const TAG_ARGUMENT: &str = "argument";
const TAG_JSON: &str = "json";

/// Who wrote a message of an API request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApiRole {
    /// Instructions from the operator.
    System,
    /// The person (or program) asking.
    User,
    /// The model.
    Assistant,
    /// The result of a tool call.
    Tool,
}

impl ApiRole {
    /// Parses `system`, `user`, `assistant` or `tool` (`developer` is read as `system`, as the
    /// OpenAI API defines it); any other role is refused.
    pub fn parse(s: &str) -> Result<ApiRole, TemplateError> {
        match s {
            "system" | "developer" => Ok(ApiRole::System),
            "user" => Ok(ApiRole::User),
            "assistant" => Ok(ApiRole::Assistant),
            "tool" => Ok(ApiRole::Tool),
            _ => Err(TemplateError::UnknownRole { found: excerpt(s) }),
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            ApiRole::System => "system",
            ApiRole::User => "user",
            ApiRole::Assistant => "assistant",
            ApiRole::Tool => "tool",
        }
    }
}

/// One tool call of an assistant message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// The call's id (`tool_call_id` of its result); not rendered.
    pub id: String,
    /// The function's name.
    pub name: String,
    /// The arguments as JSON text (an object, or anything when the model wrote it so).
    pub arguments: String,
}

/// One message of an API request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiMessage {
    /// Who wrote it.
    pub role: ApiRole,
    /// The text, rendered verbatim.
    pub content: String,
    /// Assistant reasoning (`reasoning_content`).
    pub reasoning: Option<String>,
    /// The `name` attribute of a system or user message (skipped when empty); the tool's name
    /// for a tool result.
    pub name: Option<String>,
    /// An assistant's tool calls.
    pub tool_calls: Vec<ToolCall>,
    /// The call a tool result answers.
    pub tool_call_id: Option<String>,
    /// Tools declared by a system message (lazily loaded tools), as JSON text.
    pub tools: Option<String>,
}

impl ApiMessage {
    /// A message with only a role and text.
    pub fn new(role: ApiRole, content: impl Into<String>) -> ApiMessage {
        ApiMessage {
            role,
            content: content.into(),
            reasoning: None,
            name: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
            tools: None,
        }
    }
}

/// `tool_choice`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// The model decides (no system message).
    #[default]
    Auto,
    /// The model must call a tool.
    Required,
    /// The model must not call a tool.
    None,
}

/// `response_format`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ResponseFormat {
    /// Plain text (no system message).
    #[default]
    Text,
    /// Raw JSON.
    JsonObject,
    /// Raw JSON matching a schema (its JSON text).
    JsonSchema(String),
}

/// Everything besides the messages that changes an API request's prompt.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ApiOptions {
    /// Thinking and effort.
    pub render: RenderOptions,
    /// The declared tools as one JSON array's text (`None` or `[]`: no declaration).
    pub tools: Option<String>,
    /// `tool_choice`.
    pub tool_choice: ToolChoice,
    /// `response_format`.
    pub response_format: ResponseFormat,
}

/// A JSON value that keeps the order of object keys (an argument list is rendered in the order
/// the client wrote it, as the release does with Python dicts).
#[derive(Debug, Clone, PartialEq)]
pub enum OrderedJson {
    /// `null`.
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// A number, as serde_json read it.
    Number(serde_json::Number),
    /// A string.
    String(String),
    /// An array.
    Array(Vec<OrderedJson>),
    /// An object, keys in their written order.
    Object(Vec<(String, OrderedJson)>),
}

impl<'de> Deserialize<'de> for OrderedJson {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = OrderedJson;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_unit<E>(self) -> Result<OrderedJson, E> {
                Ok(OrderedJson::Null)
            }
            fn visit_none<E>(self) -> Result<OrderedJson, E> {
                Ok(OrderedJson::Null)
            }
            fn visit_bool<E>(self, b: bool) -> Result<OrderedJson, E> {
                Ok(OrderedJson::Bool(b))
            }
            fn visit_i64<E>(self, n: i64) -> Result<OrderedJson, E> {
                Ok(OrderedJson::Number(n.into()))
            }
            fn visit_u64<E>(self, n: u64) -> Result<OrderedJson, E> {
                Ok(OrderedJson::Number(n.into()))
            }
            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<OrderedJson, E> {
                serde_json::Number::from_f64(n)
                    .map(OrderedJson::Number)
                    .ok_or_else(|| E::custom("a number that is not finite"))
            }
            fn visit_str<E>(self, s: &str) -> Result<OrderedJson, E> {
                Ok(OrderedJson::String(s.to_owned()))
            }
            fn visit_string<E>(self, s: String) -> Result<OrderedJson, E> {
                Ok(OrderedJson::String(s))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<OrderedJson, A::Error> {
                let mut v = Vec::new();
                while let Some(x) = a.next_element()? {
                    v.push(x);
                }
                Ok(OrderedJson::Array(v))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<OrderedJson, A::Error> {
                let mut v = Vec::new();
                while let Some((k, x)) = a.next_entry::<String, OrderedJson>()? {
                    v.push((k, x));
                }
                Ok(OrderedJson::Object(v))
            }
        }
        d.deserialize_any(V)
    }
}

impl OrderedJson {
    /// Parses JSON text.
    pub fn parse(text: &str) -> Result<OrderedJson, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// The JSON type name the template writes in an argument's `type` attribute.
    fn type_name(&self) -> &'static str {
        match self {
            OrderedJson::Null => "null",
            OrderedJson::Bool(_) => "boolean",
            OrderedJson::Number(_) => "number",
            OrderedJson::String(_) => "string",
            OrderedJson::Array(_) => "array",
            OrderedJson::Object(_) => "object",
        }
    }

    /// Compact JSON (`,` and `:`), object keys sorted recursively, non-ASCII kept: how the
    /// release serializes tool schemas.
    pub fn to_sorted_compact(&self) -> String {
        let mut out = String::new();
        self.write(&mut out, true, ",", ":", false);
        out
    }

    /// Python `json.dumps` with its defaults (`, ` and `: `, keys in order, non-ASCII escaped):
    /// how the release writes a non-string argument value.
    pub fn to_python_default(&self) -> String {
        let mut out = String::new();
        self.write(&mut out, false, ", ", ": ", true);
        out
    }

    /// Compact JSON with keys in their order (a tool call's `arguments` in a reply).
    pub fn to_compact(&self) -> String {
        let mut out = String::new();
        self.write(&mut out, false, ",", ":", false);
        out
    }

    fn write(&self, out: &mut String, sort: bool, comma: &str, colon: &str, ascii: bool) {
        match self {
            OrderedJson::Null => out.push_str("null"),
            OrderedJson::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            OrderedJson::Number(n) => out.push_str(&n.to_string()),
            OrderedJson::String(s) => write_json_string(out, s, ascii),
            OrderedJson::Array(v) => {
                out.push('[');
                for (i, x) in v.iter().enumerate() {
                    if i > 0 {
                        out.push_str(comma);
                    }
                    x.write(out, sort, comma, colon, ascii);
                }
                out.push(']');
            }
            OrderedJson::Object(v) => {
                let mut entries: Vec<&(String, OrderedJson)> = v.iter().collect();
                if sort {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                out.push('{');
                for (i, (k, x)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(comma);
                    }
                    write_json_string(out, k, ascii);
                    out.push_str(colon);
                    x.write(out, sort, comma, colon, ascii);
                }
                out.push('}');
            }
        }
    }
}

/// A JSON string literal as Python writes it (`\uXXXX` for control characters, and for every
/// non-ASCII UTF-16 unit when `ascii`).
fn write_json_string(out: &mut String, s: &str, ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ascii && !c.is_ascii()) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A request's JSON that the template cannot use.
fn bad_json(what: &str, e: &serde_json::Error) -> TemplateError {
    TemplateError::BadJson {
        what: what.to_owned(),
        reason: e.to_string(),
    }
}

/// The fenced JSON block of a tool declaration or schema.
fn fenced(json: &str) -> String {
    format!("```json\n{json}\n```")
}

/// Body of a tool-declaration message (`dynamic`: tools declared by a system message).
fn tool_declare_body(tools_json: &str, dynamic: bool) -> Result<String, TemplateError> {
    let tools = OrderedJson::parse(tools_json).map_err(|e| bad_json("tools", &e))?;
    let head = if dynamic {
        "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n\
         You have access to all existing and extended tools.\nHere are the specs for the \
         extended tools.\n\n"
    } else {
        "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
    };
    Ok(format!("{head}{}", fenced(&tools.to_sorted_compact())))
}

/// Whether a tools list is absent or empty.
fn no_tools(tools: Option<&str>) -> bool {
    tools.is_none_or(|t| t.trim().is_empty() || t.trim() == "[]")
}

/// An internal system message (`type` = `kind`) with a whitespace-stripped body.
fn internal(b: &mut Builder, kind: &str, body: &str) {
    b.message(
        &[("role", "system"), ("type", kind)],
        body.trim_matches(is_python_space),
    );
}

/// Renders an API request (docs/runtime.md#render-order): the tool declaration, the thinking-effort message,
/// every message (tool results in the order of the assistant's calls where every id resolves),
/// the `tool_choice` and `response_format` messages, and the generation prompt.
pub fn render_api_segments(
    messages: &[ApiMessage],
    opts: &ApiOptions,
    add_generation_prompt: bool,
) -> Result<Vec<Segment>, TemplateError> {
    let mut b = Builder::default();
    if !no_tools(opts.tools.as_deref()) {
        let body = tool_declare_body(opts.tools.as_deref().unwrap_or("[]"), false)?;
        b.message(&[("role", "system"), ("type", "tool-declare")], &body);
    }
    if opts.render.thinking {
        b.message(
            &[("role", "system"), ("type", "thinking-effort")],
            &super::effort_message_body(opts.render.effort),
        );
    }
    let mut i = 0;
    while i < messages.len() {
        let msg = &messages[i];
        if msg.role == ApiRole::Tool {
            // A run of tool results, answering the assistant message before it.
            let end = messages[i..]
                .iter()
                .position(|m| m.role != ApiRole::Tool)
                .map_or(messages.len(), |p| i + p);
            let calls: &[ToolCall] = messages[..i]
                .iter()
                .rev()
                .find(|m| m.role == ApiRole::Assistant)
                .map_or(&[], |m| &m.tool_calls);
            let mut run: Vec<&ApiMessage> = messages[i..end].iter().collect();
            let position = |m: &ApiMessage| {
                m.tool_call_id
                    .as_ref()
                    .and_then(|id| calls.iter().position(|c| &c.id == id))
            };
            if run.iter().all(|m| position(m).is_some()) {
                run.sort_by_key(|m| position(m));
            }
            for (k, m) in run.into_iter().enumerate() {
                let name = m
                    .name
                    .clone()
                    .or_else(|| position(m).map(|p| calls[p].name.clone()))
                    .unwrap_or_default();
                let index = (k + 1).to_string();
                b.message(
                    &[("role", "tool"), ("tool", &name), ("index", &index)],
                    &m.content,
                );
            }
            i = end;
            continue;
        }
        render_message(&mut b, i, msg, &opts.render)?;
        i += 1;
    }
    match opts.tool_choice {
        ToolChoice::Auto => {}
        ToolChoice::Required => internal(
            &mut b,
            "tool-choice",
            "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next \
             message.",
        ),
        ToolChoice::None => internal(
            &mut b,
            "tool-choice",
            "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the \
             next message.",
        ),
    }
    let json_object = "The system is invoked with `response_format=json_object`.\nYour response \
                       must be raw JSON data without markdown code blocks (```json) or any \
                       additional formatting.";
    match &opts.response_format {
        ResponseFormat::Text => {}
        ResponseFormat::JsonObject => internal(&mut b, "response-format", json_object),
        ResponseFormat::JsonSchema(schema) => {
            let schema = OrderedJson::parse(schema).map_err(|e| bad_json("json_schema", &e))?;
            let body = format!(
                "{json_object}\nThe JSON data must match the following schema:\n{}",
                fenced(&schema.to_sorted_compact())
            );
            internal(&mut b, "response-format", &body);
        }
    }
    if add_generation_prompt {
        b.open_tag(TAG_MESSAGE, &[("role", "assistant")]);
        b.open_tag(
            if opts.render.thinking {
                TAG_THINK
            } else {
                TAG_RESPONSE
            },
            &[],
        );
    }
    Ok(b.segments)
}

fn render_message(
    b: &mut Builder,
    index: usize,
    msg: &ApiMessage,
    opts: &RenderOptions,
) -> Result<(), TemplateError> {
    match msg.role {
        ApiRole::System if !no_tools(msg.tools.as_deref()) => {
            let body = tool_declare_body(msg.tools.as_deref().unwrap_or("[]"), true)?;
            b.message(&[("role", "system"), ("type", "tool-declare")], &body);
        }
        ApiRole::System | ApiRole::User => {
            if msg.reasoning.is_some() {
                let role = if msg.role == ApiRole::System {
                    super::Role::System
                } else {
                    super::Role::User
                };
                return Err(TemplateError::ReasoningOnNonAssistant { index, role });
            }
            let role = msg.role.as_str();
            match msg.name.as_deref().filter(|n| !n.is_empty()) {
                Some(name) => b.message(&[("role", role), ("name", name)], &msg.content),
                None => b.message(&[("role", role)], &msg.content),
            }
        }
        ApiRole::Assistant => {
            b.open_tag(TAG_MESSAGE, &[("role", "assistant")]);
            if opts.thinking {
                b.open_tag(TAG_THINK, &[]);
                if let Some(r) = &msg.reasoning {
                    if !r.chars().all(is_python_space) {
                        b.text(r);
                    }
                }
                b.close_tag(TAG_THINK);
            }
            b.open_tag(TAG_RESPONSE, &[]);
            b.text(&msg.content);
            b.close_tag(TAG_RESPONSE);
            if !msg.tool_calls.is_empty() {
                b.open_tag(TAG_TOOLS, &[]);
                for (k, call) in msg.tool_calls.iter().enumerate() {
                    let index = (k + 1).to_string();
                    b.open_tag(TAG_CALL, &[("tool", &call.name), ("index", &index)]);
                    render_arguments(b, &call.arguments);
                    b.close_tag(TAG_CALL);
                }
                b.close_tag(TAG_TOOLS);
            }
            b.close_tag(TAG_MESSAGE);
            b.end_of_msg();
        }
        ApiRole::Tool => {
            // Runs of tool results are rendered by the caller; a lone one is index 1.
            let name = msg.name.clone().unwrap_or_default();
            b.message(
                &[("role", "tool"), ("tool", &name), ("index", "1")],
                &msg.content,
            );
        }
    }
    Ok(())
}

/// One `argument` element per key of an object; anything else (unparsable text, an array, a
/// scalar) as one `json` element of type `object` holding the text as given.
pub(super) fn render_arguments(b: &mut Builder, arguments: &str) {
    match OrderedJson::parse(arguments) {
        Ok(OrderedJson::Object(entries)) => {
            for (key, value) in entries {
                b.open_tag(TAG_ARGUMENT, &[("key", &key), ("type", value.type_name())]);
                match &value {
                    OrderedJson::String(s) => b.text(s),
                    other => b.text(&other.to_python_default()),
                }
                b.close_tag(TAG_ARGUMENT);
            }
        }
        _ => {
            b.open_tag(TAG_JSON, &[("type", "object")]);
            b.text(arguments);
            b.close_tag(TAG_JSON);
        }
    }
}

/// A parsed assistant turn with its tool calls.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApiTurn {
    /// Reasoning and answer.
    pub turn: ParsedTurn,
    /// The calls of the `tools` block, in order (ids `call_1`, `call_2`, … by index).
    pub tool_calls: Vec<ToolCall>,
}

/// [`parse_strict`], also accepting a `tools` block between the answer's closure and the
/// message's: `<|open|>tools<|sep|>` then per call `<|open|>call tool="NAME" index="I"<|sep|>`,
/// its `argument` (or `json`) elements, `<|close|>call<|sep|>`, and `<|close|>tools<|sep|>`.
/// An argument's value is JSON text unless its type is `string`.
/// Over 100 lines: one parser over the completion's markers in order, each refusal with its own
/// message.
pub fn parse_api_completion(
    tok: &Tokenizer,
    markers: &Markers,
    completion: &[u32],
    thinking: bool,
) -> Result<ApiTurn, ParseError> {
    let first = match parse_strict(tok, markers, completion, thinking) {
        Ok(turn) => {
            return Ok(ApiTurn {
                turn,
                tool_calls: Vec::new(),
            })
        }
        Err(e) => e,
    };
    let word = |w: &str| tok.encode(w, false);
    let mut response_close = vec![markers.close];
    response_close.extend(word(TAG_RESPONSE));
    response_close.push(markers.sep);
    let mut tools_open = response_close.clone();
    tools_open.push(markers.open);
    tools_open.extend(word(TAG_TOOLS));
    tools_open.push(markers.sep);
    let Some(at) = super::find_seq(completion, &tools_open, 0) else {
        return Err(first);
    };
    // The turn up to the answer's closure, checked by the strict parser.
    let mut plain = completion[..at].to_vec();
    plain.extend_from_slice(&response_close);
    plain.push(markers.close);
    plain.extend(word(TAG_MESSAGE));
    plain.push(markers.sep);
    plain.push(markers.eos);
    let turn = parse_strict(tok, markers, &plain, thinking)?;
    let body = &completion[at + tools_open.len()..];
    let bad = |reason: String| ParseError::BadToolCall {
        reason,
        partial: turn.clone(),
    };
    let items = tag_stream(tok, markers, body);
    let mut calls = Vec::new();
    let mut pos = 0;
    let mut next = || {
        let item = items.get(pos).cloned();
        pos += 1;
        item
    };
    loop {
        match next() {
            Some(Item::Open(tag, attrs)) if tag == TAG_CALL => {
                let name =
                    attr(&attrs, "tool").ok_or_else(|| bad("a call without a tool".into()))?;
                let index = calls.len() + 1;
                let mut args: Vec<(String, OrderedJson)> = Vec::new();
                let mut raw: Option<String> = None;
                loop {
                    match next() {
                        Some(Item::Open(t, a)) if t == TAG_ARGUMENT || t == TAG_JSON => {
                            let text = match next() {
                                Some(Item::Text(s)) => {
                                    let s = s.clone();
                                    match next() {
                                        Some(Item::Close(c)) if c == t => s,
                                        _ => return Err(bad(format!("an unclosed {t} element"))),
                                    }
                                }
                                Some(Item::Close(c)) if c == t => String::new(),
                                _ => return Err(bad(format!("an unclosed {t} element"))),
                            };
                            if t == TAG_JSON {
                                raw = Some(text);
                                continue;
                            }
                            let key = attr(&a, "key")
                                .ok_or_else(|| bad("an argument without a key".into()))?;
                            let value = match attr(&a, "type").as_deref() {
                                Some("string") | None => OrderedJson::String(text),
                                Some(ty) => OrderedJson::parse(&text).map_err(|e| {
                                    bad(format!("argument {key:?} of type {ty} is not JSON: {e}"))
                                })?,
                            };
                            args.push((key, value));
                        }
                        Some(Item::Close(t)) if t == TAG_CALL => break,
                        Some(Item::Text(t)) if t.chars().all(is_python_space) => {}
                        other => return Err(bad(format!("unexpected {other:?} inside a call"))),
                    }
                }
                let arguments = raw.unwrap_or_else(|| OrderedJson::Object(args).to_compact());
                calls.push(ToolCall {
                    id: format!("call_{index}"),
                    name,
                    arguments,
                });
            }
            Some(Item::Close(t)) if t == TAG_TOOLS => break,
            Some(Item::Text(t)) if t.chars().all(is_python_space) => {}
            None => return Err(bad("the tools block is not closed".into())),
            other => return Err(bad(format!("unexpected {other:?} in the tools block"))),
        }
    }
    let rest = items.get(pos..).unwrap_or(&[]);
    match rest {
        [Item::Close(t), Item::End(id)] if t == TAG_MESSAGE && markers.is_stop(*id) => {
            Ok(ApiTurn {
                turn,
                tool_calls: calls,
            })
        }
        [Item::Close(t)] if t == TAG_MESSAGE => Err(ParseError::MissingEndId { partial: turn }),
        _ => Err(bad(
            "the tools block is not followed by `<|close|>message<|sep|>` and an end id".into(),
        )),
    }
}

/// One piece of a tag stream.
#[derive(Debug, Clone, PartialEq)]
enum Item {
    /// `<|open|>TAG attrs<|sep|>`.
    Open(String, Vec<(String, String)>),
    /// `<|close|>TAG<|sep|>`.
    Close(String),
    /// Text between tags.
    Text(String),
    /// An end id.
    End(u32),
    /// Anything else special, or a tag that never reaches its `<|sep|>`.
    Stray(u32),
}

/// Splits ids into tags and text (decoded).
fn tag_stream(tok: &Tokenizer, markers: &Markers, ids: &[u32]) -> Vec<Item> {
    let mut out = Vec::new();
    let mut i = 0;
    let decode = |s: &[u32]| super::decode_text(tok, s);
    while i < ids.len() {
        let id = ids[i];
        if id == markers.open || id == markers.close {
            match ids[i + 1..].iter().position(|&x| x == markers.sep) {
                Some(p) if ids[i + 1..i + 1 + p].iter().all(|&x| x < tok.n_base()) => {
                    let header = decode(&ids[i + 1..i + 1 + p]);
                    out.push(if id == markers.open {
                        let (tag, attrs) = parse_header(&header);
                        Item::Open(tag, attrs)
                    } else {
                        Item::Close(header)
                    });
                    i += p + 2;
                }
                _ => {
                    out.push(Item::Stray(id));
                    i += 1;
                }
            }
        } else if markers.is_stop(id) {
            out.push(Item::End(id));
            i += 1;
        } else if id >= tok.n_base() {
            out.push(Item::Stray(id));
            i += 1;
        } else {
            let end = ids[i..]
                .iter()
                .position(|&x| x >= tok.n_base())
                .map_or(ids.len(), |p| i + p);
            out.push(Item::Text(decode(&ids[i..end])));
            i = end;
        }
    }
    out
}

/// `call tool="x" index="1"` → (`call`, [(tool, x), (index, 1)]), values unescaped.
fn parse_header(header: &str) -> (String, Vec<(String, String)>) {
    let (tag, mut rest) = match header.find(' ') {
        Some(p) => (&header[..p], &header[p..]),
        None => (header, ""),
    };
    let mut attrs = Vec::new();
    while let Some(eq) = rest.find("=\"") {
        let key = rest[..eq].trim().to_owned();
        let after = &rest[eq + 2..];
        let Some(close) = after.find('"') else { break };
        let value = after[..close].replace("&quot;", "\"").replace("&amp;", "&");
        attrs.push((key, value));
        rest = &after[close + 1..];
    }
    (tag.to_owned(), attrs)
}

fn attr(attrs: &[(String, String)], key: &str) -> Option<String> {
    attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
}
