//! Bad input end to end: every case runs the real `kvrun` binary and checks
//! that it fails with exactly one `error: ...` line on stderr that names the
//! file or flag and the problem, a non-zero exit code, and no panic or
//! backtrace. Small GGUF files for the model-structure cases are written by a
//! tiny GGUF v3 writer below (tiny F32 llama weights, a handful of tokens).

use crate::util;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

// ---------------------------------------------------------------- helpers

/// A scratch directory unique to this test process and case, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(case: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("kvrun-bad-input-{}-{case}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
    fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn run(args: &[&str]) -> Output {
    run_env(args, &[])
}

fn run_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(util::kvrun_bin())
        .args(args)
        .env_remove("KVRUN_MODEL")
        .env_remove("RUST_BACKTRACE")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("spawn kvrun")
}

/// Run kvrun, expect a clean one-line failure, and return that line.
fn expect_error(args: &[&str], must_contain: &[&str]) -> String {
    expect_error_env(args, &[], must_contain)
}

fn expect_error_env(args: &[&str], env: &[(&str, &str)], must_contain: &[&str]) -> String {
    let out = run_env(args, env);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let ctx = format!(
        "kvrun {args:?}\nstatus: {:?}\nstderr:\n{stderr}",
        out.status
    );
    assert!(!out.status.success(), "expected failure: {ctx}");
    assert!(out.status.code().is_some(), "killed by a signal: {ctx}");
    for bad in ["panicked", "RUST_BACKTRACE", "backtrace", "internal error"] {
        assert!(!stderr.contains(bad), "stderr contains {bad:?}: {ctx}");
    }
    let lines: Vec<&str> = stderr.trim().lines().collect();
    assert_eq!(lines.len(), 1, "expected exactly one stderr line: {ctx}");
    let line = lines[0].trim();
    assert!(
        line.starts_with("error:") && line.len() > "error:".len() + 3,
        "not an error line: {ctx}"
    );
    for want in must_contain {
        assert!(line.contains(want), "error line lacks {want:?}: {ctx}");
    }
    line.to_owned()
}

fn model() -> String {
    util::default_model().to_string_lossy().into_owned()
}

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

// ---------------------------------------------------------------- a tiny GGUF v3 writer

const ALIGN: usize = 32;
const F32: u32 = 0;

enum V {
    U32(u32),
    F32(f32),
    Str(&'static str),
    StrArr(Vec<String>),
    I32Arr(Vec<i32>),
}

struct Tensor {
    name: String,
    dims: Vec<u64>,
    ty: u32,
    data: Vec<u8>,
}

#[derive(Default)]
struct GgufWriter {
    kv: Vec<(String, V)>,
    tensors: Vec<Tensor>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl GgufWriter {
    fn kv(&mut self, k: &str, v: V) -> &mut Self {
        self.kv.retain(|(key, _)| key != k);
        self.kv.push((k.to_owned(), v));
        self
    }
    /// An F32 tensor filled with small deterministic values.
    fn f32(&mut self, name: &str, dims: &[u64]) -> &mut Self {
        let n: u64 = dims.iter().product();
        let data = (0..n)
            .flat_map(|i| (((i % 7) as f32 - 3.0) * 0.01).to_le_bytes())
            .collect();
        self.tensors.push(Tensor {
            name: name.to_owned(),
            dims: dims.to_vec(),
            ty: F32,
            data,
        });
        self
    }
    fn remove(&mut self, name: &str) -> &mut Self {
        let before = self.tensors.len();
        self.tensors.retain(|t| t.name != name);
        assert_eq!(before, self.tensors.len() + 1, "no tensor {name}");
        self
    }
    fn tensor_mut(&mut self, name: &str) -> &mut Tensor {
        self.tensors.iter_mut().find(|t| t.name == name).unwrap()
    }

    fn bytes(&self) -> Vec<u8> {
        let mut o = Vec::new();
        o.extend_from_slice(b"GGUF");
        o.extend_from_slice(&3u32.to_le_bytes());
        o.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        o.extend_from_slice(&(self.kv.len() as u64).to_le_bytes());
        for (k, v) in &self.kv {
            put_str(&mut o, k);
            match v {
                V::U32(x) => {
                    o.extend_from_slice(&4u32.to_le_bytes());
                    o.extend_from_slice(&x.to_le_bytes());
                }
                V::F32(x) => {
                    o.extend_from_slice(&6u32.to_le_bytes());
                    o.extend_from_slice(&x.to_le_bytes());
                }
                V::Str(x) => {
                    o.extend_from_slice(&8u32.to_le_bytes());
                    put_str(&mut o, x);
                }
                V::StrArr(a) => {
                    o.extend_from_slice(&9u32.to_le_bytes());
                    o.extend_from_slice(&8u32.to_le_bytes());
                    o.extend_from_slice(&(a.len() as u64).to_le_bytes());
                    for x in a {
                        put_str(&mut o, x);
                    }
                }
                V::I32Arr(a) => {
                    o.extend_from_slice(&9u32.to_le_bytes());
                    o.extend_from_slice(&5u32.to_le_bytes());
                    o.extend_from_slice(&(a.len() as u64).to_le_bytes());
                    for x in a {
                        o.extend_from_slice(&x.to_le_bytes());
                    }
                }
            }
        }
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        for t in &self.tensors {
            put_str(&mut o, &t.name);
            o.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                o.extend_from_slice(&d.to_le_bytes());
            }
            o.extend_from_slice(&t.ty.to_le_bytes());
            o.extend_from_slice(&(offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.data.len()).div_ceil(ALIGN) * ALIGN;
        }
        o.resize(o.len().div_ceil(ALIGN) * ALIGN, 0);
        let data_start = o.len();
        for (t, off) in self.tensors.iter().zip(offsets) {
            o.resize(data_start + off, 0);
            o.extend_from_slice(&t.data);
        }
        o.resize(o.len().div_ceil(ALIGN) * ALIGN, 0);
        o
    }

    fn write(&self, dir: &Scratch, name: &str) -> PathBuf {
        dir.write(name, &self.bytes())
    }
}

const DIM: u64 = 32;
const FFN: u64 = 64;
const HEADS: u32 = 2;
const KV_HEADS: u32 = 1;
const KV_DIM: u64 = DIM / HEADS as u64 * KV_HEADS as u64;

/// Byte-level BPE vocabulary: the printable ASCII bytes plus two specials.
fn vocab() -> Vec<String> {
    let mut v: Vec<String> = (b'!'..=b'~').map(|b| (b as char).to_string()).collect();
    v.push("Ġ".into()); // the byte-level space
    v.push("<|endoftext|>".into());
    v.push("<|im_start|>".into());
    v
}

/// A complete, loadable one-layer llama with tiny F32 weights and a gpt2 tokenizer.
fn tiny_llama() -> GgufWriter {
    let toks = vocab();
    let n_vocab = toks.len() as u64;
    let mut types = vec![1i32; toks.len()];
    let n = types.len();
    types[n - 2] = 3;
    types[n - 1] = 3;
    let mut w = GgufWriter::default();
    w.kv("general.architecture", V::Str("llama"))
        .kv("general.name", V::Str("tiny test llama"))
        .kv("llama.block_count", V::U32(1))
        .kv("llama.context_length", V::U32(64))
        .kv("llama.embedding_length", V::U32(DIM as u32))
        .kv("llama.feed_forward_length", V::U32(FFN as u32))
        .kv("llama.attention.head_count", V::U32(HEADS))
        .kv("llama.attention.head_count_kv", V::U32(KV_HEADS))
        .kv("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5))
        .kv("llama.rope.freq_base", V::F32(10000.0))
        .kv("tokenizer.ggml.model", V::Str("gpt2"))
        .kv("tokenizer.ggml.pre", V::Str("smollm"))
        .kv("tokenizer.ggml.tokens", V::StrArr(toks))
        .kv("tokenizer.ggml.token_type", V::I32Arr(types))
        .kv("tokenizer.ggml.merges", V::StrArr(Vec::new()))
        .kv("tokenizer.ggml.bos_token_id", V::U32(n as u32 - 2))
        .kv("tokenizer.ggml.eos_token_id", V::U32(n as u32 - 2));
    w.f32("token_embd.weight", &[DIM, n_vocab])
        .f32("output_norm.weight", &[DIM])
        .f32("blk.0.attn_norm.weight", &[DIM])
        .f32("blk.0.attn_q.weight", &[DIM, DIM])
        .f32("blk.0.attn_k.weight", &[DIM, KV_DIM])
        .f32("blk.0.attn_v.weight", &[DIM, KV_DIM])
        .f32("blk.0.attn_output.weight", &[DIM, DIM])
        .f32("blk.0.ffn_norm.weight", &[DIM])
        .f32("blk.0.ffn_gate.weight", &[DIM, FFN])
        .f32("blk.0.ffn_up.weight", &[DIM, FFN])
        .f32("blk.0.ffn_down.weight", &[FFN, DIM]);
    w
}

fn gen_args(model: &str) -> Vec<&str> {
    vec![
        "-m",
        model,
        "-p",
        "hi",
        "-n",
        "1",
        "-t",
        "1",
        "-c",
        "64",
        "--no-perf",
    ]
}

// ---------------------------------------------------------------- positive controls

/// The tiny writer's model is valid: cases 6–10 fail only by their one defect.
#[test]
fn control_tiny_model_generates() {
    let tmp = Scratch::new("control");
    let p = tiny_llama().write(&tmp, "control.gguf");
    let m = s(&p);
    let out = run(&gen_args(&m));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "tiny model failed: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// `inspect` reads a header-only file and reports the missing data on stdout.
#[test]
fn inspect_header_only_fixture_succeeds() {
    let fixture = util::shared("r1-distill-qwen-7b.header.gguf");
    let out = run(&["inspect", &s(&fixture)]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "inspect failed: {stderr}\n{stdout}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stdout.contains("qwen2"), "{stdout}");
    let data_line = stdout
        .lines()
        .find(|l| l.starts_with("tensor data: "))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(data_line.contains("tensor data missing"), "{data_line}");
    assert!(stdout.contains("deepseek-r1-qwen"), "{stdout}");
}

// ---------------------------------------------------------------- 1–5: files

#[test]
fn c01_missing_model_file() {
    expect_error(
        &["-m", "/nonexistent.gguf", "-p", "hi", "-n", "1"],
        &["/nonexistent.gguf", "no such file"],
    );
}

#[test]
fn c02_not_a_gguf() {
    let tmp = Scratch::new("c02");
    let text =
        "Hello, this is not a model at all.\nJust some text: 12345 qwerty zxcv.\n".repeat(20);
    let p = tmp.write("not_a_model.gguf", text.as_bytes());
    let m = s(&p);
    expect_error(&["-m", &m, "-p", "hi", "-n", "1"], &[&m, "bad magic"]);
}

#[test]
fn c03_header_only_fixture_as_model() {
    let fixture = util::shared("r1-distill-qwen-7b.header.gguf");
    let m = s(&fixture);
    let line = expect_error(
        &["-m", &m, "-p", "hi", "-n", "1"],
        &[
            "r1-distill-qwen-7b.header.gguf",
            "tensor data missing",
            "needs bytes",
        ],
    );
    let len = std::fs::metadata(&fixture).unwrap().len();
    assert!(line.contains(&format!("file has {len} bytes")), "{line}");
}

#[test]
fn c04_truncated_default_model() {
    let tmp = Scratch::new("c04");
    let src = std::fs::read(util::default_model()).unwrap();
    let p = tmp.write("truncated.gguf", &src[..50 << 20]);
    let m = s(&p);
    let line = expect_error(
        &["-m", &m, "-p", "hi", "-n", "1"],
        &[&m, "tensor data missing"],
    );
    assert!(
        line.contains(&format!("file has {} bytes", 50 << 20)),
        "{line}"
    );
}

#[test]
fn c05_corrupt_metadata_length() {
    let tmp = Scratch::new("c05");
    let src = std::fs::read(util::default_model()).unwrap();
    let mut head = src[..64 << 10].to_vec();
    // magic, version, tensor count, kv count; then the first key's u64 length.
    head[24..32].copy_from_slice(&(u64::MAX - 7).to_le_bytes());
    let p = tmp.write("corrupt_len.gguf", &head);
    let m = s(&p);
    expect_error(
        &["-m", &m, "-p", "hi", "-n", "1"],
        &[&m, "invalid GGUF", "byte 24", "string length"],
    );

    // A huge array length deeper in the header (tokenizer.ggml.tokens) too.
    let needle = b"tokenizer.ggml.tokens";
    let at = head
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("tokens key in the header");
    let len_at = at + needle.len() + 4 + 4; // type (array), element type (string)
    let mut head2 = src[..64 << 10].to_vec();
    head2[len_at..len_at + 8].copy_from_slice(&(1u64 << 60).to_le_bytes());
    let p2 = tmp.write("corrupt_arr.gguf", &head2);
    let m2 = s(&p2);
    expect_error(
        &["-m", &m2, "-p", "hi", "-n", "1"],
        &[&m2, "invalid GGUF", "array length"],
    );
}

// ---------------------------------------------------------------- 6–10: model structure

#[test]
fn c06_unknown_architecture() {
    let tmp = Scratch::new("c06");
    let mut w = tiny_llama();
    w.kv("general.architecture", V::Str("mamba9"));
    let m = s(&w.write(&tmp, "mamba9.gguf"));
    expect_error(&gen_args(&m), &[&m, "unknown architecture", "mamba9"]);
}

#[test]
fn c07_unsupported_tensor_type() {
    let tmp = Scratch::new("c07");
    let mut w = tiny_llama();
    let t = w.tensor_mut("blk.0.attn_q.weight");
    t.ty = 16; // IQ2_XXS: 256-element blocks of 66 bytes
    t.dims = vec![256, DIM];
    t.data = vec![0u8; 66 * DIM as usize];
    let m = s(&w.write(&tmp, "iq2.gguf"));
    expect_error(
        &gen_args(&m),
        &[&m, "blk.0.attn_q.weight", "unsupported type", "IQ2_XXS"],
    );
}

#[test]
fn c08_missing_tensor() {
    let tmp = Scratch::new("c08");
    let mut w = tiny_llama();
    w.remove("blk.0.attn_q.weight");
    let m = s(&w.write(&tmp, "missing.gguf"));
    expect_error(
        &gen_args(&m),
        &[&m, "missing tensor", "blk.0.attn_q.weight"],
    );
}

#[test]
fn c09_shape_mismatch() {
    let tmp = Scratch::new("c09");
    let mut w = tiny_llama();
    w.remove("blk.0.ffn_down.weight")
        .f32("blk.0.ffn_down.weight", &[DIM, FFN]);
    let m = s(&w.write(&tmp, "shape.gguf"));
    expect_error(
        &gen_args(&m),
        &[&m, "blk.0.ffn_down.weight", "shape", "[32, 64]", "[64, 32]"],
    );
}

#[test]
fn c10_unknown_pre_tokenizer() {
    let tmp = Scratch::new("c10");
    let mut w = tiny_llama();
    w.kv("tokenizer.ggml.pre", V::Str("nonesuch"));
    let m = s(&w.write(&tmp, "pre.gguf"));
    expect_error(
        &gen_args(&m),
        &[&m, "tokenizer", "pre-tokenizer", "nonesuch"],
    );
}

// ---------------------------------------------------------------- 11–14: flags

#[test]
fn c11_prompt_file_not_utf8() {
    let tmp = Scratch::new("c11");
    let p = tmp.write("prompt.bin", &[b'o', b'k', 0xff, 0xfe, 0x00, 0x41, 0xc3]);
    let f = s(&p);
    let m = model();
    expect_error(&["-m", &m, "-f", &f, "-n", "1"], &["-f", &f, "UTF-8"]);
}

#[test]
fn c12_context_smaller_than_prompt() {
    let m = model();
    expect_error(
        &[
            "-m",
            &m,
            "-p",
            "Tell me a long story about a dragon and a knight.",
            "-c",
            "4",
            "-n",
            "1",
            "-t",
            "1",
        ],
        &["-c/--ctx-size", "context holds 4"],
    );
}

#[test]
fn c13_negative_n_predict() {
    let m = model();
    expect_error(
        &["-m", &m, "-p", "hi", "-n", "-5"],
        &["-n/--n-predict", "-5"],
    );
}

#[test]
fn c14_zero_threads() {
    let m = model();
    expect_error(
        &["-m", &m, "-p", "hi", "-n", "1", "-t", "0"],
        &["-t/--threads", "got 0"],
    );
}

// ---------------------------------------------------------------- found while writing these

/// A context far too large to allocate used to abort in the allocator
/// ("memory allocation of N bytes failed", SIGABRT); now it is a -c error.
#[test]
fn c15_huge_context() {
    let m = model();
    expect_error(
        &[
            "-m",
            &m,
            "-p",
            "hi",
            "-n",
            "1",
            "-t",
            "1",
            "-c",
            "99999999999",
        ],
        &["-c/--ctx-size", "99999999999", "cannot be allocated"],
    );
    expect_error(
        &[
            "-m",
            &m,
            "-p",
            "hi",
            "-n",
            "1",
            "-t",
            "1",
            "-c",
            &i64::MAX.to_string(),
        ],
        &["-c/--ctx-size", "cannot be allocated"],
    );
}

/// The -t upper bound is named in the message (it used to say "at least 1").
#[test]
fn c16_too_many_threads() {
    let m = model();
    expect_error(
        &["-m", &m, "-p", "hi", "-n", "1", "-t", "100000"],
        &["-t/--threads", "1024", "got 100000"],
    );
}

/// A tokenizer larger than the embedding matrix is refused at load (it used
/// to fail at the first prompt token: "token id 71 out of range", no file named).
#[test]
fn c17_vocab_larger_than_embedding() {
    let tmp = Scratch::new("c17");
    let mut w = tiny_llama();
    w.remove("token_embd.weight")
        .f32("token_embd.weight", &[DIM, 10]);
    let m = s(&w.write(&tmp, "small_embd.gguf"));
    let n = format!("{} tokens", vocab().len());
    expect_error(
        &gen_args(&m),
        &[&m, "token_embd.weight", &n, "only 10 rows"],
    );
}

/// A tensor whose byte size overflows u64 is reported as too large (it used
/// to be reported as a row length that is "not a multiple of the F32 block
/// size 1").
#[test]
fn c18_tensor_too_large() {
    let tmp = Scratch::new("c18");
    let mut w = tiny_llama();
    w.tensor_mut("blk.0.attn_q.weight").dims = vec![DIM, 1 << 58];
    let m = s(&w.write(&tmp, "huge_tensor.gguf"));
    expect_error(
        &gen_args(&m),
        &[&m, "invalid GGUF", "blk.0.attn_q.weight", "too large"],
    );
}

/// A quantized row that is not a whole number of blocks, at an offset near
/// u64::MAX (the error's byte offset used to be computed with an unchecked add).
#[test]
fn c19_partial_block_at_huge_offset() {
    let tmp = Scratch::new("c19");
    let mut w = tiny_llama();
    // A Q4_0 tensor (32-element blocks of 18 bytes) whose row is half a block,
    // first in the table; then its offset is patched to u64::MAX - 31.
    w.remove("blk.0.attn_q.weight");
    w.tensors.insert(
        0,
        Tensor {
            name: "blk.0.attn_q.weight".into(),
            dims: vec![16, DIM],
            ty: 2,
            data: vec![0; 18 * 16],
        },
    );
    let mut b = w.bytes();
    let name = b"blk.0.attn_q.weight";
    let at = b.windows(name.len()).position(|x| x == name).unwrap() + name.len();
    let off_at = at + 4 + 2 * 8 + 4; // n_dims, two dims, type
    b[off_at..off_at + 8].copy_from_slice(&(u64::MAX - 31).to_le_bytes());
    let m = s(&tmp.write("partial_block.gguf", &b));
    expect_error(
        &gen_args(&m),
        &[
            &m,
            "invalid GGUF",
            "blk.0.attn_q.weight",
            "not a multiple of the Q4_0 block size 32",
        ],
    );
}

// ---------------------------------------------------------------- KV cache flags

/// An unknown `--cache-type` is one line naming the flag and the choices.
/// Metadata values the math depends on are checked at load, naming the
/// key: a −inf epsilon, a NaN RoPE base, a zero scaling factor, BOS/EOS ids
/// past the vocabulary (each was silent garbage or a wrong stop before).
#[test]
fn c20_corrupt_metadata_values() {
    let tmp = Scratch::new("c20");
    let n = vocab().len() as u32;
    let cases: Vec<(&str, V, &[&str])> = vec![
        (
            "llama.attention.layer_norm_rms_epsilon",
            V::F32(f32::NEG_INFINITY),
            &["layer_norm_rms_epsilon", "-inf"],
        ),
        (
            "llama.rope.freq_base",
            V::F32(f32::NAN),
            &["rope.freq_base", "NaN"],
        ),
        (
            "tokenizer.ggml.bos_token_id",
            V::U32(n),
            &["bos_token_id", "outside the vocabulary"],
        ),
        (
            "tokenizer.ggml.eos_token_id",
            V::U32(n + 1000),
            &["eos_token_id", "outside the vocabulary"],
        ),
    ];
    for (i, (key, v, want)) in cases.into_iter().enumerate() {
        let mut w = tiny_llama();
        w.kv(key, v);
        let m = s(&w.write(&tmp, &format!("meta{i}.gguf")));
        expect_error(&gen_args(&m), want);
    }
    let mut w = tiny_llama();
    w.kv("llama.rope.scaling.type", V::Str("linear"))
        .kv("llama.rope.scaling.factor", V::F32(0.0));
    let m = s(&w.write(&tmp, "scale.gguf"));
    expect_error(&gen_args(&m), &["rope.scaling.factor"]);
}

#[test]
fn c40_unknown_cache_type() {
    let m = model();
    let mut a = gen_args(&m);
    a.extend(["--cache-type", "q4_0"]);
    expect_error(&a, &["--cache-type", "q4_0", "f32, f16, q8_0"]);
}

/// q8_0 needs head_dim to be a multiple of 32: the tiny model's is not.
#[test]
fn c41_q8_0_cache_on_a_model_whose_heads_do_not_fit_blocks() {
    let tmp = Scratch::new("q8cache");
    let m = s(&tiny_llama().write(&tmp, "tiny.gguf"));
    let mut a = gen_args(&m);
    a.extend(["--cache-type", "q8_0"]);
    expect_error(&a, &["--cache-type", "q8_0", "multiple of 32"]);
    // f32 works on it
    let mut a = gen_args(&m);
    a.extend(["--cache-type", "f32"]);
    let out = run(&a);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--pos-mode cache` needs `--policy window`; unknown modes are named.
#[test]
fn c42_pos_mode_cache_without_window() {
    let m = model();
    let mut a = gen_args(&m);
    a.extend([
        "--pos-mode",
        "cache",
        "--policy",
        "h2o",
        "--kv-budget",
        "32",
    ]);
    expect_error(&a, &["--pos-mode", "window", "h2o"]);
    let mut a = gen_args(&m);
    a.extend(["--pos-mode", "cache"]);
    expect_error(&a, &["--pos-mode", "window", "full"]);
    let mut a = gen_args(&m);
    a.extend(["--pos-mode", "relative"]);
    expect_error(&a, &["--pos-mode", "relative", "absolute, cache"]);
}

// ---------------------------------------------------------------- device

/// `--device cuda` (or llama.cpp's `-ngl N`) on a machine without an
/// NVIDIA driver, or in a build without CUDA kernels, is one line naming
/// the flag and the device, for the commands that run on the GPU; the
/// commands that run on the CPU only say so whatever the machine; unknown
/// devices name the choices; `--device cpu` and `-ngl 0` run.
#[test]
fn c50_device_flag_reaches_the_backend_check() {
    let m = model();
    // a GPU machine runs these (scripts/gpu-check.sh covers them there)
    if !std::path::Path::new("/dev/nvidiactl").exists() {
        for dev in [["--device", "cuda"], ["--device", "cuda:1"], ["-ngl", "99"]] {
            let mut a = gen_args(&m);
            a.extend(dev);
            expect_error(&a, &["--device", "cuda"]);
        }
        expect_error(
            &["bench", "-m", &m, "--device", "cuda", "-p", "8", "-n", "2"],
            &["--device", "cuda:0"],
        );
    }
    expect_error(
        &["chat", "-m", &m, "--device", "cuda"],
        &["--device", "cuda", "CPU only"],
    );
    let mut a = gen_args(&m);
    a.extend(["--device", "tpu"]);
    expect_error(&a, &["--device", "tpu", "cpu, cuda, cuda:N"]);
    let mut a = gen_args(&m);
    a.extend(["-ngl", "some"]);
    expect_error(&a, &["-ngl", "some"]);
    for ok in [["--device", "cpu"], ["-ngl", "0"]] {
        let mut a = gen_args(&m);
        a.extend(ok);
        let out = run(&a);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

// ---------------------------------------------------------------- retention gates

/// trimkv/dbtrimkv without gates, with a gate file that is not one, with
/// gates of another model; `--gates` on a policy that reads none; the
/// trainer's bad arguments: one line each.
#[test]
fn c60_retention_gates() {
    let m = model();
    let tmp = Scratch::new("c60");
    let mut a = gen_args(&m);
    a.extend([
        "--policy",
        "dbtrimkv",
        "--kv-budget",
        "64",
        "--gates",
        "/nonexistent.gates.safetensors",
    ]);
    expect_error(
        &a,
        &[
            "--gates",
            "/nonexistent.gates.safetensors",
            "kvrun train gates",
        ],
    );
    let junk = tmp.write("junk.safetensors", b"\x05\x00\x00\x00\x00\x00\x00\x00{}   ");
    let junk_s = s(&junk);
    let mut a = gen_args(&m);
    a.extend([
        "--policy",
        "trimkv",
        "--kv-budget",
        "64",
        "--gates",
        &junk_s,
    ]);
    expect_error(&a, &["junk.safetensors", "not a kvrun gate file"]);
    // gates of another shape: refused when the session is built
    let g = kvrun::policy::gates::Gates::init(
        kvrun::policy::gates::GateArch::Rg10,
        64,
        8,
        2,
        1,
        10.0,
        1,
    );
    let other = tmp.0.join("other.gates.safetensors");
    g.save(&other).unwrap();
    let other_s = s(&other);
    let mut a = gen_args(&m);
    a.extend([
        "--policy",
        "dbtrimkv",
        "--kv-budget",
        "64",
        "--gates",
        &other_s,
    ]);
    expect_error(
        &a,
        &["retention gates were trained for", "layers 2 (model: 30)"],
    );
    let mut a = gen_args(&m);
    a.extend(["--policy", "h2o", "--kv-budget", "64", "--gates", &other_s]);
    expect_error(&a, &["--gates", "only applies to trimkv and dbtrimkv"]);
    let mut a = gen_args(&m);
    a.extend([
        "--policy",
        "dbtrimkv",
        "--kv-budget",
        "64",
        "--min-per-head",
        "65",
    ]);
    if std::path::Path::new(&m)
        .with_extension("gates.safetensors")
        .is_file()
    {
        expect_error(&a, &["--min-per-head", "65 exceeds the per-head budget 64"]);
    }
    let data = tmp.write("d.txt", b"hello world");
    let data_s = s(&data);
    for (bad, msg) in [
        (vec!["--budget", "0"], "--budget"),
        (
            vec!["--budget", "8", "--arch", "rg7"],
            "unknown gate architecture 'rg7'",
        ),
        (vec!["--budget", "8", "--seq-len", "1"], "--seq-len"),
        (
            vec!["--budget", "8", "--seq-len", "64", "--loss-window", "64"],
            "--loss-window: must be below --seq-len (64)",
        ),
        (
            vec!["--budget", "8", "--decay", "exp"],
            "unknown retention decay 'exp' (logit, weight)",
        ),
        (vec!["--budget", "8", "--lr", "3"], "--lr"),
        (
            vec![
                "--budget",
                "8",
                "--resume",
                "-o",
                "/nonexistent/g.safetensors",
            ],
            "--resume",
        ),
        (
            vec!["--budget", "8", "--seq-len", "64"],
            "fewer than one sequence of 64",
        ),
        // regression: 1024 tokens were an OOM kill at 24 GB, not an error
        (
            vec!["--budget", "8", "--seq-len", "8192"],
            "GiB are available: use a shorter --seq-len",
        ),
        (
            vec!["--budget", "8", "--init", "/nonexistent/g.safetensors"],
            "--init: no gate file",
        ),
    ] {
        let mut a = vec![
            "train",
            "gates",
            "-m",
            &m,
            "--data",
            &data_s,
            "--skip-tokens",
            "0",
        ];
        a.extend(bad.iter().copied());
        expect_error(&a, &[msg]);
    }
}

/// `KVRUN_CPU` naming no kernel level, or one this CPU lacks: one line.
#[test]
fn c61_kernel_level() {
    use kvrun::backend::cpu::isa::{detected, Level};
    let m = model();
    let a = gen_args(&m);
    expect_error_env(
        &a,
        &[("KVRUN_CPU", "avx9")],
        &["KVRUN_CPU=avx9", "expected one of", "portable"],
    );
    if let Some(above) = Level::ALL.into_iter().find(|&l| l > detected()) {
        expect_error_env(
            &a,
            &[("KVRUN_CPU", above.name())],
            &["this CPU supports at most", detected().name()],
        );
    }
    // KVRUN_AMX_EMULATE: 1 or 0, and 1 only where the CPU has AVX-512 VNNI
    expect_error_env(
        &a,
        &[("KVRUN_AMX_EMULATE", "yes")],
        &["KVRUN_AMX_EMULATE=yes", "expected 1"],
    );
    if detected() < Level::Avx512Vnni {
        expect_error_env(
            &a,
            &[("KVRUN_AMX_EMULATE", "1")],
            &["KVRUN_AMX_EMULATE=1", "AVX-512 VNNI"],
        );
    }
    // every level the CPU has is accepted
    for l in Level::ALL.into_iter().filter(|&l| l <= detected()) {
        let out = run_env(&a, &[("KVRUN_CPU", l.name())]);
        assert!(
            out.status.success(),
            "KVRUN_CPU={l}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// `kvrun synth` and `-m synth:...`: a missing header, an unknown shape or
/// mix, a header whose tensors have no reshaping rule: one line each.
#[test]
fn c62_synthetic_models() {
    let hdr = util::shared("r1-distill-qwen-7b.header.gguf");
    let h = s(&hdr);
    let tmp = Scratch::new("c62");
    let out = s(&tmp.0.join("o.gguf"));
    expect_error(
        &["synth", "/nonexistent.gguf", "-o", &out],
        &["no such file"],
    );
    expect_error(
        &["synth", &h, "-o", &out, "--shape", "gpt5"],
        &["--shape", "unknown shape", "r1-distill-qwen-1.5b"],
    );
    expect_error(
        &["synth", &h, "-o", &out, "--type", "Q3_K_XL"],
        &["--type", "unknown mix", "Q4_K_M"],
    );
    expect_error(&["synth", &h, "-o", &out, "--sigma", "0"], &["--sigma"]);
    expect_error(
        &["synth", &h, "-o", "/nonexistent/dir/o.gguf"],
        &["/nonexistent/dir"],
    );
    assert!(!tmp.0.join("o.gguf.tmp").exists());
    for (m, want) in [
        ("synth:/nonexistent.gguf".to_string(), "no such header file"),
        (format!("synth:{h}:bogus"), "not a shape"),
    ] {
        expect_error(&["-m", &m, "-p", "hi", "-n", "1"], &[want]);
    }
    expect_error(&["synth", &h, "-o", &out, "-t", "0"], &["-t/--threads"]);
}

/// Sampling values the server rejects are one-line errors on the command
/// line too (one check in the library), for run, batch and serve.
#[test]
fn c70_sampling_out_of_range() {
    let m = model();
    let cases: [(&str, &str); 4] = [
        ("--top-p=5", "--top-p: must be between 0 and 1, got 5"),
        ("--min-p=-1", "--min-p: must be between 0 and 1, got -1"),
        ("--repeat-penalty=0", "--repeat-penalty: must be above 0"),
        ("--temp=inf", "--temp: must be a finite number"),
    ];
    for (flag, want) in cases {
        expect_error(&["-m", &m, "-p", "hi", "-n", "1", flag], &[want]);
        expect_error(&["batch", "-m", &m, "-i", "-", "-o", "-", flag], &[want]);
        expect_error(&["serve", "-m", &m, "--port", "0", flag], &[want]);
    }
}

/// `serve` checks its own KV flags at start-up: a default policy no request
/// could run with is a one-line error, not a server that fails every request.
#[test]
fn c71_serve_default_policy_checked_at_start() {
    let m = model();
    expect_error(
        &[
            "serve",
            "-m",
            &m,
            "--port",
            "0",
            "--policy",
            "h2o",
            "--kv-budget",
            "1",
        ],
        &["--kv-budget", "cannot hold the protected tokens"],
    );
    expect_error(
        &[
            "serve",
            "-m",
            &m,
            "--port",
            "0",
            "-c",
            "256",
            "--policy",
            "window",
            "--kv-budget",
            "512",
        ],
        &["--kv-budget", "larger than the context"],
    );
    expect_error(
        &["serve", "-m", &m, "--port", "0", "--timeout", "0"],
        &["--timeout"],
    );
}

/// `serve --alias ''` would answer every request with an empty model id:
/// refused at start-up (one line, non-zero exit), blank ones too.
#[test]
fn c72_serve_empty_alias_refused() {
    let m = model();
    for alias in ["", "  "] {
        // the unusable --host makes a server that took the alias fail
        // (on another flag) instead of serving for ever
        expect_error(
            &[
                "serve",
                "-m",
                &m,
                "--host",
                "256.0.0.1",
                "--port",
                "0",
                "--alias",
                alias,
            ],
            &["-a/--alias", "must not be empty"],
        );
    }
}
