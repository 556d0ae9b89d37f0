//! A wrapper around any backend that fails chosen calls, and counts every call, for tests:
//! "fail the 3rd map from now" exercises each clean-up path of the allocator in turn.

use std::collections::HashMap;
use std::sync::Mutex;

use super::{
    BackendKind, CallKind, Device, DevicePtr, Event, MemInfo, PhysHandle, SharedDevice, Stream,
};
use crate::error::{Error, ErrorKind, Result};

/// What an injected failure does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Injected {
    Fail(ErrorKind),
    /// Panics inside the call: checks that panics never cross the C boundary.
    Panic,
}

#[derive(Debug, Default)]
struct Plan {
    calls: HashMap<CallKind, u64>,
    /// kind -> (call number that fails, what it does)
    failures: HashMap<CallKind, (u64, Injected)>,
    injected: u64,
}

/// Wraps a device; see the module docs.
pub struct FaultDevice {
    inner: SharedDevice,
    plan: Mutex<Plan>,
}

impl FaultDevice {
    pub fn new(inner: SharedDevice) -> Self {
        FaultDevice {
            inner,
            plan: Mutex::new(Plan::default()),
        }
    }

    fn plan(&self) -> std::sync::MutexGuard<'_, Plan> {
        match self.plan.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// Makes the `nth` call of `kind` from now (1 = the next one) fail with a driver error.
    pub fn fail_nth(&self, kind: CallKind, nth: u64) {
        self.fail_nth_with(kind, nth, ErrorKind::Driver);
    }

    /// Like [`FaultDevice::fail_nth`], returning an error of `error` kind.
    pub fn fail_nth_with(&self, kind: CallKind, nth: u64, error: ErrorKind) {
        self.plan_nth(kind, nth, Injected::Fail(error));
    }

    /// Makes the `nth` call of `kind` from now panic.
    pub fn panic_nth(&self, kind: CallKind, nth: u64) {
        self.plan_nth(kind, nth, Injected::Panic);
    }

    fn plan_nth(&self, kind: CallKind, nth: u64, what: Injected) {
        let mut plan = self.plan();
        let done = plan.calls.get(&kind).copied().unwrap_or(0);
        plan.failures.insert(kind, (done + nth.max(1), what));
    }

    /// Forgets all planned failures.
    pub fn clear(&self) {
        self.plan().failures.clear();
    }

    /// Calls of `kind` so far.
    pub fn calls(&self, kind: CallKind) -> u64 {
        self.plan().calls.get(&kind).copied().unwrap_or(0)
    }

    /// Failures injected so far.
    pub fn injected(&self) -> u64 {
        self.plan().injected
    }

    pub fn inner(&self) -> &SharedDevice {
        &self.inner
    }

    fn gate(&self, kind: CallKind) -> Result<()> {
        let mut plan = self.plan();
        let count = plan.calls.entry(kind).or_insert(0);
        *count += 1;
        let count = *count;
        if let Some(&(at, what)) = plan.failures.get(&kind) {
            if at == count {
                plan.failures.remove(&kind);
                plan.injected += 1;
                let message = format!("injected failure of {kind:?} call {count}");
                match what {
                    Injected::Fail(error) => return Err(Error::new(error, message)),
                    Injected::Panic => {
                        drop(plan);
                        panic!("{message}");
                    }
                }
            }
        }
        Ok(())
    }
}

impl Device for FaultDevice {
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
        self.gate(CallKind::MemInfo)?;
        self.inner.mem_info()
    }
    fn device_count(&self) -> Result<usize> {
        self.inner.device_count()
    }
    fn can_access_peer(&self, peer: i32) -> Result<bool> {
        self.inner.can_access_peer(peer)
    }
    fn reserve(&self, size: usize, align: usize) -> Result<DevicePtr> {
        self.gate(CallKind::Reserve)?;
        self.inner.reserve(size, align)
    }
    fn unreserve(&self, va: DevicePtr, size: usize) -> Result<()> {
        self.gate(CallKind::Unreserve)?;
        self.inner.unreserve(va, size)
    }
    fn create_physical(&self, size: usize) -> Result<PhysHandle> {
        self.gate(CallKind::CreatePhysical)?;
        self.inner.create_physical(size)
    }
    fn release_physical(&self, handle: PhysHandle) -> Result<()> {
        self.gate(CallKind::ReleasePhysical)?;
        self.inner.release_physical(handle)
    }
    fn map(&self, va: DevicePtr, size: usize, handle: PhysHandle, offset: usize) -> Result<()> {
        self.gate(CallKind::Map)?;
        self.inner.map(va, size, handle, offset)
    }
    fn unmap(&self, va: DevicePtr, size: usize) -> Result<()> {
        self.gate(CallKind::Unmap)?;
        self.inner.unmap(va, size)
    }
    fn set_access(&self, va: DevicePtr, size: usize, devices: &[i32]) -> Result<()> {
        self.gate(CallKind::SetAccess)?;
        self.inner.set_access(va, size, devices)
    }
    fn create_stream(&self) -> Result<Stream> {
        self.gate(CallKind::CreateStream)?;
        self.inner.create_stream()
    }
    fn destroy_stream(&self, stream: Stream) -> Result<()> {
        self.gate(CallKind::DestroyStream)?;
        self.inner.destroy_stream(stream)
    }
    fn create_event(&self) -> Result<Event> {
        self.gate(CallKind::CreateEvent)?;
        self.inner.create_event()
    }
    fn destroy_event(&self, event: Event) -> Result<()> {
        self.gate(CallKind::DestroyEvent)?;
        self.inner.destroy_event(event)
    }
    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        self.gate(CallKind::RecordEvent)?;
        self.inner.record_event(event, stream)
    }
    fn query_event(&self, event: Event) -> Result<bool> {
        self.gate(CallKind::QueryEvent)?;
        self.inner.query_event(event)
    }
    fn synchronize_event(&self, event: Event) -> Result<()> {
        self.gate(CallKind::SynchronizeEvent)?;
        self.inner.synchronize_event(event)
    }
    fn synchronize_stream(&self, stream: Stream) -> Result<()> {
        self.gate(CallKind::SynchronizeStream)?;
        self.inner.synchronize_stream(stream)
    }
    fn synchronize_device(&self) -> Result<()> {
        self.gate(CallKind::SynchronizeDevice)?;
        self.inner.synchronize_device()
    }
    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        self.gate(CallKind::StreamWaitEvent)?;
        self.inner.stream_wait_event(stream, event)
    }
    unsafe fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        self.gate(CallKind::Copy)?;
        // SAFETY: forwarded under the caller's contract.
        unsafe { self.inner.copy_to_device(dst, src, len, stream) }
    }
    unsafe fn copy_to_host(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        self.gate(CallKind::Copy)?;
        // SAFETY: forwarded under the caller's contract.
        unsafe { self.inner.copy_to_host(dst, src, len, stream) }
    }
    fn copy_device(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        self.gate(CallKind::Copy)?;
        self.inner.copy_device(dst, src, len, stream)
    }
    fn alloc_pinned(&self, size: usize) -> Result<*mut u8> {
        self.gate(CallKind::Pinned)?;
        self.inner.alloc_pinned(size)
    }
    unsafe fn free_pinned(&self, ptr: *mut u8) -> Result<()> {
        self.gate(CallKind::Pinned)?;
        // SAFETY: forwarded under the caller's contract.
        unsafe { self.inner.free_pinned(ptr) }
    }
}
