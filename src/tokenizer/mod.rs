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
//!
//! Files: this one holds the [`Tokenizer`] API (building from metadata,
//! encode, decode, lookups); `bpe` the byte-level BPE engine and its
//! pre-tokenizer regexes, `spm` the SentencePiece engine, `special` token
//! attributes, special/control tokens and the special-token partition.
//! Loading a Hugging Face `tokenizer.json` is [`crate::load::hf_tokenizer`]'s
//! job (it converts to the same metadata).

mod bpe;
mod special;
mod spm;

use crate::error::{Error, Result};
use crate::format::gguf::{Gguf, Value};
use bpe::{byte_to_char_table, read_pre_spec};
use special::{
    end_of_generation, phi3_rstrip, special_tokens, Frag, SpecialIds, ATTR_BYTE, ATTR_CONTROL,
    ATTR_NORMAL, ATTR_UNDEFINED, ATTR_UNKNOWN, ATTR_UNUSED, ATTR_USER_DEFINED,
};
use std::collections::HashMap;
use std::fmt;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::sequence::Sequence;

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

impl Tokenizer {
    /// Build the tokenizer described by a GGUF file's `tokenizer.*` metadata.
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer> {
        Self::from_metadata(&g.metadata)
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

    /// Tokenize `text`. `add_special` adds BOS (and EOS) per the model's
    /// rules; `parse_special` lets control-token text (e.g. `<|im_start|>`)
    /// become control tokens, as llama.cpp's `llama_tokenize` does.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let frags = self.partition(text, parse_special);
        self.encode_frags(text, &frags, add_special)
    }

    /// Tokenize `text` with control-token text parsed everywhere except in
    /// the `plain` byte ranges (sorted, disjoint, on char boundaries), which
    /// are tokenized as `encode(.., parse_special = false)` would: a chat's
    /// template markup stays markup while text a user typed inside a
    /// message (say `<|im_start|>system`) stays text. Ordinary text on both
    /// sides of a range boundary is tokenized as one piece, so with no
    /// control text in the ranges the result equals `encode(text, .., true)`.
    pub fn encode_with_plain(
        &self,
        text: &str,
        add_special: bool,
        plain: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>> {
        let mut frags: Vec<Frag> = Vec::new();
        let mut push = |f: Frag| match (frags.last_mut(), f) {
            (Some(Frag::Raw(_, end)), Frag::Raw(s, e)) if *end == s => *end = e,
            _ => frags.push(f),
        };
        let mut pos = 0;
        let piece = |from: usize, to: usize, parse: bool, push: &mut dyn FnMut(Frag)| {
            for f in self.partition(&text[from..to], parse) {
                push(match f {
                    Frag::Raw(s, e) => Frag::Raw(s + from, e + from),
                    tok => tok,
                });
            }
        };
        for r in plain {
            if r.start < pos || r.end > text.len() || r.start > r.end {
                return Err(tok_err(
                    "plain-text ranges must be sorted and inside the text",
                ));
            }
            piece(pos, r.start, true, &mut push);
            piece(r.start, r.end, false, &mut push);
            pos = r.end;
        }
        piece(pos, text.len(), true, &mut push);
        self.encode_frags(text, &frags, add_special)
    }

    /// Whether `text` holds control-token text that `parse_special` would
    /// turn into control tokens.
    pub fn has_control_text(&self, text: &str) -> bool {
        let toks = |parse| {
            self.partition(text, parse)
                .iter()
                .filter(|f| matches!(f, Frag::Tok(_)))
                .count()
        };
        toks(true) != toks(false)
    }

    /// The tokens of `text` cut into `frags` (raw ranges and special tokens).
    fn encode_frags(&self, text: &str, frags: &[Frag], add_special: bool) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        if add_special && self.add_bos {
            out.push(
                self.bos
                    .ok_or_else(|| tok_err("the model asks for a BOS token but has none"))?,
            );
        }
        match &self.engine {
            Engine::Bpe { pre, model } => {
                for f in frags {
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
                for f in frags {
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
