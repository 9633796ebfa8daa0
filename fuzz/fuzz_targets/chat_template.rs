//! Fuzz the chat-template renderer: a template source (it comes from model
//! files, i.e. from anyone) and message contents, both from the input.
//!
//! The input is split at its first NUL byte: before it the Jinja source,
//! after it the contents of a four-message conversation (split at further
//! NULs). Compile and render errors are fine; a panic, an abort, a hang
//! (libFuzzer's -timeout) or a huge allocation (-rss_limit_mb) is a finding.
//! A quarter of the inputs use SmolLM2's ChatML template with fuzzed
//! contents, so the message side is covered even where a fuzzed source does
//! not compile.
#![no_main]

use kvrun::chat::{ChatTemplate, Message};
use libfuzzer_sys::fuzz_target;

const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.split('\0');
    let src = parts.next().unwrap_or("");
    let contents: Vec<&str> = parts.collect();
    let roles = ["system", "user", "assistant", "user"];
    let msgs: Vec<Message> = roles
        .iter()
        .enumerate()
        .map(|(i, r)| Message::new(*r, contents.get(i).copied().unwrap_or("hello")))
        .collect();
    let src = if data.first().is_some_and(|b| b % 4 == 0) { CHATML } else { src };
    if let Ok(t) = ChatTemplate::from_source(src, "<s>", "</s>") {
        let _ = t.render(&msgs, true);
        let _ = t.render(&msgs[..1], false);
        let _ = t.render_with_content_spans(&msgs, true);
    }
});
