//! `Session::record_evictions`: the log `kvrun viz` draws holds every
//! eviction the session made (count, order, stream, position, step), and a
//! session that did not ask for it keeps none.

use crate::util;

use kvrun::format::gguf::Gguf;
use kvrun::generate::{EvictionEvent, KvPolicy, Session};
use kvrun::model::llama::Logits;
use kvrun::model::Weights;
use kvrun::policy::table::{find, ScorerOptions};
use kvrun::policy::Evictor;
use kvrun::tokenizer::Tokenizer;

fn policy(name: &str, budget: usize, evict_every: usize) -> KvPolicy {
    let p = find(name)
        .unwrap()
        .build(&ScorerOptions::default())
        .unwrap()
        .unwrap();
    KvPolicy::new(
        p,
        Evictor {
            budget,
            n_sink: 4,
            n_recent: 8,
            keep_prompt_until: 0,
            evict_every,
        },
    )
}

#[test]
fn eviction_log_records_every_victim() {
    let g = Gguf::open(&util::default_model()).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let ids = tok.encode(&util::wikitext(600), false, false).unwrap();
    let ids = &ids[..80];

    // off by default
    let mut s = Session::with_policy(&w, 128, 1, 16, policy("window", 32, 1)).unwrap();
    s.feed(ids, Logits::Last).unwrap();
    assert!(s.n_evicted > 0);
    assert!(s.eviction_log().is_none());

    // window: the oldest non-sink tokens, one by one, in order
    let mut s = Session::with_policy(&w, 128, 1, 16, policy("window", 32, 1)).unwrap();
    s.record_evictions();
    for &t in ids {
        s.feed(&[t], Logits::Last).unwrap();
    }
    let log = s.eviction_log().unwrap();
    assert_eq!(log.events.len(), s.evicted_entries());
    assert_eq!(log.events.len(), 80 - 32);
    for (i, e) in log.events.iter().enumerate() {
        assert_eq!(e.stream, EvictionEvent::ALL_STREAMS);
        assert_eq!(e.pos as usize, 4 + i, "window evicts the oldest first");
        assert_eq!(
            e.step as usize,
            32 + i,
            "evicted when token {} arrived",
            32 + i
        );
        assert!(e.score.is_finite(), "{e:?}");
    }

    // snapkv: per-(layer, KV-head) streams, batched evictions
    let mut s = Session::with_policy(&w, 128, 1, 16, policy("snapkv", 32, 4)).unwrap();
    s.record_evictions();
    for &t in ids {
        s.feed(&[t], Logits::Last).unwrap();
    }
    let log = s.eviction_log().unwrap();
    assert_eq!(log.events.len(), s.evicted_entries());
    let st = s.kv.streams().unwrap();
    let mut per_stream = vec![0usize; st.n_streams()];
    for e in &log.events {
        assert!((e.stream as usize) < st.n_streams(), "{e:?}");
        assert!(e.step > e.pos && (e.step as usize) < 80, "{e:?}");
        assert!(e.pos >= 4, "sinks stay: {e:?}");
        per_stream[e.stream as usize] += 1;
    }
    for (i, n) in per_stream.iter().enumerate() {
        // every stream saw all 80 tokens: evicted + resident
        assert_eq!(n + st.len(i), 80, "stream {i}");
        // and the log names no resident position
        let (_, pos) = st.stream(i);
        assert!(log
            .events
            .iter()
            .filter(|e| e.stream as usize == i)
            .all(|e| !pos.contains(&(e.pos as i64))));
    }

    // reset forgets the log with the sequence
    s.reset();
    assert!(s.eviction_log().unwrap().events.is_empty());
}
