//! Byte-level BPE (`tokenizer.ggml.model = gpt2`): the pre-tokenizer regex
//! sets llama.cpp selects by `tokenizer.ggml.pre`, GPT-2's byte-to-unicode
//! table, and the Hugging Face `tokenizers` BPE model built over the file's
//! vocabulary and merges.

use super::{tok_err, Engine, Meta, Tokenizer};
use crate::error::Result;
use std::collections::HashSet;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{
    Model, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, SplitDelimiterBehavior,
};

/// The GPT-2 split, plus the trailing `\s+` that llama.cpp's hand-written
/// matcher for it also applies.
const GPT2_RE: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama-3 split (llama.cpp spells the case-insensitive contractions out).
const LLAMA3_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2 split: Llama-3 with single digits.
const QWEN2_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Every digit on its own (SmolLM / StarCoder family, applied before GPT2_RE).
const DIGITS_RE: &str = r"\p{N}";

/// What a `tokenizer.ggml.pre` name selects (llama.cpp `load()` + the BPE
/// tokenizer constructor).
pub(super) struct PreSpec {
    pub(super) regexes: &'static [&'static str],
    pub(super) ignore_merges: bool,
    pub(super) add_bos: bool,
    pub(super) clean_spaces: bool,
}

/// Pre-tokenizer names kvrun supports, for error messages.
pub(super) const SUPPORTED_PRE: &str = "llama3, llama-v3, llama-bpe, falcon3, falcon-h1, pixtral, midm-2.0, lfm2, \
jina-v5-nano, dbrx, smaug-bpe, qwen2, deepseek-r1-qwen, kormo, f2llmv2, megrez, stablelm2, hunyuan, \
solar-open, gpt-2, phi-2, gigachat, a.x-4.0, mellum, exaone4, mpt, olmo, jais, trillion, \
granite-docling, smollm, command-r, starcoder, refact, codeshell, exaone, minerva-7b, mellum2";

pub(super) fn pre_spec(name: &str) -> Option<PreSpec> {
    const L3: &[&str] = &[LLAMA3_RE];
    const Q2: &[&str] = &[QWEN2_RE];
    const G2: &[&str] = &[GPT2_RE];
    const SM: &[&str] = &[DIGITS_RE, GPT2_RE];
    let s = |regexes, ignore_merges, add_bos, clean_spaces| PreSpec {
        regexes,
        ignore_merges,
        add_bos,
        clean_spaces,
    };
    Some(match name {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => s(L3, true, true, true),
        "dbrx" | "smaug-bpe" => s(L3, false, false, true),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "hunyuan" | "solar-open" => {
            s(Q2, false, false, false)
        }
        "megrez" | "stablelm2" => s(Q2, false, false, true),
        "gpt-2" | "phi-2" | "gigachat" | "a.x-4.0" | "mellum" | "exaone4" | "mpt" | "olmo"
        | "jais" => s(G2, false, false, true),
        "trillion" | "granite-docling" => s(G2, false, false, false),
        "smollm" | "command-r" => s(SM, false, false, false),
        "starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
            s(SM, false, false, true)
        }
        _ => return None,
    })
}

/// GPT-2's byte -> unicode table (`bytes_to_unicode`).
pub(super) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let direct =
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let cp = if direct {
            b
        } else {
            n += 1;
            255 + n
        };
        table[b as usize] = char::from_u32(cp).unwrap_or('\0');
    }
    table
}

/// Longest whitespace run kvrun pre-tokenizes. The `\s+(?!\S)` alternative
/// costs fancy-regex one backtracking-stack entry per character, and its 1M
/// stack ends the split silently (the rest would become one piece) near 1M.
pub(super) const MAX_WHITESPACE_RUN: usize = 500_000;

/// Length in characters of the longest run of Unicode whitespace (`\s`).
pub(super) fn longest_whitespace_run(text: &str) -> usize {
    let (mut best, mut cur) = (0, 0);
    for c in text.chars() {
        if c.is_whitespace() {
            cur += 1;
            best = best.max(cur);
        } else {
            cur = 0;
        }
    }
    best
}

/// The pre-tokenizer settings named by `tokenizer.ggml.pre`; unknown or
/// missing is an error (llama.cpp silently degrades a missing one to its
/// `default` regex set; kvrun does not guess).
pub(super) fn read_pre_spec(meta: &Meta<'_>) -> Result<PreSpec> {
    let name = meta.str_opt("tokenizer.ggml.pre")?.unwrap_or("");
    if let Some(spec) = pre_spec(name) {
        return Ok(spec);
    }
    Err(tok_err(if name.is_empty() {
        format!(
            "unknown pre-tokenizer type '' (tokenizer.ggml.pre is missing; llama.cpp would fall back to \
             'default' with degraded quality, kvrun refuses to guess; supported: {SUPPORTED_PRE})"
        )
    } else {
        format!("unknown pre-tokenizer type '{name}' for gpt2 BPE (supported: {SUPPORTED_PRE})")
    }))
}

impl Tokenizer {
    /// Byte-level BPE: HF pre-tokenizer sequence and BPE model.
    pub(super) fn build_bpe(meta: &Meta<'_>, tokens: &[String], spec: &PreSpec) -> Result<Engine> {
        let merge_vals = meta.array("tokenizer.ggml.merges")?.ok_or_else(|| {
            tok_err("metadata key 'tokenizer.ggml.merges' is missing (needed by gpt2 BPE)")
        })?;
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        // llama.cpp keeps the first rank of a repeated pair. HF needs both
        // halves and their concatenation in the vocabulary, so a merge that
        // breaks this is dropped (llama.cpp would still apply it and then
        // emit the unknown merged piece byte by byte; SmolLM2 and R1 have no
        // such merges).
        let mut seen: HashSet<(&str, &str)> = HashSet::with_capacity(merge_vals.len());
        let mut merges = Vec::with_capacity(merge_vals.len());
        for (i, v) in merge_vals.iter().enumerate() {
            let m = v
                .as_str()
                .ok_or_else(|| tok_err(format!("tokenizer.ggml.merges[{i}] is not a string")))?;
            let Some(pos) = m
                .as_bytes()
                .iter()
                .skip(1)
                .position(|&b| b == b' ')
                .map(|p| p + 1)
            else {
                continue;
            };
            let (a, b) = (&m[..pos], &m[pos + 1..]);
            if !seen.insert((a, b)) {
                continue;
            }
            if !vocab.contains_key(a)
                || !vocab.contains_key(b)
                || !vocab.contains_key(&format!("{a}{b}"))
            {
                continue;
            }
            merges.push((a.to_owned(), b.to_owned()));
        }
        let model = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(spec.ignore_merges)
            .build()
            .map_err(|e| tok_err(format!("building the BPE model: {e}")))?;
        let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(spec.regexes.len() + 1);
        for re in spec.regexes {
            let split = Split::new(
                SplitPattern::Regex((*re).to_owned()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| tok_err(format!("pre-tokenizer regex {re:?}: {e}")))?;
            steps.push(split.into());
        }
        steps.push(ByteLevel::new(false, true, false).into());
        Ok(Engine::Bpe {
            pre: Sequence::new(steps),
            model: Box::new(model),
        })
    }

    /// BPE-tokenize one piece of ordinary text.
    pub(super) fn bpe_fragment(
        pre: &Sequence,
        model: &BPE,
        text: &str,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        let run = longest_whitespace_run(text);
        if run > MAX_WHITESPACE_RUN {
            return Err(tok_err(format!(
                "text has a run of {run} whitespace characters; runs longer than {MAX_WHITESPACE_RUN} \
                 exceed the pre-tokenizer regex engine's backtracking stack"
            )));
        }
        let mut pts = PreTokenizedString::from(text);
        pre.pre_tokenize(&mut pts)
            .map_err(|e| tok_err(format!("pre-tokenizing: {e}")))?;
        for (piece, _, _) in pts.get_splits(OffsetReferential::Original, OffsetType::None) {
            let toks = model
                .tokenize(piece)
                .map_err(|e| tok_err(format!("BPE: {e}")))?;
            out.extend(toks.iter().map(|t| t.id));
        }
        Ok(())
    }
}
