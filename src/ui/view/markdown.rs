//! A reply's Markdown as styled lines at a fixed width: headings, lists (nested, numbered, task
//! items), emphasis, strong, strikethrough, inline code, block quotes, tables, links (text and
//! address), images (alt text and address), rules and code blocks with syntax highlighting.
//!
//! pulldown-cmark parses (with [`markdown_options`], the options select mode finds code blocks
//! with) and syntect highlights (its bundled grammars and themes, pure-Rust regexes). Prose is
//! word-wrapped at the pane width; code is never re-flowed: a code line longer than the pane
//! wraps hard, by characters, its continuation rows under the same gutter. A single line break
//! in a paragraph is kept as a line break (as chat front ends do), not joined.
//!
//! Every piece of text passes through [`clean`] before it reaches a span, so nothing the model
//! wrote can move the cursor. Renderings of finished replies and highlighted code blocks are
//! cached per thread (the UI thread draws), so a frame re-renders only the reply that streams,
//! and in it only the code block still open.

use super::text::{char_width, clean, str_width};
use crate::app::config::ThemeName;
use crate::app::state::markdown_options;
use crate::ui::theme::Theme;
use pulldown_cmark::{Alignment, CodeBlockKind, Event, HeadingLevel, Parser, Tag, TagEnd};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use rustc_hash::{FxHashMap, FxHasher};
use std::cell::RefCell;
use std::hash::{Hash, Hasher};
use std::ops::Range;
use std::rc::Rc;
use std::sync::OnceLock;
use syntect::easy::HighlightLines;
use syntect::highlighting::{FontStyle, ThemeSet};
use syntect::parsing::SyntaxSet;
use syntect::util::LinesWithEndings;

/// Left margin of every line of a reply.
pub const INDENT: &str = "  ";
/// The gutter in front of every code line.
pub const GUTTER: &str = "▎ ";

/// A reply rendered at one width.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Rendered {
    /// The lines, each starting with an [`INDENT`] span of its own.
    pub lines: Vec<Line<'static>>,
    /// The lines of each code block (its language line included), in order.
    pub code: Vec<Range<usize>>,
}

/// One character on the screen with its style.
type Cell = (char, Style);

/// The styles Markdown adds to a colour scheme.
struct Styles {
    text: Style,
    dim: Style,
    code: Style,
    heading: [Style; 3],
    link: Style,
    quote: Style,
    marker: Style,
}

impl Styles {
    fn new(theme: &Theme, name: ThemeName) -> Styles {
        let bold = Modifier::BOLD;
        let (accent, link) = match name {
            ThemeName::Mono => (Style::new(), Style::new()),
            ThemeName::Dark | ThemeName::Light => (
                Style::new().fg(Color::Magenta),
                Style::new().fg(Color::Blue),
            ),
        };
        Styles {
            text: theme.text,
            dim: theme.dim,
            code: theme.code,
            heading: [
                accent.add_modifier(bold | Modifier::UNDERLINED),
                accent.add_modifier(bold),
                theme.text.add_modifier(bold),
            ],
            link: link.add_modifier(Modifier::UNDERLINED),
            quote: theme.text.add_modifier(Modifier::ITALIC),
            marker: theme.assistant,
        }
    }
}

/// A container a line's prefix comes from.
enum Container {
    /// A block quote: a bar on every line.
    Quote,
    /// A list item: its marker on its first line, as many spaces on the others.
    Item { marker: String, first: bool },
}

/// A table being collected.
#[derive(Default)]
struct Table {
    aligns: Vec<Alignment>,
    head: Option<Vec<Vec<Cell>>>,
    rows: Vec<Vec<Vec<Cell>>>,
    row: Vec<Vec<Cell>>,
    in_head: bool,
}

struct Md<'a> {
    width: usize,
    s: &'a Styles,
    name: ThemeName,
    out: Vec<Line<'static>>,
    code_ranges: Vec<Range<usize>>,
    inline: Vec<Cell>,
    style: Vec<Style>,
    containers: Vec<Container>,
    lists: Vec<Option<u64>>,
    need_blank: bool,
    heading: Option<HeadingLevel>,
    code: Option<(String, String)>,
    links: Vec<(String, usize)>,
    table: Option<Table>,
}

/// Consecutive cells of one style as spans.
fn spans_of(cells: &[Cell]) -> Vec<Span<'static>> {
    let mut out: Vec<Span<'static>> = Vec::new();
    let mut cur = String::new();
    let mut style = None;
    for &(c, st) in cells {
        if style != Some(st) {
            if let Some(s) = style {
                out.push(Span::styled(std::mem::take(&mut cur), s));
            }
            style = Some(st);
        }
        cur.push(c);
    }
    if let Some(s) = style {
        out.push(Span::styled(cur, s));
    }
    out
}

fn cells_width(cells: &[Cell]) -> usize {
    cells.iter().map(|(c, _)| char_width(*c)).sum()
}

/// One word of a line of cells for `textwrap`'s line filling: cells `start..end` of the line,
/// `width` columns wide, followed by `gap` columns of spaces.
#[derive(Debug)]
struct CellWord {
    start: usize,
    end: usize,
    width: usize,
    gap: usize,
}

impl textwrap::core::Fragment for CellWord {
    fn width(&self) -> f64 {
        self.width as f64
    }

    fn whitespace_width(&self) -> f64 {
        self.gap as f64
    }

    fn penalty_width(&self) -> f64 {
        0.0
    }
}

/// Word-wrap one line of cells (no line breaks) at `width` columns with the rules of
/// [`super::text::wrap_line`]: break at spaces, cut a word longer than the line by characters,
/// drop the spaces at a break. The words are cut here; `textwrap` fills the lines (first fit),
/// on cells because each character carries its style.
fn wrap_cells(line: &[Cell], width: usize) -> Vec<Vec<Cell>> {
    let width = width.max(1);
    let mut words = Vec::new();
    let mut i = 0;
    while i < line.len() {
        let mut end = i;
        while end < line.len() && line[end].0 != ' ' {
            end += 1;
        }
        let mut next = end;
        while next < line.len() && line[next].0 == ' ' {
            next += 1;
        }
        // A word longer than the line becomes pieces of at most `width` columns.
        let (mut start, mut w) = (i, 0);
        for (k, cell) in line.iter().enumerate().take(end).skip(i) {
            let cw = char_width(cell.0);
            if w + cw > width && k > start {
                words.push(CellWord {
                    start,
                    end: k,
                    width: w,
                    gap: 0,
                });
                (start, w) = (k, 0);
            }
            w += cw;
        }
        words.push(CellWord {
            start,
            end,
            width: w,
            gap: next - end,
        });
        i = next;
    }
    let rows: Vec<Vec<Cell>> = textwrap::wrap_algorithms::wrap_first_fit(&words, &[width as f64])
        .iter()
        .filter_map(|row| Some(line[row.first()?.start..row.last()?.end].to_vec()))
        .collect();
    if rows.is_empty() {
        vec![Vec::new()]
    } else {
        rows
    }
}

/// Cut one line of cells by characters into rows of at most `width` columns (code).
fn hard_cells(line: &[Cell], width: usize) -> Vec<Vec<Cell>> {
    let width = width.max(1);
    let mut out = Vec::new();
    let mut cur = Vec::new();
    let mut cur_w = 0;
    for &cell in line {
        let cw = char_width(cell.0);
        if cur_w + cw > width && !cur.is_empty() {
            out.push(std::mem::take(&mut cur));
            cur_w = 0;
        }
        cur.push(cell);
        cur_w += cw;
    }
    out.push(cur);
    out
}

/// `text` escaped (see [`clean`]) as cells of one style.
fn cells(text: &str, style: Style) -> Vec<Cell> {
    clean(text).chars().map(|c| (c, style)).collect()
}

impl Md<'_> {
    fn top(&self) -> Style {
        self.style.last().copied().unwrap_or(self.s.text)
    }

    fn push_style(&mut self, f: impl Fn(Style) -> Style) {
        let st = f(self.top());
        self.style.push(st);
    }

    fn text(&mut self, t: &str, style: Style) {
        self.inline.extend(cells(t, style));
    }

    /// The prefix of the next line: the indent, quote bars and list markers (a marker once,
    /// on its item's first line, when `consume`).
    fn prefix(&mut self, consume: bool) -> Vec<Span<'static>> {
        let mut out = vec![Span::raw(INDENT)];
        for c in &mut self.containers {
            match c {
                Container::Quote => out.push(Span::styled("│ ", self.s.dim)),
                Container::Item { marker, first } => {
                    if *first && consume {
                        out.push(Span::styled(marker.clone(), self.s.marker));
                        *first = false;
                    } else {
                        out.push(Span::raw(" ".repeat(str_width(marker))));
                    }
                }
            }
        }
        out
    }

    fn prefix_width(&self) -> usize {
        str_width(INDENT)
            + self
                .containers
                .iter()
                .map(|c| match c {
                    Container::Quote => 2,
                    Container::Item { marker, .. } => str_width(marker),
                })
                .sum::<usize>()
    }

    fn room(&self) -> usize {
        self.width.saturating_sub(self.prefix_width()).max(1)
    }

    fn push_row(&mut self, row: Vec<Span<'static>>) {
        let mut spans = self.prefix(true);
        spans.extend(row);
        self.out.push(Line::from(spans));
    }

    /// A blank line between blocks (quote bars kept), when one is due.
    fn start_block(&mut self) {
        if self.need_blank && !self.out.is_empty() {
            let mut spans = self.prefix(false);
            // Only quote bars on a blank line; trailing list padding dropped.
            while spans.len() > 1 && spans.last().is_some_and(|s| s.content.trim().is_empty()) {
                spans.pop();
            }
            self.out.push(Line::from(spans));
        }
        self.need_blank = false;
    }

    /// Emit the collected inline text, word-wrapped, one row per line break kept.
    fn flush(&mut self) {
        if self.inline.is_empty() {
            return;
        }
        let mut inline = std::mem::take(&mut self.inline);
        while inline.last().is_some_and(|(c, _)| *c == '\n') {
            inline.pop();
        }
        let room = self.room();
        for logical in inline.split(|(c, _)| *c == '\n') {
            let rows = wrap_cells(logical, room);
            let widest = rows.iter().map(|r| cells_width(r)).max().unwrap_or(0);
            for row in rows {
                self.push_row(spans_of(&row));
            }
            // Headings of the first two levels are underlined across their text.
            match self.heading {
                Some(HeadingLevel::H1) => {
                    self.push_row(vec![Span::styled("═".repeat(widest), self.s.heading[0])]);
                }
                Some(HeadingLevel::H2) => {
                    self.push_row(vec![Span::styled("─".repeat(widest), self.s.heading[1])]);
                }
                _ => {}
            }
        }
    }

    fn event(&mut self, ev: Event<'_>) {
        match ev {
            Event::Start(tag) => self.start(tag),
            Event::End(tag) => self.end(tag),
            Event::Text(t) => match self.code.as_mut() {
                Some((_, body)) => body.push_str(&t),
                None => self.text(&t, self.top()),
            },
            Event::Code(t) => self.text(&t, self.s.code),
            Event::Html(t) | Event::InlineHtml(t) => self.text(&t, self.s.dim),
            Event::SoftBreak | Event::HardBreak => self.inline.push(('\n', self.top())),
            Event::Rule => {
                self.flush();
                self.start_block();
                let w = self.room();
                self.push_row(vec![Span::styled("─".repeat(w), self.s.dim)]);
                self.need_blank = true;
            }
            Event::FootnoteReference(l) => self.text(&format!("[^{l}]"), self.s.dim),
            Event::TaskListMarker(done) => {
                self.text(if done { "[x] " } else { "[ ] " }, self.s.marker);
            }
            Event::InlineMath(t) | Event::DisplayMath(t) => self.text(&t, self.s.code),
        }
    }

    fn start(&mut self, tag: Tag<'_>) {
        match tag {
            Tag::Paragraph | Tag::HtmlBlock => {
                self.flush();
                self.start_block();
            }
            Tag::Heading { level, .. } => {
                self.flush();
                self.start_block();
                let i = match level {
                    HeadingLevel::H1 => 0,
                    HeadingLevel::H2 => 1,
                    _ => 2,
                };
                let st = self.s.heading[i];
                self.style.push(st);
                self.heading = Some(level);
            }
            Tag::BlockQuote(_) => {
                self.flush();
                self.start_block();
                self.containers.push(Container::Quote);
                let st = self.s.quote;
                self.style.push(st);
            }
            Tag::CodeBlock(kind) => {
                self.flush();
                self.start_block();
                let lang = match kind {
                    CodeBlockKind::Fenced(info) => {
                        info.split_whitespace().next().unwrap_or("").to_string()
                    }
                    CodeBlockKind::Indented => String::new(),
                };
                self.code = Some((lang, String::new()));
            }
            Tag::List(start) => {
                self.flush();
                self.start_block();
                self.lists.push(start);
            }
            Tag::Item => {
                self.flush();
                self.start_block();
                let depth = self.lists.len().saturating_sub(1);
                let marker = match self.lists.last_mut() {
                    Some(Some(n)) => {
                        let m = format!("{n}. ");
                        *n += 1;
                        m
                    }
                    _ => ["• ", "◦ ", "▪ "][depth % 3].to_string(),
                };
                self.containers.push(Container::Item {
                    marker,
                    first: true,
                });
            }
            Tag::FootnoteDefinition(l) => {
                self.flush();
                self.start_block();
                self.text(&format!("[^{l}]: "), self.s.dim);
            }
            Tag::Table(aligns) => {
                self.flush();
                self.start_block();
                self.table = Some(Table {
                    aligns,
                    ..Table::default()
                });
            }
            Tag::TableHead => {
                if let Some(t) = self.table.as_mut() {
                    t.in_head = true;
                    t.row.clear();
                }
            }
            Tag::TableRow => {
                if let Some(t) = self.table.as_mut() {
                    t.row.clear();
                }
            }
            Tag::TableCell => self.inline.clear(),
            Tag::Emphasis => self.push_style(|s| s.add_modifier(Modifier::ITALIC)),
            Tag::Strong => self.push_style(|s| s.add_modifier(Modifier::BOLD)),
            Tag::Strikethrough => self.push_style(|s| s.add_modifier(Modifier::CROSSED_OUT)),
            Tag::Link { dest_url, .. } => {
                let st = self.s.link;
                self.style.push(st);
                self.links.push((dest_url.to_string(), self.inline.len()));
            }
            Tag::Image { dest_url, .. } => {
                let st = self.s.dim;
                self.style.push(st);
                self.text("[image: ", st);
                self.links.push((dest_url.to_string(), self.inline.len()));
            }
            _ => {}
        }
    }

    /// Over 100 lines: one arm per kind of Markdown tag end, most a few lines.
    fn end(&mut self, tag: TagEnd) {
        match tag {
            TagEnd::Paragraph | TagEnd::HtmlBlock => {
                self.flush();
                self.need_blank = true;
            }
            TagEnd::Heading(_) => {
                self.flush();
                self.style.pop();
                self.heading = None;
                self.need_blank = true;
            }
            TagEnd::BlockQuote(_) => {
                self.flush();
                self.containers.pop();
                self.style.pop();
                self.need_blank = true;
            }
            TagEnd::CodeBlock => {
                if let Some((lang, body)) = self.code.take() {
                    self.code_block(&lang, &body);
                }
                self.need_blank = true;
            }
            TagEnd::List(_) => {
                self.flush();
                self.lists.pop();
                if self.lists.is_empty() {
                    self.need_blank = true;
                }
            }
            TagEnd::Item => {
                self.flush();
                if matches!(
                    self.containers.last(),
                    Some(Container::Item { first: true, .. })
                ) {
                    // An empty item still shows its marker.
                    self.push_row(Vec::new());
                }
                self.containers.pop();
            }
            TagEnd::FootnoteDefinition => {
                self.flush();
                self.need_blank = true;
            }
            TagEnd::Table => {
                if let Some(t) = self.table.take() {
                    self.table_rows(t);
                }
                self.need_blank = true;
            }
            TagEnd::TableHead => {
                if let Some(t) = self.table.as_mut() {
                    t.head = Some(std::mem::take(&mut t.row));
                    t.in_head = false;
                }
            }
            TagEnd::TableRow => {
                if let Some(t) = self.table.as_mut() {
                    let row = std::mem::take(&mut t.row);
                    t.rows.push(row);
                }
            }
            TagEnd::TableCell => {
                let mut cell = std::mem::take(&mut self.inline);
                if let Some(t) = self.table.as_mut() {
                    for c in &mut cell {
                        if c.0 == '\n' {
                            c.0 = ' ';
                        }
                        if t.in_head {
                            c.1 = c.1.add_modifier(Modifier::BOLD);
                        }
                    }
                    t.row.push(cell);
                }
            }
            TagEnd::Emphasis | TagEnd::Strong | TagEnd::Strikethrough => {
                self.style.pop();
            }
            TagEnd::Link => {
                self.style.pop();
                if let Some((url, at)) = self.links.pop() {
                    let shown: String = self.inline[at.min(self.inline.len())..]
                        .iter()
                        .map(|(c, _)| *c)
                        .collect();
                    let bare = url.strip_prefix("mailto:").unwrap_or(&url);
                    if !url.is_empty() && shown != url && shown != bare {
                        self.text(&format!(" ({url})"), self.s.dim);
                    }
                }
            }
            TagEnd::Image => {
                self.style.pop();
                let dim = self.s.dim;
                self.text("]", dim);
                if let Some((url, _)) = self.links.pop() {
                    if !url.is_empty() {
                        self.text(&format!(" ({url})"), dim);
                    }
                }
            }
            _ => {}
        }
    }

    fn code_block(&mut self, lang: &str, body: &str) {
        let start = self.out.len();
        let gutter = self.s.dim;
        if !lang.is_empty() {
            let label = vec![
                Span::styled(GUTTER, gutter),
                Span::styled(
                    clean(lang).into_owned(),
                    self.s.dim.add_modifier(Modifier::ITALIC),
                ),
            ];
            self.push_row(label);
        }
        let room = self.room().saturating_sub(str_width(GUTTER)).max(1);
        let lines = highlighted(body, lang, self.name, self.s.code);
        for line in lines.iter() {
            let row: Vec<Cell> = line.iter().flat_map(|(t, st)| cells(t, *st)).collect();
            for piece in hard_cells(&row, room) {
                let mut spans = vec![Span::styled(GUTTER, gutter)];
                spans.extend(spans_of(&piece));
                self.push_row(spans);
            }
        }
        if self.out.len() == start {
            self.push_row(vec![Span::styled(GUTTER, gutter)]);
        }
        self.code_ranges.push(start..self.out.len());
    }

    fn table_rows(&mut self, t: Table) {
        let mut all: Vec<&Vec<Vec<Cell>>> = Vec::new();
        all.extend(t.head.iter());
        all.extend(t.rows.iter());
        let ncols = all
            .iter()
            .map(|r| r.len())
            .max()
            .unwrap_or(0)
            .max(t.aligns.len());
        if ncols == 0 {
            return;
        }
        let mut widths = vec![1usize; ncols];
        for row in &all {
            for (i, cell) in row.iter().enumerate() {
                widths[i] = widths[i].max(cells_width(cell));
            }
        }
        // Narrow the widest columns until the table fits the pane (cells then wrap).
        let sep = 3;
        let avail = self.room();
        let mut total: usize = widths.iter().sum::<usize>() + sep * (ncols - 1);
        while total > avail {
            let Some((i, w)) = widths.iter().copied().enumerate().max_by_key(|&(_, w)| w) else {
                break;
            };
            if w <= 3 {
                break;
            }
            widths[i] -= 1;
            total -= 1;
        }
        let border = self.s.dim;
        let row_lines = |row: &Vec<Vec<Cell>>| -> Vec<Vec<Span<'static>>> {
            let empty = Vec::new();
            let wrapped: Vec<Vec<Vec<Cell>>> = (0..ncols)
                .map(|i| wrap_cells(row.get(i).unwrap_or(&empty), widths[i]))
                .collect();
            let height = wrapped.iter().map(Vec::len).max().unwrap_or(1);
            (0..height)
                .map(|r| {
                    let mut spans = Vec::new();
                    for (i, cell) in wrapped.iter().enumerate() {
                        if i > 0 {
                            spans.push(Span::styled(" │ ", border));
                        }
                        let piece = cell.get(r).map_or(&[][..], |p| p.as_slice());
                        let pad = widths[i].saturating_sub(cells_width(piece));
                        let (left, right) = match t.aligns.get(i) {
                            Some(Alignment::Right) => (pad, 0),
                            Some(Alignment::Center) => (pad / 2, pad - pad / 2),
                            _ => (0, pad),
                        };
                        if left > 0 {
                            spans.push(Span::raw(" ".repeat(left)));
                        }
                        spans.extend(spans_of(piece));
                        if right > 0 && i + 1 < ncols {
                            spans.push(Span::raw(" ".repeat(right)));
                        }
                    }
                    spans
                })
                .collect()
        };
        if let Some(head) = &t.head {
            for l in row_lines(head) {
                self.push_row(l);
            }
            let rule: Vec<String> = widths.iter().map(|w| "─".repeat(*w)).collect();
            self.push_row(vec![Span::styled(rule.join("─┼─"), border)]);
        }
        for row in &t.rows {
            for l in row_lines(row) {
                self.push_row(l);
            }
        }
    }
}

/// Render `text` (a reply's answer, Markdown) at `width` columns.
#[must_use]
pub fn render(text: &str, width: usize, theme: &Theme, name: ThemeName) -> Rendered {
    let s = Styles::new(theme, name);
    let mut md = Md {
        width: width.max(1),
        s: &s,
        name,
        out: Vec::new(),
        code_ranges: Vec::new(),
        inline: Vec::new(),
        style: Vec::new(),
        containers: Vec::new(),
        lists: Vec::new(),
        need_blank: false,
        heading: None,
        code: None,
        links: Vec::new(),
        table: None,
    };
    for ev in Parser::new_ext(text, markdown_options()) {
        md.event(ev);
    }
    // A reply cut off mid-block (streaming) still shows what it has.
    if let Some((lang, body)) = md.code.take() {
        md.code_block(&lang, &body);
    }
    if let Some(t) = md.table.take() {
        md.table_rows(t);
    }
    md.flush();
    Rendered {
        lines: md.out,
        code: md.code_ranges,
    }
}

/// Entries kept in each cache before the ones at other widths are let go.
const CACHE_MAX: usize = 2048;

/// Cached renderings, keyed by a hash of the text and the width and scheme; the text is kept
/// to rule out a collision.
type RenderCache = FxHashMap<(u64, usize, u8), (String, Rc<Rendered>)>;
/// Highlighted code blocks, keyed like [`RenderCache`] (no width: code is wrapped later).
type CodeCache = FxHashMap<(u64, u8), (String, String, Rc<Vec<Vec<(String, Style)>>>)>;

thread_local! {
    static RENDERED: RefCell<RenderCache> = RefCell::new(FxHashMap::default());
    static HIGHLIGHTED: RefCell<CodeCache> = RefCell::new(FxHashMap::default());
}

fn hash_of(parts: &[&str]) -> u64 {
    let mut h = FxHasher::default();
    for p in parts {
        p.hash(&mut h);
    }
    h.finish()
}

fn scheme_id(name: ThemeName) -> u8 {
    match name {
        ThemeName::Dark => 0,
        ThemeName::Light => 1,
        ThemeName::Mono => 2,
    }
}

/// [`render`], from the cache when this text was rendered at this width before. `keep`:
/// remember the result (a finished reply; a streaming one changes at every token).
#[must_use]
pub fn render_cached(
    text: &str,
    width: usize,
    theme: &Theme,
    name: ThemeName,
    keep: bool,
) -> Rc<Rendered> {
    let key = (hash_of(&[text]), width, scheme_id(name));
    let hit = RENDERED.with(|c| {
        c.borrow()
            .get(&key)
            .filter(|(t, _)| t == text)
            .map(|(_, r)| Rc::clone(r))
    });
    if let Some(r) = hit {
        return r;
    }
    let r = Rc::new(render(text, width, theme, name));
    if keep {
        RENDERED.with(|c| {
            let mut c = c.borrow_mut();
            if c.len() >= CACHE_MAX {
                c.retain(|k, _| k.1 == width);
                if c.len() >= CACHE_MAX {
                    c.clear();
                }
            }
            c.insert(key, (text.to_string(), Rc::clone(&r)));
        });
    }
    r
}

/// Load the grammars and themes now (about a tenth of a second), so that the first code block
/// shown does not wait for them. Any thread may call it; the UI thread's first draw does not.
pub fn warm_up() {
    let _ = syntaxes();
    let _ = themes();
}

fn syntaxes() -> &'static SyntaxSet {
    static S: OnceLock<SyntaxSet> = OnceLock::new();
    S.get_or_init(SyntaxSet::load_defaults_newlines)
}

fn themes() -> &'static ThemeSet {
    static T: OnceLock<ThemeSet> = OnceLock::new();
    T.get_or_init(ThemeSet::load_defaults)
}

/// The lines of `code` as (text, style) runs, highlighted for `lang` where syntect knows it
/// (by name or file extension: `rust`, `rs`, `py`, `sh`, …); otherwise in the code style.
/// Cached: a code block already closed is not highlighted again while its reply streams.
fn highlighted(
    code: &str,
    lang: &str,
    name: ThemeName,
    fallback: Style,
) -> Rc<Vec<Vec<(String, Style)>>> {
    let key = (hash_of(&[lang, code]), scheme_id(name));
    let hit = HIGHLIGHTED.with(|c| {
        c.borrow()
            .get(&key)
            .filter(|(l, t, _)| l == lang && t == code)
            .map(|(_, _, r)| Rc::clone(r))
    });
    if let Some(r) = hit {
        return r;
    }
    let r = Rc::new(highlight(code, lang, name).unwrap_or_else(|| {
        code.lines()
            .map(|l| vec![(l.to_string(), fallback)])
            .collect()
    }));
    HIGHLIGHTED.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() >= CACHE_MAX {
            c.clear();
        }
        c.insert(key, (lang.to_string(), code.to_string(), Rc::clone(&r)));
    });
    r
}

fn highlight(code: &str, lang: &str, name: ThemeName) -> Option<Vec<Vec<(String, Style)>>> {
    let theme_name = match name {
        ThemeName::Dark => "base16-ocean.dark",
        ThemeName::Light => "InspiredGitHub",
        ThemeName::Mono => return None,
    };
    if lang.is_empty() {
        return None;
    }
    let ss = syntaxes();
    let syntax = ss.find_syntax_by_token(lang)?;
    let theme = themes().themes.get(theme_name)?;
    let mut h = HighlightLines::new(syntax, theme);
    let mut out = Vec::new();
    for line in LinesWithEndings::from(code) {
        let regions = h.highlight_line(line, ss).ok()?;
        let runs = regions
            .into_iter()
            .filter_map(|(st, text)| {
                let text = text.trim_end_matches(['\n', '\r']);
                if text.is_empty() {
                    return None;
                }
                let mut style = Style::new().fg(Color::Rgb(
                    st.foreground.r,
                    st.foreground.g,
                    st.foreground.b,
                ));
                if st.font_style.contains(FontStyle::BOLD) {
                    style = style.add_modifier(Modifier::BOLD);
                }
                if st.font_style.contains(FontStyle::ITALIC) {
                    style = style.add_modifier(Modifier::ITALIC);
                }
                if st.font_style.contains(FontStyle::UNDERLINE) {
                    style = style.add_modifier(Modifier::UNDERLINED);
                }
                Some((text.to_string(), style))
            })
            .collect();
        out.push(runs);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines of words, spaces (runs of one to three, leading and trailing too), wide characters
    /// and words longer than the line, from a fixed seed.
    fn wrap_cases() -> Vec<String> {
        let words = [
            "a",
            "to",
            "wrap",
            "日本語",
            "supercalifragilistic",
            "é",
            "x-y-z",
            "0123456789abcdef",
        ];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        (0..2000)
            .map(|_| {
                let mut line = " ".repeat(next(3));
                for _ in 0..next(12) {
                    line.push_str(words[next(words.len())]);
                    line.push_str(&" ".repeat(1 + next(3)));
                }
                if next(2) == 0 {
                    line.truncate(line.trim_end().len());
                }
                line
            })
            .collect()
    }

    #[test]
    fn styled_cells_wrap_exactly_as_plain_text_does() {
        // Two paths to the same rule: `textwrap::wrap` on the text, and textwrap's line filling
        // over words of cells.
        for line in wrap_cases() {
            let cells: Vec<Cell> = line.chars().map(|c| (c, Style::default())).collect();
            for width in 1..30 {
                let plain = super::super::text::wrap_line(&line, width);
                let styled: Vec<String> = wrap_cells(&cells, width)
                    .iter()
                    .map(|r| r.iter().map(|(c, _)| c).collect())
                    .collect();
                assert_eq!(styled, plain, "{line:?} at {width}");
                for row in &plain {
                    // A character wider than the line stands alone.
                    let fits = str_width(row) <= width || row.chars().count() == 1;
                    assert!(fits, "{row:?} at {width}");
                }
            }
        }
    }

    fn text_of(line: &Line<'_>) -> String {
        line.spans.iter().map(|s| s.content.as_ref()).collect()
    }

    fn lines(md: &str, width: usize) -> Vec<String> {
        let theme = Theme::new(ThemeName::Dark);
        render(md, width, &theme, ThemeName::Dark)
            .lines
            .iter()
            .map(|l| text_of(l).trim_end().to_string())
            .collect()
    }

    const DOC: &str = "# Title\n\nSome *words* and **more** words, then `code` and ~~gone~~ and \
        a [link](https://example.com/a/long/path) and <https://k3.dev>.\nA kept line break.\n\n\
        > quoted text that is long enough to wrap around the pane\n\n\
        1. one\n2. two\n   1. two.one\n   2. two.two\n      - deep\n3. three\n\n\
        - [x] done\n- [ ] open\n\n---\n\n\
        | a | b |\n|---|--:|\n| left cell with words | 1 |\n\n\
        ```rust\nfn main() { println!(\"a very long line of code that will not fit the pane\"); }\n```\n";

    #[test]
    fn blocks_render_as_text_without_markup() {
        let l = lines(DOC, 60);
        let want_prefix = [
            "  Title",
            "  ═════",
            "",
            "  Some words and more words, then code and gone and a link",
            "  (https://example.com/a/long/path) and https://k3.dev.",
            "  A kept line break.",
            "",
            "  │ quoted text that is long enough to wrap around the pane",
            "",
            "  1. one",
            "  2. two",
            "     1. two.one",
            "     2. two.two",
            "        ▪ deep",
            "  3. three",
            "",
            "  • [x] done",
            "  • [ ] open",
            "",
        ];
        assert_eq!(&l[..want_prefix.len()], &want_prefix[..], "{l:#?}");
        let rest = &l[want_prefix.len()..];
        assert!(rest[0].starts_with("  ───"), "{rest:#?}");
        assert_eq!(rest[2], "  a                    │ b");
        assert!(rest[3].starts_with("  ─────"), "{rest:#?}");
        assert_eq!(rest[4], "  left cell with words │ 1");
        assert_eq!(rest[6], "  ▎ rust");
    }

    #[test]
    fn every_line_fits_and_code_is_never_reflowed() {
        let theme = Theme::new(ThemeName::Dark);
        let code =
            "fn main() { println!(\"a very long line of code that will not fit the pane\"); }";
        for width in 20..100 {
            let r = render(DOC, width, &theme, ThemeName::Dark);
            for l in &r.lines {
                assert!(str_width(&text_of(l)) <= width, "{width}: {:?}", text_of(l));
            }
            assert_eq!(r.code.len(), 1);
            // The code rows after the language line, gutters removed, give back the line.
            let rows: String = r.lines[r.code[0].clone()]
                .iter()
                .skip(1)
                .map(|l| text_of(l)["  ▎ ".len()..].to_string())
                .collect();
            assert_eq!(rows, code, "at {width}");
        }
    }

    #[test]
    fn code_is_highlighted_except_in_mono() {
        let md = "```rust\nlet x: u32 = 1; // one\n```\n";
        let colours = |name| {
            let theme = Theme::new(name);
            let r = render(md, 80, &theme, name);
            let mut fg: Vec<Option<Color>> = r.lines[r.code[0].end - 1]
                .spans
                .iter()
                .map(|s| s.style.fg)
                .collect();
            fg.sort_by_key(|c| format!("{c:?}"));
            fg.dedup();
            fg.len()
        };
        assert!(
            colours(ThemeName::Dark) >= 4,
            "keyword, type, number, comment"
        );
        assert!(colours(ThemeName::Light) >= 4);
        // Mono: the indent, the gutter and the code, in at most two styles.
        assert!(colours(ThemeName::Mono) <= 2);
        // An unknown language is shown in the code style, unhighlighted.
        let theme = Theme::new(ThemeName::Dark);
        let r = render("```nosuchlang\nx y\n```\n", 80, &theme, ThemeName::Dark);
        let last = &r.lines[r.code[0].end - 1];
        assert_eq!(last.spans.last().map(|s| s.style), Some(theme.code));
    }

    #[test]
    fn control_characters_never_reach_a_span() {
        let md = "a \u{1b}[2J b\n\n```\n\u{1b}]52;c;eA==\u{7}\tx\n```\n| \u{9b}1 | c |\n|--|--|\n";
        let theme = Theme::new(ThemeName::Dark);
        let r = render(md, 40, &theme, ThemeName::Dark);
        let all: String = r.lines.iter().map(text_of).collect();
        assert!(!all.chars().any(|c| c.is_control()), "{all:?}");
        assert!(all.contains("\\u{1b}[2J"), "{all:?}");
        assert!(all.contains("\\u{7}    x"), "{all:?}");
    }

    #[test]
    fn a_streaming_reply_renders_its_open_block_and_finished_ones_are_cached() {
        let theme = Theme::new(ThemeName::Dark);
        let partial = "Intro\n\n```py\nprint(1)\nprint(";
        let l = lines(partial, 40);
        assert_eq!(
            l,
            vec!["  Intro", "", "  ▎ py", "  ▎ print(1)", "  ▎ print("]
        );
        let a = render_cached(partial, 40, &theme, ThemeName::Dark, false);
        let b = render_cached(partial, 40, &theme, ThemeName::Dark, false);
        assert!(!Rc::ptr_eq(&a, &b), "a streaming reply is not kept");
        let done = "Intro\n\n```py\nprint(1)\n```\n";
        let a = render_cached(done, 40, &theme, ThemeName::Dark, true);
        let b = render_cached(done, 40, &theme, ThemeName::Dark, true);
        assert!(
            Rc::ptr_eq(&a, &b),
            "a finished reply is rendered once per width"
        );
        let c = render_cached(done, 41, &theme, ThemeName::Dark, true);
        assert!(!Rc::ptr_eq(&a, &c));
        assert_eq!(*a, render(done, 40, &theme, ThemeName::Dark));
    }

    #[test]
    fn a_table_wider_than_the_pane_wraps_its_cells() {
        let md = "| name | what it does |\n|---|---|\n| budget | caps the memory the engine may use for weights |\n";
        let l = lines(md, 30);
        for row in &l {
            assert!(str_width(row) <= 30, "{row:?}");
        }
        assert!(l.len() > 3, "{l:#?}");
        let joined = l.join(" ");
        for w in ["caps", "memory", "engine", "weights"] {
            assert!(joined.contains(w), "{joined}");
        }
    }
}
