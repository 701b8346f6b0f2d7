//! Slash commands typed in either front end (TUI input box or plain REPL): one parser, so both
//! accept exactly the same words. Unknown commands and bad values come back as a one-line
//! explanation; nothing here exits the program.

use super::chat::Settings;

/// A `/set` target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setting {
    /// Sampling temperature (0 = greedy).
    Temperature,
    /// Nucleus threshold.
    TopP,
    /// Top-k (0 = off).
    TopK,
    /// Min-p (0 = off).
    MinP,
    /// Repetition penalty (1 = off).
    RepeatPenalty,
    /// Sampling seed (restarts the random stream).
    Seed,
    /// Reply length limit in tokens.
    MaxTokens,
    /// Raw-mode continuation length limit in tokens.
    RawMaxTokens,
    /// Raw mode runs past the end-of-text ids (1) or stops at them (0).
    RawIgnoreEnd,
}

impl Setting {
    /// Every setting with its command-line name.
    pub const ALL: [(&'static str, Setting); 9] = [
        ("temperature", Setting::Temperature),
        ("top_p", Setting::TopP),
        ("top_k", Setting::TopK),
        ("min_p", Setting::MinP),
        ("repeat_penalty", Setting::RepeatPenalty),
        ("seed", Setting::Seed),
        ("max_tokens", Setting::MaxTokens),
        ("raw_max_tokens", Setting::RawMaxTokens),
        ("raw_ignore_end", Setting::RawIgnoreEnd),
    ];

    /// The name used by `/set`.
    #[must_use]
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, s)| *s == self)
            .map_or("?", |(n, _)| n)
    }

    /// Set this to `v` (a value the parser accepted) in `s`; the line that says so.
    pub fn apply(self, v: f64, s: &mut Settings) -> String {
        match self {
            Setting::Temperature => s.sampler.temperature = v as f32,
            Setting::TopP => s.sampler.top_p = v as f32,
            Setting::TopK => s.sampler.top_k = v as usize,
            Setting::MinP => s.sampler.min_p = v as f32,
            Setting::RepeatPenalty => s.sampler.repeat_penalty = v as f32,
            Setting::Seed => s.sampler.seed = v as u64,
            Setting::MaxTokens => s.max_tokens = (v as usize).max(1),
            Setting::RawMaxTokens => s.raw_max_tokens = (v as usize).max(1),
            Setting::RawIgnoreEnd => s.raw_ignore_end = v != 0.0,
        }
        format!("{} = {v}", self.name())
    }
}

/// The thinking switch of `/think`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Think {
    /// Thinking on (keeps the current effort).
    On,
    /// Thinking off.
    Off,
    /// Thinking on with effort `low`.
    Low,
    /// Thinking on with effort `high`.
    High,
    /// Thinking on with effort `max`.
    Max,
}

impl Think {
    /// Switch thinking in `s` as `/think` asks (an effort turns it on); the line that says
    /// what it is now.
    pub fn apply(self, s: &mut Settings) -> String {
        match self {
            Think::On => s.thinking = true,
            Think::Off => s.thinking = false,
            Think::Low | Think::High | Think::Max => {
                s.thinking = true;
                s.effort = match self {
                    Think::Low => "low",
                    Think::High => "high",
                    _ => "max",
                }
                .into();
            }
        }
        if s.thinking {
            format!("thinking on, effort {}", s.effort)
        } else {
            "thinking off".into()
        }
    }
}

/// `/export` formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportFormat {
    /// Markdown transcript.
    Markdown,
    /// JSON transcript.
    Json,
}

/// A parsed slash command.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// Start a new conversation (clears history and state).
    New,
    /// Set (or with empty text, clear) the system message.
    System(String),
    /// Switch to raw continuation mode.
    Raw,
    /// Switch to chat mode.
    Chat,
    /// Thinking on/off or effort.
    Think(Think),
    /// Regenerate the last reply.
    Regen,
    /// Remove the last exchange.
    Undo,
    /// Replace the last user message and regenerate.
    Edit(String),
    /// Save the session (under its name, or a new one); refused over a different saved
    /// session of that name.
    Save(Option<String>),
    /// `/save!`: save, replacing a different saved session of that name.
    SaveOver(Option<String>),
    /// Load a saved session.
    Load(String),
    /// List saved sessions.
    Sessions,
    /// Write the transcript to a file.
    Export(ExportFormat, String),
    /// Change a setting.
    Set(Setting, f64),
    /// Change the memory budget (GB).
    Budget(f64),
    /// Show engine statistics.
    Stats,
    /// Show the command list.
    Help,
    /// Leave.
    Quit,
}

/// One line per command, for `/help`.
pub const HELP: &str = "\
/new                      start a new conversation
/system TEXT              set the system message (empty clears it)
/raw, /chat               switch to raw continuation or back to chat (state is kept)
/think on|off|low|high|max  thinking channel and effort
/regen                    regenerate the last reply
/undo                     remove the last exchange
/edit TEXT                replace your last message and regenerate
/save[!] [NAME]           save the session; /save! replaces another saved session
/load NAME                load a saved session
/sessions                 list saved sessions
/export md|json PATH      write the transcript to a file
/set temperature|top_p|top_k|min_p|repeat_penalty|seed|max_tokens V
/set raw_max_tokens N | raw_ignore_end 0|1   raw-mode limit; run past end-of-text
/budget GB                change the memory budget
/stats                    engine statistics
/help                     this list
/quit (/bye, /exit)       leave";

fn number(word: &str, what: &str) -> Result<f64, String> {
    word.parse::<f64>()
        .ok()
        .filter(|x| x.is_finite())
        .ok_or_else(|| format!("{what}: {word:?} is not a number"))
}

fn check_setting(s: Setting, v: f64) -> Result<(), String> {
    let ok = match s {
        Setting::Temperature => v >= 0.0,
        Setting::TopP => v > 0.0 && v <= 1.0,
        Setting::TopK | Setting::Seed => v >= 0.0 && v.fract() == 0.0,
        Setting::MinP => (0.0..=1.0).contains(&v),
        Setting::RepeatPenalty => v > 0.0,
        Setting::MaxTokens | Setting::RawMaxTokens => v >= 1.0 && v.fract() == 0.0 && v <= 1e9,
        Setting::RawIgnoreEnd => v == 0.0 || v == 1.0,
    };
    if ok {
        Ok(())
    } else {
        let range = match s {
            Setting::Temperature => "≥ 0",
            Setting::TopP => "in (0, 1]",
            Setting::TopK | Setting::Seed => "a whole number ≥ 0",
            Setting::MinP => "in [0, 1]",
            Setting::RepeatPenalty => "> 0",
            Setting::MaxTokens | Setting::RawMaxTokens => "a whole number ≥ 1",
            Setting::RawIgnoreEnd => "0 or 1",
        };
        Err(format!("/set {}: {v} must be {range}", s.name()))
    }
}

/// Parse one input line. `None` when the line is not a command (it does not start with `/`,
/// or starts with `//`, which sends a literal `/`); `Some(Err(text))` explains a bad command.
#[must_use]
pub fn parse(line: &str) -> Option<Result<Command, String>> {
    let line = line.trim();
    let rest = line.strip_prefix('/')?;
    if rest.starts_with('/') {
        return None;
    }
    let (word, arg) = match rest.split_once(char::is_whitespace) {
        Some((w, a)) => (w, a.trim()),
        None => (rest, ""),
    };
    let no_arg = |c: Command| {
        if arg.is_empty() {
            Ok(c)
        } else {
            Err(format!("/{word} takes no argument"))
        }
    };
    Some(match word {
        "new" => no_arg(Command::New),
        "system" => Ok(Command::System(arg.to_string())),
        "raw" => no_arg(Command::Raw),
        "chat" => no_arg(Command::Chat),
        "think" => match arg {
            "on" => Ok(Command::Think(Think::On)),
            "off" => Ok(Command::Think(Think::Off)),
            "low" => Ok(Command::Think(Think::Low)),
            "high" => Ok(Command::Think(Think::High)),
            "max" => Ok(Command::Think(Think::Max)),
            "medium" => Err("/think: `medium` is not accepted by K3; use low, high or max".into()),
            _ => Err("/think takes on, off, low, high or max".into()),
        },
        "regen" => no_arg(Command::Regen),
        "undo" => no_arg(Command::Undo),
        "edit" if arg.is_empty() => Err("/edit needs the new text of your last message".into()),
        "edit" => Ok(Command::Edit(arg.to_string())),
        "save" => Ok(Command::Save((!arg.is_empty()).then(|| arg.to_string()))),
        "save!" => Ok(Command::SaveOver(
            (!arg.is_empty()).then(|| arg.to_string()),
        )),
        "load" if arg.is_empty() => Err("/load needs a session name (see /sessions)".into()),
        "load" => Ok(Command::Load(arg.to_string())),
        "sessions" => no_arg(Command::Sessions),
        "export" => {
            let mut it = arg.splitn(2, char::is_whitespace);
            let fmt = match it.next().unwrap_or("") {
                "md" | "markdown" => Ok(ExportFormat::Markdown),
                "json" => Ok(ExportFormat::Json),
                other => Err(format!("/export: format {other:?} is not md or json")),
            };
            match (fmt, it.next().map(str::trim).filter(|p| !p.is_empty())) {
                (Ok(f), Some(p)) => Ok(Command::Export(f, p.to_string())),
                (Ok(_), None) => Err("/export needs a file path: /export md|json PATH".into()),
                (Err(e), _) => Err(e),
            }
        }
        "set" => {
            let mut it = arg.split_whitespace();
            match (it.next(), it.next(), it.next()) {
                (Some(k), Some(v), None) => match Setting::ALL.iter().find(|(n, _)| *n == k) {
                    None => Err(format!(
                        "/set: unknown setting {k:?}; one of temperature, top_p, top_k, min_p, \
                         repeat_penalty, seed, max_tokens, raw_max_tokens, raw_ignore_end"
                    )),
                    Some(&(_, s)) => number(v, &format!("/set {k}"))
                        .and_then(|x| check_setting(s, x).map(|()| Command::Set(s, x))),
                },
                _ => Err("/set takes a name and a value, e.g. /set temperature 0.7".into()),
            }
        }
        "budget" => number(arg, "/budget").and_then(|gb| {
            if gb > 0.0 {
                Ok(Command::Budget(gb))
            } else {
                Err("/budget: the budget must be a positive number of GB".into())
            }
        }),
        "stats" => no_arg(Command::Stats),
        "help" | "?" => no_arg(Command::Help),
        "quit" | "exit" | "bye" | "q" => no_arg(Command::Quit),
        other => Err(format!(
            "unknown command /{other}; /help lists the commands"
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_command_parses() {
        let ok: &[(&str, Command)] = &[
            ("/new", Command::New),
            ("/system Be brief.", Command::System("Be brief.".into())),
            ("/system", Command::System(String::new())),
            ("/raw", Command::Raw),
            ("/chat", Command::Chat),
            ("/think off", Command::Think(Think::Off)),
            ("/think max", Command::Think(Think::Max)),
            ("/regen", Command::Regen),
            ("/undo", Command::Undo),
            ("/edit hi there", Command::Edit("hi there".into())),
            ("/save", Command::Save(None)),
            ("/save s1", Command::Save(Some("s1".into()))),
            ("/save! s1", Command::SaveOver(Some("s1".into()))),
            ("/save!", Command::SaveOver(None)),
            ("/load s1", Command::Load("s1".into())),
            ("/sessions", Command::Sessions),
            (
                "/export md /tmp/x.md",
                Command::Export(ExportFormat::Markdown, "/tmp/x.md".into()),
            ),
            (
                "/export json out.json",
                Command::Export(ExportFormat::Json, "out.json".into()),
            ),
            (
                "/set temperature 0.7",
                Command::Set(Setting::Temperature, 0.7),
            ),
            ("/set max_tokens 64", Command::Set(Setting::MaxTokens, 64.0)),
            ("/budget 8", Command::Budget(8.0)),
            ("/stats", Command::Stats),
            ("/help", Command::Help),
            ("  /quit  ", Command::Quit),
            ("/bye", Command::Quit),
        ];
        for (line, want) in ok {
            assert_eq!(parse(line), Some(Ok(want.clone())), "{line}");
        }
    }

    #[test]
    fn bad_commands_explain_in_one_line() {
        for line in [
            "/frobnicate",
            "/think medium",
            "/think",
            "/set top_p 2",
            "/set temperature -1",
            "/set top_k 1.5",
            "/set colour red",
            "/set temperature",
            "/budget -3",
            "/budget lots",
            "/export pdf x",
            "/export md",
            "/load",
            "/new now",
            "/set max_tokens 0",
        ] {
            match parse(line) {
                Some(Err(msg)) => assert!(!msg.contains('\n') && !msg.is_empty(), "{line}: {msg}"),
                other => panic!("{line}: {other:?}"),
            }
        }
    }

    #[test]
    fn think_and_set_change_the_settings_and_say_so() {
        let mut s = Settings {
            thinking: false,
            effort: "max".into(),
            ..Settings::default()
        };
        // On keeps the effort; an effort turns thinking on; off keeps the effort for later.
        assert_eq!(Think::On.apply(&mut s), "thinking on, effort max");
        assert_eq!(Think::Low.apply(&mut s), "thinking on, effort low");
        assert_eq!(Think::Off.apply(&mut s), "thinking off");
        assert!(!s.thinking);
        assert_eq!(s.effort, "low");
        assert_eq!(Think::High.apply(&mut s), "thinking on, effort high");
        assert!(s.thinking);
        // Every setting the parser accepts lands in its own field.
        for (line, want) in [
            ("/set temperature 0.5", "temperature = 0.5"),
            ("/set top_p 0.25", "top_p = 0.25"),
            ("/set top_k 7", "top_k = 7"),
            ("/set min_p 0.125", "min_p = 0.125"),
            ("/set repeat_penalty 1.5", "repeat_penalty = 1.5"),
            ("/set seed 42", "seed = 42"),
            ("/set max_tokens 64", "max_tokens = 64"),
            ("/set raw_max_tokens 9", "raw_max_tokens = 9"),
            ("/set raw_ignore_end 1", "raw_ignore_end = 1"),
        ] {
            let Some(Ok(Command::Set(setting, v))) = parse(line) else {
                panic!("{line}");
            };
            assert_eq!(setting.apply(v, &mut s), want);
        }
        let want = Settings {
            sampler: crate::engine::sampling::SamplerConfig {
                temperature: 0.5,
                top_p: 0.25,
                top_k: 7,
                min_p: 0.125,
                repeat_penalty: 1.5,
                seed: 42,
            },
            max_tokens: 64,
            raw_max_tokens: 9,
            raw_ignore_end: true,
            ..s.clone()
        };
        assert_eq!(s, want);
    }

    #[test]
    fn plain_text_is_not_a_command() {
        assert_eq!(parse("hello"), None);
        assert_eq!(parse("//literal slash"), None);
        assert_eq!(parse(""), None);
    }
}
