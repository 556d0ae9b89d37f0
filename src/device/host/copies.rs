//! Copies of the host backend (host to device, device to host, device to device), checked
//! against the mappings and queued on a stream, and the page-aligned host buffers that stand in
//! for pinned memory.

use super::memory::Memory;
use super::process;
use super::streams::Op;
use super::{lock, HostDevice};
use crate::device::{DevicePtr, HostMemory, Stream};
use crate::error::{Error, Result};

impl HostDevice {
    /// [`Device::copy_to_device`](crate::device::Device::copy_to_device). Like CUDA's copies
    /// from pageable memory, the source is staged before the call returns, so the caller may
    /// reuse it at once.
    ///
    /// # Safety
    /// As for the trait call: `src` must be valid for `len` bytes (this backend reads them
    /// before returning).
    pub(super) unsafe fn copy_host_to_device(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        if src.is_null() || !self.writable(dst, len) {
            return Err(Error::invalid_argument(format!(
                "copy_to_device: {dst:#x}+{len} is not writable device memory"
            )));
        }
        if process::host_memory(src as usize, len) == HostMemory::Pinned {
            // Read when the stream gets there: the caller keeps it unchanged until then.
            return self.enqueue(
                stream,
                Op::Copy {
                    dst: dst as usize,
                    src: src as usize,
                    len,
                },
            );
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

    /// [`Device::copy_to_host`](crate::device::Device::copy_to_host). Like CUDA's copies into
    /// pageable memory, the call returns once the bytes have landed.
    ///
    /// # Safety
    /// As for the trait call: `dst` must be valid for `len` bytes (this backend writes them
    /// before returning).
    pub(super) unsafe fn copy_device_to_host(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        if dst.is_null() || !self.reachable(src, len) {
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
        if process::host_memory(dst as usize, len) == HostMemory::Pinned {
            return Ok(());
        }
        self.wait_for_stream(stream)
    }

    /// [`Device::copy_device`](crate::device::Device::copy_device).
    pub(super) fn copy_device_to_device(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        {
            if !self.writable(dst, len) || !self.reachable(src, len) {
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

    /// [`Device::alloc_pinned`](crate::device::Device::alloc_pinned).
    pub(super) fn alloc_host_pinned(&self, size: usize) -> Result<*mut u8> {
        let layout = std::alloc::Layout::from_size_align(size.max(1), 4096)
            .map_err(|e| Error::invalid_argument(format!("alloc_pinned({size}): {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(Error::out_of_memory(format!("alloc_pinned({size})")));
        }
        if let Err(err) = process::lock_pages(ptr as usize, layout.size(), false) {
            // SAFETY: just allocated with this layout and never handed out.
            unsafe { std::alloc::dealloc(ptr, layout) };
            return Err(err);
        }
        lock(&self.memory).pinned.insert(ptr as usize, layout);
        Ok(ptr)
    }

    /// [`Device::free_pinned`](crate::device::Device::free_pinned).
    ///
    /// # Safety
    /// `ptr` must come from [`HostDevice::alloc_host_pinned`] and not be in use.
    pub(super) unsafe fn free_host_pinned(&self, ptr: *mut u8) -> Result<()> {
        let layout = lock(&self.memory)
            .pinned
            .remove(&(ptr as usize))
            .ok_or_else(|| Error::invalid_argument(format!("free_pinned: unknown {ptr:?}")))?;
        let _ = process::unlock_pages(ptr as usize, false);
        // SAFETY: allocated by alloc_pinned with this layout, and the caller no longer uses it.
        unsafe { std::alloc::dealloc(ptr, layout) };
        Ok(())
    }
}

impl HostDevice {
    /// Whether this device may touch `[va, va+len)`: its own mapped memory with access granted,
    /// or memory of another host device of the process that granted it access (as a CUDA
    /// device may use a peer's memory, or one ordinal's memory is the same from any object).
    fn reachable(&self, va: DevicePtr, len: usize) -> bool {
        lock(&self.memory).accessible(va, len) || process::granted(va, len, self.ordinal)
    }

    /// Whether this device may write `[va, va+len)`: its own memory mapped writable, or a
    /// peer's granted to it (only writable memory is granted to peers).
    fn writable(&self, va: DevicePtr, len: usize) -> bool {
        lock(&self.memory).writable(va, len) || process::granted(va, len, self.ordinal)
    }

    /// Pinned buffers handed out and not freed (leak checks in tests).
    pub fn live_pinned(&self) -> usize {
        lock(&self.memory).pinned.len()
    }
}

/// Frees every pinned buffer still handed out, when the device goes away.
pub(super) fn free_all_pinned(memory: &Memory) {
    for (&ptr, &layout) in memory.pinned.iter() {
        let _ = process::unlock_pages(ptr, false);
        // SAFETY: allocated with this layout by alloc_pinned.
        unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
    }
}
