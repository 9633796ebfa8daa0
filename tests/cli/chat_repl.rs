//! `kvrun chat`: driven through a pipe (scripting) and through a real
//! terminal (tmux), on the default model.

use crate::util;

use std::io::Write;
use std::process::{Command, Stdio};

fn chat_pipe(args: &[&str], input: &str) -> (String, String, bool) {
    let model = util::default_model();
    let mut child = Command::new(util::kvrun_bin())
        .arg("chat")
        .args([
            "-m",
            model.to_str().unwrap(),
            "--temp",
            "0",
            "-n",
            "24",
            "-t",
            "2",
        ])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvrun chat");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        out.status.success(),
    )
}

/// Two turns over a pipe: the cache carries over (the second turn feeds only
/// the new tokens, so the position grows by less than a full re-prefill),
/// /stats, /save, /regen and /clear work, and the answers match a fresh
/// session given the same history (greedy).
#[test]
fn chat_over_a_pipe_carries_the_cache() {
    let dir = std::env::temp_dir().join(format!("kvrun-chat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let save = dir.join("conv.json");
    let input = format!(
        "What is the capital of Italy?\n/stats\nAnd of Spain?\n/stats\n/save {}\n/regen\n/clear\n/stats\n/exit\n",
        save.display()
    );
    let (out, err, ok) = chat_pipe(&[], &input);
    assert!(ok, "chat failed: {err}");
    let stats: Vec<&str> = out.lines().filter(|l| l.starts_with("[kv:")).collect();
    assert_eq!(stats.len(), 3, "expected three /stats lines in:\n{out}");
    let pos = |l: &str| -> usize {
        l.split("position ")
            .nth(1)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .trim_end_matches(',')
            .parse()
            .unwrap()
    };
    let (p1, p2, p3) = (pos(stats[0]), pos(stats[1]), pos(stats[2]));
    assert!(p1 > 20 && p2 > p1, "positions {p1} -> {p2}");
    // the second turn appended to the first instead of re-prefilling it
    assert!(
        p2 - p1 < p1 + 30,
        "second turn re-fed the history: {p1} -> {p2}"
    );
    assert_eq!(p3, 0, "/clear did not reset the cache");
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&save).unwrap()).unwrap();
    let roles: Vec<&str> = saved
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "user", "assistant"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A real terminal: tmux runs `kvrun chat`, we type a question and read the
/// screen. CI installs tmux (.ci/run).
#[test]
fn chat_in_a_terminal() {
    let have_tmux = Command::new("tmux")
        .arg("-V")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        have_tmux,
        "tmux is required for this test (apt-get install tmux)"
    );
    let model = util::default_model();
    let sock = format!("kvrun-test-{}", std::process::id());
    let cmd = format!(
        "{} chat -m {} --temp 0 -n 16 -t 2",
        util::kvrun_bin().display(),
        model.display()
    );
    let tmux = |args: &[&str]| {
        Command::new("tmux")
            .args(["-L", &sock])
            .args(args)
            .output()
            .unwrap()
    };
    // kill the tmux server (and kvrun in it) even when an assertion fails
    struct Kill(String);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = Command::new("tmux")
                .args(["-L", &self.0, "kill-server"])
                .output();
        }
    }
    let _kill = Kill(sock.clone());
    let o = tmux(&["new-session", "-d", "-x", "200", "-y", "50", &cmd]);
    assert!(o.status.success(), "tmux new-session failed");
    let screen = |t: &dyn Fn(&[&str]) -> std::process::Output| {
        String::from_utf8_lossy(&t(&["capture-pane", "-p"]).stdout).into_owned()
    };
    let wait_for = |pred: &dyn Fn(&str) -> bool| -> String {
        for _ in 0..120 {
            let s = screen(&tmux);
            if pred(&s) {
                return s;
            }
            std::thread::sleep(std::time::Duration::from_millis(250));
        }
        screen(&tmux)
    };
    // capture-pane trims trailing spaces: a prompt line is ">" or "> ..."
    let prompts = |s: &str| {
        s.lines()
            .filter(|l| l.trim_end() == ">" || l.starts_with("> "))
            .count()
    };
    let s = wait_for(&|s| prompts(s) >= 1);
    assert!(prompts(&s) >= 1, "no prompt on screen:\n{s}");
    tmux(&["send-keys", "Say hello.", "Enter"]);
    let s = wait_for(&|s| prompts(s) >= 2);
    assert!(prompts(&s) >= 2, "no reply / second prompt on screen:\n{s}");
    assert!(s.contains("> Say hello."), "typed text not echoed:\n{s}");
    tmux(&["send-keys", "/stats", "Enter"]);
    let s = wait_for(&|s| s.contains("[kv:"));
    assert!(s.contains("[kv:"), "/stats not shown:\n{s}");
    tmux(&["send-keys", "/exit", "Enter"]);
    std::thread::sleep(std::time::Duration::from_millis(500));
    let _ = tmux(&["kill-server"]);
}
