//! The CUDA backend.
//!
//! - Everywhere (no GPU needed): every embedded PTX module compiles with
//!   ptxas for sm_80 and sm_90 (`KVRUN_REQUIRE_NVCC=1`, as CI sets, makes
//!   a missing ptxas or a build without kernels a failure).
//! - On a machine with an NVIDIA GPU (skipped elsewhere; `KVRUN_REQUIRE_GPU=1`,
//!   as scripts/gpu-check.sh sets, makes a missing GPU a failure): every
//!   operation of the `Backend` trait against the CPU backend on fresh
//!   random data (f32 paths within 1e-5 of the largest reference value,
//!   quantized matmuls within 1e-4 of an f64 product of the dequantized
//!   weights), attention over every store type and both cache layouts with
//!   the mass export, and a synthetic model decoded on both backends
//!   (`KVRUN_SYNTH_HEADER` names the header GGUF; default
//!   ../shared/data/r1-distill-qwen-7b.header.gguf).

#[path = "util/mod.rs"]
mod util;

use kvrun::backend::cuda::{self, Cuda};
use kvrun::backend::{AttnStep, Backend, Host, KvAccess, KvType, MassMode, Rope, RopeStyle};
use kvrun::kv::KvCache;
use kvrun::rng::Rng;
use kvrun::tensor::DType;
use std::borrow::Cow;
use std::path::PathBuf;

// ------------------------------------------------------------------ ptxas

fn find_ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KVRUN_PTXAS") {
        return Some(PathBuf::from(p));
    }
    if let Some(n) = std::env::var_os("KVRUN_NVCC") {
        let p = PathBuf::from(n).with_file_name("ptxas");
        if p.is_file() {
            return Some(p);
        }
    }
    if let Some(h) = std::env::var_os("CUDA_HOME") {
        let p = PathBuf::from(h).join("bin/ptxas");
        if p.is_file() {
            return Some(p);
        }
    }
    std::env::var_os("PATH").and_then(|ps| {
        std::env::split_paths(&ps)
            .map(|d| d.join("ptxas"))
            .find(|p| p.is_file())
    })
}

fn required(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| v == "1")
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90() {
    let modules = cuda::ptx_modules();
    if modules.is_empty() {
        assert!(
            !required("KVRUN_REQUIRE_NVCC"),
            "KVRUN_REQUIRE_NVCC=1 but this build has no CUDA kernels"
        );
        eprintln!("skipped: built without nvcc (no kernels to check)");
        return;
    }
    let Some(ptxas) = find_ptxas() else {
        assert!(
            !required("KVRUN_REQUIRE_NVCC"),
            "KVRUN_REQUIRE_NVCC=1 but no ptxas (KVRUN_PTXAS, next to KVRUN_NVCC, $CUDA_HOME/bin, PATH)"
        );
        eprintln!("skipped: no ptxas found");
        return;
    };
    let names: Vec<&str> = modules.iter().map(|m| m.0).collect();
    for want in ["attention", "elementwise", "matmul"] {
        assert!(names.contains(&want), "module {want} missing: {names:?}");
    }
    let dir = std::env::temp_dir().join(format!("kvrun-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, text) in modules {
        // PTX ISA at most 9.0, so a CUDA 13.0 driver JIT-compiles it
        let ver = text
            .lines()
            .find_map(|l| l.trim().strip_prefix(".version "))
            .unwrap_or_else(|| panic!("{name}: no .version line"));
        let (maj, min) = ver.trim().split_once('.').unwrap();
        let v = maj.parse::<u32>().unwrap() * 10 + min.parse::<u32>().unwrap();
        assert!(v <= 90, "{name}: PTX ISA {ver} is newer than 9.0");
        let f = dir.join(format!("{name}.ptx"));
        std::fs::write(&f, text).unwrap();
        for arch in ["sm_80", "sm_90"] {
            let out = std::process::Command::new(&ptxas)
                .arg(format!("-arch={arch}"))
                .arg("-o")
                .arg(dir.join(format!("{name}.{arch}.cubin")))
                .arg(&f)
                .output()
                .expect("run ptxas");
            assert!(
                out.status.success(),
                "ptxas -arch={arch} {name}.ptx: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

// ------------------------------------------------------------------ GPU

/// GPU 0, or None (skip) where this build or machine has none.
fn gpu() -> Option<Cuda> {
    if cuda::available() {
        return Some(Cuda::new(0, 2).expect("open GPU 0"));
    }
    assert!(
        !required("KVRUN_REQUIRE_GPU"),
        "KVRUN_REQUIRE_GPU=1 but no GPU is usable (kernels embedded: {}, driver: {})",
        cuda::has_kernels(),
        cuda::driver_present()
    );
    eprintln!("skipped: no NVIDIA GPU");
    None
}

fn randn(rng: &mut Rng, n: usize, s: f32) -> Vec<f32> {
    (0..n).map(|_| rng.normal() * s).collect()
}

/// max |a − b| ≤ tol · max |b|
fn close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let m = b.iter().fold(0f32, |m, &v| m.max(v.abs())).max(1e-30);
    let (i, e) = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .enumerate()
        .fold(
            (0, 0f32),
            |acc, (i, e)| if e > acc.1 { (i, e) } else { acc },
        );
    assert!(
        e <= tol * m && a.iter().all(|x| x.is_finite()),
        "{what}: max error {e} at {i} ({} vs {}) exceeds {tol} × {m}",
        a[i],
        b[i]
    );
}

/// Weights of `dtype`, n_out rows of n_in, from N(0, s²).
fn weights(rng: &mut Rng, dtype: DType, n_in: usize, n_out: usize, s: f32) -> Vec<u8> {
    let x = randn(rng, n_in * n_out, s);
    match dtype {
        DType::F32 => bytemuck::cast_slice(&x).to_vec(),
        DType::F16 | DType::BF16 => {
            let mut q = vec![0u8; 2 * x.len()];
            if dtype == DType::F16 {
                kvrun::quant::quantize_row_f16(&x, &mut q);
            } else {
                kvrun::quant::quantize_row_bf16(&x, &mut q);
            }
            q
        }
        _ => x
            .chunks_exact(n_in)
            .flat_map(|r| ggml_sys::quantize_ref(dtype.ggml_id(), r))
            .collect(),
    }
}

#[test]
fn matmul_of_every_weight_type_matches_an_exact_product() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(11);
    let (n_in, n_out) = (768, 67);
    for dtype in DType::ALL {
        let w = weights(&mut rng, dtype, n_in, n_out, 0.05);
        let m = g.matrix(dtype, n_in, n_out, Cow::Borrowed(&w)).unwrap();
        let rb = dtype.row_bytes(n_in);
        let mut deq = vec![0f32; n_in * n_out];
        for (r, row) in deq.chunks_exact_mut(n_in).enumerate() {
            kvrun::quant::dequantize_row(dtype, &w[r * rb..(r + 1) * rb], row);
        }
        for n_tok in [1usize, 2, 3, 5, 8, 9, 40, 100] {
            let x = randn(&mut rng, n_tok * n_in, 1.0);
            let want: Vec<f32> = (0..n_tok * n_out)
                .map(|i| {
                    let (t, r) = (i / n_out, i % n_out);
                    (0..n_in)
                        .map(|k| x[t * n_in + k] as f64 * deq[r * n_in + k] as f64)
                        .sum::<f64>() as f32
                })
                .collect();
            let xa = g.act_from(&x).unwrap();
            let mut y = g.act(n_tok * n_out);
            let mut sc = g.scratch();
            g.matmul(&mut sc, &[&m], &xa, n_tok, &mut [&mut y]);
            let mut got = Vec::new();
            g.read(&y, 0..n_tok * n_out, &mut got);
            close(&format!("{dtype:?} × {n_tok} tokens"), &got, &want, 1e-4);
            // the classifier path reads back to the host
            let mut host = vec![0f32; n_tok * n_out];
            g.matmul_host(&mut sc, &m, &xa, n_tok, &mut host);
            close(&format!("{dtype:?} matmul_host"), &host, &want, 1e-4);
            g.check().unwrap();
        }
        // a weight row read back, as scorers read W_O
        let mut row = vec![0f32; n_in];
        g.mat_row(&m, 5, &mut row);
        assert_eq!(row, deq[5 * n_in..6 * n_in], "{dtype:?} mat_row");
    }
}

/// The same sequence of element-wise ops on a backend; every result read
/// back.
fn elementwise_ops<B: Backend>(
    b: &B,
    mk: &dyn Fn(&[f32]) -> B::Act,
    seed: u64,
) -> Vec<(String, Vec<f32>)> {
    let mut rng = Rng::new(seed);
    let (n, dim, nh, nkv, hd) = (5usize, 256usize, 4usize, 2usize, 64usize);
    let mut out: Vec<(String, Vec<f32>)> = Vec::new();
    let rd = |a: &B::Act, len: usize| {
        let mut v = Vec::new();
        b.read(a, 0..len, &mut v);
        v
    };
    let x = mk(&randn(&mut rng, n * dim, 1.0));
    let w = b.vector(randn(&mut rng, dim, 1.0)).unwrap();
    let mut o = b.act(n * dim);
    b.rmsnorm(&x, 1, &w, 1e-5, 3, &mut o);
    out.push(("rmsnorm".into(), rd(&o, 3 * dim)));
    let mut x2 = mk(&randn(&mut rng, n * dim, 1.0));
    let mut b2 = mk(&randn(&mut rng, n * dim, 1.0));
    b.add_rmsnorm(&mut x2, &mut b2, &w, 1e-6, n);
    out.push(("add_rmsnorm x".into(), rd(&x2, n * dim)));
    out.push(("add_rmsnorm b".into(), rd(&b2, n * dim)));
    let wq = b.vector(randn(&mut rng, hd, 1.0)).unwrap();
    let mut q = mk(&randn(&mut rng, n * nh * hd, 1.0));
    b.rmsnorm_rows(&mut q, &wq, 1e-6, n * nh);
    out.push(("rmsnorm_rows".into(), rd(&q, n * nh * hd)));
    let ff: Vec<f32> = (0..16).map(|i| 1.0 + i as f32 * 0.5).collect();
    for (name, rope) in [
        (
            "rope normal",
            Rope::new(RopeStyle::Normal, hd, 10000.0, None, 1.0),
        ),
        ("rope neox", Rope::new(RopeStyle::Neox, hd, 1e6, None, 0.25)),
        (
            "rope partial+factors",
            Rope::new(RopeStyle::Neox, 32, 10000.0, Some(&ff), 1.0),
        ),
    ] {
        let st = AttnStep {
            n,
            pos0: 1000,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            cache_positions: false,
            mass: MassMode::None,
            mass_w: 0.0,
            scale: 0.125,
            window: 0,
            prompt: false,
        };
        let mut q = mk(&randn(&mut rng, n * nh * hd, 1.0));
        let mut k = mk(&randn(&mut rng, n * nkv * hd, 1.0));
        b.rope(&rope, &mut q, &mut k, &st);
        out.push((format!("{name} q"), rd(&q, n * nh * hd)));
        out.push((format!("{name} k"), rd(&k, n * nkv * hd)));
    }
    let width = 96;
    let up = mk(&randn(&mut rng, n * width, 1.0));
    let mut g1 = mk(&randn(&mut rng, n * width, 2.0));
    b.swiglu(&mut g1, &up, n, width);
    out.push(("swiglu".into(), rd(&g1, n * width)));
    let mut g2 = mk(&randn(&mut rng, n * width, 2.0));
    b.geglu(&mut g2, &up, n, width);
    out.push(("geglu".into(), rd(&g2, n * width)));
    let mut a = mk(&randn(&mut rng, n * width, 1.0));
    b.add(&mut a, &up, n, width);
    b.scale(&mut a, 0.5, n * width);
    let bias = b.vector(randn(&mut rng, width, 1.0)).unwrap();
    b.add_bias(&mut a, &bias, n);
    out.push(("add, scale, add_bias".into(), rd(&a, n * width)));
    let mut c = b.act(n * width);
    b.copy(&mut c, &a, 2 * width);
    out.push(("copy".into(), rd(&c, 2 * width)));
    let mut gat = b.act(3 * width);
    b.gather_rows(&a, &[3, 0, 3], width, &mut gat);
    out.push(("gather_rows".into(), rd(&gat, 3 * width)));
    let mut sca = mk(&vec![0.0; n * width]);
    b.scatter_rows(&mut sca, &gat, &[4, 1, 2], &[0.5, 2.0, -1.0], width);
    out.push(("scatter_rows".into(), rd(&sca, n * width)));
    let mut sg = b.act(2 * width);
    b.sum_groups(&a, 2, 2, width, &mut sg);
    out.push(("sum_groups".into(), rd(&sg, 2 * width)));
    for dt in [DType::Q4K, DType::F16, DType::Q8_0] {
        let table = weights(&mut rng, dt, dim, 40, 0.1);
        let t = b.matrix(dt, dim, 40, Cow::Owned(table)).unwrap();
        let mut e = b.act(4 * dim);
        b.embed(&t, &[7, 0, 39, 7], &mut e);
        out.push((format!("embed {dt:?}"), rd(&e, 4 * dim)));
    }
    b.check().unwrap();
    out
}

#[test]
fn elementwise_ops_match_the_cpu_backend() {
    let Some(g) = gpu() else { return };
    let cpu = Host::new(2);
    let want = elementwise_ops(&cpu, &|v: &[f32]| v.to_vec(), 5);
    let got = elementwise_ops(&g, &|v: &[f32]| g.act_from(v).unwrap(), 5);
    for ((name, a), (_, b)) in got.iter().zip(&want) {
        // the CPU's GELU goes through ggml's f16 table
        let tol = if name == "geglu" { 2e-3 } else { 1e-5 };
        close(name, a, b, tol);
    }
}

/// A cache on `b`: uniform or per-head streams, 2 layers × 2 KV heads of 64.
fn cache_on<B: Backend>(b: &B, streams: bool, ty: KvType) -> KvCache {
    let make = |sh: kvrun::kv::StoreShape| b.kv_store(sh.ty, sh.n_rows, sh.row_vals);
    let (nl, nkv, hd, slots) = (2, 2, 64, 96);
    if streams {
        let r = kvrun::kv::streams::Region {
            first_stream: 0,
            n_streams: nl * nkv,
            rows: nl * nkv * slots,
        };
        KvCache::streams_on(&make, nl, nkv * hd, hd, &[r], ty).unwrap()
    } else {
        KvCache::uniform_on(&make, nl, nkv * hd, hd, slots, ty).unwrap()
    }
}

/// Three steps of attention on a backend: a 40-token prefill exporting
/// every row's mass, then (after evicting a few entries from a uniform
/// cache) one decoded token exporting the last row, then (after evicting
/// from a stream cache and compacting it) one with a sliding window;
/// outputs, masses and a K/V read-back.
fn attention_steps<B: Backend>(
    b: &B,
    mk: &dyn Fn(&[f32]) -> B::Act,
    streams: bool,
    ty: KvType,
) -> Vec<(String, Vec<f32>)> {
    let mut rng = Rng::new(21);
    let (nh, nkv, hd) = (6usize, 2usize, 64usize);
    let kv_dim = nkv * hd;
    let mut kv = cache_on(b, streams, ty);
    let mut sc = b.scratch();
    let rope = Rope::new(RopeStyle::Neox, hd, 10000.0, None, 1.0);
    let mut res = Vec::new();
    let rd = |a: &B::Act, len: usize| {
        let mut v = Vec::new();
        b.read(a, 0..len, &mut v);
        v
    };
    let mut slots = Vec::new();
    for (step, (n, pos0, mass, window)) in [
        (40usize, 0usize, MassMode::AllRows, 0usize),
        (1, 40, MassMode::LastRow, 0),
        (1, 41, MassMode::LastRow, 16),
    ]
    .into_iter()
    .enumerate()
    {
        let positions: Vec<i64> = (pos0..pos0 + n).map(|p| p as i64).collect();
        if step == 2 && streams {
            // evict a few entries of each stream, then pack the pool again
            // (`KvStore::permute` on the backend's store), so the last
            // step reads moved rows
            let st = kv.streams().unwrap();
            let victims: Vec<u32> = (0..st.n_streams())
                .flat_map(|s| {
                    let (sl, p) = st.stream(s);
                    sl.iter()
                        .zip(p)
                        .filter(move |(_, &p)| [2, 5 + s as i64, 20].contains(&p))
                        .map(|(&x, _)| x)
                })
                .collect();
            kv.apply(&victims, &[], &mut slots).unwrap();
            let mut map = Vec::new();
            assert!(kv.compact(&mut map).unwrap(), "{ty}: rows moved");
        }
        let victims: Vec<u32> = if step == 1 && !streams {
            // evict the entries at positions 3, 10 and 11
            let (s, p) = kv.live();
            s.iter()
                .zip(p)
                .filter(|(_, &p)| [3, 10, 11].contains(&p))
                .map(|(&s, _)| s)
                .collect()
        } else {
            Vec::new()
        };
        kv.apply(&victims, &positions, &mut slots).unwrap();
        let st = AttnStep {
            n,
            pos0,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            cache_positions: false,
            mass,
            mass_w: 0.5,
            scale: 0.125,
            window,
            prompt: false,
        };
        b.begin_attention(&mut sc, &kv, &st);
        for layer in 0..2 {
            let k = mk(&randn(&mut rng, n * kv_dim, 1.0));
            let v = mk(&randn(&mut rng, n * kv_dim, 1.0));
            b.kv_write(&mut kv, layer, &slots, &k, &v, n, kv_dim);
            let q = mk(&randn(&mut rng, n * nh * hd, 1.0));
            let mut out = b.act(n * nh * hd);
            b.attention(&mut sc, &kv, &st, layer, &rope, &q, &q, &mut out);
            res.push((
                format!("step {step} layer {layer} out"),
                rd(&out, n * nh * hd),
            ));
        }
        let ns = kv.n_slots();
        let mut m = vec![0f32; ns];
        b.end_attention(&mut sc, ns, &mut m);
        res.push((format!("step {step} mass"), m));
    }
    // the store's batched read (what key- and value-reading scorers use)
    for layer in 0..2 {
        for g in 0..nkv {
            let h = kv.head(layer, g, false);
            let s = h.slots.to_vec();
            let mut o = vec![0f32; s.len() * hd];
            kv.read_heads(true, layer, g, &s, &mut o);
            res.push((format!("read keys layer {layer} head {g}"), o));
        }
    }
    b.check().unwrap();
    res
}

#[test]
fn attention_matches_the_cpu_backend_for_every_store_and_layout() {
    let Some(g) = gpu() else { return };
    let cpu = Host::new(2);
    for streams in [false, true] {
        for ty in KvType::ALL {
            let want = attention_steps(&cpu, &|v: &[f32]| v.to_vec(), streams, ty);
            let got = attention_steps(&g, &|v: &[f32]| g.act_from(v).unwrap(), streams, ty);
            assert_eq!(got.len(), want.len());
            for ((name, a), (_, b)) in got.iter().zip(&want) {
                close(&format!("streams={streams} {ty}: {name}"), a, b, 2e-5);
            }
        }
    }
}

fn synth_header() -> PathBuf {
    std::env::var_os("KVRUN_SYNTH_HEADER")
        .map(PathBuf::from)
        .unwrap_or_else(|| util::shared("r1-distill-qwen-7b.header.gguf"))
}

fn argmax(l: &[f32]) -> u32 {
    l.iter()
        .enumerate()
        .fold((0, f32::MIN), |a, (i, &v)| if v > a.1 { (i, v) } else { a })
        .0 as u32
}

/// The synthetic model, its CPU weights and a prompt.
fn synth_model() -> (PathBuf, kvrun::load::Loaded) {
    let path = PathBuf::from(format!("synth:{}:tiny", synth_header().display()));
    let m = kvrun::load::Loaded::open(&path).unwrap();
    (path, m)
}

/// Greedy decoding of the synthetic model on the CPU and on `b` (weights
/// `wd`), teacher-forced on the CPU's tokens so one near-tie cannot make
/// the runs drift apart, with a full cache, a window and H2O (which ranks
/// by the exported attention mass).
fn decode_agreement<'w, B: Backend>(
    path: &std::path::Path,
    m: &kvrun::load::Loaded,
    wd: &'w kvrun::model::Weights<'w, B>,
    backend: &dyn Fn() -> B,
) {
    use kvrun::generate::Session;
    use kvrun::model::llama::Logits;
    use kvrun::policy::PolicyConfig;
    let w = m.weights();
    let prompt: Vec<u32> = (0..48).map(|i| 100 + (i * 37) % 5000).collect();
    for (policy, budget) in [("full", None), ("window", Some(40usize)), ("h2o", Some(40))] {
        let cfg = PolicyConfig {
            policy: policy.into(),
            budget,
            ..Default::default()
        };
        let mut c = Session::for_config(w, &cfg, 0, path, 512, 2, 16, prompt.len()).unwrap();
        let mut d =
            Session::for_config_on(backend(), wd, &cfg, 0, path, 512, 16, prompt.len()).unwrap();
        let mut lc = c.feed(&prompt, Logits::Last).unwrap().to_vec();
        let mut ld = d.feed(&prompt, Logits::Last).unwrap().to_vec();
        let (mut same, mut decided) = (0, 0);
        for step in 0..64 {
            let t = argmax(&lc);
            let margin = {
                let mut s = lc.clone();
                s.sort_by(|a, b| b.total_cmp(a));
                s[0] - s[1]
            };
            if margin > 0.05 {
                decided += 1;
                same += usize::from(argmax(&ld) == t);
            }
            close(&format!("{policy} step {step} logits"), &ld, &lc, 2e-2);
            lc = c.feed(&[t], Logits::Last).unwrap().to_vec();
            ld = d.feed(&[t], Logits::Last).unwrap().to_vec();
        }
        if let Some(b) = budget {
            assert!(
                d.kv.peak_live <= b,
                "{policy}: {} resident > budget {b}",
                d.kv.peak_live
            );
            assert_eq!(d.n_evicted, c.n_evicted, "{policy}: evictions");
        }
        // h2o's masses differ in the last bits between devices, so a
        // near-tie may evict another entry
        let need = if policy == "h2o" {
            decided * 9 / 10
        } else {
            decided
        };
        assert!(
            same >= need && decided > 0,
            "{policy}: greedy tokens agree at {same} of {decided} decided steps"
        );
        eprintln!("{policy}: greedy agreement {same}/{decided}");
    }
}

#[test]
fn a_synthetic_model_decodes_on_the_gpu_as_on_the_cpu() {
    let Some(g) = gpu() else { return };
    let (path, m) = synth_model();
    let gg = match m.checkpoint() {
        kvrun::load::Checkpoint::Gguf(x) => x,
        _ => unreachable!("a synthetic model is a GGUF"),
    };
    let wd = kvrun::model::Weights::from_gguf_on(&g, gg).unwrap();
    decode_agreement(&path, &m, &wd, &|| g.sibling(2));
}

/// The harness of the GPU tests, run with the CPU on both sides where no
/// GPU is (so a GPU session spends no time on the tests' own bugs).
#[test]
fn gpu_test_harness_runs_on_the_cpu() {
    let cpu = Host::new(2);
    let mk = |v: &[f32]| v.to_vec();
    let a = elementwise_ops(&cpu, &mk, 5);
    assert!(a.len() == 20 && a.iter().all(|(_, v)| !v.is_empty()));
    for streams in [false, true] {
        for ty in KvType::ALL {
            let r = attention_steps(&cpu, &mk, streams, ty);
            // 3 steps × (2 layers + mass) + 4 read-backs
            assert_eq!(r.len(), 13);
            let mass = &r[2].1;
            let total: f32 = mass.iter().sum();
            // 40 rows × 6 heads × 2 layers × weight 0.5, each row summing to 1
            assert!((total - 240.0).abs() < 1e-2, "{streams} {ty}: mass {total}");
        }
    }
    if !synth_header().exists() {
        eprintln!("skipped the model part: no {}", synth_header().display());
        return;
    }
    let (path, m) = synth_model();
    decode_agreement(&path, &m, m.weights(), &|| Host::new(2));
}
