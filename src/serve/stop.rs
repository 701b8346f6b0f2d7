//! Stop strings of a request, applied to the generated text as it streams: text that could be
//! the start of a stop string is held back until the next piece says whether it is; the reply
//! ends before the first stop string, which is never sent. Pure: text in, text out.

/// Holds back what may be the start of a stop string.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    hit: bool,
}

impl StopMatcher {
    /// A matcher for these strings (empty ones are never matched).
    #[must_use]
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            hit: false,
        }
    }

    /// Whether a stop string was found (all text after it is dropped).
    #[must_use]
    pub fn hit(&self) -> bool {
        self.hit
    }

    /// Add `text`; returns the text that can be sent now.
    pub fn push(&mut self, text: &str) -> String {
        if self.hit {
            return String::new();
        }
        if self.stops.is_empty() {
            return text.to_owned();
        }
        self.held.push_str(text);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            self.hit = true;
            let out = self.held[..at].to_owned();
            self.held.clear();
            return out;
        }
        // The longest end of what is held that some stop string starts with.
        let keep = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let out = self.held[..keep].to_owned();
        self.held.drain(..keep);
        out
    }

    /// The text still held (the reply ended without completing a stop string).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::StopMatcher;

    /// Feeds `pieces`; returns what was released and whether a stop string was hit.
    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| (*s).to_owned()).collect());
        let mut out: Vec<String> = pieces.iter().map(|p| m.push(p)).collect();
        out.push(m.finish());
        (out, m.hit())
    }

    #[test]
    fn a_partial_match_is_held_and_a_full_one_never_sent() {
        let (out, hit) = run(&["END"], &["Hello E", "N", "D and more", "ignored"]);
        assert!(hit);
        assert_eq!(out, ["Hello ", "", "", "", ""]);
        // A partial match that does not complete is released with the next piece.
        let (out, hit) = run(&["END"], &["Hello E", "NV", "!"]);
        assert!(!hit);
        assert_eq!(out.concat(), "Hello ENV!");
        assert_eq!(out[0], "Hello ");
        // Held at the end of the reply: released by finish.
        let (out, _) = run(&["\n\n"], &["a\n"]);
        assert_eq!(out, ["a", "\n"]);
    }

    #[test]
    fn the_earliest_of_several_stops_wins_and_multibyte_text_is_cut_on_characters() {
        let (out, hit) = run(&["Zürich", "ü"], &["Grüße aus Zürich"]);
        assert!(hit);
        assert_eq!(out[0], "Gr");
        let (out, hit) = run(&["éé"], &["aé", "b"]);
        assert!(!hit);
        assert_eq!(out, ["a", "éb", ""]);
        // Without stop strings everything passes at once.
        assert_eq!(run(&[], &["x", "y"]).0, ["x", "y", ""]);
    }
}
