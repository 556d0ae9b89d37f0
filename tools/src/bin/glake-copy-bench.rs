//! Host<->device copy benchmark: the driver's own copies (pageable and pinned) against glake's
//! transfer engine (the target's link alone, and with relays through peers), in the same
//! process, taking turns rep by rep so that drifts of the machine fall on all alike.
//!
//! usage: glake-copy-bench [--backend auto|cuda|host] [--device N] [--sizes 4K,1M,...]
//!                         [--reps N] [--peers N] [--json FILE] [--also VAR=VAL,...]...
//! Lanes, chunk and thresholds come from the GLAKE_COPY_* variables. Each `--also` adds engines
//! made with those GLAKE_COPY_* variables changed, timed in the same turns as the others (an
//! A/B of a setting on one machine start).

use std::io::Write;
use std::process::ExitCode;
use std::time::Instant;

use glake::config::{host_options_from_env, parse_bytes};
use glake::device::HostMemory;
use glake::device::{self, BackendChoice, SharedDevice, Stream};
use glake::transfer::staging::{DeviceBuffer, PinnedBuffer};
use glake::transfer::{Completion, Direction, Engine, Route};
use glake::TransferConfig;

struct Args {
    backend: BackendChoice,
    device: i32,
    sizes: Vec<usize>,
    reps: usize,
    peers: usize,
    json: Option<String>,
    /// Extra engine variants: the GLAKE_COPY_* settings each changes.
    also: Vec<Vec<(String, String)>>,
}

const USAGE: &str = "usage: glake-copy-bench [--backend auto|cuda|host] [--device N] \
[--sizes 4K,64K,1M,...] [--reps N] [--peers N] [--json FILE] [--also VAR=VAL,...]...";

fn parse() -> Result<Args, String> {
    let mut args = Args {
        backend: BackendChoice::Auto,
        device: 0,
        sizes: (0..=10).map(|i| 4096usize << (2 * i)).collect(),
        reps: 5,
        peers: usize::MAX,
        json: None,
        also: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--backend" => {
                args.backend = match value()?.as_str() {
                    "auto" => BackendChoice::Auto,
                    "cuda" => BackendChoice::Cuda,
                    "host" => BackendChoice::Host,
                    other => return Err(format!("unknown backend {other}")),
                }
            }
            "--device" => args.device = value()?.parse().map_err(|e| format!("--device: {e}"))?,
            "--sizes" => {
                args.sizes = value()?
                    .split(',')
                    .map(|s| {
                        parse_bytes(s)
                            .filter(|&b| b > 0)
                            .ok_or(format!("bad size {s}"))
                    })
                    .collect::<Result<_, _>>()?
            }
            "--reps" => args.reps = value()?.parse().map_err(|e| format!("--reps: {e}"))?,
            "--peers" => args.peers = value()?.parse().map_err(|e| format!("--peers: {e}"))?,
            "--json" => args.json = Some(value()?),
            "--also" => {
                let settings = value()?
                    .split(',')
                    .map(|pair| match pair.split_once('=') {
                        Some((var, val)) if var.starts_with("GLAKE_COPY_") => {
                            Ok((var.to_string(), val.to_string()))
                        }
                        _ => Err(format!("--also takes GLAKE_COPY_*=VALUE pairs, not {pair}")),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                args.also.push(settings);
            }
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    args.reps = args.reps.max(1);
    Ok(args)
}

/// One way of copying, timed.
#[derive(Clone, Copy, PartialEq)]
enum Method {
    Driver,
    Engine(usize),
}

struct Buffers {
    device: DeviceBuffer,
    pageable: Vec<u8>,
    pinned: PinnedBuffer,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

fn run(args: &Args) -> Result<(), String> {
    let err = |e: glake::Error| e.to_string();
    let target = device::open(args.backend, args.device, host_options_from_env()).map_err(err)?;
    let count = target.device_count().unwrap_or(1);
    let peers = device::open_peers(&target, args.peers, host_options_from_env());
    let config = TransferConfig::from_env();
    let started = Instant::now();
    // Each variant's configuration is read with its settings in the environment, before any
    // engine starts a thread; the base settings come back afterwards.
    let mut variants = vec![(String::new(), config.clone())];
    for settings in &args.also {
        let saved: Vec<(String, Option<String>)> = settings
            .iter()
            .map(|(var, _)| (var.clone(), std::env::var(var).ok()))
            .collect();
        for (var, val) in settings {
            std::env::set_var(var, val);
        }
        let label: Vec<String> = settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
        variants.push((
            format!(" [{}]", label.join(",")),
            TransferConfig::from_env(),
        ));
        for (var, old) in saved {
            match old {
                Some(v) => std::env::set_var(&var, v),
                None => std::env::remove_var(&var),
            }
        }
    }
    let mut engines = Vec::new();
    let mut labels = Vec::new();
    for (label, variant) in &variants {
        engines.push(Engine::new(target.clone(), Vec::new(), variant.clone()).map_err(err)?);
        labels.push(label.clone());
        if !peers.is_empty() {
            engines.push(Engine::new(target.clone(), peers.clone(), variant.clone()).map_err(err)?);
            labels.push(label.clone());
        }
    }
    eprintln!(
        "{} backend, device {} of {count}; engines ready in {:.0} ms; lanes {} (relay {}), chunk {}, slots {}",
        target.kind().name(),
        args.device,
        started.elapsed().as_secs_f64() * 1e3,
        config.lanes,
        config.relay_lanes,
        human(config.chunk),
        config.slots
    );
    for engine in &engines {
        let paths: Vec<String> = engine
            .paths()
            .iter()
            .map(|p| match p.via {
                None => format!("own link {:.1} GB/s", p.gbps),
                Some(v) => format!("via {v} {:.1} GB/s", p.gbps),
            })
            .collect();
        eprintln!("engine paths: {}", paths.join(", "));
    }
    let largest = args.sizes.iter().copied().max().unwrap_or(4096);
    let stream = target.create_stream().map_err(err)?;
    let mut buffers = Buffers {
        device: DeviceBuffer::new(&target, largest, &[]).map_err(err)?,
        pageable: vec![1u8; largest],
        pinned: PinnedBuffer::new(&target, largest).map_err(err)?,
    };
    let names: Vec<String> = std::iter::once("driver".to_string())
        .chain(engines.iter().zip(&labels).map(|(e, label)| {
            if e.paths().len() > 1 {
                format!("glake +{} peers{label}", e.paths().len() - 1)
            } else {
                format!("glake{label}")
            }
        }))
        .collect();
    let mut json = match &args.json {
        Some(path) => Some(std::fs::File::create(path).map_err(|e| format!("{path}: {e}"))?),
        None => None,
    };
    let mut header = "| size | direction | host memory |".to_string();
    let mut rule = "|---|---|---|".to_string();
    for name in &names {
        header += &format!(" {name} GB/s |");
        rule += "---|";
    }
    for name in names.iter().skip(1) {
        header += &format!(" {name} / driver |");
        rule += "---|";
    }
    println!("{header}\n{rule}");
    for &size in &args.sizes {
        for direction in [Direction::HostToDevice, Direction::DeviceToHost] {
            for memory in [HostMemory::Pageable, HostMemory::Pinned] {
                let methods: Vec<Method> = std::iter::once(Method::Driver)
                    .chain((0..engines.len()).map(Method::Engine))
                    .collect();
                // Reps: at least `reps`, and more for small sizes (256 MiB moved per method,
                // at most 200), so that their medians rest on many copies.
                let reps = args.reps.max((256 << 20) / size.max(1)).min(200);
                let mut times: Vec<Vec<f64>> = vec![Vec::new(); methods.len()];
                for rep in 0..=reps {
                    for (m, &method) in methods.iter().enumerate() {
                        let t = time_copy(
                            &target,
                            &engines,
                            &mut buffers,
                            stream,
                            method,
                            direction,
                            memory,
                            size,
                        )
                        .map_err(err)?;
                        if rep > 0 {
                            times[m].push(t);
                        }
                    }
                }
                let gbps: Vec<f64> = times
                    .into_iter()
                    .map(|t| size as f64 / median(t) / 1e9)
                    .collect();
                let dir = match direction {
                    Direction::HostToDevice => "H2D",
                    Direction::DeviceToHost => "D2H",
                };
                let kind = match memory {
                    HostMemory::Pageable => "pageable",
                    HostMemory::Pinned => "pinned",
                };
                let mut row = format!("| {} | {dir} | {kind} |", human(size));
                for g in &gbps {
                    row += &format!(" {g:.2} |");
                }
                for g in gbps.iter().skip(1) {
                    row += &format!(" {:.2} |", g / gbps[0]);
                }
                println!("{row}");
                if let Some(file) = json.as_mut() {
                    let routes: Vec<String> = engines
                        .iter()
                        .map(|e| match e.route(size, direction, memory) {
                            Route::Driver => "\"driver\"".to_string(),
                            Route::Engine(p) => format!("\"engine:{}\"", p.len()),
                        })
                        .collect();
                    let values: Vec<String> = gbps.iter().map(|g| format!("{g:.4}")).collect();
                    let _ = writeln!(
                        file,
                        "{{\"bytes\":{size},\"direction\":\"{dir}\",\"memory\":\"{kind}\",\"methods\":[{}],\"gbps\":[{}],\"routes\":[{}]}}",
                        names.iter().map(|n| format!("\"{n}\"")).collect::<Vec<_>>().join(","),
                        values.join(","),
                        routes.join(",")
                    );
                }
            }
        }
    }
    drop(engines);
    let _ = target.destroy_stream(stream);
    Ok(())
}

/// Seconds of one copy of `size` bytes by `method`, from its call until the data has arrived.
#[allow(clippy::too_many_arguments)]
fn time_copy(
    target: &SharedDevice,
    engines: &[Engine],
    buffers: &mut Buffers,
    stream: Stream,
    method: Method,
    direction: Direction,
    memory: HostMemory,
    size: usize,
) -> glake::Result<f64> {
    let host = match memory {
        HostMemory::Pageable => buffers.pageable.as_mut_ptr(),
        HostMemory::Pinned => buffers.pinned.ptr(),
    };
    let device = buffers.device.va();
    let started = Instant::now();
    match (method, direction) {
        // SAFETY: the buffers hold `size` bytes and outlive the synchronised copy.
        (Method::Driver, Direction::HostToDevice) => unsafe {
            target.copy_to_device(device, host, size, stream)?
        },
        // SAFETY: as above.
        (Method::Driver, Direction::DeviceToHost) => unsafe {
            target.copy_to_host(host, device, size, stream)?
        },
        // SAFETY: as above; blocking copies.
        (Method::Engine(e), Direction::HostToDevice) => unsafe {
            engines[e].copy_to_device(device, host, size, stream, Completion::Blocking)?
        },
        // SAFETY: as above.
        (Method::Engine(e), Direction::DeviceToHost) => unsafe {
            engines[e].copy_to_host(host, device, size, stream, Completion::Blocking)?
        },
    }
    // The engine's blocking copies return once the data has arrived; the driver's calls are
    // only queued, so they are waited for here.
    if method == Method::Driver {
        target.synchronize_stream(stream)?;
    }
    Ok(started.elapsed().as_secs_f64())
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    glake::init_logging();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("glake-copy-bench: {message}");
            ExitCode::FAILURE
        }
    }
}
