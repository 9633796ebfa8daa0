//! `kvrun inspect MODEL`: a model file's architecture, shapes, tensor types,
//! tokenizer and chat template, each part reported even when another is
//! broken (it reads the GGUF directly, not through `load_model`).

use crate::chat::{ChatTemplate, Message};
use crate::error::Result;
use crate::format::gguf::Gguf;
use crate::tokenizer::Tokenizer;
use std::path::Path;

/// `kvrun inspect MODEL`.
pub fn run_inspect(path: &Path) -> Result<()> {
    if path.is_dir() {
        // (mapping a directory fails with "No such device")
        return Err(crate::error::Error::BadCheckpoint {
            path: path.to_owned(),
            what: "a directory, not a GGUF file (inspect reads GGUF files, header-only ones too)"
                .into(),
        });
    }
    let g = Gguf::open(path)?;
    let mut o = String::new();
    use std::fmt::Write as _;
    let _ = writeln!(
        o,
        "file: {} (GGUF v{}, {} bytes)",
        path.display(),
        g.version,
        g.bytes().len()
    );
    let _ = writeln!(
        o,
        "metadata: {} keys, tensors: {}, data offset {}, alignment {}",
        g.metadata.len(),
        g.tensors.len(),
        g.data_offset,
        g.alignment
    );
    for key in [
        "general.name",
        "general.architecture",
        "general.file_type",
        "general.size_label",
    ] {
        if let Some(v) = g.get(key) {
            let _ = writeln!(o, "  {key} = {}", short_value(v));
        }
    }
    match crate::model::Config::from_gguf(&g) {
        Ok(c) => {
            let _ = writeln!(
                o,
                "architecture: {} | layers {} | dim {} | ffn {} | heads {} (kv {}) | head_dim {} | vocab {} | ctx_train {} | rope base {} dims {} {:?} | eps {:e} | output {}",
                c.arch.name(), c.n_layers, c.dim, c.ffn_dim, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab,
                c.n_ctx_train, c.rope_base, c.n_rot, c.rope_style, c.norm_eps,
                if c.tied_output { "tied to token_embd" } else { "separate" }
            );
            let fx = &c.features;
            let mut extra = Vec::new();
            if fx.qk_norm {
                extra.push("q/k norm".to_string());
            }
            if fx.post_norms {
                extra.push("post-norms".to_string());
            }
            if fx.ffn_act == crate::model::FfnAct::GeluTanh {
                extra.push("GeGLU (tanh)".to_string());
            }
            if fx.embed_scale != 1.0 {
                extra.push(format!("embedding × {:.3}", fx.embed_scale));
            }
            if fx.logit_softcap > 0.0 {
                extra.push(format!("logit soft cap {}", fx.logit_softcap));
            }
            if let Some(m) = &fx.moe {
                extra.push(format!(
                    "experts {} of {} (ffn {} each{})",
                    m.n_used,
                    m.n_expert,
                    m.expert_ffn,
                    if m.norm_weights {
                        ", weights renormalized"
                    } else {
                        ""
                    }
                ));
            }
            if let Some(w) = &fx.swa {
                let global: Vec<String> = c.cache_layers().iter().map(|l| l.to_string()).collect();
                extra.push(format!(
                    "sliding window {} on {} local layers (rope base {}), global layers {}",
                    w.window,
                    c.n_layers - c.n_cache_layers(),
                    w.rope_base,
                    global.join(",")
                ));
            }
            if !extra.is_empty() {
                let _ = writeln!(o, "features: {}", extra.join(" | "));
            }
            let kv_tok = 2 * c.n_cache_layers() * c.kv_dim() * 2;
            let _ = writeln!(
                o,
                "kv cache (f16): {kv_tok} bytes per token ({:.1} KiB){}",
                kv_tok as f64 / 1024.0,
                match &fx.swa {
                    Some(w) => format!(
                        " in the budgeted global layers, plus a fixed {} KiB for the local layers' window",
                        2 * (c.n_layers - c.n_cache_layers()) * c.kv_dim() * 2 * w.window / 1024
                    ),
                    None => String::new(),
                }
            );
        }
        Err(e) => {
            let _ = writeln!(o, "architecture: not loadable ({e})");
        }
    }
    // tensor type summary
    let mut by_type: std::collections::BTreeMap<String, (usize, u64, u64)> = Default::default();
    for t in &g.tensors {
        let e = by_type
            .entry(crate::tensor::ggml_type_name(t.type_id))
            .or_default();
        e.0 += 1;
        e.1 += t.n_elements();
        e.2 += t.n_bytes().unwrap_or(0);
    }
    let total_params: u64 = g.tensors.iter().map(|t| t.n_elements()).sum();
    let total_bytes: u64 = g.tensors.iter().filter_map(|t| t.n_bytes()).sum();
    let _ = writeln!(
        o,
        "tensors: {} params, {:.2} MiB",
        total_params,
        total_bytes as f64 / (1 << 20) as f64
    );
    for (ty, (n, el, by)) in &by_type {
        let _ = writeln!(
            o,
            "  {ty:8} {n:5} tensors {el:12} params {:10.2} MiB",
            *by as f64 / (1 << 20) as f64
        );
    }
    for t in g
        .tensors
        .iter()
        .filter(|t| !t.name.starts_with("blk.") || t.name.starts_with("blk.0."))
    {
        let _ = writeln!(
            o,
            "  {:32} {:8} {:?}",
            t.name,
            crate::tensor::ggml_type_name(t.type_id),
            t.dims
        );
    }
    match g.check_data() {
        Ok(()) => {
            let _ = writeln!(o, "tensor data: complete");
        }
        Err(e) => {
            let _ = writeln!(o, "tensor data: {e}");
        }
    }
    match Tokenizer::from_gguf(&g) {
        Ok(t) => {
            let _ = writeln!(
                o,
                "tokenizer: {} / pre {} | {} tokens | bos {:?} eos {:?} add_bos {}",
                t.model_type(),
                t.pre_type(),
                t.n_vocab(),
                t.bos(),
                t.eos(),
                t.add_bos()
            );
        }
        Err(e) => {
            let _ = writeln!(o, "tokenizer: {e}");
        }
    }
    match g.get("tokenizer.chat_template").and_then(|v| v.as_str()) {
        Some(src) => {
            let status = match ChatTemplate::from_gguf(&g) {
                Ok(Some(t)) => match t.render(
                    &[Message {
                        role: "user".into(),
                        content: "Hi".into(),
                    }],
                    true,
                ) {
                    Ok(s) => format!("renders; sample: {:?}", s),
                    Err(e) => format!("does not render: {e}"),
                },
                Ok(None) => "absent".into(),
                Err(e) => format!("invalid: {e}"),
            };
            let _ = writeln!(o, "chat template: {} chars, {status}", src.len());
        }
        None => {
            let _ = writeln!(o, "chat template: none");
        }
    }
    print!("{o}");
    Ok(())
}

fn short_value(v: &crate::format::gguf::Value) -> String {
    match v {
        crate::format::gguf::Value::Str(s) => format!("{s:?}"),
        crate::format::gguf::Value::Array(a) => format!("[{} items]", a.len()),
        other => format!("{other:?}"),
    }
}
