//! Hugging Face tokenizers: `tokenizer.json` (byte-level BPE), with
//! `tokenizer_config.json` and `config.json` beside it, converted to the GGUF
//! `tokenizer.*` metadata llama.cpp's converter would write and built by
//! [`Tokenizer::from_metadata`], so an HF directory tokenizes exactly like
//! its GGUF conversion.

use crate::error::Result;
use crate::format::gguf::Value;
use crate::load::json::{bad, read_json};
use crate::tokenizer::Tokenizer;
use serde_json::Value as Json;
use std::path::Path;

/// Build the tokenizer of a Hugging Face `tokenizer.json`, reading BOS/EOS
/// and flags from `tokenizer_config.json` / `config.json` beside it.
pub fn from_json(path: &Path) -> Result<Tokenizer> {
    Tokenizer::from_metadata(&metadata(path)?)
}

/// [`from_json`] on `dir/tokenizer.json`.
pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
    from_json(&dir.join("tokenizer.json"))
}

/// HF's spelling of the Llama-3 split regex.
const HF_LLAMA3_RE: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// HF's spelling of the Qwen2 split regex.
const HF_QWEN2_RE: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Flatten a pre-tokenizer (nested `Sequence`s) into its steps.
fn pre_steps<'j>(v: &'j Json, out: &mut Vec<&'j Json>) {
    if v.get("type").and_then(Json::as_str) == Some("Sequence") {
        for s in v
            .get("pretokenizers")
            .and_then(Json::as_array)
            .into_iter()
            .flatten()
        {
            pre_steps(s, out);
        }
    } else if !v.is_null() {
        out.push(v);
    }
}

/// The llama.cpp `tokenizer.ggml.pre` name equivalent to a tokenizer.json
/// pre-tokenizer, or an error describing what was found.
fn hf_pre_type(path: &Path, tj: &Json, clean: Option<bool>) -> Result<&'static str> {
    let mut steps = Vec::new();
    pre_steps(tj.get("pre_tokenizer").unwrap_or(&Json::Null), &mut steps);
    let ty = |s: &Json| {
        s.get("type")
            .and_then(Json::as_str)
            .unwrap_or("")
            .to_owned()
    };
    let desc: Vec<String> = steps
        .iter()
        .map(|s| match ty(s).as_str() {
            "Split" => format!(
                "Split({})",
                s.get("pattern")
                    .and_then(|p| p.get("Regex").or_else(|| p.get("String")))
                    .unwrap_or(&Json::Null)
            ),
            "ByteLevel" => format!(
                "ByteLevel(use_regex={})",
                s.get("use_regex").unwrap_or(&Json::Null)
            ),
            "Digits" => format!(
                "Digits(individual={})",
                s.get("individual_digits").unwrap_or(&Json::Null)
            ),
            t => t.to_owned(),
        })
        .collect();
    let is_bytelevel = |s: &Json, regex: bool| {
        ty(s) == "ByteLevel" && s.get("use_regex").and_then(Json::as_bool).unwrap_or(true) == regex
    };
    let split_re = |s: &Json| -> Option<String> {
        (ty(s) == "Split")
            .then(|| s.get("pattern")?.get("Regex")?.as_str().map(str::to_owned))
            .flatten()
    };
    let ignore_merges = tj
        .get("model")
        .and_then(|m| m.get("ignore_merges"))
        .and_then(Json::as_bool)
        .unwrap_or(false);
    let name = match steps.as_slice() {
        [s, b] if is_bytelevel(b, false) && split_re(s).as_deref() == Some(HF_LLAMA3_RE) => {
            match (ignore_merges, clean.unwrap_or(true)) {
                (true, _) => "llama-bpe",
                (false, _) => "dbrx",
            }
        }
        [s, b] if is_bytelevel(b, false) && split_re(s).as_deref() == Some(HF_QWEN2_RE) => {
            if clean.unwrap_or(false) {
                "megrez"
            } else {
                "qwen2"
            }
        }
        [d, b]
            if ty(d) == "Digits"
                && d.get("individual_digits").and_then(Json::as_bool) == Some(true)
                && is_bytelevel(b, true) =>
        {
            if clean.unwrap_or(false) {
                "starcoder"
            } else {
                "smollm"
            }
        }
        [b] if is_bytelevel(b, true) => {
            if clean.unwrap_or(true) {
                "gpt-2"
            } else {
                "trillion"
            }
        }
        _ => {
            return Err(bad(
                path,
                format!("unsupported pre-tokenizer [{}] (supported: GPT-2, SmolLM/StarCoder, Llama-3, Qwen2 byte-level BPE)", desc.join(", ")),
            ))
        }
    };
    Ok(name)
}

/// Convert a Hugging Face `tokenizer.json` (plus `tokenizer_config.json` and
/// `config.json` next to it, when present) into the GGUF `tokenizer.*`
/// metadata llama.cpp's converter would write, for [`Tokenizer::from_metadata`].
/// Byte-level BPE only.
pub fn metadata(path: &Path) -> Result<Vec<(String, Value)>> {
    let tj = read_json(path)?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let opt_json = |name: &str| -> Result<Option<Json>> {
        let p = dir.join(name);
        if p.exists() {
            read_json(&p).map(Some)
        } else {
            Ok(None)
        }
    };
    let tc = opt_json("tokenizer_config.json")?.unwrap_or(Json::Null);
    let cfg = opt_json("config.json")?.unwrap_or(Json::Null);

    let model = tj
        .get("model")
        .ok_or_else(|| bad(path, "missing 'model'"))?;
    let mty = model.get("type").and_then(Json::as_str).unwrap_or("");
    if mty != "BPE" {
        return Err(bad(
            path,
            format!("tokenizer model '{mty}' is not supported (byte-level BPE only)"),
        ));
    }
    if model.get("byte_fallback").and_then(Json::as_bool) == Some(true) {
        return Err(bad(
            path,
            "SentencePiece-style BPE (byte_fallback) tokenizer.json is not supported",
        ));
    }
    let clean = tc
        .get("clean_up_tokenization_spaces")
        .and_then(Json::as_bool);
    let pre = hf_pre_type(path, &tj, clean)?;

    // Vocabulary: model vocab plus added tokens, by id; holes become [PAD{i}].
    let mut by_id: Vec<Option<(String, i32)>> = Vec::new();
    let mut put = |id: u64, text: &str, ty: i32| -> Result<()> {
        let id = usize::try_from(id)
            .ok()
            .filter(|&i| i < (1 << 24))
            .ok_or_else(|| bad(path, format!("token id {id} too large")))?;
        if by_id.len() <= id {
            by_id.resize(id + 1, None);
        }
        by_id[id] = Some((text.to_owned(), ty));
        Ok(())
    };
    let vocab = model
        .get("vocab")
        .and_then(Json::as_object)
        .ok_or_else(|| bad(path, "missing 'model.vocab' object"))?;
    for (text, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| bad(path, format!("vocab entry '{text}' has a non-integer id")))?;
        put(id, text, 1)?;
    }
    for t in tj
        .get("added_tokens")
        .and_then(Json::as_array)
        .into_iter()
        .flatten()
    {
        let id = t
            .get("id")
            .and_then(Json::as_u64)
            .ok_or_else(|| bad(path, "added token without an integer 'id'"))?;
        let text = t
            .get("content")
            .and_then(Json::as_str)
            .ok_or_else(|| bad(path, "added token without 'content'"))?;
        let special = t.get("special").and_then(Json::as_bool).unwrap_or(false);
        put(id, text, if special { 3 } else { 4 })?;
    }
    if by_id.is_empty() {
        return Err(bad(path, "empty vocabulary"));
    }
    let n = by_id.len();
    let (mut tokens, mut types) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for (i, slot) in by_id.into_iter().enumerate() {
        let (t, ty) = slot.unwrap_or_else(|| (format!("[PAD{i}]"), 5));
        tokens.push(Value::Str(t));
        types.push(Value::I32(ty));
    }
    let token_id = |text: &str| -> Option<i64> {
        tokens
            .iter()
            .position(|t| matches!(t, Value::Str(s) if s == text))
            .map(|i| i as i64)
    };

    let mut merges = Vec::new();
    for (i, m) in model
        .get("merges")
        .and_then(Json::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        let s = match m {
            Json::String(s) => s.clone(),
            Json::Array(p) if p.len() == 2 => match (p[0].as_str(), p[1].as_str()) {
                (Some(a), Some(b)) => format!("{a} {b}"),
                _ => return Err(bad(path, format!("merges[{i}] is not a pair of strings"))),
            },
            _ => {
                return Err(bad(
                    path,
                    format!("merges[{i}] is neither \"a b\" nor [a, b]"),
                ))
            }
        };
        merges.push(Value::Str(s));
    }

    let mut kv: Vec<(String, Value)> = vec![
        ("tokenizer.ggml.model".into(), Value::Str("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::Str(pre.into())),
    ];
    // Special tokens: tokenizer_config.json names them by text, config.json by id.
    let special_id = |key: &str, cfg_key: &str| -> Option<i64> {
        let text = match tc.get(key) {
            Some(Json::String(s)) => Some(s.as_str()),
            Some(v) => v.get("content").and_then(Json::as_str),
            None => None,
        };
        text.and_then(&token_id).or_else(|| match cfg.get(cfg_key) {
            Some(Json::Array(a)) => a.first().and_then(Json::as_i64),
            Some(v) => v.as_i64(),
            None => None,
        })
    };
    for (key, tk, ck) in [
        ("tokenizer.ggml.bos_token_id", "bos_token", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token", "eos_token_id"),
        (
            "tokenizer.ggml.unknown_token_id",
            "unk_token",
            "unk_token_id",
        ),
        (
            "tokenizer.ggml.padding_token_id",
            "pad_token",
            "pad_token_id",
        ),
    ] {
        if let Some(id) = special_id(tk, ck) {
            kv.push((key.into(), Value::I64(id)));
        }
    }
    for (key, tk) in [
        ("tokenizer.ggml.add_bos_token", "add_bos_token"),
        ("tokenizer.ggml.add_eos_token", "add_eos_token"),
    ] {
        if let Some(b) = tc.get(tk).and_then(Json::as_bool) {
            kv.push((key.into(), Value::Bool(b)));
        }
    }
    kv.push(("tokenizer.ggml.tokens".into(), Value::Array(tokens)));
    kv.push(("tokenizer.ggml.token_type".into(), Value::Array(types)));
    kv.push(("tokenizer.ggml.merges".into(), Value::Array(merges)));
    Ok(kv)
}
