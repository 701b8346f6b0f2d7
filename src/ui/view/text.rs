//! Text preparation for the screen: escaping of everything that did not come from this client
//! (model output, engine messages, pasted text), display widths and word wrapping.

use std::borrow::Cow;
use unicode_width::UnicodeWidthChar;

/// Spinner frames, advanced by timer ticks.
pub const SPINNER: [&str; 10] = ["⠋", "⠙", "⠹", "⠸", "⠼", "⠴", "⠦", "⠧", "⠇", "⠏"];

/// True for characters that must never reach the terminal as themselves: C0/C1 controls
/// (escape sequences start with them) and the bidirectional overrides and isolates.
fn must_escape(c: char) -> bool {
    (c.is_control() && c != '\n')
        || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}')
}

/// The text with every control character shown as a visible escape (`\u{1b}`), tabs as four
/// spaces and line breaks kept. Nothing returned can move the cursor or change the terminal.
#[must_use]
pub fn clean(text: &str) -> Cow<'_, str> {
    if !text.chars().any(must_escape) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c == '\t' {
            out.push_str("    ");
        } else if must_escape(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// One-line form of `text`: escaped, line breaks shown as `⏎`.
#[must_use]
pub fn one_line(text: &str) -> String {
    clean(text).replace('\n', "⏎")
}

/// Display width of a character (0 for combining marks, 2 for wide ones).
#[must_use]
pub fn char_width(c: char) -> usize {
    c.width().unwrap_or(0)
}

/// Display width of a string.
#[must_use]
pub fn str_width(s: &str) -> usize {
    s.chars().map(char_width).sum()
}

/// The longest prefix of `s` that fits in `width` columns.
#[must_use]
pub fn fit(s: &str, width: usize) -> &str {
    let mut w = 0;
    for (i, c) in s.char_indices() {
        w += char_width(c);
        if w > width {
            return &s[..i];
        }
    }
    s
}

/// Break one line (no `\n`, already escaped) into pieces of at most `width` columns, at spaces
/// where possible; a word longer than the line is cut by characters. Trailing spaces at a
/// break are dropped. `textwrap`, first fit, no hyphenation.
#[must_use]
pub fn wrap_line(line: &str, width: usize) -> Vec<String> {
    textwrap::wrap(line, wrap_options(width))
        .into_iter()
        .map(Cow::into_owned)
        .collect()
}

/// The wrapping rules of [`wrap_line`]: break only at ASCII spaces, never hyphenate, cut a word
/// longer than the line, fill each line before the next (first fit: a line's content does not
/// depend on what follows it, so streamed text never re-flows lines above).
fn wrap_options(width: usize) -> textwrap::Options<'static> {
    textwrap::Options::new(width.max(1))
        .break_words(true)
        .word_separator(textwrap::WordSeparator::AsciiSpace)
        .word_splitter(textwrap::WordSplitter::NoHyphenation)
        .wrap_algorithm(textwrap::WrapAlgorithm::FirstFit)
}

/// Break one line by characters only (code, input): pieces of at most `width` columns.
#[must_use]
pub fn hard_wrap(line: &str, width: usize) -> Vec<String> {
    let width = width.max(1);
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut cur_w = 0;
    for c in line.chars() {
        let cw = char_width(c);
        if cur_w + cw > width && !cur.is_empty() {
            out.push(std::mem::take(&mut cur));
            cur_w = 0;
        }
        cur.push(c);
        cur_w += cw;
    }
    out.push(cur);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_controls_and_bidi_but_keeps_newlines() {
        assert_eq!(clean("plain"), "plain");
        assert_eq!(clean("a\u{1b}[31mb\n"), "a\\u{1b}[31mb\n");
        assert_eq!(clean("\u{9b}x\u{7}"), "\\u{9b}x\\u{7}");
        assert_eq!(clean("\u{202e}abc"), "\\u{202e}abc");
        assert_eq!(clean("a\tb\r"), "a    b\\u{d}");
        assert_eq!(one_line("a\nb"), "a⏎b");
    }

    #[test]
    fn wraps_at_spaces_and_cuts_long_words() {
        assert_eq!(wrap_line("  indented line", 20), vec!["  indented line"]);
        assert_eq!(wrap_line("trailing   ", 20), vec!["trailing"]);
        // The spaces at a break are dropped, not carried to the start of the next line.
        assert_eq!(wrap_line("ab   cd", 3), vec!["ab", "cd"]);
        assert_eq!(
            wrap_line("a-hyphenated-word x", 8),
            vec!["a-hyphen", "ated-wor", "d x"]
        );
        assert_eq!(wrap_line("hello big world", 9), vec!["hello big", "world"]);
        assert_eq!(wrap_line("abcdefghij", 4), vec!["abcd", "efgh", "ij"]);
        assert_eq!(wrap_line("", 4), vec![""]);
        assert_eq!(wrap_line("日本語です", 4), vec!["日本", "語で", "す"]);
        assert_eq!(hard_wrap("abcdef", 4), vec!["abcd", "ef"]);
        assert_eq!(fit("日本語", 5), "日本");
        for w in 2..12 {
            for piece in wrap_line("a quick brown 狐 jumps over", w) {
                assert!(str_width(&piece) <= w, "{piece:?} at {w}");
            }
        }
    }
}
