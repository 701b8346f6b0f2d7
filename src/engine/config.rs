//! The model configuration read from a checkpoint's `config.json`.
//!
//! Two shapes are accepted: the released nested file (root → `text_config` →
//! `linear_attn_config`) and the flat fixture shape (everything at the root, optionally inside a
//! `"config"` object, with the aliases `kda_num_heads`, `kda_head_dim`, `situ_beta`,
//! `situ_linear_beta`). Every key is looked up in `text_config`, then `linear_attn_config`, then
//! the root. An absent required key is an error, never a default; every problem found is
//! reported together in one message naming the file and the key path. Unknown keys are ignored.
//!
//! The file is read into typed structs mirroring that nesting (`ConfigFile` → `TextConfig` →
//! `Keys`), each key of its type inside a `Field`, which keeps a value of another type
//! as written instead of failing, so the reader can report every problem at once and quote each
//! value exactly. Only `quantization_config`'s groups, whose layout the release varies, are
//! walked as they come.

use serde::Deserialize;
use serde_json::{Map, Number, Value};
use std::path::{Path, PathBuf};

/// Largest `num_experts_per_token` the engine accepts.
pub const MAX_TOP_K: usize = 64;
/// Largest `config.json` read: 16 MiB (the released one is a few kB).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// Largest number of AttnRes sources the engine accepts per aggregator.
pub const MAX_LAYERS: usize = 4096;

/// How far a dimension may exceed the released Kimi K3 value (docs/model.md#dimensions) before it is
/// refused: every dimension is bounded before anything is sized from it.
pub const DIM_HEADROOM: usize = 16;

/// Each bounded dimension with its released value; the limit is [`DIM_HEADROOM`] times that.
pub const RELEASED_DIMS: [(&str, usize); 20] = [
    ("hidden_size", 7168),
    ("num_hidden_layers", 93),
    ("vocab_size", 163_840),
    ("linear_attn_config.num_heads", 96),
    ("linear_attn_config.head_dim", 128),
    ("short_conv_kernel_size", 4),
    ("num_attention_heads", 96),
    ("q_lora_rank", 1536),
    ("kv_lora_rank", 512),
    ("qk_nope_head_dim", 128),
    ("qk_rope_head_dim", 64),
    ("v_head_dim", 128),
    ("num_experts", 896),
    ("num_experts_per_token", 16),
    ("num_shared_experts", 2),
    ("routed_expert_hidden_size", 3584),
    ("moe_intermediate_size", 3072),
    ("intermediate_size", 33_792),
    // Bounded by the layer limit: a dense prefix or a block can span every layer.
    ("first_k_dense_replace", 93),
    ("attn_res_block_size", 93),
];

/// The limit of a bounded dimension (its released value × [`DIM_HEADROOM`]).
#[must_use]
pub fn dim_limit(key: &str) -> usize {
    RELEASED_DIMS
        .iter()
        .find(|(k, _)| *k == key)
        .map_or(usize::MAX, |&(_, v)| v * DIM_HEADROOM)
}

/// The most problems a refusal lists; the rest are counted.
pub const MAX_LISTED_PROBLEMS: usize = 20;
/// The longest single problem line, in characters (values from the file are cut).
const MAX_PROBLEM_CHARS: usize = 240;

/// Problems collected while validating: the first [`MAX_LISTED_PROBLEMS`] kept (each at most
/// [`MAX_PROBLEM_CHARS`] characters), the rest only counted, so a hostile file cannot make a
/// refusal huge.
#[derive(Clone, Debug, Default)]
pub struct ProblemList {
    /// The problems kept, in the order found.
    pub list: Vec<String>,
    /// How many more were found and not kept.
    pub more: usize,
}

impl ProblemList {
    /// Record a problem.
    pub fn push(&mut self, msg: String) {
        if self.list.len() >= MAX_LISTED_PROBLEMS {
            self.more += 1;
            return;
        }
        if msg.chars().count() > MAX_PROBLEM_CHARS {
            let cut: String = msg.chars().take(MAX_PROBLEM_CHARS).collect();
            self.list.push(format!("{cut}…"));
        } else {
            self.list.push(msg);
        }
    }

    /// Whether nothing was found.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.list.is_empty() && self.more == 0
    }

    /// Problems found in all (kept and counted).
    #[must_use]
    pub fn total(&self) -> usize {
        self.list.len() + self.more
    }
}

/// `problems` as indented lines, then "… and N more" when `more` were left out.
#[must_use]
pub fn list_problems(problems: &[String], more: usize) -> String {
    let mut s = problems.join("\n  - ");
    if more > 0 {
        s.push_str(&format!("\n  … and {more} more"));
    }
    s
}

/// `config.json` is missing, unreadable or refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: cannot read: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// The file is not JSON, or not an object.
    #[error("{path}: not a JSON object: {reason}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// Parser message.
        reason: String,
    },
    /// One or more keys are missing, contradictory, out of range or unsupported.
    #[error("{path}: refusing this config ({} problem(s)); no defaults are substituted:\n  - {}",
        .problems.len() + .more, list_problems(.problems, *.more))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The problems (the first [`MAX_LISTED_PROBLEMS`]), each naming its key path.
        problems: Vec<String>,
        /// Problems found beyond those listed.
        more: usize,
    },
}

impl ConfigError {
    /// Exit status: every config refusal is 2.
    #[must_use]
    pub fn exit_code(&self) -> i32 {
        2
    }
}

/// Hyper-parameters of a Kimi K3 model (names as in the checkpoint).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Hidden width.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Vocabulary size (rows of embedding and lm_head).
    pub vocab_size: usize,
    /// Default RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// KDA heads (`linear_attn_config.num_heads`).
    pub kda_num_heads: usize,
    /// KDA head dim, d_k = d_v (`linear_attn_config.head_dim`).
    pub kda_head_dim: usize,
    /// Short convolution taps.
    pub short_conv_kernel_size: usize,
    /// KDA decay lower bound g_min (negative).
    pub gate_lower_bound: f32,
    /// MLA heads.
    pub num_attention_heads: usize,
    /// MLA query LoRA rank.
    pub q_lora_rank: usize,
    /// MLA key/value latent rank.
    pub kv_lora_rank: usize,
    /// MLA no-position q/k dims per head.
    pub qk_nope_head_dim: usize,
    /// MLA "rope" q/k dims per head (scored, never rotated).
    pub qk_rope_head_dim: usize,
    /// MLA value dims per head.
    pub v_head_dim: usize,
    /// Routed experts per MoE layer.
    pub num_experts: usize,
    /// Experts selected per token.
    pub num_experts_per_token: usize,
    /// Shared experts (fused into one MLP).
    pub num_shared_experts: usize,
    /// Latent width of the routed experts.
    pub routed_expert_hidden_size: usize,
    /// Expert intermediate width.
    pub moe_intermediate_size: usize,
    /// Multiplier on the routing weights.
    pub routed_scaling_factor: f32,
    /// Whether top-k weights are renormalised.
    pub moe_renormalize: bool,
    /// Whether the routed aggregate is RMS-normalised.
    pub latent_moe_use_norm: bool,
    /// Number of leading dense layers.
    pub first_k_dense_replace: usize,
    /// Dense MLP intermediate width.
    pub intermediate_size: usize,
    /// AttnRes block size.
    pub attn_res_block_size: usize,
    /// SiTU gate cap β1.
    pub situ_beta: f32,
    /// SiTU up cap β2.
    pub situ_linear_beta: f32,
    /// Whether the MLA output is gated.
    pub mla_use_output_gate: bool,
    /// Zero-based: `is_mla[l]` iff layer l is full (MLA) attention.
    pub is_mla: Vec<bool>,
    /// Epsilon of MLA `q_a_layernorm`/`kv_a_layernorm` (the release builds them with 1e-6).
    pub mla_lora_norm_eps: f32,
    /// Epsilon of the KDA q/k L2 normalisation (added to the sum of squares).
    pub kda_l2norm_eps: f32,
    /// Token that ends a message, if declared (`eos_token_id`).
    pub eos_token_id: Option<u32>,
}

impl ModelConfig {
    /// Read and validate `path` (at most [`MAX_CONFIG_BYTES`]).
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let bytes =
            crate::stream::read_capped(path, MAX_CONFIG_BYTES).map_err(|e| ConfigError::Read {
                path: path.to_path_buf(),
                source: e,
            })?;
        let text = String::from_utf8(bytes).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            reason: format!("not UTF-8 (at byte {})", e.utf8_error().valid_up_to()),
        })?;
        Self::parse(&text, path)
    }

    /// Validate the text of a `config.json` (`path` is used in messages).
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let v: Value = serde_json::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        if !v.is_object() {
            return Err(ConfigError::Parse {
                path: path.to_path_buf(),
                reason: "the top level is not an object".into(),
            });
        }
        // Every key's type is checked by the reader, so that all problems are reported at once:
        // a key of the wrong type is kept as written ([`Field::Wrong`]), never a parse error.
        let file = ConfigFile::deserialize(&v).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        let mut r = Reader::new(&file);
        let cfg = r.build();
        match cfg {
            Some(c) if r.problems.is_empty() => Ok(c),
            _ => Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                problems: r.problems.list,
                more: r.problems.more,
            }),
        }
    }

    /// Whether layer `il` has a dense MLP (else MoE).
    #[must_use]
    pub fn is_dense(&self, il: usize) -> bool {
        il < self.first_k_dense_replace
    }

    /// Whether layer `il` mixes the block snapshots into its input before attention: only
    /// once an earlier layer has started a block, so never at layer 0 (docs/model.md). Where
    /// it does not, the layer's `self_attention_res_norm` and `self_attention_res_proj` are
    /// never read by the forward pass.
    #[must_use]
    pub fn mixes_before_attention(&self, il: usize) -> bool {
        (0..il).any(|j| self.is_block_start(j))
    }

    /// Whether layer `il` starts an AttnRes block.
    #[must_use]
    pub fn is_block_start(&self, il: usize) -> bool {
        il.is_multiple_of(self.attn_res_block_size)
    }

    /// Layers that start an AttnRes block: the most block snapshots a chunk takes.
    #[must_use]
    pub fn block_starts(&self) -> usize {
        (0..self.num_hidden_layers)
            .filter(|&il| self.is_block_start(il))
            .count()
    }

    /// KDA projection width (heads × head dim).
    #[must_use]
    pub fn kda_width(&self) -> usize {
        self.kda_num_heads * self.kda_head_dim
    }

    /// MLA query width per head (nope + rope).
    #[must_use]
    pub fn mla_q_head(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Shared-expert intermediate width.
    #[must_use]
    pub fn shared_width(&self) -> usize {
        self.moe_intermediate_size * self.num_shared_experts
    }
}

/// One key of `config.json` as the file has it: absent, `null`, of the type the key takes, or
/// of another type. The value is kept as written (`raw`) so a refusal quotes it exactly; a
/// value of the wrong type is a problem to report with the others, never a parse failure that
/// would hide them.
#[derive(Clone, Debug, Default)]
enum Field<T> {
    /// The key is not there.
    #[default]
    Absent,
    /// The key is there with `null`.
    Null,
    /// The key holds a value of its type.
    Ok {
        /// The value.
        value: T,
        /// The value as written.
        raw: Value,
    },
    /// The key holds a value of another type, as written.
    Wrong(Value),
}

impl<'de, T: serde::de::DeserializeOwned> Deserialize<'de> for Field<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = Value::deserialize(d)?;
        Ok(match raw {
            Value::Null => Field::Null,
            raw => match T::deserialize(&raw) {
                Ok(value) => Field::Ok { value, raw },
                Err(_) => Field::Wrong(raw),
            },
        })
    }
}

impl<T> Field<T> {
    /// Whether the key is there (`null` included).
    fn present(&self) -> bool {
        !matches!(self, Field::Absent)
    }

    /// The value, when of its type.
    fn value(&self) -> Option<&T> {
        match self {
            Field::Ok { value, .. } => Some(value),
            _ => None,
        }
    }

    /// The value as written, for messages.
    fn shown(&self) -> String {
        match self {
            Field::Absent => "(absent)".into(),
            Field::Null => "null".into(),
            Field::Ok { raw, .. } | Field::Wrong(raw) => raw.to_string(),
        }
    }
}

/// `eos_token_id`: one id, or several stop tokens.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum TokenIds {
    /// One id.
    One(u64),
    /// A list of ids (each checked on its own).
    Many(Vec<Field<u64>>),
}

/// `quantization_config`: the method and format, and the rest as the release varies it
/// (`config_groups`, `ignore`: docs/model.md), whose every `group_size` and `num_bits` is
/// checked wherever it sits.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
struct Quantization {
    /// Must be `compressed-tensors`.
    quant_method: Field<String>,
    /// Must be `mxfp4-pack-quantized`.
    format: Field<String>,
    /// Everything else.
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// The keys k3 reads, as any of the three scopes of `config.json` may hold them (the released
/// file keeps almost all in `text_config`, the KDA ones in `linear_attn_config`, the token ids
/// at the root; the flat fixture shape keeps all at the root). Keys not named are ignored.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
struct Keys {
    hidden_size: Field<Number>,
    num_hidden_layers: Field<Number>,
    vocab_size: Field<Number>,
    rms_norm_eps: Field<Number>,
    num_heads: Field<Number>,
    head_dim: Field<Number>,
    kda_num_heads: Field<Number>,
    kda_head_dim: Field<Number>,
    short_conv_kernel_size: Field<Number>,
    gate_lower_bound: Field<Number>,
    num_attention_heads: Field<Number>,
    num_key_value_heads: Field<Number>,
    q_lora_rank: Field<Number>,
    kv_lora_rank: Field<Number>,
    qk_nope_head_dim: Field<Number>,
    qk_rope_head_dim: Field<Number>,
    v_head_dim: Field<Number>,
    num_experts: Field<Number>,
    n_routed_experts: Field<Number>,
    num_experts_per_token: Field<Number>,
    num_experts_per_tok: Field<Number>,
    num_shared_experts: Field<Number>,
    routed_expert_hidden_size: Field<Number>,
    moe_intermediate_size: Field<Number>,
    routed_scaling_factor: Field<Number>,
    first_k_dense_replace: Field<Number>,
    intermediate_size: Field<Number>,
    attn_res_block_size: Field<Number>,
    activation_situ_beta: Field<Number>,
    situ_beta: Field<Number>,
    activation_situ_linear_beta: Field<Number>,
    situ_linear_beta: Field<Number>,
    moe_layer_freq: Field<Number>,
    num_nextn_predict_layers: Field<Number>,
    max_position_embeddings: Field<Number>,
    num_expert_group: Field<Number>,
    topk_group: Field<Number>,
    moe_renormalize: Field<bool>,
    latent_moe_use_norm: Field<bool>,
    mla_use_output_gate: Field<bool>,
    mla_use_nope: Field<bool>,
    use_full_rank_gate: Field<bool>,
    tie_word_embeddings: Field<bool>,
    hidden_act: Field<String>,
    moe_router_activation_func: Field<String>,
    topk_method: Field<String>,
    full_attn_layers: Field<Vec<Field<u64>>>,
    kda_layers: Field<Vec<Field<u64>>>,
    bos_token_id: Field<u64>,
    eos_token_id: Field<TokenIds>,
    pad_token_id: Field<u64>,
    media_placeholder_token_id: Field<u64>,
    quantization_config: Field<Quantization>,
}

/// `text_config`: the language model's keys and its `linear_attn_config`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
struct TextConfig {
    /// The KDA keys and the layer maps.
    linear_attn_config: Field<Keys>,
    /// Everything else.
    #[serde(flatten)]
    keys: Keys,
}

/// `config.json`: the released nesting (root → `text_config` → `linear_attn_config`), or the
/// flat fixture shape, optionally wrapped in a `"config"` object.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
struct ConfigFile {
    /// The language model (released shape).
    text_config: Field<TextConfig>,
    /// The KDA keys at the root (when `text_config` has none).
    linear_attn_config: Field<Keys>,
    /// The fixture wrapper: the whole file inside `"config"`.
    config: Field<Box<ConfigFile>>,
    /// The keys at the root.
    #[serde(flatten)]
    keys: Keys,
}

/// A key of [`Keys`] by name: the name for messages and the field.
type Key<T> = (&'static str, fn(&Keys) -> &Field<T>);

/// `key!(name)`: the [`Key`] of field `name`.
macro_rules! key {
    ($name:ident) => {
        (stringify!($name), |k: &Keys| &k.$name)
    };
}

/// Key lookup across the scopes, collecting problems.
struct Reader<'a> {
    scopes: Vec<(&'static str, &'a Keys)>,
    lin: Option<(&'static str, &'a Keys)>,
    flat: Option<&'a Keys>,
    problems: ProblemList,
}

impl<'a> Reader<'a> {
    fn new(file: &'a ConfigFile) -> Self {
        let root = match &file.config {
            Field::Ok { value, .. } if !file.text_config.present() => value,
            _ => file,
        };
        let text = root.text_config.value();
        let lin = text
            .and_then(|t| t.linear_attn_config.value())
            .map(|l| ("text_config.linear_attn_config", l))
            .or(root
                .linear_attn_config
                .value()
                .map(|l| ("linear_attn_config", l)));
        let mut scopes = Vec::new();
        if let Some(t) = text {
            scopes.push(("text_config", &t.keys));
        }
        if let Some(l) = lin {
            scopes.push(l);
        }
        scopes.push(("", &root.keys));
        let flat = text.is_none().then_some(&root.keys);
        Reader {
            scopes,
            lin,
            flat,
            problems: ProblemList::default(),
        }
    }

    fn path(scope: &str, key: &str) -> String {
        if scope.is_empty() {
            key.to_string()
        } else {
            format!("{scope}.{key}")
        }
    }

    /// First occurrence of any of `names`, with its key path.
    fn find<T>(&self, names: &[Key<T>]) -> Option<(String, &'a Field<T>)> {
        for (scope, m) in &self.scopes {
            for (n, get) in names {
                let f = get(m);
                if f.present() {
                    return Some((Self::path(scope, n), f));
                }
            }
        }
        None
    }

    fn where_<T>(names: &[Key<T>]) -> String {
        names
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join(" or ")
    }

    fn number(&mut self, names: &[Key<Number>]) -> Option<(String, f64)> {
        match self.find(names) {
            None => {
                self.problems
                    .push(format!("missing key `{}`", Self::where_(names)));
                None
            }
            Some((p, Field::Ok { value, .. })) => match value.as_f64() {
                Some(x) if x.is_finite() => Some((p, x)),
                _ => {
                    self.problems.push(format!("`{p}` is not a finite number"));
                    None
                }
            },
            Some((p, v)) => {
                self.problems
                    .push(format!("`{p}` must be a number, found {}", v.shown()));
                None
            }
        }
    }

    /// A dimension: an integer ≥ `min` and at most its limit ([`dim_limit`] of `names[0]`).
    fn size(&mut self, names: &[Key<Number>], min: usize) -> Option<usize> {
        let (p, x) = self.number(names)?;
        self.bounded(&p, x, min, dim_limit(names[0].0))
    }

    fn bounded(&mut self, p: &str, x: f64, min: usize, max: usize) -> Option<usize> {
        // Huge values in exponent form, so the message stays short.
        let shown = if x.abs() >= 1e15 {
            format!("{x:e}")
        } else {
            format!("{x}")
        };
        if x.fract() != 0.0 || x < min as f64 {
            self.problems
                .push(format!("`{p}` = {shown} must be an integer ≥ {min}"));
            return None;
        }
        if x > max as f64 {
            self.problems.push(format!(
                "`{p}` = {shown} is above the limit of {max} ({DIM_HEADROOM} × the released value)"
            ));
            return None;
        }
        Some(x as usize)
    }

    fn float(&mut self, names: &[Key<Number>]) -> Option<f32> {
        self.number(names).map(|(_, x)| x as f32)
    }

    fn optional_bool(&mut self, name: Key<bool>, default: bool) -> bool {
        match self.find(&[name]) {
            None => default,
            Some((_, Field::Ok { value, .. })) => *value,
            Some((p, v)) => {
                self.problems
                    .push(format!("`{p}` must be true or false, found {}", v.shown()));
                default
            }
        }
    }

    /// A key that, when present, must pass `ok` (given the key as found).
    fn require_if_present<T>(&mut self, name: Key<T>, ok: impl Fn(&Field<T>) -> bool, why: &str) {
        if let Some((p, v)) = self.find(&[name]) {
            if !ok(v) {
                self.problems.push(format!("`{p}` = {}: {why}", v.shown()));
            }
        }
    }

    /// KDA heads/head dim only from `linear_attn_config` or the flat `kda_*` aliases.
    fn kda_size(&mut self, key: Key<Number>, alias: Key<Number>) -> Option<usize> {
        let ((key, get), (alias, get_alias)) = (key, alias);
        let found = if let Some((scope, m)) = self.lin {
            Some(get(m))
                .filter(|f| f.present())
                .map(|v| (Self::path(scope, key), v))
        } else {
            None
        }
        .or_else(|| {
            self.flat
                .map(get_alias)
                .filter(|f| f.present())
                .map(|v| (alias.to_string(), v))
        });
        match found {
            None => {
                self.problems.push(format!(
                    "missing key `linear_attn_config.{key}` (or flat `{alias}`)"
                ));
                None
            }
            Some((p, Field::Ok { value, .. })) => match value.as_f64() {
                Some(x) if x.is_finite() => {
                    self.bounded(&p, x, 1, dim_limit(&format!("linear_attn_config.{key}")))
                }
                _ => {
                    self.problems.push(format!("`{p}` is not a finite number"));
                    None
                }
            },
            Some((p, v)) => {
                self.problems.push(format!(
                    "`{p}` must be a positive integer, found {}",
                    v.shown()
                ));
                None
            }
        }
    }

    fn layer_list(
        &mut self,
        name: Key<Vec<Field<u64>>>,
        n_layers: usize,
    ) -> Option<(String, Vec<usize>)> {
        let (p, v) = self.find(&[name])?;
        let Some(arr) = v.value() else {
            self.problems
                .push(format!("`{p}` must be an array of one-based layer numbers"));
            return None;
        };
        if arr.len() > n_layers {
            self.problems.push(format!(
                "`{p}` lists {} layers; the model has {n_layers}",
                arr.len()
            ));
            return None;
        }
        let mut out = Vec::with_capacity(arr.len());
        let mut seen = vec![false; n_layers + 1];
        for x in arr {
            match x.value().copied() {
                Some(i) if i >= 1 && i as usize <= n_layers => {
                    if seen[i as usize] {
                        self.problems.push(format!("`{p}` lists layer {i} twice"));
                    }
                    seen[i as usize] = true;
                    out.push(i as usize);
                }
                _ => self.problems.push(format!(
                    "`{p}` contains {}, outside the one-based range 1..={n_layers}",
                    x.shown()
                )),
            }
        }
        Some((p, out))
    }

    fn layer_map(&mut self, n_layers: Option<usize>) -> Option<Vec<bool>> {
        let n = n_layers?;
        let Some((p, full)) = self.layer_list(key!(full_attn_layers), n) else {
            if self.find(&[key!(full_attn_layers)]).is_none() {
                self.problems.push(
                    "missing key `full_attn_layers` (the one-based MLA layer list; refusing to \
                     run every layer as KDA)"
                        .into(),
                );
            }
            return None;
        };
        if full.is_empty() {
            self.problems.push(format!("`{p}` is empty"));
            return None;
        }
        let mut is_mla = vec![false; n];
        for &i in &full {
            is_mla[i - 1] = true;
        }
        if is_mla.iter().all(|&m| m) {
            self.problems
                .push(format!("`{p}` covers every layer: no KDA layer is left"));
        }
        if let Some((pk, kda)) = self.layer_list(key!(kda_layers), n) {
            let mut want: Vec<usize> = (1..=n).filter(|i| !is_mla[i - 1]).collect();
            let mut got = kda.clone();
            got.sort_unstable();
            want.sort_unstable();
            if got != want {
                let missing = want.iter().find(|i| got.binary_search(i).is_err());
                let extra = got.iter().find(|i| want.binary_search(i).is_err());
                let first = match (missing, extra) {
                    (Some(i), _) => format!("layer {i} is in neither list"),
                    (None, Some(i)) => format!("layer {i} is in both"),
                    (None, None) => "a layer is listed twice".to_string(),
                };
                self.problems.push(format!(
                    "`{pk}` is not the complement of `{p}` in 1..={n} ({first})"
                ));
            }
        }
        Some(is_mla)
    }

    fn check_semantics(&mut self) {
        let is = |want: bool| move |v: &Field<bool>| v.value() == Some(&want);
        let named = |want: &'static str| {
            move |v: &Field<String>| v.value().map(String::as_str) == Some(want)
        };
        let not_null = |v: &Field<Number>| !matches!(v, Field::Null);
        let number = |v: &Field<Number>| v.value().and_then(Number::as_f64);
        self.require_if_present(key!(mla_use_nope), is(true), "only NoPE MLA is implemented");
        self.require_if_present(
            key!(use_full_rank_gate),
            is(true),
            "only the full-rank KDA gate is implemented",
        );
        self.require_if_present(
            key!(hidden_act),
            named("situ"),
            "only `situ` is implemented",
        );
        self.require_if_present(
            key!(moe_router_activation_func),
            named("sigmoid"),
            "only the sigmoid router is implemented",
        );
        self.require_if_present(
            key!(moe_layer_freq),
            |v| number(v) == Some(1.0),
            "only moe_layer_freq 1 is implemented",
        );
        self.require_if_present(
            key!(q_lora_rank),
            not_null,
            "the direct q_proj variant is not implemented",
        );
        self.require_if_present(
            key!(routed_expert_hidden_size),
            not_null,
            "non-latent MoE is not implemented",
        );
        self.require_if_present(
            key!(num_nextn_predict_layers),
            |v| number(v).is_none_or(|x| x == 0.0),
            "MTP layers are not implemented",
        );
        self.require_if_present(
            key!(tie_word_embeddings),
            is(false),
            "tied embeddings are not supported (a separate lm_head is required)",
        );
        self.require_if_present(
            key!(gate_lower_bound),
            not_null,
            "null selects a different decay law that is not implemented",
        );
        self.require_if_present(
            key!(topk_method),
            named("noaux_tc"),
            "only `noaux_tc` routing (sigmoid scores, bias-corrected top-k) is implemented",
        );
        self.check_quantization();
    }

    /// An optional integer key: None when absent or null; a problem when it is not an integer
    /// in `min..=max`.
    fn optional_int(&mut self, name: Key<Number>, min: u64, max: u64) -> Option<(String, u64)> {
        let (p, v) = self.find(&[name])?;
        if matches!(v, Field::Null) {
            return None;
        }
        match v.value().and_then(Number::as_u64) {
            Some(x) if (min..=max).contains(&x) => Some((p, x)),
            _ => {
                self.problems.push(format!(
                    "`{p}` = {} must be an integer in {min}..={max}",
                    v.shown()
                ));
                None
            }
        }
    }

    /// Values checked against the graph: the special token ids inside the vocabulary (in
    /// every scope that states them), the expert groups consistent with the experts, a usable
    /// position limit.
    fn check_values(&mut self, vocab_size: Option<usize>, num_experts: Option<usize>) {
        if let Some(vocab) = vocab_size {
            let scopes = self.scopes.clone();
            let ids: [Key<u64>; 3] = [
                key!(bos_token_id),
                key!(pad_token_id),
                key!(media_placeholder_token_id),
            ];
            for (scope, m) in &scopes {
                // (key, whether the id is in the vocabulary, the id as written)
                let mut found: Vec<(&str, bool, String)> = Vec::new();
                for (key, get) in ids {
                    let f = get(m);
                    if f.present() && !matches!(f, Field::Null) {
                        let ok = f.value().is_some_and(|&x| x < vocab as u64);
                        found.push((key, ok, f.shown()));
                    }
                }
                // A list of ids is allowed for eos (several stop tokens).
                match &m.eos_token_id {
                    Field::Absent | Field::Null => {}
                    Field::Ok {
                        value: TokenIds::Many(list),
                        ..
                    } => {
                        for id in list {
                            let ok = id.value().is_some_and(|&x| x < vocab as u64);
                            found.push(("eos_token_id", ok, id.shown()));
                        }
                    }
                    f @ (Field::Ok { .. } | Field::Wrong(_)) => {
                        let ok = matches!(f.value(), Some(TokenIds::One(x)) if *x < vocab as u64);
                        found.push(("eos_token_id", ok, f.shown()));
                    }
                }
                for (key, ok, id) in found {
                    if !ok {
                        let p = Self::path(scope, key);
                        self.problems.push(format!(
                            "`{p}` = {id} is not a token id of the vocabulary (0..={})",
                            vocab - 1
                        ));
                    }
                }
            }
        }
        self.optional_int(key!(max_position_embeddings), 2, 1 << 40);
        let groups = self.optional_int(key!(num_expert_group), 1, 1 << 20);
        let topk_group = self.optional_int(key!(topk_group), 1, 1 << 20);
        let g = groups.as_ref().map_or(1, |(_, g)| *g);
        if let Some((p, tg)) = &topk_group {
            if *tg > g {
                self.problems.push(format!(
                    "`{p}` = {tg} is more than the {g} expert group(s) (`num_expert_group`)"
                ));
            }
        }
        if let (Some((p, g)), Some(e)) = (&groups, num_experts) {
            if !(e as u64).is_multiple_of(*g) {
                self.problems.push(format!(
                    "`{p}` = {g} does not divide the {e} experts (`num_experts`)"
                ));
            }
        }
        if let Some(tg) = topk_group.map(|(_, t)| t) {
            if g > 1 && g > tg {
                self.problems.push(format!(
                    "grouped routing (num_expert_group {g} > topk_group {tg}) is not implemented"
                ));
            }
        }
    }

    fn check_quantization(&mut self) {
        let Some((p, Field::Ok { value: q, .. })) = self.find(&[key!(quantization_config)]) else {
            return;
        };
        let m = &q.quant_method;
        if m.present() && m.value().map(String::as_str) != Some("compressed-tensors") {
            self.problems.push(format!(
                "`{p}.quant_method` = {}: expected \"compressed-tensors\"",
                m.shown()
            ));
        }
        let f = &q.format;
        if f.present() && f.value().map(String::as_str) != Some("mxfp4-pack-quantized") {
            self.problems.push(format!(
                "`{p}.format` = {}: expected \"mxfp4-pack-quantized\"",
                f.shown()
            ));
        }
        // Every group_size / num_bits stated anywhere inside must be 32 / 4.
        let rest = Value::Object(q.rest.clone());
        let mut stack = vec![(p.clone(), &rest)];
        while let Some((path, v)) = stack.pop() {
            if let Some(o) = v.as_object() {
                for (k, child) in o {
                    let cp = format!("{path}.{k}");
                    match k.as_str() {
                        "group_size" if !child.is_null() && child.as_f64() != Some(32.0) => {
                            self.problems
                                .push(format!("`{cp}` = {child}: MXFP4 needs group size 32"));
                        }
                        "num_bits" if !child.is_null() && child.as_f64() != Some(4.0) => {
                            self.problems
                                .push(format!("`{cp}` = {child}: expected 4-bit weights"));
                        }
                        _ => stack.push((cp, child)),
                    }
                }
            }
        }
    }

    /// Over 100 lines: one read per key of the release's config, each problem recorded so all
    /// are reported at once.
    fn build(&mut self) -> Option<ModelConfig> {
        let hidden_size = self.size(&[key!(hidden_size)], 1);
        let num_hidden_layers = self.size(&[key!(num_hidden_layers)], 1);
        let vocab_size = self.size(&[key!(vocab_size)], 1);
        let rms_norm_eps = self.float(&[key!(rms_norm_eps)]);
        if rms_norm_eps.is_some_and(|e| e <= 0.0 || e >= 1.0) {
            self.problems
                .push("`rms_norm_eps` must be in (0, 1)".into());
        }
        let kda_num_heads = self.kda_size(key!(num_heads), key!(kda_num_heads));
        let kda_head_dim = self.kda_size(key!(head_dim), key!(kda_head_dim));
        let short_conv_kernel_size = self.size(&[key!(short_conv_kernel_size)], 1);
        let gate_lower_bound = self.float(&[key!(gate_lower_bound)]);
        if gate_lower_bound.is_some_and(|g| g >= 0.0) {
            self.problems
                .push("`gate_lower_bound` must be negative".into());
        }
        let num_attention_heads = self.size(&[key!(num_attention_heads)], 1);
        if let (Some(h), Some((p, kv))) =
            (num_attention_heads, self.find(&[key!(num_key_value_heads)]))
        {
            if kv.value().and_then(Number::as_f64) != Some(h as f64) {
                self.problems.push(format!("`{p}` = {} must equal num_attention_heads ({h}): grouped KV is not implemented", kv.shown()));
            }
        }
        let q_lora_rank = self.size(&[key!(q_lora_rank)], 1);
        let kv_lora_rank = self.size(&[key!(kv_lora_rank)], 1);
        let qk_nope_head_dim = self.size(&[key!(qk_nope_head_dim)], 1);
        let qk_rope_head_dim = self.size(&[key!(qk_rope_head_dim)], 0);
        let v_head_dim = self.size(&[key!(v_head_dim)], 1);
        let num_experts = self.size(&[key!(num_experts), key!(n_routed_experts)], 1);
        let top_k = self.size(&[key!(num_experts_per_token), key!(num_experts_per_tok)], 1);
        if let (Some(k), Some(e)) = (top_k, num_experts) {
            if k > e {
                self.problems.push(format!(
                    "`num_experts_per_token` = {k} exceeds `num_experts` = {e}"
                ));
            }
        }
        if top_k.is_some_and(|k| k > MAX_TOP_K) {
            self.problems.push(format!(
                "`num_experts_per_token` above the engine maximum {MAX_TOP_K}"
            ));
        }
        let num_shared_experts = self.size(&[key!(num_shared_experts)], 0);
        let routed_expert_hidden_size = self.size(&[key!(routed_expert_hidden_size)], 1);
        let moe_intermediate_size = self.size(&[key!(moe_intermediate_size)], 1);
        let routed_scaling_factor = self.float(&[key!(routed_scaling_factor)]);
        let first_k_dense_replace = self.size(&[key!(first_k_dense_replace)], 0);
        let intermediate_size = self.size(&[key!(intermediate_size)], 1);
        let attn_res_block_size = self.size(&[key!(attn_res_block_size)], 1);
        let situ_beta = self.float(&[key!(activation_situ_beta), key!(situ_beta)]);
        let situ_linear_beta =
            self.float(&[key!(activation_situ_linear_beta), key!(situ_linear_beta)]);
        for (n, b) in [
            ("activation_situ_beta", situ_beta),
            ("activation_situ_linear_beta", situ_linear_beta),
        ] {
            if b.is_some_and(|x| x <= 0.0) {
                self.problems.push(format!("`{n}` must be positive"));
            }
        }
        let moe_renormalize = self.optional_bool(key!(moe_renormalize), true);
        let latent_moe_use_norm = self.optional_bool(key!(latent_moe_use_norm), true);
        if !latent_moe_use_norm {
            self.problems
                .push("`latent_moe_use_norm` false is not implemented".into());
        }
        let mla_use_output_gate = self.optional_bool(key!(mla_use_output_gate), true);
        if !mla_use_output_gate {
            self.problems
                .push("`mla_use_output_gate` false is not implemented".into());
        }
        let is_mla = self.layer_map(num_hidden_layers);
        self.check_semantics();
        self.check_values(vocab_size, num_experts);
        let eos_token_id = match self.find(&[key!(eos_token_id)]) {
            Some((
                _,
                Field::Ok {
                    value: TokenIds::One(x),
                    ..
                },
            )) => u32::try_from(*x).ok(),
            _ => None,
        };
        Some(ModelConfig {
            hidden_size: hidden_size?,
            num_hidden_layers: num_hidden_layers?,
            vocab_size: vocab_size?,
            rms_norm_eps: rms_norm_eps?,
            kda_num_heads: kda_num_heads?,
            kda_head_dim: kda_head_dim?,
            short_conv_kernel_size: short_conv_kernel_size?,
            gate_lower_bound: gate_lower_bound?,
            num_attention_heads: num_attention_heads?,
            q_lora_rank: q_lora_rank?,
            kv_lora_rank: kv_lora_rank?,
            qk_nope_head_dim: qk_nope_head_dim?,
            qk_rope_head_dim: qk_rope_head_dim?,
            v_head_dim: v_head_dim?,
            num_experts: num_experts?,
            num_experts_per_token: top_k?,
            num_shared_experts: num_shared_experts?,
            routed_expert_hidden_size: routed_expert_hidden_size?,
            moe_intermediate_size: moe_intermediate_size?,
            routed_scaling_factor: routed_scaling_factor?,
            moe_renormalize,
            latent_moe_use_norm,
            first_k_dense_replace: first_k_dense_replace?,
            intermediate_size: intermediate_size?,
            attn_res_block_size: attn_res_block_size?,
            situ_beta: situ_beta?,
            situ_linear_beta: situ_linear_beta?,
            mla_use_output_gate,
            is_mla: is_mla?,
            mla_lora_norm_eps: 1e-6,
            kda_l2norm_eps: 1e-6,
            eos_token_id,
        })
    }
}
