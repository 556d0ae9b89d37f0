//! The fast-path loop runs, prints a positive cost per pair for each pass, and refuses a bad
//! argument with an error instead of a panic.

use std::process::Command;

#[test]
fn the_loop_reports_each_pass() {
    let out = Command::new(env!("CARGO_BIN_EXE_glake-hotloop"))
        .args(["50", "2"])
        .output()
        .expect("glake-hotloop runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let costs: Vec<f64> = text
        .lines()
        .map(|line| {
            let ns = line.split(": ").nth(1).and_then(|r| r.split(' ').next());
            ns.and_then(|n| n.parse().ok()).expect("a cost per pair")
        })
        .collect();
    assert_eq!(costs.len(), 2, "{text}");
    assert!(costs.iter().all(|&ns| ns > 0.0), "{text}");
}

#[test]
fn a_bad_argument_is_an_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_glake-hotloop"))
        .arg("many")
        .output()
        .expect("glake-hotloop runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("ROUNDS must be a positive number"));
}
