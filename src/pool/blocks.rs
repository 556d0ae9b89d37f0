//! Segments and blocks: the bookkeeping of the caching allocator, on addresses and sizes only.
//!
//! A segment is a few physical handles (chunks) mapped side by side at its own virtual range.
//! Its bytes are covered by a doubly linked list of blocks in address order; a block is free,
//! allocated, or pending (freed but waiting for events of other streams). Free blocks sit in
//! best-fit sets keyed by pool and owner stream, and neighbours with the same owner coalesce.
//! No driver is called here.

use std::collections::BTreeMap;
use std::iter::Peekable;

use slab::Slab;

use super::bins::{Entry, SizeBins, SizeClasses, Slot};
use crate::device::{DevicePtr, PhysHandle, Stream};

pub type SegmentId = usize;
pub type BlockId = usize;

/// Which pool a segment belongs to: the shared pool, or a private pool (a CUDA graph's memory,
/// which only allocations routed to that pool may use, and which is never released or
/// stitched while the pool exists).
pub type Tag = u32;
/// The shared pool.
pub const SHARED: Tag = 0;
/// Tags from here on name sleep regions (private pools count up from 1).
pub const FIRST_REGION: Tag = 1 << 31;
/// Guard-page mode's segments: one allocation each, its end against an unmapped range.
pub const GUARDED: Tag = FIRST_REGION - 1;
/// Segments holding memory shared read-only with other processes: no request is served from
/// their free blocks (a write there would reach the other processes' data); they go back to
/// the device once wholly free.
pub const READ_ONLY: Tag = FIRST_REGION - 2;
/// Segments of private pools released since the device was last waited for as a whole: a
/// graph replay queued before the release may still use their memory, so no request is served
/// from them until the pool has waited for the whole device, which then joins them to the
/// shared pool (PyTorch, too, hands a released graph pool's memory back only through a
/// device-wide wait, cudaFree's).
pub const RELEASED: Tag = FIRST_REGION - 3;

/// Whether `tag` names a sleep region: memory kept apart so it can sleep and wake as one, but
/// cached and released like the shared pool's.
pub fn is_region(tag: Tag) -> bool {
    tag >= FIRST_REGION
}

/// The small pool (requests up to `small_limit`) or the large pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PoolKind {
    Small = 0,
    Large = 1,
}

/// Which stream may reuse a free block at once. `None`: any stream (its last use is known to be
/// complete); `Some(s)`: only `s`, since work queued on `s` may still touch it.
pub type Owner = Option<Stream>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    Free,
    Allocated,
    /// Freed by the user, waiting for events on other streams before it becomes free.
    Pending,
}

/// One physical handle of a segment, mapped `offset` bytes into it. CUDA maps only whole
/// handles, so chunk boundaries are the only places where a stitch may cut a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub handle: PhysHandle,
    pub offset: usize,
    pub len: usize,
}

/// Chunks per segment aimed at: few enough to make mapping cheap (CUDA's access grant costs
/// about the same per handle whatever its size), many enough that a block split by an
/// allocation still holds whole chunks a stitch can use.
const CHUNKS_PER_SEGMENT: usize = 8;

fn floor_power_of_two(n: usize) -> usize {
    1usize << (usize::BITS - 1 - n.max(1).leading_zeros())
}

/// Segments from this size on get at most `Config::segment_handles` chunks, so that a segment
/// of several GiB made early in a run (before `reserved` is large) does not come in thousands
/// of small handles, each costing every stitch that maps it an access grant. Applied to every
/// size, the bound also coarsened the handles of a small pool's mid-sized segments, whose
/// partial handles a stitch cannot use: vision's peak on an H200 rose from 8.39 to 8.41 GiB.
const FEW_CHUNKS_FROM: usize = 512 << 20;

/// The largest chunk a pool holding `reserved` bytes gives a new segment of `size` bytes: a
/// power of two between `unit` and `max_chunk`, at most `1/divisor` of `reserved` (see
/// `Config::chunk_divisor`) unless a segment from [`FEW_CHUNKS_FROM`] on would then have more
/// than `most_chunks` chunks.
pub fn chunk_limit(
    reserved: usize,
    size: usize,
    unit: usize,
    max_chunk: usize,
    divisor: usize,
    most_chunks: usize,
) -> usize {
    let by_segment = if size >= FEW_CHUNKS_FROM {
        size / most_chunks.max(1)
    } else {
        0
    };
    floor_power_of_two((reserved / divisor.max(1)).max(by_segment))
        .min(max_chunk)
        .max(unit)
}

/// The chunk lengths of a new segment of `size` bytes (a multiple of `unit`, a power of two):
/// equal power-of-two chunks between `unit` and `limit`, then one chunk for the rest.
pub fn chunk_sizes(size: usize, unit: usize, limit: usize) -> Vec<usize> {
    let chunk = floor_power_of_two(size / CHUNKS_PER_SEGMENT)
        .min(limit)
        .max(unit);
    let mut sizes = vec![chunk; size / chunk];
    if size % chunk != 0 {
        sizes.push(size % chunk);
    }
    sizes
}

/// The chunk lengths of a sleep region's segment of `size` bytes: one handle. Mapping,
/// granting access and unmapping cost CUDA about the same per handle whatever its size, so
/// sleep and wake run fastest on the fewest handles (a 7B model's weights in chunks of at most
/// 1/8 of each segment were 2113 handles, whose maps and unmaps took most of each sleep and
/// wake). A stitch inside a region therefore takes whole free segments of it.
pub fn region_chunks(size: usize) -> Vec<usize> {
    vec![size]
}

#[derive(Debug, Clone)]
pub struct Segment {
    pub va: DevicePtr,
    pub size: usize,
    /// The physical handles behind the range, in address order, covering it exactly (none
    /// while its memory is given back). Read with [`Segment::chunks`] and replaced with
    /// [`Segment::set_chunks`], so that `unit` follows them.
    chunks: Vec<Chunk>,
    /// The chunks' length when they are laid out evenly (chunk `k` at offset `k * unit`, all of
    /// that length but the last, which is no longer and ends the segment), else 0. Whole-chunk
    /// lookups, made on every large allocation, then need no access to the chunk list.
    unit: usize,
    pub pool: PoolKind,
    pub tag: Tag,
    pub first: BlockId,
    /// Bytes reserved after the segment and never mapped (guard-page mode), freed with it.
    pub guard: usize,
    /// The [`BlockMap::epoch`] of the segment's last free: work queued before it may still use
    /// the segment until a fence of a later epoch has passed (see `pool::gather`).
    pub freed_at: u64,
    /// The epoch the segment moved to its pool in (0: made there). Work of the pool it left (a
    /// graph's replays, on any stream) may still use it until the device is waited for.
    pub joined_at: u64,
}

#[derive(Debug, Clone)]
pub struct Block {
    pub addr: DevicePtr,
    pub size: usize,
    pub segment: SegmentId,
    pub prev: Option<BlockId>,
    pub next: Option<BlockId>,
    pub state: BlockState,
    pub owner: Owner,
    /// Allocated in the map but parked (see `parked.rs`): a neighbour's free takes it back
    /// to the free lists so that the two merge.
    pub parked: bool,
    /// Where the block sits in its free bins while free (small pool).
    free_slot: Slot,
    /// The free set (index into `BlockMap::free`) the block sits in while free, or last sat
    /// in: unlinking needs no search, and linking tries it first.
    free_set: u32,
}

/// Change in the free-but-split ("inactive split") accounting caused by one operation.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SplitDelta {
    pub count: i64,
    pub bytes: i64,
}

#[derive(Debug, Default)]
pub struct BlockMap {
    pub segments: Slab<Segment>,
    pub blocks: Slab<Block>,
    /// Every segment by start address, for lookups of pointers. Blocks are found from their
    /// segment's list: indexing every block would cost an update on every split and merge.
    by_addr: BTreeMap<DevicePtr, SegmentId>,
    /// Best-fit indexes, one per (tag, pool, owner); few streams and tags, so a short list
    /// beats a map.
    free: Vec<(FreeKey, FreeIndex)>,
    /// Free blocks that are part of a segment split into several blocks.
    pub inactive_split: SplitDelta,
    /// The same, per pool (indexed by `PoolKind as usize`).
    pub inactive_split_by_pool: [SplitDelta; 2],
    /// Stamped on a segment at each free; fences on the streams advance it (see
    /// `pool::gather`).
    pub epoch: u64,
}

type FreeKey = (Tag, PoolKind, Owner);

/// The free blocks of one (tag, pool, owner): the small pool's in exact-size bins, the large
/// pool's in size classes, which stitching walks from their large end (see [`super::bins`]).
#[derive(Debug)]
enum FreeIndex {
    Classes(Box<SizeClasses>),
    Binned(Box<SizeBins>),
}

impl FreeIndex {
    fn for_pool(pool: PoolKind) -> FreeIndex {
        match pool {
            PoolKind::Small => FreeIndex::Binned(Box::default()),
            PoolKind::Large => FreeIndex::Classes(Box::default()),
        }
    }

    fn len(&self) -> usize {
        match self {
            FreeIndex::Classes(classes) => classes.len(),
            FreeIndex::Binned(bins) => bins.len(),
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            FreeIndex::Classes(classes) => classes.is_empty(),
            FreeIndex::Binned(bins) => bins.is_empty(),
        }
    }

    /// Every free block, as (size, address, id).
    fn entries(&self) -> Box<dyn Iterator<Item = Entry> + '_> {
        match self {
            FreeIndex::Classes(classes) => Box::new(classes.iter()),
            FreeIndex::Binned(bins) => Box::new(bins.iter()),
        }
    }
}

/// Whether a free set of `key` serves requests of `tag`/`pool` on `stream`.
fn serves(key: &FreeKey, tag: Tag, pool: PoolKind, stream: Stream) -> bool {
    let (t, p, owner) = *key;
    t == tag && p == pool && (owner.is_none() || owner == Some(stream))
}

/// Each chunk's handle with its length, in order: what mapping them side by side needs.
pub fn handle_layout(chunks: &[Chunk]) -> Vec<(PhysHandle, usize)> {
    chunks.iter().map(|c| (c.handle, c.len)).collect()
}

/// The `unit` of a segment of `size` bytes made of `chunks` (see [`Segment`]).
fn even_unit(chunks: &[Chunk], size: usize) -> usize {
    let (Some(first), Some(last)) = (chunks.first(), chunks.last()) else {
        return 0;
    };
    let unit = first.len;
    let n = chunks.len();
    let even = unit > 0
        && last.offset + last.len == size
        && chunks.iter().enumerate().all(|(k, c)| {
            c.offset == k * unit && (c.len == unit || (k == n - 1 && c.len > 0 && c.len < unit))
        });
    if even {
        unit
    } else {
        0
    }
}

impl Segment {
    /// The physical handles behind the range, in address order.
    pub fn chunks(&self) -> &[Chunk] {
        &self.chunks
    }

    /// Replaces the chunks (the segment's memory given back, or made again).
    pub fn set_chunks(&mut self, chunks: Vec<Chunk>) -> Vec<Chunk> {
        self.unit = even_unit(&chunks, self.size);
        std::mem::replace(&mut self.chunks, chunks)
    }

    /// The widest run of whole chunks inside `[addr, addr+len)`, as (start, length).
    pub fn whole_chunks(&self, addr: DevicePtr, len: usize) -> Option<(DevicePtr, usize)> {
        let (first, last) = self.chunk_edges(addr, len)?;
        (first < last).then(|| (first, (last - first) as usize))
    }

    /// The first and the last chunk boundary (a chunk's start, or the segment's end) inside
    /// `[addr, addr+len]`, ends included; None when none lies there (the range is inside one
    /// chunk). The bytes before the first belong to a chunk that starts before the range, those
    /// after the last to one that ends after it: a stitch can map such a chunk only as its
    /// first or its last piece.
    pub fn chunk_edges(&self, addr: DevicePtr, len: usize) -> Option<(DevicePtr, DevicePtr)> {
        let from = addr.checked_sub(self.va)? as usize;
        let to = from.checked_add(len)?;
        if to > self.size {
            return None;
        }
        let n = self.chunks.len();
        let (first, last) = if self.unit > 0 {
            // Chunk k starts at k * unit; the last one ends the segment.
            let k = from.div_ceil(self.unit);
            let first = if k < n { k * self.unit } else { self.size };
            let last = if to == self.size {
                self.size
            } else {
                (to / self.unit).min(n - 1) * self.unit
            };
            (first, last)
        } else {
            let k = self.chunks.partition_point(|c| c.offset < from);
            let first = self.chunks.get(k).map_or(self.size, |c| c.offset);
            let last = if to == self.size {
                self.size
            } else {
                let k = self.chunks.partition_point(|c| c.offset <= to);
                self.chunks[k.checked_sub(1)?].offset
            };
            (first, last)
        };
        (first <= last).then(|| (self.va + first as u64, self.va + last as u64))
    }

    /// The chunks that map `[addr, addr+len)`: from the one holding its first byte up to the
    /// one holding its last.
    pub fn chunks_covering(&self, addr: DevicePtr, len: usize) -> &[Chunk] {
        let from = addr.saturating_sub(self.va) as usize;
        let n = self.chunks.len();
        let (first, end) = if let Some(first) = from.checked_div(self.unit) {
            // Past the last byte no chunk holds `from` (the last one may be shorter).
            let first = if from < self.size { first } else { n };
            (first, (from + len).div_ceil(self.unit).min(n))
        } else {
            (
                self.chunks.partition_point(|c| c.offset + c.len <= from),
                self.chunks.partition_point(|c| c.offset < from + len),
            )
        };
        &self.chunks[first..end.max(first)]
    }
}

impl BlockMap {
    pub fn new() -> Self {
        // Epoch 0 is the one no fence has closed: every free starts after it.
        Self {
            epoch: 1,
            ..Self::default()
        }
    }

    /// The position in `free` of the set of `key`, made if missing; `hint` (a block's last set)
    /// is tried first. Sets are never removed, so positions stay valid.
    fn free_set(&mut self, key: FreeKey, hint: u32) -> usize {
        let hint = hint as usize;
        if self.free.get(hint).is_some_and(|(k, _)| *k == key) {
            return hint;
        }
        match self.free.iter().position(|(k, _)| *k == key) {
            Some(index) => index,
            None => {
                self.free.push((key, FreeIndex::for_pool(key.1)));
                self.free.len() - 1
            }
        }
    }

    fn link_free(&mut self, id: BlockId) {
        let (tag, pool, owner, size, addr, hint, split) = {
            let b = &self.blocks[id];
            let s = &self.segments[b.segment];
            (
                s.tag,
                s.pool,
                b.owner,
                b.size,
                b.addr,
                b.free_set,
                b.size < s.size,
            )
        };
        let set = self.free_set((tag, pool, owner), hint);
        let slot = match &mut self.free[set].1 {
            FreeIndex::Classes(classes) => classes.insert((size, addr, id)),
            FreeIndex::Binned(bins) => bins.insert((size, addr, id)),
        };
        let block = &mut self.blocks[id];
        block.free_slot = slot;
        block.free_set = set as u32;
        if split {
            self.inactive_split.count += 1;
            self.inactive_split.bytes += size as i64;
            self.inactive_split_by_pool[pool as usize].count += 1;
            self.inactive_split_by_pool[pool as usize].bytes += size as i64;
        }
    }

    fn unlink_free(&mut self, id: BlockId) {
        let (pool, size, addr, slot, set, split) = {
            let b = &self.blocks[id];
            let s = &self.segments[b.segment];
            debug_assert!(self
                .free
                .get(b.free_set as usize)
                .is_some_and(|(k, _)| *k == (s.tag, s.pool, b.owner)));
            (
                s.pool,
                b.size,
                b.addr,
                b.free_slot,
                b.free_set,
                b.size < s.size,
            )
        };
        let moved = match self.free.get_mut(set as usize).map(|(_, index)| index) {
            Some(FreeIndex::Classes(classes)) => classes.remove((size, addr, id), slot),
            Some(FreeIndex::Binned(bins)) => bins.remove((size, addr, id), slot),
            None => None,
        };
        if let Some(moved) = moved {
            self.blocks[moved].free_slot = slot;
        }
        if split {
            self.inactive_split.count -= 1;
            self.inactive_split.bytes -= size as i64;
            self.inactive_split_by_pool[pool as usize].count -= 1;
            self.inactive_split_by_pool[pool as usize].bytes -= size as i64;
        }
    }

    /// Adds a segment of pool `tag` covered by one free block with no owner (new memory is
    /// idle).
    pub fn add_segment(
        &mut self,
        va: DevicePtr,
        size: usize,
        chunks: Vec<Chunk>,
        pool: PoolKind,
        tag: Tag,
    ) -> (SegmentId, BlockId) {
        let segment = self.segments.insert(Segment {
            va,
            size,
            unit: even_unit(&chunks, size),
            chunks,
            pool,
            tag,
            first: usize::MAX,
            guard: 0,
            freed_at: self.epoch,
            joined_at: 0,
        });
        let block = self.blocks.insert(Block {
            addr: va,
            size,
            segment,
            prev: None,
            next: None,
            state: BlockState::Free,
            owner: None,
            parked: false,
            free_slot: 0,
            free_set: 0,
        });
        self.segments[segment].first = block;
        self.by_addr.insert(va, segment);
        self.link_free(block);
        (segment, block)
    }

    /// The byte ranges of segment `id` that hold allocations (allocated or pending blocks,
    /// neighbours merged), as (offset into the segment, length).
    pub fn used_ranges(&self, id: SegmentId) -> Vec<(usize, usize)> {
        let s = &self.segments[id];
        let mut ranges: Vec<(usize, usize)> = Vec::new();
        let mut at = Some(s.first);
        while let Some(b) = at {
            let block = &self.blocks[b];
            if block.state != BlockState::Free {
                let offset = (block.addr - s.va) as usize;
                match ranges.last_mut() {
                    Some(last) if last.0 + last.1 == offset => last.1 += block.size,
                    _ => ranges.push((offset, block.size)),
                }
            }
            at = block.next;
        }
        ranges
    }

    /// The run of whole chunks inside block `id`, as (start, length).
    pub fn whole_chunks_of(&self, id: BlockId) -> Option<(DevicePtr, usize)> {
        let b = self.blocks.get(id)?;
        self.segments[b.segment].whole_chunks(b.addr, b.size)
    }

    /// The first and last chunk boundaries inside block `id` (see [`Segment::chunk_edges`]).
    pub fn chunk_edges_of(&self, id: BlockId) -> Option<(DevicePtr, DevicePtr)> {
        let b = self.blocks.get(id)?;
        self.segments[b.segment].chunk_edges(b.addr, b.size)
    }

    /// Removes a segment whose only block is free; returns it.
    pub fn remove_segment(&mut self, segment: SegmentId) -> Option<Segment> {
        let first = self.segments.get(segment)?.first;
        let whole = {
            let b = &self.blocks[first];
            b.state == BlockState::Free && b.next.is_none()
        };
        if !whole {
            return None;
        }
        self.unlink_free(first);
        self.blocks.remove(first);
        let removed = self.segments.remove(segment);
        self.by_addr.remove(&removed.va);
        Some(removed)
    }

    /// Segments of the shared pool or of a sleep region whose whole range is one free block.
    /// (A private pool's free memory is still the memory its graph replays use.)
    pub fn idle_segments(&self) -> Vec<SegmentId> {
        self.segments
            .iter()
            .filter(|(_, s)| {
                s.tag == SHARED || s.tag == GUARDED || s.tag == READ_ONLY || is_region(s.tag)
            })
            .filter(|(_, s)| {
                let b = &self.blocks[s.first];
                b.state == BlockState::Free && b.next.is_none()
            })
            .map(|(id, _)| id)
            .collect()
    }

    /// The block that starts at `addr`.
    pub fn block_at(&self, addr: DevicePtr) -> Option<BlockId> {
        self.block_containing(addr)
            .filter(|&id| self.blocks[id].addr == addr)
    }

    /// The block whose range contains `addr`: found by walking its segment's list, which is
    /// short in practice (a walk of about two blocks per lookup on the recorded traces).
    pub fn block_containing(&self, addr: DevicePtr) -> Option<BlockId> {
        let (_, &segment) = self.by_addr.range(..=addr).next_back()?;
        let s = &self.segments[segment];
        if addr >= s.va + s.size as u64 {
            return None;
        }
        self.segment_blocks(segment).find(|&id| {
            let b = &self.blocks[id];
            addr < b.addr + b.size as u64
        })
    }

    /// Smallest free block of `tag`'s `pool` usable on `stream` with at least `size` bytes.
    pub fn best_fit(
        &self,
        tag: Tag,
        pool: PoolKind,
        stream: Stream,
        size: usize,
    ) -> Option<BlockId> {
        let mut best: Option<(usize, DevicePtr, BlockId)> = None;
        for (key, index) in &self.free {
            if !serves(key, tag, pool, stream) {
                continue;
            }
            let candidate = match index {
                FreeIndex::Classes(classes) => classes.best_fit(size),
                FreeIndex::Binned(bins) => bins.best_fit(size),
            };
            if let Some(candidate) = candidate {
                if best.is_none_or(|b| candidate < b) {
                    best = Some(candidate);
                }
            }
        }
        best.map(|(_, _, id)| id)
    }

    /// Free blocks of `tag`'s `pool` usable on `stream`, of at least `min_size` bytes, as
    /// `(size, id)`, largest first (equal sizes by id, highest first). Lazy: a stitch needs
    /// only the few largest blocks, not all of them sorted.
    pub fn largest_free_blocks(
        &self,
        tag: Tag,
        pool: PoolKind,
        stream: Stream,
        min_size: usize,
    ) -> LargestFirst<'_> {
        let sets = self
            .free
            .iter()
            .filter(|(key, _)| serves(key, tag, pool, stream))
            .filter_map(|(_, index)| match index {
                FreeIndex::Classes(classes) => {
                    let walk: Box<dyn Iterator<Item = Entry> + '_> =
                        Box::new(classes.largest_first(min_size));
                    Some(walk.peekable())
                }
                // Stitching takes large-pool blocks only.
                FreeIndex::Binned(_) => None,
            })
            .collect();
        LargestFirst {
            sets,
            ties: Vec::new(),
        }
    }

    /// Streams that own free blocks.
    pub fn owning_streams(&self) -> Vec<Stream> {
        let mut streams: Vec<Stream> = self
            .free
            .iter()
            .filter(|(_, index)| !index.is_empty())
            .filter_map(|((_, _, owner), _)| *owner)
            .collect();
        streams.sort_unstable();
        streams.dedup();
        streams
    }

    /// Cuts block `id` after its first `size` bytes (less than its size); the rest becomes a
    /// new block in the same state with the same owner, and is returned. Neither block is
    /// linked into the free sets here: callers link only what stays free, once.
    fn split_off(&mut self, id: BlockId, size: usize) -> BlockId {
        let (addr, total, segment, next, state, owner, free_set) = {
            let b = &self.blocks[id];
            (
                b.addr, b.size, b.segment, b.next, b.state, b.owner, b.free_set,
            )
        };
        debug_assert!(size < total);
        let rest = self.blocks.insert(Block {
            addr: addr + size as u64,
            size: total - size,
            segment,
            prev: Some(id),
            next,
            state,
            owner,
            parked: false,
            free_slot: 0,
            free_set,
        });
        if let Some(n) = next {
            self.blocks[n].prev = Some(rest);
        }
        let block = &mut self.blocks[id];
        block.size = size;
        block.next = Some(rest);
        rest
    }

    /// Marks free block `id` allocated on `stream`, keeping only its first `size` bytes: a
    /// larger block is split and the rest stays free, with the block's owner. Returns the
    /// rest's id, if any.
    pub fn take_front(&mut self, id: BlockId, size: usize, stream: Stream) -> Option<BlockId> {
        debug_assert_eq!(self.blocks[id].state, BlockState::Free);
        self.unlink_free(id);
        self.claim_front(id, size, stream)
    }

    /// `take_front` of a free block already out of the free sets.
    fn claim_front(&mut self, id: BlockId, size: usize, stream: Stream) -> Option<BlockId> {
        let rest = (size < self.blocks[id].size).then(|| {
            let rest = self.split_off(id, size);
            self.link_free(rest);
            rest
        });
        let block = &mut self.blocks[id];
        block.state = BlockState::Allocated;
        block.owner = Some(stream);
        rest
    }

    /// Marks the last `size` bytes of free block `id` (less than its size) allocated on
    /// `stream`, as `take_range` of them would, without looking the block up by address; the
    /// front stays free with the block's owner. Returns the block of those bytes.
    pub fn take_back(&mut self, id: BlockId, size: usize, stream: Stream) -> BlockId {
        debug_assert_eq!(self.blocks[id].state, BlockState::Free);
        debug_assert!(size < self.blocks[id].size);
        self.unlink_free(id);
        let back = self.split_off(id, self.blocks[id].size - size);
        self.link_free(id);
        self.claim_front(back, size, stream);
        back
    }

    /// Marks free block `id` allocated on `stream`, whole.
    pub fn take(&mut self, id: BlockId, stream: Stream) {
        let size = self.blocks[id].size;
        self.take_front(id, size, stream);
    }

    /// Takes `[addr, addr+size)` out of the free block containing it, allocated on `stream`,
    /// and returns the block that covers exactly that range; what lies before and after stays
    /// free. None (and nothing changes) when the range is not inside one free block usable on
    /// `stream`.
    pub fn take_range(&mut self, addr: DevicePtr, size: usize, stream: Stream) -> Option<BlockId> {
        let id = self.block_containing(addr)?;
        let (start, len, state, owner) = {
            let b = &self.blocks[id];
            (b.addr, b.size, b.state, b.owner)
        };
        let usable = owner.is_none() || owner == Some(stream);
        if state != BlockState::Free
            || !usable
            || size == 0
            || addr + size as u64 > start + len as u64
        {
            return None;
        }
        self.unlink_free(id);
        let id = if addr > start {
            let middle = self.split_off(id, (addr - start) as usize);
            self.link_free(id);
            middle
        } else {
            id
        };
        self.claim_front(id, size, stream);
        Some(id)
    }

    /// Marks allocated block `id` pending (freed, waiting for events).
    pub fn set_pending(&mut self, id: BlockId) {
        self.blocks[id].state = BlockState::Pending;
    }

    fn mergeable(&self, a: BlockId, b: BlockId) -> bool {
        let (x, y) = (&self.blocks[a], &self.blocks[b]);
        x.state == BlockState::Free
            && y.state == BlockState::Free
            && (x.owner == y.owner || x.owner.is_none() || y.owner.is_none())
    }

    /// Absorbs block `next` into block `id`, the block just before it. Neither is in the free
    /// sets: a merge links only its result, once.
    fn absorb(&mut self, id: BlockId, next: BlockId) {
        let gone = self.blocks.remove(next);
        if let Some(n) = gone.next {
            self.blocks[n].prev = Some(id);
        }
        let block = &mut self.blocks[id];
        block.size += gone.size;
        block.next = gone.next;
        if block.owner.is_none() {
            block.owner = gone.owner;
        }
    }

    /// Returns block `id` to the free sets, owned by `owner`, and merges it with free neighbours
    /// of a compatible owner. Returns the id of the resulting block.
    pub fn release(&mut self, id: BlockId, owner: Owner) -> BlockId {
        self.release_freed_in(id, owner, self.epoch)
    }

    /// [`BlockMap::release`] of a block its user freed in epoch `freed_in` (it was kept apart
    /// since, parked): the segment's stamp is that epoch, unless a later free set a later one.
    pub fn release_freed_in(&mut self, id: BlockId, owner: Owner, freed_in: u64) -> BlockId {
        {
            let block = &mut self.blocks[id];
            block.state = BlockState::Free;
            block.owner = owner;
        }
        let segment = &mut self.segments[self.blocks[id].segment];
        segment.freed_at = segment.freed_at.max(freed_in);
        let id = self.merge_neighbours(id);
        self.link_free(id);
        id
    }

    /// Merges free block `id`, which is not in the free sets, with its free neighbours of a
    /// compatible owner (taking them out of the free sets). Returns the merged block, unlinked.
    fn merge_neighbours(&mut self, mut id: BlockId) -> BlockId {
        if let Some(next) = self.blocks[id].next {
            if self.mergeable(id, next) {
                self.unlink_free(next);
                self.absorb(id, next);
            }
        }
        if let Some(prev) = self.blocks[id].prev {
            if self.mergeable(prev, id) {
                self.unlink_free(prev);
                self.absorb(prev, id);
                id = prev;
            }
        }
        id
    }

    /// Gives every free block owned by `stream` to no stream (its work is known complete), and
    /// merges what can now be merged.
    pub fn disown(&mut self, stream: Stream) {
        let ids: Vec<BlockId> = self
            .free
            .iter()
            .filter(|((_, _, owner), _)| *owner == Some(stream))
            .flat_map(|(_, index)| index.entries().map(|(_, _, id)| id))
            .collect();
        for id in &ids {
            self.unlink_free(*id);
            self.blocks[*id].owner = None;
            self.link_free(*id);
        }
        for id in ids {
            if self.blocks.contains(id) && self.blocks[id].state == BlockState::Free {
                self.unlink_free(id);
                let merged = self.merge_neighbours(id);
                self.link_free(merged);
            }
        }
    }

    /// Moves every segment of pool `from` to pool `to` (a private pool that ends gives its
    /// memory to the shared pool); returns the segments moved.
    pub fn retag(&mut self, from: Tag, to: Tag) -> Vec<SegmentId> {
        let moved: Vec<SegmentId> = self
            .segments
            .iter()
            .filter(|(_, s)| s.tag == from)
            .map(|(id, _)| id)
            .collect();
        for &segment in &moved {
            self.retag_segment(segment, to);
        }
        moved
    }

    /// Whether any segment belongs to pool `tag`.
    pub fn has_tag(&self, tag: Tag) -> bool {
        self.segments.iter().any(|(_, s)| s.tag == tag)
    }

    /// Moves segment `segment` to pool `to`, its free blocks to that pool's free sets.
    pub fn retag_segment(&mut self, segment: SegmentId, to: Tag) {
        let free: Vec<BlockId> = self
            .segment_blocks(segment)
            .filter(|&b| self.blocks[b].state == BlockState::Free)
            .collect();
        for &b in &free {
            self.unlink_free(b);
        }
        let moved = &mut self.segments[segment];
        moved.tag = to;
        moved.joined_at = self.epoch;
        for b in free {
            self.link_free(b);
        }
    }

    /// Number of free blocks (all pools and owners).
    pub fn free_block_count(&self) -> usize {
        self.free.iter().map(|(_, index)| index.len()).sum()
    }

    /// Blocks of a segment, in address order.
    pub fn segment_blocks(&self, segment: SegmentId) -> SegmentBlocks<'_> {
        SegmentBlocks {
            map: self,
            next: self.segments.get(segment).map(|s| s.first),
        }
    }

    /// Checks the structural invariants; used by tests.
    pub fn check(&self) -> Result<(), String> {
        let mut covered = 0usize;
        for (sid, segment) in self.segments.iter() {
            let mut at = segment.va;
            let mut prev = None;
            for id in self.segment_blocks(sid) {
                let b = &self.blocks[id];
                if b.addr != at || b.prev != prev || b.segment != sid || b.size == 0 {
                    return Err(format!("segment {sid}: block {id} breaks the chain"));
                }
                if let (Some(p), BlockState::Free) = (prev, b.state) {
                    if self.mergeable(p, id) {
                        return Err(format!("blocks {p} and {id} should have merged"));
                    }
                }
                at += b.size as u64;
                prev = Some(id);
                covered += 1;
            }
            if at != segment.va + segment.size as u64 {
                return Err(format!("segment {sid} not covered"));
            }
            if segment.unit != even_unit(&segment.chunks, segment.size) {
                return Err(format!("segment {sid}: chunk unit out of step"));
            }
        }
        if covered != self.blocks.len() {
            return Err(format!(
                "{} blocks, {covered} in segments",
                self.blocks.len()
            ));
        }
        if self.by_addr.len() != self.segments.len()
            || self
                .by_addr
                .iter()
                .any(|(&va, &sid)| self.segments.get(sid).is_none_or(|s| s.va != va))
        {
            return Err("segments by address out of step".into());
        }
        let free_listed = self.free_block_count();
        let free_actual = self
            .blocks
            .iter()
            .filter(|(_, b)| b.state == BlockState::Free)
            .count();
        if free_listed != free_actual {
            return Err(format!("{free_listed} listed free, {free_actual} free"));
        }
        Ok(())
    }
}

/// Iterator of [`BlockMap::largest_free_blocks`]: merges the free sets from their large ends.
pub struct LargestFirst<'a> {
    sets: Vec<Peekable<Box<dyn Iterator<Item = Entry> + 'a>>>,
    /// The blocks of the size being handed out, lowest id first (popped from the end).
    ties: Vec<(usize, BlockId)>,
}

impl Iterator for LargestFirst<'_> {
    type Item = (usize, BlockId);

    fn next(&mut self) -> Option<(usize, BlockId)> {
        if let Some(next) = self.ties.pop() {
            return Some(next);
        }
        let size = self
            .sets
            .iter_mut()
            .filter_map(|set| set.peek().map(|&(size, _, _)| size))
            .max()?;
        // The sets order equal sizes by address; the order promised is by id, so all blocks
        // of this size are gathered and sorted.
        for set in &mut self.sets {
            while let Some((_, _, id)) = set.next_if(|&(s, _, _)| s == size) {
                self.ties.push((size, id));
            }
        }
        self.ties.sort_unstable();
        self.ties.pop()
    }
}

pub struct SegmentBlocks<'a> {
    map: &'a BlockMap,
    next: Option<BlockId>,
}

impl Iterator for SegmentBlocks<'_> {
    type Item = BlockId;
    fn next(&mut self) -> Option<BlockId> {
        let id = self.next?;
        self.next = self.map.blocks[id].next;
        Some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Stream = Stream(7);
    const MIB: usize = 1 << 20;

    /// A segment's chunk list of one handle.
    fn one(handle: u64, len: usize) -> Vec<Chunk> {
        vec![Chunk {
            handle: PhysHandle(handle),
            offset: 0,
            len,
        }]
    }

    fn chunks_of(sizes: &[usize]) -> Vec<Chunk> {
        let mut offset = 0;
        sizes
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                let chunk = Chunk {
                    handle: PhysHandle(i as u64 + 1),
                    offset,
                    len,
                };
                offset += len;
                chunk
            })
            .collect()
    }

    #[test]
    fn chunk_sizes_are_powers_of_two_then_a_rest() {
        let unit = 2 * MIB;
        assert_eq!(chunk_sizes(2 * MIB, unit, 64 * MIB), vec![2 * MIB]);
        assert_eq!(chunk_sizes(10 * MIB, unit, 64 * MIB), vec![2 * MIB; 5]);
        assert_eq!(chunk_sizes(64 * MIB, unit, 64 * MIB), vec![8 * MIB; 8]);
        let mut twelve_and_a_rest = vec![8 * MIB; 12];
        twelve_and_a_rest.push(4 * MIB);
        assert_eq!(chunk_sizes(100 * MIB, unit, 64 * MIB), twelve_and_a_rest);
        assert_eq!(chunk_sizes(1 << 30, unit, 64 * MIB), vec![64 * MIB; 16]);
        assert_eq!(chunk_sizes(1 << 30, unit, 2 * MIB).len(), 512);
        for size in (1..300).map(|n| n * unit) {
            let sizes = chunk_sizes(size, unit, 64 * MIB);
            assert_eq!(sizes.iter().sum::<usize>(), size);
            assert!(sizes
                .iter()
                .all(|&s| s % unit == 0 && s > 0 && s <= 64 * MIB));
        }
    }

    #[test]
    fn chunk_limit_follows_the_pool() {
        let unit = 2 * MIB;
        let small = 64 * MIB;
        assert_eq!(chunk_limit(0, small, unit, 32 * MIB, 512, 32), unit);
        assert_eq!(chunk_limit(1 << 30, small, unit, 32 * MIB, 512, 32), unit);
        assert_eq!(
            chunk_limit(3 << 30, small, unit, 32 * MIB, 512, 32),
            4 * MIB
        );
        assert_eq!(
            chunk_limit(80 << 30, small, unit, 32 * MIB, 512, 32),
            32 * MIB
        );
        assert_eq!(chunk_limit(80 << 30, small, unit, unit, 512, 32), unit);
        assert_eq!(
            chunk_limit(20 * MIB, small, unit, 32 * MIB, 1, 32),
            16 * MIB
        );
    }

    #[test]
    fn a_large_segment_of_a_small_pool_gets_few_chunks() {
        let unit = 2 * MIB;
        // 1 GiB made while the pool holds 1 GiB: 1/2048 of the pool would be 2 MiB handles
        // (512 of them); at most 32 chunks makes them 32 MiB.
        let limit = chunk_limit(1 << 30, 1 << 30, unit, 32 * MIB, 2048, 32);
        assert_eq!(limit, 32 * MIB);
        assert_eq!(chunk_sizes(1 << 30, unit, limit).len(), 32);
        // The cap still holds: 8 GiB comes in 32 MiB handles, not 256 MiB ones.
        assert_eq!(
            chunk_limit(1 << 30, 8 << 30, unit, 32 * MIB, 2048, 32),
            32 * MIB
        );
        // A pool large enough already gives larger handles than the segment asks for.
        assert_eq!(
            chunk_limit(64 << 30, 96 * MIB, unit, 32 * MIB, 2048, 32),
            32 * MIB
        );
        // Smaller segments are unchanged: 40 and 256 MiB in a 1 GiB pool keep 2 MiB handles.
        assert_eq!(
            chunk_limit(1 << 30, 40 * MIB, unit, 32 * MIB, 2048, 32),
            unit
        );
        assert_eq!(
            chunk_limit(1 << 30, 256 * MIB, unit, 32 * MIB, 2048, 32),
            unit
        );
        assert_eq!(
            chunk_limit(1 << 30, 512 * MIB, unit, 32 * MIB, 2048, 32),
            16 * MIB
        );
        // More chunks allowed: 64 for 1 GiB are 16 MiB each.
        assert_eq!(
            chunk_limit(1 << 30, 1 << 30, unit, 32 * MIB, 2048, 64),
            16 * MIB
        );
    }

    #[test]
    fn whole_chunks_inside_a_range() {
        let mut m = BlockMap::new();
        let va = 0x4000_0000;
        let (seg, _) = m.add_segment(
            va,
            20 * MIB,
            chunks_of(&[8 * MIB, 8 * MIB, 4 * MIB]),
            PoolKind::Large,
            SHARED,
        );
        let s = &m.segments[seg];
        let at = |mib: usize| va + (mib * MIB) as u64;
        assert_eq!(s.whole_chunks(va, 20 * MIB), Some((va, 20 * MIB)));
        assert_eq!(s.whole_chunks(at(2), 18 * MIB), Some((at(8), 12 * MIB)));
        assert_eq!(s.whole_chunks(at(2), 14 * MIB), Some((at(8), 8 * MIB)));
        assert_eq!(s.whole_chunks(at(2), 12 * MIB), None);
        assert_eq!(s.chunks_covering(at(8), 9 * MIB).len(), 2);
        assert_eq!(s.chunks_covering(at(8), 8 * MIB).len(), 1);
        assert_eq!(s.chunks_covering(va, 20 * MIB).len(), 3);
    }

    #[test]
    fn chunk_lookups_match_a_search_on_any_layout() {
        let mut m = BlockMap::new();
        let va = 0x4000_0000;
        for sizes in [&[4, 4, 4, 2][..], &[2, 8, 4, 8], &[8], &[1, 1, 16, 1]] {
            let chunks = chunks_of(&sizes.iter().map(|&s| s * MIB).collect::<Vec<_>>());
            let total = chunks.iter().map(|c| c.len).sum::<usize>();
            let (seg, _) = m.add_segment(va, total, chunks, PoolKind::Large, SHARED);
            let s = m.segments[seg].clone();
            for from in (0..=total).step_by(MIB / 2) {
                for len in (0..=total - from).step_by(MIB / 2) {
                    let first = s.chunks.partition_point(|c| c.offset < from);
                    let end = s.chunks.partition_point(|c| c.offset + c.len <= from + len);
                    let want = (first < end).then(|| {
                        let stop = s.chunks[end - 1].offset + s.chunks[end - 1].len;
                        (
                            va + s.chunks[first].offset as u64,
                            stop - s.chunks[first].offset,
                        )
                    });
                    let at = va + from as u64;
                    assert_eq!(s.whole_chunks(at, len), want, "{sizes:?} {from} {len}");
                    let bounds: Vec<usize> =
                        s.chunks.iter().map(|c| c.offset).chain([total]).collect();
                    let first = bounds.iter().copied().find(|&b| b >= from);
                    let last = bounds.iter().copied().rev().find(|&b| b <= from + len);
                    let edges = first
                        .zip(last)
                        .filter(|(f, l)| f <= l)
                        .map(|(f, l)| (va + f as u64, va + l as u64));
                    assert_eq!(s.chunk_edges(at, len), edges, "{sizes:?} {from} {len}");
                    let holding = s.chunks.partition_point(|c| c.offset + c.len <= from);
                    let end = s.chunks.partition_point(|c| c.offset < from + len);
                    let covering = &s.chunks[holding..end.max(holding)];
                    assert_eq!(
                        s.chunks_covering(at, len),
                        covering,
                        "{sizes:?} {from} {len}"
                    );
                }
            }
            assert!(m.remove_segment(seg).is_some());
        }
    }

    #[test]
    fn split_take_release_coalesce() {
        let mut m = BlockMap::new();
        let (seg, b) = m.add_segment(0x10000, 4096, one(1, 4096), PoolKind::Small, SHARED);
        assert_eq!(m.best_fit(SHARED, PoolKind::Small, S, 512), Some(b));
        m.take_front(b, 512, S);
        let c = m.best_fit(SHARED, PoolKind::Small, S, 512).unwrap();
        m.take_front(c, 1024, S);
        assert_eq!(m.inactive_split.count, 1);
        assert_eq!(m.inactive_split.bytes, 4096 - 1536);
        m.check().unwrap();
        m.release(b, Some(S));
        m.check().unwrap();
        assert_eq!(m.inactive_split.count, 2);
        let merged = m.release(c, Some(S));
        assert_eq!(merged, b);
        assert_eq!(m.blocks[b].size, 4096);
        assert_eq!(m.inactive_split, SplitDelta::default());
        m.check().unwrap();
        assert!(m.remove_segment(seg).is_some());
        assert_eq!(m.blocks.len(), 0);
    }

    #[test]
    fn owners_keep_streams_apart() {
        let mut m = BlockMap::new();
        let (_, b) = m.add_segment(0x100000, 8192, one(1, 8192), PoolKind::Large, SHARED);
        m.take_front(b, 4096, S);
        m.release(b, Some(S));
        // The first half is owned by S, the second by nobody: they merge, owned by S.
        assert_eq!(m.blocks[b].size, 8192);
        assert_eq!(m.best_fit(SHARED, PoolKind::Large, Stream(9), 4096), None);
        m.disown(S);
        assert_eq!(
            m.best_fit(SHARED, PoolKind::Large, Stream(9), 4096),
            Some(b)
        );
        m.check().unwrap();
    }

    #[test]
    fn take_range_middle() {
        let mut m = BlockMap::new();
        let (_, b) = m.add_segment(0x200000, 8 << 20, one(1, 8 << 20), PoolKind::Large, SHARED);
        let mid = m.take_range(0x200000 + (2 << 20), 2 << 20, S).unwrap();
        assert_ne!(mid, b);
        assert_eq!(m.blocks[mid].size, 2 << 20);
        assert_eq!(m.blocks[b].size, 2 << 20);
        m.check().unwrap();
        assert!(m.take_range(0x200000 + (2 << 20), 2 << 20, S).is_none());
    }

    #[test]
    fn lookups_by_address() {
        let mut m = BlockMap::new();
        let (_, a) = m.add_segment(0x100000, 4096, one(1, 4096), PoolKind::Small, SHARED);
        let (_, b) = m.add_segment(0x300000, 8192, one(2, 8192), PoolKind::Large, SHARED);
        let rest = m.take_front(b, 2048, S).unwrap();
        assert_eq!(m.block_at(0x100000), Some(a));
        assert_eq!(m.block_at(0x100200), None);
        assert_eq!(m.block_containing(0x100fff), Some(a));
        assert_eq!(m.block_containing(0x101000), None);
        assert_eq!(m.block_containing(0xfffff), None);
        assert_eq!(m.block_containing(0x3007ff), Some(b));
        assert_eq!(m.block_at(0x300800), Some(rest));
        assert_eq!(m.block_containing(0x301fff), Some(rest));
        assert_eq!(m.block_containing(0x302000), None);
    }

    #[test]
    fn largest_free_blocks_by_size_then_id() {
        let mut m = BlockMap::new();
        let other = Stream(9);
        let sizes = [4096usize, 8192, 4096, 4096, 8192, 1024, 2048];
        for (i, size) in sizes.into_iter().enumerate() {
            // Addresses fall as ids rise, so that the order by id is not the order by address.
            let va = 0x100000 * (16 - i as u64);
            let (_, b) = m.add_segment(va, size + 512, one(1, size + 512), PoolKind::Large, SHARED);
            // Leaves a free block of `size` owned by S, by `other` or by nobody.
            m.take_front(b, 512, S);
            let owner = [Some(S), Some(other), None][i % 3];
            let rest = m.blocks[b].next.unwrap();
            m.take(rest, S);
            m.release(rest, owner);
        }
        m.check().unwrap();
        let mut expected: Vec<(usize, BlockId)> = m
            .blocks
            .iter()
            .filter(|(_, b)| {
                b.state == BlockState::Free
                    && b.size >= 2048
                    && (b.owner.is_none() || b.owner == Some(S))
            })
            .map(|(id, b)| (b.size, id))
            .collect();
        expected.sort_unstable_by(|x, y| y.cmp(x));
        let found: Vec<_> = m
            .largest_free_blocks(SHARED, PoolKind::Large, S, 2048)
            .collect();
        assert_eq!(found, expected);
        assert_eq!(found.len(), 4);
        assert_eq!(
            m.largest_free_blocks(SHARED, PoolKind::Large, S, 1 << 20)
                .next(),
            None
        );
    }
}
