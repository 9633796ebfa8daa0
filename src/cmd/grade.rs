//! Answer extraction and grading for math benchmarks (MATH-500, GSM8K, AIME),
//! used by `kvrun batch`.
//!
//! Pure string functions, no model:
//! - [`extract_boxed`]: the content of the last `\boxed{…}` / `\fbox{…}` /
//!   `\framebox{…}` (nested braces handled);
//! - [`extract_gsm8k`]: the number after `####`, else the last `\boxed{}`,
//!   else the last number in the text;
//! - [`extract_answer`]: the extraction used for a benchmark kind (AIME:
//!   last box, else the last integer);
//! - [`normalize_answer`]: a canonical form of a LaTeX answer so that
//!   equivalent spellings compare equal;
//! - [`grade`]: normalized string equality, else numeric equality when both
//!   sides parse as numbers or simple fractions (relative tolerance 1e-6);
//!   AIME compares integers (leading zeros ignored).

/// Which benchmark's grading rules to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// LaTeX answers (MATH-500): `\boxed{}` extraction, normalized comparison.
    Math,
    /// GSM8K: numbers; the gold answer may be the full reference (`… #### n`).
    Gsm8k,
    /// AIME: integers 0–999, zero-padded gold answers ("025").
    Aime,
}

/// Find the matching `}` for the `{` at byte `open`; returns the content
/// and the byte index just past the closing brace.
fn braced(text: &str, open: usize) -> Option<(&str, usize)> {
    let b = text.as_bytes();
    if b.get(open) != Some(&b'{') {
        return None;
    }
    let mut depth = 0usize;
    let mut i = open;
    while i < b.len() {
        match b[i] {
            b'\\' => {
                // skip escaped braces \{ \}
                i += 2;
                continue;
            }
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some((&text[open + 1..i], i + 1));
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// Content of the last `\boxed{…}` (also `\fbox{…}`, `\framebox{…}`, and the
/// brace-less `\boxed 5`), nested braces handled. None when there is no box
/// or the last one is not closed.
pub fn extract_boxed(text: &str) -> Option<String> {
    let mut best: Option<(usize, usize)> = None; // (start, index after the command)
    for cmd in ["\\boxed", "\\fbox", "\\framebox"] {
        let mut from = 0;
        while let Some(p) = text[from..].find(cmd) {
            let s = from + p;
            let e = s + cmd.len();
            // a whole command, not a prefix of a longer one
            let next = text[e..].chars().next();
            if !next.is_some_and(|c| c.is_ascii_alphabetic()) && best.is_none_or(|(bs, _)| s > bs) {
                best = Some((s, e));
            }
            from = e;
        }
    }
    let (_, e) = best?;
    let rest = &text[e..];
    let trimmed = rest.trim_start();
    let open = e + (rest.len() - trimmed.len());
    if trimmed.starts_with('{') {
        return braced(text, open).map(|(c, _)| c.trim().to_owned());
    }
    // `\boxed 5`: up to whitespace or `$`
    let tok: String = trimmed
        .chars()
        .take_while(|c| !c.is_whitespace() && *c != '$')
        .collect();
    if tok.is_empty() {
        None
    } else {
        Some(tok)
    }
}

/// Numbers in `text` in order: `-?\d[\d,]*(\.\d+)?`, commas removed
/// (a comma not followed by three digits ends the number).
fn numbers(text: &str) -> Vec<String> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_digit()
            || (b[i] == b'.' && b.get(i + 1).is_some_and(|c| c.is_ascii_digit()))
        {
            let neg = i > 0 && b[i - 1] == b'-' && !(i > 1 && b[i - 2].is_ascii_alphanumeric());
            let mut s = String::new();
            if neg {
                s.push('-');
            }
            let mut j = i;
            while j < b.len() {
                let c = b[j];
                if c.is_ascii_digit() {
                    s.push(c as char);
                    j += 1;
                } else if c == b','
                    && j + 3 < b.len()
                    && b[j + 1..j + 4].iter().all(|d| d.is_ascii_digit())
                    && !b.get(j + 4).is_some_and(|d| d.is_ascii_digit())
                    && !s.contains('.')
                {
                    j += 1; // thousands separator
                } else if c == b'.'
                    && b.get(j + 1).is_some_and(|d| d.is_ascii_digit())
                    && !s.contains('.')
                {
                    s.push('.');
                    j += 1;
                } else {
                    break;
                }
            }
            if s.starts_with('.') || s.starts_with("-.") {
                s = s.replacen('.', "0.", 1);
            }
            out.push(s);
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

/// The GSM8K answer: the number after the last `####` (the reference
/// format), else the last `\boxed{}`, else the last number in the text.
/// Thousands separators are removed.
pub fn extract_gsm8k(text: &str) -> Option<String> {
    if let Some(p) = text.rfind("####") {
        let after = &text[p + 4..];
        if let Some(n) = numbers(after).into_iter().next() {
            return Some(n);
        }
    }
    if let Some(b) = extract_boxed(text) {
        return Some(b);
    }
    numbers(text).pop()
}

/// The last integer in `text` (AIME fallback when there is no box).
pub fn last_integer(text: &str) -> Option<String> {
    numbers(text).into_iter().rev().find(|n| !n.contains('.'))
}

/// The answer extraction for a benchmark kind: Math = last box; Gsm8k =
/// [`extract_gsm8k`]; Aime = last box, else the last integer.
pub fn extract_answer(text: &str, kind: Kind) -> Option<String> {
    match kind {
        Kind::Math => extract_boxed(text),
        Kind::Gsm8k => extract_gsm8k(text),
        Kind::Aime => extract_boxed(text).or_else(|| last_integer(text)),
    }
}

/// Remove `\name` where it is a whole command (not followed by a letter).
fn remove_cmd(s: &str, name: &str) -> String {
    replace_cmd(s, name, "")
}

/// Replace the whole command `\name` by `with`.
fn replace_cmd(s: &str, name: &str, with: &str) -> String {
    let pat = format!("\\{name}");
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(p) = rest.find(&pat) {
        let after = &rest[p + pat.len()..];
        let whole = !name.chars().last().is_some_and(|c| c.is_ascii_alphabetic())
            || !after
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic());
        out.push_str(&rest[..p]);
        if whole {
            out.push_str(with);
        } else {
            out.push_str(&pat);
        }
        rest = after;
    }
    out.push_str(rest);
    out
}

/// Unit words dropped from answers (inside `\text{}` or trailing).
const UNITS: &[&str] = &[
    "cm",
    "m",
    "km",
    "mm",
    "in",
    "inch",
    "inches",
    "ft",
    "foot",
    "feet",
    "yd",
    "yard",
    "yards",
    "mile",
    "miles",
    "meter",
    "meters",
    "metre",
    "metres",
    "centimeter",
    "centimeters",
    "kilometer",
    "kilometers",
    "unit",
    "units",
    "square",
    "sq",
    "cubic",
    "degree",
    "degrees",
    "deg",
    "radian",
    "radians",
    "dollar",
    "dollars",
    "cent",
    "cents",
    "hour",
    "hours",
    "hr",
    "hrs",
    "minute",
    "minutes",
    "min",
    "mins",
    "second",
    "seconds",
    "sec",
    "secs",
    "day",
    "days",
    "week",
    "weeks",
    "month",
    "months",
    "year",
    "years",
    "mph",
    "pound",
    "pounds",
    "lb",
    "lbs",
    "ounce",
    "ounces",
    "oz",
    "gram",
    "grams",
    "g",
    "kg",
    "kilogram",
    "kilograms",
    "liter",
    "liters",
    "l",
    "ml",
    "gallon",
    "gallons",
    "people",
    "students",
    "times",
    "percent",
    "points",
    "point",
    "ways",
    "p.m.",
    "a.m.",
    "pm",
    "am",
];

fn is_unit_phrase(s: &str) -> bool {
    let words: Vec<&str> = s
        .split(|c: char| c.is_whitespace() || c == '^' || c == '{' || c == '}' || c == '~')
        .filter(|w| !w.is_empty() && !w.chars().all(|c| c.is_ascii_digit()))
        .collect();
    !words.is_empty()
        && words
            .iter()
            .all(|w| UNITS.contains(&w.to_ascii_lowercase().trim_end_matches('.')))
}

/// Unwrap `\name{X}` to `X` (or drop it when `X` is a unit phrase and
/// `units` is set).
fn unwrap_cmd(s: &str, name: &str, units: bool) -> String {
    let pat = format!("\\{name}");
    let mut s = s.to_owned();
    let mut from = 0;
    while let Some(p) = s[from..].find(&pat).map(|p| p + from) {
        let after = p + pat.len();
        let rest = &s[after..];
        let t = rest.trim_start();
        let open = after + (rest.len() - t.len());
        if rest.chars().next().is_some_and(|c| c.is_ascii_alphabetic()) || !t.starts_with('{') {
            from = after;
            continue;
        }
        let Some((inner, end)) = braced(&s, open) else {
            from = after;
            continue;
        };
        let repl = if units && is_unit_phrase(inner) {
            String::new()
        } else {
            inner.to_owned()
        };
        s = format!("{}{}{}", &s[..p], repl, &s[end..]);
        from = p;
    }
    s
}

/// `\frac12` → `\frac{1}{2}`, `\sqrt2` → `\sqrt{2}` (single-character
/// arguments get braces). Run after whitespace removal.
fn brace_args(s: &str, cmd: &str, n_args: usize) -> String {
    let pat = format!("\\{cmd}");
    let mut out = String::with_capacity(s.len() + 8);
    let mut rest = s;
    while let Some(p) = rest.find(&pat) {
        out.push_str(&rest[..p]);
        out.push_str(&pat);
        let mut r = &rest[p + pat.len()..];
        // optional [n] for \sqrt
        if cmd == "sqrt" && r.starts_with('[') {
            if let Some(q) = r.find(']') {
                out.push_str(&r[..=q]);
                r = &r[q + 1..];
            }
        }
        for _ in 0..n_args {
            if r.starts_with('{') {
                // copy the braced group as is
                if let Some((_, end)) = braced(r, 0) {
                    out.push_str(&r[..end]);
                    r = &r[end..];
                    continue;
                }
                break;
            }
            if r.starts_with('\\') {
                // a command argument: \frac\pi2 → {\pi}
                let len = 1 + r[1..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphabetic())
                    .count()
                    .max(1);
                let len = r.char_indices().nth(len).map_or(r.len(), |(i, _)| i);
                out.push('{');
                out.push_str(&r[..len]);
                out.push('}');
                r = &r[len..];
                continue;
            }
            match r.chars().next() {
                Some(c) if c != '}' && c != '^' && c != '_' => {
                    out.push('{');
                    out.push(c);
                    out.push('}');
                    r = &r[c.len_utf8()..];
                }
                _ => break,
            }
        }
        rest = r;
    }
    out.push_str(rest);
    out
}

fn is_int(s: &str) -> bool {
    let d = s.strip_prefix('-').unwrap_or(s);
    !d.is_empty() && d.chars().all(|c| c.is_ascii_digit())
}

/// `1,000` / `12,345.5` (thousands groups) → without commas; else unchanged.
fn strip_thousands(s: &str) -> String {
    let body = s.strip_prefix('-').unwrap_or(s);
    let (int, frac) = match body.split_once('.') {
        Some((a, b)) => (a, Some(b)),
        None => (body, None),
    };
    let groups: Vec<&str> = int.split(',').collect();
    let ok = groups.len() > 1
        && (1..=3).contains(&groups[0].len())
        && groups
            .iter()
            .all(|g| !g.is_empty() && g.chars().all(|c| c.is_ascii_digit()))
        && groups[1..].iter().all(|g| g.len() == 3)
        && frac.is_none_or(|f| !f.is_empty() && f.chars().all(|c| c.is_ascii_digit()));
    if ok {
        s.replace(',', "")
    } else {
        s.to_owned()
    }
}

/// Is `s` a "variable" on the left of `=` (x, y_1, x_{10}, \alpha, f(x))?
fn is_variable(s: &str) -> bool {
    let simple = |t: &str| {
        let mut cs = t.chars();
        match cs.next() {
            Some(c) if c.is_ascii_alphabetic() => {}
            Some('\\') => return t.len() > 1 && t[1..].chars().all(|c| c.is_ascii_alphabetic()),
            _ => return false,
        }
        let r: String = cs.collect();
        r.is_empty()
            || r.starts_with('_')
                && r[1..]
                    .trim_matches(|c| c == '{' || c == '}')
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric())
            || r.starts_with('(') && r.ends_with(')') && r.len() <= 6
            || r.chars().all(|c| c.is_ascii_digit())
    };
    !s.is_empty() && s.len() <= 12 && simple(s)
}

/// A canonical form of an answer so that equivalent spellings compare
/// equal; see the module docs for the rules.
pub fn normalize_answer(s: &str) -> String {
    let mut s = s.trim().to_owned();
    // units and words inside \text{} / \mbox{} (before spaces go)
    for c in [
        "text",
        "textbf",
        "textrm",
        "textit",
        "mathrm",
        "mathbf",
        "mathit",
        "mbox",
        "textnormal",
        "operatorname",
        "boxed",
    ] {
        s = unwrap_cmd(&s, c, true);
    }
    s = s.replace("\\$", "").replace('$', "");
    for c in [
        "left",
        "right",
        "displaystyle",
        "!",
        ",",
        ";",
        ":",
        " ",
        "quad",
        "qquad",
        "limits",
    ] {
        s = remove_cmd(&s, c);
    }
    s = replace_cmd(&s, "dfrac", "\\frac");
    s = replace_cmd(&s, "tfrac", "\\frac");
    s = replace_cmd(&s, "dbinom", "\\binom");
    s = replace_cmd(&s, "tbinom", "\\binom");
    s = replace_cmd(&s, "le", "\\leq");
    s = replace_cmd(&s, "ge", "\\geq");
    // degrees and percent
    for pat in [
        "^{\\circ}",
        "^\\circ",
        "^{\\circ }",
        "\\circ",
        "°",
        "\\%",
        "%",
        "\\$",
    ] {
        s = s.replace(pat, "");
    }
    s = s.replace("^{ \\circ}", "");
    // trailing unit words written without \text ("10 inches", "5 cm")
    loop {
        let t = s.trim_end();
        match t.rsplit_once(char::is_whitespace) {
            Some((head, last)) if !head.trim().is_empty() && is_unit_phrase(last) => {
                s = head.to_owned()
            }
            _ => break,
        }
    }
    // whitespace
    s.retain(|c| !c.is_whitespace());
    // trailing periods
    while let Some(t) = s.strip_suffix('.').or_else(|| s.strip_suffix("\\.")) {
        s = t.to_owned();
    }
    s = brace_args(&s, "frac", 2);
    s = brace_args(&s, "binom", 2);
    s = brace_args(&s, "sqrt", 1);
    // "x=5" → "5" (a single equation whose left side is a variable)
    if s.matches('=').count() == 1 {
        let (l, r) = s.split_once('=').unwrap();
        if is_variable(l) && !r.is_empty() {
            s = r.to_owned();
        }
    }
    // \{a\} → a for single elements is not done (sets stay sets)
    // outer parentheses around a single number or letter: "(C)" → "C"
    if let Some(inner) = s.strip_prefix('(').and_then(|t| t.strip_suffix(')')) {
        if is_int(inner)
            || inner.parse::<f64>().is_ok()
            || (inner.chars().count() == 1 && inner.chars().all(|c| c.is_ascii_alphabetic()))
        {
            s = inner.to_owned();
        }
    }
    s = strip_thousands(&s);
    // leading "+" and leading zeros of integers
    if let Some(t) = s.strip_prefix('+') {
        if t.parse::<f64>().is_ok() {
            s = t.to_owned();
        }
    }
    if is_int(&s) {
        let neg = s.starts_with('-');
        let d = s.trim_start_matches('-').trim_start_matches('0');
        let d = if d.is_empty() { "0" } else { d };
        s = if neg && d != "0" {
            format!("-{d}")
        } else {
            d.to_owned()
        };
    }
    // 2.50 → 2.5, 3.0 → 3
    if s.contains('.') && s.parse::<f64>().is_ok() && !s.contains(['e', 'E']) {
        let t = s.trim_end_matches('0').trim_end_matches('.');
        s = if t.is_empty() || t == "-" {
            "0".into()
        } else {
            t.to_owned()
        };
    }
    s
}

/// The value of a normalized answer that is a number or a simple fraction:
/// `12`, `-0.5`, `\frac{1}{2}`, `-\frac{3}{4}`, `3/4`.
pub fn numeric_value(s: &str) -> Option<f64> {
    let plain = |t: &str| -> Option<f64> {
        if t.is_empty()
            || !t
                .chars()
                .all(|c| c.is_ascii_digit() || c == '.' || c == '-')
        {
            return None;
        }
        t.parse::<f64>().ok().filter(|v| v.is_finite())
    };
    if let Some(v) = plain(s) {
        return Some(v);
    }
    let (neg, body) = match s.strip_prefix('-') {
        Some(b) => (true, b),
        None => (false, s),
    };
    let sign = if neg { -1.0 } else { 1.0 };
    if let Some(r) = body.strip_prefix("\\frac") {
        let (a, e1) = braced(r, 0)?;
        let (b, e2) = braced(&r[e1..], 0)?;
        if e1 + e2 != r.len() {
            return None;
        }
        let (a, b) = (plain(a)?, plain(b)?);
        return (b != 0.0).then(|| sign * a / b);
    }
    if let Some((a, b)) = body.split_once('/') {
        let (a, b) = (plain(a)?, plain(b)?);
        return (b != 0.0).then(|| sign * a / b);
    }
    None
}

fn numbers_equal(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * a.abs().max(b.abs()).max(1.0)
}

/// Is the predicted answer `pred` (already extracted) equal to `gold`?
/// For Gsm8k a gold containing `####` is reduced to its number first.
pub fn grade(pred: &str, gold: &str, kind: Kind) -> bool {
    let gold_owned;
    let gold = match kind {
        Kind::Gsm8k if gold.contains("####") => {
            gold_owned = extract_gsm8k(gold).unwrap_or_default();
            gold_owned.as_str()
        }
        _ => gold,
    };
    let (p, g) = (normalize_answer(pred), normalize_answer(gold));
    if p.is_empty() || g.is_empty() {
        return false;
    }
    match kind {
        Kind::Aime => {
            if is_int(&p) && is_int(&g) {
                return p == g;
            }
            p == g
                || matches!((numeric_value(&p), numeric_value(&g)), (Some(a), Some(b)) if numbers_equal(a, b))
        }
        Kind::Gsm8k | Kind::Math => {
            if p == g {
                return true;
            }
            matches!((numeric_value(&p), numeric_value(&g)), (Some(a), Some(b)) if numbers_equal(a, b))
        }
    }
}
