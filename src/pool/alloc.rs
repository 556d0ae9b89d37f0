//! The allocation path: a request is checked, rounded to its size class, and served from the
//! small or the large pool, with the order of attempts the module documentation gives (reuse,
//! stitching, growth, taking back other streams' memory, releasing the cache). What each
//! attempt does lives with its concern; this file holds the order and the books of a new
//! allocation.

use super::blocks::{self, BlockId, PoolKind, Tag, SHARED};
use super::{sizes, Inner, Live, Target};
use crate::config::DefragLevel;
use crate::device::{DevicePtr, Stream};
use crate::error::{Error, ErrorKind, Result};

/// Refuses sizes no request may have: 0, and beyond any device.
pub(super) fn check_size(size: usize) -> Result<()> {
    if size == 0 {
        return Err(Error::invalid_argument("size 0 requested"));
    }
    if size > isize::MAX as usize {
        return Err(Error::invalid_argument(format!(
            "size {size} is beyond any device"
        )));
    }
    Ok(())
}

/// The largest idle large-pool segment given back to make room for a small-pool segment that
/// would raise the reserved peak, in small-pool segments (see `make_room_below_peak`).
const ROOM_FROM_IDLE_MOST: usize = 2;

impl Inner {
    pub(super) fn reserved(&self) -> usize {
        self.stats.reserved_bytes.all.current as usize
    }

    /// Allocates `size` bytes of `tag`'s pool for `stream`, booking `asked` (at most `size`)
    /// as requested.
    pub(super) fn malloc(
        &mut self,
        device: &dyn crate::device::Device,
        size: usize,
        asked: usize,
        stream: Stream,
        tag: Tag,
    ) -> Result<DevicePtr> {
        let (pool, rounded) = self.request_shape(size)?;
        // A plain request has just missed the parked blocks in `Pool::malloc_in`'s fast path
        // (asked before `admit` finishes frees that waited on events, as the fast path saw it;
        // after a relock for driver work, blocks parked meanwhile by other threads are left).
        let missed_parked = self.takes_plain_requests();
        self.admit(device, size, rounded)?;
        self.request = asked;
        let parked = match tag {
            SHARED if !missed_parked => self.unpark(rounded, asked, pool, stream),
            _ => None,
        };
        let ptr = match (parked, pool) {
            (Some(ptr), _) => Ok(Some(ptr)),
            (None, PoolKind::Small) => self.malloc_small(device, rounded, stream, tag),
            (None, PoolKind::Large) => self.malloc_large(device, rounded, stream, tag),
        };
        self.request = 0;
        let Some(ptr) = ptr? else {
            if self.planned.is_some() {
                return Err(super::unlocked::planned());
            }
            return Err(self.no_memory(device, size));
        };
        Ok(ptr)
    }

    /// The pool a request of `size` bytes comes from and the bytes it is handed (an error for
    /// a size no pool hands out).
    pub(super) fn request_shape(&self, size: usize) -> Result<(PoolKind, usize)> {
        check_size(size)?;
        Ok((
            sizes::pool_of(size, self.config.small_limit),
            sizes::round(size)?,
        ))
    }

    /// Serves `size` bytes (`asked` asked for) for `stream` from the free blocks of `tag`'s pool
    /// alone: no parked block, stitch, growth or wait, and no out-of-memory counted when none
    /// fits (None). PyTorch lends a pool's cached blocks this way to a request that ran out of
    /// memory elsewhere.
    pub(super) fn malloc_cached(
        &mut self,
        device: &dyn crate::device::Device,
        size: usize,
        asked: usize,
        stream: Stream,
        tag: Tag,
    ) -> Result<Option<DevicePtr>> {
        let (pool, rounded) = self.request_shape(size)?;
        if !self.pending.is_empty() {
            self.process_pending(device)?;
        }
        let Some(id) = self.map.best_fit(tag, pool, stream, rounded) else {
            return Ok(None);
        };
        self.request = asked;
        let ptr = self.allocate_block(id, rounded, stream, pool);
        self.request = 0;
        Ok(Some(ptr))
    }

    /// Checks a request of `size` bytes (`rounded` as the pool hands it out) against the
    /// device, and finishes the frees whose events have completed, before any search.
    pub(super) fn admit(
        &mut self,
        device: &dyn crate::device::Device,
        size: usize,
        rounded: usize,
    ) -> Result<()> {
        if rounded > self.total_memory {
            self.stats.num_ooms += 1;
            return Err(Error::out_of_memory(format!(
                "request of {size} bytes is larger than the device's {} bytes",
                self.total_memory
            )));
        }
        if !self.pending.is_empty() {
            self.process_pending(device)?;
        }
        Ok(())
    }

    /// The error of a request of `size` bytes that found no memory, counted as out of memory.
    pub(super) fn no_memory(&mut self, device: &dyn crate::device::Device, size: usize) -> Error {
        self.stats.num_ooms += 1;
        Error::out_of_memory(format!(
            "cannot allocate {size} bytes on device {}: {} bytes reserved of a {} byte cap, {} allocated",
            device.ordinal(),
            self.reserved(),
            self.cap.bytes(),
            self.stats.allocated_bytes.all.current
        ))
    }

    /// Allocates exactly `[addr, addr+size)` again for use on `stream`, from the segments of
    /// pool `tag`: the range must lie inside one free block usable on `stream`, and `size` be a
    /// size this pool hands out (it is not rounded again). Nothing changes when it does not:
    /// an `InvalidState` error for a range that is not such free memory, `InvalidArgument` for
    /// a size or address off the pool's unit. Nothing is created or mapped, and while a
    /// routing is active (a capture may be underway) no driver call is made. PyTorch's CUDA graph trees restore a graph pool's checkpoint with this: its
    /// allocations freed since must come back where the captured graphs expect them.
    pub(super) fn malloc_at(
        &mut self,
        device: &dyn crate::device::Device,
        addr: DevicePtr,
        size: usize,
        stream: Stream,
        tag: Tag,
    ) -> Result<DevicePtr> {
        check_size(size)?;
        if !self.pending.is_empty() {
            self.process_pending(device)?;
        }
        let not_free = |inner: &Self| {
            let owner = match inner.private_of_tag(tag) {
                Some(id) => format!("private pool {id:?}"),
                None => "the shared pool".to_string(),
            };
            Error::new(
                ErrorKind::InvalidState,
                format!(
                    "[{addr:#x}, {:#x}) is not free memory of {owner} usable on stream {:#x}",
                    addr.saturating_add(size as u64),
                    stream.0
                ),
            )
        };
        let Some(id) = self.map.block_containing(addr) else {
            return Err(not_free(self));
        };
        let segment = &self.map.segments[self.map.blocks[id].segment];
        let pool = segment.pool;
        let unit = sizes::MIN_BLOCK;
        if size % unit != 0 || (addr - segment.va) % unit as u64 != 0 {
            return Err(Error::invalid_argument(format!(
                "[{addr:#x}, +{size}) is not aligned to the pool's {unit} byte unit"
            )));
        }
        if segment.tag != tag {
            return Err(not_free(self));
        }
        let Some(id) = self.map.take_range(addr, size, stream) else {
            return Err(not_free(self));
        };
        self.register(addr, Target::Block(id), size, stream, pool);
        self.set_requested(addr, size);
        Ok(addr)
    }

    /// Records the bytes asked for by the new allocation at `ptr`, for allocations registered
    /// outside [`Inner::malloc`] (which books them in [`Inner::register`]).
    pub(super) fn set_requested(&mut self, ptr: DevicePtr, requested: usize) {
        if let Some(live) = self.live.get_mut(&ptr) {
            live.requested = requested;
            self.stats.requested_bytes.add(live.pool, requested as i64);
        }
    }

    /// Records a new allocation and its statistics, with the bytes of the request being served
    /// (`request`; 0 outside [`Inner::malloc`], where callers book them with `set_requested`).
    pub(super) fn register(
        &mut self,
        ptr: DevicePtr,
        target: Target,
        size: usize,
        stream: Stream,
        pool: PoolKind,
    ) {
        let parkable = self.may_park(target, pool);
        self.book_allocation(ptr, target, size, self.request, stream, pool, parkable);
        self.sync_split_stats();
    }

    /// The books of a new allocation of `size` bytes (`requested` asked for), for a block
    /// map that is in step with the split statistics.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn book_allocation(
        &mut self,
        ptr: DevicePtr,
        target: Target,
        size: usize,
        requested: usize,
        stream: Stream,
        pool: PoolKind,
        parkable: bool,
    ) {
        self.live.insert(
            ptr,
            Live {
                target,
                size,
                requested,
                stream,
                pool,
                extra_streams: Vec::new(),
                parkable,
            },
        );
        let stats = &mut self.stats;
        stats.requested_bytes.increase(pool, requested as u64);
        stats.allocation.increase(pool, 1);
        stats.allocated_bytes.increase(pool, size as u64);
        stats.active.increase(pool, 1);
        stats.active_bytes.increase(pool, size as u64);
        self.observe(super::AllocationEvent::Allocated { ptr, bytes: size });
    }

    /// Brings the inactive-split statistics of both pools in step with the block map (one
    /// operation, such as merging after a wait for all streams, may change both pools).
    pub(super) fn sync_split_stats(&mut self) {
        for pool in [PoolKind::Small, PoolKind::Large] {
            let now = self.map.inactive_split_by_pool[pool as usize];
            let (count, bytes) = match pool {
                PoolKind::Small => (
                    self.stats.inactive_split.small_pool.current,
                    self.stats.inactive_split_bytes.small_pool.current,
                ),
                PoolKind::Large => (
                    self.stats.inactive_split.large_pool.current,
                    self.stats.inactive_split_bytes.large_pool.current,
                ),
            };
            self.stats.inactive_split.add(pool, now.count - count);
            self.stats.inactive_split_bytes.add(pool, now.bytes - bytes);
        }
    }

    /// Takes free block `id` (split to `size`) as a plain allocation. A large allocation goes
    /// to the front or the back of the block, whichever leaves more whole chunks free: only
    /// whole chunks can be stitched, and a chunk shared with a live allocation cannot.
    fn allocate_block(
        &mut self,
        id: BlockId,
        size: usize,
        stream: Stream,
        pool: PoolKind,
    ) -> DevicePtr {
        let rest = self.map.blocks[id].size - size;
        let id = if rest < sizes::MIN_BLOCK {
            self.map.take(id, stream);
            id
        } else if pool == PoolKind::Large && self.back_leaves_more_chunks(id, size) {
            self.map.take_back(id, size, stream)
        } else {
            self.map.take_front(id, size, stream);
            id
        };
        let (ptr, size) = (self.map.blocks[id].addr, self.map.blocks[id].size);
        self.register(ptr, Target::Block(id), size, stream, pool);
        ptr
    }

    /// Whether taking `size` bytes from the back of free block `id` leaves more bytes of whole
    /// chunks free than taking them from its front.
    fn back_leaves_more_chunks(&self, id: BlockId, size: usize) -> bool {
        let block = &self.map.blocks[id];
        let segment = &self.map.segments[block.segment];
        let rest = block.size - size;
        let chunk_bytes = |at: DevicePtr| segment.whole_chunks(at, rest).map_or(0, |(_, len)| len);
        chunk_bytes(block.addr) > chunk_bytes(block.addr + size as u64)
    }

    /// The best-fitting free block for a request. When there is none, parked blocks go back to
    /// the free lists (merged, they may fit) and the search is made again; so they do when
    /// the block found would be split and parked blocks of sizes between might fit better.
    fn best_fit(
        &mut self,
        tag: Tag,
        pool: PoolKind,
        stream: Stream,
        size: usize,
    ) -> Option<BlockId> {
        let found = self.map.best_fit(tag, pool, stream, size);
        let retry = match found {
            // Parked blocks between the request and the block found might fit better.
            Some(id) => {
                let found = self.map.blocks[id].size;
                found > size && self.unpark_between(size, found - 1)
            }
            None => self.unpark_all(),
        };
        if !retry {
            return found;
        }
        self.map.best_fit(tag, pool, stream, size)
    }

    fn malloc_small(
        &mut self,
        device: &dyn crate::device::Device,
        size: usize,
        stream: Stream,
        tag: Tag,
    ) -> Result<Option<DevicePtr>> {
        for attempt in 0..3 {
            if let Some(id) = self.best_fit(tag, PoolKind::Small, stream, size) {
                return Ok(Some(self.allocate_block(id, size, stream, PoolKind::Small)));
            }
            let segment_size = sizes::small_segment(size, self.granularity)?;
            if attempt == 0 && tag == SHARED {
                // Only a saving: the request goes on without it.
                if let Err(err) = self.make_room_below_peak(device, segment_size) {
                    log::warn!("glake: giving back an idle segment failed: {err}");
                }
            }
            if attempt == 0
                && tag == SHARED
                && self.plan_segment(PoolKind::Small, segment_size, tag)
            {
                return Ok(None);
            }
            if let Some(id) = self.grow(device, PoolKind::Small, segment_size, tag)? {
                return Ok(Some(self.allocate_block(id, size, stream, PoolKind::Small)));
            }
            match attempt {
                0 => {
                    // Later attempts wait and release under the lock: planning is for the first.
                    self.planning = false;
                    self.reclaim_other_streams(device, stream)?
                }
                1 => {
                    self.stats.num_alloc_retries += 1;
                    self.release_cached(device)?;
                }
                _ => {}
            }
        }
        Ok(None)
    }

    /// Before a small-pool segment of `bytes` raises the peak of reserved memory: gives back
    /// the smallest idle (unparked) large-pool segment that makes room for it and is at most
    /// [`ROOM_FROM_IDLE_MOST`] times its size, if there is one. The small pool's growth late in
    /// a run (small allocations outliving the large ones) otherwise sets the peak while the
    /// large pool caches memory nobody uses: generate's trace set its peak so, with 8% of it
    /// live and 90% free in whole large-pool chunks. Larger segments given back were needed
    /// again and regrown elsewhere (opt13b +42 MiB, llama1b +26 MiB in replay).
    fn make_room_below_peak(
        &mut self,
        device: &dyn crate::device::Device,
        bytes: usize,
    ) -> Result<()> {
        let reserved = &self.stats.reserved_bytes.all;
        if reserved.current + (bytes as i64) <= reserved.peak || self.routing > 0 {
            return Ok(());
        }
        let smallest_idle = |inner: &Self| {
            inner
                .releasable_segments(|s| {
                    s.tag == SHARED
                        && s.pool == PoolKind::Large
                        && (bytes..=ROOM_FROM_IDLE_MOST * bytes).contains(&s.size)
                })
                .min_by_key(|&id| inner.map.segments[id].size)
        };
        if smallest_idle(self).is_none() {
            return Ok(());
        }
        // Nothing queued may still use the memory given back.
        self.synchronize_all(device)?;
        if let Some(id) = smallest_idle(self) {
            self.release_segment(device, id)?;
        }
        Ok(())
    }

    /// Bytes of a new segment for a shared-pool request of `size` bytes (`own`: its whole
    /// granules): room for the next requests of its run as well (see [`sizes::GrowthRun`])
    /// where that fits under both the cap and the soft limit, so that making room ahead never
    /// turns a request that fits into an out-of-memory error or a release of cached memory.
    fn run_segment(&self, size: usize, own: usize) -> Result<usize> {
        let repeats = self.growth_run.before(size);
        let packed = sizes::packed_segment(size, self.granularity, repeats)?;
        let room = self.fits_cap(packed) && !self.past_soft_limit(packed);
        Ok(if room { packed } else { own })
    }

    fn malloc_large(
        &mut self,
        device: &dyn crate::device::Device,
        size: usize,
        stream: Stream,
        tag: Tag,
    ) -> Result<Option<DevicePtr>> {
        // A private pool maps nothing twice: its graph replays use fixed addresses. A sleep
        // region stitches its own free blocks only (its ranges sleep and wake with it).
        let stitch = self.config.stitch && (tag == SHARED || blocks::is_region(tag));
        for attempt in 0..3 {
            if let Some(id) = self.best_fit(tag, PoolKind::Large, stream, size) {
                return Ok(Some(self.allocate_block(id, size, stream, PoolKind::Large)));
            }
            if stitch {
                if let Some(ptr) = self.reuse_stitched(size, stream, tag) {
                    return Ok(Some(ptr));
                }
                let eager = self.config.defrag_level == DefragLevel::BeforeGrow || attempt > 0;
                if eager {
                    if let Some(ptr) = self.stitch_new(device, size, stream, tag)? {
                        return Ok(Some(ptr));
                    }
                    if self.planned.is_some() {
                        return Ok(None);
                    }
                }
            }
            let own = sizes::large_segment(size, self.granularity)?;
            let segment_size = match (attempt, tag) {
                (0, SHARED) => self.run_segment(size, own)?,
                _ => own,
            };
            if attempt == 0
                && tag == SHARED
                && self.plan_segment(PoolKind::Large, segment_size, tag)
            {
                self.growth_run.record(size);
                return Ok(None);
            }
            let mut grown = self.grow(device, PoolKind::Large, segment_size, tag)?;
            if grown.is_none() && segment_size != own {
                // No room on the device for the run's next requests: the request's own.
                grown = self.grow(device, PoolKind::Large, own, tag)?;
            }
            if let Some(id) = grown {
                if tag == SHARED {
                    self.growth_run.record(size);
                }
                return Ok(Some(self.allocate_block(id, size, stream, PoolKind::Large)));
            }
            if stitch && self.config.defrag_level == DefragLevel::WhenFull && attempt == 0 {
                if let Some(ptr) = self.stitch_new(device, size, stream, tag)? {
                    return Ok(Some(ptr));
                }
                if self.planned.is_some() {
                    return Ok(None);
                }
            }
            match attempt {
                0 => {
                    // Later attempts wait and release under the lock: planning is for the first.
                    self.planning = false;
                    self.reclaim_other_streams(device, stream)?
                }
                1 => {
                    self.stats.num_alloc_retries += 1;
                    self.release_cached(device)?;
                }
                _ => {}
            }
        }
        Ok(None)
    }
}
