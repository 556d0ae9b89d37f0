//! The host backend: real bytes and real virtual-address stitching without a GPU.
//!
//! A reserved range is an `mmap(PROT_NONE)` region; physical memory is a region of one sparse
//! memfd per device; mapping is `mmap(MAP_FIXED | MAP_SHARED)` of that region, with access off
//! until [`Device::set_access`] (as with CUDA, where a mapping is unusable before access is set).
//! Bytes written through a stitched range land in the chunks it maps. Streams are worker threads
//! that run their copies in order; events complete when the worker reaches them.
//!
//! This file holds the device and its [`Device`] implementation; the work is in `memory`
//! (chunks, reservations and mappings), `streams` (worker threads and events) and `copies`
//! (copies and pinned buffers).

mod copies;
mod memory;
mod process;
mod streams;

use std::collections::HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use self::memory::Memory;
use self::streams::{Events, HostStream};
use super::{
    BackendKind, Device, DevicePtr, Event, HostMemory, MemInfo, PhysHandle, SharedDevice, Stream,
};
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

use crate::sync::lock;

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
        let memfd = memory::create_memfd(ordinal, options.total_memory)?;
        let device = HostDevice {
            ordinal,
            options,
            memfd,
            memory: Mutex::new(Memory::new(options.total_memory)),
            streams: Mutex::new(HashMap::new()),
            events: Events::global(),
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
}

impl Drop for HostDevice {
    fn drop(&mut self) {
        self.stop_streams();
        let memory = lock(&self.memory);
        memory.unmap_reservations();
        copies::free_all_pinned(&memory);
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
        Ok(MemInfo {
            free: self.options.total_memory - self.created_bytes(),
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
        self.reserve_range(size, align)
    }

    fn unreserve(&self, va: DevicePtr, size: usize) -> Result<()> {
        self.unreserve_range(va, size)
    }

    fn create_physical(&self, size: usize) -> Result<PhysHandle> {
        self.create_chunk(size)
    }

    fn release_physical(&self, handle: PhysHandle) -> Result<()> {
        self.release_chunk(handle)
    }

    fn map(&self, va: DevicePtr, size: usize, handle: PhysHandle, offset: usize) -> Result<()> {
        self.map_chunk(va, size, handle, offset)
    }

    fn unmap(&self, va: DevicePtr, size: usize) -> Result<()> {
        self.unmap_range(va, size)
    }

    fn set_access(&self, va: DevicePtr, size: usize, devices: &[i32]) -> Result<()> {
        self.grant_access(va, size, devices, true)
    }

    fn set_access_read_only(&self, va: DevicePtr, size: usize, devices: &[i32]) -> Result<()> {
        self.grant_access(va, size, devices, false)
    }

    fn create_shareable(&self, size: usize) -> Result<PhysHandle> {
        self.create_shareable_chunk(size)
    }

    fn export_handle(&self, handle: PhysHandle) -> Result<OwnedFd> {
        self.export_chunk(handle)
    }

    fn import_handle(&self, fd: BorrowedFd<'_>, size: usize) -> Result<PhysHandle> {
        self.import_chunk(fd, size)
    }

    fn create_stream(&self) -> Result<Stream> {
        self.add_stream()
    }

    fn destroy_stream(&self, stream: Stream) -> Result<()> {
        self.remove_stream(stream)
    }

    fn knows_stream(&self, stream: Stream) -> bool {
        self.has_stream(stream)
    }

    fn create_event(&self) -> Result<Event> {
        self.add_event()
    }

    fn create_timed_event(&self) -> Result<Event> {
        self.add_timed_event()
    }

    fn elapsed_ns(&self, start: Event, end: Event) -> Result<u64> {
        self.events_elapsed_ns(start, end)
    }

    fn destroy_event(&self, event: Event) -> Result<()> {
        self.remove_event(event)
    }

    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        self.record(event, stream)
    }

    fn query_event(&self, event: Event) -> Result<bool> {
        self.event_complete(event)
    }

    fn synchronize_event(&self, event: Event) -> Result<()> {
        self.wait_for_event(event)
    }

    fn synchronize_stream(&self, stream: Stream) -> Result<()> {
        self.wait_for_stream(stream)
    }

    fn synchronize_device(&self) -> Result<()> {
        self.wait_for_all_streams()
    }

    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        self.enqueue_event_wait(stream, event)
    }

    /// Like CUDA's copies from pageable memory, the source is staged before the call returns,
    /// so the caller may reuse it at once; page-locked sources are read when the stream gets
    /// there, as a DMA engine would.
    unsafe fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        // SAFETY: the caller keeps this call's contract, which is the inherent call's.
        unsafe { self.copy_host_to_device(dst, src, len, stream) }
    }

    /// Like CUDA's copies into pageable memory, the call returns once the bytes have landed;
    /// page-locked destinations are written when the stream gets there.
    unsafe fn copy_to_host(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        // SAFETY: the caller keeps this call's contract, which is the inherent call's.
        unsafe { self.copy_device_to_host(dst, src, len, stream) }
    }

    fn copy_device(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        self.copy_device_to_device(dst, src, len, stream)
    }

    fn alloc_pinned(&self, size: usize) -> Result<*mut u8> {
        self.alloc_host_pinned(size)
    }

    unsafe fn free_pinned(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: the caller keeps this call's contract, which is the inherent call's.
        unsafe { self.free_host_pinned(ptr) }
    }

    unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<()> {
        if ptr.is_null() || len == 0 {
            return Err(Error::invalid_argument(format!(
                "register_host: {ptr:?}+{len} is not a host range"
            )));
        }
        process::lock_pages(ptr as usize, len, true)
    }

    unsafe fn unregister_host(&self, ptr: *mut u8) -> Result<()> {
        process::unlock_pages(ptr as usize, true).map(|_| ())
    }

    fn host_memory(&self, ptr: *const u8, len: usize) -> Result<HostMemory> {
        if ptr.is_null() {
            return Err(Error::new(ErrorKind::NullPointer, "host pointer is NULL"));
        }
        Ok(process::host_memory(ptr as usize, len))
    }
}

/// A default host device, for the tests of this backend.
#[cfg(test)]
fn test_device() -> HostDevice {
    HostDevice::new(0, HostOptions::default()).unwrap()
}
