//! The user's configuration file (`config.toml` in the platform config directory, or the file
//! named by `K3_CONFIG`): default model directory, memory budget, sampling and thinking
//! defaults, theme and key bindings; and the `k3 config path|show|init` subcommand.
//!
//! Unknown keys are refused with their line and column, so a typo never silently does nothing.
//! Precedence: command-line flags, then this file, then the built-in defaults. Key chords are
//! plain data here ([`KeyChord`]); the terminal front end maps its key events onto them.

use clap::{Args, Subcommand};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::{Path, PathBuf};

/// Environment variable naming the config file to use instead of the default path.
pub const CONFIG_ENV: &str = "K3_CONFIG";

/// A user config file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    /// The file exists but could not be read.
    #[error("{path}: cannot read: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// The file is not valid TOML for this schema (syntax, unknown key, wrong type).
    #[error("{path}:{line}:{column}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line of the problem.
        line: usize,
        /// 1-based column (in characters) of the problem.
        column: usize,
        /// What is wrong.
        message: String,
    },
    /// A value is out of range or two key bindings collide.
    #[error("{path}{}: {field}: {message}", at_text(*.at))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// 1-based line and column of the value in the file (None: the key is not in the file,
        /// its default collides).
        at: Option<(usize, usize)>,
        /// The offending key, dotted (`sampling.top_p`).
        field: String,
        /// What is wrong.
        message: String,
    },
    /// No config directory could be determined (no home directory and no `K3_CONFIG`).
    #[error("no configuration directory (set {CONFIG_ENV} to a file path)")]
    NoConfigDir,
    /// `k3 config init` would overwrite an existing file.
    #[error("{path} already exists (use --force to overwrite it)")]
    Exists {
        /// The file.
        path: PathBuf,
    },
}

/// Largest user config file read: 1 MiB.
pub const MAX_CONFIG_TOML_BYTES: u64 = 1 << 20;

fn at_text(at: Option<(usize, usize)>) -> String {
    at.map_or_else(String::new, |(l, c)| format!(":{l}:{c}"))
}

/// Colour scheme of the terminal client.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ThemeName {
    /// Light text on a dark terminal.
    #[default]
    Dark,
    /// Dark text on a light terminal.
    Light,
    /// No colours, only bold, dim and reverse.
    Mono,
}

/// Thinking defaults (the `[thinking]` table).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ThinkingConfig {
    /// Whether the reasoning channel is on.
    pub enabled: bool,
    /// Effort: `low`, `high` or `max`.
    pub effort: String,
}

impl Default for ThinkingConfig {
    fn default() -> Self {
        ThinkingConfig {
            enabled: true,
            effort: "max".into(),
        }
    }
}

/// Memory defaults (the `[memory]` table).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MemoryConfig {
    /// Memory budget in GB the full-screen client applies once the model is open (as `/budget`
    /// does); absent: the budget the model opened with (80% of the memory available at start).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget_gb: Option<f64>,
}

/// A key the terminal client can bind: a named key or a character.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyName {
    /// A printable character (letters are stored lowercase when a modifier is held).
    Char(char),
    /// Function key F1–F24.
    F(u8),
    /// Enter / Return.
    Enter,
    /// Escape.
    Esc,
    /// Tab.
    Tab,
    /// Backspace.
    Backspace,
    /// Delete.
    Delete,
    /// Insert.
    Insert,
    /// Home.
    Home,
    /// End.
    End,
    /// Page Up.
    PageUp,
    /// Page Down.
    PageDown,
    /// Arrow up.
    Up,
    /// Arrow down.
    Down,
    /// Arrow left.
    Left,
    /// Arrow right.
    Right,
}

/// A key with modifiers, e.g. `ctrl-y`, `alt-enter`, `f1`, `[`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KeyChord {
    /// The key.
    pub key: KeyName,
    /// Control held.
    pub ctrl: bool,
    /// Alt (Meta) held.
    pub alt: bool,
    /// Shift held (only meaningful for named keys).
    pub shift: bool,
}

impl KeyChord {
    /// A chord with no modifiers.
    #[must_use]
    pub const fn plain(key: KeyName) -> Self {
        KeyChord {
            key,
            ctrl: false,
            alt: false,
            shift: false,
        }
    }

    /// Control plus a character.
    #[must_use]
    pub const fn ctrl(c: char) -> Self {
        KeyChord {
            key: KeyName::Char(c),
            ctrl: true,
            alt: false,
            shift: false,
        }
    }

    /// True for a printable character with no Control or Alt: typing it would insert it.
    #[must_use]
    pub fn is_printable(&self) -> bool {
        matches!(self.key, KeyName::Char(_)) && !self.ctrl && !self.alt
    }

    /// Parse `ctrl-y`, `Ctrl+Y`, `alt-enter`, `shift-enter`, `f1`, `pageup`, `[`, `?`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim();
        if t.is_empty() {
            return Err("empty key".into());
        }
        let mut parts: Vec<&str> = t.split(['-', '+']).collect();
        // `ctrl--` or `ctrl-+` ends in an empty part: the key is the separator itself.
        let last = match parts.pop() {
            Some("") if t.chars().count() > 1 => {
                // Only a doubled separator names the separator key (`ctrl--`); `ctrl-` is cut off.
                if parts.pop() != Some("") {
                    return Err(format!("{text:?} ends without a key"));
                }
                &t[t.len() - 1..]
            }
            Some(p) if !p.is_empty() => p,
            _ => t,
        };
        if t.chars().count() == 1 {
            parts.clear();
        }
        let mut chord = KeyChord::plain(KeyName::Enter);
        for m in parts.iter().filter(|m| !m.is_empty()) {
            let held = match m.to_ascii_lowercase().as_str() {
                "ctrl" | "control" | "c" => &mut chord.ctrl,
                "alt" | "meta" | "m" => &mut chord.alt,
                "shift" | "s" => &mut chord.shift,
                other => return Err(format!("unknown modifier {other:?} in {text:?}")),
            };
            if *held {
                return Err(format!("modifier {m:?} given twice in {text:?}"));
            }
            *held = true;
        }
        chord.key = key_name(last).ok_or_else(|| format!("unknown key {last:?} in {text:?}"))?;
        if let KeyName::Char(c) = chord.key {
            if chord.ctrl || chord.alt {
                chord.key = KeyName::Char(c.to_ascii_lowercase());
            }
            if chord.shift {
                return Err(format!(
                    "{text:?}: write the shifted character itself instead of shift-"
                ));
            }
        }
        Ok(chord)
    }
}

fn key_name(word: &str) -> Option<KeyName> {
    let mut chars = word.chars();
    if let (Some(c), None) = (chars.next(), chars.next()) {
        return (!c.is_control()).then_some(KeyName::Char(c));
    }
    let lower = word.to_ascii_lowercase();
    let named = match lower.as_str() {
        "enter" | "return" => KeyName::Enter,
        "esc" | "escape" => KeyName::Esc,
        "tab" => KeyName::Tab,
        "backspace" => KeyName::Backspace,
        "delete" | "del" => KeyName::Delete,
        "insert" | "ins" => KeyName::Insert,
        "home" => KeyName::Home,
        "end" => KeyName::End,
        "pageup" | "pgup" => KeyName::PageUp,
        "pagedown" | "pgdn" | "pgdown" => KeyName::PageDown,
        "up" => KeyName::Up,
        "down" => KeyName::Down,
        "left" => KeyName::Left,
        "right" => KeyName::Right,
        "space" => KeyName::Char(' '),
        "minus" => KeyName::Char('-'),
        "plus" => KeyName::Char('+'),
        f if f.starts_with('f') => {
            let n: u8 = f[1..].parse().ok()?;
            if (1..=24).contains(&n) {
                KeyName::F(n)
            } else {
                return None;
            }
        }
        _ => return None,
    };
    Some(named)
}

impl fmt::Display for KeyChord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.ctrl {
            f.write_str("Ctrl-")?;
        }
        if self.alt {
            f.write_str("Alt-")?;
        }
        if self.shift {
            f.write_str("Shift-")?;
        }
        match self.key {
            KeyName::Char(' ') => f.write_str("Space"),
            KeyName::Char(c) if self.ctrl || self.alt => write!(f, "{}", c.to_ascii_uppercase()),
            KeyName::Char(c) => write!(f, "{c}"),
            KeyName::F(n) => write!(f, "F{n}"),
            KeyName::Enter => f.write_str("Enter"),
            KeyName::Esc => f.write_str("Esc"),
            KeyName::Tab => f.write_str("Tab"),
            KeyName::Backspace => f.write_str("Backspace"),
            KeyName::Delete => f.write_str("Delete"),
            KeyName::Insert => f.write_str("Insert"),
            KeyName::Home => f.write_str("Home"),
            KeyName::End => f.write_str("End"),
            KeyName::PageUp => f.write_str("PgUp"),
            KeyName::PageDown => f.write_str("PgDn"),
            KeyName::Up => f.write_str("Up"),
            KeyName::Down => f.write_str("Down"),
            KeyName::Left => f.write_str("Left"),
            KeyName::Right => f.write_str("Right"),
        }
    }
}

/// A bindable command of the terminal client (the `[keys]` table names them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Cmd {
    /// Open or close the help popup.
    Help,
    /// Leave (asks first when the session has unsaved turns).
    Quit,
    /// Stop the reply being generated; close a popup.
    Stop,
    /// Copy the last reply to the clipboard (OSC 52).
    Copy,
    /// Switch between chat and raw mode.
    Mode,
    /// Show or hide the thinking channel.
    Thinking,
    /// Open the session dialog.
    Sessions,
    /// Lower the memory budget one step.
    BudgetDown,
    /// Raise the memory budget one step.
    BudgetUp,
    /// Insert a new line in the input box.
    Newline,
    /// Jump to the newest text and follow it.
    Follow,
    /// Move the keyboard focus between the input box and the budget slider.
    Focus,
    /// Start a new conversation (asks first when the current one has unsaved turns).
    New,
    /// Answer now: close the reply's thinking channel at the next token.
    AnswerNow,
    /// Thinking effort: off → low → high → max → off for the next replies.
    Effort,
    /// Select mode: move over messages and code blocks, `y` copies one.
    Select,
    /// Hide or show the live panes (the conversation takes their room).
    Panes,
}

impl Cmd {
    /// Every command with its `[keys]` name, in help order.
    pub const ALL: [(&'static str, Cmd); 17] = [
        ("help", Cmd::Help),
        ("quit", Cmd::Quit),
        ("stop", Cmd::Stop),
        ("copy", Cmd::Copy),
        ("mode", Cmd::Mode),
        ("thinking", Cmd::Thinking),
        ("sessions", Cmd::Sessions),
        ("budget_down", Cmd::BudgetDown),
        ("budget_up", Cmd::BudgetUp),
        ("newline", Cmd::Newline),
        ("follow", Cmd::Follow),
        ("focus", Cmd::Focus),
        ("new", Cmd::New),
        ("answer_now", Cmd::AnswerNow),
        ("effort", Cmd::Effort),
        ("select", Cmd::Select),
        ("panes", Cmd::Panes),
    ];

    /// What the command does, for the help popup.
    #[must_use]
    pub fn describe(self) -> &'static str {
        match self {
            Cmd::Help => "this help",
            Cmd::Quit => "quit (asks when the session is unsaved)",
            Cmd::Stop => "stop the reply (keeps the session); close a popup",
            Cmd::Copy => "copy the last reply (OSC 52 clipboard)",
            Cmd::Mode => "switch chat / raw mode",
            Cmd::Thinking => "show / hide the thinking channel",
            Cmd::Sessions => "sessions: save, load, new",
            Cmd::BudgetDown => "memory budget down (when the input is empty)",
            Cmd::BudgetUp => "memory budget up (when the input is empty)",
            Cmd::Newline => "new line in the input (Ctrl-J too)",
            Cmd::Follow => "jump to the newest text",
            Cmd::Focus => "focus the budget slider / the input",
            Cmd::New => "new conversation (asks when unsaved)",
            Cmd::AnswerNow => "answer now: end the thinking, the model answers",
            Cmd::Effort => "thinking effort: off, low, high, max (next reply)",
            Cmd::Select => "select a message or code block; y copies it",
            Cmd::Panes => "hide / show the live panes (more room to read)",
        }
    }
}

/// Key bindings (the `[keys]` table); each value is a chord such as `"ctrl-y"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KeysConfig {
    /// Open or close the help popup.
    pub help: String,
    /// Leave.
    pub quit: String,
    /// Stop the reply; close a popup.
    pub stop: String,
    /// Copy the last reply.
    pub copy: String,
    /// Chat / raw mode.
    pub mode: String,
    /// Show / hide thinking.
    pub thinking: String,
    /// Session dialog.
    pub sessions: String,
    /// Budget one step down.
    pub budget_down: String,
    /// Budget one step up.
    pub budget_up: String,
    /// New line in the input box.
    pub newline: String,
    /// Jump to the newest text.
    pub follow: String,
    /// Move focus between input and budget slider.
    pub focus: String,
    /// New conversation.
    pub new: String,
    /// Answer now (close the thinking channel).
    pub answer_now: String,
    /// Cycle the thinking effort.
    pub effort: String,
    /// Select mode (copy any message or code block).
    pub select: String,
    /// Hide or show the live panes.
    pub panes: String,
}

impl Default for KeysConfig {
    fn default() -> Self {
        KeysConfig {
            help: "f1".into(),
            quit: "ctrl-q".into(),
            stop: "esc".into(),
            copy: "ctrl-y".into(),
            mode: "ctrl-r".into(),
            thinking: "ctrl-t".into(),
            sessions: "ctrl-s".into(),
            budget_down: "[".into(),
            budget_up: "]".into(),
            newline: "alt-enter".into(),
            follow: "ctrl-l".into(),
            focus: "tab".into(),
            new: "ctrl-n".into(),
            answer_now: "ctrl-g".into(),
            effort: "f2".into(),
            select: "ctrl-o".into(),
            panes: "f3".into(),
        }
    }
}

impl KeysConfig {
    fn get(&self, cmd: Cmd) -> &str {
        match cmd {
            Cmd::Help => &self.help,
            Cmd::Quit => &self.quit,
            Cmd::Stop => &self.stop,
            Cmd::Copy => &self.copy,
            Cmd::Mode => &self.mode,
            Cmd::Thinking => &self.thinking,
            Cmd::Sessions => &self.sessions,
            Cmd::BudgetDown => &self.budget_down,
            Cmd::BudgetUp => &self.budget_up,
            Cmd::Newline => &self.newline,
            Cmd::Follow => &self.follow,
            Cmd::Focus => &self.focus,
            Cmd::New => &self.new,
            Cmd::AnswerNow => &self.answer_now,
            Cmd::Effort => &self.effort,
            Cmd::Select => &self.select,
            Cmd::Panes => &self.panes,
        }
    }

    /// Where in `text` another binding with the same chord as `field` (`keys.NAME`) is written.
    fn clash_in_file(&self, text: &str, field: &str) -> Option<(usize, usize)> {
        let chord_of = |cmd: Cmd| KeyChord::parse(self.get(cmd)).ok();
        let name = field.strip_prefix("keys.")?;
        let (_, cmd) = Cmd::ALL.iter().find(|(n, _)| *n == name)?;
        let want = chord_of(*cmd)?;
        Cmd::ALL
            .iter()
            .filter(|(n, c)| *n != name && chord_of(*c) == Some(want))
            .find_map(|(n, _)| value_position(text, &format!("keys.{n}")))
    }

    /// Every binding, parsed; the error names the `[keys]` entry.
    pub fn bindings(&self) -> Result<Vec<(Cmd, KeyChord)>, (String, String)> {
        let mut out: Vec<(Cmd, KeyChord)> = Vec::with_capacity(Cmd::ALL.len());
        for (name, cmd) in Cmd::ALL {
            let chord = KeyChord::parse(self.get(cmd)).map_err(|e| (format!("keys.{name}"), e))?;
            if let Some((other, _)) = out.iter().find(|(_, c)| *c == chord) {
                let other_name = Cmd::ALL
                    .iter()
                    .find(|(_, c)| c == other)
                    .map_or("?", |(n, _)| n);
                return Err((
                    format!("keys.{name}"),
                    format!("{chord} is already bound to {other_name}"),
                ));
            }
            out.push((cmd, chord));
        }
        Ok(out)
    }
}

/// The whole user configuration.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Checkpoint directory used when `k3 chat` is given none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_dir: Option<PathBuf>,
    /// Colour scheme.
    pub theme: ThemeName,
    /// Sampling defaults: each key given here overrides the model's `generation_config.json`.
    pub sampling: crate::session::defaults::SamplingLayer,
    /// Thinking defaults.
    pub thinking: ThinkingConfig,
    /// Memory defaults.
    pub memory: MemoryConfig,
    /// Key bindings.
    pub keys: KeysConfig,
    /// Speed knobs (docs/tuning.md): the same as the `K3_*` variables, which override them.
    #[serde(skip_serializing_if = "TuningConfig::is_empty")]
    pub tuning: TuningConfig,
}

/// The `[tuning]` table: each key is a `K3_*` speed variable's name without the prefix, in
/// lower case (docs/tuning.md). Checked like the variables: a value a knob does not take is
/// refused with its line.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TuningConfig {
    /// `K3_KERNELS`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernels: Option<String>,
    /// `K3_ROW_ORDER`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub row_order: Option<String>,
    /// `K3_IO_THREADS`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub io_threads: Option<i64>,
    /// `K3_NO_DIRECT`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub no_direct: Option<bool>,
    /// `K3_MMAP`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mmap: Option<bool>,
    /// `K3_PREFETCH`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefetch: Option<i64>,
    /// `K3_PREFETCH_DEPTH`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefetch_depth: Option<i64>,
    /// `K3_PREFETCH_LATE_DEPTH`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefetch_late_depth: Option<i64>,
    /// `K3_PREFETCH_EARLY`: `"on"`, `"off"` or `"auto"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefetch_early: Option<String>,
    /// `K3_CACHE_POLICY`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_policy: Option<String>,
    /// `K3_NOSPEC`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub no_spec: Option<bool>,
    /// `K3_TRUNK_SEGMENT_KB`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trunk_segment_kb: Option<i64>,
    /// `K3_KEEP_WARM`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keep_warm: Option<bool>,
}

impl TuningConfig {
    fn is_empty(&self) -> bool {
        *self == TuningConfig::default()
    }

    /// The key of the table that sets variable `var` (`K3_IO_THREADS` → `io_threads`).
    #[must_use]
    pub fn key_of(var: &str) -> String {
        match var {
            "K3_NOSPEC" => "no_spec".into(),
            v => v.trim_start_matches("K3_").to_ascii_lowercase(),
        }
    }

    /// What the table sets variable `var` to, spelled as the variable would be.
    #[must_use]
    pub fn value(&self, var: &str) -> Option<String> {
        let flag = |b: &Option<bool>| b.map(|b| if b { "1" } else { "0" }.to_string());
        let num = |n: &Option<i64>| n.map(|n| n.to_string());
        match var {
            "K3_KERNELS" => self.kernels.clone(),
            "K3_ROW_ORDER" => self.row_order.clone(),
            "K3_IO_THREADS" => num(&self.io_threads),
            "K3_NO_DIRECT" => flag(&self.no_direct),
            "K3_MMAP" => flag(&self.mmap),
            "K3_PREFETCH" => num(&self.prefetch),
            "K3_PREFETCH_DEPTH" => num(&self.prefetch_depth),
            "K3_PREFETCH_LATE_DEPTH" => num(&self.prefetch_late_depth),
            "K3_PREFETCH_EARLY" => self.prefetch_early.clone(),
            "K3_CACHE_POLICY" => self.cache_policy.clone(),
            "K3_NOSPEC" => flag(&self.no_spec),
            "K3_TRUNK_SEGMENT_KB" => num(&self.trunk_segment_kb),
            "K3_KEEP_WARM" => flag(&self.keep_warm),
            _ => None,
        }
    }
}

/// The file `k3 config init` writes: every key with its default, commented.
pub const DEFAULT_TOML: &str = r#"# k3 configuration. Command-line flags override these values; unknown keys are refused.

# Checkpoint directory used when `k3 chat` is given none.
# model_dir = "/models/Kimi-K3"

# Colours of the terminal client: "dark", "light" or "mono".
theme = "dark"

# Sampling: a key set here overrides the model directory's generation_config.json; a key left
# unset takes the model's value, else the built-in default shown.
[sampling]
# temperature = 1.0    # 0 is greedy
# top_k = 0            # 0 = off
# top_p = 1.0          # in (0, 1]
# min_p = 0.0          # in [0, 1]
# repeat_penalty = 1.0 # 1 = off
# seed = 1
# max_tokens = 512     # longest reply
# raw_max_tokens = 200 # longest raw-mode continuation (it also stops at an end-of-text token)
# context = 32768      # most positions a session may hold

[thinking]
enabled = true
effort = "max"         # low, high or max

[tuning]
# Speed knobs (docs/tuning.md); they never change what is computed. The K3_* variable of the
# same name (K3_IO_THREADS for io_threads) and `--tune NAME=VALUE` override a key set here.
# kernels = "auto"            # generic, avx2, avx512 or auto
# io_threads = 8
# prefetch = 16
# cache_policy = "cycle-queue"

[memory]
# Memory budget in GB the full-screen client applies once the model is open, as /budget
# does; unset, the model runs under 80% of the memory available when k3 starts.
# budget_gb = 24.0

# Key bindings: "ctrl-x", "alt-x", "shift-enter", "f1", "esc", "tab", "pageup", or a character.
# A bare character (like "[") acts only while the input box is empty; otherwise it is typed.
[keys]
help = "f1"            # `?` also opens help while the input box is empty
quit = "ctrl-q"
stop = "esc"
copy = "ctrl-y"
mode = "ctrl-r"
thinking = "ctrl-t"
sessions = "ctrl-s"
budget_down = "["
budget_up = "]"
newline = "alt-enter"  # shift-enter also works where the terminal reports it
follow = "ctrl-l"
focus = "tab"
new = "ctrl-n"
answer_now = "ctrl-g"  # end the thinking channel now: the model answers
effort = "f2"          # thinking off → low → high → max for the next replies
select = "ctrl-o"      # select mode: Up/Down or j/k move, y copies, Esc leaves
"#;

/// 1-based line and column (in characters) of byte `offset` in `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let mut line = 1;
    let mut col = 1;
    for (i, c) in text.char_indices() {
        if i >= offset {
            break;
        }
        if c == '\n' {
            line += 1;
            col = 1;
        } else {
            col += 1;
        }
    }
    (line, col)
}

/// 1-based line and column of the value of the dotted key `field` in `text`, if it is there.
fn value_position(text: &str, field: &str) -> Option<(usize, usize)> {
    use toml::de::{DeTable, DeValue};
    let doc = DeTable::parse(text).ok()?;
    let mut table = doc.get_ref();
    let parts: Vec<&str> = field.split('.').collect();
    for (i, part) in parts.iter().enumerate() {
        let (_, value) = table.iter().find(|(k, _)| k.get_ref().as_ref() == *part)?;
        if i + 1 == parts.len() {
            return Some(line_column(text, value.span().start));
        }
        match value.get_ref() {
            DeValue::Table(t) => table = t,
            _ => return None,
        }
    }
    None
}

impl Config {
    /// Parse and check a config file's text; `path` is only used in messages.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigFileError> {
        let cfg: Config = toml::from_str(text).map_err(|e| {
            let (line, column) = line_column(text, e.span().map_or(0, |s| s.start));
            ConfigFileError::Parse {
                path: path.to_path_buf(),
                line,
                column,
                message: e.message().trim().to_string(),
            }
        })?;
        cfg.validate(path, text)?;
        Ok(cfg)
    }

    fn validate(&self, path: &Path, text: &str) -> Result<(), ConfigFileError> {
        let bad = |field: &str, message: String| ConfigFileError::Invalid {
            path: path.to_path_buf(),
            at: value_position(text, field),
            field: field.into(),
            message,
        };
        if let Err(e) = crate::tuning::Tuning::from_lookup(|var| self.tuning.value(var)) {
            let field = format!("tuning.{}", TuningConfig::key_of(e.var));
            return Err(bad(
                &field,
                format!("{:?} is not valid: expected {}", e.value, e.expected),
            ));
        }
        let s = &self.sampling;
        let checks: [(&str, bool, &str); 8] = [
            (
                "sampling.temperature",
                s.temperature.is_none_or(|t| t >= 0.0 && t.is_finite()),
                "must be a finite number ≥ 0",
            ),
            (
                "sampling.top_p",
                s.top_p.is_none_or(|p| p > 0.0 && p <= 1.0),
                "must be in (0, 1]",
            ),
            (
                "sampling.min_p",
                s.min_p.is_none_or(|p| (0.0..=1.0).contains(&p)),
                "must be in [0, 1]",
            ),
            (
                "sampling.repeat_penalty",
                s.repeat_penalty.is_none_or(|r| r > 0.0 && r.is_finite()),
                "must be a finite number > 0",
            ),
            (
                "sampling.max_tokens",
                s.max_tokens.is_none_or(|n| n >= 1),
                "must be ≥ 1",
            ),
            (
                "sampling.raw_max_tokens",
                s.raw_max_tokens.is_none_or(|n| n >= 1),
                "must be ≥ 1",
            ),
            (
                "sampling.context",
                s.context
                    .is_none_or(|n| (2..=crate::session::chat::MAX_CONTEXT).contains(&n)),
                "must be in 2..=1048576",
            ),
            (
                "thinking.effort",
                matches!(self.thinking.effort.as_str(), "low" | "high" | "max"),
                "must be low, high or max",
            ),
        ];
        for (field, ok, why) in checks {
            if !ok {
                return Err(bad(field, why.into()));
            }
        }
        if let Some(gb) = self.memory.budget_gb {
            if !(gb.is_finite() && gb > 0.0) {
                return Err(bad("memory.budget_gb", "must be a positive number".into()));
            }
        }
        self.keys.bindings().map_err(|(field, message)| {
            let mut e = bad(&field, message);
            if let ConfigFileError::Invalid { at: at @ None, .. } = &mut e {
                // The key refused keeps its default: point at the binding in the file it
                // collides with.
                *at = self.keys.clash_in_file(text, &field);
            }
            e
        })?;
        Ok(())
    }

    /// The config file path: `$K3_CONFIG` when set and non-empty, else `config.toml` in the
    /// platform config directory (`~/.config/k3/config.toml` on Linux).
    pub fn path() -> Result<PathBuf, ConfigFileError> {
        if let Some(p) = std::env::var_os(CONFIG_ENV).filter(|p| !p.is_empty()) {
            return Ok(PathBuf::from(p));
        }
        directories::ProjectDirs::from("", "", "k3")
            .map(|d| d.config_dir().join("config.toml"))
            .ok_or(ConfigFileError::NoConfigDir)
    }

    /// Read `path` (at most [`MAX_CONFIG_TOML_BYTES`]); a missing file gives the defaults.
    pub fn load_from(path: &Path) -> Result<Config, ConfigFileError> {
        let bytes = match crate::stream::read_capped(path, MAX_CONFIG_TOML_BYTES) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Config::default()),
            Err(source) => {
                return Err(ConfigFileError::Read {
                    path: path.to_path_buf(),
                    source,
                })
            }
        };
        match String::from_utf8(bytes) {
            Ok(text) => Config::parse(&text, path),
            Err(e) => {
                // Where the bad byte is, counted over the valid text before it.
                let at = e.utf8_error().valid_up_to();
                let bytes = e.as_bytes();
                let valid = String::from_utf8_lossy(&bytes[..at]);
                let (line, column) = line_column(&valid, valid.len());
                Err(ConfigFileError::Parse {
                    path: path.to_path_buf(),
                    line,
                    column,
                    message: format!("not UTF-8 (byte 0x{:02x})", bytes[at]),
                })
            }
        }
    }

    /// The user's config file (defaults when there is none): read once per process, at
    /// start ([`Config::keep`]), and the same values every time after.
    pub fn load() -> Result<Config, ConfigFileError> {
        if let Some(kept) = KEPT.get() {
            return Ok(kept.clone());
        }
        match Config::path() {
            Ok(p) => Config::load_from(&p),
            Err(ConfigFileError::NoConfigDir) => Ok(Config::default()),
            Err(e) => Err(e),
        }
    }

    /// Keep `self` (the file as read at start) as what [`Config::load`] answers from now on.
    pub fn keep(&self) {
        let _ = KEPT.set(self.clone());
    }

    /// The effective configuration as TOML.
    #[must_use]
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot show the configuration: {e}\n"))
    }
}

/// The config file as read at start, kept for the commands that read it later.
static KEPT: std::sync::OnceLock<Config> = std::sync::OnceLock::new();

/// Arguments of `k3 config`.
#[derive(Debug, Args)]
pub struct ConfigArgs {
    /// What to do.
    #[command(subcommand)]
    pub action: ConfigAction,
}

/// `k3 config` subcommands.
#[derive(Debug, Subcommand)]
pub enum ConfigAction {
    /// Print the config file's path.
    Path,
    /// Print the effective configuration (the file merged over the defaults) as TOML.
    Show,
    /// Write a commented default config file.
    Init {
        /// Overwrite an existing file.
        #[arg(long)]
        force: bool,
    },
}

/// Run `k3 config`; returns the exit status.
pub fn run(args: &ConfigArgs) -> crate::Result<i32> {
    let usage = |e: ConfigFileError| crate::Error::Usage(e.to_string());
    match &args.action {
        ConfigAction::Path => {
            println!("{}", Config::path().map_err(usage)?.display());
        }
        ConfigAction::Show => {
            let cfg = Config::load().map_err(usage)?;
            print!("{}", cfg.to_toml());
        }
        ConfigAction::Init { force } => {
            let path = Config::path().map_err(usage)?;
            if path.exists() && !force {
                return Err(usage(ConfigFileError::Exists { path }));
            }
            let write_err = |source| crate::Error::Write {
                path: path.display().to_string(),
                source,
            };
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir).map_err(write_err)?;
            }
            std::fs::write(&path, DEFAULT_TOML).map_err(write_err)?;
            println!("wrote {}", path.display());
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigFileError> {
        Config::parse(text, Path::new("config.toml"))
    }

    #[test]
    fn the_default_file_is_the_defaults() {
        assert_eq!(parse(DEFAULT_TOML).unwrap(), Config::default());
        assert_eq!(parse("").unwrap(), Config::default());
    }

    #[test]
    fn show_round_trips() {
        let mut cfg = Config {
            model_dir: Some(PathBuf::from("/m")),
            ..Config::default()
        };
        cfg.memory.budget_gb = Some(12.5);
        cfg.keys.copy = "ctrl-k".into();
        assert_eq!(parse(&cfg.to_toml()).unwrap(), cfg);
    }

    #[test]
    fn values_override_defaults() {
        let cfg = parse(
            "model_dir = \"/x\"\ntheme = \"mono\"\n[sampling]\ntemperature = 0.0\n\
             [thinking]\nenabled = false\n[keys]\ncopy = \"alt-c\"\n",
        )
        .unwrap();
        assert_eq!(cfg.model_dir, Some(PathBuf::from("/x")));
        assert_eq!(cfg.theme, ThemeName::Mono);
        assert_eq!(cfg.sampling.temperature, Some(0.0));
        // A key not in the file is left to the model's generation_config.json or the built-in.
        assert_eq!(cfg.sampling.top_p, None);
        assert!(!cfg.thinking.enabled);
        let b = cfg.keys.bindings().unwrap();
        let copy = b.iter().find(|(c, _)| *c == Cmd::Copy).unwrap().1;
        assert_eq!(
            copy,
            KeyChord {
                key: KeyName::Char('c'),
                ctrl: false,
                alt: true,
                shift: false
            }
        );
    }

    #[test]
    fn unknown_keys_are_refused_with_line_and_column() {
        let text = "theme = \"dark\"\n[sampling]\n  temprature = 0.5\n";
        match parse(text) {
            Err(ConfigFileError::Parse {
                line,
                column,
                message,
                ..
            }) => {
                assert_eq!((line, column), (3, 3), "{message}");
                assert!(message.contains("temprature"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        match parse("colour = 1\n") {
            Err(ConfigFileError::Parse { line: 1, .. }) => {}
            other => panic!("{other:?}"),
        }
        let shown = parse("[keys]\nhelp = 3\n").unwrap_err().to_string();
        assert!(shown.starts_with("config.toml:2:"), "{shown}");
    }

    #[test]
    fn syntax_errors_name_the_place() {
        match parse("theme = \n") {
            Err(ConfigFileError::Parse { line: 1, .. }) => {}
            other => panic!("{other:?}"),
        }
        match parse("theme = \"blue\"\n") {
            Err(ConfigFileError::Parse {
                line: 1, column, ..
            }) => assert_eq!(column, 9),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn out_of_range_values_are_refused() {
        for (text, field) in [
            ("[sampling]\ntop_p = 0.0\n", "sampling.top_p"),
            ("[sampling]\ntemperature = -1.0\n", "sampling.temperature"),
            ("[sampling]\nmax_tokens = 0\n", "sampling.max_tokens"),
            ("[thinking]\neffort = \"medium\"\n", "thinking.effort"),
            ("[memory]\nbudget_gb = -2.0\n", "memory.budget_gb"),
            ("[keys]\ncopy = \"ctrl-q\"\n", "keys.copy"),
            ("[keys]\ncopy = \"hyper-x\"\n", "keys.copy"),
        ] {
            match parse(text) {
                Err(ConfigFileError::Invalid { field: f, .. }) => assert_eq!(f, field, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    #[test]
    fn chords_parse_and_print() {
        for (text, shown) in [
            ("ctrl-y", "Ctrl-Y"),
            ("Ctrl+Y", "Ctrl-Y"),
            ("alt-enter", "Alt-Enter"),
            ("shift-enter", "Shift-Enter"),
            ("f1", "F1"),
            ("[", "["),
            ("?", "?"),
            ("-", "-"),
            ("ctrl--", "Ctrl--"),
            ("pageup", "PgUp"),
            ("space", "Space"),
        ] {
            assert_eq!(KeyChord::parse(text).unwrap().to_string(), shown, "{text}");
        }
        for bad in ["", "ctrl-", "f99", "super-x", "shift-a", "enterr"] {
            assert!(KeyChord::parse(bad).is_err(), "{bad}");
        }
        assert!(KeyChord::parse("[").unwrap().is_printable());
        assert!(!KeyChord::parse("ctrl-y").unwrap().is_printable());
    }

    #[test]
    fn missing_file_gives_defaults_and_bad_file_names_itself() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.toml");
        assert_eq!(Config::load_from(&p).unwrap(), Config::default());
        std::fs::write(&p, "bogus = true\n").unwrap();
        let e = Config::load_from(&p).unwrap_err().to_string();
        assert!(e.contains("config.toml:1:1"), "{e}");
        std::fs::create_dir_all(dir.path().join("d")).unwrap();
        assert!(matches!(
            Config::load_from(&dir.path().join("d")),
            Err(ConfigFileError::Read { .. })
        ));
    }
}
