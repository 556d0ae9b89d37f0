//! The device seam: everything that touches a driver goes through [`Device`].
//!
//! Backends: [`cuda`] (the only module that calls CUDA), [`host`] (memfd + mmap, real bytes and
//! real virtual-address stitching without a GPU) and [`fault`] (wraps any backend and fails
//! chosen calls, for tests). The allocator above works on addresses and sizes only.

pub mod cuda;
pub mod fault;
pub mod host;
pub mod interpose;

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use crate::error::{Error, Result};

/// A device virtual address.
pub type DevicePtr = u64;

/// An opaque physical-memory handle of a backend (CUDA: `CUmemGenericAllocationHandle`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PhysHandle(pub u64);

/// A stream: CUDA's `CUstream` value (0 is the legacy default stream); on the host backend an id
/// handed out by the backend, 0 being its default stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Stream(pub u64);

impl Stream {
    pub const DEFAULT: Stream = Stream(0);
}

/// An event handle of a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Event(pub u64);

/// Which kind of backend a device is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendKind {
    Host,
    Cuda,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Host => "host",
            BackendKind::Cuda => "cuda",
        }
    }
}

/// Free and total memory of a device, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    pub free: usize,
    pub total: usize,
}

/// The kinds of driver call, so that the fault backend can fail one kind at a time and tests can
/// count calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CallKind {
    Reserve,
    Unreserve,
    CreatePhysical,
    ReleasePhysical,
    Map,
    Unmap,
    SetAccess,
    CreateStream,
    DestroyStream,
    CreateEvent,
    DestroyEvent,
    RecordEvent,
    QueryEvent,
    SynchronizeEvent,
    SynchronizeStream,
    SynchronizeDevice,
    StreamWaitEvent,
    Copy,
    Pinned,
    MemInfo,
    HostRegister,
    HostQuery,
    /// Creating, exporting or importing shareable physical memory.
    Share,
}

impl CallKind {
    pub const ALL: [CallKind; 23] = [
        CallKind::Reserve,
        CallKind::Unreserve,
        CallKind::CreatePhysical,
        CallKind::ReleasePhysical,
        CallKind::Map,
        CallKind::Unmap,
        CallKind::SetAccess,
        CallKind::CreateStream,
        CallKind::DestroyStream,
        CallKind::CreateEvent,
        CallKind::DestroyEvent,
        CallKind::RecordEvent,
        CallKind::QueryEvent,
        CallKind::SynchronizeEvent,
        CallKind::SynchronizeStream,
        CallKind::SynchronizeDevice,
        CallKind::StreamWaitEvent,
        CallKind::Copy,
        CallKind::Pinned,
        CallKind::MemInfo,
        CallKind::HostRegister,
        CallKind::HostQuery,
        CallKind::Share,
    ];
}

/// Whether host memory is page-locked for the devices' DMA engines (allocated pinned or
/// registered, by anyone in the process) or pageable (the driver stages it through buffers of its
/// own, at a fraction of the link's speed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HostMemory {
    Pinned,
    Pageable,
}

/// How a thread's driver calls interact with stream captures under way (CUDA's
/// `CUstreamCaptureMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureMode {
    Global,
    ThreadLocal,
    Relaxed,
}

/// One device of one backend. All methods are thread-safe; the allocator serialises its own
/// state but may call from any thread (PyTorch frees from arbitrary threads).
///
/// Addresses and sizes given to the mapping calls must be multiples of [`Device::granularity`].
///
/// The driver calls (the methods an [`interpose::Interposed`] device runs through its hook) are
/// `#[track_caller]`: an interposer learns the line of the caller's source that made each call,
/// which is how fault sweeps tell the call sites they failed apart.
pub trait Device: Send + Sync {
    fn kind(&self) -> BackendKind;
    /// The device ordinal this object drives.
    fn ordinal(&self) -> i32;
    /// Mapping granularity in bytes (2 MiB on current NVIDIA GPUs).
    fn granularity(&self) -> usize;
    #[track_caller]
    fn mem_info(&self) -> Result<MemInfo>;
    /// Number of devices of this backend visible to the process.
    fn device_count(&self) -> Result<usize>;
    /// Whether device `peer` can map memory of this device.
    fn can_access_peer(&self, peer: i32) -> Result<bool>;

    /// Reserves `size` bytes of virtual address space, aligned to `align`.
    #[track_caller]
    fn reserve(&self, size: usize, align: usize) -> Result<DevicePtr>;
    #[track_caller]
    fn unreserve(&self, va: DevicePtr, size: usize) -> Result<()>;
    /// Creates `size` bytes of physical memory on this device.
    #[track_caller]
    fn create_physical(&self, size: usize) -> Result<PhysHandle>;
    #[track_caller]
    fn release_physical(&self, handle: PhysHandle) -> Result<()>;
    /// Maps `size` bytes of `handle`, starting `offset` bytes in, at `va`.
    #[track_caller]
    fn map(&self, va: DevicePtr, size: usize, handle: PhysHandle, offset: usize) -> Result<()>;
    #[track_caller]
    fn unmap(&self, va: DevicePtr, size: usize) -> Result<()>;
    /// Grants read/write access to `[va, va+size)` to each device in `devices`.
    #[track_caller]
    fn set_access(&self, va: DevicePtr, size: usize, devices: &[i32]) -> Result<()>;
    /// Grants read-only access to `[va, va+size)` to each device in `devices`: a write there
    /// faults (memory shared with other processes).
    #[track_caller]
    fn set_access_read_only(&self, _va: DevicePtr, _size: usize, _devices: &[i32]) -> Result<()> {
        Err(unsupported_sharing(self.kind()))
    }

    /// Whether `[a, a+len)` and `[b, b+len)`, both readable by this device, hold the same bytes,
    /// compared by the device itself after the work queued on `stream`; returns once known.
    /// Unsupported where the backend has no way to (callers then read both through the host).
    #[track_caller]
    fn equal_bytes(
        &self,
        _a: DevicePtr,
        _b: DevicePtr,
        _len: usize,
        _stream: Stream,
    ) -> Result<bool> {
        Err(Error::new(
            crate::error::ErrorKind::Unsupported,
            "this backend compares device memory through the host",
        ))
    }

    /// Creates `size` bytes of physical memory that [`Device::export_handle`] can hand to
    /// another process.
    #[track_caller]
    fn create_shareable(&self, _size: usize) -> Result<PhysHandle> {
        Err(unsupported_sharing(self.kind()))
    }
    /// A file descriptor for `handle` (made by [`Device::create_shareable`] or imported) that
    /// another process of the same user imports with [`Device::import_handle`]. The memory
    /// lives while any process holds a handle, a mapping or such a descriptor.
    #[track_caller]
    fn export_handle(&self, _handle: PhysHandle) -> Result<OwnedFd> {
        Err(unsupported_sharing(self.kind()))
    }
    /// Imports `size` bytes of physical memory of this device exported by any process; the
    /// handle is released with [`Device::release_physical`] like any other, and `fd` stays the
    /// caller's.
    #[track_caller]
    fn import_handle(&self, _fd: BorrowedFd<'_>, _size: usize) -> Result<PhysHandle> {
        Err(unsupported_sharing(self.kind()))
    }
    /// A name of the physical device that every process of the machine agrees on (the GPU's
    /// UUID): processes sharing memory meet under it.
    fn identity(&self) -> Result<String> {
        Ok(format!("{}-{}", self.kind().name(), self.ordinal()))
    }

    #[track_caller]
    fn create_stream(&self) -> Result<Stream>;
    #[track_caller]
    fn destroy_stream(&self, stream: Stream) -> Result<()>;
    #[track_caller]
    fn create_event(&self) -> Result<Event>;
    /// An event that also keeps when its work completed, for timing device work (the
    /// profiler's op times); costlier to record than a plain event, so made only for that.
    #[track_caller]
    fn create_timed_event(&self) -> Result<Event>;
    /// Nanoseconds from the completion of `start` to that of `end`, both timed events whose
    /// last records have completed (an error otherwise); 0 when `end` completed first.
    #[track_caller]
    fn elapsed_ns(&self, start: Event, end: Event) -> Result<u64>;
    /// After this, `event` must not be passed again: the host backend refuses it, but the
    /// driver's handles are pointers (a destroyed one is undefined behaviour there).
    #[track_caller]
    fn destroy_event(&self, event: Event) -> Result<()>;
    #[track_caller]
    fn record_event(&self, event: Event, stream: Stream) -> Result<()>;
    /// True once all work captured by the event's last record has completed.
    #[track_caller]
    fn query_event(&self, event: Event) -> Result<bool>;
    #[track_caller]
    fn synchronize_event(&self, event: Event) -> Result<()>;
    #[track_caller]
    fn synchronize_stream(&self, stream: Stream) -> Result<()>;
    /// Waits for all work on the device, on every stream.
    #[track_caller]
    fn synchronize_device(&self) -> Result<()>;
    /// Makes future work on `stream` wait for `event`.
    #[track_caller]
    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()>;

    /// Queues a host-to-device copy on `stream`.
    ///
    /// # Safety
    /// `src` must be valid for `len` bytes until the copy has completed on the stream.
    #[track_caller]
    unsafe fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: Stream,
    ) -> Result<()>;
    /// Queues a device-to-host copy on `stream`.
    ///
    /// # Safety
    /// `dst` must be valid for `len` bytes until the copy has completed on the stream.
    #[track_caller]
    unsafe fn copy_to_host(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        stream: Stream,
    ) -> Result<()>;
    /// Queues a device-to-device copy (both addresses visible to this device) on `stream`.
    #[track_caller]
    fn copy_device(&self, dst: DevicePtr, src: DevicePtr, len: usize, stream: Stream)
        -> Result<()>;

    /// Whether `stream` is one of this backend's streams, where the backend can tell: the host
    /// backend knows its streams; CUDA cannot check a raw handle cheaply or safely and says yes.
    fn knows_stream(&self, _stream: Stream) -> bool {
        true
    }

    /// Sets the calling thread's capture mode and returns the previous one. Backends without
    /// stream capture keep nothing.
    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        Ok(mode)
    }

    /// Page-locked host memory, for staging copies.
    #[track_caller]
    fn alloc_pinned(&self, size: usize) -> Result<*mut u8>;
    /// # Safety
    /// `ptr` must come from [`Device::alloc_pinned`] of this backend and not be in use.
    #[track_caller]
    unsafe fn free_pinned(&self, ptr: *mut u8) -> Result<()>;

    /// Page-locks `len` bytes of existing host memory at `ptr` for every device (CUDA's
    /// `cuMemHostRegister`). Slow (it pins page by page): for long-lived buffers only.
    ///
    /// # Safety
    /// `ptr` must be valid for `len` bytes until [`Device::unregister_host`].
    #[track_caller]
    unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<()>;
    /// Undoes [`Device::register_host`] of the range starting at `ptr`.
    ///
    /// # Safety
    /// No queued copy may still use the range.
    #[track_caller]
    unsafe fn unregister_host(&self, ptr: *mut u8) -> Result<()>;
    /// Whether `[ptr, ptr+len)` is page-locked host memory (its first and last byte are), or
    /// pageable. Any pointer may be asked about; nothing is dereferenced.
    #[track_caller]
    fn host_memory(&self, ptr: *const u8, len: usize) -> Result<HostMemory>;
    /// The NUMA node nearest the device's host link, where the platform says.
    fn numa_node(&self) -> Option<u32> {
        None
    }
}

fn unsupported_sharing(kind: BackendKind) -> Error {
    Error::new(
        crate::error::ErrorKind::Unsupported,
        format!(
            "the {} backend cannot share memory between processes",
            kind.name()
        ),
    )
}

/// A shared device handle.
pub type SharedDevice = Arc<dyn Device>;

/// Which backend to open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// CUDA when a usable GPU is present, otherwise the host backend.
    Auto,
    Host,
    Cuda,
}

/// Opens device `ordinal` of the chosen backend; `host` sets up the host backend when that is
/// the one opened.
pub fn open(choice: BackendChoice, ordinal: i32, host: host::HostOptions) -> Result<SharedDevice> {
    match choice {
        BackendChoice::Host => Ok(host::HostDevice::shared(ordinal, host)?),
        BackendChoice::Cuda => Ok(Arc::new(cuda::CudaDevice::open(ordinal)?)),
        BackendChoice::Auto => match cuda::CudaDevice::open(ordinal) {
            Ok(device) => Ok(Arc::new(device)),
            Err(err) => {
                log::info!("no usable CUDA device ({err}); using the host backend");
                Ok(host::HostDevice::shared(ordinal, host)?)
            }
        },
    }
}

/// Up to `most` other devices of `target`'s backend that `target` can reach as peers, opened
/// (relays for copies). Devices that fail to open are passed over with a log line.
pub fn open_peers(
    target: &SharedDevice,
    most: usize,
    host: host::HostOptions,
) -> Vec<SharedDevice> {
    let choice = match target.kind() {
        BackendKind::Cuda => BackendChoice::Cuda,
        BackendKind::Host => BackendChoice::Host,
    };
    let count = target.device_count().unwrap_or(1) as i32;
    let mut peers = Vec::new();
    for ordinal in (0..count).filter(|&d| d != target.ordinal()) {
        if peers.len() >= most {
            break;
        }
        if !target.can_access_peer(ordinal).unwrap_or(false) {
            continue;
        }
        match open(choice, ordinal, host) {
            Ok(peer) => peers.push(peer),
            Err(err) => log::info!("device {ordinal} is no relay: {err}"),
        }
    }
    peers
}

/// Rounds `value` up to a multiple of `align` (a power of two), failing on overflow.
pub fn align_up(value: usize, align: usize) -> Result<usize> {
    debug_assert!(align.is_power_of_two());
    value
        .checked_add(align - 1)
        .map(|v| v & !(align - 1))
        .ok_or_else(|| Error::invalid_argument(format!("size {value} overflows when aligned")))
}
