//! Counted nouns in messages: `1 token`, `0 tokens`, `2 tokens`.

/// `noun` as given when `n` is one, with an `s` otherwise (`token`, `tokens`).
#[must_use]
pub fn plural(n: u64, noun: &str) -> String {
    if n == 1 {
        noun.to_string()
    } else {
        format!("{noun}s")
    }
}

/// `n` and its noun: `1 token`, `0 tokens`, `12 tokens`.
#[must_use]
pub fn count(n: u64, noun: &str) -> String {
    format!("{n} {}", plural(n, noun))
}

#[cfg(test)]
mod tests {
    use super::{count, plural};

    #[test]
    fn one_is_singular_and_every_other_count_plural() {
        assert_eq!(count(1, "token"), "1 token");
        assert_eq!(count(0, "token"), "0 tokens");
        assert_eq!(count(2, "token"), "2 tokens");
        assert_eq!(count(11, "token"), "11 tokens");
        assert_eq!(count(21, "token"), "21 tokens");
        assert_eq!(count(u64::MAX, "turn"), format!("{} turns", u64::MAX));
        assert_eq!(plural(1, "token"), "token");
        assert_eq!(plural(1_062, "token"), "tokens");
    }
}
