//! Quick start: allocate, fragment, stitch, print statistics.
//!
//! Runs on the GPU when one is usable, otherwise on the host backend:
//! `cargo run --release --example quickstart` (`GLAKE_LOG=debug` shows each stitch).
//! The same fragmenting workload runs twice under a 1 GiB budget: with stitching it fits;
//! with plain caching (GMLake's vmmDefragment=0) the last request runs out of memory.

use glake::device::{self, BackendChoice, SharedDevice, Stream};
use glake::{Config, Pool};

const MIB: usize = 1 << 20;
const BUDGET: usize = 1024 * MIB;

fn run(device: &SharedDevice, config: Config, label: &str) -> glake::Result<()> {
    let pool = Pool::new(device.clone(), config)?;
    pool.set_memory_limit(BUDGET)?;

    // Fill the budget with 16 blocks of 64 MiB, carved from one segment, then free every other.
    let whole = pool.malloc(BUDGET, Stream::DEFAULT)?;
    pool.free(whole)?;
    let blocks: Vec<u64> = (0..16)
        .map(|_| pool.malloc(64 * MIB, Stream::DEFAULT))
        .collect::<glake::Result<_>>()?;
    for &b in blocks.iter().step_by(2) {
        pool.free(b)?;
    }

    // 512 MiB is free, in eight 64 MiB holes; ask for 256 MiB in one piece.
    let result = pool.malloc(256 * MIB, Stream::DEFAULT);
    let stats = pool.stats();
    println!("== {label} ==");
    match &result {
        Ok(ptr) => println!("256 MiB request: ok at {ptr:#x}"),
        Err(err) => println!("256 MiB request: failed: {}", err.message()),
    }
    println!(
        "allocated {:>5} MiB   reserved {:>5} MiB (peak {:>5} MiB)   stitches {}   stitched pieces {}   OOMs {}",
        stats.allocated_bytes.all.current >> 20,
        stats.reserved_bytes.all.current >> 20,
        stats.reserved_bytes.all.peak >> 20,
        stats.stitches,
        stats.stitched_pieces,
        stats.num_ooms
    );
    if let Ok(ptr) = result {
        pool.free(ptr)?;
        // The same request again reuses the cached stitched range: no driver call.
        let again = pool.malloc(256 * MIB, Stream::DEFAULT)?;
        println!(
            "again: {} (stitched-cache hits {})",
            if again == ptr {
                "same range"
            } else {
                "new range"
            },
            pool.stats().stitch_reuse_hits
        );
        pool.free(again)?;
    }
    for &b in blocks.iter().skip(1).step_by(2) {
        pool.free(b)?;
    }
    pool.empty_cache()?;
    println!(
        "after empty_cache: reserved {} MiB\n",
        pool.stats().reserved_bytes.all.current >> 20
    );
    Ok(())
}

fn main() {
    glake::init_logging();
    let device = match device::open(
        BackendChoice::Auto,
        0,
        glake::config::host_options_from_env(),
    ) {
        Ok(device) => device,
        Err(err) => {
            eprintln!("no device: {err}");
            std::process::exit(1);
        }
    };
    let total = device.mem_info().map_or(0, |info| info.total);
    println!(
        "GLake {} on the {} backend (device {}, {} bytes, granularity {} KiB)\n",
        env!("CARGO_PKG_VERSION"),
        device.kind().name(),
        device.ordinal(),
        total,
        device.granularity() >> 10
    );
    let stitching = Config::from_env();
    let caching = Config {
        stitch: false,
        ..stitching.clone()
    };
    for (config, label) in [
        (stitching, "stitching (default)"),
        (caching, "plain caching"),
    ] {
        if let Err(err) = run(&device, config, label) {
            eprintln!("{label}: {err}");
            std::process::exit(1);
        }
    }
}
