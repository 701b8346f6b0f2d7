//! Where the reply settings come from: layers of defaults applied in order of precedence, each
//! value remembering its source, and the checkpoint's `generation_config.json` read as one of
//! them.
//!
//! Precedence, highest first: a command-line flag (or a request field, for the server), the
//! user config file's `[sampling]` table, the model directory's `generation_config.json`, the
//! built-in defaults. `docs/sampling.md` describes the keys read.

use super::chat::Settings;
use crate::engine::sampling::SamplerConfig;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// The file name read from a model directory.
pub const GENERATION_CONFIG: &str = "generation_config.json";

/// Largest `generation_config.json` read: 1 MiB (real ones are a few hundred bytes).
pub const MAX_GENERATION_CONFIG_BYTES: u64 = 1 << 20;

/// Largest `max_new_tokens` accepted (the longest context k3 plans for).
pub const MAX_NEW_TOKENS: u64 = 1 << 20;

/// The built-in temperature of `k3 chat` and `k3 serve`: K3's recommendation.
pub const BUILT_IN_TEMPERATURE: f32 = 1.0;

/// Where a setting's value came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Source {
    /// The built-in default.
    #[default]
    BuiltIn,
    /// The model directory's `generation_config.json`.
    Model,
    /// The user config file.
    UserConfig,
    /// A command-line flag.
    Flag,
    /// `/set` while chatting.
    Set,
    /// A saved session that was loaded or resumed.
    Session,
}

impl Source {
    /// How the start-up line and `/stats` name it.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Source::BuiltIn => "built-in",
            Source::Model => GENERATION_CONFIG,
            Source::UserConfig => "config file",
            Source::Flag => "flag",
            Source::Set => "/set",
            Source::Session => "saved session",
        }
    }
}

/// The settings whose source is tracked, in the order they are shown.
pub const TRACKED: [&str; 7] = [
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "seed",
    "max_tokens",
];

/// The source of each [`TRACKED`] setting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sources([Source; 7]);

impl Sources {
    /// Every setting from `source`.
    #[must_use]
    pub fn all(source: Source) -> Sources {
        Sources([source; 7])
    }

    /// The source of the setting named `key` (one of [`TRACKED`]; built-in for any other).
    #[must_use]
    pub fn of(&self, key: &str) -> Source {
        TRACKED
            .iter()
            .position(|k| *k == key)
            .map_or(Source::BuiltIn, |i| self.0[i])
    }

    /// Record that `key` now comes from `source` (ignored for a key not in [`TRACKED`]).
    pub fn set(&mut self, key: &str, source: Source) {
        if let Some(i) = TRACKED.iter().position(|k| *k == key) {
            self.0[i] = source;
        }
    }

    /// One line naming each tracked setting's value in `s` and its source, e.g.
    /// `sampling: temperature 0.6 (generation_config.json), top_k 0 (built-in), …`.
    #[must_use]
    pub fn line(&self, s: &Settings) -> String {
        let c = &s.sampler;
        let values = [
            c.temperature.to_string(),
            c.top_k.to_string(),
            c.top_p.to_string(),
            c.min_p.to_string(),
            c.repeat_penalty.to_string(),
            c.seed.to_string(),
            s.max_tokens.to_string(),
        ];
        let parts: Vec<String> = TRACKED
            .iter()
            .zip(values)
            .zip(self.0)
            .map(|((k, v), src)| format!("{k} {v} ({})", src.name()))
            .collect();
        format!("sampling: {}", parts.join(", "))
    }
}

/// Reply settings from one source, each given or not: the user config file's `[sampling]`
/// table, the settings read from `generation_config.json`, or the command-line flags.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SamplingLayer {
    /// Temperature (0 is greedy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Top-k (0 = off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<usize>,
    /// Nucleus threshold in (0, 1].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Min-p in [0, 1].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    /// Repetition penalty (1 = off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repeat_penalty: Option<f32>,
    /// Random seed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Longest reply in tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    /// Longest raw-mode continuation in tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub raw_max_tokens: Option<usize>,
    /// Most positions a session may hold.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<usize>,
}

impl SamplingLayer {
    /// Put every value this layer gives into `s`, recording `source` for each.
    pub fn apply(&self, source: Source, s: &mut Settings, from: &mut Sources) {
        let c: &mut SamplerConfig = &mut s.sampler;
        let mut put = |key: &str, given: bool| {
            if given {
                from.set(key, source);
            }
        };
        if let Some(v) = self.temperature {
            c.temperature = v;
        }
        put("temperature", self.temperature.is_some());
        if let Some(v) = self.top_k {
            c.top_k = v;
        }
        put("top_k", self.top_k.is_some());
        if let Some(v) = self.top_p {
            c.top_p = v;
        }
        put("top_p", self.top_p.is_some());
        if let Some(v) = self.min_p {
            c.min_p = v;
        }
        put("min_p", self.min_p.is_some());
        if let Some(v) = self.repeat_penalty {
            c.repeat_penalty = v;
        }
        put("repeat_penalty", self.repeat_penalty.is_some());
        if let Some(v) = self.seed {
            c.seed = v;
        }
        put("seed", self.seed.is_some());
        if let Some(v) = self.max_tokens {
            s.max_tokens = v.max(1);
        }
        put("max_tokens", self.max_tokens.is_some());
        if let Some(v) = self.raw_max_tokens {
            s.raw_max_tokens = v.max(1);
        }
        if let Some(v) = self.context {
            s.context_limit = v.max(2);
        }
    }
}

impl SamplingLayer {
    /// Each value this layer gives, as `key value` (e.g. `max_tokens 300`), in field order.
    #[must_use]
    pub fn given(&self) -> Vec<String> {
        let pairs = [
            ("temperature", self.temperature.map(|v| v.to_string())),
            ("top_k", self.top_k.map(|v| v.to_string())),
            ("top_p", self.top_p.map(|v| v.to_string())),
            ("min_p", self.min_p.map(|v| v.to_string())),
            ("repeat_penalty", self.repeat_penalty.map(|v| v.to_string())),
            ("seed", self.seed.map(|v| v.to_string())),
            ("max_tokens", self.max_tokens.map(|v| v.to_string())),
            ("raw_max_tokens", self.raw_max_tokens.map(|v| v.to_string())),
            ("context", self.context.map(|v| v.to_string())),
        ];
        pairs
            .into_iter()
            .filter_map(|(k, v)| v.map(|v| format!("{k} {v}")))
            .collect()
    }

    /// Put the command line's flags (this layer) over the settings of a session just loaded
    /// (docs/sessions.md): `s` and `from` are changed for each value given; the line saying
    /// so, or `None` when no flag gave a value.
    pub fn over_session(&self, s: &mut Settings, from: &mut Sources) -> Option<String> {
        let given = self.given();
        if given.is_empty() {
            return None;
        }
        self.apply(Source::Flag, s, from);
        Some(format!(
            "the command line's flags win over the session's settings: {}",
            given.join(", ")
        ))
    }
}

/// Apply `layers` (lowest precedence first) over `base`; the settings and each one's source.
#[must_use]
pub fn resolve(base: Settings, layers: &[(Source, &SamplingLayer)]) -> (Settings, Sources) {
    let mut s = base;
    let mut from = Sources::default();
    for (source, layer) in layers {
        layer.apply(*source, &mut s, &mut from);
    }
    (s, from)
}

/// The built-in settings of `k3 chat` and `k3 serve`: K3's recommended temperature, the rest
/// off, seed 1.
#[must_use]
pub fn built_in() -> Settings {
    Settings {
        sampler: SamplerConfig {
            temperature: BUILT_IN_TEMPERATURE,
            ..SamplerConfig::default()
        },
        ..Settings::default()
    }
}

/// A `generation_config.json` could not be used.
#[derive(Debug, thiserror::Error)]
pub enum GenerationConfigError {
    /// The file exists but could not be read (or is too large).
    #[error("{}: cannot read: {source}", .path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// The path exists but is not a regular file.
    #[error("{}: not a regular file", .path.display())]
    NotAFile {
        /// The path.
        path: PathBuf,
    },
    /// The file is not a JSON object.
    #[error("{}: not a JSON object: {reason}", .path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// Parser message.
        reason: String,
    },
    /// A key has the wrong type or is out of range.
    #[error("{}: {key}: {message}", .path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The offending key.
        key: String,
        /// What is wrong.
        message: String,
    },
}

impl GenerationConfigError {
    /// Exit status: 3, an input file of the model failed validation.
    #[must_use]
    pub fn exit_code(&self) -> i32 {
        3
    }
}

/// The sampling defaults a checkpoint recommends.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationConfig {
    /// The settings it gives (`max_new_tokens` → `max_tokens`, `repetition_penalty` →
    /// `repeat_penalty`; `"do_sample": false` → temperature 0).
    pub layer: SamplingLayer,
    /// One line per key that was ignored, for the start-up output.
    pub notes: Vec<String>,
}

fn invalid(path: &Path, key: &str, message: impl Into<String>) -> GenerationConfigError {
    GenerationConfigError::Invalid {
        path: path.to_path_buf(),
        key: key.to_string(),
        message: message.into(),
    }
}

/// A finite number in `range` (as the file writes it: JSON numbers only).
fn number(
    path: &Path,
    key: &str,
    v: &Value,
    ok: impl Fn(f64) -> bool,
    range: &str,
) -> Result<f32, GenerationConfigError> {
    let x = v
        .as_f64()
        .ok_or_else(|| invalid(path, key, format!("expected a number, found {}", kind(v))))?;
    // A finite f64 beyond f32's range (1e40) would become infinite as f32.
    if !(x.is_finite() && (x as f32).is_finite() && ok(x)) {
        return Err(invalid(path, key, format!("{x} is not {range}")));
    }
    Ok(x as f32)
}

/// A whole number in `lo..=hi` (an integral float such as `50.0` is accepted).
fn whole(
    path: &Path,
    key: &str,
    v: &Value,
    lo: u64,
    hi: u64,
) -> Result<u64, GenerationConfigError> {
    let n = match v {
        Value::Number(n) => n.as_u64().or_else(|| {
            n.as_f64()
                .filter(|x| x.fract() == 0.0 && *x >= 0.0 && *x <= hi as f64)
                .map(|x| x as u64)
        }),
        _ => {
            return Err(invalid(
                path,
                key,
                format!("expected a whole number, found {}", kind(v)),
            ))
        }
    };
    match n {
        Some(n) if (lo..=hi).contains(&n) => Ok(n),
        _ => Err(invalid(
            path,
            key,
            format!("{v} is not a whole number in {lo}..={hi}"),
        )),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

impl GenerationConfig {
    /// Parse and check the file's bytes; `path` is only used in messages. A key whose value is
    /// `null` counts as absent; keys k3 does not use are ignored with a note.
    /// Over 100 lines: one arm per `generation_config.json` key, each with its check and
    /// message.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<GenerationConfig, GenerationConfigError> {
        let value: Value =
            serde_json::from_slice(bytes).map_err(|e| GenerationConfigError::Parse {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
        let Value::Object(map) = value else {
            return Err(GenerationConfigError::Parse {
                path: path.to_path_buf(),
                reason: format!("the top level is {}", kind(&value)),
            });
        };
        let mut g = GenerationConfig::default();
        let mut greedy = false;
        let mut ignored = Vec::new();
        for (key, v) in &map {
            if v.is_null() {
                continue;
            }
            let l = &mut g.layer;
            match key.as_str() {
                "temperature" => {
                    l.temperature = Some(number(path, key, v, |x| x >= 0.0, "≥ 0")?);
                }
                "top_p" => {
                    l.top_p = Some(number(path, key, v, |x| x > 0.0 && x <= 1.0, "in (0, 1]")?);
                }
                "min_p" => {
                    l.min_p = Some(number(
                        path,
                        key,
                        v,
                        |x| (0.0..=1.0).contains(&x),
                        "in [0, 1]",
                    )?);
                }
                "repetition_penalty" => {
                    l.repeat_penalty = Some(number(path, key, v, |x| x > 0.0, "> 0")?);
                }
                "top_k" => {
                    let k = whole(path, key, v, 0, u64::from(u32::MAX))?;
                    l.top_k = Some(usize::try_from(k).unwrap_or(usize::MAX));
                }
                "max_new_tokens" => {
                    let n = whole(path, key, v, 1, MAX_NEW_TOKENS)?;
                    l.max_tokens = Some(usize::try_from(n).unwrap_or(usize::MAX));
                }
                "do_sample" => match v {
                    Value::Bool(b) => greedy = !b,
                    _ => {
                        return Err(invalid(
                            path,
                            key,
                            format!("expected true or false, found {}", kind(v)),
                        ))
                    }
                },
                // Checked but not used: the chat template decides the end ids.
                "bos_token_id" | "pad_token_id" => {
                    whole(path, key, v, 0, u64::from(u32::MAX))?;
                }
                "eos_token_id" => match v {
                    Value::Array(ids) => {
                        for id in ids {
                            whole(path, key, id, 0, u64::from(u32::MAX))?;
                        }
                    }
                    _ => {
                        whole(path, key, v, 0, u64::from(u32::MAX))?;
                    }
                },
                "transformers_version" => {
                    if !v.is_string() {
                        return Err(invalid(
                            path,
                            key,
                            format!("expected a string, found {}", kind(v)),
                        ));
                    }
                }
                _ => ignored.push(key.clone()),
            }
        }
        if greedy {
            g.layer.temperature = Some(0.0);
        }
        if !ignored.is_empty() {
            const SHOWN: usize = 8;
            let mut list: Vec<String> = ignored
                .iter()
                .take(SHOWN)
                .map(|k| format!("{k:?}"))
                .collect();
            if ignored.len() > SHOWN {
                list.push(format!("and {} more", ignored.len() - SHOWN));
            }
            g.notes.push(format!(
                "{}: ignored key(s) k3 does not use: {}",
                path.display(),
                list.join(", ")
            ));
        }
        Ok(g)
    }

    /// Read `generation_config.json` from `model_dir`: None when there is none; refused when it
    /// is not a regular file, above [`MAX_GENERATION_CONFIG_BYTES`], or malformed.
    pub fn load(model_dir: &Path) -> Result<Option<GenerationConfig>, GenerationConfigError> {
        let path = model_dir.join(GENERATION_CONFIG);
        let meta = match std::fs::metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(GenerationConfigError::Read { path, source }),
        };
        if !meta.is_file() {
            return Err(GenerationConfigError::NotAFile { path });
        }
        let bytes =
            crate::stream::read_capped(&path, MAX_GENERATION_CONFIG_BYTES).map_err(|source| {
                GenerationConfigError::Read {
                    path: path.clone(),
                    source,
                }
            })?;
        Self::parse(&bytes, &path).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<GenerationConfig, GenerationConfigError> {
        GenerationConfig::parse(text.as_bytes(), Path::new("generation_config.json"))
    }

    #[test]
    fn a_hugging_face_file_gives_its_settings_and_notes_what_is_ignored() {
        let g = parse(
            r#"{"_from_model_config": true, "bos_token_id": 1, "eos_token_id": [2, 3],
                "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05,
                "max_new_tokens": 256, "min_p": null, "transformers_version": "4.51.0",
                "do_sample": true}"#,
        )
        .unwrap();
        assert_eq!(
            g.layer,
            SamplingLayer {
                temperature: Some(0.6),
                top_p: Some(0.95),
                top_k: Some(20),
                repeat_penalty: Some(1.05),
                max_tokens: Some(256),
                ..SamplingLayer::default()
            }
        );
        assert_eq!(g.notes.len(), 1);
        assert!(
            g.notes[0].contains("\"_from_model_config\""),
            "{:?}",
            g.notes
        );
        // A number beyond f32's range is refused, not taken as infinite.
        assert!(parse(r#"{"temperature": 1e40}"#).is_err());
        assert!(parse(r#"{"do_sample": false, "temperature": 1e40}"#).is_err());
        // do_sample false is greedy whatever the temperature says.
        let g = parse(r#"{"do_sample": false, "temperature": 0.7}"#).unwrap();
        assert_eq!(g.layer.temperature, Some(0.0));
        assert!(parse("{}").unwrap().notes.is_empty());
    }

    #[test]
    fn a_malformed_file_is_refused_naming_its_key() {
        for (text, key) in [
            (r#"{"temperature": -0.5}"#, "temperature"),
            (r#"{"temperature": "0.6"}"#, "temperature"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"top_p": 1.5}"#, "top_p"),
            (r#"{"min_p": 2}"#, "min_p"),
            (r#"{"top_k": -1}"#, "top_k"),
            (r#"{"top_k": 2.5}"#, "top_k"),
            (r#"{"repetition_penalty": 0}"#, "repetition_penalty"),
            (r#"{"max_new_tokens": 0}"#, "max_new_tokens"),
            (r#"{"max_new_tokens": 1e300}"#, "max_new_tokens"),
            (r#"{"do_sample": "yes"}"#, "do_sample"),
            (r#"{"eos_token_id": [1, "x"]}"#, "eos_token_id"),
            (r#"{"transformers_version": 4}"#, "transformers_version"),
        ] {
            match parse(text) {
                Err(GenerationConfigError::Invalid { key: k, .. }) => assert_eq!(k, key, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
        for text in ["[1]", "{", "", "null", "{\"a\":1} x"] {
            assert!(
                matches!(parse(text), Err(GenerationConfigError::Parse { .. })),
                "{text}"
            );
        }
    }

    #[test]
    fn each_layer_overrides_the_one_below_and_says_so() {
        let model = SamplingLayer {
            temperature: Some(0.6),
            top_p: Some(0.9),
            top_k: Some(40),
            max_tokens: Some(100),
            ..SamplingLayer::default()
        };
        let user = SamplingLayer {
            top_p: Some(0.8),
            top_k: Some(30),
            ..SamplingLayer::default()
        };
        let flags = SamplingLayer {
            top_k: Some(5),
            ..SamplingLayer::default()
        };
        let (s, from) = resolve(
            built_in(),
            &[
                (Source::Model, &model),
                (Source::UserConfig, &user),
                (Source::Flag, &flags),
            ],
        );
        assert_eq!(s.sampler.temperature, 0.6);
        assert_eq!(s.sampler.top_p, 0.8);
        assert_eq!(s.sampler.top_k, 5);
        assert_eq!(s.sampler.seed, 1);
        assert_eq!(s.max_tokens, 100);
        assert_eq!(from.of("temperature"), Source::Model);
        assert_eq!(from.of("top_p"), Source::UserConfig);
        assert_eq!(from.of("top_k"), Source::Flag);
        assert_eq!(from.of("seed"), Source::BuiltIn);
        let line = from.line(&s);
        assert!(
            line.contains("temperature 0.6 (generation_config.json)"),
            "{line}"
        );
        assert!(line.contains("top_p 0.8 (config file)"), "{line}");
        assert!(line.contains("top_k 5 (flag)"), "{line}");
        assert!(line.contains("seed 1 (built-in)"), "{line}");
        // Without the layers above it, each lower one shows through.
        let (s, _) = resolve(built_in(), &[(Source::Model, &model)]);
        assert_eq!((s.sampler.top_p, s.sampler.top_k), (0.9, 40));
        let (s, _) = resolve(built_in(), &[]);
        assert_eq!(s.sampler.temperature, BUILT_IN_TEMPERATURE);
    }

    #[test]
    fn load_refuses_a_directory_and_an_oversized_file_and_passes_over_a_missing_one() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(GenerationConfig::load(dir.path()).unwrap(), None);
        std::fs::create_dir(dir.path().join(GENERATION_CONFIG)).unwrap();
        assert!(matches!(
            GenerationConfig::load(dir.path()),
            Err(GenerationConfigError::NotAFile { .. })
        ));
        let big = tempfile::tempdir().unwrap();
        let mut text = String::from("{\"temperature\": 0.5, \"pad\": \"");
        text.push_str(&"x".repeat(MAX_GENERATION_CONFIG_BYTES as usize));
        text.push_str("\"}");
        std::fs::write(big.path().join(GENERATION_CONFIG), text).unwrap();
        let e = GenerationConfig::load(big.path()).unwrap_err();
        assert!(matches!(e, GenerationConfigError::Read { .. }), "{e}");
        assert_eq!(e.exit_code(), 3);
    }
}
