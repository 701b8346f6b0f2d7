//! One conversation: transcript, render options, the engine state it has built, and the turn
//! logic that reuses that state.
//!
//! Every chat turn re-renders the whole conversation canonically and feeds the engine only what
//! it has not seen: the state is reused up to the longest common prefix of the tokens it covers
//! and the new render. KDA state cannot be rolled back, so a snapshot (state + logits) is kept at
//! the end of each prompt; a regenerate, an undo, an edit, or a re-render that diverges restarts
//! from the newest snapshot that is a prefix of the new render and prefills only the tail.

use super::template::{self, Markers, Message, RenderOptions, Role};
use super::tokenizer::{Tokenizer, Utf8Stream};
use crate::engine::logit_adjust::{self, LogitAdjust, TokenLogprob};
use crate::engine::model::Logits;
use crate::engine::sampling::{Sampler, SamplerConfig};
use crate::engine::spec::{SpecMode, SpecStats, Speculator};
use crate::engine::{Model, SeqState, Snapshot};
use crate::stream::StreamError;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Chat (templated) or raw continuation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// K3 chat template.
    Chat,
    /// Plain text continuation, no template.
    Raw,
}

impl Mode {
    /// Lowercase name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Mode::Chat => "chat",
            Mode::Raw => "raw",
        }
    }
}

/// One transcript entry (the transcript is saved as JSON and readable on its own).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Entry {
    /// A chat message.
    Message {
        /// `system`, `user` or `assistant`.
        role: String,
        /// Text.
        content: String,
        /// Assistant reasoning (think channel), if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reasoning: Option<String>,
    },
    /// A raw-mode exchange: the text given and the continuation produced. It stays in the
    /// context where it was typed: the chat render places its ids between the messages
    /// before and after it (see [`Session::render_conversation`]).
    Raw {
        /// Text appended to the context.
        prompt: String,
        /// Generated continuation, for display: special tokens as markers (`⟨close⟩`), the
        /// end id that stopped it left out.
        output: String,
        /// The generated ids as sampled (the context holds these, not a re-encoding of
        /// `output`). Absent in sessions saved before they were kept: `output` is then
        /// encoded as raw text.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        ids: Vec<u32>,
    },
    /// A switch between chat and raw.
    Mode {
        /// The mode switched to.
        mode: Mode,
    },
}

/// A transcript as Markdown (`/export md`): a title (`name`, else "k3 conversation"), the
/// system message, then each entry: a message under its role in bold, its reasoning quoted
/// above it; a raw exchange in a code block; a mode switch in italics.
#[must_use]
pub fn markdown<'e>(
    name: Option<&str>,
    system: Option<&str>,
    entries: impl IntoIterator<Item = &'e Entry>,
) -> String {
    let mut md = format!("# {}\n", name.unwrap_or("k3 conversation"));
    if let Some(sys) = system {
        md.push_str(&format!("\n**system**\n\n{sys}\n"));
    }
    for e in entries {
        match e {
            Entry::Message {
                role,
                content,
                reasoning,
            } => {
                md.push_str(&format!("\n**{role}**\n\n"));
                if let Some(r) = reasoning.as_ref().filter(|r| !r.trim().is_empty()) {
                    for line in r.lines() {
                        md.push_str(&format!("> {line}\n"));
                    }
                    md.push('\n');
                }
                md.push_str(content);
                md.push('\n');
            }
            Entry::Raw { prompt, output, .. } => {
                md.push_str(&format!("\n**raw**\n\n```\n{prompt}{output}\n```\n"));
            }
            Entry::Mode { mode } => md.push_str(&format!("\n*{} mode*\n", mode.name())),
        }
    }
    md
}

/// Settings that change what a turn produces.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    /// Sampler settings (stored flat: `temperature`, `top_k`, … beside the others).
    #[serde(flatten)]
    pub sampler: SamplerConfig,
    /// Reply length limit.
    pub max_tokens: usize,
    /// Thinking channel on.
    pub thinking: bool,
    /// Thinking effort: low, high or max.
    pub effort: String,
    /// Most positions the session may hold.
    pub context_limit: usize,
    /// Extra stop ids (chat and raw mode stop on these besides the template's end ids).
    #[serde(default)]
    pub stop_ids: Vec<u32>,
    /// Longest raw-mode continuation in tokens.
    #[serde(default = "default_raw_max_tokens")]
    pub raw_max_tokens: usize,
    /// Raw mode runs past the end-of-text ids (`[EOS]`, `<|end_of_msg|>`) to
    /// `raw_max_tokens` or a stop id, as base-model continuation in the reference does.
    #[serde(default)]
    pub raw_ignore_end: bool,
}

/// Default of [`Settings::raw_max_tokens`].
pub const RAW_MAX_TOKENS: usize = 200;

fn default_raw_max_tokens() -> usize {
    RAW_MAX_TOKENS
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            sampler: SamplerConfig::default(),
            max_tokens: 512,
            thinking: true,
            effort: "max".into(),
            context_limit: 32_768,
            stop_ids: Vec::new(),
            raw_max_tokens: RAW_MAX_TOKENS,
            raw_ignore_end: false,
        }
    }
}

impl Settings {
    /// The sampler configuration.
    #[must_use]
    pub fn sampler(&self) -> SamplerConfig {
        self.sampler
    }

    /// Render options.
    pub fn render_options(&self) -> Result<RenderOptions, String> {
        Ok(RenderOptions {
            thinking: self.thinking,
            effort: template::Effort::parse(&self.effort).map_err(|e| e.to_string())?,
        })
    }
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// An end id was sampled.
    End(u32),
    /// The reply reached `max_tokens`.
    MaxTokens,
    /// The caller cancelled.
    Cancelled,
    /// The context limit was reached.
    ContextFull,
}

/// What one turn did.
#[derive(Clone, Debug, PartialEq)]
pub struct TurnReport {
    /// Chat or raw.
    pub mode: Mode,
    /// Every id the first generated token was conditioned on.
    pub prompt_ids: Vec<u32>,
    /// Generated ids (including a final end id).
    pub generated_ids: Vec<u32>,
    /// Tokens generated: the ids' count, or the server's count for a remote reply (whose ids
    /// are not known).
    pub generated_tokens: usize,
    /// Reply text (chat: the response channel; raw: the continuation).
    pub reply: String,
    /// Reasoning text (chat with thinking).
    pub reasoning: Option<String>,
    /// Prompt tokens whose state was reused.
    pub reused_tokens: usize,
    /// Prompt tokens prefilled this turn.
    pub prefilled_tokens: usize,
    /// Why generation stopped.
    pub stop: Stop,
    /// Whether the reply was added to the history (a malformed or cut-off chat reply is not).
    pub accepted: bool,
    /// Why a chat reply was not accepted.
    pub rejected_because: Option<String>,
    /// Prefill time.
    pub prefill_seconds: f64,
    /// Decode time.
    pub decode_seconds: f64,
    /// Set when the context is more than 90% full.
    pub context_warning: Option<String>,
}

/// What [`Session::complete_prompt`] did.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    /// Generated ids (including a final end id).
    pub generated: Vec<u32>,
    /// Prompt tokens whose state was reused.
    pub reused: usize,
    /// Why generation stopped.
    pub stop: Stop,
    /// Prefill time.
    pub prefill_seconds: f64,
    /// Decode time.
    pub decode_seconds: f64,
}

/// One API request decoded step by step beside others ([`Session::begin`]): its own state,
/// sampler and stops, so that several requests advance together in one pass over the weights
/// ([`Session::step`]). Each step samples the same ids [`Session::complete_prompt`] samples
/// for the request alone: the logits are bitwise those of a lone decode (docs/batching.md).
pub struct Generation<'a> {
    tok: &'a Tokenizer,
    /// Ids the state covers.
    tokens: Vec<u32>,
    state: SeqState,
    sampler: Sampler,
    /// The prompt and the ids generated so far.
    history: Vec<u32>,
    generated: Vec<u32>,
    utf8: Utf8Stream,
    stops: Vec<u32>,
    max_tokens: usize,
    limit: usize,
    /// A sampled id the next step feeds.
    next: Option<u32>,
    /// Its last step went through the session's speculator, which may hold an open pass.
    speculating: bool,
    stop: Option<Stop>,
    reused: usize,
    prefill_seconds: f64,
    decode_start: Instant,
}

impl Generation<'_> {
    /// Why it ended, once it has.
    #[must_use]
    pub fn stop(&self) -> Option<Stop> {
        self.stop
    }

    /// Prompt tokens.
    #[must_use]
    pub fn prompt_len(&self) -> usize {
        self.history.len() - self.generated.len()
    }

    /// Sample the next id from `logits` (those after the last id fed) as the lone decoding
    /// loop does: nothing when `cancel` is set, else the id, its text to `emit`, and the end
    /// at a stop id, at `max_tokens` or at the context limit. Returns whether it has ended
    /// (then [`Session::end`] takes it back); otherwise the next [`Session::step`] feeds the
    /// id. `served` adds the request's penalties, biases and log-probabilities.
    ///
    /// # Errors
    /// Sampling failed (non-finite logits), or an id could not be decoded; the generation is
    /// then over ([`Session::fail`]).
    pub fn sample(
        &mut self,
        logits: &[f32],
        cancel: &AtomicBool,
        emit: &mut dyn FnMut(u32, &str),
        served: Option<&mut Served<'_>>,
    ) -> Result<bool, TurnError> {
        if self.stop.is_some() {
            return Ok(true);
        }
        if cancel.load(Ordering::Relaxed) {
            return Ok(self.end_with(Stop::Cancelled, emit));
        }
        let next = match served {
            None => self.sampler.sample(logits, &self.history)?,
            Some(served) => {
                served.sample(&mut self.sampler, logits, &self.history, &self.generated)?
            }
        };
        self.generated.push(next);
        self.history.push(next);
        let text = self.utf8.push(&self.tok.decode_bytes(&[next])?);
        emit(next, &text);
        let stop = if self.stops.contains(&next) {
            Some(Stop::End(next))
        } else if self.generated.len() >= self.max_tokens {
            Some(Stop::MaxTokens)
        } else if self.tokens.len() + 1 >= self.limit {
            Some(Stop::ContextFull)
        } else {
            None
        };
        Ok(match stop {
            Some(s) => self.end_with(s, emit),
            None => {
                self.next = Some(next);
                false
            }
        })
    }

    /// End it now as cancelled (its client went away): nothing more is sampled or fed.
    pub fn cancel(&mut self, emit: &mut dyn FnMut(u32, &str)) {
        if self.stop.is_none() {
            self.end_with(Stop::Cancelled, emit);
        }
    }

    fn end_with(&mut self, stop: Stop, emit: &mut dyn FnMut(u32, &str)) -> bool {
        self.stop = Some(stop);
        self.next = None;
        let tail = self.utf8.finish();
        if !tail.is_empty() {
            emit(u32::MAX, &tail);
        }
        true
    }
}

/// What an API request adds to sampling in [`Session::complete_prompt`]: logit adjustments
/// (penalties and biases) and the log-probabilities of each sampled token, computed from the
/// model's logits before any adjustment and handed to `observe` before the token's text is
/// emitted. With an identity adjustment and no log-probabilities, sampling is exactly the
/// session's own.
pub struct Served<'a> {
    /// Applied to each step's logits before the sampler.
    pub adjust: &'a LogitAdjust,
    /// Report log-probabilities, with this many of the most likely tokens.
    pub logprobs: Option<usize>,
    /// Gets each sampled token's log-probabilities.
    pub observe: &'a mut dyn FnMut(TokenLogprob),
}

impl Served<'_> {
    fn sample(
        &mut self,
        sampler: &mut Sampler,
        logits: &[f32],
        history: &[u32],
        generated: &[u32],
    ) -> Result<u32, crate::engine::sampling::SampleError> {
        let next = if self.adjust.is_identity() {
            sampler.sample(logits, history)?
        } else {
            let mut adjusted = logits.to_vec();
            self.adjust.apply(&mut adjusted, generated);
            sampler.sample(&adjusted, history)?
        };
        if let Some(top) = self.logprobs {
            (self.observe)(logit_adjust::logprobs(logits, next, top));
        }
        Ok(next)
    }
}

/// A failure that leaves the session usable.
#[derive(Debug, thiserror::Error)]
pub enum TurnError {
    /// The request cannot be served in the current session (empty history for /regen, …).
    #[error("{0}")]
    Refused(String),
    /// The prompt would not fit in the context limit.
    #[error("the context is full ({needed} positions needed, limit {limit}); /new starts over")]
    ContextFull {
        /// Positions the prompt needs.
        needed: usize,
        /// The limit.
        limit: usize,
    },
    /// The template could not render.
    #[error(transparent)]
    Template(#[from] template::TemplateError),
    /// Sampling failed (non-finite logits).
    #[error(transparent)]
    Sample(#[from] crate::engine::sampling::SampleError),
    /// Decoding generated ids failed.
    #[error(transparent)]
    Tokenizer(#[from] super::tokenizer::TokenizerError),
    /// Weights could not be read; the turn was abandoned and the state rolled back.
    #[error("{0}; the turn was abandoned and the conversation state kept as before it")]
    Stream(#[from] StreamError),
}

/// A conversation bound to a model and tokenizer.
pub struct Session<'a> {
    model: &'a Model,
    tok: &'a Tokenizer,
    markers: Markers,
    /// System message, rendered first.
    pub system: Option<String>,
    /// Transcript in order.
    pub entries: Vec<Entry>,
    /// Current mode.
    pub mode: Mode,
    /// Settings.
    pub settings: Settings,
    sampler: Sampler,
    /// Ids the engine state covers.
    tokens: Vec<u32>,
    /// A sampled id not yet fed to the engine (the last id of a reply).
    pending: Option<u32>,
    state: SeqState,
    snapshots: Vec<Snapshot>,
    max_snapshots: usize,
    on_prefill: Option<Box<dyn FnMut(usize, usize) + 'a>>,
    spec: Speculator,
    /// Positions the engine state covers, published as prompt tokens are fed and reply tokens
    /// generated (read by another thread while a turn runs).
    positions: Arc<AtomicUsize>,
    /// "Answer now": set by another thread while a reply is in its thinking channel, it makes
    /// the next tokens the channel's close and the answer's opening (then cleared).
    answer_now: Arc<AtomicBool>,
}

/// Snapshots of the sequence state a session keeps (each one a full state: the engine's plan
/// reserves memory for them, see `stream::budget::plan_states`).
pub const SNAPSHOTS: usize = 4;

/// Largest context (`--context`, `k3 serve`'s and the config file's) accepted: the released
/// model's `max_position_embeddings`.
pub const MAX_CONTEXT: usize = 1 << 20;

/// Prompt tokens fed to the engine per forward call while prefilling (results do not depend
/// on it; it only sets how often progress is reported).
pub const PREFILL_CHUNK: usize = 64;

/// Length of the longest common prefix.
fn lcp(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// How a raw continuation shows a special token: its name in angle brackets, without the
/// `<|…|>` or `[…]` around it (`<|close|>` → `⟨close⟩`, `[EOS]` → `⟨EOS⟩`), so it never reads
/// as text that would encode to it.
#[must_use]
pub fn special_marker(tok: &Tokenizer, id: u32) -> String {
    let name = tok.special_token(id).map_or("special", |t| t.name.as_str());
    let bare = name
        .strip_prefix("<|")
        .and_then(|n| n.strip_suffix("|>"))
        .or_else(|| name.strip_prefix('[').and_then(|n| n.strip_suffix(']')))
        .unwrap_or(name);
    format!("\u{27e8}{bare}\u{27e9}")
}

/// How many tokens a generating call may add, and how it shows them.
#[derive(Clone, Copy, Debug)]
struct Limits<'t> {
    /// Most tokens generated.
    max_tokens: usize,
    /// Show special tokens as [`special_marker`]s (the stopping one as nothing): raw mode.
    mark_specials: bool,
    /// The completion starts in the thinking channel and these ids close it: the "answer
    /// now" flag makes them the next tokens.
    think_close: Option<&'t [u32]>,
}

impl<'a> Session<'a> {
    /// A new, empty session.
    pub fn new(
        model: &'a Model,
        tok: &'a Tokenizer,
        settings: Settings,
    ) -> Result<Self, TurnError> {
        let markers = Markers::resolve(tok)?;
        settings.render_options().map_err(TurnError::Refused)?;
        let sampler =
            Sampler::new(settings.sampler()).map_err(|e| TurnError::Refused(e.to_string()))?;
        Ok(Session {
            model,
            tok,
            markers,
            system: None,
            entries: Vec::new(),
            mode: Mode::Chat,
            settings,
            sampler,
            tokens: Vec::new(),
            pending: None,
            state: SeqState::new(&model.cfg),
            snapshots: Vec::new(),
            max_snapshots: SNAPSHOTS,
            on_prefill: None,
            spec: Speculator::new(SpecMode::Auto.or_env_off()),
            positions: Arc::new(AtomicUsize::new(0)),
            answer_now: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Choose how replies are decoded: speculation never changes a token, only the time
    /// (see `engine::spec`).
    pub fn set_speculation(&mut self, mode: SpecMode) {
        if mode != self.spec.mode() {
            self.spec = Speculator::new(mode);
        }
    }

    /// How replies are decoded.
    #[must_use]
    pub fn spec_mode(&self) -> SpecMode {
        self.spec.mode()
    }

    /// What speculative decoding did in this session so far.
    #[must_use]
    pub fn spec_stats(&self) -> SpecStats {
        self.spec.stats()
    }

    /// A counter of the positions the engine state covers, kept up to date while a turn runs:
    /// after each prompt chunk and each generated token is fed (a token just sampled is not
    /// counted until it is fed).
    #[must_use]
    pub fn positions_counter(&self) -> Arc<AtomicUsize> {
        Arc::clone(&self.positions)
    }

    /// The "answer now" flag: set while a chat reply is in its thinking channel, the next
    /// tokens close that channel (`<|close|>think<|sep|><|open|>response<|sep|>`, not
    /// sampled) and the model goes on in the answer. It is cleared when a reply starts and
    /// once used; it does nothing to a reply that is already answering, or in raw mode.
    #[must_use]
    pub fn answer_now_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.answer_now)
    }

    /// Use `flag` as the "answer now" flag (one the front end holds; see
    /// [`Session::answer_now_flag`]).
    pub fn set_answer_now_flag(&mut self, flag: Arc<AtomicBool>) {
        self.answer_now = flag;
    }

    /// Call `f(done, total)` as prompt tokens are prefilled.
    pub fn on_prefill(&mut self, f: Box<dyn FnMut(usize, usize) + 'a>) {
        self.on_prefill = Some(f);
    }

    /// Feed `ids` in chunks, reporting progress; returns the logits after the last id.
    fn feed(
        &mut self,
        ids: &[u32],
        done_before: usize,
        total: usize,
    ) -> Result<Vec<f32>, StreamError> {
        let mut logits = Vec::new();
        let mut done = done_before;
        let n_chunks = ids.len().div_ceil(PREFILL_CHUNK);
        for (i, chunk) in ids.chunks(PREFILL_CHUNK).enumerate() {
            logits = self
                .model
                .forward(&mut self.state, chunk, Logits::for_chunk(i, n_chunks))?;
            self.tokens.extend_from_slice(chunk);
            self.positions.store(self.tokens.len(), Ordering::Relaxed);
            done += chunk.len();
            if let Some(f) = self.on_prefill.as_mut() {
                f(done, total);
            }
        }
        Ok(logits)
    }

    /// The tokenizer.
    #[must_use]
    pub fn tokenizer(&self) -> &'a Tokenizer {
        self.tok
    }

    /// The model (the reference outlives the session's borrow).
    #[must_use]
    pub fn model(&self) -> &'a Model {
        self.model
    }

    /// Ids the engine state covers.
    #[must_use]
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The carried engine state.
    #[must_use]
    pub fn state(&self) -> &SeqState {
        &self.state
    }

    /// The sampled-but-not-forwarded id, if any.
    #[must_use]
    pub fn pending(&self) -> Option<u32> {
        self.pending
    }

    /// The sampler's generator state.
    #[must_use]
    pub fn rng_state(&self) -> u64 {
        self.sampler.rng_state()
    }

    /// The snapshots held, oldest first.
    #[must_use]
    pub fn snapshots(&self) -> &[Snapshot] {
        &self.snapshots
    }

    /// Restore engine-side state (tokens covered, state, pending id, sampler stream) and the
    /// snapshots that were held with it (oldest first; the newest [`SNAPSHOTS`] within the
    /// context limit are kept).
    pub fn restore(
        &mut self,
        tokens: Vec<u32>,
        state: SeqState,
        pending: Option<u32>,
        rng_state: u64,
        snapshots: Vec<Snapshot>,
    ) -> Result<(), TurnError> {
        self.sampler = Sampler::with_rng_state(self.settings.sampler(), rng_state)
            .map_err(|e| TurnError::Refused(e.to_string()))?;
        self.tokens = tokens;
        self.state = state;
        self.pending = pending;
        self.snapshots.clear();
        let limit = self.settings.context_limit;
        for s in snapshots {
            let fits = !s.tokens.is_empty() && s.tokens.len() <= limit;
            if fits && !self.snapshots.iter().any(|k| k.tokens == s.tokens) {
                self.snapshots.push(s);
            }
        }
        let extra = self.snapshots.len().saturating_sub(self.max_snapshots);
        self.snapshots.drain(..extra);
        Ok(())
    }

    /// Move the engine-side state out (the ids it covers, the state, the snapshots) so that it
    /// can be written without a copy; [`Session::put_back`] must return it before the next
    /// turn. Until then the session holds no state.
    pub fn lend_state(&mut self) -> (Vec<u32>, SeqState, Vec<Snapshot>) {
        let placeholder = SeqState {
            n_pos: 0,
            layers: Vec::new(),
        };
        (
            std::mem::take(&mut self.tokens),
            std::mem::replace(&mut self.state, placeholder),
            std::mem::take(&mut self.snapshots),
        )
    }

    /// Return what [`Session::lend_state`] moved out.
    pub fn put_back(&mut self, tokens: Vec<u32>, state: SeqState, snapshots: Vec<Snapshot>) {
        self.tokens = tokens;
        self.state = state;
        self.snapshots = snapshots;
    }

    /// Let go of the engine state and the snapshots (the transcript stays), so that loading
    /// another session's state does not hold two: until [`Session::restore`] or
    /// [`Session::ensure_state`] the session holds no state at all.
    pub fn release_state(&mut self) {
        self.snapshots.clear();
        self.tokens.clear();
        self.pending = None;
        self.state = SeqState {
            n_pos: 0,
            layers: Vec::new(),
        };
    }

    /// Hold an empty state again if [`Session::release_state`] left none (the next turn
    /// prefills the transcript).
    pub fn ensure_state(&mut self) {
        if self.state.layers.len() != self.model.cfg.is_mla.len() {
            self.tokens.clear();
            self.pending = None;
            self.state = SeqState::new(&self.model.cfg);
        }
    }

    /// Chat messages in render order (system first).
    #[must_use]
    pub fn messages(&self) -> Vec<Message> {
        let mut out = Vec::new();
        if let Some(s) = &self.system {
            out.push(Message {
                role: Role::System,
                content: s.clone(),
                reasoning: None,
            });
        }
        for e in &self.entries {
            if let Entry::Message {
                role,
                content,
                reasoning,
            } = e
            {
                let role = match role.as_str() {
                    "system" => Role::System,
                    "assistant" => Role::Assistant,
                    _ => Role::User,
                };
                out.push(Message {
                    role,
                    content: content.clone(),
                    reasoning: reasoning.clone(),
                });
            }
        }
        out
    }

    /// A raw continuation for display: ordinary ids decoded, special tokens as
    /// [`special_marker`]s, a final stop id left out.
    fn raw_display(&self, ids: &[u32], stops: &[u32]) -> Result<String, TurnError> {
        let mut out = String::new();
        let mut run = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            if self.tok.is_special(id) {
                out.push_str(&self.tok.decode_lossy(&run)?);
                run.clear();
                if !(i + 1 == ids.len() && stops.contains(&id)) {
                    out.push_str(&special_marker(self.tok, id));
                }
            } else {
                run.push(id);
            }
        }
        out.push_str(&self.tok.decode_lossy(&run)?);
        Ok(out)
    }

    /// The conversation's ids as the context holds them: the chat template's render of its
    /// messages, with each raw exchange's ids (its text encoded as raw mode encodes it, then
    /// the ids generated) where it was typed — after the rendered messages that came before
    /// it and before the ones after it. Raw text before the first message comes first, so a
    /// conversation that starts in raw mode is a plain continuation; the thinking-effort and
    /// system messages open the first message's render, as the template puts them. Without a
    /// generation prompt, template text after the last raw exchange is included only when a
    /// message follows it. Returns the ids and their length before the generation prompt.
    pub fn render_conversation(
        &self,
        opts: &RenderOptions,
        add_generation_prompt: bool,
    ) -> Result<(Vec<u32>, usize), TurnError> {
        let messages = self.messages();
        let sys = usize::from(self.system.is_some());
        let full = template::render(self.tok, &messages, opts, add_generation_prompt)?;
        let history = if add_generation_prompt {
            template::render(self.tok, &messages, opts, false)?.len()
        } else {
            full.len()
        };
        let mut out = Vec::with_capacity(full.len());
        let (mut taken, mut before, mut inserted) = (0, 0, 0);
        let mut message_after_raw = true;
        for e in &self.entries {
            match e {
                Entry::Message { .. } => {
                    before += 1;
                    message_after_raw = true;
                }
                Entry::Raw {
                    prompt,
                    output,
                    ids,
                } => {
                    if before > 0 {
                        let upto =
                            template::render(self.tok, &messages[..sys + before], opts, false)?
                                .len();
                        out.extend_from_slice(&full[taken..upto]);
                        taken = upto;
                    }
                    let start = out.len();
                    out.extend(template::render_raw(self.tok, prompt));
                    if ids.is_empty() {
                        out.extend(template::render_raw(self.tok, output));
                    } else {
                        out.extend_from_slice(ids);
                    }
                    inserted += out.len() - start;
                    message_after_raw = false;
                }
                Entry::Mode { .. } => {}
            }
        }
        if add_generation_prompt || message_after_raw {
            out.extend_from_slice(&full[taken..]);
        }
        Ok((out, history + inserted))
    }

    /// Number of completed chat exchanges.
    #[must_use]
    pub fn turns(&self) -> usize {
        self.entries
            .iter()
            .filter(|e| matches!(e, Entry::Message { role, .. } if role == "assistant"))
            .count()
            + self
                .entries
                .iter()
                .filter(|e| matches!(e, Entry::Raw { .. }))
                .count()
    }

    /// Change settings; the sampler keeps its random stream unless the seed changed.
    pub fn set_settings(&mut self, s: Settings) -> Result<(), TurnError> {
        s.render_options().map_err(TurnError::Refused)?;
        let rng = if s.sampler.seed == self.settings.sampler.seed {
            Some(self.sampler.rng_state())
        } else {
            None
        };
        let sampler = match rng {
            Some(r) => Sampler::with_rng_state(s.sampler(), r),
            None => Sampler::new(s.sampler()),
        }
        .map_err(|e| TurnError::Refused(e.to_string()))?;
        self.sampler = sampler;
        self.settings = s;
        Ok(())
    }

    /// Switch mode (recorded in the transcript; the engine state is kept).
    pub fn set_mode(&mut self, mode: Mode) {
        if mode != self.mode {
            self.mode = mode;
            self.entries.push(Entry::Mode { mode });
        }
    }

    /// Forget everything: history, state, snapshots (settings are kept; the random stream
    /// restarts from the seed).
    pub fn reset(&mut self) -> Result<(), TurnError> {
        self.entries.clear();
        self.tokens.clear();
        self.pending = None;
        self.state = SeqState::new(&self.model.cfg);
        self.snapshots.clear();
        self.sampler =
            Sampler::new(self.settings.sampler()).map_err(|e| TurnError::Refused(e.to_string()))?;
        Ok(())
    }

    /// Forget the live state after a failed forward (it may be partly advanced); the next turn
    /// starts again from a snapshot.
    fn drop_live_state(&mut self) {
        self.tokens.clear();
        self.pending = None;
        self.state = SeqState::new(&self.model.cfg);
    }

    /// Keep a snapshot of the current state (with the logits that follow it), bounded.
    fn snapshot(&mut self, logits: &[f32]) {
        if self.max_snapshots == 0 || self.snapshots.iter().any(|s| s.tokens == self.tokens) {
            return;
        }
        // The oldest goes before the copy is made (never one state more than planned).
        while self.snapshots.len() >= self.max_snapshots {
            self.snapshots.remove(0);
        }
        self.snapshots.push(Snapshot {
            tokens: self.tokens.clone(),
            state: self.state.clone(),
            logits: logits.to_vec(),
        });
    }

    /// Bring the engine to the end of `prompt` and return the logits that follow it, reusing
    /// state; returns (logits, reused tokens). When `history_end` is given (the prompt length
    /// before the generation prompt), the state there is snapshotted too, so that a later
    /// render that diverges only after the history (a rejected reply, an undo) can start from it.
    fn prefill(
        &mut self,
        prompt: &[u32],
        history_end: Option<usize>,
    ) -> Result<(Vec<f32>, usize), StreamError> {
        // Candidates: the live state (if its tokens are a prefix of the prompt and leave at
        // least one token to feed) and every snapshot that is a prefix of the prompt.
        // The live state is absent while its sequence decodes apart ([`Session::begin`]); a
        // kept state without logits (a finished sequence's) needs one token fed at least.
        let live = lcp(&self.tokens, prompt);
        let live_ok = live == self.tokens.len()
            && live < prompt.len()
            && self.state.layers.len() == self.model.cfg.is_mla.len();
        let best_snap = self
            .snapshots
            .iter()
            .enumerate()
            .filter(|(_, s)| {
                prompt.starts_with(&s.tokens)
                    && (s.tokens.len() < prompt.len()
                        || (s.tokens.len() == prompt.len() && !s.logits.is_empty()))
            })
            .max_by_key(|(i, s)| (s.tokens.len(), *i))
            .map(|(i, s)| (i, s.tokens.len()));
        let use_snap = match best_snap {
            Some((_, n)) if !live_ok || n > live => best_snap,
            _ => None,
        };
        let (start, logits) = if let Some((i, n)) = use_snap {
            let snap = &self.snapshots[i];
            self.state = snap.state.clone();
            self.tokens = snap.tokens.clone();
            (n, (n == prompt.len()).then(|| snap.logits.clone()))
        } else if live_ok {
            (live, None)
        } else {
            self.state = SeqState::new(&self.model.cfg);
            self.tokens.clear();
            (0, None)
        };
        self.pending = None;
        let logits = match logits {
            Some(l) => l,
            None => {
                let mut from = start;
                if let Some(h) = history_end.filter(|&h| h > start && h < prompt.len()) {
                    let l = self.feed(&prompt[start..h], 0, prompt.len() - start)?;
                    self.snapshot(&l);
                    from = h;
                }
                self.feed(&prompt[from..], from - start, prompt.len() - start)?
            }
        };
        self.snapshot(&logits);
        self.positions.store(self.tokens.len(), Ordering::Relaxed);
        Ok((logits, start))
    }

    /// Prefill `prompt`, then sample until a stop id, the length limit, the context limit or
    /// cancellation. `emit` receives each id and its printable text as it is generated.
    /// Over 100 lines: the decode loop's state (history, thinking channel, forced ids, UTF-8
    /// stream, stops) is shared by every step.
    fn generate(
        &mut self,
        prompt: &[u32],
        history_end: Option<usize>,
        stops: &[u32],
        limits: Limits<'_>,
        cancel: &AtomicBool,
        emit: &mut dyn FnMut(u32, &str),
        mut served: Option<&mut Served<'_>>,
    ) -> Result<(Vec<u32>, usize, Stop, f64, f64), TurnError> {
        let limit = self.settings.context_limit;
        if prompt.len() >= limit {
            return Err(TurnError::ContextFull {
                needed: prompt.len() + 1,
                limit,
            });
        }
        let t0 = Instant::now();
        let (mut logits, reused) = match self.prefill(prompt, history_end) {
            Ok(r) => r,
            Err(e) => {
                self.drop_live_state();
                return Err(e.into());
            }
        };
        let prefill_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut history = prompt.to_vec();
        let mut generated = Vec::new();
        let mut utf8 = Utf8Stream::default();
        self.answer_now.store(false, Ordering::Relaxed);
        let mut thinking = limits.think_close.is_some();
        let mut forced = std::collections::VecDeque::new();
        let stop = loop {
            if cancel.load(Ordering::Relaxed) {
                break Stop::Cancelled;
            }
            if let Some(close) = limits.think_close {
                if thinking && generated.ends_with(close) {
                    thinking = false; // the model closed the channel itself
                }
                if thinking && self.answer_now.swap(false, Ordering::Relaxed) {
                    // Close the channel from where the completion stands: the part of the
                    // sequence it has already begun is not repeated.
                    let begun = (1..close.len())
                        .rev()
                        .find(|&k| generated.ends_with(&close[..k]))
                        .unwrap_or(0);
                    forced.extend(&close[begun..]);
                    thinking = false;
                }
            }
            let next = match forced.pop_front() {
                Some(id) => id,
                None => match match served.as_deref_mut() {
                    None => self.sampler.sample(&logits, &history),
                    Some(served) => served.sample(&mut self.sampler, &logits, &history, &generated),
                } {
                    Ok(n) => n,
                    Err(e) => {
                        self.spec.settle(self.model, &mut self.state);
                        return Err(e.into());
                    }
                },
            };
            generated.push(next);
            history.push(next);
            let text = if limits.mark_specials && self.tok.is_special(next) {
                let mut t = utf8.finish();
                if !stops.contains(&next) {
                    t.push_str(&special_marker(self.tok, next));
                }
                t
            } else {
                utf8.push(&self.tok.decode_bytes(&[next])?)
            };
            emit(next, &text);
            if stops.contains(&next) {
                self.pending = Some(next);
                break Stop::End(next);
            }
            if generated.len() >= limits.max_tokens {
                self.pending = Some(next);
                break Stop::MaxTokens;
            }
            if self.tokens.len() + 1 >= limit {
                self.pending = Some(next);
                break Stop::ContextFull;
            }
            // Positions a draft may add after `next` without passing the limit.
            let room = limit.saturating_sub(self.tokens.len() + 2);
            let step = self
                .spec
                .advance(self.model, &mut self.state, &history, next, room);
            match step {
                Ok(l) => {
                    logits.clear();
                    logits.extend_from_slice(l);
                }
                Err(e) => {
                    self.spec.abandon();
                    self.drop_live_state();
                    return Err(e.into());
                }
            }
            self.tokens.push(next);
            self.positions.store(self.tokens.len(), Ordering::Relaxed);
        };
        self.spec.settle(self.model, &mut self.state);
        let tail = utf8.finish();
        if !tail.is_empty() {
            emit(u32::MAX, &tail);
        }
        Ok((
            generated,
            reused,
            stop,
            prefill_s,
            t1.elapsed().as_secs_f64(),
        ))
    }

    /// Answer one prompt from outside the transcript (a request to the API server): `settings`
    /// apply to this call only and the sampler restarts from their seed, so the reply is the
    /// one a fresh session would give; the engine state is reused up to the longest common
    /// prefix of what it has seen (live state or a snapshot) and `prompt`, and `history_end`
    /// (the prompt's length before its generation prompt) is snapshotted for the next request.
    /// The transcript is not touched. `served` adds a request's penalties, biases and
    /// log-probabilities (None: plain sampling).
    #[allow(clippy::too_many_arguments)]
    pub fn complete_prompt(
        &mut self,
        prompt: &[u32],
        history_end: Option<usize>,
        stops: &[u32],
        settings: &Settings,
        cancel: &AtomicBool,
        emit: &mut dyn FnMut(u32, &str),
        served: Option<&mut Served<'_>>,
    ) -> Result<Completion, TurnError> {
        self.sampler =
            Sampler::new(settings.sampler()).map_err(|e| TurnError::Refused(e.to_string()))?;
        self.settings = settings.clone();
        let limits = Limits {
            max_tokens: settings.max_tokens,
            mark_specials: false,
            think_close: None,
        };
        let (generated, reused, stop, prefill_seconds, decode_seconds) =
            self.generate(prompt, history_end, stops, limits, cancel, emit, served)?;
        Ok(Completion {
            generated,
            reused,
            stop,
            prefill_seconds,
            decode_seconds,
        })
    }

    /// Keep up to `n` states for prefix reuse: the snapshots and the states finished
    /// [`Generation`]s leave (the plan must count them).
    pub fn set_max_snapshots(&mut self, n: usize) {
        self.max_snapshots = n;
        let extra = self.snapshots.len().saturating_sub(n);
        self.snapshots.drain(..extra);
    }

    /// Start one API request that will decode beside others: as [`Session::complete_prompt`]
    /// it reuses the longest state (kept or live) whose ids are a prefix of `prompt`, prefills
    /// the rest and snapshots `history_end` and the prompt's end, and the sampler starts from
    /// `settings`' seed; then the state moves into the returned [`Generation`] (the session
    /// holds no live state until it is back), with the logits that follow the prompt, from
    /// which [`Generation::sample`] draws the first id. The transcript is not touched.
    ///
    /// # Errors
    /// The prompt does not fit the context, the settings are invalid, or a weight read failed.
    pub fn begin(
        &mut self,
        prompt: &[u32],
        history_end: Option<usize>,
        stops: &[u32],
        settings: &Settings,
    ) -> Result<(Generation<'a>, Vec<f32>), TurnError> {
        let sampler =
            Sampler::new(settings.sampler()).map_err(|e| TurnError::Refused(e.to_string()))?;
        let limit = settings.context_limit;
        if prompt.len() >= limit {
            return Err(TurnError::ContextFull {
                needed: prompt.len() + 1,
                limit,
            });
        }
        let t0 = Instant::now();
        let prefilled = self.prefill(prompt, history_end);
        let tokens = std::mem::take(&mut self.tokens);
        let mut state = std::mem::replace(
            &mut self.state,
            SeqState {
                n_pos: 0,
                layers: Vec::new(),
            },
        );
        self.pending = None;
        let (logits, reused) = prefilled?;
        // Room for the whole reply, so that decoding never grows a cache.
        state.reserve(
            (prompt.len() + settings.max_tokens).min(limit),
            &self.model.cfg,
        );
        let generation = Generation {
            tok: self.tok,
            tokens,
            state,
            sampler,
            history: prompt.to_vec(),
            generated: Vec::new(),
            utf8: Utf8Stream::default(),
            stops: stops.to_vec(),
            max_tokens: settings.max_tokens,
            limit,
            next: None,
            speculating: false,
            stop: None,
            reused,
            prefill_seconds: t0.elapsed().as_secs_f64(),
            decode_start: Instant::now(),
        };
        Ok((generation, logits))
    }

    /// Feed each generation the id it sampled last, in one pass over the weights, and put the
    /// logits that follow into `logits` (`[gens.len(), vocab]`, row `t` for `gens[t]`). A lone
    /// generation goes through the session's speculator (docs/runtime.md#speculative-decoding);
    /// several go through [`Model::forward_batch`] without speculation (an open speculative
    /// pass is settled first). Either way the logits are bitwise those of decoding each
    /// alone, so the ids are the same.
    ///
    /// # Errors
    /// A weight read failed; the generations' states may be partly advanced, so each of them
    /// is over ([`Session::fail`]).
    pub fn step(
        &mut self,
        gens: &mut [&mut Generation<'a>],
        run: &mut crate::engine::RunState,
        logits: &mut Vec<f32>,
    ) -> Result<(), TurnError> {
        logits.clear();
        let mut ids = Vec::with_capacity(gens.len());
        for g in gens.iter() {
            match g.next {
                Some(id) if g.stop.is_none() => ids.push(id),
                _ => {
                    return Err(TurnError::Refused(
                        "a generation was stepped without a sampled id".into(),
                    ))
                }
            }
        }
        if let [g] = gens {
            if !g.speculating {
                // Any open pass is another sequence's, and that one has ended.
                self.spec.abandon();
            }
            let room = g.limit.saturating_sub(g.tokens.len() + 2);
            g.speculating = true;
            match self
                .spec
                .advance(self.model, &mut g.state, &g.history, ids[0], room)
            {
                Ok(l) => logits.extend_from_slice(l),
                Err(e) => {
                    self.spec.abandon();
                    g.speculating = false;
                    return Err(e.into());
                }
            }
        } else {
            for g in gens.iter_mut().filter(|g| g.speculating) {
                self.spec.settle(self.model, &mut g.state);
                g.speculating = false;
            }
            let mut seqs: Vec<&mut SeqState> = gens.iter_mut().map(|g| &mut g.state).collect();
            let out = self.model.forward_batch(&mut seqs, run, &ids)?;
            logits.extend_from_slice(out);
        }
        for (g, id) in gens.iter_mut().zip(ids) {
            g.tokens.push(id);
            g.next = None;
        }
        Ok(())
    }

    /// Take back an ended [`Generation`]: its state is kept for prefix reuse (as a state whose
    /// logits are not known, so a later prompt must go past it), and what it did is returned.
    pub fn end(&mut self, mut g: Generation<'a>) -> Completion {
        if g.speculating {
            self.spec.settle(self.model, &mut g.state);
        }
        let done = Completion {
            generated: std::mem::take(&mut g.generated),
            reused: g.reused,
            stop: g.stop.unwrap_or(Stop::Cancelled),
            prefill_seconds: g.prefill_seconds,
            decode_seconds: g.decode_start.elapsed().as_secs_f64(),
        };
        let known = self.snapshots.iter().any(|s| s.tokens == g.tokens);
        if self.max_snapshots > 0 && !g.tokens.is_empty() && !known {
            while self.snapshots.len() >= self.max_snapshots {
                self.snapshots.remove(0);
            }
            self.snapshots.push(Snapshot {
                tokens: g.tokens,
                state: g.state,
                logits: Vec::new(),
            });
        }
        done
    }

    /// Let go of a [`Generation`] whose state cannot be trusted (a failed step or sample).
    pub fn fail(&mut self, g: Generation<'a>) {
        if g.speculating {
            self.spec.abandon();
        }
    }

    /// The end-of-turn ids of this tokenizer's chat template.
    #[must_use]
    pub fn markers(&self) -> Markers {
        self.markers
    }

    fn context_warning(&self) -> Option<String> {
        let used = self.tokens.len() + usize::from(self.pending.is_some());
        let limit = self.settings.context_limit;
        (used * 10 >= limit * 9).then(|| {
            format!("context {used}/{limit} positions used; /new starts a fresh conversation")
        })
    }

    /// Run one chat turn on the current history (the last message must be the user's).
    fn chat_turn(
        &mut self,
        cancel: &AtomicBool,
        emit: &mut dyn FnMut(u32, &str),
    ) -> Result<TurnReport, TurnError> {
        let opts = self.settings.render_options().map_err(TurnError::Refused)?;
        let (prompt, history_end) = self.render_conversation(&opts, true)?;
        let mut stops = self.markers.stop_ids().to_vec();
        stops.extend(self.settings.stop_ids.iter().copied());
        let close = template::think_close_ids(self.tok, &self.markers).ok();
        let limits = Limits {
            max_tokens: self.settings.max_tokens,
            mark_specials: false,
            think_close: close.as_deref().filter(|_| opts.thinking),
        };
        let (generated, reused, stop, prefill_s, decode_s) = self.generate(
            &prompt,
            Some(history_end),
            &stops,
            limits,
            cancel,
            emit,
            None,
        )?;
        let parsed = template::parse_strict(self.tok, &self.markers, &generated, opts.thinking);
        let (reply, reasoning, accepted, why) = match parsed {
            Ok(p) => (p.content, p.reasoning, true, None),
            Err(e) => {
                let text = self.tok.decode_lossy(&generated)?;
                (text, None, false, Some(e.to_string()))
            }
        };
        if accepted {
            self.entries.push(Entry::Message {
                role: "assistant".into(),
                content: reply.clone(),
                reasoning: reasoning.clone(),
            });
        }
        Ok(TurnReport {
            mode: Mode::Chat,
            prefilled_tokens: prompt.len() - reused,
            prompt_ids: prompt,
            generated_tokens: generated.len(),
            generated_ids: generated,
            reply,
            reasoning,
            reused_tokens: reused,
            stop,
            accepted,
            rejected_because: why,
            prefill_seconds: prefill_s,
            decode_seconds: decode_s,
            context_warning: self.context_warning(),
        })
    }

    /// Send `text`: a user message in chat mode, or text to continue in raw mode.
    pub fn send(
        &mut self,
        text: &str,
        cancel: &AtomicBool,
        emit: &mut dyn FnMut(u32, &str),
    ) -> Result<TurnReport, TurnError> {
        match self.mode {
            Mode::Chat => {
                self.entries.push(Entry::Message {
                    role: "user".into(),
                    content: text.to_string(),
                    reasoning: None,
                });
                self.chat_turn(cancel, emit)
            }
            Mode::Raw => self.raw_turn(text, cancel, emit),
        }
    }

    fn raw_turn(
        &mut self,
        text: &str,
        cancel: &AtomicBool,
        emit: &mut dyn FnMut(u32, &str),
    ) -> Result<TurnReport, TurnError> {
        // The conversation as the chat template renders it (earlier raw exchanges in place),
        // then the text: what the context holds, so returning to chat mode keeps it.
        let opts = self.settings.render_options().map_err(TurnError::Refused)?;
        let (mut prompt, _) = self.render_conversation(&opts, false)?;
        prompt.extend(template::render_raw(self.tok, text));
        if prompt.is_empty() {
            return Err(TurnError::Refused(
                "raw mode needs some text to continue".into(),
            ));
        }
        let mut stops = if self.settings.raw_ignore_end {
            Vec::new()
        } else {
            self.markers.stop_ids().to_vec()
        };
        stops.extend(self.settings.stop_ids.iter().copied());
        let limits = Limits {
            max_tokens: self.settings.raw_max_tokens.max(1),
            mark_specials: true,
            think_close: None,
        };
        let (generated, reused, stop, prefill_s, decode_s) =
            self.generate(&prompt, None, &stops, limits, cancel, emit, None)?;
        let output = self.raw_display(&generated, &stops)?;
        self.entries.push(Entry::Raw {
            prompt: text.to_string(),
            output: output.clone(),
            ids: generated.clone(),
        });
        Ok(TurnReport {
            mode: Mode::Raw,
            prefilled_tokens: prompt.len() - reused,
            prompt_ids: prompt,
            generated_tokens: generated.len(),
            generated_ids: generated,
            reply: output,
            reasoning: None,
            reused_tokens: reused,
            stop,
            accepted: true,
            rejected_because: None,
            prefill_seconds: prefill_s,
            decode_seconds: decode_s,
            context_warning: self.context_warning(),
        })
    }

    fn last_message_index(&self, role: &str) -> Option<usize> {
        self.entries
            .iter()
            .rposition(|e| matches!(e, Entry::Message { role: r, .. } if r == role))
    }

    /// Drop the last assistant reply and generate it again.
    pub fn regen(
        &mut self,
        cancel: &AtomicBool,
        emit: &mut dyn FnMut(u32, &str),
    ) -> Result<TurnReport, TurnError> {
        let Some(u) = self.last_message_index("user") else {
            return Err(TurnError::Refused(
                "/regen: there is no message to answer yet".into(),
            ));
        };
        self.entries.truncate(u + 1);
        self.mode = Mode::Chat;
        self.chat_turn(cancel, emit)
    }

    /// Remove the last exchange (user message and its reply, or a raw exchange).
    pub fn undo(&mut self) -> Result<(), TurnError> {
        let last_raw = self
            .entries
            .iter()
            .rposition(|e| matches!(e, Entry::Raw { .. }));
        let Some(u) = self.last_message_index("user").max(last_raw) else {
            return Err(TurnError::Refused("/undo: nothing to undo".into()));
        };
        self.entries.truncate(u);
        Ok(())
    }

    /// Replace the last user message with `text` and answer it again.
    pub fn edit(
        &mut self,
        text: &str,
        cancel: &AtomicBool,
        emit: &mut dyn FnMut(u32, &str),
    ) -> Result<TurnReport, TurnError> {
        let Some(u) = self.last_message_index("user") else {
            return Err(TurnError::Refused(
                "/edit: there is no message to edit yet".into(),
            ));
        };
        self.entries.truncate(u);
        self.entries.push(Entry::Message {
            role: "user".into(),
            content: text.to_string(),
            reasoning: None,
        });
        self.mode = Mode::Chat;
        self.chat_turn(cancel, emit)
    }

    /// Bring the engine state to cover exactly `tokens` (the ids of turns recovered from a
    /// journal), and hold a snapshot for each of `snapshots` (the ids each snapshot the
    /// journaled session held covered, oldest first), as an uninterrupted session would have
    /// them; then set the pending id and the sampler's stream as they were. The current state
    /// and the snapshots held are reused where their ids are a prefix of what is needed, the
    /// rest is prefilled: prefill and decode give the same bits, in any chunking, so every
    /// state equals the one the turns left. Returns the ids prefilled. On a read error the
    /// live state and the snapshots are dropped (the next turn starts over).
    pub fn rebuild(
        &mut self,
        tokens: &[u32],
        pending: Option<u32>,
        rng_state: u64,
        snapshots: &[Vec<u32>],
    ) -> Result<usize, TurnError> {
        let sampler = Sampler::with_rng_state(self.settings.sampler(), rng_state)
            .map_err(|e| TurnError::Refused(e.to_string()))?;
        let vocab = self.model.cfg.vocab_size;
        let all = tokens
            .iter()
            .chain(snapshots.iter().flatten())
            .chain(&pending);
        if let Some(id) = all.into_iter().find(|&&id| id as usize >= vocab) {
            return Err(TurnError::Refused(format!(
                "token id {id} is outside the vocabulary of {vocab}"
            )));
        }
        let limit = self.settings.context_limit;
        let mut targets: Vec<&[u32]> = Vec::new();
        for t in snapshots {
            if !t.is_empty() && t.len() <= limit && !targets.contains(&t.as_slice()) {
                targets.push(t);
            }
        }
        let extra = targets.len().saturating_sub(self.max_snapshots);
        targets.drain(..extra);
        // Held snapshots that are wanted are kept as they are; the others go first, so that
        // no more states are held than the live one and the snapshots.
        let mut built: Vec<Option<Snapshot>> = vec![None; targets.len()];
        for s in std::mem::take(&mut self.snapshots) {
            if let Some(i) = targets.iter().position(|t| *t == s.tokens.as_slice()) {
                built[i] = Some(s);
            }
        }
        if !tokens.starts_with(&self.tokens) {
            self.tokens.clear();
            self.state = SeqState::new(&self.model.cfg);
        }
        match self.rebuild_states(tokens, &targets, &mut built) {
            Ok(n) => {
                self.snapshots = built.into_iter().flatten().collect();
                self.pending = pending;
                self.sampler = sampler;
                Ok(n)
            }
            Err(e) => {
                self.drop_live_state();
                Err(e.into())
            }
        }
    }

    /// Feed `ids` to `state` in prefill chunks; the logits after the last id.
    fn feed_into(
        &mut self,
        state: &mut SeqState,
        ids: &[u32],
        progress: &mut (usize, usize),
    ) -> Result<Vec<f32>, StreamError> {
        let mut logits = Vec::new();
        let n_chunks = ids.len().div_ceil(PREFILL_CHUNK);
        for (i, chunk) in ids.chunks(PREFILL_CHUNK).enumerate() {
            logits = self
                .model
                .forward(state, chunk, Logits::for_chunk(i, n_chunks))?;
            progress.0 += chunk.len();
            progress.1 = progress.1.max(progress.0);
            if let Some(f) = self.on_prefill.as_mut() {
                f(progress.0, progress.1);
            }
        }
        Ok(logits)
    }

    /// Advance the live state along `tokens` to `to` ids; the logits there (from the last feed,
    /// or kept from before).
    fn advance_live(
        &mut self,
        tokens: &[u32],
        to: usize,
        logits: &mut Option<Vec<f32>>,
        progress: &mut (usize, usize),
    ) -> Result<(), StreamError> {
        let from = self.tokens.len();
        if from < to {
            let mut state = std::mem::replace(
                &mut self.state,
                SeqState {
                    n_pos: 0,
                    layers: Vec::new(),
                },
            );
            let fed = self.feed_into(&mut state, &tokens[from..to], progress);
            self.state = state;
            *logits = Some(fed?);
            self.tokens.extend_from_slice(&tokens[from..to]);
        }
        Ok(())
    }

    /// The states [`Session::rebuild`] needs: one pass along `tokens` with the live state, a
    /// copy of it taken where a snapshot leaves `tokens` (or of a longer snapshot that is a
    /// prefix of it), so that no id before a branch point is fed twice.
    fn rebuild_states(
        &mut self,
        tokens: &[u32],
        targets: &[&[u32]],
        built: &mut [Option<Snapshot>],
    ) -> Result<usize, StreamError> {
        let mut order: Vec<usize> = (0..targets.len()).filter(|&i| built[i].is_none()).collect();
        order.sort_by_key(|&i| (lcp(targets[i], tokens), targets[i].len()));
        let planned = tokens.len().saturating_sub(self.tokens.len())
            + order
                .iter()
                .map(|&i| targets[i].len() - lcp(targets[i], tokens))
                .sum::<usize>();
        let mut progress = (0, planned);
        let mut live_logits: Option<Vec<f32>> = None;
        for i in order {
            let t = targets[i];
            let branch = lcp(t, tokens);
            // The longest snapshot already built that is a proper prefix of this one.
            let from_snap = built
                .iter()
                .enumerate()
                .filter_map(|(j, s)| s.as_ref().map(|s| (j, s.tokens.len())))
                .filter(|&(j, n)| {
                    n < t.len() && built[j].as_ref().is_some_and(|s| t.starts_with(&s.tokens))
                })
                .max_by_key(|&(_, n)| n);
            let live = self.tokens.len();
            let live_ok = live <= branch && (live < t.len() || live_logits.is_some());
            let snap = match from_snap {
                Some((j, n)) if !live_ok || n > live => Some(j),
                _ => None,
            };
            let done = match snap {
                Some(j) => {
                    let base = built[j].as_ref().map(|s| (s.state.clone(), s.tokens.len()));
                    let (mut state, n) =
                        base.unwrap_or_else(|| (SeqState::new(&self.model.cfg), 0));
                    let logits = self.feed_into(&mut state, &t[n..], &mut progress)?;
                    Snapshot {
                        tokens: t.to_vec(),
                        state,
                        logits,
                    }
                }
                None if !live_ok => {
                    let mut state = SeqState::new(&self.model.cfg);
                    let logits = self.feed_into(&mut state, t, &mut progress)?;
                    Snapshot {
                        tokens: t.to_vec(),
                        state,
                        logits,
                    }
                }
                None => {
                    self.advance_live(tokens, branch, &mut live_logits, &mut progress)?;
                    if branch == t.len() {
                        Snapshot {
                            tokens: t.to_vec(),
                            state: self.state.clone(),
                            logits: live_logits.clone().unwrap_or_default(),
                        }
                    } else {
                        let mut state = self.state.clone();
                        let logits = self.feed_into(&mut state, &t[branch..], &mut progress)?;
                        Snapshot {
                            tokens: t.to_vec(),
                            state,
                            logits,
                        }
                    }
                }
            };
            built[i] = Some(done);
        }
        // The live state: from a snapshot when one covers more of `tokens` than it does.
        let longest = built
            .iter()
            .flatten()
            .filter(|s| s.tokens.len() > self.tokens.len() && tokens.starts_with(&s.tokens))
            .max_by_key(|s| s.tokens.len());
        if let Some(s) = longest {
            // The live state goes before the copy is made (never one state more than planned).
            self.state = SeqState {
                n_pos: 0,
                layers: Vec::new(),
            };
            self.state = s.state.clone();
            self.tokens = s.tokens.clone();
        }
        self.advance_live(tokens, tokens.len(), &mut live_logits, &mut progress)?;
        Ok(progress.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transcript_reads_as_markdown_entry_by_entry() {
        let msg = |role: &str, content: &str, reasoning: Option<&str>| Entry::Message {
            role: role.into(),
            content: content.into(),
            reasoning: reasoning.map(str::to_string),
        };
        let entries = [
            msg("user", "Hi?", None),
            msg("assistant", "Hello.", Some("greet\nbriefly")),
            msg("assistant", "Again.", Some("  ")),
            Entry::Mode { mode: Mode::Raw },
            Entry::Raw {
                prompt: "Once".into(),
                output: " upon".into(),
                ids: vec![1, 2],
            },
        ];
        assert_eq!(
            markdown(Some("demo"), Some("Be brief."), &entries),
            "# demo\n\n**system**\n\nBe brief.\n\n**user**\n\nHi?\n\n**assistant**\n\n\
             > greet\n> briefly\n\nHello.\n\n**assistant**\n\nAgain.\n\n*raw mode*\n\n\
             **raw**\n\n```\nOnce upon\n```\n"
        );
        assert_eq!(markdown(None, None, &[]), "# k3 conversation\n");
    }
}
