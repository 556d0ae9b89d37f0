//! `glake-replay`: replays allocation traces through the glake pool and compares
//! configurations (memory utilisation, OOMs under a budget, allocator time). The logic lives in
//! `glake_tools`; this file is the command line and the plots.
//!
//! Plotting lives here, not in the library, so that the C library does not carry it.

use std::path::Path;
use std::process::ExitCode;

use glake_tools::budget::find_min_budget;
use glake_tools::cli::{parse_args, Args, USAGE};
use glake_tools::replay::Sample;
use glake_tools::{
    configs, load, replay, report, waste_at, Moment, ReplayOptions, ReplayResult, Trace,
};
use plotters::prelude::*;

/// Points per plotted series: enough for a 1200-pixel-wide chart.
const PLOT_POINTS: usize = 4000;

fn main() -> ExitCode {
    // GLAKE_LOG=debug shows the pool's decisions (each stitch, its handles) as it replays.
    glake::init_logging();
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(err) => {
            eprintln!("glake-replay: {err}");
            return ExitCode::from(2);
        }
    };
    if args.help {
        print!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    if args.list_configs {
        for entry in configs::TABLE {
            println!("{:<16} {}", entry.name, entry.description);
        }
        return ExitCode::SUCCESS;
    }
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("glake-replay: {err}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    let options = ReplayOptions {
        backend: args.backend,
        budget: args.budget,
        timeline: args.plot.is_some(),
        snapshot_after: None,
        check_every: args.check_every,
    };
    let mut failed = false;
    for (index, path) in args.traces.iter().enumerate() {
        let trace = load(path, args.device).map_err(|e| e.to_string())?;
        if !args.json {
            if index > 0 {
                println!();
            }
            println!("{}", report::trace_summary(&trace));
            let budget = args
                .budget
                .map(|b| format!(", budget {:.2} GiB", b as f64 / (1u64 << 30) as f64))
                .unwrap_or_default();
            println!("backend {}{budget}", args.backend.name());
        }
        let mut results = Vec::with_capacity(args.configs.len());
        let mut replayed = Vec::with_capacity(args.configs.len());
        for config in &args.configs {
            // One configuration failing (a driver error) should not hide the others.
            match replay(&trace, config, &options) {
                Ok(result) => {
                    if args.json {
                        println!("{}", report::json_line(&result));
                    }
                    results.push(result);
                    replayed.push(config);
                }
                Err(err) => {
                    eprintln!("glake-replay: {} with {}: {err}", trace.name, config.name);
                    failed = true;
                }
            }
        }
        if !args.json {
            print!("{}", report::table(&trace, &results));
            for result in &results {
                print!("{}", report::marks_lines(result));
            }
        }
        if args.driver_calls {
            for result in &results {
                eprintln!("{}", report::driver_calls(result));
            }
        }
        if args.waste {
            for config in &replayed {
                let moments = [Moment::LivePeak, Moment::ReservedPeak];
                match waste_at(&trace, config, &options, &moments) {
                    Ok(sorted) => {
                        for w in sorted {
                            println!(
                                "{}",
                                if args.json {
                                    report::waste_json(&trace.name, &config.name, &w)
                                } else {
                                    report::waste_line(&trace.name, &config.name, &w)
                                }
                            );
                        }
                    }
                    Err(err) => {
                        eprintln!("glake-replay: {} with {}: {err}", trace.name, config.name);
                        failed = true;
                    }
                }
            }
        }
        if let Some(base) = &args.plot {
            for result in &results {
                let file = report::plot_file(
                    base,
                    &trace.stem(),
                    &result.config,
                    args.traces.len() > 1,
                    args.configs.len() > 1,
                );
                plot(&file, &trace, result)?;
                eprintln!("wrote {}", file.display());
            }
        }
        if args.find_min_budget {
            for (config, result) in replayed.iter().zip(&results) {
                let search = find_min_budget(&trace, config, &options, result)
                    .map_err(|e| format!("{} with {}: {e}", trace.name, config.name))?;
                if args.json {
                    println!("{}", report::budget_json(&search));
                } else {
                    println!("{}", report::budget_line(&search));
                }
            }
        }
    }
    if failed {
        return Err("some replays failed (see above)".to_string());
    }
    Ok(())
}

/// Draws the memory timeline of one replay: live, reserved and stitched bytes over the trace's
/// operations, with the native allocator's reserved bytes when the trace has segment events.
fn plot(path: &Path, trace: &Trace, result: &ReplayResult) -> Result<(), String> {
    let samples = result
        .timeline
        .as_ref()
        .map(|t| t.downsample(PLOT_POINTS))
        .unwrap_or_default();
    let title = format!(
        "{} / {}: peak live {:.2} GiB, peak reserved {:.2} GiB, utilization {:.3}",
        trace.name,
        result.config,
        result.peak_live_bytes as f64 / GIB,
        result.peak_reserved_bytes as f64 / GIB,
        result.utilization
    );
    let mut svg = String::new();
    draw(&mut svg, &title, &samples).map_err(|e| format!("drawing {}: {e}", path.display()))?;
    let written = match path.extension().and_then(|e| e.to_str()) {
        Some("png") => rasterize(&svg, path),
        _ => std::fs::write(path, svg).map_err(|e| e.to_string()),
    };
    written.map_err(|e| format!("writing {}: {e}", path.display()))
}

const GIB: f64 = (1u64 << 30) as f64;

type Series = (&'static str, RGBColor, fn(&Sample) -> Option<u64>);

fn draw(svg: &mut String, title: &str, samples: &[Sample]) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<_>| e.to_string();
    let root = SVGBackend::with_string(svg, (1200, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let series: [Series; 4] = [
        ("live (requested bytes)", RGBColor(200, 30, 30), |s| {
            Some(s.live)
        }),
        ("reserved", RGBColor(30, 80, 200), |s| Some(s.reserved)),
        ("stitched, mapped", RGBColor(30, 150, 60), |s| {
            Some(s.stitched)
        }),
        (
            "native reserved (trace segments)",
            RGBColor(120, 120, 120),
            |s| s.native,
        ),
    ];
    let x_max = samples.last().map_or(1, |s| s.index + 1);
    let y_max = samples
        .iter()
        .flat_map(|s| series.iter().filter_map(|(_, _, get)| get(s)))
        .max()
        .unwrap_or(0) as f64
        / GIB;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0..x_max, 0.0..(y_max * 1.05).max(0.01))
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("operation (alloc or free) index")
        .y_desc("GiB")
        .draw()
        .map_err(err)?;
    for (label, color, get) in series {
        if samples.iter().all(|s| get(s).is_none()) {
            continue;
        }
        let points = samples
            .iter()
            .filter_map(|s| get(s).map(|v| (s.index, v as f64 / GIB)));
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// PNG through a pure-Rust SVG rasterizer, so that no system library is linked; text needs a
/// system font, and is left out (with a warning) when there is none.
fn rasterize(svg: &str, path: &Path) -> Result<(), String> {
    use resvg::usvg::fontdb::{Family, Query};
    let mut options = resvg::usvg::Options::default();
    let fonts = options.fontdb_mut();
    fonts.load_system_fonts();
    if fonts.is_empty() {
        eprintln!("glake-replay: no system fonts found; the PNG has no text (an SVG would)");
    } else {
        let sans = Query {
            families: &[Family::SansSerif],
            ..Query::default()
        };
        if fonts.query(&sans).is_none() {
            // The default sans-serif family (Arial) is often missing: prefer any sans face.
            let families: Vec<String> = fonts
                .faces()
                .filter_map(|f| f.families.first().map(|(name, _)| name.clone()))
                .collect();
            let pick = families
                .iter()
                .find(|n| n.contains("Sans") && !n.contains("Mono"))
                .or(families.first());
            if let Some(name) = pick.cloned() {
                fonts.set_sans_serif_family(name);
            }
        }
    }
    let tree = resvg::usvg::Tree::from_str(svg, &options).map_err(|e| e.to_string())?;
    let size = tree.size().to_int_size();
    let mut pixmap = resvg::tiny_skia::Pixmap::new(size.width(), size.height())
        .ok_or_else(|| format!("cannot make a {size:?} image"))?;
    pixmap.fill(resvg::tiny_skia::Color::WHITE);
    resvg::render(
        &tree,
        resvg::tiny_skia::Transform::default(),
        &mut pixmap.as_mut(),
    );
    pixmap.save_png(path).map_err(|e| e.to_string())
}
