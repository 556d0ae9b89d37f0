//! Segments that grow at their end. A large request carved out of a new segment leaves the
//! rest of the segment's last granule free. A rest under `small_limit` is stranded: large
//! requests are larger, small ones come from the small pool, and stitching maps only whole
//! handles (on a MoE run, hundreds of MiB sat in such rests). So every segment of the shared
//! large pool reserves address space after it ([`MAX_HEADROOM`]), and a request that needs new
//! memory maps it right after a segment that ends in such a rest, when that creates fewer
//! granules than a segment of its own: the request then covers the rest, as it would in one
//! growing range (PyTorch's expandable segments). Like a new segment, the driver work is done
//! outside the lock in planning mode; the segment is marked meanwhile so that nothing else
//! grows, trims or releases it. `empty_cache` takes whole free chunks off segments' ends again;
//! the out-of-memory path does not (it releases idle segments, as PyTorch's allocator does,
//! and a request can stitch those chunks instead).

use super::blocks::{self, BlockId, Chunk, PoolKind, SegmentId, Tag, SHARED};
use super::events::{self, SegmentEvent, SegmentEventKind};
use super::growth::{map_at, Zombie};
use super::unlocked::{create_chunks, Planned};
use super::Inner;
use crate::device::{align_up, Device, DevicePtr, Stream};
use crate::error::Result;

/// Most address space reserved, unmapped, after a segment of the shared large pool for it to
/// grow into: as much as the segment's own size up to this, so the pool's address space stays
/// within twice its memory (a GiB per segment ran a process out of address space under
/// valgrind). Replaying the recorded traces, 128 MiB kept within 0.2% of 1 GiB's peak
/// reserved memory; a segment that has used up its headroom simply grows no more.
pub(super) const MAX_HEADROOM: usize = 128 << 20;

/// Where a request would extend a segment: the free block ending it, and the bytes to map.
#[derive(Debug, Clone, Copy)]
pub(super) struct Extension {
    pub(super) block: BlockId,
    pub(super) bytes: usize,
}

/// An extension to map outside the lock: new chunks of `chunk_sizes` at `at`, the end of
/// `segment`, which stays marked `extending` until the plan is booked.
#[derive(Debug)]
pub(super) struct ExtendPlan {
    segment: SegmentId,
    at: DevicePtr,
    bytes: usize,
    chunk_sizes: Vec<usize>,
    access: Vec<i32>,
}

/// What mapping a planned extension gave: its chunks (offsets from `at`), none (the device
/// is full) or an error, with what could not be torn down.
pub(super) struct Extended {
    result: Result<Option<Vec<Chunk>>>,
    leftovers: Vec<Zombie>,
}

impl ExtendPlan {
    /// Creates the chunks and maps them after the segment, without the pool's lock.
    pub(super) fn make(&self, device: &dyn Device) -> Extended {
        let (result, zombie) = create_chunks(device, &self.chunk_sizes);
        let mut leftovers: Vec<Zombie> = zombie.into_iter().collect();
        let result = match result {
            Ok(Some(chunks)) => map_chunks(device, self.at, chunks, &self.access)
                .map_err(|(err, zombie)| {
                    leftovers.extend(zombie);
                    err
                })
                .map(Some),
            other => other.map(|_| None),
        };
        Extended { result, leftovers }
    }
}

/// Maps `chunks` side by side from `at`, granting `access`; on failure everything is undone
/// or handed back as a zombie.
fn map_chunks(
    device: &dyn Device,
    at: DevicePtr,
    chunks: Vec<Chunk>,
    access: &[i32],
) -> std::result::Result<Vec<Chunk>, (crate::error::Error, Option<Zombie>)> {
    match map_at(device, at, &blocks::handle_layout(&chunks), access) {
        Ok(()) => Ok(chunks),
        Err((err, mut zombie)) => {
            zombie.handles = chunks.iter().map(|c| c.handle).collect();
            let zombie = zombie.finish(device).is_err().then_some(zombie);
            Err((err.context("mapping memory after a segment"), zombie))
        }
    }
}

impl Inner {
    /// The headroom a new segment of `pool`/`tag` reserves.
    pub(super) fn headroom_for(&self, pool: PoolKind, tag: Tag, size: usize) -> usize {
        if pool == PoolKind::Large && tag == SHARED && !self.config.guard {
            size.min(MAX_HEADROOM)
        } else {
            0
        }
    }

    /// The best segment end to grow for a request of `size` bytes on `stream`: among free
    /// blocks of at most `small_limit` bytes that end a segment, the one that saves the most
    /// granules against a segment of the request's own (ties: the least left over), if any
    /// saves one and fits its segment's headroom and the cap.
    pub(super) fn find_extension(
        &self,
        size: usize,
        stream: Stream,
        tag: Tag,
    ) -> Option<Extension> {
        if tag != SHARED || self.config.guard {
            return None;
        }
        let g = self.granularity;
        let own = align_up(size, g).ok()?;
        let mut best: Option<(usize, usize, Extension)> = None;
        for (free, block) in self.map.free_tails(tag, stream) {
            if free > self.config.small_limit || free >= size || self.map.blocks[block].parked {
                continue;
            }
            let Ok(bytes) = align_up(size - free, g) else {
                continue;
            };
            let segment = &self.map.segments[self.map.blocks[block].segment];
            let growable = !segment.extending && !segment.chunks().is_empty();
            if bytes >= own || bytes > segment.headroom || !growable {
                continue;
            }
            let saved = own - bytes;
            let left = free + bytes - size;
            let better = best.is_none_or(|(s, l, _)| saved > s || (saved == s && left < l));
            if better {
                best = Some((saved, left, Extension { block, bytes }));
            }
        }
        let (_, _, found) = best?;
        self.fits_cap(found.bytes).then_some(found)
    }

    /// In planning mode, on a request's first attempt: plans extension `ext` instead of
    /// making it, as [`Inner::plan_segment`] does for a segment. Returns whether it did.
    pub(super) fn plan_extension(&mut self, ext: Extension) -> bool {
        let over_soft = self
            .soft_limit
            .is_some_and(|soft| self.capped_bytes().saturating_add(ext.bytes) > soft);
        if !self.planning || self.routing > 0 || over_soft {
            return false;
        }
        let id = self.map.blocks[ext.block].segment;
        let chunk_sizes = self.segment_chunks(ext.bytes, SHARED);
        let segment = &mut self.map.segments[id];
        segment.extending = true;
        let at = segment.va + segment.size as u64;
        self.growing += ext.bytes;
        self.planned = Some(Planned::Extend(ExtendPlan {
            segment: id,
            at,
            bytes: ext.bytes,
            chunk_sizes,
            access: self.access.clone(),
        }));
        true
    }

    /// Books a planned extension that was mapped (or not), under the lock again.
    pub(super) fn adopt_extension(
        &mut self,
        device: &dyn Device,
        plan: ExtendPlan,
        made: Extended,
    ) -> Result<()> {
        self.growing -= plan.bytes;
        self.map.segments[plan.segment].extending = false;
        self.zombies.extend(made.leftovers);
        let Some(chunks) = made.result? else {
            return Ok(());
        };
        if plan.access != self.access {
            // A peer was granted access meanwhile: not booked with the wrong access (the
            // allocation makes its memory again under the lock).
            self.discard(device, Zombie::mapped(plan.at, &chunks));
            return Ok(());
        }
        self.book_extension(device, plan.segment, chunks);
        Ok(())
    }

    /// Grows a segment's end for a request of `size` bytes on `stream` (about `bytes`, as
    /// [`Inner::find_extension`] found), under the lock; returns the free block that now ends
    /// the segment, or None when no segment can grow or the device is full.
    pub(super) fn extend(
        &mut self,
        device: &dyn Device,
        bytes: usize,
        size: usize,
        stream: Stream,
        tag: Tag,
    ) -> Result<Option<BlockId>> {
        self.respect_soft_limit(device, bytes)?;
        // Giving the cache back may have released the segment found before: found again.
        let Some(ext) = self.find_extension(size, stream, tag) else {
            return Ok(None);
        };
        let id = self.map.blocks[ext.block].segment;
        let sizes = self.segment_chunks(ext.bytes, SHARED);
        let Some(chunks) = self.create_chunks(device, &sizes)? else {
            return Ok(None);
        };
        let segment = &self.map.segments[id];
        let at = segment.va + segment.size as u64;
        let chunks = match map_chunks(device, at, chunks, &self.access) {
            Ok(chunks) => chunks,
            Err((err, zombie)) => {
                self.zombies.extend(zombie);
                return Err(err);
            }
        };
        Ok(Some(self.book_extension(device, id, chunks)))
    }

    /// Puts `chunks` (offsets from the segment's end), just mapped there, on segment `id`'s
    /// books, with their statistics and event; returns the free block ending the segment.
    fn book_extension(
        &mut self,
        device: &dyn Device,
        id: SegmentId,
        mut chunks: Vec<Chunk>,
    ) -> BlockId {
        let segment = &self.map.segments[id];
        let (at, base) = (segment.va + segment.size as u64, segment.size);
        let bytes: usize = chunks.iter().map(|c| c.len).sum();
        for c in &mut chunks {
            c.offset += base;
        }
        let count = chunks.len() as i64;
        let tail = self.map.extend_segment(id, chunks);
        events::record(|| SegmentEvent {
            kind: SegmentEventKind::Map,
            device: device.ordinal(),
            address: at,
            size: bytes,
            pool: None,
        });
        self.stats.reserved_bytes.add(PoolKind::Large, bytes as i64);
        self.stats.num_device_alloc += count;
        self.sync_split_stats();
        tail
    }

    /// Unmaps and releases the whole free chunks at the end of every shared segment that
    /// holds allocations (idle segments are released whole), the range kept for growing
    /// again.
    pub(super) fn trim_segments(&mut self, device: &dyn Device) {
        let ids: Vec<SegmentId> = self
            .map
            .segments
            .iter()
            .filter(|(_, s)| {
                s.tag == SHARED && s.pool == PoolKind::Large && s.headroom > 0 && !s.extending
            })
            .map(|(id, _)| id)
            .collect();
        for id in ids {
            let Some(chunks) = self.map.trim_segment(id) else {
                continue;
            };
            let va = self.map.segments[id].va;
            let bytes: usize = chunks.iter().map(|c| c.len).sum();
            let at = va + chunks.first().map_or(0, |c| c.offset) as u64;
            events::record(|| SegmentEvent {
                kind: SegmentEventKind::Unmap,
                device: device.ordinal(),
                address: at,
                size: bytes,
                pool: None,
            });
            self.stats
                .reserved_bytes
                .add(PoolKind::Large, -(bytes as i64));
            self.stats.num_device_free += chunks.len() as i64;
            self.forget_shared(&chunks);
            self.bury(device, Zombie::mapped(va, &chunks));
        }
        self.sync_split_stats();
    }
}
