//! Tokenizer built from GGUF metadata, matching llama.cpp token for token.
//!
//! Two tokenizer models are supported:
//!
//! * `gpt2` (byte-level BPE). The pre-tokenizer is a Hugging Face `tokenizers`
//!   `Sequence` of `Split(regex, Isolated)` steps, one per regex of the file's
//!   `tokenizer.ggml.pre` type (the same regex sets llama.cpp uses, see
//!   `src/llama-vocab.cpp`), followed by `ByteLevel(add_prefix_space=false,
//!   use_regex=false)`. The model is an HF `BPE` over `tokenizer.ggml.tokens` and
//!   `tokenizer.ggml.merges`, with `ignore_merges` for the Llama-3 family. An
//!   unknown or missing pre-type is an error, never a silent fallback.
//! * `llama` (SentencePiece BPE, "SPM"). A port of llama.cpp's algorithm:
//!   spaces become `▁`, an optional `▁` prefix is added, adjacent symbols are
//!   merged greedily by the highest vocabulary score, and pieces that never
//!   become tokens are emitted as `<0xNN>` byte tokens.
//!
//! Special tokens follow llama.cpp (`tokenizer_st_partition`): before any
//! pre-tokenization the text is cut at the text of every control, unknown and
//! user-defined token, longest first. Control and unknown tokens are only
//! matched when `parse_special` is set; user-defined ones always are.
//! Token attributes, BOS/EOS defaults and the end-of-generation set are derived
//! the way `llama_vocab::impl::load` derives them.

use crate::error::{Error, Result};
use crate::load::gguf::{Gguf, Value};
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::fmt;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{
    Model, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, SplitDelimiterBehavior,
};

// Token attributes (llama.cpp `llama_token_attr`, reduced to what tokenizing
// and detokenizing look at).
const ATTR_UNDEFINED: u16 = 1 << 0;
const ATTR_UNKNOWN: u16 = 1 << 1;
const ATTR_UNUSED: u16 = 1 << 2;
const ATTR_NORMAL: u16 = 1 << 3;
const ATTR_CONTROL: u16 = 1 << 4;
const ATTR_USER_DEFINED: u16 = 1 << 5;
const ATTR_BYTE: u16 = 1 << 6;
const ATTR_RSTRIP: u16 = 1 << 7;

/// The GPT-2 split, plus the trailing `\s+` that llama.cpp's hand-written
/// matcher for it also applies.
const GPT2_RE: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama-3 split (llama.cpp spells the case-insensitive contractions out).
const LLAMA3_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2 split: Llama-3 with single digits.
const QWEN2_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Every digit on its own (SmolLM / StarCoder family, applied before GPT2_RE).
const DIGITS_RE: &str = r"\p{N}";

/// Token texts that llama.cpp treats as end of generation (`special_eog_ids`).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];
/// Texts llama.cpp uses to find the EOT token when the file does not name it.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];

/// What a `tokenizer.ggml.pre` name selects (llama.cpp `load()` + the BPE
/// tokenizer constructor).
struct PreSpec {
    regexes: &'static [&'static str],
    ignore_merges: bool,
    add_bos: bool,
    clean_spaces: bool,
}

/// Pre-tokenizer names kvrun supports, for error messages.
const SUPPORTED_PRE: &str = "llama3, llama-v3, llama-bpe, falcon3, falcon-h1, pixtral, midm-2.0, lfm2, \
jina-v5-nano, dbrx, smaug-bpe, qwen2, deepseek-r1-qwen, kormo, f2llmv2, megrez, stablelm2, hunyuan, \
solar-open, gpt-2, phi-2, gigachat, a.x-4.0, mellum, exaone4, mpt, olmo, jais, trillion, \
granite-docling, smollm, command-r, starcoder, refact, codeshell, exaone, minerva-7b, mellum2";

fn pre_spec(name: &str) -> Option<PreSpec> {
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

/// The model-specific part of the tokenizer.
enum Engine {
    /// Byte-level BPE through HF `tokenizers`.
    Bpe { pre: Sequence, model: Box<BPE> },
    /// SentencePiece-style BPE (llama.cpp `llm_tokenizer_spm`).
    Spm {
        scores: Vec<f32>,
        /// Token for each byte value (`<0xNN>`, else the one-byte text).
        byte_tokens: Box<[Option<u32>; 256]>,
    },
}

/// A piece of the input after special-token partitioning.
#[derive(Clone, Copy)]
enum Frag {
    /// Byte range of ordinary text.
    Raw(usize, usize),
    /// A special token matched by its text.
    Tok(u32),
}

/// A tokenizer equivalent to llama.cpp's for a GGUF vocabulary.
pub struct Tokenizer {
    model_type: String,
    pre_type: String,
    tokens: Vec<String>,
    attrs: Vec<u16>,
    token_to_id: HashMap<String, u32>,
    /// Control / user-defined / unknown tokens, longest text first.
    specials: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
    eog: Vec<bool>,
    /// GPT-2 byte-to-unicode inverse: char code -> byte (-1 if unmapped).
    char_to_byte: Vec<i16>,
    engine: Engine,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("model_type", &self.model_type)
            .field("pre_type", &self.pre_type)
            .field("n_vocab", &self.tokens.len())
            .field("n_special", &self.specials.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .finish_non_exhaustive()
    }
}

fn tok_err(msg: impl Into<String>) -> Error {
    Error::Tokenizer(msg.into())
}

/// Metadata lookup over a key/value list.
struct Meta<'a> {
    map: HashMap<&'a str, &'a Value>,
}

impl<'a> Meta<'a> {
    fn new(kv: &'a [(String, Value)]) -> Meta<'a> {
        Meta {
            map: kv.iter().map(|(k, v)| (k.as_str(), v)).collect(),
        }
    }
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).copied()
    }
    fn str_opt(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| {
                tok_err(format!(
                    "metadata key '{key}' must be a string, found {}",
                    v.type_name()
                ))
            }),
        }
    }
    fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(tok_err(format!(
                "metadata key '{key}' must be a bool, found {}",
                v.type_name()
            ))),
        }
    }
    fn int_opt(&self, key: &str) -> Result<Option<i64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_i64().map(Some).ok_or_else(|| {
                tok_err(format!(
                    "metadata key '{key}' must be an integer, found {}",
                    v.type_name()
                ))
            }),
        }
    }
    fn array(&self, key: &str) -> Result<Option<&'a [Value]>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_array().map(Some).ok_or_else(|| {
                tok_err(format!(
                    "metadata key '{key}' must be an array, found {}",
                    v.type_name()
                ))
            }),
        }
    }
}

/// GPT-2's byte -> unicode table (`bytes_to_unicode`).
fn byte_to_char_table() -> [char; 256] {
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
const MAX_WHITESPACE_RUN: usize = 500_000;

/// Length in characters of the longest run of Unicode whitespace (`\s`).
fn longest_whitespace_run(text: &str) -> usize {
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

/// Is `b` a C `isspace` byte (what llama.cpp's rstrip of specials skips)?
fn c_isspace(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

impl Tokenizer {
    /// Build the tokenizer described by a GGUF file's `tokenizer.*` metadata.
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer> {
        Self::from_metadata(&g.metadata)
    }

    /// Build from a Hugging Face `tokenizer.json` (byte-level BPE), reading
    /// BOS/EOS and flags from `tokenizer_config.json` / `config.json` beside it.
    pub fn from_hf_json(path: &std::path::Path) -> Result<Tokenizer> {
        Self::from_metadata(&crate::load::safetensors::hf_tokenizer_metadata(path)?)
    }

    /// [`Tokenizer::from_hf_json`] on `dir/tokenizer.json`.
    pub fn from_hf_dir(dir: &std::path::Path) -> Result<Tokenizer> {
        Self::from_hf_json(&dir.join("tokenizer.json"))
    }

    /// Build the tokenizer from GGUF-style metadata key/value pairs (the
    /// `tokenizer.*` keys, plus `general.name` for a model-specific quirk).
    pub fn from_metadata(kv: &[(String, Value)]) -> Result<Tokenizer> {
        let meta = Meta::new(kv);
        let model_type = meta
            .str_opt("tokenizer.ggml.model")?
            .ok_or_else(|| tok_err("metadata key 'tokenizer.ggml.model' is missing"))?
            .to_owned();
        let spec = match model_type.as_str() {
            "gpt2" => Some(read_pre_spec(&meta)?),
            "llama" => None,
            other => {
                return Err(tok_err(format!(
                    "unsupported tokenizer model '{other}' (supported: gpt2, llama)"
                )))
            }
        };
        let is_bpe = spec.is_some();
        let pre_type = match &spec {
            Some(_) => meta.str_opt("tokenizer.ggml.pre")?.unwrap_or("").to_owned(),
            None => "default".to_owned(),
        };

        let (tokens, mut attrs) = read_vocab(&meta)?;
        let mut token_to_id = HashMap::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            token_to_id.insert(t.clone(), i as u32);
        }
        let ids = SpecialIds::read(&meta, tokens.len(), is_bpe)?;

        // BOS/EOS flags: SPM and the Llama-3 family add BOS; the file decides last.
        let add_bos = meta
            .bool_opt("tokenizer.ggml.add_bos_token")?
            .unwrap_or(spec.as_ref().is_none_or(|s| s.add_bos));
        let add_eos = meta
            .bool_opt("tokenizer.ggml.add_eos_token")?
            .unwrap_or(false);
        let add_space_prefix = meta
            .bool_opt("tokenizer.ggml.add_space_prefix")?
            .unwrap_or(!is_bpe);
        let clean_spaces = spec.as_ref().is_some_and(|s| s.clean_spaces);

        let eog = end_of_generation(&token_to_id, &mut attrs, ids);
        let specials = special_tokens(&tokens, &attrs);
        let name = meta.str_opt("general.name")?.unwrap_or("").to_lowercase();
        if name.contains("phi-3") || name.contains("phi3") {
            phi3_rstrip(&token_to_id, &specials, &mut attrs);
        }

        let engine = match &spec {
            Some(spec) => Self::build_bpe(&meta, &tokens, spec)?,
            None => Self::build_spm(&meta, &tokens, &token_to_id)?,
        };
        let mut char_to_byte = vec![-1i16; 0x144];
        for (b, c) in byte_to_char_table().iter().enumerate() {
            if let Some(slot) = char_to_byte.get_mut(*c as usize) {
                *slot = b as i16;
            }
        }

        Ok(Tokenizer {
            model_type,
            pre_type,
            tokens,
            attrs,
            token_to_id,
            specials,
            bos: ids.bos,
            eos: ids.eos,
            add_bos,
            add_eos,
            add_space_prefix,
            clean_spaces,
            eog,
            char_to_byte,
            engine,
        })
    }

    /// Byte-level BPE: HF pre-tokenizer sequence and BPE model.
    fn build_bpe(meta: &Meta<'_>, tokens: &[String], spec: &PreSpec) -> Result<Engine> {
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

    /// SentencePiece BPE: scores and byte-fallback tokens.
    fn build_spm(
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

    /// Tokenize `text`. `add_special` adds BOS (and EOS) per the model's
    /// rules; `parse_special` lets control-token text (e.g. `<|im_start|>`)
    /// become control tokens, as llama.cpp's `llama_tokenize` does.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let frags = self.partition(text, parse_special);
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        if add_special && self.add_bos {
            out.push(
                self.bos
                    .ok_or_else(|| tok_err("the model asks for a BOS token but has none"))?,
            );
        }
        match &self.engine {
            Engine::Bpe { pre, model } => {
                for f in &frags {
                    match *f {
                        Frag::Tok(id) => out.push(id),
                        Frag::Raw(s, e) => Self::bpe_fragment(pre, model, &text[s..e], &mut out)?,
                    }
                }
            }
            Engine::Spm {
                scores,
                byte_tokens,
            } => {
                let mut prev_special = true;
                for f in &frags {
                    match *f {
                        Frag::Tok(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                        Frag::Raw(s, e) => {
                            let mut piece = String::with_capacity(e - s + 3);
                            if self.add_space_prefix && prev_special {
                                piece.push(' ');
                            }
                            piece.push_str(&text[s..e]);
                            let escaped = piece.replace(' ', "▁");
                            self.spm_fragment(scores, byte_tokens, &escaped, &mut out)?;
                            prev_special = false;
                        }
                    }
                }
            }
        }
        if add_special && self.add_eos {
            out.push(
                self.eos
                    .ok_or_else(|| tok_err("the model asks for an EOS token but has none"))?,
            );
        }
        Ok(out)
    }

    /// Cut `text` at special-token texts (llama.cpp `tokenizer_st_partition`):
    /// each special token, longest first, splits every remaining raw piece.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Frag> {
        let mut frags = if text.is_empty() {
            Vec::new()
        } else {
            vec![Frag::Raw(0, text.len())]
        };
        let bytes = text.as_bytes();
        for &id in &self.specials {
            let attr = self.attrs[id as usize];
            if !parse_special && attr & (ATTR_CONTROL | ATTR_UNKNOWN) != 0 {
                continue;
            }
            let pat = self.tokens[id as usize].as_str();
            if !text.contains(pat) {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                let Frag::Raw(mut s, e) = f else {
                    next.push(f);
                    continue;
                };
                loop {
                    let Some(rel) = text[s..e].find(pat) else {
                        if s < e {
                            next.push(Frag::Raw(s, e));
                        }
                        break;
                    };
                    let m = s + rel;
                    if m > s {
                        next.push(Frag::Raw(s, m));
                    }
                    next.push(Frag::Tok(id));
                    s = m + pat.len();
                    if attr & ATTR_RSTRIP != 0 {
                        while s < e && c_isspace(bytes[s]) {
                            s += 1;
                        }
                    }
                    if s >= e {
                        break;
                    }
                }
            }
            frags = next;
        }
        frags
    }

    /// BPE-tokenize one piece of ordinary text.
    fn bpe_fragment(pre: &Sequence, model: &BPE, text: &str, out: &mut Vec<u32>) -> Result<()> {
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

    /// SPM-tokenize one piece whose spaces are already escaped to `▁`
    /// (llama.cpp `llm_tokenizer_spm_session::tokenize`).
    fn spm_fragment(
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

    /// Raw bytes of one token's text as llama.cpp's `token_to_piece` renders
    /// it: byte-level decoded for BPE, `▁` -> space for SPM, `<0xNN>` as the
    /// byte; control and unknown tokens as their text only when `special` is
    /// set; user-defined tokens always as their text; unused tokens and
    /// out-of-range ids as nothing.
    pub fn token_bytes(&self, id: u32, special: bool) -> Vec<u8> {
        let (Some(text), Some(&attr)) = (self.tokens.get(id as usize), self.attrs.get(id as usize))
        else {
            return Vec::new();
        };
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL) != 0 {
            return if special {
                text.as_bytes().to_vec()
            } else {
                Vec::new()
            };
        }
        if attr & ATTR_USER_DEFINED != 0 {
            return text.as_bytes().to_vec();
        }
        if attr & ATTR_NORMAL != 0 {
            return match self.engine {
                Engine::Spm { .. } => text.replace('▁', " ").into_bytes(),
                Engine::Bpe { .. } => self.byte_decode(text),
            };
        }
        if attr & ATTR_BYTE != 0 {
            return text
                .get(3..5)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .map(|b| vec![b])
                .unwrap_or_default();
        }
        Vec::new()
    }

    /// GPT-2 byte-level decoding of a vocabulary string (llama.cpp
    /// `llama_decode_text`, including its `[UNK_BYTE_0x..]` marker for
    /// characters outside the byte table).
    fn byte_decode(&self, text: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(text.len());
        for c in text.chars() {
            match self.char_to_byte.get(c as usize) {
                Some(&b) if b >= 0 => out.push(b as u8),
                _ => {
                    out.extend_from_slice(b"[UNK_BYTE_0x");
                    let mut buf = [0u8; 4];
                    for b in c.encode_utf8(&mut buf).as_bytes() {
                        out.extend_from_slice(format!("{b:02x}").as_bytes());
                    }
                    out.extend_from_slice(text.as_bytes());
                    out.push(b']');
                }
            }
        }
        out
    }

    /// Detokenize like llama.cpp's `llama_detokenize(.., remove_special =
    /// false, unparse_special = special)`: concatenated token bytes, with the
    /// SPM leading space removed and, for the pre-types that ask for it,
    /// Hugging Face's clean-up of spaces before punctuation. Invalid UTF-8 is
    /// replaced by U+FFFD.
    pub fn decode(&self, ids: &[u32], special: bool) -> String {
        let mut out = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let piece = self.token_bytes(id, special);
            let skip = usize::from(i == 0 && self.add_space_prefix && piece.first() == Some(&b' '));
            out.extend_from_slice(&piece[skip..]);
        }
        if self.clean_spaces {
            out = clean_up_spaces(&out);
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    /// Number of tokens in the vocabulary.
    pub fn n_vocab(&self) -> usize {
        self.tokens.len()
    }

    /// Beginning-of-sequence token, if the model has one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence token, if the model has one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `encode(.., add_special = true, ..)` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Does this token end generation (EOS, EOT, EOM, the FIM pad/repo/sep
    /// tokens, or one of llama.cpp's end-of-turn texts such as `<|im_end|>`)?
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.get(id as usize).copied().unwrap_or(false)
    }

    /// Raw vocabulary string of a token (empty for an out-of-range id).
    pub fn token_text(&self, id: u32) -> &str {
        self.tokens
            .get(id as usize)
            .map(String::as_str)
            .unwrap_or("")
    }

    /// Id of the token whose vocabulary string is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// `tokenizer.ggml.pre` (`"default"` for SPM).
    pub fn pre_type(&self) -> &str {
        &self.pre_type
    }

    /// `tokenizer.ggml.model` (`"gpt2"` or `"llama"`).
    pub fn model_type(&self) -> &str {
        &self.model_type
    }
}

/// The pre-tokenizer settings named by `tokenizer.ggml.pre`; unknown or
/// missing is an error (llama.cpp silently degrades a missing one to its
/// `default` regex set; kvrun does not guess).
fn read_pre_spec(meta: &Meta<'_>) -> Result<PreSpec> {
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

/// Token strings and their attributes from `tokenizer.ggml.tokens` /
/// `tokenizer.ggml.token_type` (every token normal when types are absent).
fn read_vocab(meta: &Meta<'_>) -> Result<(Vec<String>, Vec<u16>)> {
    let vals = meta
        .array("tokenizer.ggml.tokens")?
        .ok_or_else(|| tok_err("metadata key 'tokenizer.ggml.tokens' is missing"))?;
    let n = vals.len();
    if n == 0 || n > u32::MAX as usize / 2 {
        return Err(tok_err(format!("vocabulary has {n} tokens")));
    }
    let mut tokens = Vec::with_capacity(n);
    for (i, v) in vals.iter().enumerate() {
        let s = v
            .as_str()
            .ok_or_else(|| tok_err(format!("tokenizer.ggml.tokens[{i}] is not a string")))?;
        // llama.cpp reads token strings as C strings (cut at the first NUL)
        // and renames empty ones so they can never match text.
        let s = s.split('\0').next().unwrap_or_default();
        tokens.push(if s.is_empty() {
            format!("[EMPTY_{i}]")
        } else {
            s.to_owned()
        });
    }
    let mut attrs = vec![ATTR_NORMAL; n];
    if let Some(types) = meta.array("tokenizer.ggml.token_type")? {
        if types.len() < n {
            return Err(tok_err(format!(
                "tokenizer.ggml.token_type has {} entries for {n} tokens",
                types.len()
            )));
        }
        for (i, (t, a)) in types.iter().zip(attrs.iter_mut()).enumerate() {
            *a = match t.as_i64() {
                Some(1) => ATTR_NORMAL,
                Some(2) => ATTR_UNKNOWN,
                Some(3) => ATTR_CONTROL,
                Some(4) => ATTR_USER_DEFINED,
                Some(5) => ATTR_UNUSED,
                Some(6) => ATTR_BYTE,
                Some(_) => ATTR_UNDEFINED,
                None => {
                    return Err(tok_err(format!(
                        "tokenizer.ggml.token_type[{i}] is not an integer"
                    )))
                }
            };
        }
    }
    Ok((tokens, attrs))
}

/// Special-token ids named by the file (or llama.cpp's per-model defaults).
#[derive(Clone, Copy)]
struct SpecialIds {
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    eom: Option<u32>,
    /// FIM prefix, suffix, middle, pad, repo, separator.
    fim: [Option<u32>; 6],
}

impl SpecialIds {
    fn read(meta: &Meta<'_>, n: usize, is_bpe: bool) -> Result<SpecialIds> {
        let in_range = |id: i64| (0..n as i64).contains(&id).then_some(id as u32);
        // An out-of-range id in the file keeps the default, as in llama.cpp.
        let id_key = |key: &str, default: Option<u32>| -> Result<Option<u32>> {
            Ok(meta.int_opt(key)?.and_then(in_range).or(default))
        };
        // llama.cpp's defaults: BOS = EOS = 11 for BPE, BOS 1 / EOS 2 for SPM.
        let (def_bos, def_eos) = if is_bpe {
            (in_range(11), in_range(11))
        } else {
            (in_range(1), in_range(2))
        };
        let mut fim = [None; 6];
        let fim_keys = [
            (
                "tokenizer.ggml.fim_pre_token_id",
                "tokenizer.ggml.prefix_token_id",
            ),
            (
                "tokenizer.ggml.fim_suf_token_id",
                "tokenizer.ggml.suffix_token_id",
            ),
            (
                "tokenizer.ggml.fim_mid_token_id",
                "tokenizer.ggml.middle_token_id",
            ),
            ("tokenizer.ggml.fim_pad_token_id", ""),
            ("tokenizer.ggml.fim_rep_token_id", ""),
            ("tokenizer.ggml.fim_sep_token_id", ""),
        ];
        for (slot, (key, old_key)) in fim.iter_mut().zip(fim_keys) {
            *slot = id_key(key, None)?;
            if !old_key.is_empty() {
                *slot = id_key(old_key, *slot)?;
            }
        }
        Ok(SpecialIds {
            bos: id_key("tokenizer.ggml.bos_token_id", def_bos)?,
            eos: id_key("tokenizer.ggml.eos_token_id", def_eos)?,
            eot: id_key("tokenizer.ggml.eot_token_id", None)?,
            eom: id_key("tokenizer.ggml.eom_token_id", None)?,
            fim,
        })
    }
}

/// The end-of-generation flags per token, with llama.cpp's attribute fix-ups
/// (tokens found by their EOT/EOM/FIM/EOG text become control tokens).
///
/// llama.cpp picks the first text match in hash-map order when the file does
/// not name an EOT/EOM/FIM token; kvrun takes the lowest id and marks every
/// match as control, which only differs for vocabularies with several such
/// texts.
fn end_of_generation(
    token_to_id: &HashMap<String, u32>,
    attrs: &mut [u16],
    ids: SpecialIds,
) -> Vec<bool> {
    let find = |t: &str| token_to_id.get(t).copied();
    let detect = |slot: Option<u32>, texts: &[&str], attrs: &mut [u16]| -> Option<u32> {
        if slot.is_some() {
            return slot;
        }
        let mut hits: Vec<u32> = texts.iter().filter_map(|t| find(t)).collect();
        hits.sort_unstable();
        for &h in &hits {
            attrs[h as usize] |= ATTR_CONTROL;
        }
        hits.first().copied()
    };
    let eot = detect(ids.eot, EOT_TEXTS, attrs);
    let eom = detect(ids.eom, EOM_TEXTS, attrs);
    let fim_texts = [
        FIM_PRE_TEXTS,
        FIM_SUF_TEXTS,
        FIM_MID_TEXTS,
        FIM_PAD_TEXTS,
        FIM_REP_TEXTS,
        FIM_SEP_TEXTS,
    ];
    let mut fim = ids.fim;
    for (slot, texts) in fim.iter_mut().zip(fim_texts) {
        *slot = detect(*slot, texts, attrs);
    }

    // FIM pad / repo / separator, the end-of-turn texts, EOS, EOT, EOM.
    let mut set: HashSet<u32> = fim[3..].iter().flatten().copied().collect();
    for t in EOG_TEXTS {
        if let Some(id) = find(t) {
            set.insert(id);
            attrs[id as usize] |= ATTR_CONTROL;
        }
    }
    // gpt-oss: these are always rendered.
    for t in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
        if let Some(id) = find(t) {
            attrs[id as usize] = ATTR_USER_DEFINED;
        }
    }
    set.extend([ids.eos, eot, eom].into_iter().flatten());
    // gpt-oss / solar-open: <|end|> ends a message, not the generation.
    let has = |set: &HashSet<u32>, text: &str| find(text).is_some_and(|id| set.contains(&id));
    if let Some(end) = find("<|end|>").filter(|id| set.contains(id)) {
        if (has(&set, "<|return|>") && has(&set, "<|call|>"))
            || (has(&set, "<|calls|>") && has(&set, "<|flush|>"))
        {
            set.remove(&end);
            attrs[end as usize] = ATTR_USER_DEFINED;
        }
    }
    // gemma4 / plamo: </s> is an ordinary token there.
    if let Some(s) = find("</s>").filter(|id| set.contains(id)) {
        if has(&set, "<|tool_response>") || has(&set, "<|plamo:eos|>") {
            set.remove(&s);
            attrs[s as usize] = ATTR_NORMAL;
        }
    }
    let mut eog = vec![false; attrs.len()];
    for id in set {
        eog[id as usize] = true;
    }
    eog
}

/// Control, user-defined and unknown tokens, longest text first (ties by id).
fn special_tokens(tokens: &[String], attrs: &[u16]) -> Vec<u32> {
    let mut specials: Vec<u32> = (0..tokens.len() as u32)
        .filter(|&i| attrs[i as usize] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0)
        .collect();
    specials.sort_by(|&a, &b| {
        tokens[b as usize]
            .len()
            .cmp(&tokens[a as usize].len())
            .then(a.cmp(&b))
    });
    specials
}

/// Phi-3 (by `general.name`): special tokens swallow whitespace to their
/// right, except `<unk>`, `<s>` and `<|endoftext|>`.
fn phi3_rstrip(token_to_id: &HashMap<String, u32>, specials: &[u32], attrs: &mut [u16]) {
    for &id in specials {
        attrs[id as usize] |= ATTR_RSTRIP;
    }
    if let Some(&id) = token_to_id.get("</s>") {
        attrs[id as usize] |= ATTR_RSTRIP;
    }
    for t in ["<unk>", "<s>", "<|endoftext|>"] {
        if let Some(&id) = token_to_id.get(t) {
            attrs[id as usize] &= !ATTR_RSTRIP;
        }
    }
}

/// llama.cpp's `clean_spaces` pass of `llama_detokenize` (HF
/// `clean_up_tokenization_spaces`): drop the space before `?!.,`, around a
/// lone `'`, and before the contractions `'s 'm 're 've`.
fn clean_up_spaces(text: &[u8]) -> Vec<u8> {
    let mut t = text.to_vec();
    // Pass 1: " ?", " !", " .", " ,".
    let mut total = usize::from(!t.is_empty());
    for i in 1..t.len() {
        let x = t[i];
        if t[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            total -= 1;
        }
        t[total] = x;
        total += 1;
    }
    t.truncate(total);
    // Pass 2: " ' " -> "'".
    let n2 = t.len();
    let mut total = usize::from(n2 > 0);
    let mut i = 1;
    while i < n2 {
        let x = t[i];
        if x == b'\'' && i + 1 < n2 && t[i - 1] == b' ' && t[i + 1] == b' ' {
            // Remove the previous space and blank out (skip) the next one.
            total -= 1;
            i += 1;
            t[i] = 0;
        }
        t[total] = x;
        total += 1;
        i += 1;
    }
    t.truncate(total);
    // Pass 3: " 's", " 'm", " 're", " 've".
    let n3 = t.len();
    let mut total = usize::from(n3 > 0);
    for i in 1..n3 {
        let x = t[i];
        if t[i - 1] == b' ' && x == b'\'' && i + 1 < n3 {
            let x1 = t[i + 1];
            if x1 == b's' || x1 == b'm' {
                total -= 1;
            } else if i + 2 < n3 {
                let x2 = t[i + 2];
                if (x1 == b'r' || x1 == b'v') && x2 == b'e' {
                    total -= 1;
                }
            }
        }
        t[total] = x;
        total += 1;
    }
    t.truncate(total);
    t
}
