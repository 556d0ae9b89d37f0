//! Output of replays: a table per trace for people, one JSON object per line for scripts.

use std::fmt::Write;
use std::path::{Path, PathBuf};

use super::budget::BudgetSearch;
use super::replay::ReplayResult;
use super::waste::{Moment, Waste};
use super::Trace;

const GIB: f64 = (1u64 << 30) as f64;

fn gib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / GIB)
}

/// One line describing a trace: what it holds and what was skipped.
pub fn trace_summary(trace: &Trace) -> String {
    let mut line = format!(
        "{}: {} allocs, {} frees, {} frees of earlier allocations skipped, {} stream(s)",
        trace.name,
        trace.allocs,
        trace.frees,
        trace.skipped_frees,
        trace.streams.len()
    );
    if trace.zero_size_allocs > 0 {
        let _ = write!(
            line,
            ", {} zero-size allocs skipped",
            trace.zero_size_allocs
        );
    }
    if trace.duplicate_allocs > 0 {
        let _ = write!(
            line,
            ", {} allocs at a live address (earlier one freed)",
            trace.duplicate_allocs
        );
    }
    line
}

/// The table of one trace: the native allocator (from the trace's segments), then each replay.
pub fn table(trace: &Trace, results: &[ReplayResult]) -> String {
    let header = [
        "config",
        "live GiB",
        "reserved GiB",
        "util",
        "stitches",
        "reuse hits",
        "collections",
        "OOMs",
        "a+f ns p50/p99",
        "excl. driver p50/p99",
        "driver ms",
        "wall ms",
    ];
    let mut rows: Vec<Vec<String>> = Vec::new();
    let dash = || "-".to_string();
    let native = if trace.has_segments {
        let reserved = trace.native_peak_reserved_bytes;
        vec![
            "native (trace segments)".to_string(),
            gib(trace.peak_live_bytes),
            gib(reserved),
            if reserved > 0 {
                format!("{:.3}", trace.peak_live_bytes as f64 / reserved as f64)
            } else {
                dash()
            },
        ]
    } else {
        vec![
            "native (no segment events)".to_string(),
            gib(trace.peak_live_bytes),
            dash(),
            dash(),
        ]
    };
    rows.push(native.into_iter().chain((0..8).map(|_| dash())).collect());
    for r in results {
        rows.push(vec![
            r.config.clone(),
            gib(r.peak_live_bytes),
            gib(r.peak_reserved_bytes),
            format!("{:.3}", r.utilization),
            r.stitches.to_string(),
            r.reuse_hits.to_string(),
            r.collections.to_string(),
            r.ooms.to_string(),
            format!("{}/{}", r.alloc_free_ns.median, r.alloc_free_ns.p99),
            format!(
                "{}/{}",
                r.alloc_free_excl_driver_ns.median, r.alloc_free_excl_driver_ns.p99
            ),
            format!("{:.1}", r.driver_ns_total as f64 / 1e6),
            format!("{:.0}", r.wall_ns as f64 / 1e6),
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|c| {
            rows.iter()
                .map(|r| r[c].len())
                .chain([header[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    let mut line = |cells: &[String]| {
        for (c, cell) in cells.iter().enumerate() {
            if c == 0 {
                let _ = write!(out, "{cell:<w$}", w = widths[c]);
            } else {
                let _ = write!(out, "  {cell:>w$}", w = widths[c]);
            }
        }
        out.push('\n');
    };
    line(&header.map(String::from));
    for row in &rows {
        line(row);
    }
    if let Some(first) = results.first() {
        let _ = writeln!(
            out,
            "a+f: malloc + free time of one allocation, ns (includes 2 x ~{} ns of timer); \
             excl. driver: less the time inside driver calls",
            first.timer_ns
        );
    }
    out
}

/// Time per kind of driver call of one replay.
pub fn driver_calls(result: &ReplayResult) -> String {
    let parts: Vec<String> = result
        .driver_by_kind
        .iter()
        .map(|c| {
            format!(
                "{:?} {} calls {:.1} ms",
                c.kind,
                c.calls,
                c.nanos as f64 / 1e6
            )
        })
        .collect();
    format!("{} driver calls: {}", result.config, parts.join(", "))
}

/// A JSON string literal.
pub fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for ch in text.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn json_opt(value: Option<usize>) -> String {
    value.map_or_else(|| "null".to_string(), |v| v.to_string())
}

/// One replay as a single-line JSON object.
pub fn json_line(r: &ReplayResult) -> String {
    let fields: [(&str, String); 28] = [
        ("trace", json_string(&r.trace)),
        ("config", json_string(&r.config)),
        ("backend", json_string(r.backend.name())),
        ("budget_bytes", json_opt(r.budget)),
        ("peak_live_bytes", r.peak_live_bytes.to_string()),
        ("peak_allocated_bytes", r.peak_allocated_bytes.to_string()),
        ("peak_reserved_bytes", r.peak_reserved_bytes.to_string()),
        ("utilization", format!("{:.6}", r.utilization)),
        ("stitches", r.stitches.to_string()),
        ("growths", r.growths.to_string()),
        ("stitched_allocations", r.stitched_allocations.to_string()),
        ("reuse_hits", r.reuse_hits.to_string()),
        ("collections", r.collections.to_string()),
        ("ooms", r.ooms.to_string()),
        ("device_allocs", r.device_allocs.to_string()),
        ("device_frees", r.device_frees.to_string()),
        ("pairs", r.pairs.to_string()),
        ("alloc_free_ns_median", r.alloc_free_ns.median.to_string()),
        ("alloc_free_ns_p99", r.alloc_free_ns.p99.to_string()),
        (
            "alloc_free_excl_driver_ns_median",
            r.alloc_free_excl_driver_ns.median.to_string(),
        ),
        (
            "alloc_free_excl_driver_ns_p99",
            r.alloc_free_excl_driver_ns.p99.to_string(),
        ),
        ("driver_ns_total", r.driver_ns_total.to_string()),
        ("driver_calls", r.driver_calls.to_string()),
        (
            "native_peak_reserved_bytes",
            r.native_peak_reserved_bytes.to_string(),
        ),
        ("timer_ns", r.timer_ns.to_string()),
        ("wall_ns", r.wall_ns.to_string()),
        (
            "driver_ns_by_call",
            format!(
                "{{{}}}",
                r.driver_by_kind
                    .iter()
                    .map(|c| format!("\"{:?}\":{}", c.kind, c.nanos))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        ),
        (
            "marks",
            format!(
                "[{}]",
                r.marks
                    .iter()
                    .map(|m| format!(
                        "{{\"label\":{},\"op\":{},\"stitches\":{},\"reuse_hits\":{},\"reserved_bytes\":{}}}",
                        json_string(&m.label),
                        m.at,
                        m.stitches,
                        m.reuse_hits,
                        m.reserved
                    ))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        ),
    ];
    let body: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("{}:{v}", json_string(k)))
        .collect();
    format!("{{{}}}", body.join(","))
}

/// A budget search for people.
pub fn budget_line(search: &BudgetSearch) -> String {
    let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
    match search.min_budget {
        Some(min) => format!(
            "{:<12} smallest budget without OOM: {} GiB ({:.0} MiB fails; resolution {:.0} MiB, {} replays)",
            search.config,
            gib(min as u64),
            mib(search.failed_below),
            mib(search.resolution),
            search.replays
        ),
        None => format!(
            "{:<12} no budget up to {} GiB avoids OOMs ({} replays)",
            search.config,
            gib(search.failed_below as u64),
            search.replays
        ),
    }
}

/// A budget search as a single-line JSON object.
pub fn budget_json(search: &BudgetSearch) -> String {
    format!(
        "{{\"trace\":{},\"config\":{},\"min_budget_bytes\":{},\"failed_below_bytes\":{},\"resolution_bytes\":{},\"replays\":{}}}",
        json_string(&search.trace),
        json_string(&search.config),
        json_opt(search.min_budget),
        search.failed_below,
        search.resolution,
        search.replays
    )
}

/// What a [`Moment`] is called in a report line, and its key in JSON.
fn moment_names(at: Moment) -> (&'static str, &'static str) {
    match at {
        Moment::LivePeak => ("the live peak", "waste_at_peak"),
        Moment::ReservedPeak => ("the reserved peak", "waste_at_reserved_peak"),
    }
}

/// Where the reserved memory sat at a moment of the replay (see [`Waste`]), as one line per
/// trace, configuration and moment: GiB of each kind and its share of the reserved bytes then.
pub fn waste_line(trace: &str, config: &str, w: &Waste) -> String {
    let share = |bytes: u64| {
        let of = w.reserved.max(1) as f64;
        format!("{} ({:.2}%)", gib(bytes), 100.0 * bytes as f64 / of)
    };
    format!(
        "{trace} / {config}: at {} (after operation {}) {} GiB reserved (peak {}): requested \
         {}, \
         rounding {}, small pool free {}, large pool free in whole chunks {}, stranded in \
         {} free blocks of at most small_limit sharing a chunk {}, other partial chunks {}, \
         other {}; of the stranded and partial bytes, {} at chunk boundaries",
        moment_names(w.at).0,
        w.op,
        gib(w.reserved),
        gib(w.peak_reserved),
        share(w.requested),
        share(w.rounding),
        share(w.small_free),
        share(w.whole_chunks),
        w.stranded_blocks,
        share(w.stranded),
        share(w.partial_chunks),
        share(w.other),
        share(w.chunk_edges),
    )
}

/// [`waste_line`] as a single-line JSON object.
pub fn waste_json(trace: &str, config: &str, w: &Waste) -> String {
    format!(
        "{{\"trace\":{},\"config\":{},\"{}\":{{\"op\":{},\"reserved_bytes\":{},\"peak_reserved_bytes\":{},\"requested_bytes\":{},\"rounding_bytes\":{},\"small_free_bytes\":{},\"whole_chunk_free_bytes\":{},\"stranded_bytes\":{},\"stranded_blocks\":{},\"partial_chunk_free_bytes\":{},\"other_bytes\":{},\"chunk_edge_bytes\":{}}}}}",
        json_string(trace),
        json_string(config),
        moment_names(w.at).1,
        w.op,
        w.reserved,
        w.peak_reserved,
        w.requested,
        w.rounding,
        w.small_free,
        w.whole_chunks,
        w.stranded,
        w.stranded_blocks,
        w.partial_chunks,
        w.other,
        w.chunk_edges
    )
}

/// What happened between consecutive marks of a replay (see [`ReplayResult::marks`]): one line
/// per stretch, with the stitches made and cached stitched ranges reused in it. Empty when the
/// trace names no point.
pub fn marks_lines(r: &ReplayResult) -> String {
    let mut out = String::new();
    if r.marks.len() < 2 {
        return out;
    }
    for pair in r.marks.windows(2) {
        let (from, to) = (&pair[0], &pair[1]);
        let _ = writeln!(
            out,
            "{}: {} .. {} (ops {}..{}): {} stitches, {} reuses, {} GiB reserved at its end",
            r.config,
            from.label,
            to.label,
            from.at,
            to.at,
            to.stitches - from.stitches,
            to.reuse_hits - from.reuse_hits,
            gib(to.reserved)
        );
    }
    out
}

/// The file a plot goes to: `base` with the trace's stem and the config's name put before the
/// extension, each only when there are several of them.
pub fn plot_file(
    base: &Path,
    trace_stem: &str,
    config: &str,
    several_traces: bool,
    several_configs: bool,
) -> PathBuf {
    let stem = base
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let ext = base
        .extension()
        .map(|e| e.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut name = stem;
    if several_traces {
        name = format!("{name}-{trace_stem}");
    }
    if several_configs {
        name = format!("{name}-{config}");
    }
    if !ext.is_empty() {
        name = format!("{name}.{ext}");
    }
    base.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::{Backend, Percentiles};

    fn result() -> ReplayResult {
        ReplayResult {
            trace: "a \"b\".txt".into(),
            config: "stitch".into(),
            backend: Backend::Host,
            budget: None,
            peak_live_bytes: 3 << 30,
            peak_allocated_bytes: 3 << 30,
            peak_reserved_bytes: 4 << 30,
            utilization: 0.75,
            stitches: 2,
            growths: 1,
            stitched_allocations: 5,
            reuse_hits: 3,
            collections: 0,
            ooms: 0,
            device_allocs: 9,
            device_frees: 0,
            alloc_free_ns: Percentiles {
                median: 300,
                p99: 900,
            },
            alloc_free_excl_driver_ns: Percentiles {
                median: 200,
                p99: 800,
            },
            pairs: 10,
            driver_ns_total: 5_000_000,
            driver_calls: 40,
            driver_by_kind: vec![],
            native_peak_reserved_bytes: 5 << 30,
            timer_ns: 20,
            wall_ns: 1,
            timeline: None,
            marks: vec![],
            snapshot: None,
        }
    }

    #[test]
    fn json_has_the_keys_scripts_read() {
        let line = json_line(&result());
        assert!(line.starts_with('{') && line.ends_with('}') && !line.contains('\n'));
        for key in [
            "\"trace\":\"a \\\"b\\\".txt\"",
            "\"config\":\"stitch\"",
            "\"peak_live_bytes\":3221225472",
            "\"peak_reserved_bytes\":4294967296",
            "\"utilization\":0.750000",
            "\"alloc_free_ns_median\":300",
            "\"alloc_free_ns_p99\":900",
            "\"driver_ns_total\":5000000",
            "\"stitches\":2",
            "\"reuse_hits\":3",
            "\"collections\":0",
            "\"ooms\":0",
            "\"native_peak_reserved_bytes\":5368709120",
            "\"budget_bytes\":null",
        ] {
            assert!(line.contains(key), "{key} missing from {line}");
        }
    }

    #[test]
    fn table_has_native_and_config_rows() {
        let trace = Trace {
            name: "t".into(),
            peak_live_bytes: 3 << 30,
            native_peak_reserved_bytes: 6 << 30,
            has_segments: true,
            ..Trace::default()
        };
        let text = table(&trace, &[result()]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4);
        assert!(lines[1].starts_with("native") && lines[1].contains("6.00"));
        assert!(lines[1].contains("0.500"));
        assert!(lines[2].starts_with("stitch") && lines[2].contains("300/900"));
    }

    #[test]
    fn plot_names() {
        let base = Path::new("out/mem.svg");
        assert_eq!(
            plot_file(base, "t", "c", false, false),
            Path::new("out/mem.svg")
        );
        assert_eq!(
            plot_file(base, "t", "c", false, true),
            Path::new("out/mem-c.svg")
        );
        assert_eq!(
            plot_file(base, "t", "c", true, true),
            Path::new("out/mem-t-c.svg")
        );
    }
}
