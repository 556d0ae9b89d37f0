//! Segment events: the segments that a thread's calls created and released, in order, for
//! PyTorch's allocator trace (its memory snapshots record `segment_alloc` and `segment_free`).
//! Recording is one switch for the process, off by default: while off, creating or releasing a
//! segment costs one relaxed load more. Events are kept per thread, so that each caller takes
//! exactly the events of its own calls.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};

use super::PrivatePoolId;
use crate::device::DevicePtr;

static RECORDING: AtomicBool = AtomicBool::new(false);

thread_local! {
    static EVENTS: RefCell<Vec<SegmentEvent>> = const { RefCell::new(Vec::new()) };
}

/// What happened to a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentEventKind {
    /// Physical memory created and mapped.
    Alloc,
    /// Released to the driver.
    Free,
}

/// One segment created or released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentEvent {
    pub kind: SegmentEventKind,
    /// The device ordinal of the pool.
    pub device: i32,
    pub address: DevicePtr,
    pub size: usize,
    /// The private pool the segment belongs to; None for the shared pool.
    pub pool: Option<PrivatePoolId>,
}

/// Turns recording on or off for every thread. Events already kept stay until taken.
pub fn set_recording(on: bool) {
    RECORDING.store(on, Ordering::Relaxed);
}

/// Whether events are being recorded.
pub fn recording() -> bool {
    RECORDING.load(Ordering::Relaxed)
}

/// Keeps an event for the calling thread when recording is on; `event` builds it only then.
pub(super) fn record(event: impl FnOnce() -> SegmentEvent) {
    if recording() {
        let event = event();
        // A thread being torn down has no buffer left; its event is dropped.
        let _ = EVENTS.try_with(|events| events.borrow_mut().push(event));
    }
}

/// The calling thread's events, oldest first; they are forgotten here.
pub fn take() -> Vec<SegmentEvent> {
    EVENTS
        .try_with(|events| std::mem::take(&mut *events.borrow_mut()))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::device::host::{HostDevice, HostOptions};
    use crate::device::Stream;
    use crate::pool::Pool;
    use std::sync::Arc;

    const MIB: usize = 1 << 20;

    /// One test, since the switch is global to the process: tests in parallel would race on it.
    #[test]
    fn segments_created_and_released_are_recorded_per_thread_while_on() {
        let device = Arc::new(HostDevice::new(0, HostOptions::default()).expect("host device"));
        let pool = Pool::new(device, Config::default()).expect("pool");
        take();

        // Off: nothing is kept.
        set_recording(false);
        let p = pool.malloc(8 * MIB, Stream::DEFAULT).expect("malloc");
        pool.free(p).expect("free");
        pool.empty_cache().expect("empty_cache");
        assert!(take().is_empty());

        // On: the segment a malloc creates, then its release, in order.
        set_recording(true);
        let p = pool.malloc(8 * MIB, Stream::DEFAULT).expect("malloc");
        let alloc = SegmentEvent {
            kind: SegmentEventKind::Alloc,
            device: 0,
            address: p,
            size: 8 * MIB,
            pool: None,
        };
        assert_eq!(take(), vec![alloc]);
        assert!(take().is_empty(), "taken events are forgotten");
        pool.free(p).expect("free");
        pool.empty_cache().expect("empty_cache");
        let free = SegmentEvent {
            kind: SegmentEventKind::Free,
            ..alloc
        };
        assert_eq!(take(), vec![free]);

        // A private pool's segment names its pool; another thread sees none of this thread's
        // events, and this thread none of its.
        pool.retain_private((3, 4));
        let q = pool
            .malloc_in(4 * MIB, Stream::DEFAULT, Some((3, 4)))
            .expect("malloc_in");
        std::thread::scope(|s| {
            s.spawn(|| {
                assert!(take().is_empty());
                let r = pool.malloc(6 * MIB, Stream::DEFAULT).expect("malloc");
                let mine = take();
                assert_eq!(mine.len(), 1);
                assert_eq!((mine[0].address, mine[0].size), (r, 6 * MIB));
                pool.free(r).expect("free");
            });
        });
        let events = take();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].address, q);
        assert_eq!(events[0].pool, Some((3, 4)));
        pool.free(q).expect("free");
        pool.release_private((3, 4)).expect("release");
        set_recording(false);
        pool.empty_cache().expect("empty_cache");
        assert!(take().is_empty());
    }
}
