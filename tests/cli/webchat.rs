//! The web chat of `kvrun serve`, driven in a real headless Chromium over
//! its DevTools protocol (a small WebSocket client below, no browser
//! automation dependency): load `/`, see the policy table, send a message
//! and watch the text stream in, press stop (the server must notice and
//! cancel), switch policy and budget, see the stats and the cache view,
//! reload and find the conversation (and a `<think>` block) kept in
//! localStorage. Screenshots go to `$KVRUN_SCREENSHOT_DIR` when set (the
//! README's are made that way). Skips with a message when Chromium is
//! missing, unless `KVRUN_REQUIRE_CHROMIUM=1` (CI sets it).

use crate::server::Server;

use base64::Engine as _;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

// ------------------------------------------------------------ WebSocket

/// A client WebSocket (RFC 6455) over plain TCP: text frames out (masked,
/// as a client must), text frames in (fragmented or not), pings answered.
struct Ws {
    s: TcpStream,
}

impl Ws {
    /// Connect to `ws://HOST:PORT/PATH`.
    fn connect(url: &str) -> Ws {
        let rest = url.strip_prefix("ws://").expect("a ws:// URL");
        let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
        let mut s = TcpStream::connect(host).expect("connect to the DevTools socket");
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        write!(
            s,
            "GET /{path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Key: a3ZydW4tdGVzdC1rZXkxMg==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        .unwrap();
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            s.read_exact(&mut b).expect("WebSocket handshake");
            head.push(b[0]);
        }
        let head = String::from_utf8_lossy(&head);
        assert!(
            head.starts_with("HTTP/1.1 101"),
            "handshake refused: {head}"
        );
        Ws { s }
    }

    fn send_frame(&mut self, op: u8, payload: &[u8]) {
        let mut f = vec![0x80 | op];
        let n = payload.len();
        match n {
            0..126 => f.push(0x80 | n as u8),
            126..65536 => {
                f.push(0x80 | 126);
                f.extend_from_slice(&(n as u16).to_be_bytes());
            }
            _ => {
                f.push(0x80 | 127);
                f.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        let key = [0x5a, 0x13, 0xc7, 0x81];
        f.extend_from_slice(&key);
        f.extend(payload.iter().enumerate().map(|(i, b)| b ^ key[i % 4]));
        self.s.write_all(&f).expect("WebSocket write");
    }

    fn send_text(&mut self, text: &str) {
        self.send_frame(0x1, text.as_bytes());
    }

    /// The next text message.
    fn recv_text(&mut self) -> String {
        let mut msg = Vec::new();
        loop {
            let mut h = [0u8; 2];
            self.s.read_exact(&mut h).expect("WebSocket read");
            let (fin, op) = (h[0] & 0x80 != 0, h[0] & 0x0f);
            let mut n = (h[1] & 0x7f) as u64;
            if n == 126 {
                let mut e = [0u8; 2];
                self.s.read_exact(&mut e).unwrap();
                n = u16::from_be_bytes(e) as u64;
            } else if n == 127 {
                let mut e = [0u8; 8];
                self.s.read_exact(&mut e).unwrap();
                n = u64::from_be_bytes(e);
            }
            let key = if h[1] & 0x80 != 0 {
                let mut k = [0u8; 4];
                self.s.read_exact(&mut k).unwrap();
                Some(k)
            } else {
                None
            };
            let mut p = vec![0u8; n as usize];
            self.s.read_exact(&mut p).unwrap();
            if let Some(k) = key {
                p.iter_mut().enumerate().for_each(|(i, b)| *b ^= k[i % 4]);
            }
            match op {
                0x0 | 0x1 | 0x2 => {
                    msg.extend_from_slice(&p);
                    if fin {
                        return String::from_utf8(msg).expect("UTF-8 message");
                    }
                }
                0x8 => panic!("the browser closed the DevTools socket"),
                0x9 => self.send_frame(0xA, &p),
                _ => {}
            }
        }
    }
}

// ------------------------------------------------------------ DevTools

/// One page's DevTools session.
struct Cdp {
    ws: Ws,
    next: u64,
}

impl Cdp {
    /// Call `method` and return its result (events in between are skipped).
    fn call(&mut self, method: &str, params: Value) -> Value {
        self.next += 1;
        let id = self.next;
        self.ws
            .send_text(&json!({"id": id, "method": method, "params": params}).to_string());
        loop {
            let m: Value = serde_json::from_str(&self.ws.recv_text()).unwrap();
            if m["id"].as_u64() == Some(id) {
                if let Some(e) = m.get("error") {
                    panic!("{method}: {e}");
                }
                return m["result"].clone();
            }
        }
    }

    /// Evaluate a JS expression in the page (promises awaited) and return its value.
    fn eval(&mut self, expr: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": expr, "returnByValue": true, "awaitPromise": true}),
        );
        if let Some(e) = r.get("exceptionDetails") {
            panic!("JS error in {expr}: {e}");
        }
        r["result"]["value"].clone()
    }

    /// Poll `expr` until it is truthy; return its value.
    fn wait(&mut self, expr: &str, what: &str, limit: Duration) -> Value {
        let t0 = Instant::now();
        loop {
            let v = self.eval(expr);
            let truthy = match &v {
                Value::Null => false,
                Value::Bool(b) => *b,
                Value::Number(n) => n.as_f64() != Some(0.0),
                Value::String(s) => !s.is_empty(),
                _ => true,
            };
            if truthy {
                return v;
            }
            assert!(t0.elapsed() < limit, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A PNG of the viewport.
    fn screenshot(&mut self, path: &Path) {
        let r = self.call("Page.captureScreenshot", json!({"format": "png"}));
        let png = base64::engine::general_purpose::STANDARD
            .decode(r["data"].as_str().expect("screenshot data"))
            .expect("base64 screenshot");
        assert!(png.starts_with(b"\x89PNG"), "not a PNG");
        std::fs::write(path, png).unwrap();
    }
}

/// A headless Chromium with a fresh profile, killed on drop.
struct Browser {
    child: Child,
    profile: PathBuf,
    /// host:port of its DevTools HTTP endpoint.
    devtools: String,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// The Chromium binary on PATH, if any.
fn chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    [
        "chromium",
        "chromium-browser",
        "google-chrome",
        "google-chrome-stable",
    ]
    .iter()
    .flat_map(|n| std::env::split_paths(&path).map(move |d| d.join(n)))
    .find(|p| p.is_file())
}

impl Browser {
    fn start(bin: &Path) -> Browser {
        let profile = std::env::temp_dir().join(format!("kvrun-chromium-{}", std::process::id()));
        let mut child = Command::new(bin)
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--hide-scrollbars",
                "--remote-debugging-port=0",
                "--remote-allow-origins=*",
                "--window-size=1280,860",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn chromium");
        // "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/ID"
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let mut devtools = None;
        let mut line = String::new();
        let mut seen = String::new();
        while err.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
            if let Some(u) = line.split("ws://").nth(1) {
                devtools = u.split('/').next().map(str::to_owned);
                break;
            }
            seen.push_str(&line);
            line.clear();
        }
        let devtools =
            devtools.unwrap_or_else(|| panic!("chromium printed no DevTools address:\n{seen}"));
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = err.read_to_end(&mut sink);
        });
        Browser {
            child,
            profile,
            devtools,
        }
    }

    /// A DevTools session on the browser's first page.
    fn page(&self) -> Cdp {
        let t0 = Instant::now();
        loop {
            let list: Value = ureq::get(&format!("http://{}/json/list", self.devtools))
                .call()
                .expect("GET /json/list")
                .into_json()
                .unwrap();
            let ws = list
                .as_array()
                .and_then(|l| l.iter().find(|t| t["type"] == "page"))
                .and_then(|t| t["webSocketDebuggerUrl"].as_str().map(str::to_owned));
            if let Some(ws) = ws {
                return Cdp {
                    ws: Ws::connect(&ws),
                    next: 0,
                };
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "no page target");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Set the composer's controls and send `text`.
fn send(cdp: &mut Cdp, policy: &str, budget: usize, max_tokens: usize, text: &str) {
    let js = format!(
        r#"(() => {{
            const set = (id, v) => {{ const e = document.getElementById(id); e.value = v; e.dispatchEvent(new Event("change")); }};
            set("policy", {policy:?}); set("budget", "{budget}"); set("max-tokens", "{max_tokens}");
            document.getElementById("input").value = {text:?};
            document.getElementById("composer").requestSubmit();
            return document.getElementById("policy").value;
        }})()"#
    );
    assert_eq!(
        cdp.eval(&js),
        json!(policy),
        "the policy select took {policy}"
    );
}

const LAST_ASSISTANT: &str = r#"[...document.querySelectorAll(".msg.assistant")].pop()"#;

#[test]
fn web_chat_in_headless_chromium() {
    let required = std::env::var("KVRUN_REQUIRE_CHROMIUM").is_ok_and(|v| v == "1");
    let Some(bin) = chromium() else {
        assert!(
            !required,
            "KVRUN_REQUIRE_CHROMIUM=1 but no chromium on PATH (apt-get install chromium)"
        );
        eprintln!("SKIP web_chat_in_headless_chromium: no chromium on PATH (apt-get install chromium; KVRUN_REQUIRE_CHROMIUM=1 makes this a failure)");
        return;
    };
    let shots = match std::env::var_os("KVRUN_SCREENSHOT_DIR") {
        Some(d) => PathBuf::from(d),
        None => std::env::temp_dir().join(format!("kvrun-webchat-{}", std::process::id())),
    };
    std::fs::create_dir_all(&shots).unwrap();
    // greedy decoding keeps the first answer long enough to stop mid-stream
    let server = Server::start(&["-c", "2048", "--parallel", "1", "--temp", "0"]);
    let (st, page) = server.get("/");
    assert_eq!(st, 200);
    assert!(page.contains("<script src=\"app.js\">"), "{page}");
    for asset in ["/app.js", "/style.css"] {
        let (st, body) = server.get(asset);
        assert_eq!(st, 200, "{asset}");
        assert!(
            !body.contains("http://") && !body.contains("https://"),
            "{asset} must not load anything from the network"
        );
    }
    let browser = Browser::start(&bin);
    let mut cdp = browser.page();
    cdp.call("Page.enable", json!({}));
    cdp.call("Page.navigate", json!({"url": server.url("/")}));

    // the policy table arrives from /props
    let n = cdp.wait(
        r#"document.querySelectorAll('#policy option').length"#,
        "the policy list",
        Duration::from_secs(30),
    );
    assert!(n.as_u64().unwrap() > 10, "{n} policies");
    let names = cdp.eval(r#"[...document.querySelectorAll('#policy option')].map(o => o.value)"#);
    for p in ["full", "window", "h2o", "snapkv"] {
        assert!(
            names.as_array().unwrap().contains(&json!(p)),
            "{p} in {names}"
        );
    }

    // 1. a long answer under window@64: it streams, then we stop it
    send(
        &mut cdp,
        "window",
        64,
        1500,
        "Write a very long story about a fox who lives in a forest, with many chapters.",
    );
    let len_of = format!(
        r#"(() => {{ const m = {LAST_ASSISTANT}; return m && m.classList.contains("streaming") ? m.querySelector(".content").textContent.length : 0; }})()"#
    );
    let first = cdp.wait(
        &format!("{len_of} > 40 && {len_of}"),
        "streamed text",
        Duration::from_secs(60),
    );
    let first = first.as_u64().unwrap();
    let later = cdp.wait(
        &format!("{len_of} > {first} && {len_of}"),
        "more streamed text",
        Duration::from_secs(30),
    );
    assert!(
        later.as_u64().unwrap() > first,
        "the text grows while streaming"
    );
    assert_eq!(
        cdp.eval(r#"document.getElementById("stop").disabled"#),
        json!(false),
        "stop is enabled while streaming"
    );
    cdp.screenshot(&shots.join("webchat-streaming.png"));
    let cancelled0 = server.metric("kvrun_requests_cancelled_total", "");
    cdp.eval(r#"document.getElementById("stop").click(), true"#);
    let stats = cdp.wait(
        &format!(r#"(() => {{ const m = {LAST_ASSISTANT}; const s = m.querySelector(".stats").textContent; return !m.classList.contains("streaming") && s.startsWith("stopped") && s; }})()"#),
        "the stopped message",
        Duration::from_secs(30),
    );
    assert!(stats.as_str().unwrap().contains("tok/s"), "{stats}");
    let stopped_len = cdp.eval(&format!(
        "{LAST_ASSISTANT}.querySelector('.content').textContent.length"
    ));
    // the server noticed the disconnect and stopped generating
    let t0 = Instant::now();
    while server.metric("kvrun_requests_cancelled_total", "") <= cancelled0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the server did not cancel the aborted request"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (_, health) = server.get("/health");
    let health: Value = serde_json::from_str(&health).unwrap();
    assert_eq!(health["slots_processing"], 0, "{health}");
    assert!(
        server.metric("kvrun_generated_tokens_total", "") < 1500.0,
        "generation stopped early"
    );
    assert_eq!(
        cdp.eval(&format!(
            "{LAST_ASSISTANT}.querySelector('.content').textContent.length"
        )),
        stopped_len,
        "no text after stop"
    );

    // 2. switch policy: h2o@64, a short answer with the server's stats
    send(&mut cdp, "h2o", 64, 24, "Now tell it in one sentence.");
    let stats = cdp.wait(
        &format!(r#"(() => {{ const m = {LAST_ASSISTANT}; const s = m.querySelector(".stats").textContent; return !m.classList.contains("streaming") && s.includes("tok/s") && s; }})()"#),
        "the stats of the second answer",
        Duration::from_secs(120),
    );
    let stats = stats.as_str().unwrap().to_owned();
    for want in ["tokens", "tok/s", "KV ", "evicted ", "h2o@64", "prompt "] {
        assert!(stats.contains(want), "{want:?} in {stats:?}");
    }
    let evicted: usize = stats
        .split("evicted ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no evicted count in {stats:?}"));
    assert!(evicted > 0, "the conversation outgrew the budget: {stats}");
    let (_, slots) = server.get("/slots");
    let slots: Value = serde_json::from_str(&slots).unwrap();
    assert_eq!(slots[0]["kv"]["policy"], "h2o", "{slots}");
    assert_eq!(slots[0]["kv"]["kv_budget"], 64, "{slots}");
    // the cache view: the conversation's tokens, some evicted
    let view = cdp.wait(
        r#"(() => { const s = document.getElementById("cache-sum").textContent; return s.includes("h2o@64") && document.querySelectorAll('#cache-view span.k0').length > 0 && document.querySelectorAll('#cache-view span.k1').length > 0 && s; })()"#,
        "the cache view",
        Duration::from_secs(30),
    );
    let cached = cdp.eval(r#"document.querySelectorAll('#cache-view span.k1').length"#);
    assert!(cached.as_u64().unwrap() <= 64, "{view}: {cached} cached");
    cdp.screenshot(&shots.join("webchat.png"));

    // 3. the conversation survives a reload (localStorage), and a message
    // with reasoning shows it as a collapsed, distinct <think> block
    let n_msgs = cdp.eval(r#"JSON.parse(localStorage.getItem("kvrun-chat")).messages.length"#);
    assert_eq!(n_msgs, json!(4));
    cdp.eval(
        r#"(() => { const s = JSON.parse(localStorage.getItem("kvrun-chat"));
            s.messages.push({role: "user", content: "What is 2 + 2?"});
            s.messages.push({role: "assistant", content: "4", reasoning: "Two plus two: count two more from two, that is four.", stats: null, status: "done"});
            localStorage.setItem("kvrun-chat", JSON.stringify(s)); location.reload(); return true; })()"#,
    );
    cdp.wait(
        r#"document.querySelectorAll(".msg").length === 6 && document.querySelectorAll('#policy option').length > 0"#,
        "the conversation after a reload",
        Duration::from_secs(30),
    );
    let think = cdp.eval(
        r#"(() => { const t = document.querySelector("details.think"); if (!t) return null;
            const cs = getComputedStyle(t), c = getComputedStyle(t.parentElement.querySelector(".content"));
            return {open: t.open, summary: t.querySelector("summary").textContent, text: t.querySelector(".reasoning").textContent,
                    distinct: cs.backgroundColor !== getComputedStyle(t.parentElement).backgroundColor && cs.borderLeftStyle === "solid",
                    content: t.parentElement.querySelector(".content").textContent, colour: cs.color !== c.color}; })()"#,
    );
    assert_eq!(think["open"], false, "collapsed by default: {think}");
    assert!(
        think["summary"].as_str().unwrap().contains("thinking"),
        "{think}"
    );
    assert!(think["text"].as_str().unwrap().contains("four"), "{think}");
    assert_eq!(think["content"], "4", "{think}");
    assert_eq!(think["distinct"], true, "{think}");
    assert_eq!(
        cdp.eval(r#"document.getElementById("policy").value"#),
        json!("h2o"),
        "the settings are kept too"
    );
    cdp.eval(r#"document.querySelector("details.think").open = true"#);
    cdp.screenshot(&shots.join("webchat-think.png"));
    drop(browser);
    if std::env::var_os("KVRUN_SCREENSHOT_DIR").is_none() {
        let _ = std::fs::remove_dir_all(&shots);
    }
}
