//! SentencePiece BPE (`tokenizer.ggml.model = llama`): a port of llama.cpp's
//! `llm_tokenizer_spm` (spaces as `▁`, greedy merges by vocabulary score,
//! `<0xNN>` byte fallback).

use super::{tok_err, Engine, Meta, Tokenizer};
use crate::error::Result;
use std::collections::{BinaryHeap, HashMap};

impl Tokenizer {
    /// SentencePiece BPE: scores and byte-fallback tokens.
    pub(super) fn build_spm(
        meta: &Meta<'_>,
        tokens: &[String],
        token_to_id: &HashMap<String, u32>,
    ) -> Result<Engine> {
        let n = tokens.len();
        let scores = match meta.array("tokenizer.ggml.scores")? {
            None => vec![0.0; n],
            Some(s) if s.len() < n => {
                return Err(tok_err(format!(
                    "tokenizer.ggml.scores has {} entries for {n} tokens",
                    s.len()
                )))
            }
            Some(s) => s
                .iter()
                .take(n)
                .enumerate()
                .map(|(i, v)| {
                    v.as_f64().map(|x| x as f32).ok_or_else(|| {
                        tok_err(format!("tokenizer.ggml.scores[{i}] is not a number"))
                    })
                })
                .collect::<Result<Vec<f32>>>()?,
        };
        let mut byte_tokens = Box::new([None; 256]);
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            *slot = token_to_id
                .get(&format!("<0x{b:02X}>"))
                .copied()
                .or_else(|| {
                    // llama.cpp falls back to the one-byte text (ASCII only here).
                    (b < 0x80)
                        .then(|| token_to_id.get(&(b as u8 as char).to_string()).copied())
                        .flatten()
                });
        }
        Ok(Engine::Spm {
            scores,
            byte_tokens,
        })
    }

    /// SPM-tokenize one piece whose spaces are already escaped to `▁`
    /// (llama.cpp `llm_tokenizer_spm_session::tokenize`).
    pub(super) fn spm_fragment(
        &self,
        scores: &[f32],
        byte_tokens: &[Option<u32>; 256],
        text: &str,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        /// A run of the text: byte range plus neighbours in the live chain.
        struct Sym {
            start: usize,
            len: usize,
            prev: Option<usize>,
            next: Option<usize>,
        }
        /// A candidate merge of two adjacent symbols.
        struct Bigram {
            score: f32,
            left: usize,
            right: usize,
            size: usize,
        }
        impl PartialEq for Bigram {
            fn eq(&self, o: &Self) -> bool {
                self.cmp(o) == std::cmp::Ordering::Equal
            }
        }
        impl Eq for Bigram {}
        impl PartialOrd for Bigram {
            fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(o))
            }
        }
        impl Ord for Bigram {
            // Highest score first; on a tie the leftmost pair.
            fn cmp(&self, o: &Self) -> std::cmp::Ordering {
                self.score
                    .partial_cmp(&o.score)
                    .unwrap_or(std::cmp::Ordering::Equal)
                    .then_with(|| o.left.cmp(&self.left))
            }
        }

        if text.is_empty() {
            return Ok(());
        }
        let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
        for (i, (off, ch)) in text.char_indices().enumerate() {
            let end = off + ch.len_utf8();
            syms.push(Sym {
                start: off,
                len: ch.len_utf8(),
                prev: i.checked_sub(1),
                next: (end < text.len()).then_some(i + 1),
            });
        }
        let mut queue = BinaryHeap::new();
        let try_add = |syms: &[Sym],
                       queue: &mut BinaryHeap<Bigram>,
                       left: Option<usize>,
                       right: Option<usize>| {
            let (Some(l), Some(r)) = (left, right) else {
                return;
            };
            let (a, b) = (&syms[l], &syms[r]);
            let piece = &text[a.start..a.start + a.len + b.len];
            if let Some(&id) = self.token_to_id.get(piece) {
                queue.push(Bigram {
                    score: scores[id as usize],
                    left: l,
                    right: r,
                    size: piece.len(),
                });
            }
        };
        for i in 1..syms.len() {
            try_add(&syms, &mut queue, Some(i - 1), Some(i));
        }
        while let Some(bg) = queue.pop() {
            let (l, r) = (bg.left, bg.right);
            if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != bg.size {
                continue;
            }
            syms[l].len += syms[r].len;
            syms[r].len = 0;
            let rn = syms[r].next;
            syms[l].next = rn;
            if let Some(rn) = rn {
                syms[rn].prev = Some(l);
            }
            let lp = syms[l].prev;
            try_add(&syms, &mut queue, lp, Some(l));
            try_add(&syms, &mut queue, Some(l), rn);
        }
        let mut i = Some(0);
        while let Some(k) = i {
            let s = &syms[k];
            let piece = &text[s.start..s.start + s.len];
            match self.token_to_id.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        let id = byte_tokens[b as usize].ok_or_else(|| {
                            tok_err(format!(
                                "SPM vocabulary has no byte token <0x{b:02X}> for text {piece:?}"
                            ))
                        })?;
                        out.push(id);
                    }
                }
            }
            i = s.next;
        }
        Ok(())
    }
}
