//! Answer extraction and grading: unit equivalences plus 100% self-agreement
//! on the real reference solutions of MATH-500, GSM8K and AIME 2024.

use kvrun::cmd::grade::{
    extract_answer, extract_boxed, extract_gsm8k, grade, normalize_answer, Kind,
};

fn data(name: &str) -> Vec<serde_json::Value> {
    let p = format!("{}/../shared/data/{name}", env!("CARGO_MANIFEST_DIR"));
    let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p}: {e}"));
    s.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("valid JSON"))
        .collect()
}

fn field<'a>(r: &'a serde_json::Value, k: &str) -> &'a str {
    r[k].as_str()
        .unwrap_or_else(|| panic!("missing string field {k}"))
}

#[test]
fn math500_reference_solutions_grade_100_percent() {
    let recs = data("math500_test.jsonl");
    assert_eq!(recs.len(), 500);
    let mut bad = Vec::new();
    for r in &recs {
        let pred = extract_boxed(field(r, "solution"));
        let ok = pred
            .as_deref()
            .is_some_and(|p| grade(p, field(r, "answer"), Kind::Math));
        if !ok {
            bad.push(format!(
                "{}: {:?} vs {:?}",
                field(r, "unique_id"),
                pred,
                field(r, "answer")
            ));
        }
    }
    eprintln!(
        "MATH-500: {}/{} reference solutions graded correct",
        recs.len() - bad.len(),
        recs.len()
    );
    assert!(
        bad.is_empty(),
        "{} failures:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn gsm8k_reference_answers_extract_100_percent() {
    let recs = data("gsm8k_test.jsonl");
    assert_eq!(recs.len(), 1319);
    let mut bad = Vec::new();
    for (i, r) in recs.iter().enumerate() {
        let ans = field(r, "answer");
        // gold: the text after "####", thousands separators dropped
        let gold = ans
            .rsplit_once("####")
            .expect("#### in reference")
            .1
            .trim()
            .replace(',', "");
        let got = extract_gsm8k(ans);
        let ok = got.as_deref() == Some(gold.as_str())
            && grade(got.as_deref().unwrap(), ans, Kind::Gsm8k);
        if !ok {
            bad.push(format!("record {i}: {got:?} vs {gold:?}"));
        }
    }
    eprintln!(
        "GSM8K: {}/{} reference answers extracted and graded",
        recs.len() - bad.len(),
        recs.len()
    );
    assert!(
        bad.is_empty(),
        "{} failures:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn aime24_reference_solutions_grade_100_percent() {
    let recs = data("aime24.jsonl");
    assert_eq!(recs.len(), 30);
    let mut bad = Vec::new();
    let mut no_box = Vec::new();
    for r in &recs {
        let sol = field(r, "solution");
        if extract_boxed(sol).is_none() {
            no_box.push(r["id"].to_string());
        }
        let pred = extract_answer(sol, Kind::Aime);
        let ok = pred
            .as_deref()
            .is_some_and(|p| grade(p, field(r, "answer"), Kind::Aime));
        if !ok {
            bad.push(format!(
                "id {}: {:?} vs {:?}",
                r["id"],
                pred,
                field(r, "answer")
            ));
        }
    }
    eprintln!(
        "AIME24: {}/{} reference solutions graded correct; without a box (last-integer fallback): {:?}",
        recs.len() - bad.len(),
        recs.len(),
        no_box
    );
    assert!(
        bad.is_empty(),
        "{} failures:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn boxed_extraction() {
    assert_eq!(
        extract_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}}.").as_deref(),
        Some("\\frac{1}{2}")
    );
    assert_eq!(
        extract_boxed("\\fbox{x^{2}} done").as_deref(),
        Some("x^{2}")
    );
    assert_eq!(
        extract_boxed("so $\\framebox{204}$ minutes").as_deref(),
        Some("204")
    );
    assert_eq!(
        extract_boxed("\\boxed{\\{1,2\\}}").as_deref(),
        Some("\\{1,2\\}")
    );
    assert_eq!(extract_boxed("$\\boxed 5$").as_deref(), Some("5"));
    assert_eq!(extract_boxed("no box here 42"), None);
    assert_eq!(extract_boxed("truncated \\boxed{\\frac{1}{"), None);
}

#[test]
fn gsm8k_extraction() {
    assert_eq!(
        extract_gsm8k("so 3+4=7\n#### 1,200").as_deref(),
        Some("1200")
    );
    assert_eq!(
        extract_gsm8k("The answer is \\boxed{18}.").as_deref(),
        Some("18")
    );
    assert_eq!(
        extract_gsm8k("She pays $2 and then $1,000.50 in total.").as_deref(),
        Some("1000.50")
    );
    assert_eq!(
        extract_gsm8k("the change is -5 dollars").as_deref(),
        Some("-5")
    );
    assert_eq!(extract_gsm8k("nothing"), None);
    assert!(grade("18.00", "bla\n#### 18", Kind::Gsm8k));
    assert!(!grade("19", "bla\n#### 18", Kind::Gsm8k));
}

#[test]
fn equivalences() {
    let eq = |a: &str, b: &str| {
        assert!(
            grade(a, b, Kind::Math),
            "{a:?} should equal {b:?} ({:?} vs {:?})",
            normalize_answer(a),
            normalize_answer(b)
        )
    };
    eq("\\frac{1}{2}", "0.5");
    eq("\\dfrac12", "\\frac{1}{2}");
    eq("\\tfrac{1}{2}", "0.5");
    eq("1/2", "\\frac12");
    eq("10^\\circ", "10");
    eq("10^{\\circ}", "10");
    eq("\\text{(C)}", "C");
    eq("(C)", "\\text{C}");
    eq("1,000", "1000");
    eq("x = 5", "5");
    eq("y_1=-3", "-3");
    eq("\\sqrt2", "\\sqrt{2}");
    eq("2\\sqrt3", "2\\sqrt{3}");
    eq("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})");
    eq("5\\text{ cm}", "5");
    eq("12 inches", "12");
    eq("45 degrees", "45");
    eq("50\\%", "50");
    eq("$7$.", "7");
    eq("\\$18.00", "18");
    eq("\\!1\\,000", "1000");
    eq("\\mbox{ inches}12", "12");
    eq("-\\frac{3}{4}", "-0.75");
    assert!(grade("025", "25", Kind::Aime));
    assert!(grade("25", "025", Kind::Aime));
    assert!(grade("\\textbf{(113) }", "113", Kind::Aime));
    assert!(grade("\\mathbf{127} ", "127", Kind::Aime));
    assert!(grade("104.", "104", Kind::Aime));
}

#[test]
fn non_equivalences() {
    let ne = |a: &str, b: &str| assert!(!grade(a, b, Kind::Math), "{a:?} should differ from {b:?}");
    ne("1/2", "1/3");
    ne("\\frac{1}{2}", "\\frac{1}{3}");
    ne("12", "21");
    ne("0.5", "0.51");
    ne("(1,2)", "(2,1)");
    ne("1,2", "12");
    ne("x+1", "x-1");
    ne("", "");
    assert!(!grade("12", "021", Kind::Aime));
    assert!(!grade("1", "10", Kind::Aime));
}
