//! The server-sent-events reader of the remote client, as pure functions: bytes in, lines out
//! ([`LineBuffer`], which refuses a line longer than its cap instead of holding it), and one
//! line in, one event out ([`parse_line`]). [`parse_stream`] runs both over a whole body, for
//! tests and fuzzing. Nothing here reads the network or allocates more than the cap per line.

use serde_json::Value;

/// Longest SSE line accepted (a chunk of one token is well under a kilobyte).
pub const MAX_LINE: usize = 1 << 20;

/// Why a stream was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// A line grew past the cap without ending.
    #[error("the server sent a line of more than {cap} bytes in the stream (a chunk of one token is well under a kilobyte)")]
    LineTooLong {
        /// The cap.
        cap: usize,
    },
    /// A `data:` payload is not JSON of a chunk.
    #[error("the server sent a chunk that is not JSON: {0}")]
    NotJson(String),
    /// The server reported an error inside the stream.
    #[error("the server failed during the reply: {0}")]
    Server(String),
}

/// Token counts of a `usage` object.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt: u64,
    /// Generated tokens.
    pub completion: u64,
    /// Prompt tokens the server reused from its cache.
    pub cached: u64,
}

/// What one chunk carries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Chunk {
    /// Text of the thinking channel.
    pub reasoning: Option<String>,
    /// Text of the answer.
    pub content: Option<String>,
    /// Why the reply ended, on its last chunk.
    pub finish: Option<String>,
    /// Token counts (the last chunk, with `stream_options.include_usage`).
    pub usage: Option<Usage>,
}

/// One event of the stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SseEvent {
    /// `data: [DONE]`: the reply is complete.
    Done,
    /// A chunk.
    Chunk(Chunk),
}

/// Splits bytes into lines (LF or CRLF), holding at most `cap` bytes of an unfinished line.
#[derive(Debug)]
pub struct LineBuffer {
    pending: Vec<u8>,
    cap: usize,
}

impl LineBuffer {
    /// A buffer refusing lines longer than `cap` bytes.
    #[must_use]
    pub fn new(cap: usize) -> LineBuffer {
        LineBuffer {
            pending: Vec::new(),
            cap,
        }
    }

    /// Add `bytes`; returns the lines they complete, without their line ends. `Err` once the
    /// unfinished line passes the cap (nothing more of it is kept).
    pub fn push(&mut self, mut bytes: &[u8]) -> Result<Vec<Vec<u8>>, SseError> {
        let mut lines = Vec::new();
        while let Some(at) = bytes.iter().position(|&b| b == b'\n') {
            if self.pending.len() + at > self.cap {
                self.pending = Vec::new();
                return Err(SseError::LineTooLong { cap: self.cap });
            }
            let mut line = std::mem::take(&mut self.pending);
            line.extend_from_slice(&bytes[..at]);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            lines.push(line);
            bytes = &bytes[at + 1..];
        }
        if self.pending.len() + bytes.len() > self.cap {
            self.pending = Vec::new();
            return Err(SseError::LineTooLong { cap: self.cap });
        }
        self.pending.extend_from_slice(bytes);
        Ok(lines)
    }
}

fn text(v: &Value) -> Option<String> {
    v.as_str().filter(|s| !s.is_empty()).map(str::to_owned)
}

/// One SSE line: `None` for anything but a `data:` field (comments, `event:`, `id:`, blank
/// lines, a chunk without choices or usage).
pub fn parse_line(line: &[u8]) -> Result<Option<SseEvent>, SseError> {
    let Some(data) = line.strip_prefix(b"data:") else {
        return Ok(None);
    };
    let data = data.trim_ascii();
    if data == b"[DONE]" {
        return Ok(Some(SseEvent::Done));
    }
    let v: Value = serde_json::from_slice(data).map_err(|e| SseError::NotJson(e.to_string()))?;
    if !v.is_object() {
        return Err(SseError::NotJson(format!(
            "expected an object, found {}",
            match v {
                Value::Array(_) => "an array",
                Value::String(_) => "a string",
                Value::Number(_) => "a number",
                Value::Bool(_) => "a boolean",
                _ => "null",
            }
        )));
    }
    if let Some(e) = v.get("error").filter(|e| !e.is_null()) {
        let msg = e["message"]
            .as_str()
            .or_else(|| e.as_str())
            .unwrap_or("no message");
        return Err(SseError::Server(msg.chars().take(500).collect()));
    }
    let usage = v.get("usage").filter(|u| u.is_object()).map(|u| Usage {
        prompt: u["prompt_tokens"].as_u64().unwrap_or(0),
        completion: u["completion_tokens"].as_u64().unwrap_or(0),
        cached: u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
    });
    let choice = &v["choices"][0];
    let delta = &choice["delta"];
    let chunk = Chunk {
        reasoning: text(&delta["reasoning_content"]).or_else(|| text(&delta["reasoning"])),
        content: text(&delta["content"]),
        finish: text(&choice["finish_reason"]),
        usage,
    };
    Ok((chunk != Chunk::default()).then_some(SseEvent::Chunk(chunk)))
}

/// Every event of a whole body, up to `[DONE]`, with lines capped at [`MAX_LINE`].
pub fn parse_stream(bytes: &[u8]) -> Result<Vec<SseEvent>, SseError> {
    let mut buf = LineBuffer::new(MAX_LINE);
    let mut out = Vec::new();
    for line in buf.push(bytes)? {
        match parse_line(&line)? {
            Some(SseEvent::Done) => {
                out.push(SseEvent::Done);
                break;
            }
            Some(e) => out.push(e),
            None => {}
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_split_across_pushes_and_crlf() {
        let mut b = LineBuffer::new(16);
        assert_eq!(b.push(b"data: a").unwrap(), Vec::<Vec<u8>>::new());
        assert_eq!(
            b.push(b"b\r\n\ndata: c\n").unwrap(),
            vec![b"data: ab".to_vec(), Vec::new(), b"data: c".to_vec()]
        );
    }

    #[test]
    fn a_line_past_the_cap_is_refused_in_one_push_or_many() {
        let mut b = LineBuffer::new(8);
        assert_eq!(b.push(b"12345678\n").unwrap().len(), 1);
        assert_eq!(
            b.push(b"123456789\n"),
            Err(SseError::LineTooLong { cap: 8 })
        );
        let mut b = LineBuffer::new(8);
        b.push(b"12345").unwrap();
        assert_eq!(b.push(b"6789"), Err(SseError::LineTooLong { cap: 8 }));
        // Nothing of the refused line is held.
        assert!(b.pending.capacity() <= 8);
    }

    #[test]
    fn chunks_usage_done_and_errors() {
        let body = b": keep-alive\n\
data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n\
data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"hm\"}}]}\n\n\
data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"},\"finish_reason\":\"stop\"}]}\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\n\
data: [DONE]\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"after\"}}]}\n";
        let ev = parse_stream(body).unwrap();
        assert_eq!(
            ev,
            vec![
                SseEvent::Chunk(Chunk {
                    reasoning: Some("hm".into()),
                    ..Chunk::default()
                }),
                SseEvent::Chunk(Chunk {
                    content: Some("Hi".into()),
                    finish: Some("stop".into()),
                    ..Chunk::default()
                }),
                SseEvent::Chunk(Chunk {
                    usage: Some(Usage {
                        prompt: 7,
                        completion: 3,
                        cached: 4
                    }),
                    ..Chunk::default()
                }),
                SseEvent::Done,
            ]
        );
        assert!(matches!(
            parse_line(b"data: {\"error\":{\"message\":\"boom\"}}"),
            Err(SseError::Server(m)) if m == "boom"
        ));
        assert!(matches!(
            parse_line(b"data: [1]"),
            Err(SseError::NotJson(_))
        ));
        assert!(matches!(parse_line(b"data: {"), Err(SseError::NotJson(_))));
        assert_eq!(parse_line(b"event: x").unwrap(), None);
    }
}
