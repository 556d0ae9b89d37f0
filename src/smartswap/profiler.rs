//! The profiler: a [`Recorder`] fed by op hooks, with each op's device time measured by timed
//! events recorded on the op's stream when it begins and ends (read once the iteration is
//! over, so the hooks never wait for the device).

use std::sync::{Arc, Mutex};

use crate::device::{Event, SharedDevice, Stream};
use crate::error::{Error, Result};
use crate::pool::{AllocationEvent, Pool};
use crate::swap::{Phase, Profile, Recorder, SwapError};
use crate::sync::lock;

/// Records iterations of one device's ops.
pub struct Profiler {
    device: SharedDevice,
    recorder: Recorder,
    /// Timed event pairs (begin, end), made once and reused from one iteration to the next;
    /// the first `used` of them are taken by the iteration being recorded.
    events: Vec<(Event, Event)>,
    used: usize,
    /// Each op's pair, by op index (None where making or recording it failed).
    timing: Vec<Option<(Event, Event)>>,
    /// The stream of the op running.
    stream: Option<Stream>,
}

fn hook_error(err: SwapError) -> Error {
    Error::invalid_argument(err.to_string())
}

impl Profiler {
    pub fn new(device: SharedDevice) -> Self {
        Profiler {
            device,
            recorder: Recorder::default(),
            events: Vec::new(),
            used: 0,
            timing: Vec::new(),
            stream: None,
        }
    }

    /// Starts recording an iteration (anything recorded before is dropped).
    pub fn begin_iteration(&mut self) {
        self.recorder.begin_iteration();
        self.used = 0;
        self.timing.clear();
        self.stream = None;
    }

    /// The phase of the ops that begin from now on.
    pub fn set_phase(&mut self, phase: Phase) {
        self.recorder.set_phase(phase);
    }

    /// An op named `name` begins on `stream`; its index in the iteration.
    pub fn begin_op(&mut self, name: &str, stream: Stream) -> Result<usize> {
        let index = self.recorder.begin_op(name).map_err(hook_error)?;
        let pair = self
            .timed_pair()
            .and_then(|pair| self.device.record_event(pair.0, stream).map(|()| pair));
        match pair {
            Ok(pair) => self.timing.push(Some(pair)),
            Err(err) => {
                // The op stays in the profile with no time; the hooks go on.
                log::warn!("glake: timing op {index} ({name}) failed: {err}");
                self.timing.push(None);
            }
        }
        self.stream = Some(stream);
        Ok(index)
    }

    /// The running op touches `bytes` at `ptr`.
    pub fn tensor(&mut self, ptr: u64, bytes: usize) -> Result<()> {
        self.recorder.tensor(ptr, bytes).map_err(hook_error)
    }

    /// The running op has ended (its work is queued on its stream).
    pub fn end_op(&mut self) -> Result<()> {
        let index = self.recorder.end_op().map_err(hook_error)?;
        if let (Some(stream), Some(Some((_, end)))) = (self.stream.take(), self.timing.get(index)) {
            if let Err(err) = self.device.record_event(*end, stream) {
                log::warn!("glake: timing op {index} failed: {err}");
                self.timing[index] = None;
            }
        }
        Ok(())
    }

    /// The pool made `bytes` at `ptr`.
    pub fn allocated(&mut self, ptr: u64, bytes: usize) {
        self.recorder.allocated(ptr, bytes);
    }

    /// The pool took `ptr` back.
    pub fn freed(&mut self, ptr: u64) {
        self.recorder.freed(ptr);
    }

    /// Ends the iteration: waits for its last op, reads every op's time, returns the profile.
    pub fn end_iteration(&mut self) -> Result<Profile> {
        for (op, pair) in std::mem::take(&mut self.timing).into_iter().enumerate() {
            // An op whose events were not recorded keeps no time (0).
            let Some((begin, end)) = pair else { continue };
            if self.device.synchronize_event(end).is_ok() {
                if let Ok(ns) = self.device.elapsed_ns(begin, end) {
                    self.recorder.set_op_time(op, ns).map_err(hook_error)?;
                }
            }
        }
        self.used = 0;
        self.recorder.end_iteration().map_err(hook_error)
    }

    /// For each tensor of the last profile, which allocation of its iteration it was.
    pub fn allocation_ordinals(&self) -> &[usize] {
        self.recorder.allocation_ordinals()
    }

    /// The timed events of the next op, made on first use.
    fn timed_pair(&mut self) -> Result<(Event, Event)> {
        if self.used == self.events.len() {
            let begin = self.device.create_timed_event()?;
            let end = match self.device.create_timed_event() {
                Ok(end) => end,
                Err(err) => {
                    let _ = self.device.destroy_event(begin);
                    return Err(err);
                }
            };
            self.events.push((begin, end));
        }
        let pair = self.events[self.used];
        self.used += 1;
        Ok(pair)
    }
}

/// Makes `pool` tell `profiler` of its allocations and frees (recorded while an iteration is
/// open), replacing any observer the pool had. The pool holds the profiler weakly: once the
/// profiler is dropped, its events go nowhere. While the profiler's lock is held (the end of
/// an iteration waits for the device under it), allocations in other threads wait too.
pub fn attach(pool: &Pool, profiler: &Arc<Mutex<Profiler>>) {
    let weak = Arc::downgrade(profiler);
    pool.set_observer(Some(Arc::new(move |event| {
        if let Some(profiler) = weak.upgrade() {
            let mut profiler = lock(&profiler);
            match event {
                AllocationEvent::Allocated { ptr, bytes } => profiler.allocated(ptr, bytes),
                AllocationEvent::Freed { ptr } => profiler.freed(ptr),
            }
        }
    })));
}

impl Drop for Profiler {
    fn drop(&mut self) {
        for &(begin, end) in &self.events {
            // Recorded work may still run: wait for it before the events go.
            let _ = self.device.synchronize_event(end);
            let _ = self.device.destroy_event(begin);
            let _ = self.device.destroy_event(end);
        }
    }
}
