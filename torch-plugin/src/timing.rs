//! Opt-in accounting of the time spent inside `gmlake_malloc` and `gmlake_free`, and their
//! native counterparts `gmlake_n_malloc` and `gmlake_n_free` (`GLAKE_TIME_CALLS=1`), so that a
//! benchmark can tell the allocator's share of a step. Off, it costs one relaxed load per call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// Calls and nanoseconds of one entry point.
pub struct Counter {
    calls: AtomicU64,
    nanos: AtomicU64,
}

impl Counter {
    const fn new() -> Self {
        Counter {
            calls: AtomicU64::new(0),
            nanos: AtomicU64::new(0),
        }
    }

    fn read(&self) -> (u64, u64) {
        (
            self.calls.load(Ordering::Relaxed),
            self.nanos.load(Ordering::Relaxed),
        )
    }
}

pub static MALLOC: Counter = Counter::new();
pub static FREE: Counter = Counter::new();

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("GLAKE_TIME_CALLS").is_ok_and(|v| !matches!(v.trim(), "" | "0"))
    })
}

/// Runs `body`, adding its duration to `counter` when timing is on.
pub fn timed<T>(counter: &Counter, body: impl FnOnce() -> T) -> T {
    if !enabled() {
        return body();
    }
    let start = Instant::now();
    let result = body();
    counter
        .nanos
        .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    counter.calls.fetch_add(1, Ordering::Relaxed);
    result
}

/// The totals as a JSON object (all zero when timing is off).
pub fn to_json() -> String {
    let (malloc_calls, malloc_ns) = MALLOC.read();
    let (free_calls, free_ns) = FREE.read();
    format!(
        "{{\"enabled\":{},\"malloc_calls\":{malloc_calls},\"malloc_ns\":{malloc_ns},\"free_calls\":{free_calls},\"free_ns\":{free_ns}}}",
        enabled()
    )
}
