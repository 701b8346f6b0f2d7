//! Default session names: the first words of the conversation, slugged, and the date, such as
//! `hello-k3-what-is-a-2026-12-01`, so a list of sessions reads like a list of conversations.
//! Never performs IO; the store adds a numeric suffix (`-2`, `-3`, …) when a name is taken.

/// Longest session name, in bytes.
pub const MAX_NAME_LEN: usize = 64;

/// A session name that cannot be used as a file name inside the store.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// The name is empty.
    #[error("session name is empty")]
    Empty,
    /// The name is longer than [`MAX_NAME_LEN`] bytes.
    #[error("session name {name:?}… is {len} bytes; at most {MAX_NAME_LEN} are allowed")]
    TooLong {
        /// The first characters of the name.
        name: String,
        /// Its length in bytes.
        len: usize,
    },
    /// A character outside `A-Z a-z 0-9 . _ -`.
    #[error("session name {name:?}: {ch:?} at byte {at} is not allowed (use A-Z a-z 0-9 . _ -)")]
    BadChar {
        /// The name.
        name: String,
        /// The character.
        ch: char,
        /// Its byte offset.
        at: usize,
    },
    /// The name starts with a dot (reserved for temporary and lock files).
    #[error("session name {name:?} starts with '.'")]
    LeadingDot {
        /// The name.
        name: String,
    },
    /// The name contains `..`.
    #[error("session name {name:?} contains \"..\"")]
    DotDot {
        /// The name.
        name: String,
    },
}

/// Checks `name` against `[A-Za-z0-9._-]{1,64}`, not starting with `.`, without `..`.
pub fn validate_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > MAX_NAME_LEN {
        return Err(NameError::TooLong {
            name: name.chars().take(MAX_NAME_LEN).collect(),
            len: name.len(),
        });
    }
    if let Some((at, ch)) = name
        .char_indices()
        .find(|&(_, c)| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(NameError::BadChar {
            name: name.to_string(),
            ch,
            at,
        });
    }
    if name.starts_with('.') {
        return Err(NameError::LeadingDot {
            name: name.to_string(),
        });
    }
    if name.contains("..") {
        return Err(NameError::DotDot {
            name: name.to_string(),
        });
    }
    Ok(())
}

/// Most words taken from the first message.
const MAX_WORDS: usize = 5;
/// Most bytes of the slugged words (the date and a suffix are added to it).
const MAX_SLUG: usize = 32;
/// Highest numeric suffix tried before giving up.
pub const MAX_SUFFIX: u32 = 999;

/// The first words of `first_text` in lower case ASCII, joined by `-`: letters and digits are
/// kept, other ASCII characters separate words, and other characters are dropped. Empty when
/// no ASCII letter or digit is left.
#[must_use]
pub fn slug(first_text: &str) -> String {
    let mut out = String::new();
    let mut words = 0;
    for word in first_text.split(|c: char| c.is_ascii() && !c.is_ascii_alphanumeric()) {
        let word: String = word
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .map(|c| c.to_ascii_lowercase())
            .collect();
        if word.is_empty() {
            continue;
        }
        let sep = usize::from(!out.is_empty());
        if out.len() + sep + word.len() > MAX_SLUG {
            if out.is_empty() {
                out.push_str(word.get(..MAX_SLUG).unwrap_or(&word));
            }
            break;
        }
        if sep == 1 {
            out.push('-');
        }
        out.push_str(&word);
        words += 1;
        if words == MAX_WORDS {
            break;
        }
    }
    out
}

/// A Unix time in seconds as a local date and time (`2026-12-01 14:05`), in the time zone of
/// the `TZ` variable or the system's (`/etc/localtime`); UTC where neither is known.
#[must_use]
pub fn local_time(unix: u64) -> String {
    let Some(t) = i64::try_from(unix)
        .ok()
        .and_then(|s| chrono::DateTime::from_timestamp(s, 0))
    else {
        return "?".to_string();
    };
    t.with_timezone(&chrono::Local)
        .format("%Y-%m-%d %H:%M")
        .to_string()
}

/// The civil date (year, month, day, UTC) of a Unix time in seconds.
#[must_use]
pub fn civil_date(unix: u64) -> (i64, u32, u32) {
    // Howard Hinnant's `civil_from_days`, http://howardhinnant.github.io/date_algorithms.html
    let z = i64::try_from(unix / 86_400).unwrap_or(0) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (
        year,
        u32::try_from(month).unwrap_or(1),
        u32::try_from(day).unwrap_or(1),
    )
}

/// The default name of a conversation that starts with `first_text`, saved at `unix`: its slug
/// (or `session` when it has none) and the date, e.g. `hello-k3-2026-12-01`.
#[must_use]
pub fn default_name(first_text: &str, unix: u64) -> String {
    let (y, m, d) = civil_date(unix);
    let slug = slug(first_text);
    let head = if slug.is_empty() { "session" } else { &slug };
    format!("{head}-{y:04}-{m:02}-{d:02}")
}

/// `base` with the `k`-th suffix: `base` itself for 1, then `base-2`, `base-3`, ….
#[must_use]
pub fn with_suffix(base: &str, k: u32) -> String {
    if k <= 1 {
        base.to_string()
    } else {
        format!("{base}-{k}")
    }
}

const _: () = assert!(MAX_SLUG + "-2026-12-01".len() + "-999".len() <= MAX_NAME_LEN);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_times_are_minutes_in_the_local_zone() {
        let at = 1_796_083_200; // 2026-12-01 00:00 UTC
        let local = local_time(at);
        assert_eq!(local.len(), "2026-12-01 00:00".len(), "{local}");
        // Every zone is within a day of UTC.
        assert!(
            local.starts_with("2026-11-30") || local.starts_with("2026-12-01"),
            "{local}"
        );
        assert_eq!(local_time(u64::MAX), "?");
    }

    #[test]
    fn dates_are_civil_dates_in_utc() {
        assert_eq!(civil_date(0), (1970, 1, 1));
        assert_eq!(civil_date(951_782_400), (2000, 2, 29));
        assert_eq!(civil_date(1_764_547_200 + 86_399), (2025, 12, 1));
        assert_eq!(civil_date(4_102_444_799), (2099, 12, 31));
    }

    #[test]
    fn names_are_the_first_words_and_the_date() {
        let t = 1_764_547_200;
        assert_eq!(default_name("Hello K3!", t), "hello-k3-2025-12-01");
        assert_eq!(
            default_name("  What's the capital of France, please?", t),
            "what-s-the-capital-of-2025-12-01"
        );
        assert_eq!(default_name("Grüße aus Köln", t), "gre-aus-kln-2025-12-01");
        assert_eq!(default_name("你好", t), "session-2025-12-01");
        assert_eq!(default_name("", t), "session-2025-12-01");
        assert_eq!(default_name("../../etc/passwd", t), "etc-passwd-2025-12-01");
        let long = "x".repeat(200);
        assert_eq!(
            default_name(&long, t),
            format!("{}-2025-12-01", "x".repeat(32))
        );
        assert_eq!(with_suffix("a", 1), "a");
        assert_eq!(with_suffix("a", 7), "a-7");
    }

    #[test]
    fn every_default_name_is_a_valid_session_name() {
        let t = u64::MAX;
        let long = "ab ".repeat(100);
        for text in [
            "",
            "a",
            "\u{1b}]0;x\u{7}",
            ". . ..",
            "a\nb\tc",
            long.as_str(),
        ] {
            let name = with_suffix(&default_name(text, t), MAX_SUFFIX);
            assert_eq!(validate_name(&name), Ok(()), "{text:?} → {name}");
        }
    }
}
