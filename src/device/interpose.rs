//! A device wrapper that runs an [`Interposer`] around every driver call of another device.
//! Fault injection ([`super::fault`]) and the replay's call timing are both interposers, so
//! the forwarding of each [`Device`] method is written once.

use super::{
    BackendKind, CallKind, CaptureMode, Device, DevicePtr, Event, HostMemory, MemInfo, PhysHandle,
    SharedDevice, Stream,
};
use crate::error::Result;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::panic::Location;

/// Runs around each driver call: may refuse it, time it, count it.
pub trait Interposer: Send + Sync {
    /// Runs `call`, a driver call of `kind` made at `site` in the caller's source (the
    /// driver-call methods of [`Device`] are `#[track_caller]`, so `site` is the line that
    /// called the device, not a line of this wrapper).
    fn around<T>(
        &self,
        kind: CallKind,
        site: &'static Location<'static>,
        call: impl FnOnce() -> Result<T>,
    ) -> Result<T>;
}

/// A device whose driver calls all pass through `hook`. Plain getters (kind, ordinal,
/// granularity, device count, peer capability) are not driver calls and go straight through.
pub struct Interposed<I> {
    inner: SharedDevice,
    hook: I,
}

impl<I: Interposer> Interposed<I> {
    pub fn with(inner: SharedDevice, hook: I) -> Self {
        Interposed { inner, hook }
    }

    pub fn inner(&self) -> &SharedDevice {
        &self.inner
    }

    pub fn hook(&self) -> &I {
        &self.hook
    }
}

impl<I: Interposer> Device for Interposed<I> {
    fn kind(&self) -> BackendKind {
        self.inner.kind()
    }
    fn ordinal(&self) -> i32 {
        self.inner.ordinal()
    }
    fn granularity(&self) -> usize {
        self.inner.granularity()
    }
    #[track_caller]
    fn mem_info(&self) -> Result<MemInfo> {
        self.hook.around(CallKind::MemInfo, Location::caller(), || {
            self.inner.mem_info()
        })
    }
    fn device_count(&self) -> Result<usize> {
        self.inner.device_count()
    }
    fn can_access_peer(&self, peer: i32) -> Result<bool> {
        self.inner.can_access_peer(peer)
    }
    #[track_caller]
    fn reserve(&self, size: usize, align: usize) -> Result<DevicePtr> {
        self.hook.around(CallKind::Reserve, Location::caller(), || {
            self.inner.reserve(size, align)
        })
    }
    #[track_caller]
    fn unreserve(&self, va: DevicePtr, size: usize) -> Result<()> {
        self.hook
            .around(CallKind::Unreserve, Location::caller(), || {
                self.inner.unreserve(va, size)
            })
    }
    #[track_caller]
    fn create_physical(&self, size: usize) -> Result<PhysHandle> {
        self.hook
            .around(CallKind::CreatePhysical, Location::caller(), || {
                self.inner.create_physical(size)
            })
    }
    #[track_caller]
    fn release_physical(&self, handle: PhysHandle) -> Result<()> {
        self.hook
            .around(CallKind::ReleasePhysical, Location::caller(), || {
                self.inner.release_physical(handle)
            })
    }
    #[track_caller]
    fn map(&self, va: DevicePtr, size: usize, handle: PhysHandle, offset: usize) -> Result<()> {
        self.hook.around(CallKind::Map, Location::caller(), || {
            self.inner.map(va, size, handle, offset)
        })
    }
    #[track_caller]
    fn unmap(&self, va: DevicePtr, size: usize) -> Result<()> {
        self.hook.around(CallKind::Unmap, Location::caller(), || {
            self.inner.unmap(va, size)
        })
    }
    #[track_caller]
    fn set_access(&self, va: DevicePtr, size: usize, devices: &[i32]) -> Result<()> {
        self.hook
            .around(CallKind::SetAccess, Location::caller(), || {
                self.inner.set_access(va, size, devices)
            })
    }
    #[track_caller]
    fn set_access_read_only(&self, va: DevicePtr, size: usize, devices: &[i32]) -> Result<()> {
        self.hook
            .around(CallKind::SetAccess, Location::caller(), || {
                self.inner.set_access_read_only(va, size, devices)
            })
    }
    #[track_caller]
    fn equal_bytes(&self, a: DevicePtr, b: DevicePtr, len: usize, stream: Stream) -> Result<bool> {
        self.hook.around(CallKind::Copy, Location::caller(), || {
            self.inner.equal_bytes(a, b, len, stream)
        })
    }
    #[track_caller]
    fn create_shareable(&self, size: usize) -> Result<PhysHandle> {
        self.hook.around(CallKind::Share, Location::caller(), || {
            self.inner.create_shareable(size)
        })
    }
    #[track_caller]
    fn export_handle(&self, handle: PhysHandle) -> Result<OwnedFd> {
        self.hook.around(CallKind::Share, Location::caller(), || {
            self.inner.export_handle(handle)
        })
    }
    #[track_caller]
    fn import_handle(&self, fd: BorrowedFd<'_>, size: usize) -> Result<PhysHandle> {
        self.hook.around(CallKind::Share, Location::caller(), || {
            self.inner.import_handle(fd, size)
        })
    }
    fn identity(&self) -> Result<String> {
        self.inner.identity()
    }
    #[track_caller]
    fn create_stream(&self) -> Result<Stream> {
        self.hook
            .around(CallKind::CreateStream, Location::caller(), || {
                self.inner.create_stream()
            })
    }
    #[track_caller]
    fn destroy_stream(&self, stream: Stream) -> Result<()> {
        self.hook
            .around(CallKind::DestroyStream, Location::caller(), || {
                self.inner.destroy_stream(stream)
            })
    }
    #[track_caller]
    fn create_event(&self) -> Result<Event> {
        self.hook
            .around(CallKind::CreateEvent, Location::caller(), || {
                self.inner.create_event()
            })
    }
    #[track_caller]
    fn create_timed_event(&self) -> Result<Event> {
        self.hook
            .around(CallKind::CreateEvent, Location::caller(), || {
                self.inner.create_timed_event()
            })
    }
    #[track_caller]
    fn elapsed_ns(&self, start: Event, end: Event) -> Result<u64> {
        self.hook
            .around(CallKind::QueryEvent, Location::caller(), || {
                self.inner.elapsed_ns(start, end)
            })
    }
    #[track_caller]
    fn destroy_event(&self, event: Event) -> Result<()> {
        self.hook
            .around(CallKind::DestroyEvent, Location::caller(), || {
                self.inner.destroy_event(event)
            })
    }
    #[track_caller]
    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        self.hook
            .around(CallKind::RecordEvent, Location::caller(), || {
                self.inner.record_event(event, stream)
            })
    }
    #[track_caller]
    fn query_event(&self, event: Event) -> Result<bool> {
        self.hook
            .around(CallKind::QueryEvent, Location::caller(), || {
                self.inner.query_event(event)
            })
    }
    #[track_caller]
    fn synchronize_event(&self, event: Event) -> Result<()> {
        self.hook
            .around(CallKind::SynchronizeEvent, Location::caller(), || {
                self.inner.synchronize_event(event)
            })
    }
    #[track_caller]
    fn synchronize_stream(&self, stream: Stream) -> Result<()> {
        self.hook
            .around(CallKind::SynchronizeStream, Location::caller(), || {
                self.inner.synchronize_stream(stream)
            })
    }
    #[track_caller]
    fn synchronize_device(&self) -> Result<()> {
        self.hook
            .around(CallKind::SynchronizeDevice, Location::caller(), || {
                self.inner.synchronize_device()
            })
    }
    #[track_caller]
    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        self.hook
            .around(CallKind::StreamWaitEvent, Location::caller(), || {
                self.inner.stream_wait_event(stream, event)
            })
    }
    #[track_caller]
    unsafe fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        // SAFETY: forwarded under the caller's contract.
        self.hook
            .around(CallKind::Copy, Location::caller(), || unsafe {
                self.inner.copy_to_device(dst, src, len, stream)
            })
    }
    #[track_caller]
    unsafe fn copy_to_host(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        // SAFETY: forwarded under the caller's contract.
        self.hook
            .around(CallKind::Copy, Location::caller(), || unsafe {
                self.inner.copy_to_host(dst, src, len, stream)
            })
    }
    #[track_caller]
    fn copy_device(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        self.hook.around(CallKind::Copy, Location::caller(), || {
            self.inner.copy_device(dst, src, len, stream)
        })
    }
    fn knows_stream(&self, stream: Stream) -> bool {
        self.inner.knows_stream(stream)
    }
    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        self.inner.exchange_capture_mode(mode)
    }
    #[track_caller]
    fn alloc_pinned(&self, size: usize) -> Result<*mut u8> {
        self.hook.around(CallKind::Pinned, Location::caller(), || {
            self.inner.alloc_pinned(size)
        })
    }
    #[track_caller]
    unsafe fn free_pinned(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: forwarded under the caller's contract.
        self.hook
            .around(CallKind::Pinned, Location::caller(), || unsafe {
                self.inner.free_pinned(ptr)
            })
    }
    #[track_caller]
    unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<()> {
        // SAFETY: forwarded under the caller's contract.
        self.hook
            .around(CallKind::HostRegister, Location::caller(), || unsafe {
                self.inner.register_host(ptr, len)
            })
    }
    #[track_caller]
    unsafe fn unregister_host(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: forwarded under the caller's contract.
        self.hook
            .around(CallKind::HostRegister, Location::caller(), || unsafe {
                self.inner.unregister_host(ptr)
            })
    }
    #[track_caller]
    fn host_memory(&self, ptr: *const u8, len: usize) -> Result<HostMemory> {
        self.hook
            .around(CallKind::HostQuery, Location::caller(), || {
                self.inner.host_memory(ptr, len)
            })
    }
    fn numa_node(&self) -> Option<u32> {
        self.inner.numa_node()
    }
}
