//! Parity of the CPU attention kernels: the grouped hot loop
//! (`attend_group`) against the per-head reference (`attend_head`, which uses
//! ggml's f16 dot product) and against a direct two-pass softmax in f64, on
//! fresh random data each run (seed printed).

use half::f16;
use kvrun::backend::cpu::{attend_group, attend_head, attend_prefill_group};
use kvrun::sample::Rng;

fn randn(r: &mut Rng) -> f32 {
    // Box-Muller
    let (u, v) = (r.next_f64().max(1e-12), r.next_f64());
    ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
}

#[test]
fn attend_group_matches_per_head_reference_and_exact_softmax() {
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    eprintln!("seed {seed}");
    let mut r = Rng::new(seed);
    let f16dot = ggml_sys::CpuTraits::of(1).unwrap();
    for &(g, hd, n) in &[(1usize, 64usize, 1usize), (3, 64, 37), (4, 128, 300), (7, 128, 129), (2, 32, 1000)] {
        let q: Vec<f32> = (0..g * hd).map(|_| randn(&mut r) * 2.0).collect();
        let k: Vec<f16> = (0..n * hd).map(|_| f16::from_f32(randn(&mut r) * 2.0)).collect();
        let v: Vec<f16> = (0..n * hd).map(|_| f16::from_f32(randn(&mut r))).collect();
        let key = |j: usize| &k[j * hd..(j + 1) * hd];
        let val = |j: usize| &v[j * hd..(j + 1) * hd];
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = vec![0f32; g * hd];
        let mut sc = vec![0f32; g * n];
        let mut stats = vec![(0f32, 0f32); g];
        attend_group(&q, g, n, key, val, scale, &mut out, Some(&mut sc), &mut stats);
        for h in 0..g {
            let qh = &q[h * hd..(h + 1) * hd];
            // per-head reference
            let mut o_ref = vec![0f32; hd];
            let mut sc_ref = vec![0f32; n];
            let (m, s) = attend_head(&f16dot, qh, n, key, val, scale, &mut o_ref, Some(&mut sc_ref));
            // exact two-pass softmax in f64 on the same f16-rounded query
            let qr: Vec<f64> = qh.iter().map(|&x| f16::from_f32(x).to_f32() as f64).collect();
            let s64: Vec<f64> = (0..n)
                .map(|j| key(j).iter().zip(&qr).map(|(a, b)| a.to_f32() as f64 * b).sum::<f64>() * scale as f64)
                .collect();
            let mx = s64.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s64.iter().map(|x| (x - mx).exp()).sum();
            for d in 0..hd {
                let exact: f64 = (0..n).map(|j| (s64[j] - mx).exp() / z * val(j)[d].to_f32() as f64).sum();
                let got = out[h * hd + d] as f64;
                assert!((got - exact).abs() <= 1e-4 * (1.0 + exact.abs()), "g{g} hd{hd} n{n} head {h} dim {d}: {got} vs exact {exact}");
                assert!((got - o_ref[d] as f64).abs() <= 1e-4 * (1.0 + exact.abs()), "grouped vs per-head reference differ");
            }
            for j in 0..n {
                assert!((sc[h * n + j] as f64 - s64[j]).abs() <= 1e-4 * (1.0 + s64[j].abs()), "score {j}");
                assert!((sc_ref[j] as f64 - s64[j]).abs() <= 1e-4 * (1.0 + s64[j].abs()), "reference score {j}");
            }
            let (gm, gs) = stats[h];
            assert!((gm - m).abs() <= 1e-4 * (1.0 + m.abs()) && (gs - s).abs() <= 1e-3 * s, "softmax stats differ");
        }
    }
}

/// The two-pass prefill kernel (transposed keys) agrees with the online
/// grouped kernel, including the exported scores and softmax statistics.
#[test]
fn attend_prefill_group_matches_online_kernel() {
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 ^ 0x5eed;
    eprintln!("seed {seed}");
    let mut r = Rng::new(seed);
    for &(g, hd, n, stride) in &[(3usize, 64usize, 1usize, 5usize), (3, 64, 200, 260), (7, 128, 97, 97), (4, 32, 513, 600)] {
        let q: Vec<f32> = (0..g * hd).map(|_| randn(&mut r) * 2.0).collect();
        let k: Vec<f16> = (0..n * hd).map(|_| f16::from_f32(randn(&mut r) * 2.0)).collect();
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
        attend_group(&q, g, n, |j| &k[j * hd..(j + 1) * hd], |j| &v[j * hd..(j + 1) * hd], scale, &mut o1, Some(&mut s1), &mut st1);
        attend_prefill_group(&q, g, n, &kt, stride, |j| &vf[j * hd..(j + 1) * hd], scale, &mut s2, &mut o2, &mut st2);
        for i in 0..g * hd {
            assert!((o1[i] - o2[i]).abs() <= 1e-4 * (1.0 + o1[i].abs()), "g{g} hd{hd} n{n}: out {i}: {} vs {}", o1[i], o2[i]);
        }
        for i in 0..g * n {
            assert!((s1[i] - s2[i]).abs() <= 1e-4 * (1.0 + s1[i].abs()), "score {i}");
        }
        for h in 0..g {
            assert!((st1[h].0 - st2[h].0).abs() <= 1e-4 * (1.0 + st1[h].0.abs()));
            assert!((st1[h].1 - st2[h].1).abs() <= 1e-3 * st1[h].1);
        }
    }
}
