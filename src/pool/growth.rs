//! Growth and release of physical memory: creating segments under the cap, mapping ranges,
//! granting access, and tearing driver objects down again. Teardown steps that fail are kept
//! as zombies and retried, so a failed unmap neither loses memory nor leaves the books wrong.

use super::blocks::{self, BlockId, Chunk, PoolKind, SegmentId, Tag};
use super::events::{self, SegmentEvent, SegmentEventKind};
use super::Inner;
use crate::device::{DevicePtr, PhysHandle};
use crate::error::{Error, Result};

impl Inner {
    /// Whether `bytes` more physical memory fits under the cap.
    pub(super) fn fits_cap(&self, bytes: usize) -> bool {
        self.cap.fits(self.capped_bytes(), bytes)
    }

    /// Whether creating `bytes` more physical memory would go past the soft limit.
    pub(super) fn past_soft_limit(&self, bytes: usize) -> bool {
        self.soft_limit
            .is_some_and(|soft| self.capped_bytes().saturating_add(bytes) > soft)
    }

    /// Before creating `bytes` of physical memory past the soft limit, gives cached memory
    /// back (once per request; nothing when nothing is cached). Unlike the cap, the soft limit
    /// never makes a request fail.
    pub(super) fn respect_soft_limit(
        &mut self,
        device: &dyn crate::device::Device,
        bytes: usize,
    ) -> Result<()> {
        let over = |inner: &Self| inner.past_soft_limit(bytes);
        if over(self) {
            // Parked blocks hold memory that may make a segment idle.
            self.unpark_all();
        }
        if over(self) && self.routing == 0 && self.swaps_leaving() {
            // Memory on its way out comes back to the device first: wait for those copies.
            self.finish_swap_outs(device, true)?;
        }
        if over(self) && self.routing == 0 && self.has_cached_memory() {
            self.release_cached(device)?;
        }
        Ok(())
    }

    /// Whether [`Inner::release_cached`] would give anything back.
    fn has_cached_memory(&self) -> bool {
        self.stitch.idle_count() > 0 || self.releasable_segments(|_| true).next().is_some()
    }

    /// Creates a segment of `size` bytes from physical chunks (see [`blocks::chunk_sizes`] and
    /// [`blocks::chunk_limit`]), mapped at a new range with access set once. Returns its free
    /// block, or None when the cap or the device is full. Undoes every step if a later one
    /// fails.
    pub(super) fn grow(
        &mut self,
        device: &dyn crate::device::Device,
        pool: PoolKind,
        size: usize,
        tag: Tag,
    ) -> Result<Option<BlockId>> {
        self.grow_guarded(device, pool, size, tag, 0)
    }

    /// A segment of its own for one allocation of `size` bytes (`rounded`, a multiple of the
    /// granularity), reserving `guard` unmapped bytes after it: admitted against the cap,
    /// made, or made after the cache is given back; an out-of-memory error otherwise. Returns
    /// its one free block.
    pub(super) fn grow_own_segment(
        &mut self,
        device: &dyn crate::device::Device,
        size: usize,
        rounded: usize,
        tag: Tag,
        guard: usize,
    ) -> Result<BlockId> {
        self.admit(device, size, rounded)?;
        let mut grown = self.grow_guarded(device, PoolKind::Large, rounded, tag, guard)?;
        if grown.is_none() {
            self.stats.num_alloc_retries += 1;
            self.release_cached(device)?;
            grown = self.grow_guarded(device, PoolKind::Large, rounded, tag, guard)?;
        }
        grown.ok_or_else(|| self.no_memory(device, size))
    }

    /// As [`Inner::grow`], reserving `guard` more bytes after the segment that stay unmapped.
    pub(super) fn grow_guarded(
        &mut self,
        device: &dyn crate::device::Device,
        pool: PoolKind,
        size: usize,
        tag: Tag,
        guard: usize,
    ) -> Result<Option<BlockId>> {
        self.respect_soft_limit(device, size)?;
        if !self.fits_cap(size) {
            return Ok(None);
        }
        let sizes = self.segment_chunks(size, tag);
        let Some(chunks) = self.create_chunks(device, &sizes)? else {
            return Ok(None);
        };
        let layout = blocks::handle_layout(&chunks);
        let va = match map_range(device, &layout, guard, self.granularity, &self.access) {
            Ok(va) => va,
            Err((err, zombie)) => {
                self.zombies.extend(zombie);
                self.bury(device, Zombie::handles(&chunks));
                return Err(err.context("mapping a new segment"));
            }
        };
        Ok(Some(self.add_new_segment(
            device, va, size, chunks, pool, tag, guard,
        )))
    }

    /// The chunk lengths of a new segment of `size` bytes for `tag`: a region's as
    /// [`blocks::region_chunks`] says; others as [`blocks::chunk_limit`] says for the pool's
    /// size.
    pub(super) fn segment_chunks(&self, size: usize, tag: Tag) -> Vec<usize> {
        if blocks::is_region(tag) {
            return blocks::region_chunks(size);
        }
        blocks::chunk_sizes(size, self.granularity, self.chunk_limit(size))
    }

    /// The largest handle a new shared-pool segment of `size` bytes gets now.
    pub(super) fn chunk_limit(&self, size: usize) -> usize {
        self.chunk_limit_at(self.reserved(), size)
    }

    /// The same, were the pool holding `reserved` bytes.
    pub(super) fn chunk_limit_at(&self, reserved: usize, size: usize) -> usize {
        blocks::chunk_limit(
            reserved,
            size,
            self.granularity,
            self.config.max_chunk,
            self.config.chunk_divisor,
            self.config.segment_handles,
        )
    }

    /// Creates one physical chunk of each length in `sizes`, laid out one after another from
    /// offset 0. None when the device is out of memory; on any failure the chunks created so
    /// far are released (or kept as a zombie to retry).
    pub(super) fn create_chunks(
        &mut self,
        device: &dyn crate::device::Device,
        sizes: &[usize],
    ) -> Result<Option<Vec<Chunk>>> {
        let (result, zombie) = super::unlocked::create_chunks(device, sizes);
        self.zombies.extend(zombie);
        result
    }

    /// Grants device `peer` access to every range mapped now (segments and stitched ranges),
    /// and to every range mapped from now on.
    pub(super) fn grant_access(
        &mut self,
        device: &dyn crate::device::Device,
        peer: i32,
    ) -> Result<()> {
        if self.access.contains(&peer) {
            return Ok(());
        }
        let mut access = self.access.clone();
        access.push(peer);
        // (address, length, read-only): memory shared with other processes stays read-only.
        let mut ranges: Vec<(DevicePtr, usize, bool)> = Vec::new();
        for (_, s) in self.map.segments.iter() {
            // A swapped-out segment maps nothing; swapping in grants the access of that time.
            if s.chunks().is_empty() {
                continue;
            }
            if s.chunks()
                .iter()
                .any(|c| self.shared.contains_key(&c.handle))
            {
                ranges.extend(s.chunks().iter().map(|c| {
                    let shared = self.shared.contains_key(&c.handle);
                    (s.va + c.offset as u64, c.len, shared)
                }));
            } else {
                ranges.push((s.va, s.size, false));
            }
        }
        // A sleeping region's stitched ranges map nothing; its wake grants the access of then.
        ranges.extend(
            self.stitch
                .blocks
                .iter()
                .filter(|(_, s)| !s.asleep)
                .map(|(_, s)| (s.base(), s.mapped(), false)),
        );
        for (va, size, read_only) in ranges {
            if read_only {
                device.set_access_read_only(va, size, &access)?;
            } else {
                device.set_access(va, size, &access)?;
            }
        }
        self.access = access;
        Ok(())
    }

    /// Releases one idle segment: it leaves the books at once, and its mappings, handles and
    /// range are torn down now or, where a driver call fails, retried later.
    pub(super) fn release_segment(
        &mut self,
        device: &dyn crate::device::Device,
        segment: SegmentId,
    ) -> Result<()> {
        let zombie = self.retire_segment(device, segment)?;
        self.bury(device, zombie);
        Ok(())
    }

    /// Takes idle segment `segment` off the books: what is left is the driver's part, returned
    /// to be done now or outside the lock.
    pub(super) fn retire_segment(
        &mut self,
        device: &dyn crate::device::Device,
        segment: SegmentId,
    ) -> Result<Zombie> {
        let Some(removed) = self.map.remove_segment(segment) else {
            return Err(Error::internal("released a segment that is in use"));
        };
        events::record(|| SegmentEvent {
            kind: SegmentEventKind::Free,
            device: device.ordinal(),
            address: removed.va,
            size: removed.size,
            pool: self.private_of_tag(removed.tag),
        });
        self.stats.segment.add(removed.pool, -1);
        // A swapped-out segment holds no physical memory: only its chunks count.
        let physical: usize = removed.chunks().iter().map(|c| c.len).sum();
        self.stats
            .reserved_bytes
            .add(removed.pool, -(physical as i64));
        self.stats.num_device_free += removed.chunks().len() as i64;
        self.forget_shared(removed.chunks());
        self.sync_split_stats();
        Ok(Zombie {
            reservation: Some((removed.va, removed.size + removed.guard)),
            ..Zombie::mapped(removed.va, removed.chunks())
        })
    }

    /// Gives segment `segment`'s physical memory back to the device while its range stays
    /// reserved (a swap-out, a sleep); returns the chunk lengths it had.
    pub(super) fn unmap_segment(
        &mut self,
        device: &dyn crate::device::Device,
        segment: SegmentId,
    ) -> Vec<usize> {
        let s = &mut self.map.segments[segment];
        let chunks = s.set_chunks(Vec::new());
        let (va, pool) = (s.va, s.pool);
        self.forget_shared(&chunks);
        let physical: usize = chunks.iter().map(|c| c.len).sum();
        self.stats.reserved_bytes.add(pool, -(physical as i64));
        self.stats.num_device_free += chunks.len() as i64;
        self.bury(device, Zombie::mapped(va, &chunks));
        chunks.iter().map(|c| c.len).collect()
    }

    /// Segment `segment` holds physical memory again: `chunks`, mapped at its range (a
    /// swap-in, a wake).
    pub(super) fn remap_segment(&mut self, segment: SegmentId, chunks: Vec<Chunk>) {
        let s = &mut self.map.segments[segment];
        let physical: usize = chunks.iter().map(|c| c.len).sum();
        self.stats.reserved_bytes.add(s.pool, physical as i64);
        self.stats.num_device_alloc += chunks.len() as i64;
        s.set_chunks(chunks);
    }

    /// New physical memory of `layout` (chunk lengths) mapped at `va`, a range of `size` bytes
    /// whose memory was given back: room made within the cap first, nothing left behind on
    /// failure.
    pub(super) fn map_new_memory(
        &mut self,
        device: &dyn crate::device::Device,
        va: DevicePtr,
        size: usize,
        layout: &[usize],
    ) -> Result<Vec<Chunk>> {
        self.prepare_remap(device, va, size)?;
        let Some(chunks) = self.create_chunks(device, layout)? else {
            return Err(self.remap_out_of_memory(device, size));
        };
        let handles = blocks::handle_layout(&chunks);
        if let Err((err, mut zombie)) = map_at(device, va, &handles, &self.access) {
            zombie.handles = chunks.iter().map(|c| c.handle).collect();
            self.bury(device, zombie);
            return Err(err.context("mapping memory back"));
        }
        Ok(chunks)
    }

    /// Finishes tearing down a driver object; what fails is kept and retried later, so that a
    /// failed unmap neither loses track of memory nor leaves the books wrong.
    pub(super) fn bury(&mut self, device: &dyn crate::device::Device, mut zombie: Zombie) {
        if let Err(err) = zombie.finish(device) {
            log::warn!("glake: releasing driver memory failed, will retry: {err}");
            self.zombies.push(zombie);
        }
    }

    pub(super) fn retry_zombies(&mut self, device: &dyn crate::device::Device) -> Result<()> {
        let mut first_error = None;
        for mut zombie in std::mem::take(&mut self.zombies) {
            if let Err(err) = zombie.finish(device) {
                first_error.get_or_insert(err);
                self.zombies.push(zombie);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Frees all cached memory: idle stitched ranges and idle segments.
    pub(super) fn release_cached(&mut self, device: &dyn crate::device::Device) -> Result<()> {
        if self.routing > 0 {
            // A capture may be underway: waiting for the device would end it.
            return Ok(());
        }
        self.synchronize_all(device)?;
        if self.swaps_leaving() {
            self.finish_swap_outs(device, true)?;
        }
        self.drop_all_idle_stitched(device);
        let idle: Vec<SegmentId> = self.releasable_segments(|_| true).collect();
        for segment in idle {
            self.release_segment(device, segment)?;
        }
        self.retry_zombies(device)
    }

    /// Idle segments that `keep` selects and no stitched range maps. A range in use may map a
    /// free segment past the part its allocation takes (a smaller request served by a larger
    /// cached range): the driver would keep that memory until the range goes, so the segment
    /// stays cached, and counted, until then.
    /// Lazy: a caller that needs one looks no further.
    pub(super) fn releasable_segments<'a>(
        &'a self,
        keep: impl Fn(&blocks::Segment) -> bool + 'a,
    ) -> impl Iterator<Item = SegmentId> + 'a {
        self.map.idle_segments().into_iter().filter(move |&id| {
            let s = &self.map.segments[id];
            keep(s) && !self.stitched_over(s.va, s.size)
        })
    }

    /// Releases everything: called when the pool is dropped.
    pub(super) fn teardown(&mut self, device: &dyn crate::device::Device) -> Result<()> {
        // Nothing can capture once the pool is gone: private pools end here, and the frees
        // held back for them complete after the device wait that precedes every release.
        self.close_private();
        self.settle_regions(device);
        self.settle_guards();
        self.settle_swaps(device);
        for live in std::mem::take(&mut self.deferred) {
            self.finish_free(live, None);
        }
        let ptrs: Vec<DevicePtr> = self.live.keys().copied().collect();
        for ptr in ptrs {
            if let Some(live) = self.live.remove(&ptr) {
                self.stats.allocation.add(live.pool, -1);
                self.stats
                    .allocated_bytes
                    .add(live.pool, -(live.size as i64));
                self.finish_free(live, None);
            }
        }
        // Nothing can retry after this: a failed step (and all it left untried) gets one more
        // pass. Memory that may still be in use stays if that fails; the idle events go anyway.
        let released = self
            .release_cached(device)
            .or_else(|_| self.release_cached(device));
        self.drop_fences();
        for event in self.idle_events.drain(..) {
            undo(device.destroy_event(event));
        }
        released
    }
}

/// Driver objects still to be torn down: mappings to unmap, then handles to release and a
/// range to free. Each step that succeeds is dropped from the lists, so a retry resumes.
#[derive(Debug)]
pub(super) struct Zombie {
    pub(super) unmaps: Vec<(DevicePtr, usize)>,
    pub(super) handles: Vec<PhysHandle>,
    pub(super) reservation: Option<(DevicePtr, usize)>,
}

impl Zombie {
    /// The mappings and handles of `chunks`, mapped at `va` (the range stays reserved).
    pub(super) fn mapped(va: DevicePtr, chunks: &[Chunk]) -> Self {
        Zombie {
            unmaps: chunks
                .iter()
                .map(|c| (va + c.offset as u64, c.len))
                .collect(),
            handles: chunks.iter().map(|c| c.handle).collect(),
            reservation: None,
        }
    }

    pub(super) fn handles(chunks: &[Chunk]) -> Self {
        Zombie {
            unmaps: Vec::new(),
            handles: chunks.iter().map(|c| c.handle).collect(),
            reservation: None,
        }
    }

    pub(super) fn finish(&mut self, device: &dyn crate::device::Device) -> Result<()> {
        while let Some(&(va, len)) = self.unmaps.last() {
            device.unmap(va, len)?;
            self.unmaps.pop();
        }
        while let Some(&handle) = self.handles.last() {
            device.release_physical(handle)?;
            self.handles.pop();
        }
        if let Some((va, size)) = self.reservation {
            device.unreserve(va, size)?;
            self.reservation = None;
        }
        Ok(())
    }
}

/// Where each of `handles` (with its length) lies when they are mapped one after another from
/// `va`; mappings are unmapped one by one, as they were made.
pub(super) fn mappings<'a>(
    va: DevicePtr,
    handles: impl IntoIterator<Item = &'a (PhysHandle, usize)>,
) -> Vec<(DevicePtr, usize)> {
    let mut at = va;
    handles
        .into_iter()
        .map(|&(_, len)| {
            let mapping = (at, len);
            at += len as u64;
            mapping
        })
        .collect()
}

/// Reserves a range (aligned to `align`), maps `handles` (each with its length) one after
/// another into it, and grants access to the whole range in one call. On failure what was done
/// is undone, or handed back as a zombie to retry; the handles themselves stay with the caller.
pub(super) fn map_range(
    device: &dyn crate::device::Device,
    handles: &[(PhysHandle, usize)],
    guard: usize,
    align: usize,
    access: &[i32],
) -> std::result::Result<DevicePtr, (Error, Option<Zombie>)> {
    let size = handles.iter().map(|&(_, len)| len).sum::<usize>() + guard;
    let va = device.reserve(size, align).map_err(|e| (e, None))?;
    match map_at(device, va, handles, access) {
        Ok(()) => Ok(va),
        Err((err, mut zombie)) => {
            zombie.reservation = Some((va, size));
            match zombie.finish(device) {
                Ok(()) => Err((err, None)),
                Err(_) => Err((err, Some(zombie))),
            }
        }
    }
}

/// Maps `handles` (each with its length) one after another from `va`, inside a range already
/// reserved, and grants access to the whole of it in one call. On failure the mappings made
/// are handed back, as a zombie not yet run; the handles and the range stay with the caller.
pub(super) fn map_at(
    device: &dyn crate::device::Device,
    va: DevicePtr,
    handles: &[(PhysHandle, usize)],
    access: &[i32],
) -> std::result::Result<(), (Error, Zombie)> {
    let size = handles.iter().map(|&(_, len)| len).sum();
    let mut mapped = Vec::with_capacity(handles.len());
    let mut failure = None;
    for ((at, len), &(handle, _)) in mappings(va, handles).into_iter().zip(handles) {
        if let Err(err) = device.map(at, len, handle, 0) {
            failure = Some(err);
            break;
        }
        mapped.push((at, len));
    }
    if failure.is_none() {
        // One grant over the whole range. Its cost is per handle; granting parts from several
        // threads, or one handle per call, was measured slower on an H200.
        match device.set_access(va, size, access) {
            Ok(()) => return Ok(()),
            Err(err) => failure = Some(err.context("setting access")),
        }
    }
    let zombie = Zombie {
        unmaps: mapped,
        handles: Vec::new(),
        reservation: None,
    };
    let err = failure.unwrap_or_else(|| Error::internal("mapping failed without an error"));
    Err((err, zombie))
}

/// Logs the failure of a clean-up step taken after an earlier failure (the first error is the
/// one reported).
fn undo(result: Result<()>) {
    if let Err(err) = result {
        log::error!("glake: clean-up after a failed driver call also failed: {err}");
    }
}
