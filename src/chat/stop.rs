//! Streaming stop-string matcher: cuts generated text at the first of a set
//! of stop strings, holding back a possible beginning of one until the next
//! piece decides it (an OpenAI `stop` field in `kvrun serve`).

/// Cuts the text at the first stop string, holding back a possible prefix of one.
#[derive(Debug, Default, Clone)]
pub struct StopMatch {
    stops: Vec<String>,
    pending: String,
}

impl StopMatch {
    /// A matcher for `stops` (none: every piece passes straight through).
    pub fn new(stops: Vec<String>) -> StopMatch {
        StopMatch {
            stops,
            pending: String::new(),
        }
    }

    /// Feed one piece: the text that is safe to emit, and whether a stop
    /// string was hit (the text is then everything before it).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        if self.stops.is_empty() {
            return (piece.to_owned(), false);
        }
        self.pending.push_str(piece);
        if let Some(at) = self.stops.iter().filter_map(|s| self.pending.find(s)).min() {
            let out = self.pending[..at].to_owned();
            self.pending.clear();
            return (out, true);
        }
        let keep = self
            .stops
            .iter()
            .flat_map(|s| s.char_indices().skip(1).map(move |(i, _)| &s[..i]))
            .filter(|p| self.pending.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_owned();
        self.pending.drain(..cut);
        (out, false)
    }

    /// End of the stream: the text held back (no stop string followed).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::StopMatch;

    #[test]
    fn stop_strings_across_pieces() {
        let mut m = StopMatch::new(vec!["END".into(), "ü!".into()]);
        assert_eq!(m.push("abc E"), ("abc ".to_owned(), false));
        assert_eq!(m.push("N"), (String::new(), false));
        assert_eq!(m.push("X"), ("ENX".to_owned(), false));
        assert_eq!(m.push("xx ü"), ("xx ".to_owned(), false));
        assert_eq!(m.push("! tail"), (String::new(), true));
        let mut m = StopMatch::new(vec!["\n\n".into()]);
        assert_eq!(m.push("a\n"), ("a".to_owned(), false));
        assert_eq!(m.finish(), "\n");
    }

    #[test]
    fn earliest_stop_wins_and_none_passes_through() {
        let mut m = StopMatch::new(vec!["b".into(), "a".into()]);
        assert_eq!(m.push("xab"), ("x".to_owned(), true));
        let mut m = StopMatch::new(Vec::new());
        assert_eq!(m.push("anything"), ("anything".to_owned(), false));
        assert_eq!(m.finish(), "");
    }
}
