//! The JSON of the API: requests, their checks, and the response and chunk objects. No I/O.
//!
//! What real clients send is accepted as vLLM accepts it (docs/serve.md has the table):
//! `stop` strings are applied; `n` must be 1; `seed`, `user`, `store`, `metadata`,
//! `stream_options`, `parallel_tool_calls` are taken; `frequency_penalty`,
//! `presence_penalty`, `logit_bias`, `logprobs` and `top_logprobs` are accepted and not
//! applied. Fields this server does not know are ignored; [`Parsed::ignored`] names them (and
//! the accepted-not-applied ones) for the server's log line. [`parse_chat`] and
//! [`parse_completion`] are pure: bytes in, a checked request or an [`ApiError`] out.

use super::engine::{Finished, Task};
use super::MAX_MESSAGES;
use crate::session::chat::Settings;
use crate::session::template::tools::{
    ApiMessage, ApiOptions, ApiRole, ResponseFormat, ToolCall, ToolChoice,
};
use crate::session::template::{Effort, RenderOptions};
use serde::Deserialize;
use serde_json::{json, Value};

/// An OpenAI-style error: status, message, the parameter at fault.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// What is wrong.
    pub message: String,
    /// The parameter at fault, if one.
    pub param: Option<String>,
}

impl ApiError {
    /// A 400 naming `param`.
    pub fn bad(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            param: Some(param.to_owned()),
        }
    }

    /// The error object (`{"error": {message, type, param, code}}`).
    #[must_use]
    pub fn body(&self) -> Value {
        let kind = match self.status {
            400 | 404 | 413 => "invalid_request_error",
            401 => "authentication_error",
            429 => "rate_limit_error",
            503 => "service_unavailable",
            _ => "server_error",
        };
        json!({"error": {"message": self.message, "type": kind, "param": self.param,
                         "code": Value::Null}})
    }
}

/// `thinking` of a chat request.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Thinking {
    #[serde(rename = "type")]
    kind: Option<String>,
    effort: Option<String>,
    keep: Option<Value>,
}

/// `stream_options` (others, such as vLLM's `continuous_usage_stats`, are ignored).
#[derive(Debug, Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

/// Most stop strings a request may give, and the longest one (in bytes).
pub const MAX_STOPS: usize = 16;
/// See [`MAX_STOPS`].
pub const MAX_STOP_BYTES: usize = 256;

#[derive(Debug, Deserialize)]
struct WireFunction {
    name: String,
    arguments: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct WireToolCall {
    id: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    index: Option<u64>,
    function: WireFunction,
}

#[derive(Debug, Deserialize)]
struct WireMessage {
    role: String,
    content: Option<Value>,
    reasoning_content: Option<String>,
    reasoning: Option<String>,
    name: Option<String>,
    tool_calls: Option<Vec<WireToolCall>>,
    tool_call_id: Option<String>,
    tools: Option<Value>,
    /// Anything else (`refusal`, `annotations`, `audio`, … as a client echoes a reply back).
    #[serde(flatten)]
    other: serde_json::Map<String, Value>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
struct ChatRequest {
    model: Option<String>,
    messages: Vec<WireMessage>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    response_format: Option<Value>,
    thinking: Option<Thinking>,
    reasoning_effort: Option<String>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    seed: Option<u64>,
    n: Option<u64>,
    stop: Option<Value>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    /// A string by the API; any JSON is taken (some front ends send an object).
    user: Option<Value>,
    parallel_tool_calls: Option<bool>,
    logprobs: Option<bool>,
    top_logprobs: Option<u64>,
    logit_bias: Option<Value>,
    store: Option<bool>,
    metadata: Option<Value>,
    /// Fields this server does not know (named in the log line).
    #[serde(flatten)]
    other: serde_json::Map<String, Value>,
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
struct CompletionRequest {
    model: Option<String>,
    prompt: Value,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    max_tokens: Option<u64>,
    seed: Option<u64>,
    n: Option<u64>,
    stop: Option<Value>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    user: Option<String>,
    echo: Option<bool>,
    logprobs: Option<Value>,
    logit_bias: Option<Value>,
    suffix: Option<String>,
    best_of: Option<u64>,
    /// Fields this server does not know (named in the log line).
    #[serde(flatten)]
    other: serde_json::Map<String, Value>,
}

/// A checked request, ready for the engine.
#[derive(Debug)]
pub struct Parsed {
    /// What to do.
    pub task: Task,
    /// Sampling and length.
    pub settings: Settings,
    /// SSE.
    pub stream: bool,
    /// Send a usage chunk before `[DONE]`.
    pub include_usage: bool,
    /// Thinking on (chat).
    pub thinking: bool,
    /// Stop strings: the reply ends before the first one, which is never sent.
    pub stop: Vec<String>,
    /// Fields accepted but not applied, and fields not known, for the log line.
    pub ignored: Vec<String>,
}

/// Limits from the command line.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most tokens of one reply.
    pub max_tokens: usize,
    /// Positions one request may use.
    pub context: usize,
    /// Sampling of a request that leaves a setting out (`k3 serve` resolves it from the user
    /// config file, the model's `generation_config.json` and the built-in defaults).
    pub sampler: crate::engine::sampling::SamplerConfig,
    /// Reply length of a request that gives no `max_tokens` (at most `max_tokens`).
    pub default_max_tokens: usize,
}

fn json_error(e: &serde_json::Error) -> ApiError {
    ApiError {
        status: 400,
        message: format!("the request body is not a valid request: {e}"),
        param: None,
    }
}

/// Sampling, length and the refused parameters shared by both endpoints.
#[allow(clippy::too_many_arguments)]
fn sampling(
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    max_tokens: Option<u64>,
    default_max: usize,
    seed: Option<u64>,
    n: Option<u64>,
    stop: Option<&Value>,
    presence: Option<f32>,
    frequency: Option<f32>,
    limits: Limits,
) -> Result<(Settings, Vec<String>), ApiError> {
    if n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad(
            "n",
            "only n = 1 is supported (this server generates one sequence per request)",
        ));
    }
    for (name, v) in [
        ("presence_penalty", presence),
        ("frequency_penalty", frequency),
    ] {
        if v.is_some_and(|v| !(v.is_finite() && (-2.0..=2.0).contains(&v))) {
            return Err(ApiError::bad(
                name,
                format!("{name} must be a number from -2 to 2"),
            ));
        }
    }
    let max = match max_tokens {
        None => default_max,
        Some(0) => return Err(ApiError::bad("max_tokens", "max_tokens must be at least 1")),
        Some(m) if m > limits.max_tokens as u64 => {
            return Err(ApiError::bad(
                "max_tokens",
                format!(
                    "max_tokens {m} is above this server's limit of {} (--max-tokens)",
                    limits.max_tokens
                ),
            ))
        }
        Some(m) => m as usize,
    };
    let d = limits.sampler;
    let s = Settings {
        sampler: crate::engine::sampling::SamplerConfig {
            temperature: temperature.unwrap_or(d.temperature),
            top_p: top_p.unwrap_or(d.top_p),
            top_k: top_k.unwrap_or(d.top_k),
            min_p: min_p.unwrap_or(d.min_p),
            repeat_penalty: repetition_penalty.unwrap_or(d.repeat_penalty),
            seed: seed.unwrap_or(d.seed),
        },
        max_tokens: max,
        context_limit: limits.context,
        ..Settings::default()
    };
    crate::engine::sampling::Sampler::new(s.sampler())
        .map_err(|e| ApiError::bad("temperature", e.to_string()))?;
    Ok((s, stop_strings(stop)?))
}

/// `stop`: a string or a list of strings (empty ones dropped), at most [`MAX_STOPS`] of at
/// most [`MAX_STOP_BYTES`] bytes.
fn stop_strings(stop: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let list: Vec<String> = match stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str().map(str::to_owned).ok_or_else(|| {
                    ApiError::bad("stop", "stop must be a string or a list of strings")
                })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::bad(
                "stop",
                "stop must be a string or a list of strings",
            ))
        }
    };
    let list: Vec<String> = list.into_iter().filter(|s| !s.is_empty()).collect();
    if list.len() > MAX_STOPS {
        return Err(ApiError::bad(
            "stop",
            format!(
                "{} stop strings; at most {MAX_STOPS} are accepted",
                list.len()
            ),
        ));
    }
    if let Some(long) = list.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::bad(
            "stop",
            format!(
                "a stop string of {} bytes; at most {MAX_STOP_BYTES} are accepted",
                long.len()
            ),
        ));
    }
    Ok(list)
}

/// The names of the fields of `other` and of the accepted-but-not-applied parameters that are
/// set, for the server's log line.
fn ignored_fields(
    other: &serde_json::Map<String, Value>,
    not_applied: &[(&str, bool)],
) -> Vec<String> {
    let mut v: Vec<String> = not_applied
        .iter()
        .filter(|(_, set)| *set)
        .map(|(n, _)| format!("{n} (accepted, not applied)"))
        .collect();
    v.extend(other.keys().map(|k| format!("{k} (unknown)")));
    v
}

fn nonzero(v: Option<f32>) -> bool {
    v.is_some_and(|v| v != 0.0)
}

fn present(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Object(m)) => !m.is_empty(),
        Some(_) => true,
    }
}

/// The text of a message's `content` (a string, a list of text parts, or null).
fn content_text(v: Option<&Value>, index: usize) -> Result<String, ApiError> {
    let param = format!("messages[{index}].content");
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => out.push_str(t),
                    (Some(kind), _) => {
                        return Err(ApiError::bad(
                            &param,
                            format!("content parts of type {kind:?} are not supported (text only)"),
                        ))
                    }
                    _ => return Err(ApiError::bad(&param, "a content part without a type")),
                }
            }
            Ok(out)
        }
        Some(_) => Err(ApiError::bad(
            &param,
            "content must be a string or a list of parts",
        )),
    }
}

fn effort(s: &str, param: &str) -> Result<Effort, ApiError> {
    Effort::parse(s).map_err(|e| ApiError::bad(param, e.to_string()))
}

/// Check a chat request.
pub fn parse_chat(body: &[u8], limits: Limits) -> Result<Parsed, ApiError> {
    let r: ChatRequest = serde_json::from_slice(body).map_err(|e| json_error(&e))?;
    let _ = (
        &r.model,
        &r.user,
        r.parallel_tool_calls,
        r.store,
        &r.metadata,
    );
    let mut ignored = ignored_fields(
        &r.other,
        &[
            ("frequency_penalty", nonzero(r.frequency_penalty)),
            ("presence_penalty", nonzero(r.presence_penalty)),
            ("logit_bias", present(r.logit_bias.as_ref())),
            ("logprobs", r.logprobs == Some(true)),
            ("top_logprobs", r.top_logprobs.is_some_and(|n| n > 0)),
        ],
    );
    if r.messages.is_empty() {
        return Err(ApiError::bad("messages", "messages must not be empty"));
    }
    if r.messages.len() > MAX_MESSAGES {
        return Err(ApiError::bad(
            "messages",
            format!(
                "{} messages; at most {MAX_MESSAGES} are accepted",
                r.messages.len()
            ),
        ));
    }
    let (settings, stop) = sampling(
        r.temperature,
        r.top_p,
        r.top_k,
        r.min_p,
        r.repetition_penalty,
        r.max_completion_tokens.or(r.max_tokens),
        limits.default_max_tokens,
        r.seed,
        r.n,
        r.stop.as_ref(),
        r.presence_penalty,
        r.frequency_penalty,
        limits,
    )?;
    let mut render = RenderOptions::default();
    if let Some(t) = &r.thinking {
        let _ = &t.keep;
        match t.kind.as_deref() {
            None | Some("enabled") => render.thinking = true,
            Some("disabled") => render.thinking = false,
            Some(other) => {
                return Err(ApiError::bad(
                    "thinking.type",
                    format!("thinking.type {other:?}: expected \"enabled\" or \"disabled\""),
                ))
            }
        }
        if let Some(e) = &t.effort {
            render.effort = effort(e, "thinking.effort")?;
        }
    }
    if let Some(e) = &r.reasoning_effort {
        render.effort = effort(e, "reasoning_effort")?;
    }
    let tools = match &r.tools {
        None | Some(Value::Null) => None,
        Some(v @ Value::Array(_)) => {
            check_tools(v, "tools")?;
            Some(v.to_string())
        }
        Some(_) => return Err(ApiError::bad("tools", "tools must be a list")),
    };
    let tool_choice = match &r.tool_choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            "none" => ToolChoice::None,
            other => {
                return Err(ApiError::bad(
                    "tool_choice",
                    format!("tool_choice {other:?}: expected auto, required or none"),
                ))
            }
        },
        Some(_) => {
            return Err(ApiError::bad(
                "tool_choice",
                "naming one function is not supported: use auto, required or none",
            ))
        }
    };
    let response_format = match &r.response_format {
        None | Some(Value::Null) => ResponseFormat::Text,
        Some(v) => match v.get("type").and_then(Value::as_str) {
            Some("text") => ResponseFormat::Text,
            Some("json_object") => ResponseFormat::JsonObject,
            Some("json_schema") => {
                let schema = v
                    .get("json_schema")
                    .and_then(|s| s.get("schema"))
                    .ok_or_else(|| {
                        ApiError::bad("response_format", "json_schema needs json_schema.schema")
                    })?;
                ResponseFormat::JsonSchema(schema.to_string())
            }
            _ => {
                return Err(ApiError::bad(
                    "response_format",
                    "response_format.type must be text, json_object or json_schema",
                ))
            }
        },
    };
    let mut messages = Vec::with_capacity(r.messages.len());
    for (i, m) in r.messages.iter().enumerate() {
        let role = ApiRole::parse(&m.role)
            .map_err(|e| ApiError::bad(&format!("messages[{i}].role"), e.to_string()))?;
        // Only an assistant's message (with tool calls) may come without content.
        if role != ApiRole::Assistant && m.content.as_ref().is_none_or(Value::is_null) {
            return Err(ApiError::bad(
                &format!("messages[{i}].content"),
                format!(
                    "a {} message needs content (a string or a list of text parts)",
                    m.role
                ),
            ));
        }
        ignored.extend(
            m.other
                .keys()
                .map(|k| format!("messages[{i}].{k} (unknown)")),
        );
        let mut msg = ApiMessage::new(role, content_text(m.content.as_ref(), i)?);
        msg.name.clone_from(&m.name);
        msg.tool_call_id.clone_from(&m.tool_call_id);
        msg.reasoning = m
            .reasoning_content
            .clone()
            .filter(|r| !r.is_empty())
            .or_else(|| m.reasoning.clone());
        if role != ApiRole::Assistant && msg.reasoning.is_some() {
            return Err(ApiError::bad(
                &format!("messages[{i}]"),
                "only assistant messages may carry reasoning_content",
            ));
        }
        msg.tools = match &m.tools {
            None | Some(Value::Null) => None,
            Some(v @ Value::Array(_)) if role == ApiRole::System => {
                check_tools(v, &format!("messages[{i}].tools"))?;
                Some(v.to_string())
            }
            Some(_) => {
                return Err(ApiError::bad(
                    &format!("messages[{i}].tools"),
                    "tools in a message must be a list, on a system message",
                ))
            }
        };
        for (k, c) in m.tool_calls.iter().flatten().enumerate() {
            let _ = (c.index, &c.kind);
            let arguments = match &c.function.arguments {
                None | Some(Value::Null) => "{}".to_owned(),
                Some(Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
            };
            if c.function.name.trim().is_empty() {
                return Err(ApiError::bad(
                    &format!("messages[{i}].tool_calls[{k}].function.name"),
                    "a tool call needs the name of its function",
                ));
            }
            msg.tool_calls.push(ToolCall {
                id: c.id.clone().unwrap_or_else(|| format!("call_{}", k + 1)),
                name: c.function.name.clone(),
                arguments,
            });
        }
        messages.push(msg);
    }
    let include_usage = r
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    Ok(Parsed {
        thinking: render.thinking,
        task: Task::Chat {
            messages,
            options: ApiOptions {
                render,
                tools,
                tool_choice,
                response_format,
            },
        },
        settings,
        stream: r.stream.unwrap_or(false),
        include_usage,
        stop,
        ignored,
    })
}

/// A list of tools: each `{"type": "function", "function": {"name": …}}` with a non-empty
/// name (the template renders them by name).
fn check_tools(v: &Value, param: &str) -> Result<(), ApiError> {
    for (k, t) in v.as_array().into_iter().flatten().enumerate() {
        let f = t.get("function").unwrap_or(t);
        match f.get("name").and_then(Value::as_str) {
            Some(n) if !n.trim().is_empty() => {}
            _ => {
                return Err(ApiError::bad(
                    &format!("{param}[{k}].function.name"),
                    "a tool needs a name",
                ))
            }
        }
    }
    Ok(())
}

/// Check a raw completion request.
pub fn parse_completion(body: &[u8], limits: Limits) -> Result<Parsed, ApiError> {
    let r: CompletionRequest = serde_json::from_slice(body).map_err(|e| json_error(&e))?;
    let _ = (&r.model, &r.user);
    if r.echo == Some(true) {
        return Err(ApiError::bad("echo", "echo is not supported"));
    }
    if r.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad(
            "suffix",
            "suffix (fill in the middle) is not supported",
        ));
    }
    if r.best_of.is_some_and(|n| n != 1) {
        return Err(ApiError::bad("best_of", "only best_of = 1 is supported"));
    }
    let ignored = ignored_fields(
        &r.other,
        &[
            ("frequency_penalty", nonzero(r.frequency_penalty)),
            ("presence_penalty", nonzero(r.presence_penalty)),
            ("logit_bias", present(r.logit_bias.as_ref())),
            (
                "logprobs",
                r.logprobs
                    .as_ref()
                    .is_some_and(|v| !v.is_null() && v.as_u64() != Some(0) && *v != false),
            ),
        ],
    );
    let prompt = match &r.prompt {
        Value::String(s) => s.clone(),
        Value::Array(a) if a.len() == 1 && a[0].is_string() => {
            a[0].as_str().unwrap_or_default().to_owned()
        }
        _ => return Err(ApiError::bad("prompt", "prompt must be one string")),
    };
    let (settings, stop) = sampling(
        r.temperature,
        r.top_p,
        r.top_k,
        r.min_p,
        r.repetition_penalty,
        r.max_tokens,
        16.min(limits.max_tokens),
        r.seed,
        r.n,
        r.stop.as_ref(),
        r.presence_penalty,
        r.frequency_penalty,
        limits,
    )?;
    Ok(Parsed {
        task: Task::Raw { prompt },
        settings,
        stream: r.stream.unwrap_or(false),
        include_usage: r
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        thinking: false,
        stop,
        ignored,
    })
}

/// `usage`.
#[must_use]
pub fn usage(f: &Finished) -> Value {
    json!({
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.generated.len(),
        "total_tokens": f.prompt_tokens + f.generated.len(),
        "prompt_tokens_details": {"cached_tokens": f.cached_tokens},
    })
}

/// The `tool_calls` list of a message or delta.
#[must_use]
pub fn tool_calls(calls: &[ToolCall], with_index: bool) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut v = json!({"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}});
                if with_index {
                    v["index"] = json!(i);
                }
                v
            })
            .collect(),
    )
}

/// A `chat.completion`.
#[must_use]
pub fn chat_response(id: &str, created: u64, model: &str, f: &Finished) -> Value {
    let mut message = json!({"role": "assistant", "content": f.content});
    if let Some(r) = &f.reasoning {
        message["reasoning_content"] = json!(r);
    }
    if !f.tool_calls.is_empty() {
        message["tool_calls"] = tool_calls(&f.tool_calls, false);
    }
    json!({
        "id": id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": f.finish_reason,
                     "logprobs": Value::Null}],
        "usage": usage(f),
        "local_stats": {
            "reused_tokens": f.cached_tokens,
            "prefilled_tokens": f.prompt_tokens - f.cached_tokens,
            "first_token_seconds": f.first_token_seconds,
            "prefill_seconds": f.prefill_seconds,
            "decode_seconds": f.decode_seconds,
        },
    })
}

/// A `chat.completion.chunk` with one delta.
#[must_use]
pub fn chunk(id: &str, created: u64, model: &str, delta: Value, finish: Option<&str>) -> Value {
    json!({
        "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": Value::Null}],
    })
}

/// A `text_completion` (whole, or one streamed piece).
#[must_use]
pub fn text_completion(
    id: &str,
    created: u64,
    model: &str,
    text: &str,
    finish: Option<&str>,
    usage: Option<Value>,
) -> Value {
    let mut v = json!({
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": Value::Null}],
    });
    if let Some(u) = usage {
        v["usage"] = u;
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_tokens: 100,
        context: 1000,
        sampler: crate::engine::sampling::SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            seed: 1,
        },
        default_max_tokens: 100,
    };

    fn chat(body: &str) -> Result<Parsed, ApiError> {
        parse_chat(body.as_bytes(), LIMITS)
    }

    #[test]
    fn a_request_that_leaves_sampling_out_gets_the_server_defaults() {
        let limits = Limits {
            sampler: crate::engine::sampling::SamplerConfig {
                temperature: 0.3,
                top_p: 0.9,
                top_k: 20,
                ..LIMITS.sampler
            },
            default_max_tokens: 7,
            ..LIMITS
        };
        let body = r#"{"messages":[{"role":"user","content":"hi"}]}"#;
        let p = parse_chat(body.as_bytes(), limits).expect("minimal");
        let s = p.settings.sampler;
        assert_eq!((s.temperature, s.top_p, s.top_k, s.seed), (0.3, 0.9, 20, 1));
        assert_eq!(p.settings.max_tokens, 7);
        let body = r#"{"messages":[{"role":"user","content":"hi"}],"temperature":0.8,
            "top_k":0,"max_tokens":50}"#;
        let p = parse_chat(body.as_bytes(), limits).expect("given");
        let s = p.settings.sampler;
        assert_eq!((s.temperature, s.top_p, s.top_k), (0.8, 0.9, 0));
        assert_eq!(p.settings.max_tokens, 50);
    }

    #[test]
    fn chat_requests_are_checked() {
        let p = chat(r#"{"messages":[{"role":"user","content":"hi"}]}"#).expect("minimal");
        assert_eq!(p.settings.max_tokens, 100);
        assert!(p.thinking && !p.stream);
        let p = chat(
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
                "thinking":{"type":"disabled"},"max_tokens":5,"temperature":0,"stream":true,
                "stream_options":{"include_usage":true}}"#,
        )
        .expect("parts");
        assert!(!p.thinking && p.stream && p.include_usage);
        assert_eq!(p.settings.max_tokens, 5);
        match p.task {
            Task::Chat { messages, .. } => assert_eq!(messages[0].content, "ab"),
            Task::Raw { .. } => panic!("chat expected"),
        }
        let cases: &[(&str, &str)] = &[
            (r#"{"messages":[]}"#, "messages"),
            (r#"{"messages":[{"role":"user","content":"x"}],"n":2}"#, "n"),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"stop":[1]}"#,
                "stop",
            ),
            (
                r#"{"messages":[{"role":"user","content":null}]}"#,
                "messages[0].content",
            ),
            (r#"{"messages":[{"role":"user"}]}"#, "messages[0].content"),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"parameters":{}}}]}"#,
                "tools[0].function.name",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":""}}]}"#,
                "tools[0].function.name",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":null,"tool_calls":[{"id":"a","type":"function","function":{"name":"","arguments":"{}"}}]}]}"#,
                "messages[1].tool_calls[0].function.name",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":101}"#,
                "max_tokens",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"reasoning_effort":"medium"}"#,
                "reasoning_effort",
            ),
            (
                r#"{"messages":[{"role":"wizard","content":"x"}]}"#,
                "messages[0].role",
            ),
            (
                r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
                "messages[0].content",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"frequency_penalty":5}"#,
                "frequency_penalty",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"tool_choice":"sometimes"}"#,
                "tool_choice",
            ),
        ];
        for (body, param) in cases {
            let e = chat(body).expect_err(body);
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(*param), "{body}: {}", e.message);
        }
        let e = chat("{not json").expect_err("not json");
        assert_eq!((e.status, e.param.clone()), (400, None));
        assert_eq!(e.body()["error"]["type"], "invalid_request_error");
    }

    #[test]
    fn what_real_clients_send_is_accepted_and_the_unknown_is_named() {
        let p = chat(
            r#"{"messages":[{"role":"user","content":"x"},
                {"role":"assistant","content":"y","refusal":null,"annotations":[]},
                {"role":"user","content":"z"}],
                "stop":["\n\n","END",""],"n":1,"seed":3,"frequency_penalty":0.5,
                "presence_penalty":0,"logit_bias":{"42":-100},"logprobs":false,"user":"u",
                "store":false,"metadata":{"a":"b"},"parallel_tool_calls":true,
                "stream_options":{"include_usage":true,"continuous_usage_stats":false},
                "bogus":1}"#,
        )
        .expect("accepted");
        assert_eq!(p.stop, ["\n\n", "END"]);
        assert_eq!(p.settings.sampler.seed, 3);
        assert_eq!(
            p.ignored,
            [
                "frequency_penalty (accepted, not applied)",
                "logit_bias (accepted, not applied)",
                "bogus (unknown)",
                "messages[1].annotations (unknown)",
                "messages[1].refusal (unknown)",
            ]
        );
        let p = chat(r#"{"messages":[{"role":"user","content":"x"}],"stop":"."}"#).expect("one");
        assert_eq!(p.stop, ["."]);
        assert!(p.ignored.is_empty());
        // An assistant message with tool calls and no content is fine.
        chat(
            r#"{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":null,
                "tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{}"}}]},
                {"role":"tool","tool_call_id":"a","content":"1"}]}"#,
        )
        .expect("tool call without content");
        let c = parse_completion(
            br#"{"prompt":"a","stop":"b","logprobs":0,"best_of":1}"#,
            LIMITS,
        )
        .expect("completion");
        assert_eq!(c.stop, ["b"]);
        let e = parse_completion(br#"{"prompt":"a","suffix":"z"}"#, LIMITS).expect_err("suffix");
        assert_eq!(e.param.as_deref(), Some("suffix"));
    }
}
