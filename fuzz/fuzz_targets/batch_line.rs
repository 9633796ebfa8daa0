//! Fuzz the batch input-line parser and the answer grader behind it.
//!
//! Each input is one JSONL line as `kvrun batch` reads it (any bytes). It
//! goes through `parse_item` with the default fields and with custom
//! prompt/id/answer fields; a record that parses has its prompt and gold
//! answer run through answer extraction and grading (as model output and
//! reference would be). Errors are fine; a panic or a hang is a finding.
#![no_main]

use kvrun::cmd::batch::{auto_kind, id_key, parse_item, BatchArgs};
use kvrun::cmd::grade::{extract_answer, grade, normalize_answer};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

/// The batch flags, parsed once the way the binary parses them.
fn args(custom: bool) -> &'static BatchArgs {
    static DEF: OnceLock<BatchArgs> = OnceLock::new();
    static CUSTOM: OnceLock<BatchArgs> = OnceLock::new();
    let make = |extra: &[&str]| {
        let mut argv = vec!["kvrun", "batch", "-i", "x.jsonl", "-o", "y.jsonl"];
        argv.extend_from_slice(extra);
        match kvrun::cmd::parse(argv).expect("batch flags parse").cmd {
            Some(kvrun::cmd::Cmd::Batch(b)) => b.run,
            _ => unreachable!("not a batch command"),
        }
    };
    if custom {
        CUSTOM.get_or_init(|| {
            make(&["--prompt-field", "q", "--id-field", "n", "--answer-field", "a"])
        })
    } else {
        DEF.get_or_init(|| make(&[]))
    }
}

fuzz_target!(|data: &[u8]| {
    for custom in [false, true] {
        if let Ok(item) = parse_item(args(custom), 7, data) {
            let _ = id_key(&item.id);
            if let Some(gold) = &item.gold {
                let kind = auto_kind(gold);
                let _ = normalize_answer(gold);
                if let Some(pred) = extract_answer(&item.prompt, kind) {
                    let _ = grade(&pred, gold, kind);
                }
            }
        }
    }
});
