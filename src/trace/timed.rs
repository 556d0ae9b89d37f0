//! A [`Device`] wrapper that measures the time spent inside each driver call, so that the
//! allocator's own CPU cost can be told apart from the driver's (mapping calls dominate a
//! stitch on CUDA and are syscalls on the host backend).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::device::{
    BackendKind, CallKind, Device, DevicePtr, Event, MemInfo, PhysHandle, SharedDevice, Stream,
};
use crate::error::Result;

/// Calls and nanoseconds of one kind of driver call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallTime {
    pub kind: CallKind,
    pub calls: u64,
    pub nanos: u64,
}

/// Wraps a device and accumulates the wall time of every driver call.
pub struct TimedDevice {
    inner: SharedDevice,
    nanos: AtomicU64,
    calls: AtomicU64,
    by_kind: [(AtomicU64, AtomicU64); CallKind::ALL.len()],
}

impl TimedDevice {
    pub fn new(inner: SharedDevice) -> Self {
        TimedDevice {
            inner,
            nanos: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            by_kind: std::array::from_fn(|_| (AtomicU64::new(0), AtomicU64::new(0))),
        }
    }

    pub fn inner(&self) -> &SharedDevice {
        &self.inner
    }

    /// Nanoseconds spent inside driver calls so far.
    pub fn nanos(&self) -> u64 {
        self.nanos.load(Ordering::Relaxed)
    }

    /// Driver calls made so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Calls and time per kind, for the kinds that were called.
    pub fn by_kind(&self) -> Vec<CallTime> {
        CallKind::ALL
            .iter()
            .zip(self.by_kind.iter())
            .map(|(&kind, (calls, nanos))| CallTime {
                kind,
                calls: calls.load(Ordering::Relaxed),
                nanos: nanos.load(Ordering::Relaxed),
            })
            .filter(|c| c.calls > 0)
            .collect()
    }

    fn timed<T>(&self, kind: CallKind, call: impl FnOnce(&dyn Device) -> T) -> T {
        let start = Instant::now();
        let result = call(&*self.inner);
        let nanos = start.elapsed().as_nanos() as u64;
        self.nanos.fetch_add(nanos, Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::Relaxed);
        if let Some((calls, total)) = self.by_kind.get(kind as usize) {
            calls.fetch_add(1, Ordering::Relaxed);
            total.fetch_add(nanos, Ordering::Relaxed);
        }
        result
    }
}

impl Device for TimedDevice {
    // Plain getters are not driver calls.
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
        self.timed(CallKind::MemInfo, |d| d.mem_info())
    }

    fn device_count(&self) -> Result<usize> {
        self.inner.device_count()
    }

    fn can_access_peer(&self, peer: i32) -> Result<bool> {
        self.inner.can_access_peer(peer)
    }

    fn reserve(&self, size: usize, align: usize) -> Result<DevicePtr> {
        self.timed(CallKind::Reserve, |d| d.reserve(size, align))
    }

    fn unreserve(&self, va: DevicePtr, size: usize) -> Result<()> {
        self.timed(CallKind::Unreserve, |d| d.unreserve(va, size))
    }

    fn create_physical(&self, size: usize) -> Result<PhysHandle> {
        self.timed(CallKind::CreatePhysical, |d| d.create_physical(size))
    }

    fn release_physical(&self, handle: PhysHandle) -> Result<()> {
        self.timed(CallKind::ReleasePhysical, |d| d.release_physical(handle))
    }

    fn map(&self, va: DevicePtr, size: usize, handle: PhysHandle, offset: usize) -> Result<()> {
        self.timed(CallKind::Map, |d| d.map(va, size, handle, offset))
    }

    fn unmap(&self, va: DevicePtr, size: usize) -> Result<()> {
        self.timed(CallKind::Unmap, |d| d.unmap(va, size))
    }

    fn set_access(&self, va: DevicePtr, size: usize, devices: &[i32]) -> Result<()> {
        self.timed(CallKind::SetAccess, |d| d.set_access(va, size, devices))
    }

    fn create_stream(&self) -> Result<Stream> {
        self.timed(CallKind::CreateStream, |d| d.create_stream())
    }

    fn destroy_stream(&self, stream: Stream) -> Result<()> {
        self.timed(CallKind::DestroyStream, |d| d.destroy_stream(stream))
    }

    fn create_event(&self) -> Result<Event> {
        self.timed(CallKind::CreateEvent, |d| d.create_event())
    }

    fn destroy_event(&self, event: Event) -> Result<()> {
        self.timed(CallKind::DestroyEvent, |d| d.destroy_event(event))
    }

    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        self.timed(CallKind::RecordEvent, |d| d.record_event(event, stream))
    }

    fn query_event(&self, event: Event) -> Result<bool> {
        self.timed(CallKind::QueryEvent, |d| d.query_event(event))
    }

    fn synchronize_event(&self, event: Event) -> Result<()> {
        self.timed(CallKind::SynchronizeEvent, |d| d.synchronize_event(event))
    }

    fn synchronize_stream(&self, stream: Stream) -> Result<()> {
        self.timed(CallKind::SynchronizeStream, |d| {
            d.synchronize_stream(stream)
        })
    }

    fn synchronize_device(&self) -> Result<()> {
        self.timed(CallKind::SynchronizeDevice, |d| d.synchronize_device())
    }

    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        self.timed(CallKind::StreamWaitEvent, |d| {
            d.stream_wait_event(stream, event)
        })
    }

    unsafe fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        // SAFETY: the caller's guarantee for `src` is passed on unchanged.
        self.timed(CallKind::Copy, |d| unsafe {
            d.copy_to_device(dst, src, len, stream)
        })
    }

    unsafe fn copy_to_host(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        // SAFETY: the caller's guarantee for `dst` is passed on unchanged.
        self.timed(CallKind::Copy, |d| unsafe {
            d.copy_to_host(dst, src, len, stream)
        })
    }

    fn copy_device(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        self.timed(CallKind::Copy, |d| d.copy_device(dst, src, len, stream))
    }

    fn alloc_pinned(&self, size: usize) -> Result<*mut u8> {
        self.timed(CallKind::Pinned, |d| d.alloc_pinned(size))
    }

    unsafe fn free_pinned(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: the caller's guarantee for `ptr` is passed on unchanged.
        self.timed(CallKind::Pinned, |d| unsafe { d.free_pinned(ptr) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::host::{HostDevice, HostOptions};
    use std::sync::Arc;

    #[test]
    fn counts_driver_calls_and_time() {
        let host = HostDevice::shared(0, HostOptions::default()).unwrap();
        let timed = TimedDevice::new(host);
        let g = timed.granularity();
        assert_eq!(timed.calls(), 0, "getters are not driver calls");
        let h = timed.create_physical(g).unwrap();
        let va = timed.reserve(g, g).unwrap();
        timed.map(va, g, h, 0).unwrap();
        timed.unmap(va, g).unwrap();
        timed.unreserve(va, g).unwrap();
        timed.release_physical(h).unwrap();
        assert_eq!(timed.calls(), 6);
        assert!(timed.nanos() > 0);
        let kinds = timed.by_kind();
        assert_eq!(kinds.len(), 6);
        assert!(kinds.iter().all(|c| c.calls == 1));
        let shared: SharedDevice = Arc::new(timed);
        assert_eq!(shared.kind(), BackendKind::Host);
    }
}
