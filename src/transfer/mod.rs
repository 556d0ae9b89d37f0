//! Multipath copies between host memory and one device (the target), faster than the driver's
//! own calls: pageable host memory passes through pinned staging buffers that several lanes
//! (threads, each with its own stream) fill and drain in parallel, and large copies also run
//! through peer GPUs that have their own host link and reach the target over NVLink.
//!
//! - [`plan`]: routing policy and chunking, on sizes only (no device calls).
//! - [`lanes`]: the worker threads and their staging slots.
//! - [`hostcopy`]: how lanes copy host memory (streaming stores).
//! - [`staging`]: pinned host buffers and relay buffers on peers, made once.
//! - [`topology`]: NUMA nodes and CPU binding.
//! - [`job`]: one copy as the lanes see it.
//!
//! Ordering, as with `cuMemcpyAsync`: a copy starts after the work queued on the caller's
//! stream before the call, and work queued on that stream after the call sees its result.
//! A copy with pageable host memory returns once that memory is no longer needed (the source
//! has been read, or the destination written); one with page-locked host memory may return
//! earlier, and the caller keeps that memory unchanged (or unread) until the stream gets there.
//! Blocking copies return when the data has arrived.

pub mod hostcopy;
pub mod job;
pub mod lanes;
pub mod plan;
pub mod staging;
pub mod topology;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::config::TransferConfig;
use crate::device::{DevicePtr, Event, HostMemory, SharedDevice, Stream};
use crate::error::{Error, ErrorKind, Result};
use crate::sync::lock;
pub use hostcopy::HostCopy;
use job::Job;
use lanes::{LaneHandle, LaneSpec};
pub use plan::{Direction, Path, Policy, Route};
use staging::{DeviceBuffer, PinnedBuffer};

/// When a copy call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// Once the data has arrived.
    Blocking,
    /// Ordered on the caller's stream (see the module documentation for when host memory may
    /// be reused).
    StreamOrdered,
}

/// Counters of an engine, for reports and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransferStats {
    pub copies: u64,
    pub bytes: u64,
    /// Copies handed straight to the driver (small, or pinned with no relay worth it).
    pub driver_copies: u64,
    /// Bytes that went through the engine's lanes.
    pub engine_bytes: u64,
    /// Of those, bytes that relay lanes carried (through a peer's link).
    pub relay_bytes: u64,
}

/// The counters behind [`TransferStats`], updated without a lock on every copy.
#[derive(Debug, Default)]
struct Counters {
    copies: AtomicU64,
    bytes: AtomicU64,
    driver_copies: AtomicU64,
    engine_bytes: AtomicU64,
    /// Shared with the relay lanes, which count the chunks they carry.
    relay_bytes: Arc<AtomicU64>,
}

impl Counters {
    /// Counts `pieces` copies of `len` bytes in all that took `route`.
    fn count(&self, len: usize, pieces: usize, route: &Route) {
        self.copies.fetch_add(pieces as u64, Ordering::Relaxed);
        self.bytes.fetch_add(len as u64, Ordering::Relaxed);
        match route {
            Route::Driver => self
                .driver_copies
                .fetch_add(pieces as u64, Ordering::Relaxed),
            Route::Engine(_) => self.engine_bytes.fetch_add(len as u64, Ordering::Relaxed),
        };
    }

    fn read(&self) -> TransferStats {
        TransferStats {
            copies: self.copies.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            driver_copies: self.driver_copies.load(Ordering::Relaxed),
            engine_bytes: self.engine_bytes.load(Ordering::Relaxed),
            relay_bytes: self.relay_bytes.load(Ordering::Relaxed),
        }
    }
}

/// One piece of a copy: host address, device address (on the target) and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyPiece {
    pub host: usize,
    pub device: DevicePtr,
    pub len: usize,
}

impl CopyPiece {
    fn validate(&self) -> Result<()> {
        if self.host == 0 {
            return Err(Error::new(ErrorKind::NullPointer, "host pointer is NULL"));
        }
        if self.device == 0 {
            return Err(Error::new(ErrorKind::NullPointer, "device pointer is NULL"));
        }
        if self.host.checked_add(self.len).is_none()
            || self.device.checked_add(self.len as u64).is_none()
        {
            return Err(Error::invalid_argument(format!(
                "a copy of {} bytes runs past the end of the address space",
                self.len
            )));
        }
        Ok(())
    }
}

/// Events made on demand per device and reused: the start and final events of copies.
struct EventPool {
    devices: HashMap<i32, SharedDevice>,
    free: Mutex<HashMap<i32, Vec<Event>>>,
}

impl EventPool {
    fn take(&self, device: i32) -> Result<Event> {
        if let Some(event) = lock(&self.free).get_mut(&device).and_then(Vec::pop) {
            return Ok(event);
        }
        self.device(device)?.create_event()
    }

    fn give(&self, device: i32, events: impl IntoIterator<Item = Event>) {
        lock(&self.free).entry(device).or_default().extend(events);
    }

    fn device(&self, ordinal: i32) -> Result<&SharedDevice> {
        self.devices
            .get(&ordinal)
            .ok_or_else(|| Error::internal(format!("no device {ordinal} in this engine")))
    }
}

impl Drop for EventPool {
    fn drop(&mut self) {
        for (ordinal, events) in lock(&self.free).drain() {
            if let Some(device) = self.devices.get(&ordinal) {
                for event in events {
                    let _ = device.destroy_event(event);
                }
            }
        }
    }
}

/// The copy engine of one target device.
pub struct Engine {
    target: SharedDevice,
    config: TransferConfig,
    paths: Vec<Path>,
    /// Lanes of each path, in the order of `paths`.
    lanes: Vec<Vec<LaneHandle>>,
    events: EventPool,
    /// Keeps the lanes' queues in one order per copy, so concurrent copies interleave whole.
    dispatch: Mutex<()>,
    stats: Counters,
}

impl Engine {
    /// An engine copying to and from `target`, relaying through those of `peers` that can
    /// reach it (and only when `config.max_peers` allows). Makes every lane, stream and staging
    /// buffer now (events are made on first use and kept); measures each path's bandwidth when
    /// `config.measure` is set.
    pub fn new(
        target: SharedDevice,
        peers: Vec<SharedDevice>,
        config: TransferConfig,
    ) -> Result<Engine> {
        config.validate()?;
        let mut relays = Vec::new();
        for peer in peers {
            if relays.len() >= config.max_peers || peer.ordinal() == target.ordinal() {
                continue;
            }
            // The target reads and writes the relay buffers on the peer; the peer maps them.
            match target.can_access_peer(peer.ordinal()) {
                Ok(true) => relays.push(peer),
                Ok(false) => log::info!(
                    "glake: device {} cannot reach device {}; no relay through it",
                    target.ordinal(),
                    peer.ordinal()
                ),
                Err(err) => log::warn!("glake: peer check failed: {err}"),
            }
        }
        let config = config.fit_staging(relays.len());
        let mut devices = HashMap::new();
        devices.insert(target.ordinal(), target.clone());
        for peer in &relays {
            devices.insert(peer.ordinal(), peer.clone());
        }
        let events = EventPool {
            devices,
            free: Mutex::new(HashMap::new()),
        };
        let mut paths = vec![Path {
            via: None,
            gbps: 0.0,
        }];
        let mut lanes = vec![Vec::new()];
        let stats = Counters::default();
        let target_cpus = topology::cpus_near(&target);
        for i in 0..config.lanes {
            let spec = LaneSpec {
                target: target.clone(),
                peer: None,
                slots: config.slots,
                chunk: config.chunk,
                cpus: target_cpus.clone(),
                yield_waits: config.yield_waits,
                fill_copy: config.fill_copy,
                drain_copy: config.drain_copy,
                relayed: None,
            };
            lanes[0].push(LaneHandle::spawn(
                spec,
                format!("glake-copy-{}-{i}", target.ordinal()),
            )?);
        }
        for peer in &relays {
            let cpus = topology::cpus_near(peer);
            let mut path_lanes = Vec::new();
            for i in 0..config.relay_lanes {
                let spec = LaneSpec {
                    target: target.clone(),
                    peer: Some(peer.clone()),
                    slots: config.slots,
                    chunk: config.chunk,
                    cpus: cpus.clone(),
                    yield_waits: config.yield_waits,
                    fill_copy: config.fill_copy,
                    drain_copy: config.drain_copy,
                    relayed: Some(stats.relay_bytes.clone()),
                };
                path_lanes.push(LaneHandle::spawn(
                    spec,
                    format!("glake-copy-{}-via{}-{i}", target.ordinal(), peer.ordinal()),
                )?);
            }
            paths.push(Path {
                via: Some(peer.ordinal()),
                gbps: 0.0,
            });
            lanes.push(path_lanes);
        }
        let mut engine = Engine {
            target,
            config,
            paths,
            lanes,
            events,
            dispatch: Mutex::new(()),
            stats,
        };
        if engine.config.measure && engine.paths.len() > 1 {
            engine.measure()?;
        }
        Ok(engine)
    }

    pub fn target(&self) -> &SharedDevice {
        &self.target
    }

    /// The paths and their measured bandwidths (0 until measured).
    pub fn paths(&self) -> &[Path] {
        &self.paths
    }

    pub fn config(&self) -> &TransferConfig {
        &self.config
    }

    pub fn stats(&self) -> TransferStats {
        self.stats.read()
    }

    /// Times a pinned host-to-device copy through each path alone and keeps the bandwidths,
    /// which decide which relays take part in a copy.
    pub fn measure(&mut self) -> Result<()> {
        let len = self.config.chunk * 8;
        let source = PinnedBuffer::new(&self.target, len)?;
        let target_buffer = DeviceBuffer::new(&self.target, len, &[])?;
        for path in 0..self.paths.len() {
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                let started = Instant::now();
                // SAFETY: both buffers live until the blocking copy has returned.
                unsafe {
                    self.run_job(
                        Direction::HostToDevice,
                        HostMemory::Pinned,
                        &[CopyPiece {
                            host: source.ptr() as usize,
                            device: target_buffer.va(),
                            len,
                        }],
                        Stream::DEFAULT,
                        Completion::Blocking,
                        &[path],
                    )?
                };
                best = best.min(started.elapsed().as_secs_f64());
            }
            self.paths[path].gbps = len as f64 / best / 1e9;
        }
        log::info!(
            "glake: copy paths of device {}: {:?}",
            self.target.ordinal(),
            self.paths
        );
        Ok(())
    }

    /// Copies `len` bytes from host memory at `src` to device memory at `dst` (on the target).
    ///
    /// # Safety
    /// `src` must be valid for reads of `len` bytes; for page-locked memory with
    /// [`Completion::StreamOrdered`], until the stream has reached this copy.
    pub unsafe fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: Stream,
        completion: Completion,
    ) -> Result<()> {
        // SAFETY: forwarded under the caller's contract.
        unsafe {
            self.copy(
                Direction::HostToDevice,
                src as usize,
                dst,
                len,
                stream,
                completion,
            )
        }
    }

    /// Copies `len` bytes from device memory at `src` (on the target) to host memory at `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes; for page-locked memory with
    /// [`Completion::StreamOrdered`], until the stream has reached this copy.
    pub unsafe fn copy_to_host(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        stream: Stream,
        completion: Completion,
    ) -> Result<()> {
        // SAFETY: forwarded under the caller's contract.
        unsafe {
            self.copy(
                Direction::DeviceToHost,
                dst as usize,
                src,
                len,
                stream,
                completion,
            )
        }
    }

    /// The route a copy of `len` bytes in `direction` with host memory of kind `host` takes.
    pub fn route(&self, len: usize, direction: Direction, host: HostMemory) -> Route {
        plan::route(len, direction, host, &self.paths, &self.config.policy)
    }

    /// # Safety
    /// As for [`Engine::copy_to_device`] and [`Engine::copy_to_host`].
    unsafe fn copy(
        &self,
        direction: Direction,
        host_ptr: usize,
        device_ptr: DevicePtr,
        len: usize,
        stream: Stream,
        completion: Completion,
    ) -> Result<()> {
        let piece = CopyPiece {
            host: host_ptr,
            device: device_ptr,
            len,
        };
        // SAFETY: forwarded under the caller's contract.
        unsafe { self.copy_pieces(direction, &[piece], stream, completion) }
    }

    /// Copies several pieces in one direction as one copy: their chunks share the lanes, so
    /// many tensors of a state dict keep every lane busy from the first byte to the last
    /// instead of draining the pipeline between pieces. Ordering and completion as for one
    /// piece.
    ///
    /// # Safety
    /// Every piece's host memory must be valid as [`Engine::copy_to_device`] (or
    /// [`Engine::copy_to_host`]) requires.
    pub unsafe fn copy_pieces(
        &self,
        direction: Direction,
        pieces: &[CopyPiece],
        stream: Stream,
        completion: Completion,
    ) -> Result<()> {
        let pieces: Vec<CopyPiece> = pieces.iter().copied().filter(|p| p.len > 0).collect();
        for piece in &pieces {
            piece.validate()?;
        }
        if pieces.is_empty() {
            return Ok(());
        }
        let total: usize = pieces.iter().map(|p| p.len).sum();
        // Small copies surely go to the driver: no need to ask what their memory is.
        let small = self.config.policy.surely_driver(total, direction);
        let mut groups: Vec<(HostMemory, Vec<CopyPiece>)> = Vec::new();
        if small {
            groups.push((HostMemory::Pageable, pieces));
        } else {
            for piece in pieces {
                let kind = self
                    .target
                    .host_memory(piece.host as *const u8, piece.len)?;
                match groups.iter_mut().find(|(k, _)| *k == kind) {
                    Some((_, group)) => group.push(piece),
                    None => groups.push((kind, vec![piece])),
                }
            }
        }
        let mut driver_used = false;
        let mut failure = None;
        'groups: for (host, group) in groups {
            let len: usize = group.iter().map(|p| p.len).sum();
            let route = if small {
                Route::Driver
            } else {
                self.route(len, direction, host)
            };
            self.stats.count(len, group.len(), &route);
            match route {
                Route::Driver => {
                    driver_used = true;
                    for piece in &group {
                        // SAFETY: forwarded under the caller's contract.
                        if let Err(err) = unsafe { self.driver_copy(direction, piece, stream) } {
                            failure = Some(err);
                            break 'groups;
                        }
                    }
                }
                Route::Engine(paths) => {
                    // SAFETY: forwarded under the caller's contract.
                    let done = unsafe {
                        self.run_job(direction, host, &group, stream, completion, &paths)
                    };
                    if let Err(err) = done {
                        failure = Some(err);
                        break 'groups;
                    }
                }
            }
        }
        // Driver copies queued before a failure still touch the caller's memory: they are
        // waited for as well as can be before the error goes back.
        if driver_used && (completion == Completion::Blocking || failure.is_some()) {
            let waited = self.target.synchronize_stream(stream);
            if failure.is_none() {
                waited?;
            }
        }
        match failure {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    /// One call of the driver on the caller's stream (its own semantics for pageable memory:
    /// the call returns once host memory may be reused).
    unsafe fn driver_copy(
        &self,
        direction: Direction,
        piece: &CopyPiece,
        stream: Stream,
    ) -> Result<()> {
        match direction {
            // SAFETY: the caller keeps the host memory valid as the contract says.
            Direction::HostToDevice => unsafe {
                self.target
                    .copy_to_device(piece.device, piece.host as *const u8, piece.len, stream)
            },
            // SAFETY: as above.
            Direction::DeviceToHost => unsafe {
                self.target
                    .copy_to_host(piece.host as *mut u8, piece.device, piece.len, stream)
            },
        }
    }

    /// Runs a copy on the lanes of `paths` (pinned copies on the first lane of each path
    /// only: with nothing to stage, more lanes would only queue more chunks on one link and
    /// leave a longer tail) and orders it on `stream`.
    unsafe fn run_job(
        &self,
        direction: Direction,
        host: HostMemory,
        pieces: &[CopyPiece],
        stream: Stream,
        completion: Completion,
        paths: &[usize],
    ) -> Result<()> {
        let len: usize = pieces.iter().map(|p| p.len).sum();
        let staged = host == HostMemory::Pageable;
        // Pageable copies wake lanes in proportion to their size; pinned ones one per path.
        let per_path = if staged {
            plan::lanes_for(len, usize::MAX, self.config.bytes_per_lane)
        } else {
            1
        };
        let chosen: Vec<&LaneHandle> = paths
            .iter()
            .filter_map(|&p| self.lanes.get(p))
            .flat_map(|lanes| lanes.iter().take(per_path))
            .collect();
        if chosen.is_empty() {
            return Err(Error::internal("a copy was routed to no lane"));
        }
        let target = self.target.ordinal();
        let chunk = plan::chunk_size(
            len,
            chosen.len() * self.config.slots,
            match direction {
                Direction::HostToDevice => self.config.min_chunk,
                Direction::DeviceToHost => self.config.min_chunk_d2h,
            },
            self.config.chunk,
        );
        let start = self.events.take(target)?;
        let mut finals = Vec::with_capacity(chosen.len());
        let mut owners = Vec::with_capacity(chosen.len());
        let mut setup = self.target.record_event(start, stream);
        if setup.is_ok() {
            for lane in &chosen {
                let owner = if lane.ends_on_peer(direction) {
                    lane.via().unwrap_or(target)
                } else {
                    target
                };
                match self.events.take(owner) {
                    Ok(event) => {
                        finals.push(event);
                        owners.push(owner);
                    }
                    Err(err) => {
                        setup = Err(err);
                        break;
                    }
                }
            }
        }
        if let Err(err) = setup {
            self.events.give(target, [start]);
            for (owner, event) in owners.into_iter().zip(finals) {
                self.events.give(owner, [event]);
            }
            return Err(err.context("preparing a copy"));
        }
        let cursor = plan::Cursor::over(pieces.iter().map(|p| p.len).collect(), chunk);
        // Pinned copies stage nothing: each lane issues its share at once, slots reused in
        // device order, so a stream-ordered copy returns without waiting for the data.
        let shares = (!staged).then(|| {
            let weights: Vec<f64> = chosen
                .iter()
                .map(|lane| {
                    self.paths
                        .iter()
                        .find(|p| p.via == lane.via())
                        .map_or(0.0, |p| p.gbps)
                })
                .collect();
            plan::shares(cursor.count(), &weights)
        });
        let job = Arc::new(Job::new(
            direction,
            host,
            pieces.iter().map(|p| (p.host, p.device)).collect(),
            cursor,
            start,
            finals.clone(),
            shares,
        ));
        let mut sent = 0;
        let mut failure = None;
        {
            let _order = lock(&self.dispatch);
            for (index, lane) in chosen.iter().enumerate() {
                match lane.send(job.clone(), index) {
                    Ok(()) => sent += 1,
                    Err(err) => {
                        failure = Some(err);
                        break;
                    }
                }
            }
        }
        if sent < chosen.len() {
            // Lanes that got the job count themselves down; the rest are counted here.
            job.fail(failure.unwrap_or_else(|| Error::internal("a lane refused a copy")));
            for _ in sent..chosen.len() {
                job.lane_done();
            }
        }
        let outcome = match job.wait() {
            Some(err) => {
                self.wait_all(&finals, &owners);
                Err(err)
            }
            None => self.finish(stream, completion, &finals, &owners),
        };
        self.events.give(target, [start]);
        for (owner, event) in owners.into_iter().zip(finals) {
            self.events.give(owner, [event]);
        }
        outcome
    }

    /// Makes `stream` wait for the lanes' final events, or waits for them (blocking).
    fn finish(
        &self,
        stream: Stream,
        completion: Completion,
        finals: &[Event],
        owners: &[i32],
    ) -> Result<()> {
        let mut first_error = None;
        for (&event, &owner) in finals.iter().zip(owners) {
            let done = match completion {
                Completion::Blocking => self
                    .events
                    .device(owner)
                    .and_then(|device| device.synchronize_event(event)),
                Completion::StreamOrdered => self.target.stream_wait_event(stream, event),
            };
            if let Err(err) = done {
                first_error.get_or_insert(err);
            }
        }
        match first_error {
            Some(err) => {
                self.wait_all(finals, owners);
                Err(err)
            }
            None => Ok(()),
        }
    }

    /// Waits, as well as it can, for every lane's last work of a copy that is failing: lanes
    /// that did not fail may still have queued work touching the caller's memory, which must
    /// be over before the error goes back (a failed lane has waited for its own streams).
    fn wait_all(&self, finals: &[Event], owners: &[i32]) {
        for (&event, &owner) in finals.iter().zip(owners) {
            if let Ok(device) = self.events.device(owner) {
                if device.synchronize_event(event).is_err() {
                    let _ = device.synchronize_device();
                }
            }
        }
    }
}
