//! Parity of the CPU attention kernels: the grouped hot loop
//! (`attend_group`) against the per-head reference (`attend_head`, which uses
//! ggml's f16 dot product) and against a direct two-pass softmax in f64, on
//! fresh random data each run (seed printed).

use half::f16;
use kvrun::backend::cpu::decode_attn::attend_group_probs;
use kvrun::backend::cpu::isa::Level;
use kvrun::backend::cpu::matmul::matmul_q_at;
use kvrun::backend::cpu::prefill_attn_kernels::attend_prefill_group;
use kvrun::backend::cpu::qgemm_x86::{q4_1_tile_for, tile_q4_1_q8_1_scalar, TileScales, MR, NT};
use kvrun::backend::cpu::reference::prefill_group_dyn;
use kvrun::backend::cpu::reference::{attend_group, attend_head};
use kvrun::backend::cpu::QMat;
use kvrun::backend::pool::ThreadPool;
use kvrun::sample::Rng;
use kvrun::tensor::DType;

fn randn(r: &mut Rng) -> f32 {
    // Box-Muller
    let (u, v) = (r.next_f64().max(1e-12), r.next_f64());
    ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
}

#[test]
fn attend_group_matches_per_head_reference_and_exact_softmax() {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    eprintln!("seed {seed}");
    let mut r = Rng::new(seed);
    let f16dot = ggml_sys::CpuTraits::of(1).unwrap();
    for &(g, hd, n) in &[
        (1usize, 64usize, 1usize),
        (3, 64, 37),
        (4, 128, 300),
        (7, 128, 129),
        (2, 32, 1000),
    ] {
        let q: Vec<f32> = (0..g * hd).map(|_| randn(&mut r) * 2.0).collect();
        let k: Vec<f16> = (0..n * hd)
            .map(|_| f16::from_f32(randn(&mut r) * 2.0))
            .collect();
        let v: Vec<f16> = (0..n * hd).map(|_| f16::from_f32(randn(&mut r))).collect();
        let key = |j: usize| &k[j * hd..(j + 1) * hd];
        let val = |j: usize| &v[j * hd..(j + 1) * hd];
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = vec![0f32; g * hd];
        let mut sc = vec![0f32; g * n];
        let mut stats = vec![(0f32, 0f32); g];
        attend_group(
            &q,
            g,
            n,
            key,
            val,
            scale,
            &mut out,
            Some(&mut sc),
            &mut stats,
        );
        for h in 0..g {
            let qh = &q[h * hd..(h + 1) * hd];
            // per-head reference
            let mut o_ref = vec![0f32; hd];
            let mut sc_ref = vec![0f32; n];
            let (m, s) = attend_head(
                &f16dot,
                qh,
                n,
                key,
                val,
                scale,
                &mut o_ref,
                Some(&mut sc_ref),
            );
            // exact two-pass softmax in f64 on the same f16-rounded query
            let qr: Vec<f64> = qh
                .iter()
                .map(|&x| f16::from_f32(x).to_f32() as f64)
                .collect();
            let s64: Vec<f64> = (0..n)
                .map(|j| {
                    key(j)
                        .iter()
                        .zip(&qr)
                        .map(|(a, b)| a.to_f32() as f64 * b)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let mx = s64.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s64.iter().map(|x| (x - mx).exp()).sum();
            for d in 0..hd {
                let exact: f64 = (0..n)
                    .map(|j| (s64[j] - mx).exp() / z * val(j)[d].to_f32() as f64)
                    .sum();
                let got = out[h * hd + d] as f64;
                assert!(
                    (got - exact).abs() <= 1e-4 * (1.0 + exact.abs()),
                    "g{g} hd{hd} n{n} head {h} dim {d}: {got} vs exact {exact}"
                );
                assert!(
                    (got - o_ref[d] as f64).abs() <= 1e-4 * (1.0 + exact.abs()),
                    "grouped vs per-head reference differ"
                );
            }
            for j in 0..n {
                assert!(
                    (sc[h * n + j] as f64 - s64[j]).abs() <= 1e-4 * (1.0 + s64[j].abs()),
                    "score {j}"
                );
                assert!(
                    (sc_ref[j] as f64 - s64[j]).abs() <= 1e-4 * (1.0 + s64[j].abs()),
                    "reference score {j}"
                );
            }
            let (gm, gs) = stats[h];
            assert!(
                (gm - m).abs() <= 1e-4 * (1.0 + m.abs()) && (gs - s).abs() <= 1e-3 * s,
                "softmax stats differ"
            );
        }
    }
}

/// The two-pass prefill kernel (transposed keys) agrees with the online
/// grouped kernel, including the exported scores and softmax statistics.
#[test]
fn attend_prefill_group_matches_online_kernel() {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        ^ 0x5eed;
    eprintln!("seed {seed}");
    let mut r = Rng::new(seed);
    for &(g, hd, n, stride) in &[
        (3usize, 64usize, 1usize, 5usize),
        (3, 64, 200, 260),
        (7, 128, 97, 97),
        (4, 32, 513, 600),
        (2, 48, 37, 40),
        (9, 16, 33, 33),
    ] {
        let q: Vec<f32> = (0..g * hd).map(|_| randn(&mut r) * 2.0).collect();
        let k: Vec<f16> = (0..n * hd)
            .map(|_| f16::from_f32(randn(&mut r) * 2.0))
            .collect();
        let v: Vec<f16> = (0..n * hd).map(|_| f16::from_f32(randn(&mut r))).collect();
        let vf: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
        // transposed keys with a stride larger than n (the live list may be longer)
        let mut kt = vec![f32::NAN; hd * stride];
        for j in 0..n {
            for d in 0..hd {
                kt[d * stride + j] = k[j * hd + d].to_f32();
            }
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let (mut o1, mut o2) = (vec![0f32; g * hd], vec![0f32; g * hd]);
        let (mut s1, mut s2) = (vec![0f32; g * n], vec![0f32; g * n]);
        let (mut st1, mut st2) = (vec![(0f32, 0f32); g], vec![(0f32, 0f32); g]);
        attend_group(
            &q,
            g,
            n,
            |j| &k[j * hd..(j + 1) * hd],
            |j| &v[j * hd..(j + 1) * hd],
            scale,
            &mut o1,
            Some(&mut s1),
            &mut st1,
        );
        attend_prefill_group(
            &q,
            g,
            n,
            &kt,
            stride,
            |j| &vf[j * hd..(j + 1) * hd],
            scale,
            &mut s2,
            &mut o2,
            &mut st2,
        );
        // the per-head reference: the same sums in the same order
        let (mut o4, mut s4, mut st4) =
            (vec![0f32; g * hd], vec![0f32; g * n], vec![(0f32, 0f32); g]);
        let val = |j: usize| &vf[j * hd..(j + 1) * hd];
        prefill_group_dyn(
            &q,
            &[n],
            n,
            &kt,
            stride,
            &val,
            scale,
            &mut s4,
            &mut o4,
            &mut st4,
        );
        assert!(o4.iter().zip(&o2).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(s4.iter().zip(&s2).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert_eq!(st4, st2);
        // the decode kernel that exports probabilities, on the f16 rows
        let (mut o3, mut s3, mut st3) =
            (vec![0f32; g * hd], vec![0f32; g * n], vec![(0f32, 0f32); g]);
        attend_group_probs(
            &q,
            g,
            n,
            |j| &k[j * hd..(j + 1) * hd],
            |j| &v[j * hd..(j + 1) * hd],
            scale,
            &mut s3,
            &mut o3,
            &mut st3,
        );
        for i in 0..g * hd {
            assert!(
                (o1[i] - o2[i]).abs() <= 1e-4 * (1.0 + o1[i].abs()),
                "g{g} hd{hd} n{n}: out {i}: {} vs {}",
                o1[i],
                o2[i]
            );
            assert!(
                (o1[i] - o3[i]).abs() <= 1e-4 * (1.0 + o1[i].abs()),
                "g{g} hd{hd} n{n}: probs kernel out {i}"
            );
        }
        for h in 0..g {
            let (m, sum) = st1[h];
            let mut total = 0f32;
            for j in 0..n {
                // probabilities implied by the online kernel's raw scores and stats
                let p = (s1[h * n + j] - m).exp() / sum;
                assert!(
                    (p - s2[h * n + j]).abs() <= 1e-5 + 1e-4 * p,
                    "prefill probability {h},{j}: {p} vs {}",
                    s2[h * n + j]
                );
                assert!(
                    (p - s3[h * n + j]).abs() <= 1e-5 + 1e-4 * p,
                    "decode probability {h},{j}"
                );
                total += s3[h * n + j];
            }
            assert!((total - 1.0).abs() <= 1e-4, "probabilities sum to {total}");
            for st in [st2[h], st3[h]] {
                assert!((st.0 - m).abs() <= 1e-4 * (1.0 + m.abs()));
                assert!((st.1 - sum).abs() <= 1e-3 * sum);
            }
        }
    }
}

/// Random Q4_1 rows (n_out, n_in) and Q8_1 activations (n_tok, n_in) from
/// ggml's own quantizers.
fn q4_1_problem(r: &mut Rng, n_out: usize, n_in: usize, n_tok: usize) -> (Vec<u8>, Vec<u8>) {
    quant_problem(DType::Q4_1, r, n_out, n_in, n_tok)
}

/// Random `dt` rows (n_out, n_in) and activations (n_tok, n_in) in its dot
/// partner's format, from ggml's own quantizers.
fn quant_problem(
    dt: DType,
    r: &mut Rng,
    n_out: usize,
    n_in: usize,
    n_tok: usize,
) -> (Vec<u8>, Vec<u8>) {
    let tr = ggml_sys::CpuTraits::of(dt.ggml_id()).unwrap();
    let x: Vec<f32> = (0..n_out * n_in).map(|_| randn(r) * 0.1).collect();
    let w = ggml_sys::quantize_ref(dt.ggml_id(), &x);
    let ab = tr.act_bytes(n_in);
    let mut act = vec![0u8; n_tok * ab];
    for t in 0..n_tok {
        // activations with a few outliers, like a residual stream
        let a: Vec<f32> = (0..n_in)
            .map(|i| randn(r) * if i % 97 == 0 { 8.0 } else { 1.0 })
            .collect();
        tr.quantize_act(&a, &mut act[t * ab..(t + 1) * ab]);
    }
    (w, act)
}

#[test]
fn q4_1_tile_matches_ggml_vec_dot_bit_for_bit() {
    let seed = 0x5eed_0401 ^ std::process::id() as u64;
    eprintln!("seed {seed}");
    let mut r = Rng::new(seed);
    let tr = ggml_sys::CpuTraits::of(DType::Q4_1.ggml_id()).unwrap();
    for &n_in in &[32usize, 576, 1536] {
        let nb = n_in / 32;
        let (rb, ab) = (DType::Q4_1.row_bytes(n_in), tr.act_bytes(n_in));
        let (w, act) = q4_1_problem(&mut r, MR, n_in, NT);
        let rows: [&[u8]; MR] = std::array::from_fn(|k| &w[k * rb..(k + 1) * rb]);
        let toks: [&[u8]; NT] = std::array::from_fn(|k| &act[k * ab..(k + 1) * ab]);
        let (mut ws, mut as_) = (TileScales::default(), TileScales::default());
        ws.q4_1(&rows, nb);
        as_.q8_1(&toks, nb);
        let scalar = tile_q4_1_q8_1_scalar(nb, &rows, &ws, &toks, &as_);
        // every SIMD level this CPU runs (VNNI and AVX2 tiles)
        let simd: Vec<(Level, [[f32; NT]; MR])> = simd_levels()
            .into_iter()
            .filter_map(|l| q4_1_tile_for(l).map(|f| (l, f(nb, &rows, &ws, &toks, &as_))))
            .collect();
        assert!(
            simd_levels().is_empty() || !simd.is_empty(),
            "no Q4_1 tile at a SIMD level this CPU runs"
        );
        for i in 0..MR {
            for t in 0..NT {
                let g = tr.dot(n_in, rows[i], toks[t]);
                let f64_ref = kvrun::quant::dot_q_ref(DType::Q4_1, n_in, rows[i], toks[t]);
                let s = scalar[i][t];
                assert!(
                    (s - f64_ref).abs() <= 1e-4 * (1.0 + f64_ref.abs()),
                    "n_in {n_in} ({i},{t}): scalar {s} vs f64 ref {f64_ref}"
                );
                assert_eq!(
                    s.to_bits(),
                    g.to_bits(),
                    "n_in {n_in} ({i},{t}): scalar {s} vs ggml {g}"
                );
                for (level, v) in &simd {
                    let v = v[i][t];
                    assert_eq!(
                        v.to_bits(),
                        g.to_bits(),
                        "n_in {n_in} ({i},{t}): {level} tile {v} vs ggml {g}"
                    );
                }
            }
        }
    }
}

/// The SIMD levels above the portable loops this CPU runs; the ones it
/// lacks are named on stderr (their paths go untested here). A CPU with
/// AVX-512 VNNI but no AMX runs the `amx` level on emulated tiles
/// (`amx_emu`: the kernels' own instruction text, executed in software).
fn simd_levels() -> Vec<Level> {
    use kvrun::backend::cpu::isa::{detected, emulate_amx};
    if detected() == Level::Avx512Vnni && emulate_amx() {
        eprintln!("the amx kernels run on emulated tiles here");
    }
    let (run, skip): (Vec<Level>, Vec<Level>) =
        [Level::Avx2, Level::Avx512, Level::Avx512Vnni, Level::Amx]
            .into_iter()
            .partition(|&l| l <= detected());
    for l in skip {
        eprintln!("skipping the {l} kernels: this CPU lacks them");
    }
    run
}

/// Q8_0 with the tokens in the lanes (`qgemm_q8_0_tokens`, AVX2 and VNNI):
/// at every SIMD level this CPU runs, the prefill tile (over its packed
/// activations and side data) and the decoding kernel equal their scalar
/// model bit for bit on fresh random data (weights −128 included); the
/// model is within float rounding (1e-4 relative) of an f64 dot product of
/// the same quantized data and of ggml's `vec_dot`.
#[test]
fn q8_0_tokens_kernels_match_their_scalar_model() {
    use kvrun::backend::cpu::qgemm_q8_0_tokens::{
        decode_for, dot_scalar, pack_side, prefill_for, ROWS, SIDE_BYTES, TOKS,
    };
    let seed = 0x5eed_0808 ^ std::process::id() as u64;
    eprintln!("seed {seed}");
    let mut r = Rng::new(seed);
    let dt = DType::Q8_0;
    let tr = ggml_sys::CpuTraits::of(dt.ggml_id()).unwrap();
    // a level without its kernels panics below
    let levels = simd_levels();
    for n_in in [32usize, 64, 640, 3584, 8960] {
        let nb = n_in / 32;
        let (rb, ab) = (dt.row_bytes(n_in), tr.act_bytes(n_in));
        let (mut w, act) = quant_problem(dt, &mut r, ROWS, n_in, TOKS);
        // the extreme weight ggml's quantizer never writes, but a file may
        for k in 0..ROWS {
            w[k * rb + 2 + (k * 7) % 32] = 0x80;
        }
        let rows: [&[u8]; ROWS] = std::array::from_fn(|k| &w[k * rb..(k + 1) * rb]);
        let toks: [&[u8]; TOKS] = std::array::from_fn(|k| &act[k * ab..(k + 1) * ab]);
        let model: Vec<Vec<f32>> = (0..ROWS)
            .map(|i| {
                (0..TOKS)
                    .map(|t| dot_scalar(nb, rows[i], toks[t]))
                    .collect()
            })
            .collect();
        for i in 0..ROWS {
            for t in 0..TOKS {
                let m = model[i][t];
                let exact = kvrun::quant::dot_q_ref(dt, n_in, rows[i], toks[t]);
                let g = tr.dot(n_in, rows[i], toks[t]);
                for (what, v) in [("f64", exact), ("ggml", g)] {
                    assert!(
                        (m - v).abs() <= 1e-4 * (1.0 + v.abs()),
                        "n_in {n_in} ({i},{t}): model {m} vs {what} {v}"
                    );
                }
            }
        }
        for &level in &levels {
            let (Some(prefill), Some(decode)) = (prefill_for(dt, level), decode_for(level)) else {
                panic!("{level}: no Q8_0 tokens-in-lanes kernels");
            };
            let mut packed = vec![0u8; nb * prefill.act_bytes];
            let mut side = vec![0u8; nb * SIDE_BYTES];
            (prefill.pack)(nb, &toks, &mut packed);
            pack_side(nb, &rows, &mut side);
            let v = (prefill.tile)(nb, &rows, &side, &packed);
            for t in 0..TOKS {
                let one = decode(nb, &rows, &[toks[t]]);
                for i in 0..ROWS {
                    let m = model[i][t];
                    assert_eq!(
                        v[i][t].to_bits(),
                        m.to_bits(),
                        "{level} n_in {n_in} ({i},{t}): tile {} vs model {m}",
                        v[i][t]
                    );
                    assert_eq!(
                        one[i][0].to_bits(),
                        m.to_bits(),
                        "{level} n_in {n_in} ({i},{t}): decode {} vs model {m}",
                        one[i][0]
                    );
                }
            }
        }
    }
    eprintln!("Q8_0: {} SIMD level(s) checked", levels.len());
}

/// The 256-weight superblock types with Q8_K activations: kvrun's
/// rows-in-lanes kernels (`qgemm_lanes`) and their repacked layouts (`x8`).
const SUPERBLOCK_TYPES: [DType; 6] = [
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
    DType::Q3K,
    DType::Q2K,
    DType::IQ4XS,
];

/// The rows-in-lanes kernels of the superblock types (AVX2, AVX-512
/// without VNNI) equal their scalar model bit for bit, for 8 tokens and for
/// 1, on fresh random data; the model is within float rounding (1e-4
/// relative) of an f64 dot product of the same quantized data and of
/// ggml's `vec_dot` (whose lanes it does not follow).
#[test]
fn k_quant_lanes_kernels_match_their_scalar_model() {
    use kvrun::backend::cpu::matmul::k_quant_kernel;
    use kvrun::backend::cpu::qgemm_lanes::{
        dot_scalar, lanes_scalar, packed_for, PACKED_BYTES, ROWS, TOKS,
    };
    use kvrun::backend::cpu::x8::{group_map, X8};
    let seed = 0x5eed_0413 ^ std::process::id() as u64;
    eprintln!("seed {seed}");
    let mut r = Rng::new(seed);
    for dt in SUPERBLOCK_TYPES {
        let tr = ggml_sys::CpuTraits::of(dt.ggml_id()).unwrap();
        let (mut checked, mut packed_checked) = (0, 0);
        for n_in in [256usize, 768, 3584, 18944] {
            let nb = n_in / 256;
            let (rb, ab) = (dt.row_bytes(n_in), tr.act_bytes(n_in));
            let (w, act) = quant_problem(dt, &mut r, ROWS, n_in, TOKS);
            let rows: [&[u8]; ROWS] = std::array::from_fn(|k| &w[k * rb..(k + 1) * rb]);
            let toks: [&[u8]; TOKS] = std::array::from_fn(|k| &act[k * ab..(k + 1) * ab]);
            let model = lanes_scalar(dt, nb, &rows, &toks);
            for i in 0..ROWS {
                for t in 0..TOKS {
                    let m = model[i][t];
                    assert_eq!(m.to_bits(), dot_scalar(dt, nb, rows[i], toks[t]).to_bits());
                    let exact = kvrun::quant::dot_q_ref(dt, n_in, rows[i], toks[t]);
                    let g = tr.dot(n_in, rows[i], toks[t]);
                    // the bound of the ggml-lane tiles' scalar models (the
                    // mins' float sum cancels most of the weights' one, so
                    // the error scales with them, not with the result)
                    for (what, v) in [("f64", exact), ("ggml", g)] {
                        assert!(
                            (m - v).abs() <= 1e-4 * (1.0 + v.abs()),
                            "{dt} n_in {n_in} ({i},{t}): model {m} vs {what} {v}"
                        );
                    }
                }
            }
            for level in simd_levels() {
                // the packed-row-block kernel (AVX2 and up): packed once, same bits
                if let Some(fns) = packed_for(dt, level) {
                    let mut p = vec![0u8; nb * PACKED_BYTES];
                    (fns.pack)(nb, &rows, &mut p);
                    // packed straight from the repacked row block: the
                    // same bytes (the engine's prefill of a repacked matrix)
                    let x8 = X8::new(dt, &w, ROWS, nb);
                    let mut p8 = vec![0u8; nb * PACKED_BYTES];
                    (fns.pack_x8)(nb, x8.block(0), group_map(dt), &mut p8);
                    assert!(
                        p8 == p,
                        "{dt} {level} n_in {n_in}: packed from the row block"
                    );
                    let v = (fns.kernel)(nb, &p, &toks);
                    for i in 0..ROWS {
                        for t in 0..TOKS {
                            let m = model[i][t];
                            assert_eq!(
                                v[i][t].to_bits(),
                                m.to_bits(),
                                "{dt} n_in {n_in} ({i},{t}): packed {} vs model {m}",
                                v[i][t]
                            );
                        }
                    }
                    packed_checked += 1;
                }
                let (Some(fw), Some(f1)) = (
                    k_quant_kernel::<TOKS>(dt, level),
                    k_quant_kernel::<1>(dt, level),
                ) else {
                    continue;
                };
                checked += 1;
                let vw = fw(nb, &rows, &toks);
                for t in 0..TOKS {
                    let v1 = f1(nb, &rows, &[toks[t]]);
                    for i in 0..ROWS {
                        let m = model[i][t];
                        assert_eq!(
                            vw[i][t].to_bits(),
                            m.to_bits(),
                            "{dt} {level} n_in {n_in} ({i},{t}): {} vs {m}",
                            vw[i][t]
                        );
                        assert_eq!(
                            v1[i][0].to_bits(),
                            m.to_bits(),
                            "{dt} {level} N=1 n_in {n_in} ({i},{t}): {} vs {m}",
                            v1[i][0]
                        );
                    }
                }
            }
        }
        // an AVX2 CPU must run them (so the skip cannot hide a dispatch bug)
        if kvrun::backend::cpu::isa::detected() >= Level::Avx2 {
            assert!(
                checked > 0,
                "no {dt} rows-in-lanes kernel ran on an AVX2 CPU"
            );
        }
        // a packed kernel at every level this CPU runs (VNNI's, or the
        // `maddubs` one below it), for each of the 4 widths
        assert_eq!(
            packed_checked,
            4 * simd_levels().len(),
            "{dt}: a level without its packed kernel"
        );
    }
}

/// Q8_0×8, Q4_0×8, Q5_0×8 and IQ4_NL×8: every row unpacks to its GGUF bytes, the
/// Q8_0 form of a block dequantizes to the same floats, the scalar model
/// is the dot product (f64 reference) within float rounding, and every
/// decoding kernel this CPU runs (repacked and row-major, at every level)
/// equals the scalar model bit for bit, on fresh random data and at the
/// extremes of the kernels' integer sums.
#[test]
fn b32_x8_layouts_round_trip_and_their_kernels_match_the_scalar_model() {
    use kvrun::backend::cpu::b32_x8::{
        block_sums, decode_for, decode_rows_for, dot_scalar, row_to_q8_0_at, row_to_unsigned_at,
        Q8_0_BYTES, ROWS,
    };
    use kvrun::backend::cpu::x8::{decode_scalar, X8};
    let seed = 0x5eed_0b32 ^ std::process::id() as u64;
    eprintln!("seed {seed}");
    let mut r = Rng::new(seed);
    let mut checked = 0;
    let check = |dt: DType, nb: usize, w: &[u8], y: &[u8], what: &str, checked: &mut usize| {
        let n_out = w.len() / (nb * dt.block_bytes());
        let rb = nb * dt.block_bytes();
        let x8 = X8::new(dt, w, n_out, nb);
        let mut ysum = vec![0i32; nb];
        block_sums(nb, y, &mut ysum);
        let mut row = vec![0u8; rb];
        for i in 0..n_out {
            x8.row_into(i, &mut row);
            assert_eq!(
                row,
                w[i * rb..(i + 1) * rb],
                "{dt} {what}: row {i} round trip"
            );
        }
        for blk in 0..n_out / ROWS {
            let model = decode_scalar(dt, nb, x8.block(blk), y);
            let rows: [&[u8]; ROWS] =
                std::array::from_fn(|k| &w[(blk * ROWS + k) * rb..(blk * ROWS + k + 1) * rb]);
            // prefill's expansion of a whole row block straight from its
            // groups (rows a ragged stride apart): the rows' own expansion,
            // signed and unsigned (Q8_0: its own rows), at every level (the
            // copy list below AVX2)
            {
                let qrb = nb * Q8_0_BYTES;
                let stride = qrb + 6;
                let forms: &[bool] = if matches!(dt, DType::Q8_0 | DType::IQ4NL) {
                    &[true]
                } else {
                    &[true, false]
                };
                for &signed in forms {
                    for level in std::iter::once(Level::Portable).chain(simd_levels()) {
                        let mut out = vec![0x5au8; ROWS * stride];
                        x8.block_to_q8_0_at(blk, level, &mut out, stride, signed);
                        for k in 0..ROWS {
                            let mut want = vec![0u8; qrb];
                            if signed {
                                row_to_q8_0_at(Level::Portable, dt, nb, rows[k], &mut want);
                            } else {
                                row_to_unsigned_at(Level::Portable, dt, nb, rows[k], &mut want);
                            }
                            let got = &out[k * stride..(k + 1) * stride];
                            assert!(
                                got[..qrb] == want[..] && got[qrb..].iter().all(|&b| b == 0x5a),
                                "{dt} {level} {what} signed {signed}: row {k} of block {blk}"
                            );
                        }
                    }
                }
            }
            for k in 0..ROWS {
                let want = dot_scalar(dt, nb, rows[k], y);
                assert_eq!(model[k].to_bits(), want.to_bits(), "{dt} {what} row {k}");
            }
            for level in simd_levels() {
                let mut got = Vec::new();
                if let Some(f) = decode_for(dt, level) {
                    got.push(("repacked", f(nb, x8.block(blk), y, &ysum)));
                }
                if let Some(f) = decode_rows_for(dt, level) {
                    got.push(("rows", f(nb, &rows, y, &ysum)));
                }
                if dt == DType::Q8_0 {
                    // the row-major Q8_0 kernel follows the same arithmetic
                    let f = kvrun::backend::cpu::qgemm_q8_0_tokens::decode_for(level).unwrap();
                    got.push(("q8_0 rows", f(nb, &rows, &[y]).map(|v| v[0])));
                } else {
                    assert!(got.len() == 2, "{dt} {level}: a kernel missing");
                }
                for (kind, v) in got {
                    for k in 0..ROWS {
                        assert_eq!(
                            v[k].to_bits(),
                            model[k].to_bits(),
                            "{dt} {level:?} {kind} {what} row {}: {} vs {}",
                            blk * ROWS + k,
                            v[k],
                            model[k]
                        );
                    }
                    *checked += 1;
                }
            }
        }
    };
    for dt in [DType::Q8_0, DType::Q4_0, DType::Q5_0, DType::IQ4NL] {
        let tr = ggml_sys::CpuTraits::of(dt.ggml_id()).unwrap();
        for n_in in [32usize, 640, 3584] {
            let nb = n_in / 32;
            let n_out = 3 * ROWS;
            let (rb, ab) = (dt.row_bytes(n_in), tr.act_bytes(n_in));
            let (w, act) = quant_problem(dt, &mut r, n_out, n_in, 1);
            let y = &act[..ab];
            for i in 0..n_out {
                let row = &w[i * rb..(i + 1) * rb];
                // the Q8_0 form is exact, and the same at every level
                let mut q8 = vec![0u8; nb * Q8_0_BYTES];
                row_to_q8_0_at(Level::Portable, dt, nb, row, &mut q8);
                for level in simd_levels() {
                    let mut v = vec![0u8; nb * Q8_0_BYTES];
                    row_to_q8_0_at(level, dt, nb, row, &mut v);
                    assert_eq!(v, q8, "{dt} {level} n_in {n_in} row {i}: Q8_0 form");
                }
                let (mut a, mut b) = (vec![0f32; n_in], vec![0f32; n_in]);
                kvrun::quant::dequantize_row(dt, row, &mut a);
                kvrun::quant::dequantize_row(DType::Q8_0, &q8, &mut b);
                assert_eq!(a, b, "{dt} n_in {n_in} row {i}: Q8_0 form");
                // the model is the dot product
                let s = dot_scalar(dt, nb, row, y);
                let f64_ref = kvrun::quant::dot_q_ref(dt, n_in, row, y);
                assert!(
                    (s - f64_ref).abs() <= 1e-4 * (1.0 + f64_ref.abs()),
                    "{dt} n_in {n_in} row {i}: model {s} vs f64 ref {f64_ref}"
                );
            }
            check(dt, nb, &w, y, &format!("n_in {n_in}"), &mut checked);
        }
        // the extremes: every quant at its top (then bottom) value against
        // activations of -127 and 127 (ggml's Q8_0 quantizer never writes
        // -128; the row-major Q8_0 kernel's sign trick relies on that)
        let nb = 4;
        let bb = dt.block_bytes();
        for fill in [0xffu8, 0x00, 0x80, 0x7f] {
            let mut w = vec![fill; ROWS * nb * bb];
            for (i, b) in w.chunks_exact_mut(bb).enumerate() {
                b[..2].copy_from_slice(&f16::from_f32(0.01 + i as f32 * 1e-3).to_le_bytes());
            }
            let mut y = vec![0u8; nb * Q8_0_BYTES];
            for (k, blk) in y.chunks_exact_mut(Q8_0_BYTES).enumerate() {
                blk[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
                let v: i8 = if k % 2 == 0 { -127 } else { 127 };
                blk[2..].fill(v as u8);
            }
            check(dt, nb, &w, &y, &format!("extremes {fill:#x}"), &mut checked);
        }
    }
    eprintln!("{checked} kernel calls checked");
}

/// Q4_0's, Q5_0's and IQ4_NL's prefill tiles at every SIMD level this CPU
/// runs (the Q8_0 form's at VNNI; at AVX2 the unsigned rows' for Q4_0 and
/// Q5_0, the Q8_0 form's for IQ4_NL) equal the scalar model bit for bit,
/// on fresh random data and at the extremes of the integer sums (every
/// quant at its top or bottom value against activations of ±127 and
/// -128), and the row forms come out the same at every level.
#[test]
fn b32_prefill_tiles_match_the_scalar_model() {
    use kvrun::backend::cpu::b32_x8::{dot_scalar, row_to_q8_0_at, row_to_unsigned_at};
    use kvrun::backend::cpu::qgemm_q8_0_tokens::{
        pack_side, prefill_for, Rows, Q8_0_BYTES, ROWS, SIDE_BYTES, TOKS,
    };
    let seed = 0x5eed_0b33 ^ std::process::id() as u64;
    eprintln!("seed {seed}");
    let mut r = Rng::new(seed);
    let mut checked = 0;
    let mut check = |dt: DType, nb: usize, w: &[u8], act: &[u8], what: &str| {
        let (rb, ab) = (nb * dt.block_bytes(), nb * Q8_0_BYTES);
        let rows: [&[u8]; ROWS] = std::array::from_fn(|k| &w[k * rb..(k + 1) * rb]);
        let toks: [&[u8]; TOKS] = std::array::from_fn(|k| &act[k * ab..(k + 1) * ab]);
        // both forms (IQ4_NL: the Q8_0 form only), the same bytes at
        // every level
        let forms = |level| -> [Vec<Vec<u8>>; 2] {
            [true, false].map(|signed| {
                rows.iter()
                    .map(|row| {
                        let mut v = vec![0u8; nb * Q8_0_BYTES];
                        if signed {
                            row_to_q8_0_at(level, dt, nb, row, &mut v);
                        } else if dt != DType::IQ4NL {
                            row_to_unsigned_at(level, dt, nb, row, &mut v);
                        }
                        v
                    })
                    .collect()
            })
        };
        let portable = forms(Level::Portable);
        for level in simd_levels() {
            assert!(forms(level) == portable, "{dt} {level} {what}: row forms");
            let prefill = prefill_for(dt, level).expect("a prefill tile");
            let form = &portable[usize::from(prefill.rows == Rows::Unsigned)];
            let x: [&[u8]; ROWS] = std::array::from_fn(|k| &form[k][..]);
            let mut packed = vec![0u8; nb * prefill.act_bytes];
            let mut side = vec![0u8; nb * SIDE_BYTES];
            (prefill.pack)(nb, &toks, &mut packed);
            pack_side(nb, &x, &mut side);
            let v = (prefill.tile)(nb, &x, &side, &packed);
            for i in 0..ROWS {
                for t in 0..TOKS {
                    let m = dot_scalar(dt, nb, rows[i], toks[t]);
                    assert_eq!(
                        v[i][t].to_bits(),
                        m.to_bits(),
                        "{dt} {level} {:?} {what} ({i},{t}): tile {} vs model {m}",
                        prefill.rows,
                        v[i][t]
                    );
                }
            }
            checked += 1;
        }
    };
    for dt in [DType::Q4_0, DType::Q5_0, DType::IQ4NL] {
        let tr = ggml_sys::CpuTraits::of(dt.ggml_id()).unwrap();
        for n_in in [32usize, 640, 3584] {
            let (w, act) = quant_problem(dt, &mut r, ROWS, n_in, TOKS);
            assert_eq!(tr.act_bytes(n_in), n_in / 32 * Q8_0_BYTES);
            check(dt, n_in / 32, &w, &act, &format!("n_in {n_in}"));
        }
        let (nb, bb) = (4, dt.block_bytes());
        for fill in [0xffu8, 0x00, 0x80, 0x7f] {
            for y in [-128i8, -127, 127] {
                let mut w = vec![fill; ROWS * nb * bb];
                for (i, b) in w.chunks_exact_mut(bb).enumerate() {
                    b[..2].copy_from_slice(&f16::from_f32(0.01 + i as f32 * 1e-3).to_le_bytes());
                }
                let mut act = vec![0u8; TOKS * nb * Q8_0_BYTES];
                for (k, blk) in act.chunks_exact_mut(Q8_0_BYTES).enumerate() {
                    blk[..2].copy_from_slice(&f16::from_f32(0.5 + k as f32 * 0.01).to_le_bytes());
                    blk[2..].fill(if k % 3 == 2 { 127 } else { y as u8 });
                }
                check(dt, nb, &w, &act, &format!("extremes {fill:#x} y {y}"));
            }
        }
    }
    eprintln!("{checked} tile calls checked");
}

/// Q8_0×8 read in place: `pack_side_x8` on a row block's groups gives
/// `pack_side`'s bytes on the gathered rows, and the tile's Q8_0×8 form
/// equals the row tile and the scalar model bit for bit (random data, and
/// all quants at -128 or 127 against activations of -128 and 127).
#[test]
fn q8_0_x8_tile_reads_the_repacked_rows_in_place() {
    use kvrun::backend::cpu::b32_x8::dot_scalar;
    use kvrun::backend::cpu::qgemm_q8_0_tokens::{
        pack_side, pack_side_x8, prefill_for, tile_x8_for, Q8_0_BYTES, ROWS, SIDE_BYTES, TOKS,
    };
    use kvrun::backend::cpu::x8::X8;
    let seed = 0x5eed_0808 ^ std::process::id() as u64;
    eprintln!("seed {seed}");
    let mut r = Rng::new(seed);
    let dt = DType::Q8_0;
    let mut checked = 0;
    let mut check = |nb: usize, w: &[u8], act: &[u8], what: &str| {
        let rb = nb * Q8_0_BYTES;
        let n_out = w.len() / rb;
        let x8 = X8::new(dt, w, n_out, nb);
        let toks: [&[u8]; TOKS] = std::array::from_fn(|k| &act[k * rb..(k + 1) * rb]);
        for blk in 0..n_out / ROWS {
            let rows: [&[u8]; ROWS] =
                std::array::from_fn(|k| &w[(blk * ROWS + k) * rb..(blk * ROWS + k + 1) * rb]);
            let (mut side, mut side_x8) = (vec![0u8; nb * SIDE_BYTES], vec![1u8; nb * SIDE_BYTES]);
            pack_side(nb, &rows, &mut side);
            pack_side_x8(nb, x8.block(blk), &mut side_x8);
            assert_eq!(side, side_x8, "{what} block {blk}: side data");
            for level in simd_levels() {
                let Some(tile_x8) = tile_x8_for(level) else {
                    assert!(!level.vnni(), "{level}: no Q8_0×8 tile");
                    continue;
                };
                let prefill = prefill_for(dt, level).expect("a prefill tile");
                let mut packed = vec![0u8; nb * prefill.act_bytes];
                (prefill.pack)(nb, &toks, &mut packed);
                let want = (prefill.tile)(nb, &rows, &side, &packed);
                let got = tile_x8(nb, x8.block(blk), &side_x8, &packed);
                for i in 0..ROWS {
                    for t in 0..TOKS {
                        let m = dot_scalar(dt, nb, rows[i], toks[t]);
                        assert!(
                            got[i][t].to_bits() == want[i][t].to_bits()
                                && got[i][t].to_bits() == m.to_bits(),
                            "{level} {what} ({i},{t}): in place {} vs rows {} vs model {m}",
                            got[i][t],
                            want[i][t]
                        );
                    }
                }
                checked += 1;
            }
        }
    };
    for (n_out, n_in) in [(8usize, 32usize), (16, 640), (24, 3584)] {
        let (w, act) = quant_problem(dt, &mut r, n_out, n_in, TOKS);
        check(n_in / 32, &w, &act, &format!("{n_out}x{n_in}"));
    }
    let nb = 4;
    for fill in [0x80u8, 0x7f] {
        for y in [-128i8, 127] {
            let mut w = vec![fill; ROWS * nb * Q8_0_BYTES];
            for (i, b) in w.chunks_exact_mut(Q8_0_BYTES).enumerate() {
                b[..2].copy_from_slice(&f16::from_f32(0.01 + i as f32 * 1e-3).to_le_bytes());
            }
            let mut act = vec![0u8; TOKS * nb * Q8_0_BYTES];
            for (k, blk) in act.chunks_exact_mut(Q8_0_BYTES).enumerate() {
                blk[..2].copy_from_slice(&f16::from_f32(0.5 + k as f32 * 0.01).to_le_bytes());
                blk[2..].fill(y as u8);
            }
            check(nb, &w, &act, &format!("extremes {fill:#x} y {y}"));
        }
    }
    eprintln!("{checked} tile calls checked");
}

/// Q4_1×8: every row unpacks to its GGUF bytes, the scalar model equals
/// ggml's `vec_dot` bit for bit (it keeps ggml's lanes), and the repacked
/// decoding kernel at every level this CPU runs equals the model bit for
/// bit, on fresh random data and at the extremes (nibbles 0 and 15
/// against activations of ±127 and -128).
#[test]
fn q4_1_x8_round_trips_and_its_kernel_matches_ggml() {
    use kvrun::backend::cpu::q4_1_x8::{decode_for, dot_scalar, ROWS};
    use kvrun::backend::cpu::x8::{decode_scalar, X8};
    let seed = 0x5eed_0411 ^ std::process::id() as u64;
    eprintln!("seed {seed}");
    let mut r = Rng::new(seed);
    let dt = DType::Q4_1;
    let tr = ggml_sys::CpuTraits::of(dt.ggml_id()).unwrap();
    let mut checked = 0;
    let mut check = |nb: usize, w: &[u8], y: &[u8], what: &str| {
        let rb = nb * dt.block_bytes();
        let n_out = w.len() / rb;
        let x8 = X8::new(dt, w, n_out, nb);
        // whole row blocks at once (prefill's gather: AVX2's transpose
        // where this CPU has it), rows a ragged stride apart
        let stride = rb + 12;
        let mut rows = vec![0xa5u8; ROWS * stride];
        for blk in 0..n_out / ROWS {
            x8.block_rows_into(blk, &mut rows, stride);
            for k in 0..ROWS {
                let i = blk * ROWS + k;
                assert_eq!(
                    rows[k * stride..k * stride + rb],
                    w[i * rb..(i + 1) * rb],
                    "{what}: row {i} of its block"
                );
                assert!(rows[k * stride + rb..(k + 1) * stride]
                    .iter()
                    .all(|&b| b == 0xa5));
            }
        }
        let mut row = vec![0u8; rb];
        for i in 0..n_out {
            x8.row_into(i, &mut row);
            assert_eq!(row, w[i * rb..(i + 1) * rb], "{what}: row {i} round trip");
            let m = dot_scalar(nb, &row, y);
            let g = tr.dot(nb * 32, &row, y);
            assert_eq!(
                m.to_bits(),
                g.to_bits(),
                "{what} row {i}: model {m} vs ggml {g}"
            );
        }
        for blk in 0..n_out / ROWS {
            let model = decode_scalar(dt, nb, x8.block(blk), y);
            for k in 0..ROWS {
                let i = blk * ROWS + k;
                let want = dot_scalar(nb, &w[i * rb..(i + 1) * rb], y);
                assert_eq!(model[k].to_bits(), want.to_bits(), "{what} row {i}");
            }
            for level in simd_levels() {
                let Some(f) = decode_for(level) else {
                    continue;
                };
                let v = f(nb, x8.block(blk), y);
                for k in 0..ROWS {
                    assert_eq!(
                        v[k].to_bits(),
                        model[k].to_bits(),
                        "{level} {what} row {}: {} vs {}",
                        blk * ROWS + k,
                        v[k],
                        model[k]
                    );
                }
                checked += 1;
            }
        }
    };
    for n_in in [32usize, 576, 1536, 3584] {
        let (w, act) = quant_problem(dt, &mut r, 3 * ROWS, n_in, 1);
        check(
            n_in / 32,
            &w,
            &act[..tr.act_bytes(n_in)],
            &format!("n_in {n_in}"),
        );
    }
    let (nb, bb) = (4, dt.block_bytes());
    for fill in [0x00u8, 0xff, 0x0f, 0xf0] {
        for yv in [-128i8, -127, 127] {
            let mut w = vec![fill; ROWS * nb * bb];
            for (i, b) in w.chunks_exact_mut(bb).enumerate() {
                b[..2].copy_from_slice(&f16::from_f32(0.01 + i as f32 * 1e-3).to_le_bytes());
                b[2..4].copy_from_slice(&f16::from_f32(-0.05 * i as f32).to_le_bytes());
            }
            let mut y = vec![0u8; nb * 36];
            for (k, blk) in y.chunks_exact_mut(36).enumerate() {
                blk[..2].copy_from_slice(&f16::from_f32(0.5 + 0.1 * k as f32).to_le_bytes());
                blk[2..4].copy_from_slice(&f16::from_f32(3.0 - k as f32).to_le_bytes());
                blk[4..].fill(if k % 2 == 1 { 127 } else { yv as u8 });
            }
            check(nb, &w, &y, &format!("extremes {fill:#x} y {yv}"));
        }
    }
    eprintln!("{checked} kernel calls checked");
}

/// `matmul_q` at every kernel level this CPU runs equals ggml's `vec_dot`
/// row by row, bit for bit: row counts not a multiple of the tile's, token
/// counts not a multiple of its width, decoding (1 token), 1-3 threads.
#[test]
fn matmul_q_tiled_matches_row_by_row_on_ragged_shapes() {
    let mut r = Rng::new(0x7113d);
    for (dt, n_out, n_in, n_tok) in [
        (DType::Q4_1, 18usize, 64usize, 7usize),
        (DType::Q4_1, 192, 576, 13),
        (DType::Q4_1, 4, 32, 4),
        (DType::Q4_1, 37, 96, 5),
        (DType::Q4_1, 37, 96, 1),
        (DType::Q4_1, 64, 576, 1),
        (DType::Q4K, 18, 256, 7),
        (DType::Q4K, 37, 768, 5),
        (DType::Q4K, 5, 512, 1),
        (DType::Q4K, 64, 1024, 1),
        (DType::Q4K, 4, 256, 4),
        (DType::Q4K, 21, 512, 2),
        (DType::Q4K, 8, 256, 3),
        (DType::Q4K, 40, 768, 9),
        (DType::Q4K, 13, 512, 17),
        (DType::Q4K, 136, 768, 1),
        (DType::Q4K, 72, 512, 11),
        // the AMX prefill: K slices (more than 16 superblocks), several
        // panel blocks, an odd number of 16-token tiles, ragged panels
        (DType::Q4K, 136, 4608, 37),
        (DType::Q4K, 64, 512, 2),
        (DType::Q5K, 80, 4352, 16),
        (DType::Q6K, 72, 4352, 33),
        (DType::Q6K, 21, 512, 18),
        (DType::Q5K, 18, 256, 7),
        (DType::Q5K, 37, 768, 5),
        (DType::Q5K, 5, 512, 1),
        (DType::Q5K, 4, 256, 4),
        (DType::Q6K, 18, 256, 7),
        (DType::Q6K, 37, 768, 5),
        (DType::Q6K, 9, 512, 1),
        // Q6_K×8 (8k rows): decoding, and prefill gathered from it
        (DType::Q6K, 64, 768, 1),
        (DType::Q6K, 24, 3584, 2),
        // Q3_K, row-major at every level (rows in lanes, packed prefill)
        (DType::Q3K, 18, 256, 7),
        (DType::Q3K, 37, 768, 5),
        (DType::Q3K, 9, 512, 1),
        (DType::Q3K, 64, 768, 1),
        (DType::Q3K, 24, 3584, 2),
        (DType::Q3K, 72, 4352, 33),
        // Q2_K, the same (mins per 16 weights)
        (DType::Q2K, 18, 256, 7),
        (DType::Q2K, 37, 768, 5),
        (DType::Q2K, 9, 512, 1),
        (DType::Q2K, 64, 768, 1),
        (DType::Q2K, 40, 3584, 9),
        // IQ4_XS (the VNNI kernels, or at AVX2 on the quants' nibbles)
        (DType::IQ4XS, 18, 256, 7),
        (DType::IQ4XS, 37, 768, 5),
        (DType::IQ4XS, 9, 512, 1),
        (DType::IQ4XS, 40, 3584, 9),
        // IQ4_XS×8 (8k rows): decoding, and prefill packed from it
        (DType::IQ4XS, 48, 768, 1),
        (DType::IQ4XS, 16, 256, 2),
        // Q5_K×8, the same
        (DType::Q5K, 48, 1536, 1),
        (DType::Q5K, 16, 768, 9),
        (DType::Q8_0, 18, 64, 7),
        (DType::Q8_0, 37, 640, 5),
        (DType::Q8_0, 9, 96, 1),
        (DType::Q8_0, 4, 32, 4),
        (DType::Q8_0, 70, 96, 2),
        (DType::Q8_0, 13, 64, 3),
        (DType::Q8_0, 130, 128, 17),
        // the AMX Q8_0 prefill: an odd block count, a ragged panel
        (DType::Q8_0, 70, 1056, 37),
        // and Q4_0 / Q5_0 through it (expanded to Q8_0 rows), plain and
        // repacked (136 rows: two blocks of 64, then half a panel)
        (DType::Q4_0, 70, 1056, 37),
        (DType::Q5_0, 70, 640, 18),
        (DType::Q4_0, 136, 640, 33),
        (DType::Q5_0, 136, 1056, 19),
        (DType::Q8_0, 136, 640, 20),
        (DType::Q4_0, 18, 64, 7),
        (DType::Q4_0, 37, 640, 5),
        (DType::Q4_0, 9, 96, 1),
        (DType::Q4_0, 4, 32, 4),
        (DType::Q5_0, 18, 64, 7),
        (DType::Q5_0, 37, 640, 5),
        (DType::Q5_0, 9, 96, 1),
        (DType::Q5_0, 4, 32, 4),
        // Q8_0×8, Q4_0×8, Q5_0×8 (8k rows): decoding, and prefill expanded
        // from them
        (DType::Q8_0, 64, 640, 1),
        (DType::Q8_0, 24, 1056, 19),
        (DType::Q4_0, 48, 3584, 1),
        (DType::Q4_0, 72, 640, 9),
        (DType::Q4_0, 16, 64, 2),
        (DType::Q5_0, 40, 1536, 1),
        (DType::Q5_0, 72, 640, 11),
        (DType::Q5_0, 16, 96, 3),
        // IQ4_NL: plain (ragged row counts) and IQ4_NL×8, the AMX path's
        // odd block count and ragged panel
        (DType::IQ4NL, 18, 64, 7),
        (DType::IQ4NL, 37, 640, 5),
        (DType::IQ4NL, 9, 96, 1),
        (DType::IQ4NL, 48, 3584, 1),
        (DType::IQ4NL, 72, 640, 9),
        (DType::IQ4NL, 70, 1056, 37),
        (DType::IQ4NL, 136, 640, 33),
        // Q4_1×8 (8k rows): decoding, and prefill gathered from it
        (DType::Q4_1, 64, 576, 1),
        (DType::Q4_1, 24, 96, 2),
        (DType::Q4_1, 16, 64, 5),
        (DType::Q4_1, 40, 1536, 9),
    ] {
        let tr = ggml_sys::CpuTraits::of(dt.ggml_id()).unwrap();
        let (w, act) = quant_problem(dt, &mut r, n_out, n_in, n_tok);
        let m = QMat::new(dt, n_in, n_out, std::borrow::Cow::Borrowed(&w)).unwrap();
        // the same matrix as this CPU's best level lays it out (the `x8`
        // layouts where it has 8k rows; every level must give the plain
        // matrix's results)
        let m8 = QMat::new(dt, n_in, n_out, std::borrow::Cow::Borrowed(&w))
            .unwrap()
            .repack_for(kvrun::backend::cpu::isa::detected());
        let ab = tr.act_bytes(n_in);
        // every kernel level this CPU runs, the portable one (ggml) included
        let levels = std::iter::once(Level::Portable).chain(simd_levels());
        let runs = levels.flat_map(|l| [1, 2, 3].map(|n| (l, n)));
        let runs = runs.flat_map(|(l, n)| [(l, n, false), (l, n, true)]);
        for (level, threads, repacked) in runs {
            if repacked && !m8.is_repacked() {
                continue;
            }
            let pool = ThreadPool::new(threads);
            let mut out = vec![f32::NAN; n_tok * n_out];
            let mat = if repacked { &m8 } else { &m };
            matmul_q_at(&pool, mat, &act, n_tok, &mut out, level);
            // K-quants on AVX2 follow the rows-in-lanes arithmetic, Q8_0,
            // Q4_0 and Q5_0 from AVX2 up the tokens-in-lanes one, not ggml's
            let lanes = kvrun::backend::cpu::matmul::k_quant_kernel::<1>(dt, level).is_some();
            let q8_vnni = matches!(dt, DType::Q8_0 | DType::Q4_0 | DType::Q5_0 | DType::IQ4NL)
                && kvrun::backend::cpu::qgemm_q8_0_tokens::prefill_for(dt, level).is_some();
            for t in 0..n_tok {
                for i in 0..n_out {
                    let a = &act[t * ab..(t + 1) * ab];
                    let g = if lanes {
                        kvrun::backend::cpu::qgemm_lanes::dot_scalar(dt, n_in / 256, &m.row(i), a)
                    } else if q8_vnni {
                        kvrun::backend::cpu::b32_x8::dot_scalar(dt, n_in / 32, &m.row(i), a)
                    } else {
                        tr.dot(n_in, &m.row(i), a)
                    };
                    let v = out[t * n_out + i];
                    assert_eq!(
                        v.to_bits(),
                        g.to_bits(),
                        "{dt} {level} {n_out}x{n_in} repacked {repacked} tok {t} row {i}: {v} vs {g}"
                    );
                }
            }
        }
    }
}

/// Scalar f32 reference attention for one query head in f64: softmax(q·k_j
/// · scale) @ V over the original (unquantized) f32 rows.
fn attend_ref(q: &[f32], k: &[f32], v: &[f32], hd: usize, scale: f32) -> (Vec<f64>, Vec<f64>) {
    let n = k.len() / hd;
    let s: Vec<f64> = (0..n)
        .map(|j| {
            (0..hd)
                .map(|d| q[d] as f64 * k[j * hd + d] as f64)
                .sum::<f64>()
                * scale as f64
        })
        .collect();
    let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = s.iter().map(|x| (x - mx).exp()).sum();
    let p: Vec<f64> = s.iter().map(|x| (x - mx).exp() / z).collect();
    let out = (0..hd)
        .map(|d| (0..n).map(|j| p[j] * v[j * hd + d] as f64).sum())
        .collect();
    (out, p)
}

/// `--cache-type`: the decode kernel reads f32, f16 and q8_0 rows (one
/// monomorphized loop each) and matches the scalar f32 reference within a
/// per-type tolerance (query rounding to f16 + storage rounding), output and
/// exported probabilities alike; with one segment the segmented kernel is
/// the plain kernel bit for bit.
#[test]
fn attention_parity_per_cache_type() {
    use kvrun::backend::cpu::decode_attn::attend_group_probs_seg;
    use kvrun::kv::{dequantize_q8_0, quantize_q8_0, BlockQ8_0, KvType, QK8_0};
    let mut r = Rng::new(0xcac4e);
    let mut worst = [0f64; 3];
    for &(g, hd, n) in &[
        (1usize, 64usize, 1usize),
        (3, 64, 37),
        (4, 128, 300),
        (2, 32, 1000),
    ] {
        let q: Vec<f32> = (0..g * hd).map(|_| randn(&mut r)).collect();
        let k: Vec<f32> = (0..n * hd).map(|_| randn(&mut r)).collect();
        let v: Vec<f32> = (0..n * hd).map(|_| randn(&mut r)).collect();
        let (k16, v16): (Vec<f16>, Vec<f16>) = (
            k.iter().map(|&x| f16::from_f32(x)).collect(),
            v.iter().map(|&x| f16::from_f32(x)).collect(),
        );
        let nb = hd / QK8_0;
        let (mut k8, mut v8) = (
            vec![BlockQ8_0::default(); n * nb],
            vec![BlockQ8_0::default(); n * nb],
        );
        quantize_q8_0(&k, &mut k8);
        quantize_q8_0(&v, &mut v8);
        // q8_0 round trip: each value within half a step of its block scale
        let mut kd = vec![0f32; n * hd];
        dequantize_q8_0(&k8, &mut kd);
        for (b, (x, y)) in k8.iter().zip(k.chunks(QK8_0).zip(kd.chunks(QK8_0))) {
            let d = b.d.to_f32();
            for (a, c) in x.iter().zip(y) {
                assert!(
                    (a - c).abs() <= 0.5 * d + 127.0 * d / 2048.0,
                    "q8_0 round trip {a} {c} d {d}"
                );
            }
        }
        let scale = 1.0 / (hd as f32).sqrt();
        for (ti, ty) in KvType::ALL.into_iter().enumerate() {
            let (mut out, mut sc, mut st) =
                (vec![0f32; g * hd], vec![0f32; g * n], vec![(0f32, 0f32); g]);
            macro_rules! run {
                ($k:expr, $v:expr, $u:expr) => {{
                    let (kk, vv, u) = (&$k, &$v, $u);
                    attend_group_probs(
                        &q,
                        g,
                        n,
                        |j| &kk[j * u..(j + 1) * u],
                        |j| &vv[j * u..(j + 1) * u],
                        scale,
                        &mut sc,
                        &mut out,
                        &mut st,
                    );
                    // the segmented kernel with one segment is the same code path
                    let (mut o2, mut s2, mut st2) =
                        (vec![0f32; g * hd], vec![0f32; g * n], vec![(0f32, 0f32); g]);
                    attend_group_probs_seg(
                        &q,
                        &[n],
                        g,
                        n,
                        |j| &kk[j * u..(j + 1) * u],
                        |j| &vv[j * u..(j + 1) * u],
                        scale,
                        &mut s2,
                        &mut o2,
                        &mut st2,
                    );
                    assert!(o2 == out && s2 == sc, "{ty}: one-segment kernel differs");
                }};
            }
            match ty {
                KvType::F32 => run!(k, v, hd),
                KvType::F16 => run!(k16, v16, hd),
                KvType::Q8_0 => run!(k8, v8, nb),
            }
            // tolerance: f16 query rounding (all types) + storage rounding
            let tol = match ty {
                KvType::F32 => 2e-3,
                KvType::F16 => 4e-3,
                KvType::Q8_0 => 3e-2,
            };
            for h in 0..g {
                let (o_ref, p_ref) = attend_ref(&q[h * hd..(h + 1) * hd], &k, &v, hd, scale);
                for d in 0..hd {
                    let e = (out[h * hd + d] as f64 - o_ref[d]).abs();
                    worst[ti] = worst[ti].max(e);
                    assert!(e <= tol, "{ty} g{g} hd{hd} n{n} head {h} dim {d}: err {e}");
                }
                for j in 0..n {
                    let e = (sc[h * n + j] as f64 - p_ref[j]).abs();
                    assert!(e <= tol, "{ty} probability {h},{j}: err {e}");
                }
            }
        }
    }
    eprintln!(
        "max |out - f32 reference|: f32 {:.2e}, f16 {:.2e}, q8_0 {:.2e}",
        worst[0], worst[1], worst[2]
    );
}

/// The q8_0 cache blocks have ggml's layout and values: serialized as
/// 34-byte blocks, ggml's dequantizer (our reference in `quant`) reads them
/// back to exactly what the cache kernels see, and the quants agree with
/// ggml's x86 activation quantizer to within one step.
#[test]
fn q8_0_cache_blocks_are_ggml_blocks() {
    use kvrun::kv::{dequantize_q8_0, quantize_q8_0, BlockQ8_0};
    use kvrun::tensor::DType;
    assert_eq!(std::mem::size_of::<BlockQ8_0>(), 34);
    let mut r = Rng::new(7);
    let n = 32 * 24;
    let mut x: Vec<f32> = (0..n).map(|_| randn(&mut r) * 3.0).collect();
    x[32..64].fill(0.0); // an all-zero block
    let mut b = vec![BlockQ8_0::default(); n / 32];
    quantize_q8_0(&x, &mut b);
    let mut bytes = Vec::new();
    for blk in &b {
        bytes.extend_from_slice(&blk.d.to_le_bytes());
        bytes.extend(blk.qs.iter().map(|&q| q as u8));
    }
    let (mut ours, mut theirs) = (vec![0f32; n], vec![0f32; n]);
    dequantize_q8_0(&b, &mut ours);
    kvrun::quant::dequantize_row(DType::Q8_0, &bytes, &mut theirs);
    assert_eq!(ours, theirs);
    let mut g = vec![0u8; bytes.len()];
    kvrun::quant::quantize_row_q8_0(&x, &mut g);
    for (a, c) in bytes.chunks(34).zip(g.chunks(34)) {
        assert_eq!(a[..2], c[..2], "scales differ");
        for (p, q) in a[2..].iter().zip(&c[2..]) {
            assert!((*p as i8 as i32 - *q as i8 as i32).abs() <= 1);
        }
    }
}

/// The 16-lane `exp` of the AVX-512 decode kernel and the 8-lane one of
/// the AVX2 kernel: bit for bit their scalar reference on the normal range,
/// within 1e-6 relative of f64 `exp` over the range the kernels use
/// (s − max ≤ 0), 0 below the underflow, NaN kept (each wherever the CPU
/// runs it; elsewhere its slice helper is the reference itself).
#[test]
// -0.3465736 is ±ln2/2 on purpose: the edge of the range reduction
#[allow(clippy::approx_constant)]
fn simd_exp_matches_scalar_reference_and_f64() {
    use kvrun::backend::cpu::decode_avx512::exp_ref;
    for (name, exp_slice) in [
        (
            "exp16",
            kvrun::backend::cpu::decode_avx512::exp_slice as fn(&mut [f32]),
        ),
        ("exp8", kvrun::backend::cpu::decode_avx2::exp_slice),
    ] {
        check_exp(name, exp_ref, exp_slice);
    }
}

#[allow(clippy::approx_constant, clippy::excessive_precision)]
fn check_exp(name: &str, exp_ref: fn(f32) -> f32, exp_slice: fn(&mut [f32])) {
    let mut xs: Vec<f32> = (0..=200_000)
        .map(|i| -87.0 * i as f32 / 200_000.0)
        .collect();
    xs.extend([
        0.0,
        -0.0,
        -1e-30,
        -0.34657359,
        -0.34657362,
        -f32::MIN_POSITIVE,
    ]);
    // every float in a few binades near 0 and around the reduction boundaries
    for base in [-1e-3f32, -0.5, -0.693147, -40.0] {
        let b = base.to_bits();
        xs.extend((0..2000u32).map(|i| f32::from_bits(b + i)));
    }
    let mut got = xs.clone();
    exp_slice(&mut got);
    let mut worst = 0f64;
    for (&x, &y) in xs.iter().zip(&got) {
        let r = exp_ref(x);
        assert_eq!(y.to_bits(), r.to_bits(), "{name}({x}) = {y}, reference {r}");
        let e = (x as f64).exp();
        let rel = (y as f64 - e).abs() / e;
        worst = worst.max(rel);
        assert!(rel <= 1e-6, "exp({x}) = {y} vs {e}: rel {rel:.2e}");
    }
    eprintln!("{name} worst relative error on [-87, 0]: {worst:.2e}");
    // the tails: subnormal results stay close in absolute terms, then 0
    let mut t = vec![
        -87.5f32,
        -95.0,
        -103.0,
        -104.0,
        -200.0,
        f32::NEG_INFINITY,
        f32::NAN,
        89.0,
    ];
    exp_slice(&mut t);
    assert!((t[0] as f64 - (-87.5f64).exp()).abs() < 1e-44);
    assert!((t[1] as f64 - (-95f64).exp()).abs() < 2e-45);
    assert!(t[2] == f32::from_bits(1) && t[3] == 0.0 && t[4] == 0.0 && t[5] == 0.0);
    assert!(t[6].is_nan() && t[7] == f32::INFINITY, "{name} tails");
}

/// The decode kernels (`decode_avx2::attend`, `decode_avx512::attend` and
/// the dispatching `attend_group_probs_seg`, each wherever the CPU can run
/// it) against the portable reference `attend_group_probs_seg_ref`: every
/// supported group size and head_dim, ragged key counts (8- and 16-key
/// tails), several query segments, each cache type; outputs and
/// probabilities agree to float rounding.
#[test]
fn decode_kernel_matches_portable_reference() {
    use kvrun::backend::cpu::decode_attn::attend_group_probs_seg;
    use kvrun::backend::cpu::reference::attend_group_probs_seg_ref;
    use kvrun::backend::cpu::{decode_avx2, decode_avx512};
    use kvrun::kv::{quantize_q8_0, BlockQ8_0, QK8_0};
    let (has2, has512) = (decode_avx2::available(), decode_avx512::available());
    eprintln!("decode kernels available: avx2 {has2}, avx512 {has512}");
    if kvrun::backend::cpu::isa::detected() >= kvrun::backend::cpu::isa::Level::Avx2 {
        assert!(has2, "an AVX2 CPU must run the AVX2 decode kernel");
    }
    let mut r = Rng::new(0xdec0de);
    let mut worst = (0f32, 0f32);
    for &(g, hd, n, ns) in &[
        (3usize, 64usize, 1usize, 1usize),
        (3, 64, 15, 1),
        (3, 64, 16, 1),
        (3, 64, 1024, 1),
        (3, 64, 1000, 3),
        (1, 32, 33, 1),
        (2, 128, 257, 2),
        (4, 256, 70, 1),
        (5, 64, 31, 1),
        (8, 128, 100, 4),
        (7, 32, 17, 2),
        (6, 64, 48, 1),
        (9, 64, 20, 1),
        (3, 48, 20, 1),
    ] {
        let q: Vec<f32> = (0..ns * g * hd).map(|_| randn(&mut r) * 3.0).collect();
        let k: Vec<f32> = (0..n * hd).map(|_| randn(&mut r)).collect();
        let v: Vec<f32> = (0..n * hd).map(|_| randn(&mut r)).collect();
        let k16: Vec<f16> = k.iter().map(|&x| f16::from_f32(x)).collect();
        let v16: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
        let nb = hd / QK8_0;
        let (mut k8, mut v8) = (
            vec![BlockQ8_0::default(); n * nb],
            vec![BlockQ8_0::default(); n * nb],
        );
        if hd % QK8_0 == 0 {
            quantize_q8_0(&k, &mut k8);
            quantize_q8_0(&v, &mut v8);
        }
        // segment ends: ns runs over the keys
        let seg: Vec<usize> = (1..=ns).map(|s| n * s / ns).collect();
        let scale = 1.0 / (hd as f32).sqrt();
        macro_rules! check {
            ($k:expr, $v:expr, $u:expr, $what:expr) => {{
                let (kk, vv, u) = (&$k, &$v, $u);
                let (o1, s1, st1) = (vec![0f32; g * hd], vec![0f32; g * n], vec![(0f32, 0f32); g]);
                let (mut o2, mut s2, mut st2) = (o1.clone(), s1.clone(), st1.clone());
                let supported = decode_avx512::supports(g, hd);
                let mut runs = Vec::new();
                for (name, can) in [
                    ("dispatched", true),
                    ("avx2", has2 && supported),
                    ("avx512", has512 && supported),
                ] {
                    if !can {
                        continue;
                    }
                    let (mut o1, mut s1, mut st1) = (o1.clone(), s1.clone(), st1.clone());
                    macro_rules! call {
                        ($f:path) => {
                            $f(
                                &q,
                                &seg,
                                g,
                                n,
                                |j| &kk[j * u..(j + 1) * u],
                                |j| &vv[j * u..(j + 1) * u],
                                scale,
                                &mut s1,
                                &mut o1,
                                &mut st1,
                            )
                        };
                    }
                    match name {
                        "avx2" => call!(decode_avx2::attend),
                        "avx512" => call!(decode_avx512::attend),
                        _ => call!(attend_group_probs_seg),
                    }
                    runs.push((name, o1, s1, st1));
                }
                attend_group_probs_seg_ref(
                    &q,
                    &seg,
                    g,
                    n,
                    |j| &kk[j * u..(j + 1) * u],
                    |j| &vv[j * u..(j + 1) * u],
                    scale,
                    &mut s2,
                    &mut o2,
                    &mut st2,
                );
                for (kname, o1, s1, st1) in &runs {
                    for i in 0..g * hd {
                        let e = (o1[i] - o2[i]).abs();
                        worst.0 = worst.0.max(e);
                        assert!(
                            e <= 2e-5 * (1.0 + o2[i].abs()),
                            "{} {} g{g} hd{hd} n{n} ns{ns}: out {i}: {} vs {}",
                            $what,
                            kname,
                            o1[i],
                            o2[i]
                        );
                    }
                    for i in 0..g * n {
                        let e = (s1[i] - s2[i]).abs();
                        worst.1 = worst.1.max(e / s2[i].max(1e-30));
                        assert!(
                            e <= 1e-5 * s2[i] + 1e-12,
                            "{} {} g{g} hd{hd} n{n} ns{ns}: prob {i}: {} vs {}",
                            $what,
                            kname,
                            s1[i],
                            s2[i]
                        );
                    }
                    for h in 0..g {
                        let ((m1, z1), (m2, z2)) = (st1[h], st2[h]);
                        assert!(
                            (m1 - m2).abs() <= 1e-5 * (1.0 + m2.abs()),
                            "{} {} max",
                            $what,
                            kname
                        );
                        assert!((z1 - z2).abs() <= 1e-5 * z2, "{} {} sum", $what, kname);
                    }
                }
            }};
        }
        check!(k, v, hd, "f32");
        check!(k16, v16, hd, "f16");
        if hd % QK8_0 == 0 {
            check!(k8, v8, nb, "q8_0");
        }
    }
    eprintln!(
        "max |out - ref| {:.2e}, max relative prob error {:.2e}",
        worst.0, worst.1
    );
}

/// Speed of the decode kernel against its portable reference on one
/// token's worth of SmolLM2-135M attention over 1024 cached f16 rows (30
/// layers × 3 KV heads × 3 query heads, head_dim 64, rows strided as in the
/// cache). `cargo test --release --test kernels -- --ignored --nocapture`.
#[test]
#[ignore]
fn decode_kernel_speed() {
    use kvrun::backend::cpu::decode_attn::attend_group_probs_seg;
    use kvrun::backend::cpu::reference::attend_group_probs_seg_ref;
    let (layers, kvh, g, hd, n) = (30usize, 3usize, 3usize, 64usize, 1024usize);
    let kv_dim = kvh * hd;
    let mut r = Rng::new(7);
    let cache: Vec<f16> = (0..layers * 2 * n * kv_dim)
        .map(|_| f16::from_f32(randn(&mut r)))
        .collect();
    let q: Vec<f32> = (0..g * hd).map(|_| randn(&mut r)).collect();
    let (mut sc, mut out, mut st) = (vec![0f32; g * n], vec![0f32; g * hd], [(0f32, 0f32); 8]);
    let scale = 0.125;
    let mut time = |simd: bool| {
        let t = std::time::Instant::now();
        let reps = 20;
        for _ in 0..reps {
            for l in 0..layers {
                let (k, v) = (
                    &cache[l * 2 * n * kv_dim..][..n * kv_dim],
                    &cache[(l * 2 + 1) * n * kv_dim..][..n * kv_dim],
                );
                for h in 0..kvh {
                    let key = |j: usize| &k[j * kv_dim + h * hd..j * kv_dim + (h + 1) * hd];
                    let val = |j: usize| &v[j * kv_dim + h * hd..j * kv_dim + (h + 1) * hd];
                    if simd {
                        attend_group_probs_seg(
                            &q,
                            &[n],
                            g,
                            n,
                            key,
                            val,
                            scale,
                            &mut sc,
                            &mut out,
                            &mut st[..g],
                        );
                    } else {
                        attend_group_probs_seg_ref(
                            &q,
                            &[n],
                            g,
                            n,
                            key,
                            val,
                            scale,
                            &mut sc,
                            &mut out,
                            &mut st[..g],
                        );
                    }
                }
            }
        }
        t.elapsed().as_secs_f64() * 1e3 / reps as f64
    };
    // interleaved rounds, the best of each (the machine may be shared)
    let (mut a, mut b) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..7 {
        a = a.min(time(false));
        b = b.min(time(true));
    }
    eprintln!(
        "per token (best of 7): portable {a:.3} ms, dispatched {b:.3} ms, {:.1}x",
        a / b
    );
}

/// Throughput of the quantized matmuls at R1-Distill-Qwen-7B shapes
/// (ffn_up: 18944 × 3584, ffn_down: 3584 × 18944) for a 128-token prefill
/// batch and one decoding token, at every level this CPU runs, in GMAC/s.
/// `KVRUN_SPEED_TYPES=Q4_K,Q6_K` and `KVRUN_SPEED_THREADS=N` narrow it;
/// `KVRUN_SPEED_SHAPES=2048x640,...` (rows × inputs) replaces the shapes.
/// `cargo test --release --test engine kernels::qgemm_speed -- --ignored --nocapture`.
#[test]
#[ignore]
fn qgemm_speed() {
    let types = std::env::var("KVRUN_SPEED_TYPES").unwrap_or_else(|_| "Q4_K,Q6_K,Q8_0".into());
    let threads: usize = std::env::var("KVRUN_SPEED_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let pool = ThreadPool::new(threads);
    let mut r = Rng::new(11);
    for name in types.split(',') {
        let dt = match name {
            "Q4_K" => DType::Q4K,
            "Q5_K" => DType::Q5K,
            "Q6_K" => DType::Q6K,
            "Q8_0" => DType::Q8_0,
            "Q4_0" => DType::Q4_0,
            "Q5_0" => DType::Q5_0,
            "IQ4_NL" => DType::IQ4NL,
            "IQ4_XS" => DType::IQ4XS,
            other => panic!("KVRUN_SPEED_TYPES: {other}?"),
        };
        let shapes: Vec<(usize, usize)> = match std::env::var("KVRUN_SPEED_SHAPES") {
            Ok(s) => s
                .split(',')
                .map(|s| {
                    let (o, i) = s.split_once('x').expect("KVRUN_SPEED_SHAPES: OUTxIN,...");
                    (o.parse().unwrap(), i.parse().unwrap())
                })
                .collect(),
            Err(_) => vec![(18944 / 4, 3584), (3584 / 4, 18944)],
        };
        for (n_out, n_in) in shapes {
            let n_tok = 128;
            let (w, act) = quant_problem(dt, &mut r, n_out, n_in, n_tok);
            let m = QMat::new(dt, n_in, n_out, std::borrow::Cow::Borrowed(&w)).unwrap();
            let levels = std::iter::once(Level::Portable).chain(simd_levels());
            for level in levels {
                let mut line = format!("{dt} {n_out}x{n_in} {level:>12}:");
                for nt in [n_tok, 1] {
                    let mut out = vec![0f32; nt * n_out];
                    let mut best = f64::INFINITY;
                    for _ in 0..3 {
                        let t = std::time::Instant::now();
                        matmul_q_at(&pool, &m, &act, nt, &mut out, level);
                        best = best.min(t.elapsed().as_secs_f64());
                    }
                    let gmac = (n_out * n_in * nt) as f64 / best / 1e9;
                    line += &format!(" n={nt}: {gmac:7.2} GMAC/s ({:.1} ms)", best * 1e3);
                }
                eprintln!("{line}");
            }
        }
    }
}

/// Q4_K×8, Q5_K×8, Q6_K×8, Q3_K×8, Q2_K×8 and IQ4_XS×8: every row unpacks to its GGUF bytes (whole, and a
/// slice of superblocks), the scalar model of a row block equals
/// `dot_scalar` on the rows, and the repacked kernel at every level this
/// CPU runs equals the model bit for bit (fresh random data).
#[test]
fn x8_repack_round_trips_and_its_kernels_match_the_scalar_model() {
    use kvrun::backend::cpu::qgemm_lanes::{dot_scalar, Q8_K_BYTES, ROWS};
    use kvrun::backend::cpu::x8::{decode_for, decode_scalar, X8};
    let seed = 0x5eed_0418 ^ std::process::id() as u64;
    eprintln!("seed {seed}");
    let mut r = Rng::new(seed);
    let mut checked = 0;
    for dt in SUPERBLOCK_TYPES {
        let tr = ggml_sys::CpuTraits::of(dt.ggml_id()).unwrap();
        for n_in in [256usize, 768, 3584, 18944] {
            let nb = n_in / 256;
            let n_out = 3 * ROWS;
            let (rb, ab) = (dt.row_bytes(n_in), tr.act_bytes(n_in));
            let (w, act) = quant_problem(dt, &mut r, n_out, n_in, 1);
            let x8 = X8::new(dt, &w, n_out, nb);
            let mut rows = vec![0u8; ROWS * rb];
            for blk in 0..n_out / ROWS {
                x8.block_rows_into(blk, &mut rows, rb);
                let at = blk * ROWS * rb;
                assert!(
                    rows == w[at..at + ROWS * rb],
                    "{dt} n_in {n_in}: row block {blk}"
                );
            }
            let mut row = vec![0u8; rb];
            let sb = dt.block_bytes();
            for i in 0..n_out {
                x8.row_into(i, &mut row);
                assert_eq!(
                    row,
                    w[i * rb..(i + 1) * rb],
                    "{dt} n_in {n_in}: row {i} round trip"
                );
                // the last superblocks alone
                let (s0, k) = (nb / 2, nb - nb / 2);
                x8.superblocks_into(i, s0, k, &mut row[..k * sb]);
                assert_eq!(row[..k * sb], w[i * rb + s0 * sb..(i + 1) * rb]);
            }
            let y = &act[..ab];
            for blk in 0..n_out / ROWS {
                let model = decode_scalar(dt, nb, x8.block(blk), y);
                for k in 0..ROWS {
                    let i = blk * ROWS + k;
                    let want = dot_scalar(dt, nb, &w[i * rb..(i + 1) * rb], y);
                    assert_eq!(
                        model[k].to_bits(),
                        want.to_bits(),
                        "{dt} n_in {n_in} row {i}"
                    );
                }
                for level in simd_levels() {
                    // every SIMD level has the kernels (AVX2's from avx2)
                    let f = decode_for(dt, level)
                        .unwrap_or_else(|| panic!("{level}: no {dt}×8 kernel"));
                    let got = f(nb, x8.block(blk), y);
                    for k in 0..ROWS {
                        assert_eq!(
                            got[k].to_bits(),
                            model[k].to_bits(),
                            "{dt} {level:?} n_in {n_in} row {}: {} vs {}",
                            blk * ROWS + k,
                            got[k],
                            model[k]
                        );
                    }
                    checked += 1;
                }
            }
        }
        // the extremes: every quant at its top value against activations of
        // -128 and 127 (the bounds of the kernels' i16 lane sums), scales
        // and mins at their largest magnitude
        let nb = 2;
        let sb = dt.block_bytes();
        let mut w = vec![0u8; ROWS * nb * sb];
        for (i, b) in w.chunks_exact_mut(sb).enumerate() {
            let d = f16::from_f32(0.01 + i as f32 * 1e-3)
                .to_bits()
                .to_le_bytes();
            b.fill(0xff);
            if dt == DType::Q6K {
                b[192..208].fill(0x80); // scales of -128
                b[208..].copy_from_slice(&d);
            } else if dt == DType::Q3K {
                // even superblocks: quants 7, scales 31; odd ones: quants
                // 0, scales −32
                if i % 2 == 1 {
                    b.fill(0);
                }
                b[108..].copy_from_slice(&d);
            } else if dt == DType::Q2K {
                // even superblocks: quants 3, scales and mins 15; odd
                // ones: quants 0, scales and mins 0
                if i % 2 == 1 {
                    b.fill(0);
                }
                b[80..82].copy_from_slice(&d);
                b[82..].copy_from_slice(&f16::from_f32(0.02).to_bits().to_le_bytes());
            } else if dt == DType::IQ4XS {
                // even superblocks: index 15 (grid 113, unsigned 241) and
                // scales of 31 (ls 63); odd ones: index 0 (grid −127) and
                // scales of −32 (ls 0)
                b[..2].copy_from_slice(&d);
                if i % 2 == 1 {
                    b[2..].fill(0);
                }
            } else {
                b[..2].copy_from_slice(&d);
                b[2..4].copy_from_slice(&f16::from_f32(0.02).to_bits().to_le_bytes());
            }
        }
        let mut y = vec![0u8; nb * Q8_K_BYTES];
        for (k, blk) in y.chunks_exact_mut(Q8_K_BYTES).enumerate() {
            blk[..4].copy_from_slice(&0.5f32.to_le_bytes());
            let v: i8 = if k == 0 { -128 } else { 127 };
            blk[4..260].fill(v as u8);
            for j in 0..16 {
                blk[260 + 2 * j..262 + 2 * j].copy_from_slice(&(16 * v as i16).to_le_bytes());
            }
        }
        let x8 = X8::new(dt, &w, ROWS, nb);
        let model = decode_scalar(dt, nb, x8.block(0), &y);
        for k in 0..ROWS {
            let want = dot_scalar(dt, nb, &w[k * nb * sb..(k + 1) * nb * sb], &y);
            assert_eq!(model[k].to_bits(), want.to_bits(), "{dt} extremes row {k}");
        }
        for level in simd_levels() {
            let f = decode_for(dt, level).unwrap_or_else(|| panic!("{level}: no {dt}×8 kernel"));
            let got = f(nb, x8.block(0), &y);
            for k in 0..ROWS {
                assert_eq!(
                    got[k].to_bits(),
                    model[k].to_bits(),
                    "{dt} {level:?} extremes row {k}: {} vs {}",
                    got[k],
                    model[k]
                );
            }
            checked += 1;
        }
    }
    eprintln!("{checked} kernel calls checked");
}

/// One core, at every SIMD level this CPU runs: the row-major decoding
/// kernels against the repacked ones (every layout of `x8::LAYOUTS`), 8-row calls over
/// a matrix in L2 and one streamed from memory (`KVRUN_SPEED_ROWS`, rows
/// per size, comma-separated; `KVRUN_SPEED_TYPES`, the layouts to time,
/// comma-separated, default all).
#[test]
#[ignore]
fn x8_speed() {
    use kvrun::backend::cpu::matmul::k_quant_kernel;
    use kvrun::backend::cpu::qgemm_lanes::ROWS;
    use kvrun::backend::cpu::x8::{decode_for, X8};
    let mut r = Rng::new(5);
    let n_in = 3584;
    let nb = n_in / 256;
    let sizes: Vec<usize> = std::env::var("KVRUN_SPEED_ROWS")
        .map(|s| s.split(',').map(|x| x.parse().unwrap()).collect())
        .unwrap_or_else(|_| vec![64, 18944]);
    use kvrun::backend::cpu::b32_x8;
    let types = std::env::var("KVRUN_SPEED_TYPES").unwrap_or_default();
    for dt in kvrun::backend::cpu::x8::LAYOUTS {
        let named = |t: &str| t.trim().eq_ignore_ascii_case(&dt.to_string());
        if !types.is_empty() && !types.split(',').any(named) {
            continue;
        }
        let rb = dt.row_bytes(n_in);
        let ab = ggml_sys::CpuTraits::of(dt.ggml_id())
            .unwrap()
            .act_bytes(n_in);
        let b32 = b32_x8::is_b32(dt);
        let nb = if b32 || dt == DType::Q4_1 {
            n_in / 32
        } else {
            nb
        };
        for &n_out in &sizes {
            let (w, act) = quant_problem(dt, &mut r, n_out, n_in, 1);
            let x8 = X8::new(dt, &w, n_out, nb);
            let y = &act[..ab];
            let mut ysum = vec![0i32; nb];
            if b32 {
                b32_x8::block_sums(nb, y, &mut ysum);
            }
            let reps = (200_000_000 / (n_out * n_in)).max(3);
            for level in simd_levels() {
                // the 32-weight block types' kernels in the K-quants' call shape
                type RowF = Box<dyn Fn(usize, &[&[u8]; ROWS], &[&[u8]; 1]) -> [[f32; 1]; ROWS]>;
                type X8F = Box<dyn Fn(usize, &[u8], &[u8]) -> [f32; ROWS]>;
                let (x8f, rowf): (Option<X8F>, Option<RowF>) = if b32 {
                    let ys = ysum.clone();
                    let x8f = b32_x8::decode_for(dt, level)
                        .map(|f| Box::new(move |nb, g: &[u8], y: &[u8]| f(nb, g, y, &ys)) as X8F);
                    let ys = ysum.clone();
                    let rowf = match dt {
                        DType::Q8_0 => kvrun::backend::cpu::qgemm_q8_0_tokens::decode_for(level)
                            .map(|f| Box::new(f) as RowF),
                        _ => b32_x8::decode_rows_for(dt, level).map(|f| {
                            Box::new(move |nb, rows: &[&[u8]; ROWS], y: &[&[u8]; 1]| {
                                f(nb, rows, y[0], &ys).map(|v| [v])
                            }) as RowF
                        }),
                    };
                    (x8f, rowf)
                } else if dt == DType::Q4_1 {
                    (
                        kvrun::backend::cpu::q4_1_x8::decode_for(level).map(|f| Box::new(f) as X8F),
                        kvrun::backend::cpu::qgemm_x86::q4_1_decode_for(level)
                            .map(|f| Box::new(f) as RowF),
                    )
                } else {
                    (
                        decode_for(dt, level).map(|f| Box::new(f) as X8F),
                        k_quant_kernel::<1>(dt, level).map(|f| Box::new(f) as RowF),
                    )
                };
                let (Some(x8f), Some(rowf)) = (x8f, rowf) else {
                    continue;
                };
                for round in 0..3 {
                    let mut sink = 0f32;
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        for blk in 0..n_out / ROWS {
                            let rows: [&[u8]; ROWS] = std::array::from_fn(|k| {
                                &w[(blk * ROWS + k) * rb..(blk * ROWS + k + 1) * rb]
                            });
                            sink += rowf(nb, &rows, &[y])[0][0];
                        }
                    }
                    let a = t.elapsed().as_secs_f64();
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        for blk in 0..n_out / ROWS {
                            sink += x8f(nb, x8.block(blk), y)[0];
                        }
                    }
                    let b = t.elapsed().as_secs_f64();
                    let gb = (reps * n_out * rb) as f64 / 1e9;
                    eprintln!(
                        "{dt} {n_out}x{n_in} {level} round {round}: row-major {:.1} GB/s, x8 {:.1} GB/s ({:.2}x) {sink}",
                        gb / a,
                        gb / b,
                        a / b
                    );
                }
            }
        }
    }
}

/// The CPU loader repacks Q4_K and Q6_K matrices (8k rows) exactly where
/// the process's kernel level has their repacked kernels, and never an
/// embedding table, nor a type `--repack` leaves out; a repacked matrix
/// still hands out its rows as GGUF stores them.
#[test]
fn cpu_loader_repacks_where_the_level_has_the_kernel() {
    use kvrun::backend::cpu::Repack;
    use kvrun::backend::WeightSink;
    let mut r = Rng::new(3);
    let loader = kvrun::backend::HOST_LOADER;
    let sink: &dyn WeightSink<kvrun::backend::cpu::Cpu> = &loader;
    let level = kvrun::backend::cpu::isa::level();
    for dt in kvrun::backend::cpu::x8::LAYOUTS
        .into_iter()
        .chain([DType::Q5_1])
    {
        let (w, _) = quant_problem(dt, &mut r, 16, 512, 1);
        let want = kvrun::backend::cpu::x8::has_kernel(dt, level);
        // Q8_0×8 has a VNNI kernel only; Q5_1 has no layout
        let min = if dt == DType::Q8_0 {
            Level::Avx512Vnni
        } else {
            Level::Avx2
        };
        assert_eq!(want, dt != DType::Q5_1 && level >= min, "{dt} {level}");
        let m = sink
            .matrix(dt, 512, 16, std::borrow::Cow::Borrowed(&w))
            .unwrap();
        assert_eq!(m.is_repacked(), want, "{dt} {level}");
        let t = sink
            .table(dt, 512, 16, std::borrow::Cow::Borrowed(&w))
            .unwrap();
        assert!(!t.is_repacked() && t.is_borrowed());
        let rb = dt.row_bytes(512);
        let (mut a, mut b) = (vec![0f32; 512], vec![0f32; 512]);
        for i in 0..16 {
            assert_eq!(&m.row(i)[..], &w[i * rb..(i + 1) * rb]);
            m.dequantize_row(i, &mut a);
            t.dequantize_row(i, &mut b);
            assert_eq!(a, b);
        }
        // rows that do not fill row blocks of 8 stay as they are
        let odd = sink
            .matrix(dt, 512, 12, std::borrow::Cow::Borrowed(&w[..12 * rb]))
            .unwrap();
        assert!(!odd.is_repacked());
        // --repack: off, or a list without this type, keeps it as it is
        for (setting, allowed) in [
            ("off", false),
            ("on", true),
            ("q4_K", dt == DType::Q4K),
            ("Q6_k", dt == DType::Q6K),
            ("q5_k", dt == DType::Q5K),
            ("q4_k+q6_k", matches!(dt, DType::Q4K | DType::Q6K)),
            (
                "q4_k+q5_k+q6_k",
                matches!(dt, DType::Q4K | DType::Q5K | DType::Q6K),
            ),
            ("q8_0+Q4_0", matches!(dt, DType::Q8_0 | DType::Q4_0)),
            ("q5_0", dt == DType::Q5_0),
            ("q4_1", dt == DType::Q4_1),
            (
                "q4_k+q5_k+q6_k+q8_0+q4_0+q5_0",
                matches!(
                    dt,
                    DType::Q4K | DType::Q5K | DType::Q6K | DType::Q8_0 | DType::Q4_0 | DType::Q5_0
                ),
            ),
            (
                "q4_k+q5_k+q6_k+q8_0+q4_0+q5_0+q4_1+iq4_nl",
                !matches!(dt, DType::IQ4XS | DType::Q3K | DType::Q2K),
            ),
            (
                "q4_k+q5_k+q6_k+q8_0+q4_0+q5_0+q4_1+iq4_nl+iq4_xs",
                !matches!(dt, DType::Q3K | DType::Q2K),
            ),
            (
                "q4_k+q5_k+q6_k+q8_0+q4_0+q5_0+q4_1+iq4_nl+iq4_xs+q3_k+q2_k",
                true,
            ),
            ("Q3_k+q2_K", matches!(dt, DType::Q3K | DType::Q2K)),
            ("IQ4_nl", dt == DType::IQ4NL),
            ("iq4_XS+q4_k", matches!(dt, DType::IQ4XS | DType::Q4K)),
        ] {
            let repack = Repack::parse(setting).unwrap();
            let loader = kvrun::backend::cpu::Loader { repack, ..loader };
            let sink: &dyn WeightSink<kvrun::backend::cpu::Cpu> = &loader;
            let m = sink
                .matrix(dt, 512, 16, std::borrow::Cow::Borrowed(&w))
                .unwrap();
            assert_eq!(m.is_repacked(), want && allowed, "{dt} {setting}");
            assert_eq!(&m.row(5)[..], &w[5 * rb..6 * rb]);
        }
    }
    for (setting, shown) in [
        ("1", "on"),
        ("false", "off"),
        ("Q6_K+q4_k+Q5_K", "Q4_K+Q5_K+Q6_K"),
        (
            "Q6_K+q4_k+Q5_K+q8_0+q4_0+q5_0+Q4_1+iq4_nl+IQ4_xs+q2_k+q3_k",
            "on",
        ),
        ("q2_k+Q4_K", "Q4_K+Q2_K"),
        (
            "Q6_K+q4_k+Q5_K+q8_0+q4_0+q5_0+Q4_1+iq4_nl",
            "Q4_K+Q5_K+Q6_K+Q8_0+Q4_0+Q5_0+Q4_1+IQ4_NL",
        ),
        ("iq4_xs+q4_k", "Q4_K+IQ4_XS"),
        (
            "Q6_K+q4_k+Q5_K+q8_0+q4_0+q5_0+Q4_1",
            "Q4_K+Q5_K+Q6_K+Q8_0+Q4_0+Q5_0+Q4_1",
        ),
        ("q8_0+q4_1", "Q8_0+Q4_1"),
        ("Q6_K+q4_k", "Q4_K+Q6_K"),
        ("q6_k", "Q6_K"),
    ] {
        assert_eq!(Repack::parse(setting).unwrap().to_string(), shown);
    }
    for bad in ["q5_1", "", "on+q4_k", "q4_k+"] {
        let e = Repack::parse(bad).unwrap_err();
        assert!(
            e.contains(
                "not on, off or a repacked type (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q5_0, Q4_1, IQ4_NL, IQ4_XS, Q3_K, Q2_K)"
            ),
            "{bad}: {e}"
        );
    }
}

/// A matrix read in place from a file's map is copied into huge pages
/// when the loader asks (`WeightPages::Huge`, `--mmap off`): the same rows,
/// no longer borrowed, the map's pages released (a re-read faults the same
/// bytes back); `Mapped` leaves it in place, and a matrix in anonymous or
/// heap memory is never copied (nothing would back its released pages).
#[test]
fn cpu_loader_copies_mapped_matrices_into_huge_pages_when_asked() {
    use kvrun::backend::cpu::{Loader, Repack, WeightPages};
    use kvrun::backend::WeightSink;
    type Sink = dyn WeightSink<kvrun::backend::cpu::Cpu>;
    let mut r = Rng::new(5);
    // the Q8_0 matrix spans several 2 MiB parts of the copy
    for (dt, n_out) in [(DType::Q8_0, 2048), (DType::Q6K, 16), (DType::Q4K, 16)] {
        let n_in = 1024;
        let (w, _) = quant_problem(dt, &mut r, n_out, n_in, 1);
        let path = std::env::temp_dir().join(format!("kvrun-huge-{}-{dt}.bin", std::process::id()));
        // an odd offset, so the matrix starts and ends mid-page
        let mut file = vec![7u8; 4099];
        file.extend_from_slice(&w);
        file.extend_from_slice(&[9u8; 333]);
        std::fs::write(&path, &file).unwrap();
        let map = kvrun::format::mmap::Mapped::open(&path).unwrap();
        let bytes = &map.bytes()[4099..4099 + w.len()];
        // (nothing repacked, so the K-quants take the copy too)
        let huge: &Sink = &Loader {
            pages: WeightPages::Huge,
            repack: Repack::NONE,
        };
        let mapped: &Sink = &Loader {
            pages: WeightPages::Mapped,
            repack: Repack::NONE,
        };
        let h = huge
            .matrix(dt, n_in, n_out, std::borrow::Cow::Borrowed(bytes))
            .unwrap();
        // the copy read every page of the map and released them: at most
        // the matrix's partial edge pages and their fault-around stay
        #[cfg(target_os = "linux")]
        if w.len() > 1 << 20 {
            let rss = map_rss_kib(map.bytes().as_ptr());
            assert!(
                rss <= 256,
                "{dt}: {rss} KiB of the map resident after the copy"
            );
        }
        let m = mapped
            .matrix(dt, n_in, n_out, std::borrow::Cow::Borrowed(bytes))
            .unwrap();
        assert!(m.is_borrowed() && !m.is_repacked(), "{dt}");
        assert!(!h.is_borrowed() && !h.is_repacked(), "{dt}");
        let rb = dt.row_bytes(n_in);
        for i in 0..n_out {
            assert_eq!(&h.row(i)[..], &w[i * rb..(i + 1) * rb], "{dt} row {i}");
            assert_eq!(&m.row(i)[..], &w[i * rb..(i + 1) * rb], "{dt} row {i}");
        }
        // the map reads the same after its pages were released
        assert_eq!(map.bytes(), &file[..], "{dt}");
        drop((h, m));
        drop(map);
        let _ = std::fs::remove_file(&path);
        // heap bytes: never copied
        let t = huge
            .matrix(dt, n_in, n_out, std::borrow::Cow::Borrowed(&w))
            .unwrap();
        assert!(t.is_borrowed(), "{dt}");
    }
}

/// Resident KiB of this process's mapping that starts at `start`
/// (/proc/self/smaps).
#[cfg(target_os = "linux")]
fn map_rss_kib(start: *const u8) -> usize {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let head = format!("{:x}-", start as usize);
    let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&head));
    assert!(lines.next().is_some(), "no mapping at {head}");
    let rss = lines.find(|l| l.starts_with("Rss:")).unwrap();
    rss.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// The f16 GEMV of the retention gates at every SIMD level this CPU runs
/// equals its scalar reference within the bound of a reordered f32 sum
/// (2 · n_in · ε · Σ|w·x|), and the reference equals an f64 sum as
/// closely, on fresh random data and ragged shapes (rows not a multiple
/// of 4, lengths not a multiple of 8 or 16).
#[test]
fn gemv_f16_matches_its_scalar_reference() {
    use kvrun::backend::cpu::gemv_f16::{gemv_f16_at, gemv_f16_scalar};
    let seed = 41 ^ std::process::id() as u64;
    eprintln!("seed {seed}");
    let mut r = Rng::new(seed);
    let levels = simd_levels();
    for (n_out, n_in) in [
        (1, 1),
        (3, 7),
        (4, 16),
        (5, 17),
        (9, 33),
        (64, 576),
        (3, 64),
        (7, 1000),
    ] {
        let w: Vec<f16> = (0..n_out * n_in)
            .map(|_| f16::from_f32(0.3 * r.normal()))
            .collect();
        let x: Vec<f32> = (0..n_in).map(|_| r.normal()).collect();
        let b: Vec<f32> = (0..n_out).map(|_| r.normal()).collect();
        let mut want = vec![0f32; n_out];
        gemv_f16_scalar(&w, n_in, &x, &b, &mut want);
        for k in 0..n_out {
            let row = &w[k * n_in..(k + 1) * n_in];
            let terms = row.iter().zip(&x).map(|(&a, &c)| a.to_f64() * c as f64);
            let exact = terms.clone().sum::<f64>() + b[k] as f64;
            let mag = terms.map(f64::abs).sum::<f64>() + b[k].abs() as f64;
            let bound = 2.0 * (n_in + 1) as f64 * f32::EPSILON as f64 * mag;
            assert!(
                (want[k] as f64 - exact).abs() <= bound,
                "scalar {n_out}x{n_in} row {k}"
            );
            for &l in &levels {
                let mut have = vec![f32::NAN; n_out];
                gemv_f16_at(l, &w, n_in, &x, &b, &mut have);
                assert!(
                    (have[k] as f64 - want[k] as f64).abs() <= 2.0 * bound,
                    "{l} {n_out}x{n_in} row {k}: {} vs {}",
                    have[k],
                    want[k]
                );
            }
        }
    }
    // the portable level is the scalar loop
    let (w, x, b) = (
        vec![f16::from_f32(0.5); 40],
        vec![1.5f32; 20],
        vec![0.25f32; 2],
    );
    let (mut p, mut s) = (vec![0f32; 2], vec![0f32; 2]);
    gemv_f16_at(Level::Portable, &w, 20, &x, &b, &mut p);
    gemv_f16_scalar(&w, 20, &x, &b, &mut s);
    assert_eq!(p, s);
    assert_eq!(p, vec![15.25; 2]);
}
