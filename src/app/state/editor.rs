//! The input box's text: a multi-line buffer with a cursor, and the history of sent inputs.
//! Pure data; the view decides how it wraps.

/// Most bytes the input box holds; a longer paste is cut with a notice.
pub const MAX_INPUT_BYTES: usize = 256 * 1024;

/// A multi-line text buffer with a cursor (a byte offset on a character boundary).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Editor {
    text: String,
    cursor: usize,
}

impl Editor {
    /// The text.
    #[must_use]
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Cursor byte offset into [`Editor::text`].
    #[must_use]
    pub fn cursor(&self) -> usize {
        self.cursor
    }

    /// True when there is no text.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.text.is_empty()
    }

    /// Replace the text; the cursor goes to the end.
    pub fn set(&mut self, text: &str) {
        self.text.clear();
        self.cursor = 0;
        self.insert_str(text);
    }

    /// Take the text out, leaving the box empty.
    pub fn take(&mut self) -> String {
        self.cursor = 0;
        std::mem::take(&mut self.text)
    }

    /// Insert one character at the cursor; false when the box is full.
    pub fn insert_char(&mut self, c: char) -> bool {
        if self.text.len() + c.len_utf8() > MAX_INPUT_BYTES {
            return false;
        }
        self.text.insert(self.cursor, c);
        self.cursor += c.len_utf8();
        true
    }

    /// Insert text at the cursor (CR LF and lone CR become LF); returns the bytes dropped
    /// because the box is full.
    pub fn insert_str(&mut self, s: &str) -> usize {
        let norm = s.replace("\r\n", "\n").replace('\r', "\n");
        let room = MAX_INPUT_BYTES.saturating_sub(self.text.len());
        let mut take = norm.len().min(room);
        while !norm.is_char_boundary(take) {
            take -= 1;
        }
        self.text.insert_str(self.cursor, &norm[..take]);
        self.cursor += take;
        norm.len() - take
    }

    fn prev_boundary(&self, at: usize) -> usize {
        self.text[..at].char_indices().last().map_or(0, |(i, _)| i)
    }

    fn next_boundary(&self, at: usize) -> usize {
        self.text[at..]
            .chars()
            .next()
            .map_or(self.text.len(), |c| at + c.len_utf8())
    }

    /// Delete the character before the cursor.
    pub fn backspace(&mut self) {
        if self.cursor > 0 {
            let p = self.prev_boundary(self.cursor);
            self.text.replace_range(p..self.cursor, "");
            self.cursor = p;
        }
    }

    /// Delete the character under the cursor.
    pub fn delete(&mut self) {
        if self.cursor < self.text.len() {
            let n = self.next_boundary(self.cursor);
            self.text.replace_range(self.cursor..n, "");
        }
    }

    /// Move one character left.
    pub fn left(&mut self) {
        self.cursor = self.prev_boundary(self.cursor);
    }

    /// Move one character right.
    pub fn right(&mut self) {
        self.cursor = self.next_boundary(self.cursor);
    }

    fn line_start(&self, at: usize) -> usize {
        self.text[..at].rfind('\n').map_or(0, |i| i + 1)
    }

    fn line_end(&self, at: usize) -> usize {
        self.text[at..]
            .find('\n')
            .map_or(self.text.len(), |i| at + i)
    }

    /// Move to the start of the line.
    pub fn home(&mut self) {
        self.cursor = self.line_start(self.cursor);
    }

    /// Move to the end of the line.
    pub fn end(&mut self) {
        self.cursor = self.line_end(self.cursor);
    }

    /// Column of the cursor in characters within its line.
    fn column(&self) -> usize {
        self.text[self.line_start(self.cursor)..self.cursor]
            .chars()
            .count()
    }

    /// Byte offset `col` characters into the line starting at `start` (clamped to its end).
    fn at_column(&self, start: usize, col: usize) -> usize {
        let end = self.line_end(start);
        self.text[start..end]
            .char_indices()
            .nth(col)
            .map_or(end, |(i, _)| start + i)
    }

    /// Move up one line; false when already on the first line.
    pub fn up(&mut self) -> bool {
        let start = self.line_start(self.cursor);
        if start == 0 {
            return false;
        }
        let col = self.column();
        let prev_start = self.line_start(start - 1);
        self.cursor = self.at_column(prev_start, col);
        true
    }

    /// Move down one line; false when already on the last line.
    pub fn down(&mut self) -> bool {
        let end = self.line_end(self.cursor);
        if end >= self.text.len() {
            return false;
        }
        let col = self.column();
        self.cursor = self.at_column(end + 1, col);
        true
    }
}

/// Inputs already sent, browsed with Up and Down.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct History {
    entries: Vec<String>,
    /// Index being shown, or `None` when editing a fresh line.
    pos: Option<usize>,
    /// The unsent text put aside while browsing.
    draft: String,
}

/// Most inputs kept in the history.
const HISTORY_MAX: usize = 500;

impl History {
    /// The inputs kept, oldest first (saved across runs by the front end's caller).
    #[must_use]
    pub fn entries(&self) -> &[String] {
        &self.entries
    }

    /// Remember a sent input (consecutive duplicates are kept once).
    pub fn push(&mut self, text: &str) {
        self.pos = None;
        if self.entries.last().is_some_and(|l| l == text) {
            return;
        }
        if self.entries.len() >= HISTORY_MAX {
            self.entries.remove(0);
        }
        self.entries.push(text.to_string());
    }

    /// The previous entry, putting `current` aside when browsing starts.
    pub fn older(&mut self, current: &str) -> Option<&str> {
        let i = match self.pos {
            None if self.entries.is_empty() => return None,
            None => {
                self.draft = current.to_string();
                self.entries.len() - 1
            }
            Some(0) => 0,
            Some(i) => i - 1,
        };
        self.pos = Some(i);
        self.entries.get(i).map(String::as_str)
    }

    /// The next entry, or the put-aside draft after the newest.
    pub fn newer(&mut self) -> Option<&str> {
        let i = self.pos?;
        if i + 1 < self.entries.len() {
            self.pos = Some(i + 1);
            self.entries.get(i + 1).map(String::as_str)
        } else {
            self.pos = None;
            Some(&self.draft)
        }
    }

    /// Number of entries.
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing was sent yet.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn editing_moves_by_characters_and_lines() {
        let mut e = Editor::default();
        e.insert_str("héllo\r\nwörld");
        assert_eq!(e.text(), "héllo\nwörld");
        assert!(e.up());
        assert!(!e.up());
        e.end();
        e.backspace();
        assert_eq!(e.text(), "héll\nwörld");
        e.home();
        e.right();
        e.delete();
        assert_eq!(e.text(), "hll\nwörld");
        assert!(e.down());
        assert!(!e.down());
        assert_eq!(e.cursor(), "hll\nw".len());
        e.left();
        e.left();
        e.backspace();
        assert_eq!(e.take(), "hl\nwörld");
        assert!(e.is_empty());
        e.backspace();
        e.delete();
        e.left();
        e.right();
    }

    #[test]
    fn a_huge_paste_is_capped() {
        let mut e = Editor::default();
        let big = "é".repeat(MAX_INPUT_BYTES);
        let dropped = e.insert_str(&big);
        assert!(e.text().len() <= MAX_INPUT_BYTES);
        assert_eq!(dropped + e.text().len(), big.len());
        assert!(!e.insert_char('x') || e.text().len() <= MAX_INPUT_BYTES);
    }

    #[test]
    fn history_browses_and_restores_the_draft() {
        let mut h = History::default();
        assert_eq!(h.older("x"), None);
        h.push("one");
        h.push("two");
        h.push("two");
        assert_eq!(h.len(), 2);
        assert_eq!(h.older("draft"), Some("two"));
        assert_eq!(h.older(""), Some("one"));
        assert_eq!(h.older(""), Some("one"));
        assert_eq!(h.newer(), Some("two"));
        assert_eq!(h.newer(), Some("draft"));
        assert_eq!(h.newer(), None);
    }
}
