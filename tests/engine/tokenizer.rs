//! Tokenizer parity with llama.cpp (the oracle: `ggml_sys::LlamaModel`).
//!
//! - A corpus of 250+ strings (numbers, whitespace runs, CJK, emoji, accents,
//!   code, contractions, R1 and ChatML special tokens, WikiText lines,
//!   MATH-500 / GSM8K / AIME problems, slices of R1 reasoning traces) must
//!   tokenize to exactly llama.cpp's ids with (add_special, parse_special) in
//!   {(true, true), (false, false)} for SmolLM2 (`smollm`) and the
//!   DeepSeek-R1-Distill-Qwen header (`deepseek-r1-qwen`); so must 4000
//!   seeded random strings built from tricky pieces.
//! - The same on 200 kB of WikiText (long-text path, with a speed floor) and
//!   on 100k-200k-character runs of spaces, tabs, letters, punctuation, digits.
//! - Other pre-types on a real vocabulary: SmolLM2's vocabulary rewritten as
//!   `llama-bpe`, `gpt-2` and `qwen2` GGUF files, and as an SPM (`llama`)
//!   vocabulary with scores and `<0xNN>` byte tokens (with and without the
//!   space prefix, and with Phi-3's right-stripping specials), each checked
//!   against llama.cpp loading the same file.
//! - `token_bytes(id, true)` equals llama.cpp's `token_to_piece` for every id;
//!   `decode(encode(s)) == s` on the corpus.
//! - Unknown / missing pre-type and bad metadata are `Error::Tokenizer`; so is
//!   a whitespace run beyond the regex engine's limit. EOG tokens; BOS rules.

// llama.cpp is the oracle here: only with the `oracle` feature (default).
#![cfg(feature = "oracle")]

use ggml_sys::LlamaModel;
use kvrun::format::gguf::{Gguf, Value};
use kvrun::tokenizer::Tokenizer;
use kvrun::Error;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

// ---------------------------------------------------------------------------
// Fixtures

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn shared(name: &str) -> PathBuf {
    root().join("..").join("shared").join("data").join(name)
}

fn smollm_path() -> PathBuf {
    let p = root()
        .join("models")
        .join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "default model missing: run `bash models/fetch.sh` ({})",
        p.display()
    );
    p
}

fn r1_path() -> PathBuf {
    shared("r1-distill-qwen-7b.header.gguf")
}

/// Our tokenizer and llama.cpp's, built from the same file.
struct Pair {
    name: &'static str,
    ours: Tokenizer,
    oracle: LlamaModel,
}

fn load_pair(name: &'static str, path: &Path) -> Pair {
    let g = Gguf::open(path).expect("open gguf");
    let ours = Tokenizer::from_gguf(&g).expect("kvrun tokenizer");
    let oracle =
        LlamaModel::load(path.to_str().expect("utf-8 path"), true).expect("llama.cpp vocab");
    Pair { name, ours, oracle }
}

fn smollm() -> &'static Pair {
    static P: OnceLock<Pair> = OnceLock::new();
    P.get_or_init(|| load_pair("SmolLM2", &smollm_path()))
}

/// The R1 header file has a tensor table but no tensor data, which llama.cpp
/// rejects even for a vocab-only load; both sides therefore read a copy that
/// keeps all metadata and drops the tensor table.
fn r1() -> &'static Pair {
    static P: OnceLock<Pair> = OnceLock::new();
    P.get_or_init(|| {
        let g = Gguf::open(&r1_path()).expect("open R1 header");
        let file = write_gguf("r1-meta", &g.metadata);
        load_pair("R1-Distill-Qwen", &file.0)
    })
}

/// A GGUF file in the temp dir, removed on drop.
struct TempGguf(PathBuf);

impl Drop for TempGguf {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn gguf_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::Str(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::Str(s) => put_str(out, s),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Array(a) => {
            let elem = a.first().map(gguf_type).unwrap_or(8);
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(a.len() as u64).to_le_bytes());
            for x in a {
                put_value(out, x);
            }
        }
    }
}

/// Write a GGUF v3 file with these metadata and no tensors (§6.6 layout).
fn write_gguf(name: &str, kv: &[(String, Value)]) -> TempGguf {
    let mut out = Vec::new();
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes());
    out.extend_from_slice(&(kv.len() as u64).to_le_bytes());
    for (k, v) in kv {
        put_str(&mut out, k);
        out.extend_from_slice(&gguf_type(v).to_le_bytes());
        put_value(&mut out, v);
    }
    while out.len() % 32 != 0 {
        out.push(0);
    }
    let path = std::env::temp_dir().join(format!("kvrun-tok-{}-{name}.gguf", std::process::id()));
    let mut f = std::fs::File::create(&path).expect("create temp gguf");
    f.write_all(&out).expect("write temp gguf");
    TempGguf(path)
}

/// SmolLM2's metadata with some keys replaced (`None` removes the key).
fn smollm_kv_with(changes: &[(&str, Option<Value>)]) -> Vec<(String, Value)> {
    let g = Gguf::open(&smollm_path()).expect("open SmolLM2");
    let mut kv: Vec<(String, Value)> = g
        .metadata
        .iter()
        .filter(|(k, _)| !changes.iter().any(|(c, _)| c == k))
        .cloned()
        .collect();
    for (k, v) in changes {
        if let Some(v) = v {
            kv.push((k.to_string(), v.clone()));
        }
    }
    kv
}

// ---------------------------------------------------------------------------
// Corpus

fn handwritten() -> Vec<String> {
    let mut v: Vec<String> = [
        // whitespace
        "", " ", "  ", "   ", "\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r\n\r\n", " \n", "\n ", "  \n\n  x",
        "a\tb", "\t\tindented", "trailing space ", "trailing spaces   ", "   leading", "x  \t \n y",
        "line1\nline2\n\nline4", "a \r\n b", "word\n\n\n\nword", "\u{000B}vt\u{000C}ff",
        // digits
        "0", "7", "42", "123", "1234", "12345", "1234567890", "3.14159265358979", "1,000,000",
        "-273.15", "1e-9", "0x1F", "year 2024", " 2024 ", "phone: +1 (555) 010-9999", "a1b2c3",
        "١٢٣ Arabic-Indic digits", "²³ superscripts ½ ¾", "Ⅻ roman numeral", "①②③ circled",
        "９８７ fullwidth", "v1.2.3-rc4",
        // contractions and case
        "I'm", "you're", "they've", "we'll", "he'd", "it's", "don't", "DON'T", "I'M HERE", "She'S",
        "'s", "rock 'n' roll", "O'Neil's", "''quoted''", "’curly’ apostrophe's", "Hello World", "HELLO",
        "hello", "HeLLo WoRLD", "camelCaseIdentifier", "snake_case_identifier",
        // punctuation
        "Hello, world!", "Wait... what?!", "(a+b)*c", "-->", "===", "!!!???", "a-b_c.d",
        "email@example.com", "https://example.com/path?q=1&r=2#frag", "#hashtag @mention",
        "$100.00 & 50%", "«guillemets» „quotes“", "em—dash and en–dash", "…ellipsis",
        // code
        "def f(x):\n    return x**2\n", "fn main() {\n    println!(\"hi\");\n}",
        "for (int i = 0; i < n; ++i) { a[i] = i; }", "import numpy as np\nnp.zeros((3, 4))",
        "<div class=\"x\">text</div>", "SELECT * FROM t WHERE id = 42;", "x = {'a': 1, \"b\": [2, 3]}",
        "    \tmixed indent", "#include <stdio.h>", "// comment\n/* block */", "if x:\n\tpass\n",
        "a &&= b || !c;", "let s = \"\\n\\t\";",
        // LaTeX
        "\\frac{1}{2}", "$x^2 + y^2 = z^2$", "\\boxed{42}", "\\( s + \\frac{1}{2} \\)",
        "\\[\\sum_{k=1}^{n} k = \\frac{n(n+1)}{2}\\]",
        // CJK
        "你好，世界！", "日本語のテキストです。", "한국어 텍스트", "中文 mixed with English 123", "漢字かなカナ",
        // emoji
        "😀", "👍🏽", "👨‍👩‍👧‍👦 family", "🇺🇸 flag", "I ❤️ Rust 🦀", "emoji🎉in🎉text",
        // accents and scripts
        "café", "naïve résumé", "Ångström", "Straße", "Ελληνικά", "Русский текст", "עברית", "العربية",
        "हिन्दी", "ไทย", "Tiếng Việt", "combining: e\u{301}", "Zalgo: h̷e̷l̷l̷o̷",
        // unusual code points
        "\u{00A0}nbsp", "zero\u{200B}width", "\u{FEFF}bom", "\u{3000}ideographic space", "\u{0085}nel",
        "control\u{0007}bell", "\u{E000} private use", "unassigned \u{0378}\u{0378} x", "\u{10FFFF}",
        "ﬁ ligature", "tab\u{2003}em space",
        // special tokens (R1, ChatML, others)
        "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
        "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>\nOK</think>4<｜end▁of▁sentence｜>",
        "<think>\nreasoning\n</think>\n\nanswer", "text<think>inline</think>text", "<|im_start|><|im_start|>",
        "<|im_end", "im_end|>", "< think>", "<THINK>", "<tool_call>{\"a\":1}</tool_call>",
        "<repo_name>x<file_sep>y", "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>", "[PAD151665]",
        "<|vision_start|><|image_pad|><|vision_end|>", "<|EOT|>", " <think> spaced </think> ",
        "<｜User｜><｜User｜>", "<think><think>",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    // long runs
    v.push("a".repeat(1000));
    v.push(" ".repeat(300));
    v.push("\n".repeat(50));
    v.push("ab ".repeat(200));
    v.push("9".repeat(500));
    v.push("😀".repeat(100));
    v.push("!".repeat(100));
    v.push(" \t".repeat(64) + "end");
    v
}

fn jsonl(name: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(shared(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect()
}

fn field(v: &serde_json::Value, key: &str) -> String {
    v.get(key)
        .and_then(|x| x.as_str())
        .unwrap_or_default()
        .to_owned()
}

/// Split `s` into chunks of cycling sizes (in chars).
fn chunks(s: &str, sizes: &[usize], max: usize) -> Vec<String> {
    let chars: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut k) = (0, 0);
    while i < chars.len() && out.len() < max {
        let n = sizes[k % sizes.len()];
        out.push(chars[i..(i + n).min(chars.len())].iter().collect());
        i += n;
        k += 1;
    }
    out
}

fn corpus() -> &'static Vec<String> {
    static C: OnceLock<Vec<String>> = OnceLock::new();
    C.get_or_init(|| {
        let mut c = handwritten();
        let wiki = std::fs::read_to_string(shared("wikitext2_test_lf.txt")).expect("wikitext");
        let lines: Vec<&str> = wiki.lines().collect();
        c.extend(lines.iter().step_by(lines.len() / 40).take(40).map(|l| l.to_string()));
        let math = jsonl("math500_test.jsonl");
        c.extend(math.iter().step_by(math.len() / 30).take(30).map(|m| field(m, "problem")));
        c.extend(math.iter().take(5).map(|m| field(m, "solution")));
        let gsm = jsonl("gsm8k_test.jsonl");
        c.extend(gsm.iter().step_by(gsm.len() / 30).take(30).map(|m| field(m, "question")));
        c.extend(gsm.iter().take(5).map(|m| field(m, "answer")));
        let aime = jsonl("aime24.jsonl");
        c.extend(aime.iter().take(8).map(|m| field(m, "problem")));
        let traces = jsonl("r1_traces.jsonl");
        for t in &traces {
            let out = field(t, "output");
            c.extend(chunks(&out, &[37, 120, 300, 800, 11], 25));
            c.push(format!(
                "<｜begin▁of▁sentence｜><｜User｜>You are given a math problem.\n\nProblem: {}\n\n You need to solve the problem step by step. First, you need to provide the chain-of-thought, then provide the final answer.\n\n Provide the final answer in the format: Final answer:  \\boxed{{}}<｜Assistant｜><think>\n{}",
                field(t, "problem"),
                out
            ));
        }
        assert!(c.len() >= 200, "corpus has only {} strings", c.len());
        c
    })
}

// ---------------------------------------------------------------------------
// Parity helpers

fn oracle_ids(m: &LlamaModel, s: &str, add: bool, parse: bool) -> Vec<u32> {
    m.tokenize(s, add, parse)
        .into_iter()
        .map(|t| t as u32)
        .collect()
}

/// Compare kvrun with llama.cpp on every string and mode; panic with the first
/// mismatch (string, both id lists, and the token texts).
fn assert_parity(name: &str, ours: &Tokenizer, oracle: &LlamaModel, strings: &[String]) {
    let mut bad = 0usize;
    let mut first: Option<String> = None;
    for s in strings {
        for (add, parse) in [(true, true), (false, false)] {
            let a = ours
                .encode(s, add, parse)
                .unwrap_or_else(|e| panic!("{name}: encode({s:?}) failed: {e}"));
            let b = oracle_ids(oracle, s, add, parse);
            if a != b {
                bad += 1;
                if first.is_none() {
                    let texts = |ids: &[u32]| {
                        ids.iter()
                            .map(|&i| ours.token_text(i).to_owned())
                            .collect::<Vec<_>>()
                    };
                    first = Some(format!(
                        "{name}: mismatch for {s:?} (add_special={add}, parse_special={parse})\n  kvrun:     {a:?}\n  llama.cpp: {b:?}\n  kvrun pieces:     {:?}\n  llama.cpp pieces: {:?}",
                        texts(&a),
                        texts(&b)
                    ));
                }
            }
        }
    }
    if let Some(msg) = first {
        panic!(
            "{msg}\n{bad} of {} (string, mode) cases differ",
            strings.len() * 2
        );
    }
}

// ---------------------------------------------------------------------------
// Tests: the two real vocabularies

#[test]
fn corpus_is_large_and_varied() {
    let c = corpus();
    assert!(c.len() >= 200);
    for needle in [
        "<｜User｜>",
        "<think>",
        "<|im_start|>",
        "你好",
        "😀",
        "1234567890",
        "\\frac",
    ] {
        assert!(
            c.iter().any(|s| s.contains(needle)),
            "corpus lacks {needle}"
        );
    }
}

#[test]
fn smollm_matches_llama_cpp_on_corpus() {
    let p = smollm();
    assert_eq!(p.ours.model_type(), "gpt2");
    assert_eq!(p.ours.pre_type(), "smollm");
    assert_eq!(p.ours.n_vocab(), p.oracle.n_vocab());
    assert_parity(p.name, &p.ours, &p.oracle, corpus());
}

#[test]
fn r1_matches_llama_cpp_on_corpus() {
    let p = r1();
    assert_eq!(p.ours.model_type(), "gpt2");
    assert_eq!(p.ours.pre_type(), "deepseek-r1-qwen");
    assert_eq!(p.ours.n_vocab(), 152064);
    assert_eq!(p.ours.n_vocab(), p.oracle.n_vocab());
    assert_parity(p.name, &p.ours, &p.oracle, corpus());
}

/// Gemma 3's SPM vocabulary (262144 pieces, no space prefix, byte
/// fallback) on the whole corpus, plus its turn markers as control tokens.
#[test]
fn gemma3_matches_llama_cpp_on_corpus() {
    let p = load_pair("Gemma3", &crate::util::gemma_model());
    assert_eq!(p.ours.model_type(), "llama");
    assert_eq!(p.ours.n_vocab(), 262144);
    assert_eq!(p.ours.n_vocab(), p.oracle.n_vocab());
    assert_parity(p.name, &p.ours, &p.oracle, corpus());
    let turn = "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n";
    assert_eq!(
        oracle_ids(&p.oracle, turn, true, true),
        p.ours.encode(turn, true, true).unwrap(),
        "turn markup"
    );
}

#[test]
fn long_wikitext_matches_and_is_fast() {
    let wiki = std::fs::read_to_string(shared("wikitext2_test_lf.txt")).expect("wikitext");
    let text: String = wiki.chars().take(200_000).collect();
    for p in [smollm(), r1()] {
        let t0 = Instant::now();
        let ours = p.ours.encode(&text, false, false).expect("encode");
        let dt = t0.elapsed().as_secs_f64();
        let theirs = oracle_ids(&p.oracle, &text, false, false);
        eprintln!(
            "{}: 200k chars -> {} tokens in {:.3} s ({:.2} MB/s)",
            p.name,
            ours.len(),
            dt,
            0.2 / dt
        );
        if ours != theirs {
            let i = ours
                .iter()
                .zip(&theirs)
                .position(|(a, b)| a != b)
                .unwrap_or(ours.len().min(theirs.len()));
            let lo = i.saturating_sub(5);
            panic!(
                "{}: long text differs at token {i}: kvrun {:?} vs llama.cpp {:?} (decoded context {:?})",
                p.name,
                &ours[lo..(i + 5).min(ours.len())],
                &theirs[lo..(i + 5).min(theirs.len())],
                p.ours.decode(&ours[lo..(i + 5).min(ours.len())], true)
            );
        }
        // Generous floor (2-core CI box, possibly busy): ~0.2 MB must take < 4 s.
        assert!(dt < 4.0, "{}: encoding 200k chars took {dt:.2} s", p.name);
    }
}

#[test]
fn r1_tokenizer_builds_quickly() {
    let g = Gguf::open(&r1_path()).expect("open");
    let t0 = Instant::now();
    let t = Tokenizer::from_gguf(&g).expect("build");
    let dt = t0.elapsed().as_secs_f64();
    eprintln!("R1 tokenizer (152k tokens, 151k merges) built in {dt:.3} s");
    assert_eq!(t.n_vocab(), 152064);
    assert!(dt < 3.0, "building the R1 tokenizer took {dt:.2} s");
}

#[test]
fn token_bytes_match_token_to_piece_for_every_id() {
    for p in [smollm(), r1()] {
        for id in 0..p.ours.n_vocab() as u32 {
            let ours = p.ours.token_bytes(id, true);
            let theirs = p.oracle.token_to_piece(id as i32);
            assert_eq!(
                ours,
                theirs,
                "{}: token {id} ({:?})",
                p.name,
                p.ours.token_text(id)
            );
        }
        // Out of range: nothing, no panic.
        assert!(p.ours.token_bytes(u32::MAX, true).is_empty());
        assert_eq!(p.ours.token_text(u32::MAX), "");
    }
}

#[test]
fn decode_roundtrips_corpus() {
    for p in [smollm(), r1()] {
        for s in corpus() {
            let plain = p.ours.encode(s, false, false).expect("encode");
            assert_eq!(
                &p.ours.decode(&plain, false),
                s,
                "{}: plain roundtrip",
                p.name
            );
            let special = p.ours.encode(s, false, true).expect("encode");
            assert_eq!(
                &p.ours.decode(&special, true),
                s,
                "{}: special roundtrip",
                p.name
            );
        }
    }
}

#[test]
fn control_tokens_hidden_unless_special() {
    let p = r1();
    let ids = p
        .ours
        .encode("<｜User｜>hi<think>x</think>", false, true)
        .expect("encode");
    assert_eq!(ids[0], 151644);
    // Control text is dropped without `special`; user-defined <think> stays.
    assert_eq!(p.ours.decode(&ids, false), "hi<think>x</think>");
    assert_eq!(p.ours.decode(&ids, true), "<｜User｜>hi<think>x</think>");
    // Unused [PAD] tokens render as nothing.
    assert!(p.ours.token_bytes(151665, true).is_empty());
}

#[test]
fn bos_eos_and_eog() {
    let s = &smollm().ours;
    assert_eq!(s.bos(), Some(1));
    assert_eq!(s.eos(), Some(2));
    assert!(!s.add_bos(), "SmolLM2 sets add_bos_token = false");
    let im_end = s.token_id("<|im_end|>").expect("<|im_end|>");
    assert!(s.is_eog(im_end));
    assert!(s.is_eog(s.token_id("<|endoftext|>").expect("eot")));
    assert!(!s.is_eog(s.token_id("<|im_start|>").expect("im_start")));
    assert!(!s.is_eog(s.encode("Hello", false, false).expect("encode")[0]));
    assert!(!s.is_eog(u32::MAX));
    assert_eq!(
        s.encode("Hi", true, true).expect("encode"),
        s.encode("Hi", false, true).expect("encode")
    );

    let r = &r1().ours;
    assert_eq!(r.bos(), Some(151646));
    assert_eq!(r.eos(), Some(151643));
    assert!(r.add_bos());
    assert_eq!(r.token_text(151643), "<｜end▁of▁sentence｜>");
    assert!(r.is_eog(151643));
    assert!(!r.is_eog(151644)); // <｜User｜>
    assert!(!r.is_eog(151649)); // </think>
    assert!(r.is_eog(r.token_id("<|fim_pad|>").expect("fim_pad")));
    let ids = r.encode("Hi", true, false).expect("encode");
    assert_eq!(ids[0], 151646);
    assert_eq!(r.encode("", true, true).expect("encode"), vec![151646]);
    assert!(r.encode("", false, false).expect("encode").is_empty());
}

// ---------------------------------------------------------------------------
// Tests: other pre-types and SPM, on SmolLM2's vocabulary, against llama.cpp

/// A subset of the corpus for the synthetic-vocabulary checks.
fn variant_corpus() -> Vec<String> {
    let c = corpus();
    let mut v = handwritten();
    v.extend(c.iter().skip(v.len()).step_by(4).cloned());
    v
}

fn check_variant(label: &str, kv: Vec<(String, Value)>) -> Tokenizer {
    let file = write_gguf(label, &kv);
    let g = Gguf::open(&file.0).expect("reopen written gguf");
    let ours = Tokenizer::from_gguf(&g).unwrap_or_else(|e| panic!("{label}: {e}"));
    let oracle = LlamaModel::load(file.0.to_str().expect("utf-8"), true)
        .unwrap_or_else(|e| panic!("{label}: llama.cpp refused the file: {e}"));
    assert_eq!(ours.n_vocab(), oracle.n_vocab());
    for id in 0..ours.n_vocab() as u32 {
        assert_eq!(
            ours.token_bytes(id, true),
            oracle.token_to_piece(id as i32),
            "{label}: token {id}"
        );
    }
    assert_parity(label, &ours, &oracle, &variant_corpus());
    ours
}

#[test]
fn llama_bpe_pre_type_matches_llama_cpp() {
    let t = check_variant(
        "llama-bpe",
        smollm_kv_with(&[
            ("tokenizer.ggml.pre", Some(Value::Str("llama-bpe".into()))),
            ("tokenizer.ggml.add_bos_token", None),
        ]),
    );
    assert!(t.add_bos(), "llama-bpe adds BOS by default");
    assert_eq!(t.encode("x", true, false).expect("encode")[0], 1);
    // clean_spaces is on for the Llama-3 family (llama_detokenize).
    let ids = t.encode("a , b . c ' d", false, false).expect("encode");
    assert_eq!(t.decode(&ids, false), "a, b. c'd");
}

#[test]
fn gpt2_pre_type_matches_llama_cpp() {
    check_variant(
        "gpt-2",
        smollm_kv_with(&[("tokenizer.ggml.pre", Some(Value::Str("gpt-2".into())))]),
    );
}

#[test]
fn qwen2_pre_type_matches_llama_cpp() {
    check_variant(
        "qwen2",
        smollm_kv_with(&[("tokenizer.ggml.pre", Some(Value::Str("qwen2".into())))]),
    );
}

/// SmolLM2's vocabulary turned into a SentencePiece vocabulary: `<unk>`,
/// `<s>`, `</s>`, 256 byte tokens, every byte-level token that decodes to
/// UTF-8 (spaces as `▁`, score = -rank), plus two control tokens and a
/// user-defined one.
fn spm_kv(add_space_prefix: Option<bool>) -> Vec<(String, Value)> {
    let g = Gguf::open(&smollm_path()).expect("open SmolLM2");
    let tok = Tokenizer::from_gguf(&g).expect("SmolLM2 tokenizer");
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types: Vec<i32> = vec![2, 3, 3];
    for b in 0..256 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    tokens.push("<|im_start|>".into());
    types.push(3);
    tokens.push("<|endoftext|>".into());
    types.push(3);
    tokens.push("<think>".into());
    types.push(4);
    let mut seen: std::collections::HashSet<String> = tokens.iter().cloned().collect();
    for id in 0..tok.n_vocab() as u32 {
        if let Ok(s) = String::from_utf8(tok.token_bytes(id, false)) {
            let s = s.replace(' ', "▁");
            if !s.is_empty() && seen.insert(s.clone()) {
                tokens.push(s);
                types.push(1);
            }
        }
    }
    let scores: Vec<Value> = (0..tokens.len())
        .map(|i| Value::F32(if types[i] == 1 { -(i as f32) } else { 0.0 }))
        .collect();
    let mut changes: Vec<(&str, Option<Value>)> = vec![
        ("tokenizer.ggml.model", Some(Value::Str("llama".into()))),
        ("tokenizer.ggml.pre", None),
        ("tokenizer.ggml.merges", None),
        (
            "tokenizer.ggml.tokens",
            Some(Value::Array(tokens.into_iter().map(Value::Str).collect())),
        ),
        (
            "tokenizer.ggml.token_type",
            Some(Value::Array(types.into_iter().map(Value::I32).collect())),
        ),
        ("tokenizer.ggml.scores", Some(Value::Array(scores))),
        ("tokenizer.ggml.bos_token_id", Some(Value::U32(1))),
        ("tokenizer.ggml.eos_token_id", Some(Value::U32(2))),
        ("tokenizer.ggml.unknown_token_id", Some(Value::U32(0))),
        ("tokenizer.ggml.padding_token_id", None),
        ("tokenizer.ggml.add_bos_token", None),
        (
            "tokenizer.ggml.add_space_prefix",
            add_space_prefix.map(Value::Bool),
        ),
        ("tokenizer.chat_template", None),
    ];
    changes.push(("llama.vocab_size", None));
    smollm_kv_with(&changes)
}

#[test]
fn spm_matches_llama_cpp() {
    let t = check_variant("spm", spm_kv(None));
    assert_eq!(t.model_type(), "llama");
    assert!(t.add_bos(), "SPM adds BOS by default");
    assert_eq!(t.bos(), Some(1));
    assert!(t.is_eog(2));
    // Leading-space handling on decode mirrors llama_detokenize.
    let ids = t.encode("Hello world", false, false).expect("encode");
    assert_eq!(t.decode(&ids, false), "Hello world");
    // Characters outside the vocabulary fall back to <0xNN> byte tokens.
    let ids = t.encode("你", false, false).expect("encode");
    assert!(
        ids.iter().any(|&i| t.token_text(i).starts_with("<0x")),
        "{ids:?}"
    );
    assert_eq!(t.decode(&ids, false), "你");
}

#[test]
fn spm_phi3_rstrip_matches_llama_cpp() {
    // llama.cpp gives Phi-3 (by general.name) right-stripping special tokens.
    let mut kv = spm_kv(None);
    kv.retain(|(k, _)| k != "general.name");
    kv.push(("general.name".into(), Value::Str("Phi-3 Mini Test".into())));
    let t = check_variant("spm-phi3", kv);
    let a = t.encode("<think>  x", false, false).expect("encode");
    let b = t.encode("<think>x", false, false).expect("encode");
    assert_eq!(
        a, b,
        "whitespace after a special token is dropped for Phi-3"
    );
}

#[test]
fn spm_without_space_prefix_matches_llama_cpp() {
    check_variant("spm-noprefix", spm_kv(Some(false)));
}

// ---------------------------------------------------------------------------
// Tests: errors

fn expect_tokenizer_error(kv: &[(String, Value)], needle: &str) {
    match Tokenizer::from_metadata(kv) {
        Err(Error::Tokenizer(msg)) => {
            assert!(msg.contains(needle), "message {msg:?} lacks {needle:?}")
        }
        Err(e) => panic!("expected Error::Tokenizer, got {e}"),
        Ok(t) => panic!("expected an error, got {t:?}"),
    }
}

#[test]
fn unknown_pre_type_is_an_error() {
    let kv = smollm_kv_with(&[("tokenizer.ggml.pre", Some(Value::Str("no-such-pre".into())))]);
    expect_tokenizer_error(&kv, "unknown pre-tokenizer type 'no-such-pre'");
    // The same through a GGUF file; llama.cpp also refuses it.
    let file = write_gguf("unknown-pre", &kv);
    let g = Gguf::open(&file.0).expect("reopen");
    assert!(
        matches!(Tokenizer::from_gguf(&g), Err(Error::Tokenizer(m)) if m.contains("no-such-pre"))
    );
    assert!(LlamaModel::load(file.0.to_str().expect("utf-8"), true).is_err());
}

#[test]
fn missing_pre_type_and_bad_metadata_are_errors() {
    expect_tokenizer_error(
        &smollm_kv_with(&[("tokenizer.ggml.pre", None)]),
        "unknown pre-tokenizer type ''",
    );
    expect_tokenizer_error(
        &smollm_kv_with(&[("tokenizer.ggml.model", Some(Value::Str("bert".into())))]),
        "'bert'",
    );
    expect_tokenizer_error(
        &smollm_kv_with(&[("tokenizer.ggml.tokens", None)]),
        "tokenizer.ggml.tokens",
    );
    expect_tokenizer_error(
        &smollm_kv_with(&[("tokenizer.ggml.merges", None)]),
        "merges",
    );
    expect_tokenizer_error(
        &smollm_kv_with(&[(
            "tokenizer.ggml.token_type",
            Some(Value::Array(vec![Value::I32(1)])),
        )]),
        "token_type",
    );
    expect_tokenizer_error(
        &smollm_kv_with(&[("tokenizer.ggml.pre", Some(Value::U32(3)))]),
        "tokenizer.ggml.pre",
    );
}

#[test]
fn long_runs_match_llama_cpp() {
    let cases = [
        " ".repeat(200_000) + "x",
        "\n".to_string() + &" ".repeat(200_000) + "x",
        "\t".repeat(100_000) + "\n\nx",
        "ab".repeat(100_000) + " x",
        "!?".repeat(100_000) + "a",
        "7".repeat(50_000),
    ];
    for p in [smollm(), r1()] {
        for s in &cases {
            let ours = p.ours.encode(s, false, false).expect("encode");
            assert!(
                ours == oracle_ids(&p.oracle, s, false, false),
                "{}: long run {:?}...",
                p.name,
                &s[..8]
            );
        }
    }
}

#[test]
fn whitespace_run_beyond_regex_limit_is_an_error() {
    // fancy-regex's backtracking stack (1M entries) would silently stop
    // splitting at ~1M consecutive whitespace characters; kvrun refuses.
    let s = "a".to_string() + &" ".repeat(600_000) + "b";
    match smollm().ours.encode(&s, false, false) {
        Err(Error::Tokenizer(m)) => assert!(m.contains("whitespace"), "{m}"),
        other => panic!(
            "expected Error::Tokenizer, got {:?}",
            other.map(|v| v.len())
        ),
    }
}

#[test]
fn tokenizer_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Tokenizer>();
}

/// Deterministic random strings over a pool of tricky pieces.
fn fuzz_strings(n: usize, seed: u64) -> Vec<String> {
    const POOL: &[&str] = &[
        " ",
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "\r\n",
        "\r",
        "a",
        "b",
        "The",
        " the",
        "word",
        "A",
        "Z",
        "é",
        "ß",
        "0",
        "1",
        "42",
        "999",
        "٣",
        "½",
        "'s",
        "'S",
        "'re",
        "'LL",
        "'d",
        "'",
        "\"",
        ".",
        ",",
        "!",
        "?",
        "...",
        "-",
        "_",
        "(",
        ")",
        "{",
        "}",
        "<",
        ">",
        "/",
        "\\",
        "$",
        "%",
        "#",
        "@",
        "*",
        "+",
        "=",
        "你",
        "好",
        "世界",
        "の",
        "한",
        "😀",
        "👍🏽",
        "🦀",
        "\u{301}",
        "\u{200B}",
        "\u{00A0}",
        "\u{3000}",
        "\u{0085}",
        "\u{0378}",
        "\u{E000}",
        "Ελ",
        "ру",
        "ال",
        "हि",
        "<think>",
        "</think>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<｜end▁of▁sentence｜>",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<|",
        "|>",
        "▁",
        "Ġ",
        "\u{1}",
        "\u{7f}",
        "x\u{0}y",
    ];
    let mut state = seed;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..n)
        .map(|_| {
            let len = (next() % 12) as usize + 1;
            (0..len)
                .map(|_| POOL[(next() % POOL.len() as u64) as usize])
                .collect::<String>()
        })
        .collect()
}

#[test]
fn random_strings_match_llama_cpp() {
    let strings = fuzz_strings(4000, 0x9E37_79B9_7F4A_7C15);
    for p in [smollm(), r1()] {
        assert_parity(p.name, &p.ours, &p.oracle, &strings);
        for s in &strings {
            let ids = p.ours.encode(s, false, true).expect("encode");
            assert_eq!(&p.ours.decode(&ids, true), s, "{}: roundtrip", p.name);
        }
    }
    for (label, kv) in [
        ("spm-fuzz", spm_kv(None)),
        (
            "llama-bpe-fuzz",
            smollm_kv_with(&[("tokenizer.ggml.pre", Some(Value::Str("llama-bpe".into())))]),
        ),
    ] {
        let file = write_gguf(label, &kv);
        let ours = Tokenizer::from_gguf(&Gguf::open(&file.0).expect("reopen")).expect("tokenizer");
        let oracle = LlamaModel::load(file.0.to_str().expect("utf-8"), true).expect("llama.cpp");
        assert_parity(label, &ours, &oracle, &strings);
    }
}
