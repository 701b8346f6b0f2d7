//! The JSON of the API: requests, their checks, and the response and chunk objects. No I/O.
//!
//! What real clients send is accepted as vLLM accepts it (docs/serve.md has the table):
//! `stop` strings, `seed`, `frequency_penalty`, `presence_penalty`, `logit_bias`, `logprobs`
//! and `top_logprobs` are applied; `n` must be 1; `user`, `store`, `metadata`,
//! `stream_options`, `parallel_tool_calls` are taken. Fields this server does not know are
//! ignored; [`Parsed::ignored`] names them for the server's log line. [`parse_chat`] and
//! [`parse_completion`] are pure: bytes in, a checked request or an [`ApiError`] out.

use super::engine::{Finished, Logprob, Task};
use super::MAX_MESSAGES;
use crate::engine::logit_adjust::{LogitAdjust, MAX_BIAS, MAX_PENALTY, MAX_TOP_LOGPROBS};
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
    /// vLLM's: name tokens in log-probabilities as `token_id:ID`.
    return_tokens_as_token_ids: Option<bool>,
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
    return_tokens_as_token_ids: Option<bool>,
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
    /// Penalties and biases.
    pub adjust: LogitAdjust,
    /// Report log-probabilities, with this many of the most likely tokens.
    pub logprobs: Option<usize>,
    /// Name tokens in log-probabilities as `token_id:ID`.
    pub token_ids: bool,
    /// Fields not known, for the log line.
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
    /// The model's vocabulary size: `logit_bias` may name ids below it.
    pub vocab: usize,
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
    logit_bias: Option<&Value>,
    limits: Limits,
) -> Result<(Settings, Vec<String>, LogitAdjust), ApiError> {
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
        if v.is_some_and(|v| !(v.is_finite() && (-MAX_PENALTY..=MAX_PENALTY).contains(&v))) {
            return Err(ApiError::bad(
                name,
                format!("{name} must be a number from -{MAX_PENALTY} to {MAX_PENALTY}"),
            ));
        }
    }
    let adjust = LogitAdjust {
        frequency_penalty: frequency.unwrap_or(0.0),
        presence_penalty: presence.unwrap_or(0.0),
        bias: bias(logit_bias, limits.vocab)?,
    };
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
    Ok((s, stop_strings(stop)?, adjust))
}

/// `logit_bias`: an object from token ids (as strings) to numbers from −100 to 100, the ids
/// below the vocabulary size; null or absent is none.
fn bias(v: Option<&Value>, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let map = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(_) => {
            return Err(ApiError::bad(
                "logit_bias",
                "logit_bias must be an object from token ids to numbers",
            ))
        }
    };
    let mut out = Vec::with_capacity(map.len());
    for (k, v) in map {
        let id = k
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|&id| (id as usize) < vocab);
        let Some(id) = id else {
            return Err(ApiError::bad(
                "logit_bias",
                format!(
                    "logit_bias names {k:?}, which is not a token id of this model (0 to {})",
                    vocab.saturating_sub(1)
                ),
            ));
        };
        let b = v.as_f64().filter(|b| b.abs() <= f64::from(MAX_BIAS));
        let Some(b) = b else {
            return Err(ApiError::bad(
                "logit_bias",
                format!(
                    "logit_bias of token {id} is {v}; it must be a number from -{MAX_BIAS} to \
                     {MAX_BIAS}"
                ),
            ));
        };
        out.push((id, b as f32));
    }
    out.sort_unstable_by_key(|p| p.0);
    out.dedup_by_key(|p| p.0);
    Ok(out)
}

/// `top_logprobs` (chat) or `logprobs` (completions): at most [`MAX_TOP_LOGPROBS`].
fn top_count(n: u64, param: &str) -> Result<usize, ApiError> {
    usize::try_from(n)
        .ok()
        .filter(|&n| n <= MAX_TOP_LOGPROBS)
        .ok_or_else(|| {
            ApiError::bad(
                param,
                format!("{param} is {n}; it must be from 0 to {MAX_TOP_LOGPROBS}"),
            )
        })
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

/// The names of the fields of `other`, for the server's log line.
fn ignored_fields(other: &serde_json::Map<String, Value>) -> Vec<String> {
    other.keys().map(|k| format!("{k} (unknown)")).collect()
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
/// Over 100 lines: one check per request field, in turn, each with its own 400 message.
pub fn parse_chat(body: &[u8], limits: Limits) -> Result<Parsed, ApiError> {
    let r: ChatRequest = serde_json::from_slice(body).map_err(|e| json_error(&e))?;
    let _ = (
        &r.model,
        &r.user,
        r.parallel_tool_calls,
        r.store,
        &r.metadata,
    );
    let mut ignored = ignored_fields(&r.other);
    let logprobs = match (r.logprobs, r.top_logprobs) {
        (Some(true), n) => Some(top_count(n.unwrap_or(0), "top_logprobs")?),
        (_, Some(n)) if n > 0 => {
            return Err(ApiError::bad(
                "top_logprobs",
                "top_logprobs needs logprobs set to true",
            ))
        }
        _ => None,
    };
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
    let (settings, stop, adjust) = sampling(
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
        r.logit_bias.as_ref(),
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
        adjust,
        logprobs,
        token_ids: r.return_tokens_as_token_ids == Some(true),
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
    let ignored = ignored_fields(&r.other);
    let logprobs = match &r.logprobs {
        None | Some(Value::Null | Value::Bool(false)) => None,
        Some(v) => match v.as_u64() {
            Some(n) => Some(top_count(n, "logprobs")?),
            None => {
                return Err(ApiError::bad(
                    "logprobs",
                    format!(
                        "logprobs is {v}; it must be a whole number from 0 to {MAX_TOP_LOGPROBS}"
                    ),
                ))
            }
        },
    };
    let prompt = match &r.prompt {
        Value::String(s) => s.clone(),
        Value::Array(a) if a.len() == 1 && a[0].is_string() => {
            a[0].as_str().unwrap_or_default().to_owned()
        }
        _ => return Err(ApiError::bad("prompt", "prompt must be one string")),
    };
    let (settings, stop, adjust) = sampling(
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
        r.logit_bias.as_ref(),
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
        adjust,
        logprobs,
        token_ids: r.return_tokens_as_token_ids == Some(true),
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
                     "logprobs": f.logprobs.as_deref().map_or(Value::Null, chat_logprobs)}],
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

/// The `logprobs` of a chat choice: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
#[must_use]
pub fn chat_logprobs(entries: &[Logprob]) -> Value {
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let top: Vec<Value> = e
                .top
                .iter()
                .map(|(t, b, lp)| json!({"token": t, "logprob": lp, "bytes": b}))
                .collect();
            json!({"token": e.token, "logprob": e.logprob, "bytes": e.bytes, "top_logprobs": top})
        })
        .collect();
    json!({"content": content, "refusal": Value::Null})
}

/// The `logprobs` of a text completion choice (`tokens`, `token_logprobs`, `top_logprobs` as
/// one object per token, `text_offset` in characters from `offset`).
#[must_use]
pub fn completion_logprobs(entries: &[Logprob], mut offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(entries.len());
    for e in entries {
        text_offset.push(offset);
        offset += e.token.chars().count();
    }
    json!({
        "tokens": entries.iter().map(|e| e.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
        "top_logprobs": entries
            .iter()
            .map(|e| {
                let m: serde_json::Map<String, Value> =
                    e.top.iter().map(|(t, _, lp)| (t.clone(), json!(lp))).collect();
                Value::Object(m)
            })
            .collect::<Vec<_>>(),
        "text_offset": text_offset,
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
        vocab: 1000,
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

    /// Over 100 lines: one case per request field the parser checks.
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
            (
                r#"{"messages":[{"role":"user","content":"x"}],"logit_bias":{"1000":1}}"#,
                "logit_bias",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"logit_bias":{"abc":1}}"#,
                "logit_bias",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"logit_bias":{"5":100.5}}"#,
                "logit_bias",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"logit_bias":[5]}"#,
                "logit_bias",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":21}"#,
                "top_logprobs",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"top_logprobs":3}"#,
                "top_logprobs",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"presence_penalty":-2.5}"#,
                "presence_penalty",
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
            p.adjust,
            LogitAdjust {
                frequency_penalty: 0.5,
                presence_penalty: 0.0,
                bias: vec![(42, -100.0)],
            }
        );
        assert_eq!(p.logprobs, None);
        assert_eq!(
            p.ignored,
            [
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
        for (body, want) in [
            (r#"{"prompt":"a","logprobs":0}"#, Some(0)),
            (r#"{"prompt":"a","logprobs":20}"#, Some(20)),
            (r#"{"prompt":"a","logprobs":null}"#, None),
        ] {
            let c = parse_completion(body.as_bytes(), LIMITS).expect(body);
            assert_eq!(c.logprobs, want, "{body}");
        }
        for body in [
            r#"{"prompt":"a","logprobs":21}"#,
            r#"{"prompt":"a","logprobs":"x"}"#,
        ] {
            let e = parse_completion(body.as_bytes(), LIMITS).expect_err(body);
            assert_eq!(e.param.as_deref(), Some("logprobs"), "{body}");
        }
        let p = chat(
            r#"{"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":20,
            "logit_bias":{"999":100,"0":-100},"return_tokens_as_token_ids":true}"#,
        )
        .expect("logprobs");
        assert_eq!(p.logprobs, Some(20));
        assert!(p.token_ids);
        assert_eq!(p.adjust.bias, [(0, -100.0), (999, 100.0)]);
    }
}
