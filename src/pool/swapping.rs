//! Swappable allocations: each lives alone in a segment of its own, so its physical memory can
//! go back to the device while its virtual range stays reserved (swap out: the bytes move to a
//! host buffer the pool keeps), and come back mapped at the same address (swap in). A
//! swapped-out segment has no chunks; its block stays allocated, so neither reuse, stitching
//! nor `empty_cache` touches it.
//!
//! A failure before the bytes are safe on the host changes nothing; a failure tearing down the
//! device memory afterwards leaves the allocation swapped out with its bytes on the host, the
//! rest of the teardown kept as a zombie and retried (as for any released segment). Swapping in
//! undoes what it created on any failure and stays swapped out.
//!
//! These calls wait for the device and copy through ordinary host memory; `swap_async.rs`
//! has the stream-ordered ones (pinned buffers, copies on the caller's streams).

use super::alloc::check_size;
use super::blocks::{self, BlockId, PoolKind, SHARED};
use super::growth::Zombie;
use super::{Inner, Target};
use crate::device::{align_up, DevicePtr, Stream};
use crate::error::{Error, ErrorKind, Result};

/// A swappable allocation: its host copy while swapped out, or the copy out under way.
#[derive(Debug, Default)]
pub(super) struct Swappable {
    pub(super) host: Option<HostCopy>,
    pub(super) leaving: Option<super::swap_async::Leaving>,
}

/// The bytes of a swapped-out allocation and the chunk lengths to create again.
#[derive(Debug)]
pub(super) struct HostCopy {
    pub(super) bytes: HostBytes,
    pub(super) layout: Vec<usize>,
}

/// Where a host copy lives: ordinary memory (the waiting calls) or a pinned buffer of the
/// pool's (the stream-ordered ones).
#[derive(Debug)]
pub(super) enum HostBytes {
    Pageable(Vec<u8>),
    Pinned(super::swap_async::PinnedBuf),
}

impl HostBytes {
    pub(super) fn ptr(&self) -> *const u8 {
        match self {
            HostBytes::Pageable(v) => v.as_ptr(),
            HostBytes::Pinned(b) => b.ptr(),
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            HostBytes::Pageable(v) => v.len(),
            HostBytes::Pinned(b) => b.len,
        }
    }
}

/// What swapping needs to know of a swappable allocation.
pub(super) struct SwapInfo {
    pub(super) block: BlockId,
    pub(super) size: usize,
    pub(super) stream: Stream,
    pub(super) extra_streams: Vec<Stream>,
}

impl Inner {
    pub(super) fn malloc_swappable(
        &mut self,
        device: &dyn crate::device::Device,
        size: usize,
        stream: Stream,
    ) -> Result<DevicePtr> {
        check_size(size)?;
        let rounded = align_up(size, self.granularity)?;
        // Parked blocks keep their segments from looking idle.
        self.unpark_all();
        // A whole idle segment of exactly this size (a swappable allocation freed earlier, as
        // a training loop's next iteration makes again) is taken as it is: no new memory. Not
        // one a cached stitched range maps: swapping out would release physical memory that
        // range still maps.
        let idle = self
            .releasable_segments(|segment| {
                let owner = self.map.blocks[segment.first].owner;
                segment.tag == SHARED
                    && segment.size == rounded
                    && segment.pool == PoolKind::Large
                    && owner.is_none_or(|s| s == stream)
            })
            .next();
        if let Some(seg) = idle {
            let id = self.map.segments[seg].first;
            return Ok(self.take_swappable(id, rounded, size, stream));
        }
        let id = self.grow_own_segment(device, size, rounded, SHARED, 0)?;
        // The new segment is one free block of exactly `rounded` bytes: taken whole.
        Ok(self.take_swappable(id, rounded, size, stream))
    }

    /// Takes free block `id`, a whole segment of `rounded` bytes, as a swappable allocation.
    fn take_swappable(
        &mut self,
        id: BlockId,
        rounded: usize,
        size: usize,
        stream: Stream,
    ) -> DevicePtr {
        self.map.take_front(id, rounded, stream);
        let ptr = self.map.blocks[id].addr;
        self.register(ptr, Target::Block(id), rounded, stream, PoolKind::Large);
        self.set_requested(ptr, size);
        self.swappable.insert(ptr, Swappable::default());
        ptr
    }

    /// The swappable allocation at `ptr`, which must be swapped out (`swapped`) or resident.
    pub(super) fn swap_target(&self, ptr: DevicePtr, swapped: bool) -> Result<SwapInfo> {
        let Some(live) = self.live.get(&ptr) else {
            return Err(self.classify_unknown(ptr));
        };
        let Some(entry) = self.swappable.get(&ptr) else {
            return Err(Error::new(
                ErrorKind::InvalidPointer,
                format!("{ptr:#x} is not a swappable allocation"),
            ));
        };
        if entry.host.is_some() != swapped {
            let state = if swapped { "resident" } else { "swapped out" };
            return Err(Error::new(
                ErrorKind::InvalidState,
                format!("{ptr:#x} is already {state}"),
            ));
        }
        if entry.leaving.is_some() && !swapped {
            return Err(Error::new(
                ErrorKind::InvalidState,
                format!("{ptr:#x} is already on its way out"),
            ));
        }
        if self.routing > 0 {
            return Err(Error::new(
                ErrorKind::InvalidState,
                "cannot swap while requests are routed to a private pool (a capture may be underway)",
            ));
        }
        let Target::Block(block) = live.target else {
            return Err(Error::internal("a swappable allocation is stitched"));
        };
        Ok(SwapInfo {
            block,
            size: live.size,
            stream: live.stream,
            extra_streams: live.extra_streams.clone(),
        })
    }

    pub(super) fn swap_out(
        &mut self,
        device: &dyn crate::device::Device,
        ptr: DevicePtr,
    ) -> Result<()> {
        let t = self.swap_target(ptr, false)?;
        for &stream in std::iter::once(&t.stream).chain(&t.extra_streams) {
            device
                .synchronize_stream(stream)
                .map_err(|e| e.context("waiting for the work of a swappable allocation"))?;
        }
        let mut bytes = Vec::new();
        bytes.try_reserve_exact(t.size).map_err(|_| {
            Error::out_of_memory(format!("no host memory for {} swapped bytes", t.size))
        })?;
        bytes.resize(t.size, 0);
        // SAFETY: `bytes` holds `t.size` bytes and lives until the copy is known complete (or
        // is leaked below when that cannot be known).
        unsafe { device.copy_to_host(bytes.as_mut_ptr(), ptr, t.size, t.stream) }
            .map_err(|e| e.context("copying a swappable allocation to the host"))?;
        if let Err(err) = wait_for_copy(device, t.stream) {
            // The copy may still be writing into the buffer: it must never be freed.
            log::error!("glake: a swap-out copy cannot be waited for; leaking its buffer");
            std::mem::forget(bytes);
            return Err(err.context("waiting for a swap-out copy"));
        }
        self.complete_swap_out(device, ptr, t.block, t.size, HostBytes::Pageable(bytes));
        Ok(())
    }

    /// The bytes of the swappable allocation at `ptr` (block `block`, `size` bytes) are safe
    /// in `bytes`: from here it is swapped out whatever the teardown of its device memory does.
    pub(super) fn complete_swap_out(
        &mut self,
        device: &dyn crate::device::Device,
        ptr: DevicePtr,
        block: BlockId,
        size: usize,
        bytes: HostBytes,
    ) {
        let segment = self.map.blocks[block].segment;
        let layout = self.unmap_segment(device, segment);
        self.stats.swapped_bytes.add(size as i64);
        if let Some(entry) = self.swappable.get_mut(&ptr) {
            entry.host = Some(HostCopy { bytes, layout });
        }
    }

    /// Whether a teardown still to be retried unmaps part of `[va, va+size)`.
    pub(super) fn unmap_pending(&self, va: DevicePtr, size: usize) -> bool {
        let end = va + size as u64;
        self.zombies
            .iter()
            .flat_map(|z| &z.unmaps)
            .any(|&(at, len)| at < end && va < at + len as u64)
    }

    pub(super) fn swap_in(
        &mut self,
        device: &dyn crate::device::Device,
        ptr: DevicePtr,
    ) -> Result<()> {
        let t = self.swap_target(ptr, true)?;
        let chunks = self.swap_in_memory(device, ptr, t.size)?;
        let queued = match self.swappable.get(&ptr).and_then(|e| e.host.as_ref()) {
            // SAFETY: the host copy stays in place (the allocation stays swapped out) at least
            // until the copy is known complete.
            Some(host) => unsafe { device.copy_to_device(ptr, host.bytes.ptr(), t.size, t.stream) },
            None => Err(Error::internal("swapped allocation without its host copy")),
        };
        if let Err(err) = queued {
            // The copy was never queued: nothing runs on the new memory.
            self.bury(device, Zombie::mapped(ptr, &chunks));
            return Err(err.context("copying a swapped allocation back"));
        }
        if let Err(err) = wait_for_copy(device, t.stream) {
            // Neither the stream nor the device can be waited for: the copy may still write
            // into the new memory, which comes down only after a later wait for the device.
            self.zombies.push(Zombie::mapped(ptr, &chunks));
            return Err(err.context("copying a swapped allocation back"));
        }
        if let Some(bytes) = self.complete_swap_in(ptr, t.block, t.size, chunks) {
            self.recycle_host(bytes); // the copy was waited for
        }
        Ok(())
    }

    /// The swapped-out allocation at `ptr` (block `block`, `size` bytes) has its memory back
    /// in `chunks`: resident from here. Returns its host copy, for the caller to recycle once
    /// no queued copy reads it.
    pub(super) fn complete_swap_in(
        &mut self,
        ptr: DevicePtr,
        block: BlockId,
        size: usize,
        chunks: Vec<blocks::Chunk>,
    ) -> Option<HostBytes> {
        let segment = self.map.blocks[block].segment;
        self.remap_segment(segment, chunks);
        self.stats.swapped_bytes.add(-(size as i64));
        self.swappable
            .get_mut(&ptr)
            .and_then(|e| e.host.take())
            .map(|h| h.bytes)
    }

    /// Room for `size` bytes mapped again at `ptr` (a swap-in, a wake): its old mappings
    /// gone, cached memory given back past the soft limit or the cap; an out-of-memory error
    /// when the cap has no room.
    pub(super) fn prepare_remap(
        &mut self,
        device: &dyn crate::device::Device,
        ptr: DevicePtr,
        size: usize,
    ) -> Result<()> {
        self.clear_old_mappings(device, ptr, size)?;
        self.respect_soft_limit(device, size)?;
        if !self.fits_cap(size) {
            self.release_cached(device)?;
        }
        if !self.fits_cap(size) {
            return Err(self.remap_out_of_memory(device, size));
        }
        Ok(())
    }

    /// Makes sure no earlier mapping of `[ptr, ptr+size)` is still waiting to be unmapped
    /// before new ones take the range: a copy that could not be waited for may still use them,
    /// so the device is waited for first. An error when they still could not be unmapped.
    pub(super) fn clear_old_mappings(
        &mut self,
        device: &dyn crate::device::Device,
        ptr: DevicePtr,
        size: usize,
    ) -> Result<()> {
        if !self.unmap_pending(ptr, size) {
            return Ok(());
        }
        self.synchronize_all(device)?;
        let _ = self.retry_zombies(device);
        if self.unmap_pending(ptr, size) {
            return Err(Error::driver(format!(
                "the old mappings of {ptr:#x} could not be unmapped yet; try again later"
            )));
        }
        Ok(())
    }

    pub(super) fn remap_out_of_memory(
        &mut self,
        device: &dyn crate::device::Device,
        size: usize,
    ) -> Error {
        self.stats.num_ooms += 1;
        Error::out_of_memory(format!(
            "cannot map {size} bytes back on device {}: {} bytes reserved of a {} byte cap",
            device.ordinal(),
            self.reserved(),
            self.cap.bytes()
        ))
    }

    /// New physical memory for swapped-out `ptr`, mapped at its address with its access.
    pub(super) fn swap_in_memory(
        &mut self,
        device: &dyn crate::device::Device,
        ptr: DevicePtr,
        size: usize,
    ) -> Result<Vec<blocks::Chunk>> {
        let layout = match self.swappable.get(&ptr).and_then(|e| e.host.as_ref()) {
            Some(host) => host.layout.clone(),
            None => return Err(Error::internal("swapped allocation without its host copy")),
        };
        self.map_new_memory(device, ptr, size, &layout)
    }

    /// Frees a swapped-out allocation: its host copy goes, and its range is released.
    pub(super) fn free_swapped(
        &mut self,
        device: &dyn crate::device::Device,
        ptr: DevicePtr,
    ) -> Result<()> {
        let live = self.unregister(ptr)?;
        if let Some(host) = self.swappable.remove(&ptr).and_then(|e| e.host) {
            self.recycle_host(host.bytes);
        }
        let Target::Block(id) = live.target else {
            return Err(Error::internal("a swappable allocation is stitched"));
        };
        self.stats.swapped_bytes.add(-(live.size as i64));
        let segment = self.map.blocks[id].segment;
        // No device work can use it: swapping out waited for its streams.
        self.finish_free(live, None);
        self.release_segment(device, segment)
    }

    /// Checks the swappable allocations against the block map and the statistics.
    pub(super) fn check_swappable(&self) -> std::result::Result<(), String> {
        let mut swapped = 0usize;
        for (&ptr, entry) in self.swappable.iter() {
            let live = self
                .live
                .get(&ptr)
                .ok_or(format!("swappable {ptr:#x} is not live"))?;
            let Target::Block(id) = live.target else {
                return Err(format!("swappable {ptr:#x} is stitched"));
            };
            let block = &self.map.blocks[id];
            let segment = &self.map.segments[block.segment];
            if block.addr != ptr || block.size != segment.size || live.size != segment.size {
                return Err(format!("swappable {ptr:#x} does not fill its segment"));
            }
            match &entry.host {
                Some(host) => {
                    swapped += live.size;
                    if !segment.chunks().is_empty()
                        || host.bytes.len() != live.size
                        || host.layout.iter().sum::<usize>() != live.size
                    {
                        return Err(format!("swapped {ptr:#x} out of step"));
                    }
                }
                None => {
                    if segment.chunks().iter().map(|c| c.len).sum::<usize>() != live.size {
                        return Err(format!("resident swappable {ptr:#x} not backed"));
                    }
                }
            }
        }
        if swapped as i64 != self.stats.swapped_bytes.current {
            return Err(format!(
                "{swapped} bytes swapped out, stats say {}",
                self.stats.swapped_bytes.current
            ));
        }
        let empty = self
            .map
            .segments
            .iter()
            .filter(|(_, s)| s.chunks().is_empty() && !blocks::is_region(s.tag))
            .count();
        let held = self.swappable.values().filter(|e| e.host.is_some()).count();
        if empty != held {
            return Err(format!(
                "{empty} segments without memory, {held} swapped out"
            ));
        }
        Ok(())
    }
}

/// Waits for a copy queued on `stream`; when the stream cannot be waited for, the whole
/// device is (a failed wait must not leave a copy running into memory about to go).
pub(super) fn wait_for_copy(device: &dyn crate::device::Device, stream: Stream) -> Result<()> {
    device.synchronize_stream(stream).or_else(|err| {
        log::warn!("glake: waiting for a swap copy failed, waiting for the device: {err}");
        device.synchronize_device().map_err(|_| err)
    })
}
