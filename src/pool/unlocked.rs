//! New segments made outside the pool's lock. Creating and mapping physical memory takes the
//! driver milliseconds; while it runs, other threads' mallocs and frees must not wait. A
//! malloc that needs a new segment on its first attempt plans it under the lock (its bytes
//! held against the cap, so other threads see them as taken), makes it with the lock
//! released, and adopts it under the lock again, then allocates as usual (from the new
//! segment, or from memory another thread freed meanwhile; the segment is cached either
//! way). Anything unusual (a capture underway, the soft limit, the cap, a failure) takes the
//! ordinary path, with every attempt made under the lock.

use super::blocks::{self, Chunk, PoolKind, Tag};
use super::events::{self, SegmentEvent, SegmentEventKind};
use super::growth::{map_range, Zombie};
use super::Inner;
use crate::device::{Device, DevicePtr};
use crate::error::{Error, ErrorKind, Result};

/// Driver work a malloc left to be done outside the lock.
#[derive(Debug)]
pub(super) enum Planned {
    /// A new segment, to allocate from once it is booked.
    Segment(GrowthPlan),
    /// A stitch whose pieces are taken, to be mapped and registered.
    Stitch(super::stitching::StitchJob),
}

/// A segment to make outside the lock.
#[derive(Debug)]
pub(super) struct GrowthPlan {
    pool: PoolKind,
    tag: Tag,
    size: usize,
    chunk_sizes: Vec<usize>,
    access: Vec<i32>,
    granularity: usize,
}

/// What making a planned segment gave: its memory mapped at `va`, none (the device is
/// full), or an error, with what could not be torn down.
pub(super) struct Made {
    pub(super) result: Result<Option<(DevicePtr, Vec<Chunk>)>>,
    pub(super) leftovers: Vec<Zombie>,
}

/// The error that carries a planned growth out of the allocation path to the pool, which
/// never lets it reach a caller.
pub(super) fn planned() -> Error {
    Error::new(
        ErrorKind::Internal,
        "a segment is planned, to be made outside the lock",
    )
}

impl GrowthPlan {
    /// A segment of `size` bytes for `pool`/`tag`, laid out as `inner` makes its segments.
    pub(super) fn new(inner: &Inner, pool: PoolKind, size: usize, tag: Tag) -> GrowthPlan {
        GrowthPlan {
            pool,
            tag,
            size,
            chunk_sizes: inner.segment_chunks(size, tag),
            access: inner.access.clone(),
            granularity: inner.granularity,
        }
    }

    pub(super) fn size(&self) -> usize {
        self.size
    }

    /// Creates the chunks and maps them at a new range, without the pool's lock.
    pub(super) fn make(&self, device: &dyn Device) -> Made {
        let mut leftovers = Vec::new();
        let chunks = match create_chunks(device, &self.chunk_sizes) {
            (Ok(Some(chunks)), _) => chunks,
            (result, zombie) => {
                leftovers.extend(zombie);
                return Made {
                    result: result.map(|_| None),
                    leftovers,
                };
            }
        };
        let layout = blocks::handle_layout(&chunks);
        let result = match map_range(device, &layout, 0, self.granularity, &self.access) {
            Ok(va) => Ok(Some((va, chunks))),
            Err((err, zombie)) => {
                leftovers.extend(zombie);
                let mut handles = Zombie::handles(&chunks);
                if handles.finish(device).is_err() {
                    leftovers.push(handles);
                }
                Err(err.context("mapping a new segment"))
            }
        };
        Made { result, leftovers }
    }
}

/// Creates one physical chunk of each length in `sizes`, laid out from offset 0. Ok(None)
/// when the device is out of memory. On any failure the chunks made so far are released; what
/// cannot be released comes back as a zombie.
pub(super) fn create_chunks(
    device: &dyn Device,
    sizes: &[usize],
) -> (Result<Option<Vec<Chunk>>>, Option<Zombie>) {
    let mut chunks: Vec<Chunk> = Vec::with_capacity(sizes.len());
    let mut offset = 0;
    for &len in sizes {
        match device.create_physical(len) {
            Ok(handle) => chunks.push(Chunk {
                handle,
                offset,
                len,
            }),
            Err(err) => {
                let mut zombie = Zombie::handles(&chunks);
                let zombie = zombie.finish(device).is_err().then_some(zombie);
                if err.kind() == ErrorKind::OutOfMemory {
                    return (Ok(None), zombie);
                }
                return (Err(err.context("creating physical memory")), zombie);
            }
        }
        offset += len;
    }
    (Ok(Some(chunks)), None)
}

impl Inner {
    /// In planning mode (a malloc of [`super::Pool::malloc_in`]), on a request's first
    /// attempt: plans a segment of `size` bytes for `pool`/`tag` instead of making it, when
    /// nothing asks for the lock to stay held. Returns whether it did.
    pub(super) fn plan_segment(&mut self, pool: PoolKind, size: usize, tag: Tag) -> bool {
        if !self.planning {
            return false;
        }
        let over_soft = self.past_soft_limit(size);
        if !self.planning || self.routing > 0 || over_soft || !self.fits_cap(size) {
            return false;
        }
        self.growing += size;
        self.planned = Some(Planned::Segment(GrowthPlan::new(self, pool, size, tag)));
        true
    }

    /// Books a planned segment that was made (or not): a new free segment of the pool, or
    /// its bytes given back to the cap. Leftovers of a failure are kept to retry.
    pub(super) fn adopt(
        &mut self,
        device: &dyn Device,
        plan: GrowthPlan,
        made: Made,
    ) -> Result<()> {
        self.growing -= plan.size;
        self.zombies.extend(made.leftovers);
        let Some((va, chunks)) = made.result? else {
            return Ok(());
        };
        if plan.access != self.access {
            // A peer was granted access meanwhile: the allocation makes its memory again under
            // the lock rather than book memory with the wrong access.
            let zombie = Zombie {
                reservation: Some((va, plan.size)),
                ..Zombie::mapped(va, &chunks)
            };
            self.discard(device, zombie);
            return Ok(());
        }
        self.add_new_segment(device, va, plan.size, chunks, plan.pool, plan.tag, 0);
        Ok(())
    }

    /// Tears down memory made outside the lock that is not booked after all: now, or, while a
    /// capture may be underway (unmapping is not allowed then), when the cache is next
    /// released.
    pub(super) fn discard(&mut self, device: &dyn Device, zombie: Zombie) {
        if self.routing > 0 {
            self.zombies.push(zombie);
        } else {
            self.bury(device, zombie);
        }
    }

    /// Puts a segment just made on the books, with its statistics and event; returns its
    /// free block.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn add_new_segment(
        &mut self,
        device: &dyn Device,
        va: DevicePtr,
        size: usize,
        chunks: Vec<Chunk>,
        pool: PoolKind,
        tag: Tag,
        guard: usize,
    ) -> blocks::BlockId {
        let count = chunks.len() as i64;
        let (segment, block) = self.map.add_segment(va, size, chunks, pool, tag);
        self.map.segments[segment].guard = guard;
        events::record(|| SegmentEvent {
            kind: SegmentEventKind::Alloc,
            device: device.ordinal(),
            address: va,
            size,
            pool: self.private_of_tag(tag),
        });
        self.stats.segment.add(pool, 1);
        self.stats.reserved_bytes.add(pool, size as i64);
        self.stats.num_device_alloc += count;
        block
    }
}
