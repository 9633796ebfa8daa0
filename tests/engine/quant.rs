//! kvrun's scalar reference kernels (`kvrun::quant`) against ggml itself.
//!
//! Fresh random data every run. Each test prints its seed (visible when it
//! fails, or with `--nocapture`); rerun with `KVRUN_QUANT_SEED=<seed>` to
//! reproduce a failure exactly.
//!
//! * `dequantize_matches_ggml`: our `dequantize_row` is bit-identical to
//!   ggml's `to_float`, on rows quantized by ggml's reference quantizer and on
//!   blocks of random bytes (every bit pattern of scales/high bits).
//! * `activation_quantizers_match_ggml`: our activation quantizers produce the
//!   same bytes as ggml's CPU `from_float` of the partner type, and the
//!   weight/partner pairing is the one ggml's CPU traits declare.
//! * `dot_products_match_ggml`: `dot_q_ref` equals ggml's SIMD `vec_dot` up to
//!   float summation order, and `dot_ref` (f32 activations) is within the
//!   error the activation quantization can introduce.

use ggml_sys::CpuTraits;
use kvrun::quant::*;
use kvrun::tensor::DType;

// ---------------------------------------------------------------------------
// Random numbers (xorshift64*), seeded from the clock or KVRUN_QUANT_SEED
// ---------------------------------------------------------------------------

struct Rng(u64);

impl Rng {
    fn for_test(name: &str) -> Rng {
        let seed = match std::env::var("KVRUN_QUANT_SEED") {
            Ok(s) => s.trim().parse().expect("KVRUN_QUANT_SEED must be a u64"),
            Err(_) => {
                let t = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap();
                t.as_nanos() as u64 ^ (name.len() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            }
        };
        println!("{name}: seed {seed} (reproduce with KVRUN_QUANT_SEED={seed})");
        Rng(seed.max(1))
    }
    fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// Standard normal (Box–Muller).
    fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// A row of `n` values ~ N(0, 1) times a random row scale (1e-2 .. 1e2), with
/// about 1% outliers (×5 .. ×50) and, sometimes, an all-zero 256-block.
fn random_row(rng: &mut Rng, n: usize) -> Vec<f32> {
    let scale = 10f64.powf(rng.uniform() * 4.0 - 2.0);
    let mut x: Vec<f32> = (0..n)
        .map(|_| {
            let mut v = rng.normal();
            if rng.below(100) == 0 {
                v *= 5.0 + 45.0 * rng.uniform();
            }
            (v * scale) as f32
        })
        .collect();
    if n >= 512 && rng.below(3) == 0 {
        let b = rng.below((n / 256) as u64) as usize;
        x[256 * b..256 * b + 256].fill(0.0);
    }
    x
}

/// Byte offsets of the f16 scale fields in one block of `dtype`.
fn f16_fields(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 | DType::IQ4NL | DType::IQ4XS => &[0],
        DType::Q4_1 | DType::Q5_1 | DType::Q4K | DType::Q5K => &[0, 2],
        DType::Q2K => &[80, 82],
        DType::Q3K => &[108],
        DType::Q6K => &[208],
        DType::F16 => &[0],
        DType::F32 | DType::BF16 => &[],
    }
}

/// A row of random bytes: every bit of every field random, except that float
/// fields are kept finite (and, when `moderate`, in 2^-10 .. 2^5 in size, so
/// that dot products stay far from overflow).
fn random_bytes_row(rng: &mut Rng, dtype: DType, n: usize, moderate: bool) -> Vec<u8> {
    let mut b: Vec<u8> = (0..dtype.row_bytes(n))
        .map(|_| rng.next_u64() as u8)
        .collect();
    let bb = dtype.block_bytes();
    for blk in b.chunks_exact_mut(bb) {
        match dtype {
            DType::F32 => {
                let mut u = u32::from_le_bytes(blk[..4].try_into().unwrap());
                if moderate {
                    u = (u & 0x807f_ffff) | ((117 + rng.below(16) as u32) << 23);
                } else if (u >> 23) & 0xff == 0xff {
                    u &= !(1 << 30); // not inf/NaN
                }
                blk.copy_from_slice(&u.to_le_bytes());
            }
            DType::BF16 => {
                let mut u = u16::from_le_bytes([blk[0], blk[1]]);
                if moderate {
                    u = (u & 0x807f) | ((117 + rng.below(16) as u16) << 7);
                } else if (u >> 7) & 0xff == 0xff {
                    u &= !(1 << 14);
                }
                blk.copy_from_slice(&u.to_le_bytes());
            }
            _ => {
                for &off in f16_fields(dtype) {
                    let mut u = u16::from_le_bytes([blk[off], blk[off + 1]]);
                    if moderate {
                        u = (u & 0x83ff) | ((5 + rng.below(16) as u16) << 10);
                    } else if (u >> 10) & 0x1f == 0x1f {
                        u &= !(1 << 14);
                    }
                    blk[off..off + 2].copy_from_slice(&u.to_le_bytes());
                }
            }
        }
    }
    b
}

/// Weight bytes for `x`: ggml's reference quantizer for the block types, a
/// direct encoding for the float types (checked against ggml's for F16/BF16).
fn encode_weights(dtype: DType, x: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 | DType::BF16 => {
            let mut out = vec![0u8; dtype.row_bytes(x.len())];
            quantize_act_row(ActType::for_weight(dtype), x, &mut out);
            assert_eq!(
                out,
                ggml_sys::quantize_ref(dtype.ggml_id(), x),
                "{dtype}: our f32 -> {dtype} encoding differs from ggml's"
            );
            out
        }
        _ => ggml_sys::quantize_ref(dtype.ggml_id(), x),
    }
}

/// ggml's `to_float` for `dtype`. (ggml has none for F32, whose rows are
/// used as they are: the oracle is then the bytes themselves.)
fn ggml_dequant(dtype: DType, src: &[u8], n: usize) -> Vec<f32> {
    if dtype == DType::F32 {
        assert_eq!(src.len(), 4 * n);
        return src
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
    }
    let mut y = vec![0f32; n];
    ggml_sys::dequantize(dtype.ggml_id(), src, &mut y);
    y
}

// ---------------------------------------------------------------------------
// 1. Dequantization, bit for bit
// ---------------------------------------------------------------------------

fn assert_bits_eq(what: &str, ours: &[f32], theirs: &[f32]) {
    assert_eq!(ours.len(), theirs.len());
    for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
        assert!(
            a.to_bits() == b.to_bits(),
            "{what}: element {i}: ours {a:e} ({:#010x}) vs ggml {b:e} ({:#010x})",
            a.to_bits(),
            b.to_bits()
        );
    }
}

#[test]
fn dequantize_matches_ggml() {
    let mut rng = Rng::for_test("dequantize_matches_ggml");
    // Geometry first: our block tables agree with ggml's.
    for dt in DType::ALL {
        assert_eq!(
            ggml_sys::block_geometry(dt.ggml_id()),
            (dt.block_len(), dt.block_bytes()),
            "{dt}: block geometry"
        );
    }
    for a in [
        ActType::F32,
        ActType::F16,
        ActType::BF16,
        ActType::Q8_0,
        ActType::Q8_1,
        ActType::Q8K,
    ] {
        assert_eq!(
            ggml_sys::block_geometry(a.ggml_id()),
            (a.block_len(), a.block_bytes()),
            "{a:?}: block geometry"
        );
    }

    let mut checked = 0usize;
    for dt in DType::ALL {
        // Rows quantized by ggml's reference quantizer.
        for &n in &[512usize, 512, 4096, 4096, 256 * (1 + rng.below(8) as usize)] {
            let x = random_row(&mut rng, n);
            let q = encode_weights(dt, &x);
            let mut ours = vec![0f32; n];
            dequantize_row(dt, &q, &mut ours);
            assert_bits_eq(
                &format!("{dt} quantized row n={n}"),
                &ours,
                &ggml_dequant(dt, &q, n),
            );
            checked += n;
        }
        // Random bytes: exercises every scale bit, high bit and sign.
        for &n in &[512usize, 4096] {
            let q = random_bytes_row(&mut rng, dt, n, false);
            let mut ours = vec![0f32; n];
            dequantize_row(dt, &q, &mut ours);
            assert_bits_eq(
                &format!("{dt} random bytes n={n}"),
                &ours,
                &ggml_dequant(dt, &q, n),
            );
            checked += n;
        }
    }
    println!("dequantize: {checked} elements bit-identical");
}

/// `affine_row` rebuilds `dequantize_row` (itself ggml's `to_float` bit
/// for bit) for every quantized type: each element `fma(q, a, b)` equals
/// it, on rows from ggml's quantizer and on random bytes (every scale bit,
/// sign and high bit). CriticalKV keeps W_O in this form.
#[test]
fn affine_form_rebuilds_the_dequantized_row() {
    let mut rng = Rng::for_test("affine_form_rebuilds_the_dequantized_row");
    let mut checked = 0usize;
    for dt in DType::ALL {
        let Some(g) = affine_group(dt) else {
            assert!(
                matches!(dt, DType::F32 | DType::F16 | DType::BF16),
                "{dt} has no affine form"
            );
            continue;
        };
        assert!(dt.block_len().is_multiple_of(g), "{dt}: group {g}");
        for (k, &n) in [512usize, 4096, 512, 4096].iter().enumerate() {
            let bytes = match k {
                0 | 1 => encode_weights(dt, &random_row(&mut rng, n)),
                _ => random_bytes_row(&mut rng, dt, n, false),
            };
            let mut want = vec![0f32; n];
            dequantize_row(dt, &bytes, &mut want);
            let mut q = vec![0i8; n];
            let (mut a, mut b) = (vec![0f32; n / g], vec![0f32; n / g]);
            affine_row(dt, &bytes, &mut q, &mut a, &mut b);
            for i in 0..n {
                let got = (q[i] as f32).mul_add(a[i / g], b[i / g]);
                assert!(
                    got == want[i],
                    "{dt} row {k} element {i}: fma({}, {:e}, {:e}) = {got:e}, dequantized {:e}",
                    q[i],
                    a[i / g],
                    b[i / g],
                    want[i]
                );
            }
            checked += n;
        }
    }
    println!("affine form: {checked} elements rebuilt exactly");
}

// ---------------------------------------------------------------------------
// 2. Activation quantizers, byte for byte
// ---------------------------------------------------------------------------

/// Rows whose scaled values land exactly on rounding ties, where round-half-
/// even (ggml's SIMD and `nearest_int`) and round-half-away (`roundf`) differ.
fn tie_row(rng: &mut Rng, act: ActType, n: usize) -> Vec<f32> {
    match act {
        // amax = 127 gives a multiplier of exactly 1, so k + 0.5 is a tie.
        ActType::Q8_0 | ActType::Q8_1 | ActType::Q8K => (0..n)
            .map(|i| {
                if i % act.block_len() == 0 {
                    -127.0 // the first element of largest magnitude (Q8_K: max = -127)
                } else {
                    (rng.below(252) as f32 - 126.0) + 0.5
                }
            })
            .collect(),
        // Midpoints between neighbouring f16 / bf16 values.
        ActType::F16 | ActType::BF16 => {
            let frac_bits = if act == ActType::F16 { 10 } else { 7 };
            (0..n)
                .map(|_| {
                    let m = rng.below(1 << frac_bits) as f32;
                    let v = (1.0 + (m + 0.5) / (1u32 << frac_bits) as f32)
                        * 2f32.powi(rng.below(10) as i32 - 5);
                    if rng.below(2) == 0 {
                        v
                    } else {
                        -v
                    }
                })
                .collect()
        }
        ActType::F32 => random_row(rng, n),
    }
}

#[test]
fn activation_quantizers_match_ggml() {
    let mut rng = Rng::for_test("activation_quantizers_match_ggml");

    // The pairing: ActType::for_weight is ggml's vec_dot_type on this CPU.
    for dt in DType::ALL {
        let t = CpuTraits::of(dt.ggml_id()).unwrap_or_else(|| panic!("{dt}: no ggml CPU traits"));
        assert_eq!(
            t.vec_dot_type,
            ActType::for_weight(dt).ggml_id(),
            "{dt}: activation partner differs from ggml's vec_dot_type"
        );
    }

    // One representative weight type per partner format, to reach ggml's
    // from_float of that partner.
    let partners = [
        (DType::F32, ActType::F32),
        (DType::F16, ActType::F16),
        (DType::BF16, ActType::BF16),
        (DType::Q4_0, ActType::Q8_0),
        (DType::Q4_1, ActType::Q8_1),
        (DType::Q4K, ActType::Q8K),
    ];
    for (dt, act) in partners {
        let traits = CpuTraits::of(dt.ggml_id()).unwrap();
        let mut rows: Vec<Vec<f32>> = Vec::new();
        for &n in &[512usize, 512, 4096, 4096, 256 * (1 + rng.below(8) as usize)] {
            rows.push(random_row(&mut rng, n));
        }
        rows.push(tie_row(&mut rng, act, 512));
        rows.push(vec![0.0; 512]);
        for (r, x) in rows.iter().enumerate() {
            let n = x.len();
            // Zero-filled: ggml leaves Q8_K bsums unwritten for an all-zero block.
            let mut theirs = vec![0u8; traits.act_bytes(n)];
            traits.quantize_act(x, &mut theirs);
            let mut ours = vec![0u8; act.row_bytes(n)];
            match act {
                ActType::Q8_0 => quantize_row_q8_0(x, &mut ours),
                ActType::Q8_1 => quantize_row_q8_1(x, &mut ours),
                ActType::Q8K => quantize_row_q8_k(x, &mut ours),
                _ => quantize_act_row(act, x, &mut ours),
            }
            if let Some(i) = ours.iter().zip(&theirs).position(|(a, b)| a != b) {
                let bb = act.block_bytes();
                panic!(
                    "{act:?} row {r} (n={n}): first differing byte {i} (block {}, offset {}): \
                     ours {:#04x}, ggml {:#04x}",
                    i / bb,
                    i % bb,
                    ours[i],
                    theirs[i]
                );
            }
        }

        // ggml's portable reference quantizers (used for model files, and by
        // ggml's scalar fallback) may round differently; show by how much.
        // (Q8_K has no separate reference: on x86 its CPU quantizer *is* the
        // reference routine, compared byte for byte above.)
        if matches!(act, ActType::Q8_0 | ActType::Q8_1) {
            let n_random = rows.len() - 2;
            let (mut diffs, mut total) = ([0usize; 2], [0usize; 2]);
            for (r, x) in rows.iter().enumerate() {
                let mut ours = vec![0u8; act.row_bytes(x.len())];
                quantize_act_row(act, x, &mut ours);
                let reference = ggml_sys::quantize_ref(act.ggml_id(), x);
                let (d, t) = compare_with_reference_quantizer(act, &ours, &reference);
                let k = (r == n_random) as usize; // 1 = the tie row
                diffs[k] += d;
                total[k] += t;
            }
            println!(
                "{act:?} vs ggml's *_ref quantizer (same scales; quants differ by exactly 1): \
                 random rows {} of {} quants, tie row {} of {}",
                diffs[0], total[0], diffs[1], total[1]
            );
        }
    }
}

/// Compare our (x86-SIMD-equivalent) activation bytes with ggml's reference
/// quantizer: the scale `d` must be identical and every quant within ±1.
/// Returns (differing quants, quants).
fn compare_with_reference_quantizer(act: ActType, ours: &[u8], reference: &[u8]) -> (usize, usize) {
    let (bb, bl) = (act.block_bytes(), act.block_len());
    let (d_len, q_off) = match act {
        ActType::Q8_0 => (2, 2),
        ActType::Q8_1 => (2, 4),
        ActType::Q8K => (4, 4),
        _ => unreachable!(),
    };
    let mut diffs = 0;
    for (b, (o, r)) in ours
        .chunks_exact(bb)
        .zip(reference.chunks_exact(bb))
        .enumerate()
    {
        assert_eq!(
            o[..d_len],
            r[..d_len],
            "{act:?} block {b}: scale differs from ggml's reference"
        );
        for j in 0..bl {
            let (qo, qr) = (o[q_off + j] as i8 as i32, r[q_off + j] as i8 as i32);
            assert!(
                (qo - qr).abs() <= 1,
                "{act:?} block {b} quant {j}: ours {qo}, reference {qr}"
            );
            diffs += (qo != qr) as usize;
        }
    }
    (diffs, ours.len() / bb * bl)
}

// ---------------------------------------------------------------------------
// 3. Dot products
// ---------------------------------------------------------------------------

/// The activation values a quantized dot product actually multiplies by
/// (`q · d` for the 8-bit formats); for Q8_1 also the per-block stored `s`
/// and the per-block sum of the quants.
struct ActView {
    values: Vec<f64>,
    block_s: Vec<f64>,
    block_qsum: Vec<f64>,
}

fn act_view(act: ActType, bytes: &[u8], n: usize) -> ActView {
    let f16 = |b: &[u8], o: usize| f16_to_f32(u16::from_le_bytes([b[o], b[o + 1]])) as f64;
    let mut values = Vec::with_capacity(n);
    let mut block_s = Vec::new();
    let mut block_qsum = Vec::new();
    match act {
        ActType::F32 => values.extend(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64),
        ),
        ActType::F16 => values.extend(bytes.chunks_exact(2).map(|b| f16(b, 0))),
        ActType::BF16 => values.extend(
            bytes
                .chunks_exact(2)
                .map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])) as f64),
        ),
        ActType::Q8_0 => {
            for b in bytes.chunks_exact(34) {
                values.extend(b[2..34].iter().map(|&q| q as i8 as f64 * f16(b, 0)));
            }
        }
        ActType::Q8_1 => {
            for b in bytes.chunks_exact(36) {
                values.extend(b[4..36].iter().map(|&q| q as i8 as f64 * f16(b, 0)));
                block_s.push(f16(b, 2));
                block_qsum.push(b[4..36].iter().map(|&q| q as i8 as f64).sum());
            }
        }
        ActType::Q8K => {
            for b in bytes.chunks_exact(292) {
                let d = f32::from_le_bytes(b[0..4].try_into().unwrap()) as f64;
                values.extend(b[4..260].iter().map(|&q| q as i8 as f64 * d));
            }
        }
    }
    assert_eq!(values.len(), n);
    ActView {
        values,
        block_s,
        block_qsum,
    }
}

/// Split dequantized weights into the part proportional to the block scale
/// and the additive part (mins / offsets), using ggml's own dequantizer on
/// copies of the blocks with `dmin`/`m` (resp. `d`) zeroed. For types without
/// an additive part the second vector is all zeros.
fn weight_parts(dt: DType, w: &[u8], n: usize) -> (Vec<f64>, Vec<f64>) {
    let has_min = matches!(
        dt,
        DType::Q4_1 | DType::Q5_1 | DType::Q2K | DType::Q4K | DType::Q5K
    );
    if !has_min {
        let y = ggml_dequant(dt, w, n);
        return (y.iter().map(|&v| v as f64).collect(), vec![0.0; n]);
    }
    let bb = dt.block_bytes();
    let mut scale_only = w.to_vec();
    let mut min_only = w.to_vec();
    for (s, m) in scale_only
        .chunks_exact_mut(bb)
        .zip(min_only.chunks_exact_mut(bb))
    {
        // d, then m / dmin (Q2_K keeps them at the end of its block)
        let d = if dt == DType::Q2K { 80 } else { 0 };
        s[d + 2..d + 4].fill(0);
        m[d..d + 2].fill(0);
    }
    let s = ggml_dequant(dt, &scale_only, n);
    let m = ggml_dequant(dt, &min_only, n);
    (
        s.iter().map(|&v| v as f64).collect(),
        m.iter().map(|&v| v as f64).collect(),
    )
}

/// Tolerances for one (weights, activations) pair; see `dot_products_match_ggml`.
struct Bounds {
    /// |dot_q_ref − ggml| allowed: float rounding only.
    q_tol: f64,
    /// |dot_ref − ggml| allowed, worst case over all roundings.
    hard: f64,
    /// |dot_ref − ggml| allowed with the rounding errors modelled as
    /// independent and zero-mean (Hoeffding, failure probability 1e-9).
    stat: f64,
}

/// Relative float tolerance for two different summation orders of the same
/// terms (ggml: f32 lanes, ≤ n/32 + ~10 additions deep on the longest chain
/// for n ≤ 4096 here; ours: f64): ~ 160 · 2^-24 ≈ 1e-5.
const REL_FP: f64 = 1e-5;

fn bounds(dt: DType, act: ActType, w: &[u8], a: &[u8], x: &[f32]) -> Bounds {
    let n = x.len();
    let (ws, wm) = weight_parts(dt, w, n);
    let av = act_view(act, a, n);
    let w_abs: Vec<f64> = ws.iter().zip(&wm).map(|(s, m)| s.abs() + m.abs()).collect();

    // Q4_1/Q5_1 × Q8_1 use m·s per block, s = f16(d·Σq): add |m·s| to the
    // magnitude of the terms summed.
    let mut ms_mag = 0.0;
    if act == ActType::Q8_1 {
        for (b, s) in av.block_s.iter().enumerate() {
            ms_mag += wm[32 * b].abs() * s.abs();
        }
    }

    // (a) dot_q_ref vs ggml: same terms, different summation order.
    let mag_q: f64 = w_abs
        .iter()
        .zip(&av.values)
        .map(|(w, a)| w * a.abs())
        .sum::<f64>()
        + ms_mag;
    let q_tol = REL_FP * mag_q + 1e-30;

    // (b) dot_ref (exact f32 activations) vs ggml (quantized activations).
    // Per element, the activation error |x − â| is at most `err[i]`, and the
    // rounding error lies in an interval of width `width[i]`:
    // * Q8_0/Q8_1: q = round(x·127/amax), â = q·f16(amax/127):
    //   |x − â| ≤ d/2 + |q|·|d − f16(d)| ≤ d·(0.5 + 127·(2^-11 + 2^-22)) (+127·2^-25
    //   when f16(d) is subnormal); width d.
    // * Q8_K: the same with an f32 scale: d·(0.5 + 127·2^-21); width d.
    // * F16 / BF16: half an ulp: |x|·2^-11 (+2^-25) / |x|·2^-8; width 2× that.
    // * F32: exact.
    let mut err = vec![0f64; n];
    let mut width = vec![0f64; n];
    match act {
        ActType::F32 => {}
        ActType::F16 | ActType::BF16 => {
            let (rel, abs) = if act == ActType::F16 {
                (2f64.powi(-11), 2f64.powi(-25))
            } else {
                (2f64.powi(-8), 2f64.powi(-134))
            };
            for i in 0..n {
                err[i] = x[i].abs() as f64 * rel + abs;
                width[i] = 2.0 * err[i];
            }
        }
        ActType::Q8_0 | ActType::Q8_1 | ActType::Q8K => {
            let bl = act.block_len();
            for b in 0..n / bl {
                let blk = &x[b * bl..(b + 1) * bl];
                let amax = blk.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
                let d = amax / 127.0;
                let e = if act == ActType::Q8K {
                    d * (0.5 + 127.0 * 2f64.powi(-21))
                } else {
                    d * (0.5 + 127.0 * (2f64.powi(-11) + 2f64.powi(-22))) + 127.0 * 2f64.powi(-25)
                };
                err[b * bl..(b + 1) * bl].fill(e);
                width[b * bl..(b + 1) * bl].fill(d);
            }
        }
    }
    // Systematic part of the Q8_0/Q8_1 error: the f16 rounding of the block
    // scale multiplies the whole block's partial dot by (1 + δ), |δ| ≤ 2^-11.
    let mut systematic = 0.0;
    if matches!(act, ActType::Q8_0 | ActType::Q8_1) {
        for b in 0..n / 32 {
            let part: f64 = (32 * b..32 * b + 32)
                .map(|i| (ws[i] + wm[i]) * av.values[i])
                .sum();
            systematic += part.abs() * (2f64.powi(-11) + 2f64.powi(-22));
        }
    }
    // Q8_1's s = f16(d·Σq) (f32 d) stands for Σ â: |s − f16(d)·Σq| ≤ 2^-10·d·|Σq| (+ rounding).
    let mut s_err = 0.0;
    if act == ActType::Q8_1 {
        for (b, qsum) in av.block_qsum.iter().enumerate() {
            let amax = x[32 * b..32 * b + 32]
                .iter()
                .fold(0f64, |m, v| m.max(v.abs() as f64));
            s_err += wm[32 * b].abs() * (amax / 127.0) * qsum.abs() * 2f64.powi(-9) + 1e-30;
        }
    }
    let mag_x: f64 = (0..n)
        .map(|i| w_abs[i] * (x[i].abs() as f64 + err[i]))
        .sum::<f64>()
        + ms_mag;
    let fp = REL_FP * mag_x + 1e-30;

    let wq: Vec<f64> = (0..n).map(|i| (ws[i] + wm[i]).abs()).collect();
    let hard = (0..n).map(|i| wq[i] * err[i]).sum::<f64>() + s_err + fp;
    // Hoeffding: P(|Σ c_i ε_i| ≥ t) ≤ 2·exp(−2t² / Σ (c_i·width_i)²).
    let sum_sq: f64 = (0..n).map(|i| (wq[i] * width[i]).powi(2)).sum();
    let ln_2_over_delta = (2.0f64 / 1e-9).ln();
    let stat = (ln_2_over_delta / 2.0 * sum_sq).sqrt() + systematic + s_err + fp;
    Bounds { q_tol, hard, stat }
}

#[test]
fn dot_products_match_ggml() {
    let mut rng = Rng::for_test("dot_products_match_ggml");
    for dt in DType::ALL {
        let traits = CpuTraits::of(dt.ggml_id()).unwrap();
        let act = ActType::for_weight(dt);
        let (mut worst_q, mut worst_stat, mut worst_hard, mut worst_norm) =
            (0f64, 0f64, 0f64, 0f64);
        let rows = 24;
        for k in 0..rows {
            let n = match k % 3 {
                0 => 512,
                1 => 4096,
                _ => 256 * (1 + rng.below(16) as usize),
            };
            // One row in six: weights of random bytes (all bit patterns).
            let w = if k % 6 == 5 {
                random_bytes_row(&mut rng, dt, n, true)
            } else {
                encode_weights(dt, &random_row(&mut rng, n))
            };
            let x = random_row(&mut rng, n);
            let mut a = vec![0u8; traits.act_bytes(n)];
            traits.quantize_act(&x, &mut a);
            assert_eq!(a.len(), act.row_bytes(n));

            let g = traits.dot(n, &w, &a) as f64;
            let q = dot_q_ref(dt, n, &w, &a) as f64;
            let r = dot_ref(dt, n, &w, &x) as f64;
            assert!(
                g.is_finite() && q.is_finite() && r.is_finite(),
                "{dt} n={n}: non-finite dot"
            );
            let b = bounds(dt, act, &w, &a, &x);

            let eq = (q - g).abs();
            assert!(
                eq <= b.q_tol,
                "{dt} row {k} n={n}: dot_q_ref {q:e} vs ggml {g:e}: |diff| {eq:e} > {:e}",
                b.q_tol
            );
            let er = (r - g).abs();
            assert!(
                er <= b.hard,
                "{dt} row {k} n={n}: dot_ref {r:e} vs ggml {g:e}: |diff| {er:e} > worst-case bound {:e}",
                b.hard
            );
            assert!(
                er <= b.stat,
                "{dt} row {k} n={n}: dot_ref {r:e} vs ggml {g:e}: |diff| {er:e} > statistical bound {:e}",
                b.stat
            );
            worst_q = worst_q.max(eq / b.q_tol);
            worst_stat = worst_stat.max(er / b.stat);
            worst_hard = worst_hard.max(er / b.hard);
            // The error relative to the typical size of a dot of this length.
            let wd = ggml_dequant(dt, &w, n);
            let rms = |v: &mut dyn Iterator<Item = f64>| {
                (v.map(|t| t * t).sum::<f64>() / n as f64).sqrt()
            };
            let typical = (n as f64).sqrt()
                * rms(&mut wd.iter().map(|&t| t as f64))
                * rms(&mut x.iter().map(|&t| t as f64));
            worst_norm = worst_norm.max(er / typical.max(1e-30));
        }
        println!(
            "{dt:>5} × {act:?} ({rows} rows): |dot_q_ref−ggml| ≤ {worst_q:.3}·tol; \
             |dot_ref−ggml| ≤ {worst_stat:.3}·stat bound, {worst_hard:.3}·hard bound, \
             {worst_norm:.1e}·√n·rms(w)·rms(x)"
        );
    }
}
