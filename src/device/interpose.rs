//! A device wrapper that runs an [`Interposer`] around every driver call of another device.
//! Fault injection ([`super::fault`]) and the replay's call timing are both interposers, so
//! the forwarding of each [`Device`] method is written once.

use super::{
    BackendKind, CallKind, CaptureMode, Device, DevicePtr, Event, HostMemory, MemInfo, PhysHandle,
    SharedDevice, Stream,
};
use crate::error::Result;
use std::os::fd::{BorrowedFd, OwnedFd};

/// Runs around each driver call: may refuse it, time it, count it.
pub trait Interposer: Send + Sync {
    fn around<T>(&self, kind: CallKind, call: impl FnOnce() -> Result<T>) -> Result<T>;
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
    fn mem_info(&self) -> Result<MemInfo> {
        self.hook
            .around(CallKind::MemInfo, || self.inner.mem_info())
    }
    fn device_count(&self) -> Result<usize> {
        self.inner.device_count()
    }
    fn can_access_peer(&self, peer: i32) -> Result<bool> {
        self.inner.can_access_peer(peer)
    }
    fn reserve(&self, size: usize, align: usize) -> Result<DevicePtr> {
        self.hook
            .around(CallKind::Reserve, || self.inner.reserve(size, align))
    }
    fn unreserve(&self, va: DevicePtr, size: usize) -> Result<()> {
        self.hook
            .around(CallKind::Unreserve, || self.inner.unreserve(va, size))
    }
    fn create_physical(&self, size: usize) -> Result<PhysHandle> {
        self.hook.around(CallKind::CreatePhysical, || {
            self.inner.create_physical(size)
        })
    }
    fn release_physical(&self, handle: PhysHandle) -> Result<()> {
        self.hook.around(CallKind::ReleasePhysical, || {
            self.inner.release_physical(handle)
        })
    }
    fn map(&self, va: DevicePtr, size: usize, handle: PhysHandle, offset: usize) -> Result<()> {
        self.hook
            .around(CallKind::Map, || self.inner.map(va, size, handle, offset))
    }
    fn unmap(&self, va: DevicePtr, size: usize) -> Result<()> {
        self.hook
            .around(CallKind::Unmap, || self.inner.unmap(va, size))
    }
    fn set_access(&self, va: DevicePtr, size: usize, devices: &[i32]) -> Result<()> {
        self.hook.around(CallKind::SetAccess, || {
            self.inner.set_access(va, size, devices)
        })
    }
    fn set_access_read_only(&self, va: DevicePtr, size: usize, devices: &[i32]) -> Result<()> {
        self.hook.around(CallKind::SetAccess, || {
            self.inner.set_access_read_only(va, size, devices)
        })
    }
    fn equal_bytes(&self, a: DevicePtr, b: DevicePtr, len: usize, stream: Stream) -> Result<bool> {
        self.hook
            .around(CallKind::Copy, || self.inner.equal_bytes(a, b, len, stream))
    }
    fn create_shareable(&self, size: usize) -> Result<PhysHandle> {
        self.hook
            .around(CallKind::Share, || self.inner.create_shareable(size))
    }
    fn export_handle(&self, handle: PhysHandle) -> Result<OwnedFd> {
        self.hook
            .around(CallKind::Share, || self.inner.export_handle(handle))
    }
    fn import_handle(&self, fd: BorrowedFd<'_>, size: usize) -> Result<PhysHandle> {
        self.hook
            .around(CallKind::Share, || self.inner.import_handle(fd, size))
    }
    fn identity(&self) -> Result<String> {
        self.inner.identity()
    }
    fn create_stream(&self) -> Result<Stream> {
        self.hook
            .around(CallKind::CreateStream, || self.inner.create_stream())
    }
    fn destroy_stream(&self, stream: Stream) -> Result<()> {
        self.hook.around(CallKind::DestroyStream, || {
            self.inner.destroy_stream(stream)
        })
    }
    fn create_event(&self) -> Result<Event> {
        self.hook
            .around(CallKind::CreateEvent, || self.inner.create_event())
    }
    fn create_timed_event(&self) -> Result<Event> {
        self.hook
            .around(CallKind::CreateEvent, || self.inner.create_timed_event())
    }
    fn elapsed_ns(&self, start: Event, end: Event) -> Result<u64> {
        self.hook
            .around(CallKind::QueryEvent, || self.inner.elapsed_ns(start, end))
    }
    fn destroy_event(&self, event: Event) -> Result<()> {
        self.hook
            .around(CallKind::DestroyEvent, || self.inner.destroy_event(event))
    }
    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        self.hook.around(CallKind::RecordEvent, || {
            self.inner.record_event(event, stream)
        })
    }
    fn query_event(&self, event: Event) -> Result<bool> {
        self.hook
            .around(CallKind::QueryEvent, || self.inner.query_event(event))
    }
    fn synchronize_event(&self, event: Event) -> Result<()> {
        self.hook.around(CallKind::SynchronizeEvent, || {
            self.inner.synchronize_event(event)
        })
    }
    fn synchronize_stream(&self, stream: Stream) -> Result<()> {
        self.hook.around(CallKind::SynchronizeStream, || {
            self.inner.synchronize_stream(stream)
        })
    }
    fn synchronize_device(&self) -> Result<()> {
        self.hook.around(CallKind::SynchronizeDevice, || {
            self.inner.synchronize_device()
        })
    }
    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        self.hook.around(CallKind::StreamWaitEvent, || {
            self.inner.stream_wait_event(stream, event)
        })
    }
    unsafe fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        // SAFETY: forwarded under the caller's contract.
        self.hook.around(CallKind::Copy, || unsafe {
            self.inner.copy_to_device(dst, src, len, stream)
        })
    }
    unsafe fn copy_to_host(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        // SAFETY: forwarded under the caller's contract.
        self.hook.around(CallKind::Copy, || unsafe {
            self.inner.copy_to_host(dst, src, len, stream)
        })
    }
    fn copy_device(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        self.hook.around(CallKind::Copy, || {
            self.inner.copy_device(dst, src, len, stream)
        })
    }
    fn knows_stream(&self, stream: Stream) -> bool {
        self.inner.knows_stream(stream)
    }
    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        self.inner.exchange_capture_mode(mode)
    }
    fn alloc_pinned(&self, size: usize) -> Result<*mut u8> {
        self.hook
            .around(CallKind::Pinned, || self.inner.alloc_pinned(size))
    }
    unsafe fn free_pinned(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: forwarded under the caller's contract.
        self.hook
            .around(CallKind::Pinned, || unsafe { self.inner.free_pinned(ptr) })
    }
    unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<()> {
        // SAFETY: forwarded under the caller's contract.
        self.hook.around(CallKind::HostRegister, || unsafe {
            self.inner.register_host(ptr, len)
        })
    }
    unsafe fn unregister_host(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: forwarded under the caller's contract.
        self.hook.around(CallKind::HostRegister, || unsafe {
            self.inner.unregister_host(ptr)
        })
    }
    fn host_memory(&self, ptr: *const u8, len: usize) -> Result<HostMemory> {
        self.hook
            .around(CallKind::HostQuery, || self.inner.host_memory(ptr, len))
    }
    fn numa_node(&self) -> Option<u32> {
        self.inner.numa_node()
    }
}
