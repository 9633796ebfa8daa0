//! Exact-vector tests of the KV slot map (`KvCells`) and of the cache's single
//! mutation point (`KvCache::apply`), in the style of candle's rotating KV
//! cache tests: every step spells out the expected head, slots, positions and
//! live order.

use kvrun::kv::cells::KvCells;
use kvrun::kv::streams::Region;
use kvrun::kv::{KvCache, KvType};
use kvrun::sample::Rng;

/// (slot, pos) pairs of `live()`.
fn live(c: &KvCells) -> Vec<(usize, i64)> {
    c.live().collect()
}

/// Every slot's position (None when free).
fn all_pos(c: &KvCells) -> Vec<Option<i64>> {
    (0..c.n_slots()).map(|s| c.pos(s)).collect()
}

#[test]
fn new_is_empty() {
    let c = KvCells::new(4);
    assert_eq!(c.n_slots(), 4);
    assert_eq!(c.n_live(), 0);
    assert_eq!(c.head(), 0);
    assert_eq!(c.find_free(), Some(0));
    assert_eq!(all_pos(&c), vec![None; 4]);
    assert!(live(&c).is_empty());
}

#[test]
fn fill_in_ring_order_and_wrap_head() {
    let mut c = KvCells::new(4);
    let mut heads = Vec::new();
    let mut slots = Vec::new();
    for p in 10..14 {
        let s = c.find_free().unwrap();
        c.set(s, p);
        slots.push(s);
        heads.push(c.head());
    }
    assert_eq!(slots, vec![0, 1, 2, 3]);
    // the head moves past each set slot and wraps to 0 after the last one
    assert_eq!(heads, vec![1, 2, 3, 0]);
    assert_eq!(c.n_live(), 4);
    assert_eq!(c.find_free(), None, "full cache has no free slot");
    assert_eq!(live(&c), vec![(0, 10), (1, 11), (2, 12), (3, 13)]);
    assert_eq!(all_pos(&c), vec![Some(10), Some(11), Some(12), Some(13)]);
}

#[test]
fn holes_after_frees_are_reused_from_the_head() {
    let mut c = KvCells::new(5);
    for p in 0..5 {
        let s = c.find_free().unwrap();
        c.set(s, p);
    }
    assert_eq!(c.head(), 0);
    c.free(3);
    c.free(1);
    assert_eq!(c.n_live(), 3);
    // freeing does not move the head
    assert_eq!(c.head(), 0);
    assert_eq!(all_pos(&c), vec![Some(0), None, Some(2), None, Some(4)]);
    assert_eq!(live(&c), vec![(0, 0), (2, 2), (4, 4)]);
    // search from head 0: slot 1 first, then (head 2) slot 3
    assert_eq!(c.find_free(), Some(1));
    c.set(1, 100);
    assert_eq!(c.head(), 2);
    assert_eq!(c.find_free(), Some(3));
    c.set(3, 101);
    assert_eq!(c.head(), 4);
    assert_eq!(c.find_free(), None);
    // live() is in slot order, not position order
    assert_eq!(live(&c), vec![(0, 0), (1, 100), (2, 2), (3, 101), (4, 4)]);
}

#[test]
fn search_starts_at_head_and_wraps() {
    let mut c = KvCells::new(6);
    for p in 0..4 {
        let s = c.find_free().unwrap();
        c.set(s, p);
    }
    assert_eq!(c.head(), 4);
    c.free(0);
    c.free(1);
    // slots 0 and 1 are free, but the head (4) comes first
    let mut order = Vec::new();
    let mut heads = Vec::new();
    for p in 4..8 {
        let s = c.find_free().unwrap();
        c.set(s, p);
        order.push(s);
        heads.push(c.head());
    }
    assert_eq!(order, vec![4, 5, 0, 1]);
    assert_eq!(heads, vec![5, 0, 1, 2]);
    assert_eq!(c.find_free(), None);
    assert_eq!(
        live(&c),
        vec![(0, 6), (1, 7), (2, 2), (3, 3), (4, 4), (5, 5)]
    );
    // free one in front of the head and one behind: the one at/after the head wins
    c.free(1);
    c.free(3);
    assert_eq!(c.head(), 2);
    assert_eq!(c.find_free(), Some(3));
    c.set(3, 8);
    assert_eq!(c.head(), 4);
    assert_eq!(c.find_free(), Some(1), "search wraps past the end");
    c.set(1, 9);
    assert_eq!(c.head(), 2);
    assert_eq!(
        live(&c),
        vec![(0, 6), (1, 9), (2, 2), (3, 8), (4, 4), (5, 5)]
    );
}

#[test]
fn set_out_of_ring_order_moves_head_past_that_slot() {
    let mut c = KvCells::new(4);
    c.set(2, 5);
    assert_eq!(c.head(), 3);
    assert_eq!(c.find_free(), Some(3));
    c.set(3, 6);
    assert_eq!(c.head(), 0);
    assert_eq!(c.find_free(), Some(0));
    assert_eq!(c.pos(2), Some(5));
    assert_eq!(c.pos(0), None);
}

#[test]
fn single_slot() {
    let mut c = KvCells::new(1);
    assert_eq!(c.find_free(), Some(0));
    c.set(0, 0);
    assert_eq!(c.head(), 0);
    assert_eq!(c.find_free(), None);
    c.free(0);
    assert_eq!(c.find_free(), Some(0));
    c.set(0, 1);
    assert_eq!(live(&c), vec![(0, 1)]);
}

#[test]
fn clear_resets_head_and_slots() {
    let mut c = KvCells::new(3);
    c.set(0, 0);
    c.set(1, 1);
    assert_eq!(c.head(), 2);
    c.clear();
    assert_eq!(c.head(), 0);
    assert_eq!(c.n_live(), 0);
    assert_eq!(all_pos(&c), vec![None; 3]);
    assert_eq!(c.find_free(), Some(0));
    assert!(live(&c).is_empty());
    // usable again from slot 0
    c.set(c.find_free().unwrap(), 42);
    assert_eq!(live(&c), vec![(0, 42)]);
}

#[test]
fn position_zero_is_a_valid_position() {
    let mut c = KvCells::new(2);
    c.set(1, 0);
    assert_eq!(c.pos(1), Some(0));
    assert_eq!(c.n_live(), 1);
    assert_eq!(live(&c), vec![(1, 0)]);
}

#[test]
#[should_panic(expected = "already free")]
fn double_free_panics() {
    let mut c = KvCells::new(2);
    c.set(0, 0);
    c.free(0);
    c.free(0);
}

#[test]
#[should_panic(expected = "already free")]
fn free_of_never_used_slot_panics() {
    let mut c = KvCells::new(2);
    c.free(1);
}

#[test]
#[should_panic(expected = "already holds position 3")]
fn double_set_panics() {
    let mut c = KvCells::new(2);
    c.set(0, 3);
    c.set(0, 4);
}

#[test]
#[should_panic(expected = "negative position")]
fn negative_position_panics() {
    let mut c = KvCells::new(2);
    c.set(0, -1);
}

// ---------------------------------------------------------------- KvCache

fn cache(n_slots: usize) -> KvCache {
    KvCache::new(2, 4, 2, n_slots)
}

fn live_of(kv: &KvCache) -> (Vec<u32>, Vec<i64>) {
    let (s, p) = kv.live();
    (s.to_vec(), p.to_vec())
}

#[test]
fn apply_exact_sequence() {
    let mut kv = cache(4);
    let mut slots = Vec::new();
    assert_eq!(live_of(&kv), (vec![], vec![]));
    assert_eq!(kv.peak_live, 0);

    // prefill 3 tokens
    kv.apply(&[], &[0, 1, 2], &mut slots).unwrap();
    assert_eq!(slots, vec![0, 1, 2]);
    assert_eq!(live_of(&kv), (vec![0, 1, 2], vec![0, 1, 2]));
    assert_eq!(kv.cells.head(), 3);
    assert_eq!(kv.peak_live, 3);

    // evict slot 1 (pos 1) and add 2 tokens: slot 3 from the head, then slot 1 (wrap)
    kv.apply(&[1], &[3, 4], &mut slots).unwrap();
    assert_eq!(slots, vec![3, 1]);
    assert_eq!(
        live_of(&kv),
        (vec![0, 2, 3, 1], vec![0, 2, 3, 4]),
        "live() is sorted by position"
    );
    assert_eq!(kv.cells.head(), 2);
    assert_eq!(kv.peak_live, 4);

    // evict slots 0 and 2 (pos 0 and 2), add one: search from head 2 takes slot 2
    kv.apply(&[0, 2], &[5], &mut slots).unwrap();
    assert_eq!(slots, vec![2]);
    assert_eq!(live_of(&kv), (vec![3, 1, 2], vec![3, 4, 5]));
    assert_eq!(kv.cells.head(), 3);
    assert_eq!(kv.peak_live, 4, "peak stays at its maximum");

    // one more fits (slot 0, after skipping occupied slot 3)
    kv.apply(&[], &[6], &mut slots).unwrap();
    assert_eq!(slots, vec![0]);
    assert_eq!(live_of(&kv), (vec![3, 1, 2, 0], vec![3, 4, 5, 6]));
    assert_eq!(kv.cells.head(), 1);
    assert_eq!(kv.cells.n_live(), 4);

    // evict and refill in the same call: victims are freed before the search
    kv.apply(&[1, 3], &[7, 8], &mut slots).unwrap();
    assert_eq!(slots, vec![1, 3]);
    assert_eq!(live_of(&kv), (vec![2, 0, 1, 3], vec![5, 6, 7, 8]));
    assert_eq!(kv.peak_live, 4);
}

#[test]
fn apply_error_when_full() {
    let mut kv = cache(3);
    let mut slots = Vec::new();
    kv.apply(&[], &[0, 1, 2], &mut slots).unwrap();
    let e = kv.apply(&[], &[3], &mut slots).unwrap_err().to_string();
    assert!(e.contains("KV cache full"), "{e}");
    assert!(e.contains("3 slots hold 3 tokens"), "{e}");
    assert_eq!(kv.cells.n_live(), 3);
    assert_eq!(live_of(&kv), (vec![0, 1, 2], vec![0, 1, 2]));
}

#[test]
fn apply_victims_make_room_for_a_full_cache() {
    let mut kv = cache(3);
    let mut slots = Vec::new();
    kv.apply(&[], &[0, 1, 2], &mut slots).unwrap();
    kv.apply(&[0], &[3], &mut slots).unwrap();
    assert_eq!(slots, vec![0]);
    assert_eq!(live_of(&kv), (vec![1, 2, 0], vec![1, 2, 3]));
    assert_eq!(kv.peak_live, 3);
}

#[test]
#[should_panic(expected = "already free")]
fn apply_with_duplicate_victim_panics() {
    let mut kv = cache(3);
    let mut slots = Vec::new();
    kv.apply(&[], &[0, 1], &mut slots).unwrap();
    let _ = kv.apply(&[0, 0], &[2], &mut slots);
}

#[test]
fn clear_resets_cache() {
    let mut kv = cache(4);
    let mut slots = Vec::new();
    kv.apply(&[], &[0, 1, 2], &mut slots).unwrap();
    kv.apply(&[0], &[3], &mut slots).unwrap();
    kv.clear();
    assert_eq!(kv.cells.head(), 0);
    assert_eq!(kv.cells.n_live(), 0);
    assert_eq!(kv.peak_live, 0);
    assert_eq!(live_of(&kv), (vec![], vec![]));
    kv.apply(&[], &[0, 1], &mut slots).unwrap();
    assert_eq!(slots, vec![0, 1]);
    assert_eq!(live_of(&kv), (vec![0, 1], vec![0, 1]));
    assert_eq!(kv.peak_live, 2);
}

#[test]
fn write_and_read_rows_exactly() {
    // 2 layers, kv_dim 4, 3 slots; values exactly representable in f16
    let mut kv = KvCache::new(2, 4, 2, 3);
    assert_eq!(kv.bytes_per_token(), 2 * 2 * 4 * 2);
    for l in 0..2 {
        for s in 0..3 {
            let base = (l * 10 + s) as f32;
            let k = [base, base + 0.5, -base, 0.25];
            let v = [-base, 1024.0, base * 2.0, -0.125];
            kv.write(l, s, &k, &v);
        }
    }
    for l in 0..2 {
        for s in 0..3 {
            let base = (l * 10 + s) as f32;
            let k = row(&kv, true, l, s);
            let v = row(&kv, false, l, s);
            assert_eq!(k, vec![base, base + 0.5, -base, 0.25], "k l{l} s{s}");
            assert_eq!(v, vec![-base, 1024.0, base * 2.0, -0.125], "v l{l} s{s}");
        }
    }
    // overwrite one row; neighbours are untouched
    kv.write(1, 1, &[7.0; 4], &[8.0; 4]);
    assert!(row(&kv, true, 1, 1).iter().all(|&x| x == 7.0));
    assert!(row(&kv, false, 1, 1).iter().all(|&x| x == 8.0));
    assert_eq!(row(&kv, true, 1, 0)[0], 10.0);
    assert_eq!(row(&kv, true, 1, 2)[0], 12.0);
    assert_eq!(row(&kv, true, 0, 1)[0], 1.0);
}

/// Random apply sequences against a brute-force model of the ring map.
#[test]
fn apply_matches_reference_model() {
    let mut rng = Rng::new(1234);
    let mut r = |n: usize| (rng.next_u64() % n as u64) as usize;
    for case in 0..200 {
        let n_slots = 1 + r(16);
        let mut kv = cache(n_slots);
        // reference: slot -> pos, ring head, peak
        let mut m: Vec<Option<i64>> = vec![None; n_slots];
        let mut head = 0usize;
        let mut peak = 0usize;
        let mut next_pos = 0i64;
        let mut slots = Vec::new();
        for _step in 0..60 {
            let occupied: Vec<usize> = (0..n_slots).filter(|&s| m[s].is_some()).collect();
            // random distinct victims
            let mut victims: Vec<u32> = occupied
                .iter()
                .filter(|_| r(3) == 0)
                .map(|&s| s as u32)
                .collect();
            // shuffle victims
            for i in (1..victims.len()).rev() {
                let j = r(i + 1);
                victims.swap(i, j);
            }
            let free_after = n_slots - occupied.len() + victims.len();
            if free_after == 0 {
                continue;
            }
            let n_new = 1 + r(free_after);
            let positions: Vec<i64> = (0..n_new as i64).map(|i| next_pos + i).collect();
            next_pos += n_new as i64;

            // reference
            for &v in &victims {
                m[v as usize] = None;
            }
            let live_after_free = m.iter().filter(|x| x.is_some()).count();
            peak = peak.max(live_after_free + n_new);
            let mut want_slots = Vec::new();
            for &p in &positions {
                let s = (0..n_slots)
                    .map(|i| (head + i) % n_slots)
                    .find(|&s| m[s].is_none())
                    .unwrap();
                m[s] = Some(p);
                head = (s + 1) % n_slots;
                want_slots.push(s as u32);
            }
            let mut want_live: Vec<(i64, u32)> = m
                .iter()
                .enumerate()
                .filter_map(|(s, p)| p.map(|p| (p, s as u32)))
                .collect();
            want_live.sort();

            kv.apply(&victims, &positions, &mut slots).unwrap();
            assert_eq!(slots, want_slots, "case {case}");
            assert_eq!(kv.cells.head(), head, "case {case}");
            assert_eq!(kv.peak_live, peak, "case {case}");
            assert_eq!(kv.cells.n_live(), want_live.len(), "case {case}");
            let (ls, lp) = kv.live();
            assert_eq!(
                lp,
                want_live.iter().map(|x| x.0).collect::<Vec<_>>().as_slice(),
                "case {case}"
            );
            assert_eq!(
                ls,
                want_live.iter().map(|x| x.1).collect::<Vec<_>>().as_slice(),
                "case {case}"
            );
            assert!(
                lp.windows(2).all(|w| w[0] < w[1]),
                "live positions strictly increasing"
            );
            for s in 0..n_slots {
                assert_eq!(kv.cells.pos(s), m[s], "case {case} slot {s}");
            }
        }
    }
}

/// Regression (decode slowed by ~10% under scattered evictions): decoding
/// walks the live tokens in slot (memory) order; that list must hold exactly
/// the same (slot, position) pairs as the position-ordered one.
#[test]
fn slot_order_view_matches_position_order_view() {
    let mut kv = cache(64);
    let mut rng = Rng::new(11);
    let mut next = 0i64;
    let mut slots = Vec::new();
    for _ in 0..300 {
        let (live, _) = kv.live();
        let victims: Vec<u32> = if live.len() >= 60 {
            let mut v: Vec<u32> = live.to_vec();
            for i in 0..3 {
                let j = i + (rng.next_u64() as usize) % (v.len() - i);
                v.swap(i, j);
            }
            v.truncate(3);
            v
        } else {
            Vec::new()
        };
        let pos: Vec<i64> = (next..next + 2).collect();
        next += 2;
        kv.apply(&victims, &pos, &mut slots).unwrap();
        let (s1, p1) = kv.live();
        let (s2, p2) = kv.live_by_slot();
        assert!(
            p1.windows(2).all(|w| w[0] < w[1]),
            "live() is position-ordered"
        );
        assert!(
            s2.windows(2).all(|w| w[0] < w[1]),
            "live_by_slot() is slot-ordered"
        );
        let mut a: Vec<(u32, i64)> = s1.iter().copied().zip(p1.iter().copied()).collect();
        let b: Vec<(u32, i64)> = s2.iter().copied().zip(p2.iter().copied()).collect();
        a.sort_unstable();
        assert_eq!(a, b);
    }
}

/// Bytes per token by cache type: 2 · L · kv_dim · {4, 2, 34/32}; q8_0
/// needs whole 32-value blocks per head and says so.
#[test]
fn bytes_per_token_by_cache_type() {
    for (ty, b) in [
        (KvType::F32, 4 * 64),
        (KvType::F16, 2 * 64),
        (KvType::Q8_0, 2 * 34),
    ] {
        let kv = KvCache::with_type(3, 64, 32, 5, ty).unwrap();
        assert_eq!(kv.bytes_per_token(), 2 * 3 * b, "{ty}");
        assert_eq!(kv.bytes_allocated(), 5 * kv.bytes_per_token());
    }
    let e = KvCache::with_type(2, 48, 16, 4, KvType::Q8_0)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--cache-type") && e.contains("head_dim 16") && e.contains("32"),
        "{e}"
    );
    // rows round-trip through every type
    let k: Vec<f32> = (0..64).map(|i| (i as f32 - 30.0) / 7.0).collect();
    let v: Vec<f32> = k.iter().map(|x| -x).collect();
    for ty in KvType::ALL {
        let mut kv = KvCache::with_type(2, 64, 32, 3, ty).unwrap();
        kv.write(1, 2, &k, &v);
        let (mut ko, mut vo) = (vec![0f32; 64], vec![0f32; 64]);
        kv.k_f32(1, 2, &mut ko);
        kv.v_f32(1, 2, &mut vo);
        let tol = match ty {
            KvType::F32 => 0.0,
            KvType::F16 => 2e-3,
            // half a step of the largest block scale (max |x| 33/7) + f16 scale rounding
            KvType::Q8_0 => 0.5 * 33.0 / 7.0 / 127.0 + 33.0 / 7.0 / 2048.0,
        };
        for i in 0..64 {
            assert!(
                (ko[i] - k[i]).abs() <= tol && (vo[i] - v[i]).abs() <= tol,
                "{ty} {i}"
            );
        }
    }
}

/// K (or V) row of (layer, slot) as stored, read back as f32.
fn row(kv: &KvCache, key: bool, l: usize, s: usize) -> Vec<f32> {
    let mut r = vec![0f32; kv.kv_dim];
    if key {
        kv.k_f32(l, s, &mut r);
    } else {
        kv.v_f32(l, s, &mut r);
    }
    r
}

/// A rewind (chat, the server's prompt cache) frees the tail and moves the
/// ring head back, so re-fed tokens take the slots of a fresh run and the
/// memory order (the decode kernel's summation order) is the fresh one.
/// Regression: the head stayed past the freed tail, so a re-fed token
/// landed elsewhere and later decoded logits differed from a fresh run.
#[test]
fn rewind_gives_the_fresh_runs_slots() {
    let mut kv = cache(8);
    let mut slots = Vec::new();
    kv.apply(&[], &[0, 1, 2, 3, 4], &mut slots).unwrap();
    kv.apply(&[], &[5, 6], &mut slots).unwrap();
    assert_eq!(kv.cells.head(), 7);
    kv.rewind(3).unwrap();
    assert_eq!(live_of(&kv), (vec![0, 1, 2], vec![0, 1, 2]));
    assert_eq!(kv.cells.head(), 3);
    kv.apply(&[], &[3, 4], &mut slots).unwrap();
    assert_eq!(slots, vec![3, 4], "the fresh run's slots");
    // after an eviction the head only moves back, never forward
    kv.apply(&[0], &[5], &mut slots).unwrap();
    assert_eq!(slots, vec![5]);
    kv.rewind(5).unwrap();
    assert_eq!(kv.cells.head(), 5);
    kv.apply(&[], &[5, 6, 7], &mut slots).unwrap();
    assert_eq!(slots, vec![5, 6, 7]);

    // the stream layout: each region's ring head moves back
    let regions = [
        Region {
            first_stream: 0,
            n_streams: 2,
            rows: 16,
        },
        Region {
            first_stream: 2,
            n_streams: 2,
            rows: 16,
        },
    ];
    let mut kv = KvCache::with_streams(2, 4, 2, &regions, KvType::F32).unwrap();
    kv.apply(&[], &[0, 1, 2, 3], &mut slots).unwrap();
    let fresh_tail: Vec<u32> = slots.clone();
    kv.rewind(2).unwrap();
    kv.apply(&[], &[2, 3], &mut slots).unwrap();
    // stream-major: each stream's entries for positions 2 and 3
    let again: Vec<u32> = fresh_tail
        .chunks(4)
        .flat_map(|c| c[2..].iter().copied())
        .collect();
    assert_eq!(slots, again, "every stream re-takes its fresh rows");
}

/// `compact` packs each multi-stream region stream by stream: every
/// stream's rows end contiguous and in position order, its rows' stored
/// bytes come along (every cache type), the free rows are one run at the
/// region's end and new entries go there. Caches it has nothing to do for
/// (token-uniform, one stream per region, already packed) are left alone.
#[test]
fn compact_packs_each_stream_and_keeps_its_rows() {
    let (n_layers, hd, nkv) = (2, 32, 2);
    let n_streams = n_layers * nkv;
    let regions = [Region {
        first_stream: 0,
        n_streams,
        rows: 48,
    }];
    for ty in [KvType::F32, KvType::F16, KvType::Q8_0] {
        let mut rng = Rng::new(99);
        let mut kv = KvCache::with_streams(n_layers, nkv * hd, hd, &regions, ty).unwrap();
        let mut slots = Vec::new();
        // fill 9 positions, evicting a few random entries as it goes, so
        // every stream's rows are scattered over the pool
        for p in 0..9i64 {
            let mut victims = Vec::new();
            if p >= 3 {
                let st = kv.streams().unwrap();
                for s in 0..n_streams {
                    let sl = st.stream(s).0;
                    if rng.next_u64() % 2 == 0 && sl.len() > 1 {
                        victims.push(sl[(rng.next_u64() % sl.len() as u64) as usize]);
                    }
                }
            }
            kv.apply(&victims, &[p], &mut slots).unwrap();
            for l in 0..n_layers {
                let k: Vec<f32> = (0..nkv * hd).map(|_| rng.normal()).collect();
                let v: Vec<f32> = (0..nkv * hd).map(|_| rng.normal()).collect();
                kv.write_token(l, 0, 1, &slots, &k, &v);
            }
        }
        // every live entry's stored rows, by (stream, position)
        let rows_of = |kv: &KvCache| -> Vec<Vec<(i64, Vec<f32>, Vec<f32>)>> {
            let st = kv.streams().unwrap();
            (0..n_streams)
                .map(|s| {
                    let (sl, ps) = st.stream(s);
                    let (l, g) = (s / nkv, s % nkv);
                    let mut k = vec![0f32; sl.len() * hd];
                    let mut v = vec![0f32; sl.len() * hd];
                    kv.read_heads(true, l, g, sl, &mut k);
                    kv.read_heads(false, l, g, sl, &mut v);
                    (0..sl.len())
                        .map(|i| {
                            let r = i * hd..(i + 1) * hd;
                            (ps[i], k[r.clone()].to_vec(), v[r].to_vec())
                        })
                        .collect()
                })
                .collect()
        };
        let before = rows_of(&kv);
        let old_slots: Vec<Vec<u32>> = (0..n_streams)
            .map(|s| kv.streams().unwrap().stream(s).0.to_vec())
            .collect();
        let scattered = old_slots
            .iter()
            .any(|sl| sl.windows(2).any(|w| w[1] != w[0] + 1));
        assert!(
            scattered,
            "{ty}: the test must start from scattered streams"
        );
        let n_live: usize = old_slots.iter().map(|s| s.len()).sum();

        let mut map = Vec::new();
        assert!(kv.compact(&mut map).unwrap(), "{ty}: rows moved");
        assert_eq!(map.len(), n_live, "{ty}: one move per live entry");
        assert!(
            map.windows(2).all(|w| w[0].0 < w[1].0),
            "{ty}: sorted by old slot"
        );
        // streams packed in order, each contiguous in position order
        let st = kv.streams().unwrap();
        let mut next = 0u32;
        for (s, old) in old_slots.iter().enumerate() {
            let (sl, ps) = st.stream(s);
            let want: Vec<u32> = (next..next + sl.len() as u32).collect();
            assert_eq!(sl, &want[..], "{ty}: stream {s} contiguous from {next}");
            assert!(
                ps.windows(2).all(|w| w[0] < w[1]),
                "{ty}: stream {s} by position"
            );
            assert_eq!(
                st.stream_by_slot(s).0,
                sl,
                "{ty}: memory order is position order"
            );
            for (&o, &n) in old.iter().zip(sl) {
                assert!(map.contains(&(o, n)), "{ty}: {o} -> {n} in the map");
                assert_eq!(st.owner(n as usize), s);
            }
            next += sl.len() as u32;
        }
        // the stored bytes came along
        assert_eq!(rows_of(&kv), before, "{ty}: rows as stored");
        // new entries take the free run at the end, stream by stream
        kv.apply(&[], &[9], &mut slots).unwrap();
        let tail: Vec<u32> = (n_live as u32..(n_live + n_streams) as u32).collect();
        assert_eq!(slots, tail, "{ty}: new entries at the end");
        // each stream's new row sits after every stream: compacting again
        // moves them in, and a third time finds nothing to do
        assert!(kv.compact(&mut map).unwrap());
        assert!(!kv.compact(&mut map).unwrap(), "{ty}: a packed cache stays");
        assert!(map.iter().all(|&(f, t)| f == t));
        // nothing written since: not worth defragmenting
        assert!(!kv.defragment(&mut map).unwrap());
        assert!(map.is_empty());
    }

    // nothing to do for a token-uniform cache or one region per stream
    let mut slots = Vec::new();
    let mut kv = cache(8);
    kv.apply(&[], &[0, 1, 2], &mut slots).unwrap();
    kv.apply(&[1], &[3], &mut slots).unwrap();
    let mut map = Vec::new();
    assert!(!kv.compact(&mut map).unwrap());
    let own: Vec<Region> = (0..4)
        .map(|s| Region {
            first_stream: s,
            n_streams: 1,
            rows: 4,
        })
        .collect();
    let mut kv = KvCache::with_streams(2, 4, 2, &own, KvType::F32).unwrap();
    kv.apply(&[], &[0, 1, 2], &mut slots).unwrap();
    let victim = kv.streams().unwrap().stream(0).0[1];
    kv.apply(&[victim], &[3], &mut slots).unwrap();
    assert!(!kv.compact(&mut map).unwrap());
}
