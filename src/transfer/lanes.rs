//! Lanes: the engine's worker threads. Each lane serves one path (the target's own link, or a
//! relay through one peer), owns its streams, events and staging slots, and runs the jobs sent
//! to it one after another, pulling chunks from the job's shared cursor whenever a slot is free.
//!
//! A slot's buffers are reused only after the event that ends the slot's last piece of work has
//! completed, so a lane never overwrites data a DMA engine has yet to read. When a lane fails,
//! it waits for everything it queued before it reports, so the caller's memory is untouched
//! once the call returns with the error.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::hostcopy::HostCopy;
use super::job::Job;
use super::plan::{Chunk, Direction};
use super::staging::{DeviceBuffer, PinnedBuffer};
use super::topology;
use crate::device::{DevicePtr, Event, HostMemory, SharedDevice, Stream};
use crate::error::{Error, Result};

/// What a lane is made of.
pub struct LaneSpec {
    pub target: SharedDevice,
    /// The peer a relay lane goes through; None for the target's own link.
    pub peer: Option<SharedDevice>,
    pub slots: usize,
    /// Bytes of each slot's buffers: the largest chunk the lane takes.
    pub chunk: usize,
    /// CPUs the lane's thread runs on (its link's NUMA node), when known.
    pub cpus: Option<Vec<usize>>,
    /// Wait for a slot by polling its event and yielding the CPU, rather than in the driver.
    pub yield_waits: bool,
    /// How pageable sources are copied into staging, and staging out to pageable destinations.
    pub fill_copy: HostCopy,
    pub drain_copy: HostCopy,
    /// A relay lane's count of the bytes it carries (the engine's statistics).
    pub relayed: Option<Arc<AtomicU64>>,
}

enum Message {
    Run(Arc<Job>, usize),
    Stop,
}

/// The engine's handle on a lane thread.
pub struct LaneHandle {
    via: Option<i32>,
    sender: Sender<Message>,
    thread: Option<JoinHandle<()>>,
}

impl LaneHandle {
    /// Starts a lane; its resources are made on its own thread (so that pinned memory lands on
    /// its node) before this returns, and an error making them is returned here.
    pub fn spawn(spec: LaneSpec, name: String) -> Result<LaneHandle> {
        let (sender, receiver) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        let via = spec.peer.as_ref().map(|p| p.ordinal());
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                if let Some(cpus) = &spec.cpus {
                    topology::bind_current_thread(cpus);
                }
                match Lane::new(spec) {
                    Ok(mut lane) => {
                        let _ = ready_tx.send(Ok(()));
                        lane.serve(&receiver);
                    }
                    Err(err) => {
                        let _ = ready_tx.send(Err(err));
                    }
                }
            })
            .map_err(|e| Error::internal(format!("spawning a copy lane: {e}")))?;
        let handle = LaneHandle {
            via,
            sender,
            thread: Some(thread),
        };
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(handle),
            Ok(Err(err)) => Err(err),
            Err(_) => Err(Error::internal("a copy lane stopped while starting")),
        }
    }

    /// The peer this lane relays through, None for the target's own link.
    pub fn via(&self) -> Option<i32> {
        self.via
    }

    /// Whether the lane's last piece of work for `direction` runs on the peer (so its final
    /// event must be the peer's).
    pub fn ends_on_peer(&self, direction: Direction) -> bool {
        ends_on_peer(self.via.is_some(), direction)
    }

    /// Hands `job` to the lane; it records `job.finals[index]` when done.
    pub fn send(&self, job: Arc<Job>, index: usize) -> Result<()> {
        self.sender
            .send(Message::Run(job, index))
            .map_err(|_| Error::internal("a copy lane has stopped"))
    }
}

impl Drop for LaneHandle {
    fn drop(&mut self) {
        let _ = self.sender.send(Message::Stop);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Whether a lane's last piece of work for `direction` runs on its peer: a relayed
/// device-to-host copy ends with the peer's copy to host memory.
fn ends_on_peer(relayed: bool, direction: Direction) -> bool {
    relayed && direction == Direction::DeviceToHost
}

/// What a slot waits for before its buffers are reused, and where a device-to-host chunk in
/// it goes once it has landed (pageable destinations only).
#[derive(Clone, Copy)]
struct Pending {
    on_peer: bool,
    event: Event,
    drain: Option<(usize, usize, HostCopy)>,
}

struct Slot {
    host: PinnedBuffer,
    relay: Option<DevicePtr>,
    target_event: Event,
    peer_event: Option<Event>,
    pending: Option<Pending>,
}

struct Lane {
    target: SharedDevice,
    peer: Option<SharedDevice>,
    target_stream: Stream,
    peer_stream: Option<Stream>,
    slots: Vec<Slot>,
    next: usize,
    yield_waits: bool,
    fill_copy: HostCopy,
    drain_copy: HostCopy,
    relayed: Option<Arc<AtomicU64>>,
    _relay_buffer: Option<DeviceBuffer>,
}

impl Lane {
    fn new(spec: LaneSpec) -> Result<Lane> {
        let slots = spec.slots.max(1);
        let relay_buffer = match &spec.peer {
            Some(peer) => Some(DeviceBuffer::new(
                peer,
                slots * spec.chunk,
                &[spec.target.ordinal()],
            )?),
            None => None,
        };
        // Streams and events are destroyed by Drop once the lane exists; until then by hand.
        let mut lane = Lane {
            target: spec.target.clone(),
            peer: spec.peer.clone(),
            target_stream: spec.target.create_stream()?,
            peer_stream: None,
            slots: Vec::with_capacity(slots),
            next: 0,
            yield_waits: spec.yield_waits,
            fill_copy: spec.fill_copy,
            drain_copy: spec.drain_copy,
            relayed: spec.relayed.clone(),
            _relay_buffer: None,
        };
        if let Some(peer) = &spec.peer {
            lane.peer_stream = Some(peer.create_stream()?);
        }
        for i in 0..slots {
            let host = PinnedBuffer::new(&spec.target, spec.chunk)?;
            let target_event = spec.target.create_event()?;
            let peer_event = match &spec.peer {
                Some(peer) => match peer.create_event() {
                    Ok(event) => Some(event),
                    Err(err) => {
                        let _ = spec.target.destroy_event(target_event);
                        return Err(err);
                    }
                },
                None => None,
            };
            let relay = relay_buffer
                .as_ref()
                .map(|b| b.va() + (i * spec.chunk) as u64);
            lane.slots.push(Slot {
                host,
                relay,
                target_event,
                peer_event,
                pending: None,
            });
        }
        lane._relay_buffer = relay_buffer;
        Ok(lane)
    }

    fn serve(&mut self, receiver: &Receiver<Message>) {
        while let Ok(Message::Run(job, index)) = receiver.recv() {
            // A panic (a bug, or one injected in tests) must neither kill the lane nor leave
            // the caller waiting: it becomes the copy's error.
            let outcome = catch_unwind(AssertUnwindSafe(|| self.run(&job, index)));
            let failure = match outcome {
                Ok(Ok(())) => None,
                Ok(Err(err)) => Some(err),
                Err(_) => Some(Error::internal("a copy lane panicked")),
            };
            if let Some(err) = failure {
                job.fail(err);
                self.quiesce();
            }
            job.lane_done();
        }
        self.quiesce();
    }

    fn peer(&self) -> Result<(&SharedDevice, Stream)> {
        match (&self.peer, self.peer_stream) {
            (Some(peer), Some(stream)) => Ok((peer, stream)),
            _ => Err(Error::internal("a direct lane was asked to relay")),
        }
    }

    fn run(&mut self, job: &Job, index: usize) -> Result<()> {
        let Some(&final_event) = job.finals.get(index) else {
            return Err(Error::internal(
                "a copy job has no final event for this lane",
            ));
        };
        // Device work of the copy comes after the caller's earlier work on its stream, on the
        // peer too: a relay reads (or writes) the caller's page-locked memory there.
        self.target
            .stream_wait_event(self.target_stream, job.start)?;
        if let (Some(peer), Some(stream)) = (&self.peer, self.peer_stream) {
            peer.stream_wait_event(stream, job.start)?;
        }
        if let Some(shares) = &job.shares {
            let mine = shares.get(index).cloned().unwrap_or(0..0);
            let chunks = mine.filter_map(|i| job.cursor.chunk(i));
            if self.peer.is_none() {
                // The target's own link stages nothing here: one copy per piece of the share,
                // not one per chunk (fewer driver calls, made while the caller waits).
                for run in super::plan::runs(chunks) {
                    if job.failed() {
                        break;
                    }
                    self.issue_direct(job, run)?;
                }
            } else {
                for chunk in chunks {
                    if job.failed() {
                        break;
                    }
                    let slot = self.acquire_in_order()?;
                    self.issue(job, slot, chunk)?;
                }
            }
        } else {
            while !job.failed() {
                let Some(chunk) = job.cursor.take() else {
                    break;
                };
                let slot = self.acquire()?;
                self.issue(job, slot, chunk)?;
            }
        }
        if job.host == HostMemory::Pageable && job.direction == Direction::DeviceToHost {
            for slot in 0..self.slots.len() {
                self.complete(slot)?;
            }
        }
        if ends_on_peer(self.peer.is_some(), job.direction) {
            let (peer, stream) = self.peer()?;
            peer.record_event(final_event, stream)
        } else {
            self.target.record_event(final_event, self.target_stream)
        }
    }

    /// The next slot in turn, after its last piece of work has finished (and, for a pageable
    /// destination, its bytes have been copied out).
    fn acquire(&mut self) -> Result<usize> {
        let slot = self.turn();
        self.complete(slot)?;
        Ok(slot)
    }

    /// The next slot in turn.
    fn turn(&mut self) -> usize {
        let slot = self.next;
        self.next = (self.next + 1) % self.slots.len();
        slot
    }

    /// The next slot in turn for a chunk of page-locked memory: the lane's stream that first
    /// touches the slot's relay buffer waits, on the device, for the slot's last piece of work
    /// (the host does not). A direct lane's slot holds no buffer such a chunk uses.
    fn acquire_in_order(&mut self) -> Result<usize> {
        let slot = self.turn();
        let Some(pending) = self.slots[slot].pending else {
            return Ok(slot);
        };
        if pending.drain.is_some() {
            // Bytes still to copy out on the host: only the host can do that.
            self.complete(slot)?;
            return Ok(slot);
        }
        if self.slots[slot].relay.is_some() {
            // The last use ended on the stream of one device; the next begins on the other's
            // (a relayed device-to-host chunk ends on the peer, a host-to-device one on the
            // target).
            if pending.on_peer {
                self.target
                    .stream_wait_event(self.target_stream, pending.event)?;
            } else {
                let (peer, stream) = self.peer()?;
                peer.stream_wait_event(stream, pending.event)?;
            }
        }
        self.slots[slot].pending = None;
        Ok(slot)
    }

    fn complete(&mut self, slot: usize) -> Result<()> {
        let Some(pending) = self.slots[slot].pending else {
            return Ok(());
        };
        let device = if pending.on_peer {
            self.peer()?.0
        } else {
            &self.target
        };
        if self.yield_waits {
            // Poll and hand the CPU to the other lanes meanwhile: their host copies need the
            // cores that a driver wait would spin on.
            while !device.query_event(pending.event)? {
                std::thread::yield_now();
            }
        } else {
            device.synchronize_event(pending.event)?;
        }
        if let Some((dst, len, how)) = pending.drain {
            // SAFETY: the chunk landed in the slot's buffer (len <= its size); `dst` lies inside
            // the caller's destination, valid for the whole copy.
            unsafe { how.copy(dst as *mut u8, self.slots[slot].host.ptr(), len) };
        }
        self.slots[slot].pending = None;
        Ok(())
    }

    fn issue(&mut self, job: &Job, slot: usize, chunk: Chunk) -> Result<()> {
        let Some(&(host_start, device_start)) = job.pieces.get(chunk.piece) else {
            return Err(Error::internal("a chunk of a piece the copy does not have"));
        };
        if chunk.len > self.slots[slot].host.len() {
            return Err(Error::internal(format!(
                "a chunk of {} bytes is larger than the lane's {}-byte slots",
                chunk.len,
                self.slots[slot].host.len()
            )));
        }
        let host_at = host_start + chunk.offset;
        let device_at = device_start + chunk.offset as u64;
        let staged = job.host == HostMemory::Pageable;
        let buffer = self.slots[slot].host.ptr();
        let len = chunk.len;
        let pending = match job.direction {
            Direction::HostToDevice => {
                let src = if staged {
                    // SAFETY: `host_at` lies inside the caller's source, valid for the whole
                    // copy; the slot's buffer holds at least `len` bytes and is idle.
                    unsafe {
                        self.fill_copy
                            .for_copy(job.len)
                            .copy(buffer, host_at as *const u8, len)
                    };
                    buffer as *const u8
                } else {
                    host_at as *const u8
                };
                self.to_device(slot, device_at, src, len)?
            }
            Direction::DeviceToHost => {
                let dst = if staged { buffer } else { host_at as *mut u8 };
                let mut pending = self.to_host(slot, dst, device_at, len)?;
                if staged {
                    pending.drain = Some((host_at, len, self.drain_copy.for_copy(job.len)));
                }
                pending
            }
        };
        self.slots[slot].pending = Some(pending);
        if let Some(relayed) = &self.relayed {
            relayed.fetch_add(len as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Copies `run` of page-locked host memory over the target's own link, in one call.
    fn issue_direct(&self, job: &Job, run: Chunk) -> Result<()> {
        let Some(&(host_start, device_start)) = job.pieces.get(run.piece) else {
            return Err(Error::internal("a chunk of a piece the copy does not have"));
        };
        let host_at = host_start + run.offset;
        let device_at = device_start + run.offset as u64;
        // SAFETY: the run lies inside the caller's page-locked host memory, which stays valid
        // (and unchanged, or unread) until the copy's final event, which follows this copy.
        unsafe {
            match job.direction {
                Direction::HostToDevice => self.target.copy_to_device(
                    device_at,
                    host_at as *const u8,
                    run.len,
                    self.target_stream,
                ),
                Direction::DeviceToHost => self.target.copy_to_host(
                    host_at as *mut u8,
                    device_at,
                    run.len,
                    self.target_stream,
                ),
            }
        }
    }

    fn to_device(
        &self,
        slot: usize,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
    ) -> Result<Pending> {
        let s = &self.slots[slot];
        if let (Some(relay), Some(peer_event)) = (s.relay, s.peer_event) {
            let (peer, stream) = self.peer()?;
            // SAFETY: `src` stays valid and unchanged until the slot's event has completed
            // (staging buffers are reused only after it; the caller keeps pinned sources).
            unsafe { peer.copy_to_device(relay, src, len, stream)? };
            peer.record_event(peer_event, stream)?;
            self.target
                .stream_wait_event(self.target_stream, peer_event)?;
            self.target
                .copy_device(dst, relay, len, self.target_stream)?;
        } else {
            // SAFETY: as above.
            unsafe {
                self.target
                    .copy_to_device(dst, src, len, self.target_stream)?
            };
        }
        self.target
            .record_event(s.target_event, self.target_stream)?;
        Ok(Pending {
            on_peer: false,
            event: s.target_event,
            drain: None,
        })
    }

    fn to_host(&self, slot: usize, dst: *mut u8, src: DevicePtr, len: usize) -> Result<Pending> {
        let s = &self.slots[slot];
        if let (Some(relay), Some(peer_event)) = (s.relay, s.peer_event) {
            let (peer, stream) = self.peer()?;
            self.target
                .copy_device(relay, src, len, self.target_stream)?;
            self.target
                .record_event(s.target_event, self.target_stream)?;
            peer.stream_wait_event(stream, s.target_event)?;
            // SAFETY: `dst` stays valid until the slot's event has completed (waited for before
            // the slot is reused, and before a failed or finished pageable copy returns).
            unsafe { peer.copy_to_host(dst, relay, len, stream)? };
            peer.record_event(peer_event, stream)?;
            return Ok(Pending {
                on_peer: true,
                event: peer_event,
                drain: None,
            });
        }
        // SAFETY: as above.
        unsafe {
            self.target
                .copy_to_host(dst, src, len, self.target_stream)?
        };
        self.target
            .record_event(s.target_event, self.target_stream)?;
        Ok(Pending {
            on_peer: false,
            event: s.target_event,
            drain: None,
        })
    }

    /// Waits for everything the lane has queued and forgets it, without copying out: after a
    /// failure, so that nothing of the caller's is touched once the call returns.
    /// Work queued before a failed call may not be behind any slot's event, so the lane's
    /// streams are waited for whole.
    fn quiesce(&mut self) {
        for slot in &mut self.slots {
            slot.pending = None;
        }
        self.synchronize_streams();
    }

    fn synchronize_streams(&self) {
        let target = self.target.synchronize_stream(self.target_stream);
        let peer = match (&self.peer, self.peer_stream) {
            (Some(peer), Some(stream)) => peer.synchronize_stream(stream),
            _ => Ok(()),
        };
        if target.is_err() || peer.is_err() {
            // The last resort: nothing queued by this process may still run afterwards.
            let _ = self.target.synchronize_device();
            if let Some(peer) = &self.peer {
                let _ = peer.synchronize_device();
            }
        }
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        self.synchronize_streams();
        for slot in &self.slots {
            let _ = self.target.destroy_event(slot.target_event);
            if let (Some(peer), Some(event)) = (&self.peer, slot.peer_event) {
                let _ = peer.destroy_event(event);
            }
        }
        let _ = self.target.destroy_stream(self.target_stream);
        if let (Some(peer), Some(stream)) = (&self.peer, self.peer_stream) {
            let _ = peer.destroy_stream(stream);
        }
    }
}
