//! The crate's layering, checked from the source text.
//!
//! Every `use crate::…` / `use super::…` item (brace groups expanded) and
//! every `crate::a::b` path in `src/**/*.rs` (comments and `#[cfg(test)]`
//! modules left out) becomes an edge from the file's module to the module the
//! path names. Then:
//!
//! - no cycle between top-level modules (`crate::X`, a folder counting as
//!   one module);
//! - no cycle between sibling files (and sub-folders) inside each folder; a
//!   folder's `mod.rs` and its own children may refer to each other;
//! - nothing below the command layer imports from `crate::cmd`.
//!
//! Offending edges are printed with the files that make them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The library below the command layer: none of it may import `crate::cmd`.
const ENGINE: &[&str] = &[
    "model",
    "policy",
    "kv",
    "backend",
    "load",
    "format",
    "tensor",
    "quant",
    "generate",
    "signals",
    "tokenizer",
    "sample",
    "rng",
    "chat",
    "error",
    "train",
];

/// Known cycles being removed elsewhere: (folder, from, to) edges ignored by
/// the cycle check. Each entry must name its reason.
const ALLOWED: &[(&str, &str, &str)] = &[
    // none: the backend/cpu <-> decode512 circle went with the device seam
    // (decode_avx512 reads only cpu/kv_store).
];

/// A module path from the crate root (`[]` = lib.rs).
type Module = Vec<String>;

/// One import: the file it is in, the importing module and the target module.
#[derive(Debug, Clone)]
struct Import {
    file: PathBuf,
    from: Module,
    to: Module,
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `src/a/b.rs` → `[a, b]`, `src/a/mod.rs` → `[a]`, `src/lib.rs` → `[]`;
/// None for the binary's `main.rs`.
fn module_of(rel: &Path) -> Option<Module> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop()?;
    if parts.is_empty() && last == "main.rs" {
        return None;
    }
    let stem = last.trim_end_matches(".rs");
    if !(stem == "mod" || (parts.is_empty() && stem == "lib")) {
        parts.push(stem.to_owned());
    }
    Some(parts)
}

/// The source without comments, string contents and `#[cfg(test)]` items
/// (test modules may import what the module itself must not).
fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if b[i] == b'"' {
            // a string literal (raw strings of the r"..." / r#"..."# kind too)
            let raw_hashes = raw_prefix(b, i);
            i += 1;
            while i < b.len() {
                if raw_hashes.is_none() && b[i] == b'\\' {
                    i += 2;
                    continue;
                }
                if b[i] == b'"' {
                    let h = raw_hashes.unwrap_or(0);
                    if b[i + 1..].iter().take(h).all(|&c| c == b'#') && i + h < b.len() {
                        i += 1 + h;
                        break;
                    }
                }
                i += 1;
            }
            out.push_str("\"\"");
        } else if b[i] == b'\'' && i + 2 < b.len() && (b[i + 2] == b'\'' || b[i + 1] == b'\\') {
            // a char literal ('"', '\'', '\n'); lifetimes are left alone
            let end = b[i + 1..]
                .iter()
                .skip(1)
                .position(|&c| c == b'\'')
                .map_or(b.len(), |p| i + 2 + p + 1);
            i = end;
            out.push_str("' '");
        } else {
            let c = src[i..].chars().next().expect("char boundary");
            out.push(c);
            i += c.len_utf8();
        }
    }
    remove_cfg_test(&out)
}

/// `Some(n)` when the `"` at `i` opens a raw string with `n` hashes.
fn raw_prefix(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i;
    let mut hashes = 0;
    while j > 0 && b[j - 1] == b'#' {
        j -= 1;
        hashes += 1;
    }
    let is_raw = j > 0
        && b[j - 1] == b'r'
        && (j < 2 || !(b[j - 2].is_ascii_alphanumeric() || b[j - 2] == b'_') || b[j - 2] == b'b');
    is_raw.then_some(hashes)
}

/// Drop every item that follows `#[cfg(test)]` (to its closing brace or `;`).
fn remove_cfg_test(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        let mut depth = 0usize;
        let mut end = tail.len();
        for (k, c) in tail.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = k + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = k + 1;
                    break;
                }
                _ => {}
            }
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// Expand a `use` tree (`a::{b, c::{d, self}}`) into its paths.
fn expand_use(tree: &str) -> Vec<String> {
    // `x as y` keeps `x`: mark the rename before dropping whitespace
    let tree: String = tree
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace(" as ", "@")
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    let mut out = Vec::new();
    expand_into("", &tree, &mut out);
    out
}

fn expand_into(prefix: &str, tree: &str, out: &mut Vec<String>) {
    match tree.find('{') {
        None => {
            let leaf = tree.split('@').next().unwrap_or(tree);
            let path = if leaf == "self" {
                prefix.trim_end_matches("::").to_owned()
            } else {
                format!("{prefix}{leaf}")
            };
            if !path.is_empty() {
                out.push(path);
            }
        }
        Some(open) => {
            let head = &tree[..open];
            let close = tree.rfind('}').unwrap_or(tree.len());
            let inner = &tree[open + 1..close];
            let mut depth = 0;
            let mut start = 0;
            let mut parts = Vec::new();
            for (k, c) in inner.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        parts.push(&inner[start..k]);
                        start = k + 1;
                    }
                    _ => {}
                }
            }
            parts.push(&inner[start..]);
            for p in parts.into_iter().filter(|p| !p.is_empty()) {
                expand_into(&format!("{prefix}{head}"), p, out);
            }
        }
    }
}

/// The crate-relative paths a (stripped) file refers to, from the module
/// `me`: `use` items (with `crate::`, `super::`, `self::`) and inline
/// `crate::…` / `super::…` paths.
fn paths_in(src: &str, me: &Module) -> Vec<Vec<String>> {
    // the module `super` names (for a folder's mod.rs, `me` is the folder)
    let parent: Module = me[..me.len().saturating_sub(1)].to_vec();
    let resolve = |p: &str| -> Option<Vec<String>> {
        let segs: Vec<&str> = p.split("::").filter(|s| !s.is_empty()).collect();
        let (base, rest): (Vec<String>, &[&str]) = match *segs.first()? {
            "crate" => (Vec::new(), &segs[1..]),
            "super" => {
                let mut base = parent.clone();
                let mut rest = &segs[1..];
                while rest.first() == Some(&"super") {
                    base.pop();
                    rest = &rest[1..];
                }
                (base, rest)
            }
            "self" => (me.clone(), &segs[1..]),
            _ => return None,
        };
        let mut full = base;
        full.extend(rest.iter().filter(|s| **s != "*").map(|s| s.to_string()));
        Some(full)
    };
    let mut out = Vec::new();
    // `use` items (what is left over is searched for inline paths)
    let mut rest = src;
    let mut code = String::with_capacity(src.len());
    while let Some(at) = find_word(rest, "use") {
        code.push_str(&rest[..at]);
        let after = &rest[at + 3..];
        let end = after.find(';').unwrap_or(after.len());
        for p in expand_use(&after[..end]) {
            if let Some(r) = resolve(&p) {
                out.push(r);
            }
        }
        rest = &after[end..];
    }
    code.push_str(rest);
    // inline paths
    for kw in ["crate::", "super::"] {
        let mut rest = code.as_str();
        while let Some(at) = rest.find(kw) {
            let before = rest[..at].chars().next_back();
            let path_start = &rest[at..];
            let len = path_start
                .char_indices()
                .find(|&(_, c)| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .map_or(path_start.len(), |(k, _)| k);
            let ok =
                !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$' || c == ':');
            if ok {
                if let Some(r) = resolve(path_start[..len].trim_end_matches(':')) {
                    out.push(r);
                }
            }
            rest = &rest[at + kw.len()..];
        }
    }
    out
}

/// Position of `word` as a whole word (an identifier on its own).
fn find_word(s: &str, word: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(k) = s[from..].find(word) {
        let at = from + k;
        let b = s.as_bytes();
        let before_ok = at == 0 || !(b[at - 1].is_ascii_alphanumeric() || b[at - 1] == b'_');
        let end = at + word.len();
        let after_ok = end < b.len() && b[end].is_ascii_whitespace();
        if before_ok && after_ok {
            return Some(at);
        }
        from = end;
    }
    None
}

/// Every import of every file under `src/`.
fn imports() -> (BTreeSet<Module>, Vec<Import>) {
    let root = src_dir();
    let mut files = Vec::new();
    rs_files(&root, &mut files);
    let mut mods = BTreeSet::new();
    let mut parsed = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&root).expect("under src");
        let Some(m) = module_of(rel) else { continue };
        mods.insert(m.clone());
        let text = std::fs::read_to_string(f).expect("read source");
        parsed.push((rel.to_owned(), m, strip(&text)));
    }
    let mut out = Vec::new();
    for (rel, m, text) in parsed {
        for p in paths_in(&text, &m) {
            // the longest known module prefix is what the path names
            let target = (0..=p.len())
                .rev()
                .map(|k| p[..k].to_vec())
                .find(|prefix| mods.contains(prefix))
                .unwrap_or_default();
            if target != m {
                out.push(Import {
                    file: rel.clone(),
                    from: m.clone(),
                    to: target,
                });
            }
        }
    }
    (mods, out)
}

/// Edges between the children of `folder`: `from`'s and `to`'s child of
/// `folder` when both lie strictly below it (the folder's own mod.rs takes
/// no part), with the files that make each edge.
fn folder_edges(
    folder: &[String],
    imps: &[Import],
) -> BTreeMap<(String, String), BTreeSet<String>> {
    let n = folder.len();
    let mut edges: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    for i in imps {
        let (a, b) = (&i.from, &i.to);
        if a.len() > n && b.len() > n && a[..n] == *folder && b[..n] == *folder && a[n] != b[n] {
            edges
                .entry((a[n].clone(), b[n].clone()))
                .or_default()
                .insert(i.file.display().to_string());
        }
    }
    edges
}

/// Strongly connected components with more than one node (the cycles),
/// each sorted, in sorted order (Tarjan's algorithm).
fn cycles(edges: &BTreeSet<(String, String)>) -> Vec<Vec<String>> {
    let nodes: BTreeSet<&String> = edges.iter().flat_map(|(a, b)| [a, b]).collect();
    let nodes: Vec<&String> = nodes.into_iter().collect();
    let idx: BTreeMap<&String, usize> = nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let mut adj = vec![Vec::new(); nodes.len()];
    for (a, b) in edges {
        adj[idx[a]].push(idx[b]);
    }
    struct Tarjan<'g> {
        adj: &'g [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        sccs: Vec<Vec<usize>>,
    }
    impl Tarjan<'_> {
        fn visit(&mut self, v: usize) {
            self.index[v] = Some(self.next);
            self.low[v] = self.next;
            self.next += 1;
            self.stack.push(v);
            self.on_stack[v] = true;
            for &w in &self.adj[v] {
                match self.index[w] {
                    None => {
                        self.visit(w);
                        self.low[v] = self.low[v].min(self.low[w]);
                    }
                    Some(iw) if self.on_stack[w] => self.low[v] = self.low[v].min(iw),
                    _ => {}
                }
            }
            if Some(self.low[v]) == self.index[v] {
                let mut scc = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack[w] = false;
                    scc.push(w);
                    if w == v {
                        break;
                    }
                }
                self.sccs.push(scc);
            }
        }
    }
    let n = nodes.len();
    let mut t = Tarjan {
        adj: &adj,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        sccs: Vec::new(),
    };
    for v in 0..n {
        if t.index[v].is_none() {
            t.visit(v);
        }
    }
    let mut out: Vec<Vec<String>> = t
        .sccs
        .into_iter()
        .filter(|s| s.len() > 1)
        .map(|s| {
            let mut names: Vec<String> = s.into_iter().map(|i| nodes[i].clone()).collect();
            names.sort();
            names
        })
        .collect();
    out.sort();
    out
}

fn show(m: &[String]) -> String {
    if m.is_empty() {
        "crate".into()
    } else {
        m.join("::")
    }
}

#[test]
fn no_cycles_and_no_upward_imports() {
    let (mods, imps) = imports();
    assert!(
        imps.len() > 50,
        "only {} imports found: is the parser broken?",
        imps.len()
    );
    let mut problems = Vec::new();

    // every folder (the crate root included) is one level
    let folders: BTreeSet<Module> = mods
        .iter()
        .filter(|m| {
            mods.iter()
                .any(|c| c.len() == m.len() + 1 && c[..m.len()] == m[..])
        })
        .cloned()
        .collect();
    for folder in &folders {
        let edges = folder_edges(folder, &imps);
        let name = show(folder);
        for (f, a, b) in ALLOWED.iter().filter(|(f, ..)| *f == name) {
            let present = edges.contains_key(&(a.to_string(), b.to_string()));
            println!(
                "{f}: allowed edge {a} -> {b} {}",
                if present {
                    "(present, being removed)"
                } else {
                    "(gone: delete it from ALLOWED)"
                }
            );
        }
        let checked: BTreeSet<(String, String)> = edges
            .keys()
            .filter(|(a, b)| !ALLOWED.contains(&(name.as_str(), a.as_str(), b.as_str())))
            .cloned()
            .collect();
        println!("{name}: {} edges between its modules", edges.len());
        for cyc in cycles(&checked) {
            let mut lines = vec![format!("cycle in {name}: {}", cyc.join(" ↔ "))];
            for ((a, b), files) in &edges {
                if cyc.contains(a) && cyc.contains(b) && checked.contains(&(a.clone(), b.clone())) {
                    let files: Vec<&str> = files.iter().map(String::as_str).collect();
                    lines.push(format!("    {a} -> {b}   ({})", files.join(", ")));
                }
            }
            problems.push(lines.join("\n"));
        }
    }

    // the engine never reaches up into the command layer
    for i in &imps {
        let below = i.from.first().is_some_and(|m| ENGINE.contains(&m.as_str()));
        if below && i.to.first().map(String::as_str) == Some("cmd") {
            problems.push(format!(
                "upward import: {} -> {}   ({})",
                show(&i.from),
                show(&i.to),
                i.file.display()
            ));
        }
    }
    // every top-level module is classified
    for m in mods.iter().filter(|m| m.len() == 1) {
        let known = ENGINE.contains(&m[0].as_str()) || m[0] == "cmd";
        if !known {
            problems.push(format!(
                "top-level module {} is neither engine nor cmd: add it to ENGINE in tests/layers.rs",
                m[0]
            ));
        }
    }

    let top = folder_edges(&[], &imps);
    println!("top-level edges:");
    for (a, b) in top.keys() {
        println!("    {a} -> {b}");
    }
    assert!(
        problems.is_empty(),
        "layering broken:\n{}",
        problems.join("\n")
    );
}

#[test]
fn cycle_detector_on_hand_made_graphs() {
    let g = |edges: &[(&str, &str)]| -> BTreeSet<(String, String)> {
        edges
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    };
    // a -> b -> c -> a is a cycle; d only points into it
    let found = cycles(&g(&[
        ("a", "b"),
        ("b", "c"),
        ("c", "a"),
        ("d", "a"),
        ("c", "e"),
    ]));
    assert_eq!(found, vec![vec!["a", "b", "c"]]);
    // two separate circles, one of them a pair
    let found = cycles(&g(&[
        ("x", "y"),
        ("y", "x"),
        ("p", "q"),
        ("q", "r"),
        ("r", "p"),
    ]));
    assert_eq!(found, vec![vec!["p", "q", "r"], vec!["x", "y"]]);
    // a diamond has none
    assert!(cycles(&g(&[("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])).is_empty());
}

#[test]
fn parser_finds_grouped_relative_and_inline_paths() {
    let src = r#"
        //! docs mention crate::cmd, which must not count
        use crate::{chat::{self, ChatTemplate}, error::Result as R};
        use super::api::{Job, Ev};
        use std::io;
        fn f() { let s = "crate::cmd::x"; crate::kv::KvType::parse(s); }
        /* crate::cmd in a block comment */
        #[cfg(test)]
        mod tests { use crate::cmd::Cli; }
    "#;
    let me: Module = vec!["cmd".into(), "serve".into(), "slots".into()];
    let mut got: Vec<String> = paths_in(&strip(src), &me)
        .into_iter()
        .map(|p| p.join("::"))
        .collect();
    got.sort();
    got.dedup();
    assert_eq!(
        got,
        vec![
            "chat",
            "chat::ChatTemplate",
            "cmd::serve::api::Ev",
            "cmd::serve::api::Job",
            "error::Result",
            "kv::KvType::parse",
        ]
    );
    // a mod.rs's `super` is its folder's parent
    let me: Module = vec!["cmd".into(), "serve".into()];
    let got = paths_in(&strip("use super::args::KvArgs;"), &me);
    assert_eq!(got, vec![vec!["cmd", "args", "KvArgs"]]);
}
