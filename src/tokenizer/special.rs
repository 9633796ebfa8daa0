//! Special and control tokens, llama.cpp style: token attributes, the texts
//! that identify end-of-generation / EOT / EOM / FIM tokens, BOS/EOS ids and
//! their defaults, and the partition of a text at special-token texts
//! (`tokenizer_st_partition`) that runs before any pre-tokenization.

use super::{Meta, Tokenizer};
use crate::error::Result;
use std::collections::{HashMap, HashSet};

// Token attributes (llama.cpp `llama_token_attr`, reduced to what tokenizing
// and detokenizing look at).
pub(super) const ATTR_UNDEFINED: u16 = 1 << 0;
pub(super) const ATTR_UNKNOWN: u16 = 1 << 1;
pub(super) const ATTR_UNUSED: u16 = 1 << 2;
pub(super) const ATTR_NORMAL: u16 = 1 << 3;
pub(super) const ATTR_CONTROL: u16 = 1 << 4;
pub(super) const ATTR_USER_DEFINED: u16 = 1 << 5;
pub(super) const ATTR_BYTE: u16 = 1 << 6;
pub(super) const ATTR_RSTRIP: u16 = 1 << 7;

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

/// A piece of the input after special-token partitioning.
#[derive(Clone, Copy)]
pub(super) enum Frag {
    /// Byte range of ordinary text.
    Raw(usize, usize),
    /// A special token matched by its text.
    Tok(u32),
}

/// Is `b` a C `isspace` byte (what llama.cpp's rstrip of specials skips)?
pub(super) fn c_isspace(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

impl Tokenizer {
    /// Cut `text` at special-token texts (llama.cpp `tokenizer_st_partition`):
    /// each special token, longest first, splits every remaining raw piece.
    pub(super) fn partition(&self, text: &str, parse_special: bool) -> Vec<Frag> {
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
}

/// Special-token ids named by the file (or llama.cpp's per-model defaults).
#[derive(Clone, Copy)]
pub(super) struct SpecialIds {
    pub(super) bos: Option<u32>,
    pub(super) eos: Option<u32>,
    pub(super) eot: Option<u32>,
    pub(super) eom: Option<u32>,
    /// FIM prefix, suffix, middle, pad, repo, separator.
    pub(super) fim: [Option<u32>; 6],
}

impl SpecialIds {
    pub(super) fn read(meta: &Meta<'_>, n: usize, is_bpe: bool) -> Result<SpecialIds> {
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
        // The ids generation starts and stops on must name a token: an id
        // past the vocabulary is a corrupt file, not a default (llama.cpp
        // only warns, then never stops or starts from the wrong token).
        let strict = |key: &str, default: Option<u32>| -> Result<Option<u32>> {
            match meta.int_opt(key)? {
                None => Ok(default),
                Some(id) if (0..n as i64).contains(&id) => Ok(Some(id as u32)),
                Some(id) => Err(super::tok_err(format!(
                    "metadata key '{key}': token id {id} is outside the vocabulary of {n} tokens"
                ))),
            }
        };
        Ok(SpecialIds {
            bos: strict("tokenizer.ggml.bos_token_id", def_bos)?,
            eos: strict("tokenizer.ggml.eos_token_id", def_eos)?,
            eot: strict("tokenizer.ggml.eot_token_id", None)?,
            eom: strict("tokenizer.ggml.eom_token_id", None)?,
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
pub(super) fn end_of_generation(
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
pub(super) fn special_tokens(tokens: &[String], attrs: &[u16]) -> Vec<u32> {
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
pub(super) fn phi3_rstrip(token_to_id: &HashMap<String, u32>, specials: &[u32], attrs: &mut [u16]) {
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
