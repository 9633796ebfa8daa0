//! Chat templates: SmolLM2's ChatML and DeepSeek-R1's real template render the
//! exact expected strings, and R1's output tokenizes to the right special ids.

use kvrun::chat::{ChatTemplate, Message};
use kvrun::format::gguf::Gguf;
use kvrun::tokenizer::Tokenizer;
use kvrun::Error;
use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn smollm() -> Gguf {
    let p = root()
        .join("models")
        .join("SmolLM2-135M-Instruct.Q4_1.gguf");
    Gguf::open(&p).expect("default model (run `bash models/fetch.sh`)")
}

fn r1() -> Gguf {
    let p = root()
        .join("..")
        .join("shared")
        .join("data")
        .join("r1-distill-qwen-7b.header.gguf");
    Gguf::open(&p).expect("R1 header")
}

fn msg(role: &str, content: &str) -> Message {
    Message::new(role, content)
}

#[test]
fn smollm_chatml_system_user_with_generation_prompt() {
    let t = ChatTemplate::from_gguf(&smollm())
        .expect("template")
        .expect("SmolLM2 has a template");
    let out = t
        .render(
            &[
                msg("system", "You are a terse assistant."),
                msg("user", "What is 2+2?"),
            ],
            true,
        )
        .expect("render");
    assert_eq!(
        out,
        "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n\
         <|im_start|>user\nWhat is 2+2?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
}

#[test]
fn smollm_default_system_prompt_and_no_generation_prompt() {
    let t = ChatTemplate::from_gguf(&smollm())
        .expect("template")
        .expect("template present");
    let out = t
        .render(&[msg("user", "Hi"), msg("assistant", "Hello!")], false)
        .expect("render");
    assert_eq!(
        out,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    );
}

#[test]
fn smollm_render_tokenizes_to_chatml_control_tokens() {
    let g = smollm();
    let t = ChatTemplate::from_gguf(&g)
        .expect("template")
        .expect("template present");
    let tok = Tokenizer::from_gguf(&g).expect("tokenizer");
    let text = t
        .render(&[msg("system", "S"), msg("user", "U")], true)
        .expect("render");
    let ids = tok.encode(&text, false, true).expect("encode");
    let (start, end) = (
        tok.token_id("<|im_start|>").expect("im_start"),
        tok.token_id("<|im_end|>").expect("im_end"),
    );
    let specials: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|&i| i == start || i == end)
        .collect();
    assert_eq!(specials, vec![start, end, start, end, start]);
    assert_eq!(tok.decode(&ids, true), text);
}

#[test]
fn r1_multi_turn_strips_think_and_tokenizes_to_special_ids() {
    let g = r1();
    let t = ChatTemplate::from_gguf(&g)
        .expect("template")
        .expect("R1 has a template");
    let conv = [
        msg("user", "What is 1+1?"),
        msg(
            "assistant",
            "<think>\nOne plus one is two.\n</think>\n\nThe answer is 2.",
        ),
        msg("user", "And 2+2?"),
    ];
    let out = t.render(&conv, true).expect("render");
    assert_eq!(
        out,
        "<｜begin▁of▁sentence｜><｜User｜>What is 1+1?<｜Assistant｜>\n\nThe answer is 2.<｜end▁of▁sentence｜>\
         <｜User｜>And 2+2?<｜Assistant｜>"
    );

    let tok = Tokenizer::from_gguf(&g).expect("tokenizer");
    // The template already emits BOS, so tokenize without add_special.
    let ids = tok.encode(&out, false, true).expect("encode");
    let specials: Vec<u32> = ids.iter().copied().filter(|&i| i >= 151643).collect();
    assert_eq!(
        specials,
        vec![151646, 151644, 151645, 151643, 151644, 151645]
    );
    assert_eq!(ids[0], 151646);
    assert_eq!(ids[1], 151644);
    assert_eq!(*ids.last().expect("non-empty"), 151645);
    assert_eq!(tok.decode(&ids, true), out);
    // With add_special the model's add_bos_token = true would double the BOS.
    let doubled = tok.encode(&out, true, true).expect("encode");
    assert_eq!(&doubled[..2], &[151646, 151646]);
}

#[test]
fn r1_system_prompt_and_no_generation_prompt() {
    let t = ChatTemplate::from_gguf(&r1())
        .expect("template")
        .expect("template present");
    let out = t
        .render(&[msg("system", "Be brief."), msg("user", "Hi")], false)
        .expect("render");
    assert_eq!(out, "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi");
}

#[test]
fn raise_exception_becomes_template_error() {
    let t = ChatTemplate::from_source(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok",
        "<s>",
        "</s>",
    )
    .expect("compile");
    assert_eq!(t.render(&[msg("user", "x")], false).expect("render"), "ok");
    match t.render(&[msg("system", "x")], false) {
        Err(Error::Template(m)) => assert!(m.contains("first message must be user"), "{m}"),
        other => panic!("expected Error::Template, got {other:?}"),
    }
}

#[test]
fn syntax_error_is_reported_at_load() {
    match ChatTemplate::from_source("{% for m in messages %}{{ m.content }}", "", "") {
        Err(Error::Template(m)) => assert!(!m.is_empty()),
        other => panic!("expected Error::Template, got {other:?}"),
    }
}

#[test]
fn python_string_methods_and_context_variables() {
    let src = "{{ bos_token }}{% for m in messages %}{{ m.role.upper() }}:{{ m.content.strip() }}|\
               {{ m.content.split(',')[-1] }}|{{ m.content.startswith(' a') }};{% endfor %}\
               {% if add_generation_prompt %}GEN{% endif %}{{ eos_token }}";
    let t = ChatTemplate::from_source(src, "<s>", "</s>").expect("compile");
    let out = t.render(&[msg("user", " a,b ")], true).expect("render");
    // Booleans print the Python way, as Jinja2 does.
    assert_eq!(out, "<s>USER:a,b|b |True;GEN</s>");
}

#[test]
fn strftime_now_renders_a_date() {
    let t = ChatTemplate::from_source("{{ strftime_now('%Y-%m-%d') }}", "", "").expect("compile");
    let out = t.render(&[], false).expect("render");
    let parts: Vec<&str> = out.split('-').collect();
    assert_eq!(parts.len(), 3, "{out}");
    assert!(parts[0].len() == 4 && parts[0].starts_with('2'), "{out}");
    assert!(parts[1].len() == 2 && parts[2].len() == 2, "{out}");
}

#[test]
fn message_serde_roundtrip() {
    let m = msg("assistant", "hi \"there\"");
    let json = serde_json::to_string(&m).expect("serialize");
    assert_eq!(json, r#"{"role":"assistant","content":"hi \"there\""}"#);
    let back: Message = serde_json::from_str(&json).expect("deserialize");
    assert_eq!(back, m);
}

/// A template comes from the model file, so its renders are bounded: an
/// endless nest of loops runs out of fuel and a template that repeats text
/// hits the output cap, each as an error (not a hang or an abort), while a
/// long real conversation still renders.
#[test]
fn chat_template_renders_are_bounded() {
    let msgs = vec![msg("user", "hi")];
    let spin =
        "{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}{% endfor %}";
    let t = ChatTemplate::from_source(spin, "<s>", "</s>").unwrap();
    let t0 = std::time::Instant::now();
    let e = t
        .render(&msgs, true)
        .expect_err("an endless template must fail");
    assert!(matches!(e, Error::Template(_)), "{e}");
    assert!(t0.elapsed().as_secs() < 60, "fuel did not stop the render");
    let big = "{% for a in range(100000) %}{{ messages[0]['content'] }}{% endfor %}";
    let t = ChatTemplate::from_source(big, "<s>", "</s>").unwrap();
    let huge = vec![msg("user", &"x".repeat(1 << 12))];
    let e = t
        .render(&huge, true)
        .expect_err("a 400 MiB render must fail");
    assert!(e.to_string().contains("MiB"), "{e}");
    let long: Vec<Message> = (0..2000)
        .map(|i| {
            msg(
                if i % 2 == 0 { "user" } else { "assistant" },
                "a fairly ordinary message",
            )
        })
        .collect();
    let t = ChatTemplate::from_gguf(&smollm()).unwrap().unwrap();
    assert!(t.render(&long, true).unwrap().len() > 2000 * 20);
}
