//! Measures the time spent inside each driver call, so that the allocator's own CPU cost can
//! be told apart from the driver's (mapping calls dominate a stitch on CUDA and are syscalls on
//! the host backend).

use std::panic::Location;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use glake::device::interpose::{Interposed, Interposer};
use glake::device::{CallKind, SharedDevice};
use glake::error::Result;

/// Calls and nanoseconds of one kind of driver call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallTime {
    pub kind: CallKind,
    pub calls: u64,
    pub nanos: u64,
}

/// Running totals of driver calls and their wall time, overall and per kind.
pub struct CallTimer {
    nanos: AtomicU64,
    calls: AtomicU64,
    by_kind: [(AtomicU64, AtomicU64); CallKind::ALL.len()],
}

impl Interposer for CallTimer {
    fn around<T>(
        &self,
        kind: CallKind,
        _site: &'static Location<'static>,
        call: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let start = Instant::now();
        let result = call();
        let nanos = start.elapsed().as_nanos() as u64;
        self.nanos.fetch_add(nanos, Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::Relaxed);
        if let Some((calls, total)) = self.by_kind.get(kind as usize) {
            calls.fetch_add(1, Ordering::Relaxed);
            total.fetch_add(nanos, Ordering::Relaxed);
        }
        result
    }
}

/// A device whose driver calls are timed: read the totals through `hook()`.
pub type TimedDevice = Interposed<CallTimer>;

/// Wraps `inner` so that the wall time of every driver call adds up.
pub fn timed(inner: SharedDevice) -> TimedDevice {
    Interposed::with(
        inner,
        CallTimer {
            nanos: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            by_kind: std::array::from_fn(|_| (AtomicU64::new(0), AtomicU64::new(0))),
        },
    )
}

impl CallTimer {
    /// Nanoseconds spent inside driver calls so far.
    pub fn nanos(&self) -> u64 {
        self.nanos.load(Ordering::Relaxed)
    }

    /// Driver calls made so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Calls and time per kind, for the kinds that were called.
    pub fn by_kind(&self) -> Vec<CallTime> {
        CallKind::ALL
            .iter()
            .zip(self.by_kind.iter())
            .map(|(&kind, (calls, nanos))| CallTime {
                kind,
                calls: calls.load(Ordering::Relaxed),
                nanos: nanos.load(Ordering::Relaxed),
            })
            .filter(|c| c.calls > 0)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use glake::device::host::{HostDevice, HostOptions};
    use glake::device::{BackendKind, Device};
    use std::sync::Arc;

    #[test]
    fn counts_driver_calls_and_time() {
        let host = HostDevice::shared(0, HostOptions::default()).unwrap();
        let timed = timed(host);
        let g = timed.granularity();
        assert_eq!(timed.hook().calls(), 0, "getters are not driver calls");
        let h = timed.create_physical(g).unwrap();
        let va = timed.reserve(g, g).unwrap();
        timed.map(va, g, h, 0).unwrap();
        timed.unmap(va, g).unwrap();
        timed.unreserve(va, g).unwrap();
        timed.release_physical(h).unwrap();
        assert_eq!(timed.hook().calls(), 6);
        assert!(timed.hook().nanos() > 0);
        let kinds = timed.hook().by_kind();
        assert_eq!(kinds.len(), 6);
        assert!(kinds.iter().all(|c| c.calls == 1));
        let shared: SharedDevice = Arc::new(timed);
        assert_eq!(shared.kind(), BackendKind::Host);
    }
}
