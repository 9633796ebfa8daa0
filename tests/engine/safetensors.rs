//! Hugging Face directories (config.json + tokenizer.json + safetensors).
//!
//! The fixture is a real HF-layout directory built from the default GGUF
//! model: every weight dequantized to f32 (two stored as f16 / bf16), the
//! llama.cpp converter's Q/K row permutation undone, split over two
//! safetensors files with a `model.safetensors.index.json`, plus config.json,
//! tokenizer.json (also checked loadable by the `tokenizers` crate) and
//! tokenizer_config.json. Logits of kvrun on that directory are compared
//! with kvrun on the GGUF (same weights up to Q4_1/Q8_0 activation
//! quantization), and loading with the wrong RoPE style must be clearly worse.

use crate::util;

use kvrun::backend::RopeStyle;
use kvrun::chat::{ChatTemplate, Message};
use kvrun::format::gguf::{Gguf, Value};
use kvrun::generate::Session;
use kvrun::load::safetensors::{hf_name, HfCheckpoint};
use kvrun::model::llama::Logits;
use kvrun::model::Weights;
use kvrun::tokenizer::Tokenizer;
use kvrun::Error;
use serde_json::{json, Map, Value as Json};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const N_THREADS: usize = 2;

/// A fresh scratch directory for this process; directories of earlier test
/// processes that are gone (the fixture is ~0.5 GB) are removed first.
fn scratch_dir(name: &str) -> PathBuf {
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    if cfg!(target_os = "linux") {
        for e in std::fs::read_dir(&tmp).into_iter().flatten().flatten() {
            let fname = e.file_name().to_string_lossy().into_owned();
            let pid = fname
                .strip_prefix("kvrun-hf-")
                .and_then(|r| r.split('-').next()?.parse::<u32>().ok());
            if pid.is_some_and(|p| {
                p != std::process::id() && !Path::new(&format!("/proc/{p}")).exists()
            }) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    let d = tmp.join(format!("kvrun-hf-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// One tensor to write: HF name, safetensors dtype, HF shape, raw bytes.
struct St {
    name: String,
    dtype: &'static str,
    shape: Vec<u64>,
    bytes: Vec<u8>,
}

/// Serialize tensors as a safetensors file (header padded to 8 bytes).
fn safetensors_bytes(tensors: &[St]) -> Vec<u8> {
    let mut header = Map::new();
    let mut off = 0u64;
    for t in tensors {
        let end = off + t.bytes.len() as u64;
        header.insert(
            t.name.clone(),
            json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [off, end]}),
        );
        off = end;
    }
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut h = serde_json::to_vec(&Json::Object(header)).unwrap();
    while !(8 + h.len()).is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + off as usize);
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    for t in tensors {
        out.extend_from_slice(&t.bytes);
    }
    out
}

/// Undo llama.cpp's converter permutation of Q/K rows: GGUF row
/// h*hd + 2*i + j holds HF row h*hd + j*(hd/2) + i.
fn unpermute(rows: &[f32], n_in: usize, n_out: usize, n_head: usize) -> Vec<f32> {
    let hd = n_out / n_head;
    let mut out = vec![0f32; rows.len()];
    for h in 0..n_head {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let g = h * hd + 2 * i + j;
                let f = h * hd + j * (hd / 2) + i;
                out[f * n_in..(f + 1) * n_in].copy_from_slice(&rows[g * n_in..(g + 1) * n_in]);
            }
        }
    }
    out
}

fn meta_u(g: &Gguf, k: &str) -> u64 {
    g.get(k)
        .and_then(Value::as_i64)
        .unwrap_or_else(|| panic!("{k}")) as u64
}
fn meta_f(g: &Gguf, k: &str) -> f64 {
    g.get(k)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("{k}"))
}

/// tokenizer.json + tokenizer_config.json equivalent to the GGUF vocabulary.
fn write_tokenizer(g: &Gguf, dir: &Path) {
    let strs = |k: &str| -> Vec<String> {
        g.get(k)
            .and_then(Value::as_array)
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_owned())
            .collect()
    };
    let tokens = strs("tokenizer.ggml.tokens");
    let merges = strs("tokenizer.ggml.merges");
    let types: Vec<i64> = g
        .get("tokenizer.ggml.token_type")
        .and_then(Value::as_array)
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect();
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        vocab.insert(t.clone(), json!(i));
        if types[i] == 3 || types[i] == 4 {
            added.push(json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                              "normalized": false, "special": types[i] == 3}));
        }
    }
    let tj = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
        ]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    });
    std::fs::write(dir.join("tokenizer.json"), serde_json::to_vec(&tj).unwrap()).unwrap();
    let id_text = |k: &str| tokens[meta_u(g, k) as usize].clone();
    let tc = json!({
        "bos_token": id_text("tokenizer.ggml.bos_token_id"),
        "eos_token": {"content": id_text("tokenizer.ggml.eos_token_id"), "special": true},
        "clean_up_tokenization_spaces": false,
        "chat_template": g.get("tokenizer.chat_template").and_then(Value::as_str).unwrap(),
        "model_max_length": 8192,
        "tokenizer_class": "GPT2Tokenizer"
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_vec_pretty(&tc).unwrap(),
    )
    .unwrap();
}

/// The HF directory built from the default model (once per test process).
fn hf_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let g = Gguf::open(&util::default_model()).unwrap();
        let dir = scratch_dir("smollm2");
        let n_head = meta_u(&g, "llama.attention.head_count") as usize;
        let n_kv = meta_u(&g, "llama.attention.head_count_kv") as usize;
        let n_layers = meta_u(&g, "llama.block_count") as usize;
        let mut files: Vec<Vec<St>> = vec![Vec::new(), Vec::new()];
        for info in &g.tensors {
            let v = g.tensor(&info.name).unwrap();
            let (n_in, n_out) = (v.n_cols(), v.n_rows());
            let mut f = vec![0f32; n_in * n_out];
            for r in 0..n_out {
                kvrun::quant::dequantize_row(v.dtype, v.row(r), &mut f[r * n_in..(r + 1) * n_in]);
            }
            if info.name.ends_with("attn_q.weight") {
                f = unpermute(&f, n_in, n_out, n_head);
            } else if info.name.ends_with("attn_k.weight") {
                f = unpermute(&f, n_in, n_out, n_kv);
            }
            let (dtype, bytes): (&'static str, Vec<u8>) = match info.name.as_str() {
                "blk.0.ffn_down.weight" => (
                    "F16",
                    f.iter()
                        .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                        .collect(),
                ),
                "blk.1.ffn_up.weight" => (
                    "BF16",
                    f.iter()
                        .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                        .collect(),
                ),
                _ => ("F32", bytemuck::cast_slice(&f).to_vec()),
            };
            let shape: Vec<u64> = info.dims.iter().rev().copied().collect();
            let name =
                hf_name(&info.name).unwrap_or_else(|| panic!("no HF name for {}", info.name));
            let layer: Option<usize> = info
                .name
                .strip_prefix("blk.")
                .and_then(|r| r.split('.').next()?.parse().ok());
            let file = usize::from(layer.is_some_and(|l| l >= n_layers / 2));
            files[file].push(St {
                name,
                dtype,
                shape,
                bytes,
            });
        }
        let mut weight_map = Map::new();
        for (i, ts) in files.iter().enumerate() {
            let fname = format!("model-{:05}-of-00002.safetensors", i + 1);
            for t in ts {
                weight_map.insert(t.name.clone(), json!(fname));
            }
            std::fs::write(dir.join(&fname), safetensors_bytes(ts)).unwrap();
        }
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::to_vec(&json!({"metadata": {}, "weight_map": weight_map})).unwrap(),
        )
        .unwrap();
        let vocab = g.info("token_embd.weight").unwrap().dims[1];
        let cfg = json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": meta_u(&g, "llama.embedding_length"),
            "intermediate_size": meta_u(&g, "llama.feed_forward_length"),
            "num_hidden_layers": n_layers,
            "num_attention_heads": n_head,
            "num_key_value_heads": n_kv,
            "rms_norm_eps": meta_f(&g, "llama.attention.layer_norm_rms_epsilon"),
            "rope_theta": meta_f(&g, "llama.rope.freq_base"),
            "rope_scaling": null,
            "vocab_size": vocab,
            "max_position_embeddings": meta_u(&g, "llama.context_length"),
            "tie_word_embeddings": true,
            "hidden_act": "silu",
            "bos_token_id": meta_u(&g, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta_u(&g, "tokenizer.ggml.eos_token_id"),
            "torch_dtype": "float32"
        });
        std::fs::write(
            dir.join("config.json"),
            serde_json::to_vec_pretty(&cfg).unwrap(),
        )
        .unwrap();
        write_tokenizer(&g, &dir);
        dir
    })
}

fn prompt_tokens(g: &Gguf, n: usize) -> Vec<u32> {
    let tok = Tokenizer::from_gguf(g).unwrap();
    let text = "The history of the Roman Empire spans more than a thousand years. In 27 BC, Augustus became \
                the first emperor, and the empire reached its greatest extent under Trajan in 117 AD.";
    let ids = tok.encode(text, false, false).unwrap();
    assert!(ids.len() >= n, "prompt has only {} tokens", ids.len());
    ids[..n].to_vec()
}

fn all_logits<'w>(w: &'w Weights<'w>, tokens: &[u32]) -> Vec<f32> {
    let mut s = Session::new(w, 64, N_THREADS, 32);
    s.feed(tokens, Logits::All).unwrap().to_vec()
}

fn argmax(x: &[f32]) -> usize {
    x.iter()
        .enumerate()
        .fold(0, |b, (i, &v)| if v > x[b] { i } else { b })
}

/// (argmax agreement fraction, max over rows of max|a-b| / max|ref|).
fn compare(reference: &[f32], got: &[f32], vocab: usize) -> (f64, f64) {
    let rows = reference.len() / vocab;
    let (mut agree, mut worst) = (0usize, 0f64);
    for r in 0..rows {
        let (a, b) = (
            &reference[r * vocab..(r + 1) * vocab],
            &got[r * vocab..(r + 1) * vocab],
        );
        agree += usize::from(argmax(a) == argmax(b));
        let scale = a.iter().fold(0f32, |m, &x| m.max(x.abs())) as f64;
        let diff = a
            .iter()
            .zip(b)
            .fold(0f32, |m, (&x, &y)| m.max((x - y).abs())) as f64;
        worst = worst.max(diff / scale);
    }
    (agree as f64 / rows as f64, worst)
}

#[test]
fn hf_dir_config_matches_gguf() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let want = kvrun::model::Config::from_gguf(&g).unwrap();
    let ck = HfCheckpoint::open(hf_dir()).unwrap();
    let c = ck.config().unwrap();
    assert_eq!(c.arch, want.arch);
    assert_eq!(
        (
            c.n_layers,
            c.dim,
            c.ffn_dim,
            c.n_heads,
            c.n_kv_heads,
            c.head_dim,
            c.vocab,
            c.n_rot,
            c.n_ctx_train
        ),
        (
            want.n_layers,
            want.dim,
            want.ffn_dim,
            want.n_heads,
            want.n_kv_heads,
            want.head_dim,
            want.vocab,
            want.n_rot,
            want.n_ctx_train
        )
    );
    assert_eq!(
        (c.norm_eps, c.rope_base, c.rope_pos_scale, c.tied_output),
        (want.norm_eps, want.rope_base, 1.0, true)
    );
    assert_eq!(
        c.rope_style,
        RopeStyle::Neox,
        "HF llama Q/K are unpermuted: NeoX rotation"
    );
    assert_eq!(want.rope_style, RopeStyle::Normal);
    // The weights borrow the maps (F32 / F16 / BF16 all zero-copy).
    let w = ck.weights().unwrap();
    assert_eq!(w.token_embd.dtype, kvrun::tensor::DType::F32);
    assert_eq!(
        w.layers[0].ffn.dense().unwrap().2.dtype,
        kvrun::tensor::DType::F16
    );
    assert_eq!(
        w.layers[1].ffn.dense().unwrap().1.dtype,
        kvrun::tensor::DType::BF16
    );
    for m in [
        &w.token_embd,
        &w.layers[0].wq,
        w.layers[0].ffn.dense().unwrap().2,
        w.layers[1].ffn.dense().unwrap().1,
        &w.layers[29].wk,
    ] {
        assert!(m.is_borrowed(), "{m:?} was copied");
    }
    assert!(w.output.is_none());
}

#[test]
fn hf_dir_logits_match_gguf_and_rope_style_matters() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let tokens = prompt_tokens(&g, 32);
    let wg = Weights::from_gguf(&g).unwrap();
    let vocab = wg.config.vocab;
    let reference = all_logits(&wg, &tokens);

    let ck = HfCheckpoint::open(hf_dir()).unwrap();
    let w = ck.weights().unwrap();
    let got = all_logits(&w, &tokens);
    let (agree, rel) = compare(&reference, &got, vocab);
    eprintln!("HF (NeoX) vs GGUF Q4_1: argmax agreement {agree:.3}, max rel logit err {rel:.4}");
    assert!(agree >= 0.9, "argmax agreement {agree}");
    assert!(rel <= 0.15, "max relative logit error {rel}");

    let mut cfg = ck.config().unwrap();
    cfg.rope_style = RopeStyle::Normal;
    let wrong = ck.weights_with(cfg).unwrap();
    let bad = all_logits(&wrong, &tokens);
    let (agree_bad, rel_bad) = compare(&reference, &bad, vocab);
    eprintln!(
        "HF with the wrong RoPE (Normal): argmax agreement {agree_bad:.3}, max rel logit err {rel_bad:.4}"
    );
    assert!(
        agree_bad <= agree - 0.2,
        "wrong RoPE style should be clearly worse: {agree_bad} vs {agree}"
    );
    assert!(
        rel_bad >= 2.0 * rel,
        "wrong RoPE style should be clearly worse: {rel_bad} vs {rel}"
    );
}

#[test]
fn hf_tokenizer_matches_gguf() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let want = Tokenizer::from_gguf(&g).unwrap();
    let ck = HfCheckpoint::open(hf_dir()).unwrap();
    let tok = ck.tokenizer().unwrap();
    let hf = tokenizers::Tokenizer::from_file(hf_dir().join("tokenizer.json"))
        .expect("tokenizers loads our tokenizer.json");
    assert_eq!(tok.n_vocab(), want.n_vocab());
    assert_eq!(
        (tok.bos(), tok.eos(), tok.add_bos()),
        (want.bos(), want.eos(), want.add_bos())
    );
    assert_eq!(tok.pre_type(), "smollm");
    for id in 0..want.n_vocab() as u32 {
        assert_eq!(tok.is_eog(id), want.is_eog(id), "eog flag of {id}");
    }
    for text in [
        "Hello world! 12345 apples cost $3.50.",
        "  leading spaces\n\nand newlines\ttabs",
        "<|im_start|>user\nHi there<|im_end|>\n",
        "naïve café — ünïcödé 日本語",
    ] {
        let a = want.encode(text, true, true).unwrap();
        let b = tok.encode(text, true, true).unwrap();
        assert_eq!(a, b, "{text:?}");
        let h = hf.encode(text, false).unwrap();
        assert_eq!(
            h.get_ids(),
            b.as_slice(),
            "tokenizers crate vs kvrun on {text:?}"
        );
        assert_eq!(tok.decode(&b, true), want.decode(&a, true));
    }
    let msgs = [Message::new("user", "Hi")];
    let t_hf = ck.chat_template().unwrap().expect("template");
    let t_gguf = ChatTemplate::from_gguf(&g).unwrap().unwrap();
    assert_eq!(
        t_hf.render(&msgs, true).unwrap(),
        t_gguf.render(&msgs, true).unwrap()
    );
}

/// A tiny valid directory: config.json + one safetensors file.
fn tiny_dir(name: &str) -> (PathBuf, Vec<u8>) {
    let dir = scratch_dir(name);
    std::fs::write(dir.join("config.json"), br#"{"model_type":"llama","hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2}"#).unwrap();
    let t = |name: &str, shape: Vec<u64>| St {
        name: name.into(),
        dtype: "F32",
        bytes: vec![0u8; 4 * shape.iter().product::<u64>() as usize],
        shape,
    };
    let bytes = safetensors_bytes(&[
        t("model.embed_tokens.weight", vec![4, 8]),
        t("model.norm.weight", vec![8]),
    ]);
    (dir, bytes)
}

fn open_err(dir: &Path) -> String {
    match HfCheckpoint::open(dir) {
        Ok(_) => panic!("{} opened", dir.display()),
        Err(e) => {
            assert!(matches!(e, Error::BadCheckpoint { .. }), "{e:?}");
            e.to_string()
        }
    }
}

#[test]
fn truncated_safetensors_is_one_clear_error() {
    let (dir, bytes) = tiny_dir("truncated");
    let f = dir.join("model.safetensors");
    std::fs::write(&f, &bytes[..bytes.len() - 10]).unwrap();
    let e = open_err(&dir);
    assert!(
        e.contains("model.safetensors")
            && e.contains("truncated")
            && e.contains("model.norm.weight"),
        "{e}"
    );
    assert_eq!(e.lines().count(), 1, "{e}");

    // Cut inside the header, and a file shorter than the length prefix.
    std::fs::write(&f, &bytes[..40]).unwrap();
    let e = open_err(&dir);
    assert!(
        e.contains("header length") && e.contains("truncated"),
        "{e}"
    );
    std::fs::write(&f, &bytes[..5]).unwrap();
    let e = open_err(&dir);
    assert!(e.contains("not a safetensors file"), "{e}");
}

#[test]
fn bad_checkpoints_are_clear_errors() {
    let (dir, bytes) = tiny_dir("bad");
    // No safetensors at all.
    assert!(open_err(&dir).contains("no *.safetensors"));
    // A complete file opens; missing layers fail at load with the HF name.
    std::fs::write(dir.join("model.safetensors"), &bytes).unwrap();
    let ck = HfCheckpoint::open(&dir).unwrap();
    let cfg = ck.config().unwrap();
    assert_eq!((cfg.vocab, cfg.head_dim, cfg.n_kv_heads), (4, 4, 2));
    let e = ck.weights().unwrap_err().to_string();
    assert!(e.contains("model.layers.0.input_layernorm.weight"), "{e}");
    // Unsupported dtype and a wrong architecture.
    let mut st = safetensors_bytes(&[St {
        name: "model.norm.weight".into(),
        dtype: "I8",
        shape: vec![8],
        bytes: vec![0; 8],
    }]);
    std::fs::write(dir.join("model.safetensors"), &st).unwrap();
    let ck = HfCheckpoint::open(&dir).unwrap();
    assert!(ck
        .config()
        .unwrap_err()
        .to_string()
        .contains("model.embed_tokens.weight"));
    // Offsets that disagree with the shape.
    let pos = st.windows(5).position(|w| w == b"[0,8]").unwrap();
    st[pos + 3] = b'4';
    std::fs::write(dir.join("model.safetensors"), &st).unwrap();
    let e = open_err(&dir);
    assert!(
        e.contains("model.norm.weight") && e.contains("needs 8"),
        "{e}"
    );
    std::fs::write(dir.join("config.json"), br#"{"model_type":"gpt_neox"}"#).unwrap();
    std::fs::write(dir.join("model.safetensors"), &bytes).unwrap();
    let e = HfCheckpoint::open(&dir)
        .unwrap()
        .config()
        .unwrap_err()
        .to_string();
    assert!(e.contains("gpt_neox"), "{e}");
}

#[test]
fn gguf_to_hf_names() {
    for (g, h) in [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.7.attn_q.bias", "model.layers.7.self_attn.q_proj.bias"),
        ("blk.7.attn_k.bias", "model.layers.7.self_attn.k_proj.bias"),
        ("blk.7.attn_v.bias", "model.layers.7.self_attn.v_proj.bias"),
        (
            "blk.12.attn_output.weight",
            "model.layers.12.self_attn.o_proj.weight",
        ),
        (
            "blk.0.ffn_norm.weight",
            "model.layers.0.post_attention_layernorm.weight",
        ),
        (
            "blk.0.ffn_gate.weight",
            "model.layers.0.mlp.gate_proj.weight",
        ),
    ] {
        assert_eq!(hf_name(g).as_deref(), Some(h), "{g}");
    }
    assert_eq!(hf_name("rope_freqs.weight"), None);
    assert_eq!(hf_name("blk.x.attn_q.weight"), None);
}
