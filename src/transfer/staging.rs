//! Staging memory, made once per engine and reused by every copy (pinning and mapping are slow):
//! page-locked host buffers that pageable data passes through, and device buffers on a peer GPU
//! that relayed chunks pass through on their way to or from the target.

use crate::device::{align_up, DevicePtr, SharedDevice};
use crate::error::{Error, Result};

/// One page-locked host buffer, freed on drop.
pub struct PinnedBuffer {
    device: SharedDevice,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain memory owned by this object; the device handle is thread-safe.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    /// `len` bytes of pinned memory from `device`, touched once so that its pages exist (and
    /// lie on the NUMA node of the calling thread) before any copy is timed.
    pub fn new(device: &SharedDevice, len: usize) -> Result<Self> {
        let ptr = device.alloc_pinned(len)?;
        if ptr.is_null() {
            return Err(Error::internal("alloc_pinned returned NULL"));
        }
        // SAFETY: `ptr` is valid for `len` bytes, just allocated.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(PinnedBuffer {
            device: device.clone(),
            ptr,
            len,
        })
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // A failure gets a second try: a drop has no later chance.
        // SAFETY: allocated by this device's alloc_pinned; the owner has waited for its copies.
        let free = || unsafe { self.device.free_pinned(self.ptr) };
        if let Err(err) = free().or_else(|_| free()) {
            log::warn!("glake: freeing a pinned staging buffer failed: {err}");
        }
    }
}

/// Device memory of `owner`, mapped in one range and accessible to `owner` and the devices in
/// `also` (a relay buffer on a peer, written by the peer's link and read by the target over
/// NVLink, or the reverse). Unmapped and released on drop.
pub struct DeviceBuffer {
    owner: SharedDevice,
    va: DevicePtr,
    size: usize,
    handle: Option<crate::device::PhysHandle>,
    mapped: bool,
}

impl DeviceBuffer {
    pub fn new(owner: &SharedDevice, len: usize, also: &[i32]) -> Result<Self> {
        let granularity = owner.granularity();
        let size = align_up(len.max(1), granularity)?;
        let va = owner.reserve(size, granularity)?;
        let mut buffer = DeviceBuffer {
            owner: owner.clone(),
            va,
            size,
            handle: None,
            mapped: false,
        };
        let handle = owner.create_physical(size)?;
        buffer.handle = Some(handle);
        owner.map(va, size, handle, 0)?;
        buffer.mapped = true;
        let mut devices = vec![owner.ordinal()];
        devices.extend(also.iter().copied().filter(|&d| d != owner.ordinal()));
        owner.set_access(va, size, &devices)?;
        Ok(buffer)
    }

    pub fn va(&self) -> DevicePtr {
        self.va
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // The owner of the buffer has waited for every copy that used it. A failed step gets
        // a second try: a drop has no later chance.
        let twice = |step: &dyn Fn() -> Result<()>| step().or_else(|_| step());
        let mut steps = Vec::new();
        if self.mapped {
            steps.push(twice(&|| self.owner.unmap(self.va, self.size)));
        }
        if let Some(handle) = self.handle {
            steps.push(twice(&|| self.owner.release_physical(handle)));
        }
        steps.push(twice(&|| self.owner.unreserve(self.va, self.size)));
        for err in steps.into_iter().filter_map(|r| r.err()) {
            log::warn!("glake: releasing a relay staging buffer failed: {err}");
        }
    }
}
