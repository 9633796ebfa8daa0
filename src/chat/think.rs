//! Streaming `<think>…</think>` splitter: cuts generated text, arriving in
//! arbitrary pieces, into reasoning (inside the block) and content, holding
//! back a possible partial tag until the next piece decides it.
//!
//! Used by `kvrun chat` (reasoning shown dimmed or hidden) and `kvrun serve`
//! (reasoning returned as `reasoning_content`).

/// The tag that opens a reasoning block.
pub const THINK_OPEN: &str = "<think>";
/// The tag that closes a reasoning block.
pub const THINK_CLOSE: &str = "</think>";

/// Length of the longest proper prefix of `tag` that `text` ends with: the
/// bytes a streaming splitter must hold back because they may be the start
/// of `tag` (e.g. `<thi` of `<think>`). Tags are ASCII, so the cut is a
/// character boundary.
pub fn partial_tag_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&k| text.ends_with(&tag[..k]))
        .unwrap_or(0)
}

/// What [`ThinkSplit`] produces, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ThinkEvent {
    /// Text (never empty); `reasoning` = it was inside `<think>…</think>`.
    Text { reasoning: bool, text: String },
    /// A tag was consumed: the text that follows is reasoning (`true`, after
    /// `<think>`) or content (`false`, after `</think>`).
    Tag { reasoning: bool },
}

/// Splits streamed text at `<think>` / `</think>` (see the module docs).
#[derive(Debug, Clone)]
pub struct ThinkSplit {
    enabled: bool,
    in_think: bool,
    /// Drop whitespace right after a tag.
    trim_after_tags: bool,
    /// A tag was just consumed and no text has followed yet.
    strip: bool,
    pending: String,
}

impl ThinkSplit {
    /// A splitter that starts inside a reasoning block when `start_in_think`
    /// (a chat template that opens the block itself), else outside.
    pub fn new(start_in_think: bool) -> ThinkSplit {
        ThinkSplit {
            enabled: true,
            in_think: start_in_think,
            trim_after_tags: false,
            strip: false,
            pending: String::new(),
        }
    }

    /// A splitter that does not split: every piece is content, tags included.
    pub fn disabled() -> ThinkSplit {
        ThinkSplit {
            enabled: false,
            ..ThinkSplit::new(false)
        }
    }

    /// Also drop the whitespace that directly follows each tag.
    pub fn trim_after_tags(mut self) -> ThinkSplit {
        self.trim_after_tags = true;
        self
    }

    /// Whether the text being streamed now is reasoning.
    pub fn in_think(&self) -> bool {
        self.in_think
    }

    /// Feed one piece; the events it completes are appended to `out`.
    pub fn push(&mut self, piece: &str, out: &mut Vec<ThinkEvent>) {
        if !self.enabled {
            if !piece.is_empty() {
                out.push(ThinkEvent::Text {
                    reasoning: false,
                    text: piece.to_owned(),
                });
            }
            return;
        }
        self.pending.push_str(piece);
        loop {
            let tag = if self.in_think {
                THINK_CLOSE
            } else {
                THINK_OPEN
            };
            if let Some(at) = self.pending.find(tag) {
                let before = self.pending[..at].to_owned();
                self.emit(&before, out);
                self.pending.drain(..at + tag.len());
                self.in_think = !self.in_think;
                self.strip = self.trim_after_tags;
                out.push(ThinkEvent::Tag {
                    reasoning: self.in_think,
                });
                continue;
            }
            // keep a possible partial tag back
            let keep = partial_tag_suffix(&self.pending, tag);
            let cut = self.pending.len() - keep;
            let text = self.pending[..cut].to_owned();
            self.emit(&text, out);
            self.pending.drain(..cut);
            break;
        }
    }

    /// End of the stream: what was held back is text after all.
    pub fn finish(&mut self, out: &mut Vec<ThinkEvent>) {
        let rest = std::mem::take(&mut self.pending);
        self.emit(&rest, out);
    }

    fn emit(&mut self, s: &str, out: &mut Vec<ThinkEvent>) {
        let s = if self.strip { s.trim_start() } else { s };
        if s.is_empty() {
            return;
        }
        self.strip = false;
        out.push(ThinkEvent::Text {
            reasoning: self.in_think,
            text: s.to_owned(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (reasoning, content) after streaming `pieces`.
    fn split(mut t: ThinkSplit, pieces: &[&str]) -> (String, String) {
        let mut out = Vec::new();
        for p in pieces {
            t.push(p, &mut out);
        }
        t.finish(&mut out);
        let pick = |r: bool| -> String {
            out.iter()
                .filter_map(|e| match e {
                    ThinkEvent::Text { reasoning, text } if *reasoning == r => Some(text.as_str()),
                    _ => None,
                })
                .collect()
        };
        (pick(true), pick(false))
    }

    #[test]
    fn tags_split_across_pieces() {
        let pieces = [
            "<th",
            "ink>\nLet me",
            " think.</th",
            "ink>",
            "\n\nThe answer",
            " is 4.",
        ];
        let (r, c) = split(ThinkSplit::new(false).trim_after_tags(), &pieces);
        assert_eq!(r, "Let me think.");
        assert_eq!(c, "The answer is 4.");
        // without trimming every byte but the tags comes through
        let (r, c) = split(ThinkSplit::new(false), &pieces);
        assert_eq!(r, "\nLet me think.");
        assert_eq!(c, "\n\nThe answer is 4.");
        // the template opened the block: generation starts inside it
        let (r, c) = split(
            ThinkSplit::new(true).trim_after_tags(),
            &["step 1\n", "</think>\n", "done"],
        );
        assert_eq!((r.as_str(), c.as_str()), ("step 1\n", "done"));
        // no tags: all content, a lone '<' is not swallowed
        let (r, c) = split(ThinkSplit::new(false), &["a <", "b"]);
        assert_eq!((r.as_str(), c.as_str()), ("", "a <b"));
        // a partial tag at the end of the stream is text
        let (r, c) = split(ThinkSplit::new(false), &["x </thi"]);
        assert_eq!((r.as_str(), c.as_str()), ("", "x </thi"));
    }

    #[test]
    fn events_in_order() {
        let mut t = ThinkSplit::new(false);
        let mut out = Vec::new();
        t.push("a<think>b</think>c", &mut out);
        t.finish(&mut out);
        let text = |reasoning, s: &str| ThinkEvent::Text {
            reasoning,
            text: s.into(),
        };
        assert_eq!(
            out,
            vec![
                text(false, "a"),
                ThinkEvent::Tag { reasoning: true },
                text(true, "b"),
                ThinkEvent::Tag { reasoning: false },
                text(false, "c"),
            ]
        );
        assert!(!t.in_think());
    }

    #[test]
    fn disabled_passes_tags_through() {
        let mut t = ThinkSplit::disabled();
        let mut out = Vec::new();
        t.push("<think>x</think>y", &mut out);
        t.push("", &mut out);
        t.finish(&mut out);
        assert_eq!(
            out,
            vec![ThinkEvent::Text {
                reasoning: false,
                text: "<think>x</think>y".to_owned()
            }]
        );
    }

    #[test]
    fn partial_suffix() {
        assert_eq!(partial_tag_suffix("abc<thi", THINK_OPEN), 4);
        assert_eq!(partial_tag_suffix("abc<", THINK_OPEN), 1);
        assert_eq!(partial_tag_suffix("abc", THINK_OPEN), 0);
        // a whole tag is not a proper prefix
        assert_eq!(partial_tag_suffix("<think>", THINK_OPEN), 0);
    }
}
