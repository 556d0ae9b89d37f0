//! End-to-end checks of trace replay: the library API and the `glake-replay` binary on a small
//! synthetic trace whose fragmentation forces stitching.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use glake_tools::{self as trace, configs, report, Moment, ReplayOptions};

const MIB: u64 = 1 << 20;

/// A few hundred events: each round fills a 64 MiB segment with eight blocks of about 8 MiB,
/// frees every other one and asks for 32 MiB, which only stitching serves without growing.
/// Small allocations, a second stream, segment events and a free of an allocation made before
/// recording are mixed in.
fn synthetic() -> String {
    let mut t = String::from("# action addr size stream\n");
    let mut line = |action: &str, addr: u64, size: u64, stream: u64| {
        t += &format!("{action} {addr} {size} {stream}\n");
    };
    line("free_completed", 999_999, 4096, 0);
    line("segment_alloc", 1, 64 * MIB, 0);
    line("alloc", 1, 64 * MIB, 0);
    line("free_requested", 1, 64 * MIB, 0);
    line("free_completed", 1, 64 * MIB, 0);
    for round in 0..12u64 {
        let base = 1000 * (round + 1);
        let big: Vec<(u64, u64)> = (0..8)
            .map(|i| (base + i, 8 * MIB - 512 * (round + i)))
            .collect();
        for &(addr, size) in &big {
            line("alloc", addr, size, 0);
        }
        let small: Vec<(u64, u64)> = (0..5).map(|k| (base + 100 + k, 1000 + 37 * k)).collect();
        for &(addr, size) in &small {
            line("alloc", addr, size, 0);
        }
        for &(addr, size) in big.iter().skip(1).step_by(2) {
            line("free_requested", addr, size, 0);
            line("free_completed", addr, size, 0);
        }
        line("segment_alloc", base + 500, 32 * MIB, 0);
        line("alloc", base + 200, 32 * MIB - 1000 * round, 0);
        line("alloc", base + 300, 3 * MIB, 7);
        line("free_completed", base + 300, 3 * MIB, 7);
        line("free_completed", base + 200, 32 * MIB - 1000 * round, 0);
        line("segment_free", base + 500, 32 * MIB, 0);
        for &(addr, size) in big.iter().step_by(2).chain(&small) {
            line("free_completed", addr, size, 0);
        }
    }
    t
}

/// Peak live bytes counted straight from the text, independently of the library.
fn independent_peak_live(text: &str) -> u64 {
    let mut live: HashMap<u64, u64> = HashMap::new();
    let (mut current, mut peak) = (0u64, 0u64);
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (addr, size): (u64, u64) = (f[1].parse().unwrap(), f[2].parse().unwrap());
        match f[0] {
            "alloc" => {
                live.insert(addr, size);
                current += size;
                peak = peak.max(current);
            }
            "free_completed" => {
                if let Some(size) = live.remove(&addr) {
                    current -= size;
                }
            }
            _ => {}
        }
    }
    peak
}

fn temp_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("glake-replay-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn write_gzip(path: &Path, text: &str) {
    let file = std::fs::File::create(path).unwrap();
    let mut gz = flate2::write::GzEncoder::new(file, flate2::Compression::fast());
    gz.write_all(text.as_bytes()).unwrap();
    gz.finish().unwrap();
}

fn run_binary(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_glake-replay"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "glake-replay {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The value of `key` in a one-line JSON object (numbers and strings only).
fn field(line: &str, key: &str) -> String {
    let start = line
        .find(&format!("\"{key}\":"))
        .unwrap_or_else(|| panic!("{key} missing in {line}"))
        + key.len()
        + 3;
    let rest = &line[start..];
    let end = rest.find([',', '}']).unwrap();
    rest[..end].trim_matches('"').to_string()
}

fn number(line: &str, key: &str) -> f64 {
    field(line, key).parse().unwrap()
}

#[test]
fn api_and_binary_agree_with_an_independent_count() {
    let text = synthetic();
    assert!(text.lines().count() > 300);
    let expected = independent_peak_live(&text);
    let path = temp_path("synthetic.txt.gz");
    write_gzip(&path, &text);

    let trace = trace::load(&path, 0).unwrap();
    assert_eq!(trace.skipped_frees, 1);
    assert_eq!(trace.peak_live_bytes, expected);
    assert_eq!(trace.streams, vec![0, 7]);
    assert!(trace.native_peak_reserved_bytes >= 96 * MIB);
    for name in ["caching", "stitch"] {
        let r = trace::replay(
            &trace,
            &configs::named(name).unwrap(),
            &ReplayOptions::default(),
        )
        .unwrap();
        assert_eq!(r.peak_live_bytes, expected, "{name}");
        assert_eq!(r.ooms, 0, "{name}");
        assert_eq!(r.pairs, trace.frees, "{name}");
        if name == "stitch" {
            assert!(r.stitches >= 1 && r.reuse_hits >= 1, "{r:?}");
        }
    }

    let out = run_binary(&["--json", path.to_str().unwrap()]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    let mut reserved = HashMap::new();
    for line in &lines {
        let live = number(line, "peak_live_bytes");
        let peak_reserved = number(line, "peak_reserved_bytes");
        assert_eq!(live, expected as f64, "{line}");
        assert_eq!(number(line, "ooms"), 0.0, "{line}");
        let utilization = number(line, "utilization");
        assert!((utilization - live / peak_reserved).abs() < 1e-5, "{line}");
        assert_eq!(field(line, "trace"), "synthetic.txt.gz");
        for key in [
            "alloc_free_ns_median",
            "alloc_free_ns_p99",
            "driver_ns_total",
            "stitches",
            "reuse_hits",
            "collections",
            "native_peak_reserved_bytes",
        ] {
            assert!(number(line, key) >= 0.0, "{key} in {line}");
        }
        reserved.insert(field(line, "config"), peak_reserved);
    }
    assert!(reserved["stitch"] < reserved["caching"], "{reserved:?}");

    let table = run_binary(&[path.to_str().unwrap()]);
    assert!(table.contains("native (trace segments)"), "{table}");
    assert!(table.lines().any(|l| l.starts_with("stitch ")), "{table}");
}

#[test]
fn tight_budget_ooms_caching_but_not_stitch() {
    let text = synthetic();
    let path = temp_path("budget.txt");
    std::fs::write(&path, &text).unwrap();
    let trace = trace::load(&path, 0).unwrap();
    let stitch = trace::replay(
        &trace,
        &configs::named("stitch").unwrap(),
        &ReplayOptions::default(),
    )
    .unwrap();
    let budget = stitch.peak_reserved_bytes.to_string();
    let out = run_binary(&["--json", "--budget", &budget, path.to_str().unwrap()]);
    for line in out.lines() {
        let ooms = number(line, "ooms");
        match field(line, "config").as_str() {
            "caching" => assert!(ooms > 0.0, "{line}"),
            "stitch" => assert_eq!(ooms, 0.0, "{line}"),
            other => panic!("unexpected config {other}"),
        }
        assert_eq!(field(line, "budget_bytes"), budget);
    }

    let out = run_binary(&["--json", "--find-min-budget", path.to_str().unwrap()]);
    let min: HashMap<String, f64> = out
        .lines()
        .filter(|l| l.contains("min_budget_bytes"))
        .map(|l| (field(l, "config"), number(l, "min_budget_bytes")))
        .collect();
    assert_eq!(min.len(), 2, "{out}");
    assert!(min["stitch"] < min["caching"], "{min:?}");
    assert!(min["stitch"] >= trace.peak_live_bytes as f64);
}

#[test]
fn plots_are_written_per_config() {
    let path = temp_path("plot.txt");
    std::fs::write(&path, synthetic()).unwrap();
    let svg = temp_path("timeline.svg");
    run_binary(&["--plot", svg.to_str().unwrap(), path.to_str().unwrap()]);
    for config in ["caching", "stitch"] {
        let file = temp_path(&format!("timeline-{config}.svg"));
        let body = std::fs::read_to_string(&file).unwrap();
        assert!(
            body.starts_with("<svg") && body.contains("reserved"),
            "{config}"
        );
    }
    let png = temp_path("one.png");
    run_binary(&[
        "--config",
        "stitch",
        "--plot",
        png.to_str().unwrap(),
        path.to_str().unwrap(),
    ]);
    let bytes = std::fs::read(&png).unwrap();
    assert!(bytes.starts_with(b"\x89PNG"), "not a PNG");
}

/// Sampling memory for a timeline leaves parked blocks parked: a freed block kept for the next
/// request of its size goes back where it was, so the replay stitches once at the end; had the
/// sampling put the parked blocks back in the free lists (as reading the statistics does), the
/// same request would take the merged free memory instead, and the timeline would describe a
/// replay other than the one reported.
#[test]
fn a_timeline_does_not_change_the_replay() {
    let four = 4 * MIB;
    let text = format!(
        "alloc 1000 {} 0\nfree_completed 1000 {} 0\n\
         alloc 2000 {four} 0\nalloc 3000 {four} 0\nalloc 4000 {four} 0\n\
         free_completed 2000 {four} 0\nfree_completed 3000 {four} 0\n\
         alloc 5000 {four} 0\nfree_completed 4000 {four} 0\nalloc 6000 {} 0\n",
        3 * four,
        3 * four,
        2 * four,
    );
    let path = temp_path("parked.txt");
    std::fs::write(&path, text).unwrap();
    let trace = trace::load(&path, 0).unwrap();
    let stitch = configs::named("stitch").unwrap();
    let replay = |timeline| {
        let options = ReplayOptions {
            timeline,
            ..ReplayOptions::default()
        };
        trace::replay(&trace, &stitch, &options).unwrap()
    };
    let (plain, sampled) = (replay(false), replay(true));
    assert_eq!(plain.stitches, 1, "{plain:?}");
    assert_eq!(
        (sampled.stitches, sampled.peak_reserved_bytes),
        (plain.stitches, plain.peak_reserved_bytes)
    );
    let timeline = sampled.timeline.unwrap();
    assert_eq!(timeline.len(), trace.ops.len());
    assert_eq!(timeline.reserved.iter().max(), Some(&(3 * four)));
}

/// Writes `text` to a trace file named `name` and sorts its reserved memory with the stitch
/// configuration at the live peak and at the reserved peak.
fn waste_of(name: &str, text: &str) -> (PathBuf, [trace::Waste; 2]) {
    let path = temp_path(name);
    std::fs::write(&path, text).unwrap();
    let trace = trace::load(&path, 0).unwrap();
    let stitch = configs::named("stitch").unwrap();
    let moments = [Moment::LivePeak, Moment::ReservedPeak];
    let sorted = trace::waste_at(&trace, &stitch, &ReplayOptions::default(), &moments).unwrap();
    (path, [sorted[0], sorted[1]])
}

/// Requests of 5.5 and 7.5 MiB made while a 16 MiB one is live get a segment each of whole
/// granules: each leaves a free half MiB that shares its chunk with the allocation, which no
/// stitch can map and no large request fits. Live bytes peak then; afterwards the 16 MiB
/// segment is free, and another request of 5.5 MiB is served from it without reserving more.
#[test]
fn the_waste_report_sorts_what_is_reserved_at_the_live_peak() {
    let (big, odd, other) = (16 * MIB, 11 * MIB / 2, 15 * MIB / 2);
    let text = format!(
        "alloc 1 {big} 0\nalloc 2 {odd} 0\nalloc 3 {other} 0\nfree_completed 1 {big} 0\n\
         alloc 4 {odd} 0\nfree_completed 4 {odd} 0\n"
    );
    let (path, [w, at_reserved]) = waste_of("waste.txt", &text);
    // The reserved bytes peak with the live ones here: the first operation of that peak.
    assert_eq!(at_reserved.at, Moment::ReservedPeak);
    assert_eq!(
        (at_reserved.op, at_reserved.reserved),
        (2, 30 * MIB),
        "{at_reserved:?}"
    );
    assert_eq!(
        (w.at, w.op, w.requested),
        (Moment::LivePeak, 2, big + odd + other),
        "{w:?}"
    );
    assert_eq!((w.reserved, w.peak_reserved), (30 * MIB, 30 * MIB), "{w:?}");
    assert_eq!((w.stranded, w.stranded_blocks), (MIB, 2), "{w:?}");
    assert_eq!((w.whole_chunks, w.partial_chunks), (0, 0), "{w:?}");
    let kinds = w.requested
        + w.rounding
        + w.small_free
        + w.whole_chunks
        + w.stranded
        + w.partial_chunks
        + w.other;
    assert_eq!((kinds, w.rounding, w.other), (w.reserved, 0, 0), "{w:?}");

    let out = run_binary(&[
        "--config",
        "stitch",
        "--waste",
        "--json",
        path.to_str().unwrap(),
    ]);
    let line = out.lines().find(|l| l.contains("waste_at_peak")).unwrap();
    assert_eq!(number(line, "stranded_bytes"), MIB as f64, "{line}");
    assert_eq!(number(line, "stranded_blocks"), 2.0, "{line}");
    let line = out
        .lines()
        .find(|l| l.contains("waste_at_reserved_peak"))
        .unwrap();
    assert_eq!(number(line, "reserved_bytes"), (30 * MIB) as f64, "{line}");
}

/// Reserved bytes can peak after the live bytes do: two 16 MiB allocations, one freed, then a
/// small request that needs a small-pool segment. The report sorts both moments: at the
/// reserved peak the freed 16 MiB sit in whole chunks.
#[test]
fn the_waste_report_sorts_the_reserved_peak_too() {
    let (big, small) = (16 * MIB, MIB / 2);
    let text = format!(
        "alloc 1 {big} 0\nalloc 2 {big} 0\nfree_completed 1 {big} 0\nalloc 3 {small} 0\n\
         free_completed 3 {small} 0\nfree_completed 2 {big} 0\n"
    );
    let (_, [live, reserved]) = waste_of("waste-later.txt", &text);
    assert_eq!(
        (live.op, live.requested, live.reserved),
        (1, 2 * big, 2 * big),
        "{live:?}"
    );
    assert_eq!(reserved.op, 3, "{reserved:?}");
    assert_eq!(reserved.requested, big + small, "{reserved:?}");
    assert_eq!(reserved.reserved, 2 * big + 2 * MIB, "{reserved:?}");
    assert_eq!(reserved.peak_reserved, reserved.reserved);
    assert_eq!(reserved.whole_chunks, big, "{reserved:?}");
    assert_eq!(reserved.small_free, 2 * MIB - small, "{reserved:?}");
}

/// The counters are read at each comment line of a trace: the stitches a stretch made are the
/// difference between its two marks, and the end of the trace is a last point when no mark
/// stands there. Sampling them leaves the replay as it is.
#[test]
fn marks_count_the_stitches_between_them() {
    let text = synthetic();
    let stretch = text.lines().count() / 2;
    let marked: String = text
        .lines()
        .enumerate()
        .map(|(i, line)| match i {
            0 => format!("# first\n{line}\n"),
            i if i == stretch => format!("# middle\n{line}\n"),
            _ => format!("{line}\n"),
        })
        .collect();
    let path = temp_path("marked.txt");
    std::fs::write(&path, marked).unwrap();
    let trace = trace::load(&path, 0).unwrap();
    let labels: Vec<&str> = trace.marks.iter().map(|m| m.label.as_str()).collect();
    assert_eq!(labels, ["first", "middle"]);
    let stitch = configs::named("stitch").unwrap();
    let r = trace::replay(&trace, &stitch, &ReplayOptions::default()).unwrap();
    // (label, stitches and reuses so far): both halves stitch or reuse.
    let points: Vec<(&str, u64)> = r
        .marks
        .iter()
        .map(|m| (m.label.as_str(), m.stitches + m.reuse_hits))
        .collect();
    assert_eq!(points.len(), 3, "{points:?}");
    assert_eq!(points[0], ("first", 0));
    assert_eq!(points[2], ("end of the trace", r.stitches + r.reuse_hits));
    assert!(0 < points[1].1 && points[1].1 < points[2].1, "{points:?}");
    // The same replay as the unmarked trace's.
    let plain = trace::load(&temp_path_with(&text, "unmarked.txt"), 0).unwrap();
    let unmarked = trace::replay(&plain, &stitch, &ReplayOptions::default()).unwrap();
    assert_eq!(
        (unmarked.stitches, unmarked.peak_reserved_bytes),
        (r.stitches, r.peak_reserved_bytes)
    );
    let line = report::json_line(&r);
    assert!(line.contains("\"label\":\"middle\""), "{line}");
    assert_eq!(report::marks_lines(&r).lines().count(), 2);
}

fn temp_path_with(text: &str, name: &str) -> PathBuf {
    let path = temp_path(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn snapshot_pickles_replay_like_text() {
    use serde_pickle::{HashableValue, Value};
    use std::collections::BTreeMap;
    let key = |k: &str| HashableValue::String(k.to_string());
    let entry = |action: &str, addr: i64, size: i64| {
        let mut d = BTreeMap::new();
        d.insert(key("action"), Value::String(action.to_string()));
        d.insert(key("addr"), Value::I64(addr));
        d.insert(key("size"), Value::I64(size));
        d.insert(key("stream"), Value::I64(0));
        d.insert(key("frames"), Value::List(vec![]));
        Value::Dict(d)
    };
    let events = vec![
        entry("segment_alloc", 1 << 40, 8 << 20),
        entry("alloc", 1 << 40, 3 << 20),
        entry("alloc", (1 << 40) + (4 << 20), 1 << 20),
        entry("free_requested", 1 << 40, 3 << 20),
        entry("free_completed", 1 << 40, 3 << 20),
        entry("free_completed", 5, 512),
    ];
    let mut top = BTreeMap::new();
    top.insert(key("segments"), Value::List(vec![]));
    top.insert(key("device_traces"), Value::List(vec![Value::List(events)]));
    let bytes =
        serde_pickle::value_to_vec(&Value::Dict(top), serde_pickle::SerOptions::new()).unwrap();
    let path = temp_path("snapshot.pickle");
    std::fs::write(&path, bytes).unwrap();
    let out = run_binary(&["--json", "--config", "stitch", path.to_str().unwrap()]);
    assert_eq!(
        number(&out, "peak_live_bytes"),
        (4u64 << 20) as f64,
        "{out}"
    );
    assert_eq!(
        number(&out, "native_peak_reserved_bytes"),
        (8u64 << 20) as f64
    );
    assert_eq!(number(&out, "ooms"), 0.0);
}

/// A snapshot pickle written by torch 2.11 itself (`torch.cuda.memory._dump_snapshot`, an MLP
/// trained for 4 steps on an H200). The recording run printed torch's own
/// `max_memory_allocated()` = 741670912 and `max_memory_reserved()` = 771751936; the replay's
/// peak live bytes must equal the former, and stitching must not reserve more than caching.
#[test]
fn a_real_torch_snapshot_pickle_replays() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/snapshot_mlp.pickle"
    );
    let out = run_binary(&["--json", path]);
    let lines: Vec<&str> = out.lines().filter(|l| l.starts_with('{')).collect();
    assert_eq!(lines.len(), 2, "{out}");
    for line in &lines {
        assert_eq!(number(line, "peak_live_bytes"), 741670912.0, "{line}");
        assert_eq!(number(line, "ooms"), 0.0);
    }
    let reserved = |config: &str| {
        let line = lines
            .iter()
            .find(|l| field(l, "config") == config)
            .unwrap_or_else(|| panic!("no {config} line in {out}"));
        number(line, "peak_reserved_bytes")
    };
    assert!(reserved("stitch") <= reserved("caching"));
    assert!(reserved("caching") <= 771751936.0 * 1.05);
}

/// The recorded traces of the repository (traces/), replayed with the default configuration and
/// GMLake's 2 MiB handles under a check of the pool's invariants every 997 operations: every
/// byte a stitched allocation hands out is held by one of its pieces, the statistics agree
/// with the blocks, and so on. Placements differ from an unchecked replay (a check returns
/// parked blocks to the free lists), which varies the layouts the traces reach.
#[test]
fn the_recorded_traces_keep_the_pool_consistent() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../traces");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".txt.gz"))
        .collect();
    paths.sort();
    assert!(paths.len() >= 10, "{paths:?}");
    let options = ReplayOptions {
        check_every: Some(997),
        ..ReplayOptions::default()
    };
    for path in &paths {
        let trace = trace::load(path, 0).unwrap();
        for name in ["stitch", "stitch-chunk2m"] {
            let config = configs::named(name).unwrap();
            let result = trace::replay(&trace, &config, &options)
                .unwrap_or_else(|err| panic!("{}: {name}: {err}", path.display()));
            assert_eq!(result.ooms, 0, "{}: {name}", path.display());
        }
    }
}

/// On a recorded trace of changing image sizes, stitched ranges grow in place by default, and
/// fewer handles are mapped than with growing switched off; off, none grows.
#[test]
fn ranges_grow_in_place_on_the_vision_trace_and_not_when_switched_off() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../traces/trace_vision.txt.gz");
    let trace = trace::load(Path::new(path), 0).unwrap();
    let options = ReplayOptions::default();
    let replay = |name: &str| trace::replay(&trace, &configs::named(name).unwrap(), &options);
    let (grown, not) = (replay("stitch").unwrap(), replay("stitch-nogrow").unwrap());
    assert!(grown.growths > 0);
    assert_eq!(not.growths, 0);
    let maps = |r: &glake_tools::replay::ReplayResult| {
        r.driver_by_kind
            .iter()
            .find(|c| c.kind == glake::device::CallKind::Map)
            .map_or(0, |c| c.calls)
    };
    assert!(
        maps(&grown) < maps(&not),
        "{} against {}",
        maps(&grown),
        maps(&not)
    );
}
