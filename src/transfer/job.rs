//! One copy as the lanes see it: what to move, the cursor its chunks come from, the events that
//! order it against the caller's stream, and how the lanes report back.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};

use super::plan::{Cursor, Direction};
use crate::device::{DevicePtr, Event, HostMemory};
use crate::error::Error;
use crate::sync::lock;

/// A copy handed to a set of lanes.
pub struct Job {
    pub direction: Direction,
    pub host: HostMemory,
    /// The pieces' starts: host side (read for host-to-device, written for device-to-host),
    /// device side (on the target device). The cursor holds their lengths.
    pub pieces: Vec<(usize, DevicePtr)>,
    pub cursor: Cursor,
    /// Bytes of the whole copy (every piece).
    pub len: usize,
    /// Recorded on the caller's stream: device work of the copy waits for it.
    pub start: Event,
    /// One event per lane taking part, recorded after its last piece of work.
    pub finals: Vec<Event>,
    /// For copies with page-locked host memory: the chunks each lane (by its index in
    /// `finals`) issues, all at once with the order kept on the device, so the caller is not
    /// held until the data moves. None: lanes pull chunks from the cursor as slots free up.
    pub shares: Option<Vec<Range<usize>>>,
    failed: AtomicBool,
    error: Mutex<Option<Error>>,
    remaining: Mutex<usize>,
    finished: Condvar,
}

impl Job {
    pub fn new(
        direction: Direction,
        host: HostMemory,
        pieces: Vec<(usize, DevicePtr)>,
        cursor: Cursor,
        start: Event,
        finals: Vec<Event>,
        shares: Option<Vec<Range<usize>>>,
    ) -> Self {
        let lanes = finals.len();
        Job {
            len: cursor.len(),
            direction,
            host,
            pieces,
            cursor,
            start,
            finals,
            shares,
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
            remaining: Mutex::new(lanes),
            finished: Condvar::new(),
        }
    }

    /// Whether a lane has failed: the others stop taking chunks.
    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Records a lane's failure (the first error is the one reported).
    pub fn fail(&self, err: Error) {
        self.failed.store(true, Ordering::Release);
        let mut slot = lock(&self.error);
        slot.get_or_insert(err);
    }

    /// A lane is done with this job (all its device work is queued, and for pageable
    /// device-to-host copies its bytes have landed).
    pub fn lane_done(&self) {
        let mut remaining = lock(&self.remaining);
        *remaining = remaining.saturating_sub(1);
        if *remaining == 0 {
            self.finished.notify_all();
        }
    }

    /// Waits until every lane is done; the first error, if any.
    pub fn wait(&self) -> Option<Error> {
        let mut remaining = lock(&self.remaining);
        while *remaining > 0 {
            remaining = match self.finished.wait(remaining) {
                Ok(guard) => guard,
                Err(poisoned) => poisoned.into_inner(),
            };
        }
        drop(remaining);
        lock(&self.error).take()
    }
}
