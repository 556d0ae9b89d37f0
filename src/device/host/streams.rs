//! Streams and events of the host backend: each stream is a worker thread that runs its queue
//! in order, and an event completes when a worker reaches the point where it was recorded.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use super::{lock, HostDevice};
use crate::device::{Event, Stream};
use crate::error::{Error, ErrorKind, Result};

/// One piece of work queued on a stream.
pub(super) enum Op {
    Copy {
        dst: usize,
        src: usize,
        len: usize,
    },
    /// A host-to-device copy whose source was staged at enqueue time.
    Upload {
        dst: usize,
        data: Vec<u8>,
    },
    Record {
        event: u64,
        generation: u64,
    },
    Wait {
        event: u64,
        generation: u64,
    },
    Host(Box<dyn FnOnce() + Send>),
}

#[derive(Default)]
struct StreamState {
    queue: VecDeque<Op>,
    running: bool,
    shutdown: bool,
}

struct StreamShared {
    state: Mutex<StreamState>,
    work: Condvar,
    idle: Condvar,
}

/// A stream's worker thread and the queue it shares with the device.
pub(super) struct HostStream {
    shared: Arc<StreamShared>,
    worker: Option<JoinHandle<()>>,
}

impl HostStream {
    /// Lets the worker finish the queued work, then joins it.
    fn finish(mut self) {
        lock(&self.shared.state).shutdown = true;
        self.shared.work.notify_all();
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

#[derive(Default, Clone, Copy)]
struct EventState {
    recorded: u64,
    completed: u64,
    /// Timed events keep when their last completion happened.
    timed: bool,
    completed_at: Option<Instant>,
}

/// Every event of the process's host devices (a stream may wait for another device's event,
/// as with CUDA): how many times each was recorded and how far the workers got.
#[derive(Default)]
pub(super) struct Events {
    states: Mutex<HashMap<u64, EventState>>,
    changed: Condvar,
}

impl Events {
    /// The events of the process, shared by all host devices.
    pub(super) fn global() -> Arc<Events> {
        static EVENTS: OnceLock<Arc<Events>> = OnceLock::new();
        EVENTS.get_or_init(|| Arc::new(Events::default())).clone()
    }

    fn complete(&self, event: u64, generation: u64) {
        let mut states = lock(&self.states);
        if let Some(state) = states.get_mut(&event) {
            state.completed = state.completed.max(generation);
            if state.timed {
                state.completed_at = Some(Instant::now());
            }
        }
        self.changed.notify_all();
    }

    fn wait(&self, event: u64, generation: u64) {
        let mut states = lock(&self.states);
        loop {
            match states.get(&event) {
                Some(state) if state.completed < generation => {}
                _ => return,
            }
            states = match self.changed.wait(states) {
                Ok(guard) => guard,
                Err(poisoned) => poisoned.into_inner(),
            };
        }
    }

    /// The generation `event` was last recorded at.
    fn recorded(&self, event: Event) -> Result<u64> {
        lock(&self.states)
            .get(&event.0)
            .map(|s| s.recorded)
            .ok_or_else(|| Error::invalid_argument(format!("unknown event {}", event.0)))
    }
}

fn run_stream(shared: &StreamShared, events: &Events) {
    loop {
        let op = {
            let mut state = lock(&shared.state);
            loop {
                if let Some(op) = state.queue.pop_front() {
                    state.running = true;
                    break op;
                }
                state.running = false;
                shared.idle.notify_all();
                if state.shutdown {
                    return;
                }
                state = match shared.work.wait(state) {
                    Ok(guard) => guard,
                    Err(poisoned) => poisoned.into_inner(),
                };
            }
        };
        match op {
            // SAFETY: both ranges were checked to be mapped and accessible (or to be caller-owned
            // host memory, per the unsafe contract of the copy calls) when the copy was queued.
            Op::Copy { dst, src, len } => unsafe {
                std::ptr::copy(src as *const u8, dst as *mut u8, len)
            },
            // SAFETY: the destination was checked to be mapped and accessible when queued.
            Op::Upload { dst, data } => unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, data.len())
            },
            Op::Record { event, generation } => events.complete(event, generation),
            Op::Wait { event, generation } => events.wait(event, generation),
            Op::Host(f) => {
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
                    log::error!("a host function queued on a stream panicked");
                }
            }
        }
    }
}

impl HostDevice {
    pub(super) fn start_stream(&self, id: u64) -> Result<()> {
        let shared = Arc::new(StreamShared {
            state: Mutex::new(StreamState::default()),
            work: Condvar::new(),
            idle: Condvar::new(),
        });
        let worker_shared = shared.clone();
        let events = self.events.clone();
        let worker = std::thread::Builder::new()
            .name(format!("glake-host-stream-{id}"))
            .spawn(move || run_stream(&worker_shared, &events))
            .map_err(|e| Error::driver(format!("spawning a host stream worker: {e}")))?;
        lock(&self.streams).insert(
            id,
            HostStream {
                shared,
                worker: Some(worker),
            },
        );
        Ok(())
    }

    /// Finishes every stream's queued work and joins the workers, when the device goes away.
    pub(super) fn stop_streams(&self) {
        let streams: Vec<HostStream> = lock(&self.streams).drain().map(|(_, s)| s).collect();
        for stream in streams {
            stream.finish();
        }
    }

    pub(super) fn enqueue(&self, stream: Stream, op: Op) -> Result<()> {
        self.enqueue_unless_idle(stream, op, false).map(|_| ())
    }

    /// Queues `op` on `stream`; with `unless_idle`, an idle stream (nothing queued or running)
    /// gets nothing and the call answers true: the op would complete at once.
    fn enqueue_unless_idle(&self, stream: Stream, op: Op, unless_idle: bool) -> Result<bool> {
        let streams = lock(&self.streams);
        let host_stream = streams
            .get(&stream.0)
            .ok_or_else(|| Error::invalid_argument(format!("unknown stream {:#x}", stream.0)))?;
        let mut state = lock(&host_stream.shared.state);
        if unless_idle && state.queue.is_empty() && !state.running {
            return Ok(true);
        }
        state.queue.push_back(op);
        host_stream.shared.work.notify_one();
        Ok(false)
    }

    /// Queues a host function on `stream`: it runs in stream order. Tests use it to hold a
    /// stream busy (a gate) and check that stream-ordered reuse waits for it.
    pub fn enqueue_host_fn(&self, stream: Stream, f: Box<dyn FnOnce() + Send>) -> Result<()> {
        self.enqueue(stream, Op::Host(f))
    }

    /// [`Device::knows_stream`](crate::device::Device::knows_stream).
    pub(super) fn has_stream(&self, stream: Stream) -> bool {
        lock(&self.streams).contains_key(&stream.0)
    }

    /// [`Device::create_stream`](crate::device::Device::create_stream).
    pub(super) fn add_stream(&self) -> Result<Stream> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.start_stream(id)?;
        Ok(Stream(id))
    }

    /// [`Device::destroy_stream`](crate::device::Device::destroy_stream).
    pub(super) fn remove_stream(&self, stream: Stream) -> Result<()> {
        if stream == Stream::DEFAULT {
            return Err(Error::invalid_argument(
                "the default stream cannot be destroyed",
            ));
        }
        let removed = lock(&self.streams).remove(&stream.0);
        let host_stream = removed
            .ok_or_else(|| Error::invalid_argument(format!("unknown stream {:#x}", stream.0)))?;
        // Like CUDA, queued work still completes.
        host_stream.finish();
        Ok(())
    }

    /// Streams created and not destroyed, the default stream included (leak checks in tests).
    pub fn live_streams(&self) -> usize {
        lock(&self.streams).len()
    }

    /// [`Device::create_event`](crate::device::Device::create_event).
    pub(super) fn add_event(&self) -> Result<Event> {
        self.add_event_state(EventState::default())
    }

    /// [`Device::create_timed_event`](crate::device::Device::create_timed_event).
    pub(super) fn add_timed_event(&self) -> Result<Event> {
        self.add_event_state(EventState {
            timed: true,
            ..EventState::default()
        })
    }

    fn add_event_state(&self, state: EventState) -> Result<Event> {
        // Unique in the process: events are shared by all host devices.
        static NEXT_EVENT: AtomicU64 = AtomicU64::new(1);
        let id = NEXT_EVENT.fetch_add(1, Ordering::Relaxed);
        lock(&self.events.states).insert(id, state);
        Ok(Event(id))
    }

    /// [`Device::elapsed_ns`](crate::device::Device::elapsed_ns).
    pub(super) fn events_elapsed_ns(&self, start: Event, end: Event) -> Result<u64> {
        let states = lock(&self.events.states);
        let at = |event: Event| -> Result<Instant> {
            let state = states
                .get(&event.0)
                .ok_or_else(|| Error::invalid_argument(format!("unknown event {}", event.0)))?;
            if !state.timed {
                return Err(Error::invalid_argument(format!(
                    "event {} was made without timing",
                    event.0
                )));
            }
            match state.completed_at {
                Some(t) if state.recorded > 0 && state.completed >= state.recorded => Ok(t),
                _ => Err(Error::new(
                    ErrorKind::InvalidState,
                    format!("event {} has not completed", event.0),
                )),
            }
        };
        let (start, end) = (at(start)?, at(end)?);
        Ok(u64::try_from(end.saturating_duration_since(start).as_nanos()).unwrap_or(u64::MAX))
    }

    /// [`Device::destroy_event`](crate::device::Device::destroy_event).
    pub(super) fn remove_event(&self, event: Event) -> Result<()> {
        lock(&self.events.states)
            .remove(&event.0)
            .map(|_| ())
            .ok_or_else(|| Error::invalid_argument(format!("unknown event {}", event.0)))
    }

    /// [`Device::record_event`](crate::device::Device::record_event).
    pub(super) fn record(&self, event: Event, stream: Stream) -> Result<()> {
        let generation = {
            let mut states = lock(&self.events.states);
            let state = states
                .get_mut(&event.0)
                .ok_or_else(|| Error::invalid_argument(format!("unknown event {}", event.0)))?;
            state.recorded += 1;
            state.recorded
        };
        // An event recorded on an idle stream completes at once, as on a GPU: a replay, which
        // queues no work, then sees the same completions on every run.
        let op = Op::Record {
            event: event.0,
            generation,
        };
        match self.enqueue_unless_idle(stream, op, true) {
            Ok(true) => self.events.complete(event.0, generation),
            Ok(false) => {}
            Err(err) => {
                // Nothing will complete this generation: take it back, or waits would hang.
                if let Some(state) = lock(&self.events.states).get_mut(&event.0) {
                    if state.recorded == generation {
                        state.recorded -= 1;
                    }
                }
                return Err(err);
            }
        }
        Ok(())
    }

    /// [`Device::query_event`](crate::device::Device::query_event).
    pub(super) fn event_complete(&self, event: Event) -> Result<bool> {
        let states = lock(&self.events.states);
        let state = states
            .get(&event.0)
            .ok_or_else(|| Error::invalid_argument(format!("unknown event {}", event.0)))?;
        Ok(state.completed >= state.recorded)
    }

    /// [`Device::synchronize_event`](crate::device::Device::synchronize_event).
    pub(super) fn wait_for_event(&self, event: Event) -> Result<()> {
        let generation = self.events.recorded(event)?;
        self.events.wait(event.0, generation);
        Ok(())
    }

    /// [`Device::synchronize_stream`](crate::device::Device::synchronize_stream).
    pub(super) fn wait_for_stream(&self, stream: Stream) -> Result<()> {
        let shared = lock(&self.streams)
            .get(&stream.0)
            .map(|s| s.shared.clone())
            .ok_or_else(|| Error::invalid_argument(format!("unknown stream {:#x}", stream.0)))?;
        let mut state = lock(&shared.state);
        while state.running || !state.queue.is_empty() {
            state = match shared.idle.wait(state) {
                Ok(guard) => guard,
                Err(poisoned) => poisoned.into_inner(),
            };
        }
        Ok(())
    }

    /// [`Device::synchronize_device`](crate::device::Device::synchronize_device).
    pub(super) fn wait_for_all_streams(&self) -> Result<()> {
        let ids: Vec<u64> = lock(&self.streams).keys().copied().collect();
        for id in ids {
            match self.wait_for_stream(Stream(id)) {
                // A stream destroyed meanwhile has finished its work.
                Err(err) if err.kind() == ErrorKind::InvalidArgument => {}
                other => other?,
            }
        }
        Ok(())
    }

    /// [`Device::stream_wait_event`](crate::device::Device::stream_wait_event).
    pub(super) fn enqueue_event_wait(&self, stream: Stream, event: Event) -> Result<()> {
        let generation = self.events.recorded(event)?;
        self.enqueue(
            stream,
            Op::Wait {
                event: event.0,
                generation,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_device as device;
    use crate::device::{Device, Stream};

    #[test]
    fn streams_run_in_order_and_events_follow() {
        let d = device();
        let g = d.granularity();
        let h = d.create_physical(g).unwrap();
        let va = d.reserve(g, g).unwrap();
        d.map(va, g, h, 0).unwrap();
        d.set_access(va, g, &[0]).unwrap();
        let s = d.create_stream().unwrap();
        let e = d.create_event().unwrap();
        assert!(d.query_event(e).unwrap(), "never recorded is complete");
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        d.enqueue_host_fn(
            s,
            Box::new(move || {
                let _ = rx.recv();
            }),
        )
        .unwrap();
        let data = [5u8; 64];
        unsafe { d.copy_to_device(va, data.as_ptr(), 64, s).unwrap() };
        d.record_event(e, s).unwrap();
        assert!(!d.query_event(e).unwrap());
        tx.send(()).unwrap();
        d.synchronize_event(e).unwrap();
        assert!(d.query_event(e).unwrap());
        let mut back = [0u8; 64];
        unsafe {
            d.copy_to_host(back.as_mut_ptr(), va, 64, Stream::DEFAULT)
                .unwrap()
        };
        d.synchronize_stream(Stream::DEFAULT).unwrap();
        assert_eq!(back, data);
        d.destroy_stream(s).unwrap();
        d.destroy_event(e).unwrap();
    }
}
