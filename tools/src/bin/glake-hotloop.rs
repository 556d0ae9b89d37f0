//! The allocator's fast path in a tight loop: 64 tensors of fixed sizes (3 MiB and up for one in
//! three, 0.5-48 KiB for the others) allocated in order and freed in reverse, round after round,
//! as a training loop's layers do, on the host backend. After the first rounds every request
//! is served from a parked block, so the figure is the cost of a malloc and free that the fast
//! path serves: the pool's lock twice, the books and the parked lists, with no per-call timer
//! in it (the loop is timed as a whole). `glake-replay` gives the same cost per call on a
//! recorded trace, where requests also miss and the timer adds its own.
//!
//! usage: glake-hotloop [ROUNDS] [PASSES]   (defaults 20000 and 3)

use std::process::ExitCode;
use std::time::Instant;

use glake::device::{self, BackendChoice, Stream};
use glake::{Config, Pool};

const TENSORS: usize = 64;

/// The sizes of one round: spread over the small pool, with every third in the large pool.
fn sizes() -> Vec<usize> {
    (0..TENSORS)
        .map(|i| 512 * (1 + (i * 37) % 97) + if i % 3 == 0 { 3 << 20 } else { 0 })
        .collect()
}

fn parse(arg: Option<String>, default: usize, what: &str) -> Result<usize, String> {
    match arg {
        None => Ok(default),
        Some(text) => match text.parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("{what} must be a positive number, not {text:?}")),
        },
    }
}

fn run() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let rounds = parse(args.next(), 20_000, "ROUNDS")?;
    let passes = parse(args.next(), 3, "PASSES")?;
    let device = device::open(BackendChoice::Host, 0, Default::default())
        .map_err(|e| format!("opening the host backend: {e}"))?;
    let pool = Pool::new(device, Config::default()).map_err(|e| format!("pool: {e}"))?;
    let sizes = sizes();
    let mut ptrs = vec![0; sizes.len()];
    let mut round = |n: usize| -> Result<(), String> {
        for _ in 0..n {
            for (ptr, &size) in ptrs.iter_mut().zip(&sizes) {
                *ptr = pool
                    .malloc(size, Stream::DEFAULT)
                    .map_err(|e| format!("malloc({size}): {e}"))?;
            }
            for &ptr in ptrs.iter().rev() {
                pool.free(ptr).map_err(|e| format!("free: {e}"))?;
            }
        }
        Ok(())
    };
    round(10)?;
    for pass in 1..=passes {
        let start = Instant::now();
        round(rounds)?;
        let pairs = (rounds * TENSORS) as f64;
        let ns = start.elapsed().as_nanos() as f64 / pairs;
        println!("pass {pass}: {ns:.1} ns per malloc + free ({pairs} pairs)");
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("glake-hotloop: {err}");
            ExitCode::FAILURE
        }
    }
}
