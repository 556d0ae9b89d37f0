//! The host backend: real bytes and real virtual-address stitching without a GPU.
//!
//! A reserved range is an `mmap(PROT_NONE)` region; physical memory is a region of one sparse
//! memfd per device; mapping is `mmap(MAP_FIXED | MAP_SHARED)` of that region, with access off
//! until [`Device::set_access`] (as with CUDA, where a mapping is unusable before access is set).
//! Bytes written through a stitched range land in the chunks it maps. Streams are worker threads
//! that run their copies in order; events complete when the worker reaches them.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use super::{BackendKind, Device, DevicePtr, Event, MemInfo, PhysHandle, SharedDevice, Stream};
use crate::error::{Error, ErrorKind, Result};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// Settings of a host device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostOptions {
    /// Bytes of "device memory" (the memfd's size; pages exist only once written).
    pub total_memory: usize,
    /// Mapping granularity; a power of two and a multiple of the OS page size.
    pub granularity: usize,
    /// How many host devices the process pretends to have (for peer tests).
    pub device_count: usize,
}

impl Default for HostOptions {
    fn default() -> Self {
        HostOptions {
            total_memory: 64 * GIB,
            granularity: 2 * MIB,
            device_count: 1,
        }
    }
}

impl HostOptions {
    /// Defaults overridden by `GLAKE_HOST_MEMORY` (bytes, or with a K/M/G/T suffix) and
    /// `GLAKE_HOST_DEVICES`.
    pub fn from_env() -> Self {
        let mut options = HostOptions::default();
        if let Some(bytes) = crate::config::env_bytes("GLAKE_HOST_MEMORY") {
            options.total_memory = bytes;
        }
        if let Some(count) = crate::config::env_bytes("GLAKE_HOST_DEVICES") {
            options.device_count = count.max(1);
        }
        options
    }
}

fn os_error(call: &str) -> Error {
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ENOMEM) && call.starts_with("mmap") {
        return Error::new(
            ErrorKind::ResourceLimit,
            format!("{call}: {err} (the process may have reached vm.max_map_count)"),
        );
    }
    Error::driver(format!("{call}: {err}"))
}

/// First-fit allocator of offsets in the memfd.
#[derive(Debug)]
struct RangeAllocator {
    free: BTreeMap<usize, usize>,
}

impl RangeAllocator {
    fn new(total: usize) -> Self {
        let mut free = BTreeMap::new();
        if total > 0 {
            free.insert(0, total);
        }
        RangeAllocator { free }
    }

    fn allocate(&mut self, size: usize) -> Option<usize> {
        let (&start, &len) = self.free.iter().find(|(_, &len)| len >= size)?;
        self.free.remove(&start);
        if len > size {
            self.free.insert(start + size, len - size);
        }
        Some(start)
    }

    fn release(&mut self, start: usize, size: usize) {
        let mut start = start;
        let mut size = size;
        if let Some((&prev, &prev_len)) = self.free.range(..start).next_back() {
            if prev + prev_len == start {
                self.free.remove(&prev);
                start = prev;
                size += prev_len;
            }
        }
        if let Some(&next_len) = self.free.get(&(start + size)) {
            self.free.remove(&(start + size));
            size += next_len;
        }
        self.free.insert(start, size);
    }
}

#[derive(Debug)]
struct Chunk {
    offset: usize,
    size: usize,
    mappings: usize,
    released: bool,
}

#[derive(Debug, Clone, Copy)]
struct Mapping {
    size: usize,
    handle: PhysHandle,
    accessible: bool,
}

#[derive(Debug)]
struct Memory {
    offsets: RangeAllocator,
    chunks: HashMap<u64, Chunk>,
    reservations: BTreeMap<DevicePtr, usize>,
    mappings: BTreeMap<DevicePtr, Mapping>,
    created_bytes: usize,
    pinned: HashMap<usize, std::alloc::Layout>,
    next_handle: u64,
}

impl Memory {
    fn reservation_contains(&self, va: DevicePtr, size: usize) -> bool {
        match self.reservations.range(..=va).next_back() {
            Some((&start, &len)) => va + size as u64 <= start + len as u64,
            None => false,
        }
    }

    fn overlaps_mapping(&self, va: DevicePtr, size: usize) -> bool {
        let end = va + size as u64;
        if let Some((&start, m)) = self.mappings.range(..=va).next_back() {
            if start + m.size as u64 > va {
                return true;
            }
        }
        self.mappings.range(va..end).next().is_some()
    }

    /// True when every byte of `[va, va+len)` is mapped with access granted.
    fn accessible(&self, va: DevicePtr, len: usize) -> bool {
        let end = va + len as u64;
        let mut at = va;
        while at < end {
            match self.mappings.range(..=at).next_back() {
                Some((&start, m)) if start + m.size as u64 > at && m.accessible => {
                    at = start + m.size as u64;
                }
                _ => return false,
            }
        }
        true
    }
}

enum Op {
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

struct HostStream {
    shared: Arc<StreamShared>,
    worker: Option<JoinHandle<()>>,
}

#[derive(Default, Clone, Copy)]
struct EventState {
    recorded: u64,
    completed: u64,
}

#[derive(Default)]
struct Events {
    states: Mutex<HashMap<u64, EventState>>,
    changed: Condvar,
}

impl Events {
    fn complete(&self, event: u64, generation: u64) {
        let mut states = lock(&self.states);
        if let Some(state) = states.get_mut(&event) {
            state.completed = state.completed.max(generation);
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
}

/// Locks a mutex, recovering the data if another thread panicked while holding it: the host
/// backend's state stays consistent across a panic because each update is one assignment.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    match mutex.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// A device backed by host memory.
pub struct HostDevice {
    ordinal: i32,
    options: HostOptions,
    memfd: libc::c_int,
    memory: Mutex<Memory>,
    streams: Mutex<HashMap<u64, HostStream>>,
    events: Arc<Events>,
    next_id: AtomicU64,
}

impl HostDevice {
    pub fn new(ordinal: i32, options: HostOptions) -> Result<Self> {
        if !options.granularity.is_power_of_two() || options.granularity < 4096 {
            return Err(Error::invalid_argument(format!(
                "host granularity {} must be a power of two >= 4096",
                options.granularity
            )));
        }
        if ordinal < 0 || ordinal as usize >= options.device_count {
            return Err(Error::new(
                ErrorKind::NoDevice,
                format!(
                    "host device {ordinal} does not exist ({} host devices)",
                    options.device_count
                ),
            ));
        }
        let name = CString::new(format!("glake-host-{ordinal}"))
            .map_err(|e| Error::internal(e.to_string()))?;
        // SAFETY: `name` is a valid C string; the returned descriptor is owned by this object.
        let memfd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if memfd < 0 {
            return Err(os_error("memfd_create"));
        }
        // SAFETY: `memfd` is the descriptor just created.
        if unsafe { libc::ftruncate(memfd, options.total_memory as libc::off_t) } != 0 {
            let err = os_error("ftruncate");
            // SAFETY: closing the descriptor we own.
            unsafe { libc::close(memfd) };
            return Err(err);
        }
        let device = HostDevice {
            ordinal,
            options,
            memfd,
            memory: Mutex::new(Memory {
                offsets: RangeAllocator::new(options.total_memory),
                chunks: HashMap::new(),
                reservations: BTreeMap::new(),
                mappings: BTreeMap::new(),
                created_bytes: 0,
                pinned: HashMap::new(),
                next_handle: 1,
            }),
            streams: Mutex::new(HashMap::new()),
            events: Arc::new(Events::default()),
            next_id: AtomicU64::new(1),
        };
        device.start_stream(Stream::DEFAULT.0)?;
        Ok(device)
    }

    pub fn shared(ordinal: i32, options: HostOptions) -> Result<SharedDevice> {
        Ok(Arc::new(HostDevice::new(ordinal, options)?))
    }

    pub fn options(&self) -> HostOptions {
        self.options
    }

    fn start_stream(&self, id: u64) -> Result<()> {
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

    fn enqueue(&self, stream: Stream, op: Op) -> Result<()> {
        let streams = lock(&self.streams);
        let host_stream = streams
            .get(&stream.0)
            .ok_or_else(|| Error::invalid_argument(format!("unknown stream {:#x}", stream.0)))?;
        let mut state = lock(&host_stream.shared.state);
        state.queue.push_back(op);
        host_stream.shared.work.notify_one();
        Ok(())
    }

    /// Queues a host function on `stream`: it runs in stream order. Tests use it to hold a
    /// stream busy (a gate) and check that stream-ordered reuse waits for it.
    pub fn enqueue_host_fn(&self, stream: Stream, f: Box<dyn FnOnce() + Send>) -> Result<()> {
        self.enqueue(stream, Op::Host(f))
    }

    /// Bytes of physical memory currently created.
    pub fn created_bytes(&self) -> usize {
        lock(&self.memory).created_bytes
    }

    /// Number of live physical chunks, mappings and reservations (leak checks in tests).
    pub fn live_objects(&self) -> (usize, usize, usize) {
        let memory = lock(&self.memory);
        let chunks = memory.chunks.values().filter(|c| !c.released).count();
        (chunks, memory.mappings.len(), memory.reservations.len())
    }

    fn check_aligned(&self, what: &str, values: &[u64]) -> Result<()> {
        let g = self.options.granularity as u64;
        if values.iter().any(|v| v % g != 0) {
            return Err(Error::invalid_argument(format!(
                "{what}: {values:?} not multiples of the granularity {g}"
            )));
        }
        Ok(())
    }

    fn punch(&self, offset: usize, size: usize) {
        // SAFETY: the range lies inside our memfd; punching a hole only drops its pages.
        let rc = unsafe {
            libc::fallocate(
                self.memfd,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                size as libc::off_t,
            )
        };
        if rc != 0 {
            log::warn!("{}", os_error("fallocate(PUNCH_HOLE)"));
        }
    }

    fn retire_chunk(&self, memory: &mut Memory, handle: u64) {
        let done = match memory.chunks.get(&handle) {
            Some(chunk) => chunk.released && chunk.mappings == 0,
            None => false,
        };
        if done {
            if let Some(chunk) = memory.chunks.remove(&handle) {
                self.punch(chunk.offset, chunk.size);
                memory.offsets.release(chunk.offset, chunk.size);
                memory.created_bytes -= chunk.size;
            }
        }
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

impl Drop for HostDevice {
    fn drop(&mut self) {
        let streams: Vec<HostStream> = lock(&self.streams).drain().map(|(_, s)| s).collect();
        for mut stream in streams {
            lock(&stream.shared.state).shutdown = true;
            stream.shared.work.notify_all();
            if let Some(worker) = stream.worker.take() {
                let _ = worker.join();
            }
        }
        let memory = lock(&self.memory);
        for (&va, &size) in memory.reservations.iter() {
            // SAFETY: unmapping a reservation this object made.
            unsafe { libc::munmap(va as *mut libc::c_void, size) };
        }
        for (&ptr, &layout) in memory.pinned.iter() {
            // SAFETY: allocated with this layout by alloc_pinned.
            unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
        }
        // SAFETY: closing the descriptor we own.
        unsafe { libc::close(self.memfd) };
    }
}

impl Device for HostDevice {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn ordinal(&self) -> i32 {
        self.ordinal
    }

    fn granularity(&self) -> usize {
        self.options.granularity
    }

    fn mem_info(&self) -> Result<MemInfo> {
        let memory = lock(&self.memory);
        Ok(MemInfo {
            free: self.options.total_memory - memory.created_bytes,
            total: self.options.total_memory,
        })
    }

    fn device_count(&self) -> Result<usize> {
        Ok(self.options.device_count)
    }

    fn can_access_peer(&self, peer: i32) -> Result<bool> {
        Ok(peer >= 0 && (peer as usize) < self.options.device_count)
    }

    fn reserve(&self, size: usize, align: usize) -> Result<DevicePtr> {
        let align = align.max(self.options.granularity);
        if size == 0 || !align.is_power_of_two() {
            return Err(Error::invalid_argument(format!(
                "reserve: size {size} align {align}"
            )));
        }
        self.check_aligned("reserve", &[size as u64])?;
        let span = size
            .checked_add(align)
            .ok_or_else(|| Error::invalid_argument("reserve: size overflows"))?;
        // SAFETY: an anonymous PROT_NONE mapping at an address the kernel chooses.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(os_error("mmap(reserve)"));
        }
        let start = raw as usize;
        let aligned = (start + align - 1) & !(align - 1);
        // SAFETY: trimming the unaligned head and tail of the mapping made above.
        unsafe {
            if aligned > start {
                libc::munmap(raw, aligned - start);
            }
            let tail = start + span - (aligned + size);
            if tail > 0 {
                libc::munmap((aligned + size) as *mut libc::c_void, tail);
            }
        }
        lock(&self.memory)
            .reservations
            .insert(aligned as DevicePtr, size);
        Ok(aligned as DevicePtr)
    }

    fn unreserve(&self, va: DevicePtr, size: usize) -> Result<()> {
        let mut memory = lock(&self.memory);
        match memory.reservations.get(&va) {
            Some(&len) if len == size => {}
            _ => {
                return Err(Error::invalid_argument(format!(
                    "unreserve: {va:#x}+{size} is not a reservation"
                )))
            }
        }
        if memory.overlaps_mapping(va, size) {
            return Err(Error::new(
                ErrorKind::InvalidState,
                format!("unreserve: {va:#x}+{size} still has mappings"),
            ));
        }
        // SAFETY: the range is a reservation of ours with nothing mapped in it.
        if unsafe { libc::munmap(va as *mut libc::c_void, size) } != 0 {
            return Err(os_error("munmap"));
        }
        memory.reservations.remove(&va);
        Ok(())
    }

    fn create_physical(&self, size: usize) -> Result<PhysHandle> {
        if size == 0 {
            return Err(Error::invalid_argument("create_physical: size 0"));
        }
        self.check_aligned("create_physical", &[size as u64])?;
        let mut memory = lock(&self.memory);
        let offset = memory.offsets.allocate(size).ok_or_else(|| {
            Error::out_of_memory(format!(
                "host device {}: cannot create {size} bytes ({} of {} in use)",
                self.ordinal, memory.created_bytes, self.options.total_memory
            ))
        })?;
        let handle = memory.next_handle;
        memory.next_handle += 1;
        memory.chunks.insert(
            handle,
            Chunk {
                offset,
                size,
                mappings: 0,
                released: false,
            },
        );
        memory.created_bytes += size;
        Ok(PhysHandle(handle))
    }

    fn release_physical(&self, handle: PhysHandle) -> Result<()> {
        let mut memory = lock(&self.memory);
        match memory.chunks.get_mut(&handle.0) {
            Some(chunk) if !chunk.released => chunk.released = true,
            _ => {
                return Err(Error::invalid_argument(format!(
                    "release_physical: unknown handle {}",
                    handle.0
                )))
            }
        }
        self.retire_chunk(&mut memory, handle.0);
        Ok(())
    }

    fn map(&self, va: DevicePtr, size: usize, handle: PhysHandle, offset: usize) -> Result<()> {
        self.check_aligned("map", &[va, size as u64, offset as u64])?;
        let mut memory = lock(&self.memory);
        let file_offset = match memory.chunks.get(&handle.0) {
            // Like CUDA, only a whole handle maps (cuMemMap's offset must be 0).
            Some(chunk) if !chunk.released && offset == 0 && size == chunk.size => chunk.offset,
            _ => {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!(
                        "map: handle {} cannot back {size} bytes at offset {offset}: only whole handles map",
                        handle.0
                    ),
                ))
            }
        };
        if !memory.reservation_contains(va, size) || memory.overlaps_mapping(va, size) {
            return Err(Error::invalid_argument(format!(
                "map: {va:#x}+{size} is not a free part of a reservation"
            )));
        }
        // SAFETY: the target lies inside a reservation of ours and overlaps no mapping.
        let raw = unsafe {
            libc::mmap(
                va as *mut libc::c_void,
                size,
                libc::PROT_NONE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                self.memfd,
                file_offset as libc::off_t,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(os_error("mmap(map)"));
        }
        memory.mappings.insert(
            va,
            Mapping {
                size,
                handle,
                accessible: false,
            },
        );
        if let Some(chunk) = memory.chunks.get_mut(&handle.0) {
            chunk.mappings += 1;
        }
        Ok(())
    }

    fn unmap(&self, va: DevicePtr, size: usize) -> Result<()> {
        let mut memory = lock(&self.memory);
        // Like cuMemUnmap, the range must cover whole mappings exactly.
        let end = va + size as u64;
        let covered: Vec<(DevicePtr, Mapping)> = memory
            .mappings
            .range(va..end)
            .map(|(&a, &m)| (a, m))
            .collect();
        let exact = !covered.is_empty()
            && covered[0].0 == va
            && covered
                .windows(2)
                .all(|w| w[0].0 + w[0].1.size as u64 == w[1].0)
            && covered
                .last()
                .is_some_and(|(a, m)| a + m.size as u64 == end);
        if !exact {
            return Err(Error::invalid_argument(format!(
                "unmap: {va:#x}+{size} does not cover whole mappings"
            )));
        }
        // SAFETY: replacing our own mappings with a PROT_NONE placeholder keeps the reservation.
        let raw = unsafe {
            libc::mmap(
                va as *mut libc::c_void,
                size,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(os_error("mmap(unmap)"));
        }
        for (addr, mapping) in covered {
            memory.mappings.remove(&addr);
            if let Some(chunk) = memory.chunks.get_mut(&mapping.handle.0) {
                chunk.mappings -= 1;
            }
            self.retire_chunk(&mut memory, mapping.handle.0);
        }
        Ok(())
    }

    fn set_access(&self, va: DevicePtr, size: usize, devices: &[i32]) -> Result<()> {
        if devices.is_empty() {
            return Err(Error::invalid_argument("set_access: no devices"));
        }
        if let Some(bad) = devices
            .iter()
            .find(|&&d| d < 0 || d as usize >= self.options.device_count)
        {
            return Err(Error::invalid_argument(format!(
                "set_access: no host device {bad}"
            )));
        }
        let mut memory = lock(&self.memory);
        let end = va + size as u64;
        let mut at = va;
        let mut starts = Vec::new();
        while at < end {
            match memory.mappings.range(..=at).next_back() {
                Some((&start, m)) if start + m.size as u64 > at => {
                    starts.push(start);
                    at = start + m.size as u64;
                }
                _ => {
                    return Err(Error::invalid_argument(format!(
                        "set_access: {at:#x} is not mapped"
                    )))
                }
            }
        }
        // SAFETY: every page of the range is one of our shared mappings.
        if unsafe {
            libc::mprotect(
                va as *mut libc::c_void,
                size,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        } != 0
        {
            return Err(os_error("mprotect"));
        }
        for start in starts {
            if let Some(m) = memory.mappings.get_mut(&start) {
                m.accessible = true;
            }
        }
        Ok(())
    }

    fn create_stream(&self) -> Result<Stream> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.start_stream(id)?;
        Ok(Stream(id))
    }

    fn destroy_stream(&self, stream: Stream) -> Result<()> {
        if stream == Stream::DEFAULT {
            return Err(Error::invalid_argument(
                "the default stream cannot be destroyed",
            ));
        }
        let removed = lock(&self.streams).remove(&stream.0);
        let mut host_stream = removed
            .ok_or_else(|| Error::invalid_argument(format!("unknown stream {:#x}", stream.0)))?;
        // Like CUDA, queued work still completes.
        lock(&host_stream.shared.state).shutdown = true;
        host_stream.shared.work.notify_all();
        if let Some(worker) = host_stream.worker.take() {
            let _ = worker.join();
        }
        Ok(())
    }

    fn create_event(&self) -> Result<Event> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        lock(&self.events.states).insert(id, EventState::default());
        Ok(Event(id))
    }

    fn destroy_event(&self, event: Event) -> Result<()> {
        lock(&self.events.states)
            .remove(&event.0)
            .map(|_| ())
            .ok_or_else(|| Error::invalid_argument(format!("unknown event {}", event.0)))
    }

    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        let generation = {
            let mut states = lock(&self.events.states);
            let state = states
                .get_mut(&event.0)
                .ok_or_else(|| Error::invalid_argument(format!("unknown event {}", event.0)))?;
            state.recorded += 1;
            state.recorded
        };
        self.enqueue(
            stream,
            Op::Record {
                event: event.0,
                generation,
            },
        )
    }

    fn query_event(&self, event: Event) -> Result<bool> {
        let states = lock(&self.events.states);
        let state = states
            .get(&event.0)
            .ok_or_else(|| Error::invalid_argument(format!("unknown event {}", event.0)))?;
        Ok(state.completed >= state.recorded)
    }

    fn synchronize_event(&self, event: Event) -> Result<()> {
        let generation = lock(&self.events.states)
            .get(&event.0)
            .map(|s| s.recorded)
            .ok_or_else(|| Error::invalid_argument(format!("unknown event {}", event.0)))?;
        self.events.wait(event.0, generation);
        Ok(())
    }

    fn synchronize_stream(&self, stream: Stream) -> Result<()> {
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

    fn synchronize_device(&self) -> Result<()> {
        let ids: Vec<u64> = lock(&self.streams).keys().copied().collect();
        for id in ids {
            match self.synchronize_stream(Stream(id)) {
                // A stream destroyed meanwhile has finished its work.
                Err(err) if err.kind() == ErrorKind::InvalidArgument => {}
                other => other?,
            }
        }
        Ok(())
    }

    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        let generation = lock(&self.events.states)
            .get(&event.0)
            .map(|s| s.recorded)
            .ok_or_else(|| Error::invalid_argument(format!("unknown event {}", event.0)))?;
        self.enqueue(
            stream,
            Op::Wait {
                event: event.0,
                generation,
            },
        )
    }

    /// Like CUDA's copies from pageable memory, the source is staged before the call returns,
    /// so the caller may reuse it at once.
    unsafe fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        if src.is_null() || !lock(&self.memory).accessible(dst, len) {
            return Err(Error::invalid_argument(format!(
                "copy_to_device: {dst:#x}+{len} is not accessible device memory"
            )));
        }
        // SAFETY: the caller guarantees `src` is valid for `len` bytes during this call.
        let data = unsafe { std::slice::from_raw_parts(src, len) }.to_vec();
        self.enqueue(
            stream,
            Op::Upload {
                dst: dst as usize,
                data,
            },
        )
    }

    /// Like CUDA's copies into pageable memory, the call returns once the bytes have landed.
    unsafe fn copy_to_host(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        if dst.is_null() || !lock(&self.memory).accessible(src, len) {
            return Err(Error::invalid_argument(format!(
                "copy_to_host: {src:#x}+{len} is not accessible device memory"
            )));
        }
        self.enqueue(
            stream,
            Op::Copy {
                dst: dst as usize,
                src: src as usize,
                len,
            },
        )?;
        self.synchronize_stream(stream)
    }

    fn copy_device(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        {
            let memory = lock(&self.memory);
            if !memory.accessible(dst, len) || !memory.accessible(src, len) {
                return Err(Error::invalid_argument(format!(
                    "copy_device: {src:#x} -> {dst:#x} ({len} bytes) is not accessible"
                )));
            }
        }
        self.enqueue(
            stream,
            Op::Copy {
                dst: dst as usize,
                src: src as usize,
                len,
            },
        )
    }

    fn alloc_pinned(&self, size: usize) -> Result<*mut u8> {
        let layout = std::alloc::Layout::from_size_align(size.max(1), 4096)
            .map_err(|e| Error::invalid_argument(format!("alloc_pinned({size}): {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(Error::out_of_memory(format!("alloc_pinned({size})")));
        }
        lock(&self.memory).pinned.insert(ptr as usize, layout);
        Ok(ptr)
    }

    unsafe fn free_pinned(&self, ptr: *mut u8) -> Result<()> {
        let layout = lock(&self.memory)
            .pinned
            .remove(&(ptr as usize))
            .ok_or_else(|| Error::invalid_argument(format!("free_pinned: unknown {ptr:?}")))?;
        // SAFETY: allocated by alloc_pinned with this layout, and the caller no longer uses it.
        unsafe { std::alloc::dealloc(ptr, layout) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device() -> HostDevice {
        HostDevice::new(0, HostOptions::default()).unwrap()
    }

    #[test]
    fn chunks_mapped_in_reverse_order_read_and_write_through() {
        let d = device();
        let g = d.granularity();
        let a = d.create_physical(g).unwrap();
        let b = d.create_physical(g).unwrap();
        let home = d.reserve(2 * g, g).unwrap();
        d.map(home, g, a, 0).unwrap();
        d.map(home + g as u64, g, b, 0).unwrap();
        d.set_access(home, 2 * g, &[0]).unwrap();
        let stitched = d.reserve(2 * g, g).unwrap();
        d.map(stitched, g, b, 0).unwrap();
        d.map(stitched + g as u64, g, a, 0).unwrap();
        d.set_access(stitched, 2 * g, &[0]).unwrap();
        unsafe {
            *(home as *mut u8) = 7;
            *((home + g as u64) as *mut u8) = 9;
            assert_eq!(*(stitched as *const u8), 9);
            assert_eq!(*((stitched + g as u64) as *const u8), 7);
            *(stitched as *mut u8) = 11;
            assert_eq!(*((home + g as u64) as *const u8), 11);
        }
        d.unmap(stitched, 2 * g).unwrap();
        d.unmap(home, 2 * g).unwrap();
        d.release_physical(a).unwrap();
        d.release_physical(b).unwrap();
        d.unreserve(stitched, 2 * g).unwrap();
        d.unreserve(home, 2 * g).unwrap();
        assert_eq!(d.live_objects(), (0, 0, 0));
        assert_eq!(d.created_bytes(), 0);
    }

    #[test]
    fn misuse_is_an_error() {
        let d = device();
        let g = d.granularity();
        assert!(d.create_physical(g + 1).is_err());
        let h = d.create_physical(g).unwrap();
        let va = d.reserve(g, g).unwrap();
        assert!(d.map(va + 4096, g, h, 0).is_err());
        assert!(d.map(va, 2 * g, h, 0).is_err());
        d.map(va, g, h, 0).unwrap();
        assert!(d.map(va, g, h, 0).is_err(), "double map");
        assert!(unsafe { d.copy_to_device(va, [0u8; 4].as_ptr(), 4, Stream::DEFAULT) }.is_err());
        assert!(d.unreserve(va, g).is_err(), "still mapped");
        d.unmap(va, g).unwrap();
        assert!(d.unmap(va, g).is_err());
        d.release_physical(h).unwrap();
        assert!(d.release_physical(h).is_err());
        let too_big = d.options().total_memory + g;
        assert_eq!(
            d.create_physical(too_big).unwrap_err().kind(),
            ErrorKind::OutOfMemory
        );
    }

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
