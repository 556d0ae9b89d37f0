//! Freed blocks kept whole for the next request of their exact size on their stream: the
//! allocator's fast path. Training and serving loops ask for the same sizes step after step
//! (47-93% of the recorded traces' requests meet a parked block of their rounded size on their
//! stream), so a free that parks its block and a malloc that takes it back skip the best-fit
//! search, the split and the merge with neighbours that the free lists cost.
//!
//! A parked block stays allocated in the block map, owned by its stream, as it was while live;
//! only the statistics count it free. Parked blocks go back to the free lists, merged with
//! their neighbours, before anything looks at free memory as a whole: a request that finds no
//! free block (so before any stitch or growth), a device-wide wait (before cached memory is
//! released, other streams' memory taken back or a region put to sleep), growth past the soft
//! limit, a swappable allocation's search for an idle segment, and the pool operations that
//! read the whole block map or the statistics (`Pool::settled`). So nothing is created,
//! stitched or released while parked memory could serve a request instead. A request that the
//! free lists can serve only by splitting a larger block first brings back the parked blocks
//! of sizes between the two, which might fit better (see `Inner::best_fit`). A freed
//! block takes its parked neighbours back to the free lists and merges with them
//! (`Inner::release_block`); a large-pool block of at most 32 MiB between free or parked
//! memory on both sides, or of 64 MiB or more next to such memory on one side, is not parked
//! (`MERGE_FIRST`).
//!
//! A plain request (the shared pool, no sleep region, swap placement, guard pages or capture
//! routing, no frees waiting on events) looks for its parked block as soon as the pool's lock
//! is taken, before any of a full malloc's dispatch ([`Inner::malloc_parked`]); whether a
//! block may be parked is decided when it is booked, so that neither path reads the block map.
//!
//! The cost is in layout, not in correctness: a block found while others are parked may not
//! be the one the merged free lists would have given. Without the neighbour and size-between
//! rules above, peak reserved memory rose by up to 0.4% on the recorded traces and by 10% on
//! a trace of SmartSwap under a memory cap (which then ran out of memory); with them it is
//! within 0.4% of no parking on the recorded traces, and on the SmartSwap trace no more.

use super::bins::{class_of, NonEmpty};
use super::blocks::{BlockId, BlockState, PoolKind, Segment, SegmentId, Tag, SHARED};
use super::{sizes, Inner, Live, Target};
use crate::device::{DevicePtr, Stream};

/// A parked block.
#[derive(Debug, Clone, Copy)]
struct ParkedBlock {
    id: BlockId,
    /// The block's address, as the block map has it: kept here too so that taking the block
    /// back reads no block (one cache miss less on the fast path).
    addr: DevicePtr,
    size: usize,
    stream: Stream,
    pool: PoolKind,
    /// When it was parked, counted in parks.
    parked_at: u64,
    /// The block map's epoch when it was freed: the work that used it was queued before.
    freed_in: u64,
}

/// Parks after which a block not taken back returns to the free lists: a size that stops
/// recurring (a KV cache that has grown past it) does not keep its blocks apart for long.
const WINDOW: usize = 4096;

/// Blocks of this size and more are not parked next to free or parked memory: parked, they
/// would keep the two apart, and a request the merged block would have served takes other
/// memory (a trace of SmartSwap's swapped activations under a cap reserved 10% more that way,
/// and ran out of memory). Large-pool blocks of sizes that packing puts in shared segments
/// (at most [`sizes::PACKED_REQUEST_MOST`]) are not parked between such memory on both sides:
/// taken back, one would split the free memory around it in two, where a best fit in the
/// merged block puts the request at an edge (with runs of one size packed, parking them anyway
/// cost 4% more memory on the MoE SmartSwap trace). Blocks between the two sizes are parked:
/// a block taken back where it was keeps a training step's layout the same as the last one's,
/// and with them merged too, a dense SmartSwap trace under a cap made 32 new stitches in its 8
/// stable steps instead of 17-21. Small blocks are always parked: they are the many requests
/// per step whose calls parking saves; on the recorded traces merging them first as well saved
/// at most 0.4% more memory (generate) but doubled the median malloc and free.
const MERGE_FIRST: usize = 64 << 20;

/// The parked blocks by size class (see the module documentation).
#[derive(Debug, Default)]
pub(super) struct Parked {
    classes: Vec<Vec<ParkedBlock>>,
    non_empty: NonEmpty,
    count: usize,
    /// Parks so far.
    parks: u64,
}

impl Parked {
    pub(super) fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Takes block `at` out of class `class`.
    fn remove(&mut self, class: usize, at: usize) -> ParkedBlock {
        let list = &mut self.classes[class];
        let block = list.swap_remove(at);
        if list.is_empty() {
            self.non_empty.clear(class);
        }
        self.count -= 1;
        block
    }

    /// Parks `block`; returns whether a sweep is due (every [`WINDOW`] parks, see
    /// [`Parked::take_stale`]).
    #[inline]
    fn push(&mut self, mut block: ParkedBlock) -> bool {
        let class = class_of(block.size);
        if self.classes.len() <= class {
            self.classes.resize_with(class + 1, Vec::new);
        }
        block.parked_at = self.parks;
        self.parks += 1;
        self.classes[class].push(block);
        self.non_empty.set(class);
        self.count += 1;
        self.parks % WINDOW as u64 == 0
    }

    /// The blocks parked more than [`WINDOW`] parks ago and not taken back since, which the
    /// caller frees.
    #[cold]
    fn take_stale(&mut self) -> Vec<ParkedBlock> {
        let oldest = self.parks.saturating_sub(WINDOW as u64);
        let mut old = Vec::new();
        let mut next = self.non_empty.first_from(0);
        while let Some(class) = next {
            let list = &mut self.classes[class];
            let before = list.len();
            old.extend(list.iter().filter(|b| b.parked_at < oldest).copied());
            list.retain(|b| b.parked_at >= oldest);
            self.count -= before - list.len();
            if list.is_empty() {
                self.non_empty.clear(class);
            }
            next = self.non_empty.first_from(class + 1);
        }
        old
    }

    /// The block parked last for `size` bytes of `pool` on `stream`, if any.
    #[inline]
    fn pop(&mut self, size: usize, pool: PoolKind, stream: Stream) -> Option<ParkedBlock> {
        let class = class_of(size);
        let at = self
            .classes
            .get(class)?
            .iter()
            .rposition(|b| b.size == size && b.stream == stream && b.pool == pool)?;
        Some(self.remove(class, at))
    }

    /// The parked blocks of sizes from `low` to `high` bytes (and others of the classes those
    /// span); None stays parked.
    fn take_between(&mut self, low: usize, high: usize) -> Vec<ParkedBlock> {
        let mut taken = Vec::new();
        let last = class_of(high);
        let mut next = self.non_empty.first_from(class_of(low));
        while let Some(class) = next.filter(|&c| c <= last) {
            self.count -= self.classes[class].len();
            taken.append(&mut self.classes[class]);
            self.non_empty.clear(class);
            next = self.non_empty.first_from(class + 1);
        }
        taken
    }

    /// Takes block `id` of `size` bytes out, if it is parked.
    fn take(&mut self, id: BlockId, size: usize) -> Option<ParkedBlock> {
        let class = class_of(size);
        let at = self.classes.get(class)?.iter().position(|b| b.id == id)?;
        Some(self.remove(class, at))
    }

    /// Every parked block; none stays parked.
    fn take_all(&mut self) -> Vec<ParkedBlock> {
        self.take_between(0, usize::MAX)
    }
}

/// Whether blocks of `segment` booked in `pool` are parked when freed: the shared pool's
/// segments of that pool.
fn parks_in(segment: &Segment, pool: PoolKind) -> bool {
    segment.tag == SHARED && segment.pool == pool
}

impl Inner {
    /// Parks the block of `live` (at `ptr`), just taken off the books and used on no stream
    /// but its own, when it may be: a plain block of the shared pool. Returns false (nothing
    /// done) for any other.
    pub(super) fn park(&mut self, ptr: DevicePtr, live: &Live) -> bool {
        let Target::Block(id) = live.target else {
            return false;
        };
        if !live.parkable {
            return false;
        }
        // A large block of a size packing makes between free or parked memory on both sides,
        // or one of MERGE_FIRST bytes or more next to such memory on one side, is freed as
        // usual, merging with it (see MERGE_FIRST). Only memory it can merge with counts:
        // free or parked on no stream or on its own.
        if live.pool == PoolKind::Large {
            let block = &self.map.blocks[id];
            let loose = |n: Option<BlockId>| {
                n.is_some_and(|n| {
                    let neighbour = &self.map.blocks[n];
                    (neighbour.parked || neighbour.state == BlockState::Free)
                        && neighbour.owner.is_none_or(|owner| owner == live.stream)
                })
            };
            // Neighbours are read only for the sizes a rule covers, and only as far as needed.
            let merges = if live.size <= sizes::PACKED_REQUEST_MOST {
                loose(block.prev) && loose(block.next)
            } else {
                live.size >= MERGE_FIRST && (loose(block.prev) || loose(block.next))
            };
            if merges {
                return false;
            }
        }
        self.map.blocks[id].parked = true;
        let parked = ParkedBlock {
            id,
            addr: ptr,
            size: live.size,
            stream: live.stream,
            pool: live.pool,
            parked_at: 0,
            freed_in: self.map.epoch,
        };
        if self.parked.push(parked) {
            let stale = self.parked.take_stale();
            self.release_parked(stale);
        }
        self.stats.active.decrease(live.pool, 1);
        self.stats
            .active_bytes
            .decrease(live.pool, live.size as u64);
        true
    }

    /// The fast path of a malloc from the shared pool: a parked block of the request's rounded
    /// size on `stream`, booked without a search. None when there is none, and when the
    /// request needs what a full malloc does first: guard pages, a swap placement, a sleep
    /// region, a capture's routing, or finishing frees that wait on events.
    pub(super) fn malloc_parked(
        &mut self,
        size: usize,
        asked: usize,
        stream: Stream,
    ) -> Option<DevicePtr> {
        if self.parked.is_empty() || !self.takes_plain_requests() {
            return None;
        }
        let (pool, rounded) = self.request_shape(size).ok()?;
        self.unpark(rounded, asked, pool, stream)
    }

    /// Whether a shared-pool request made now on this thread is a plain one (see
    /// [`Inner::malloc_parked`]).
    pub(super) fn takes_plain_requests(&self) -> bool {
        self.routing == 0
            && !self.config.guard
            && self.placement.is_none()
            && self.default_region.is_none()
            && self.pending.is_empty()
            && !super::sleep::any_region_open()
    }

    /// Moves every segment of pool `from` to pool `to`, as [`BlockMap::retag`] does, with
    /// their live blocks parked or not on their free as their new pool says.
    ///
    /// [`BlockMap::retag`]: super::blocks::BlockMap::retag
    pub(super) fn retag(&mut self, from: Tag, to: Tag) {
        for segment in self.map.retag(from, to) {
            self.recheck_parkable(segment);
        }
    }

    /// Decides again, for the live blocks of `segment`, whether each is parked when freed:
    /// after the segment changed pool (a private pool's memory joins the shared pool, memory
    /// shared read-only leaves it), the decision made when they were booked no longer holds.
    pub(super) fn recheck_parkable(&mut self, segment: SegmentId) {
        let Some(s) = self.map.segments.get(segment) else {
            return;
        };
        let addrs: Vec<DevicePtr> = self
            .map
            .segment_blocks(segment)
            .map(|b| &self.map.blocks[b])
            .filter(|b| b.state == BlockState::Allocated)
            .map(|b| b.addr)
            .collect();
        for addr in addrs {
            if let Some(live) = self.live.get_mut(&addr) {
                live.parkable = matches!(live.target, Target::Block(_)) && parks_in(s, live.pool);
            }
        }
    }

    /// Whether a live allocation of `target` in `pool` is parked when freed on its stream
    /// alone: a plain block of a segment that [`parks_in`] says yes for.
    pub(super) fn may_park(&self, target: Target, pool: PoolKind) -> bool {
        match target {
            Target::Block(id) => parks_in(&self.map.segments[self.map.blocks[id].segment], pool),
            Target::Stitched(_) => false,
        }
    }

    /// Serves a request of `size` bytes (rounded; `requested` asked for) of `pool` on `stream`
    /// from a parked block, booked as a new allocation.
    pub(super) fn unpark(
        &mut self,
        size: usize,
        requested: usize,
        pool: PoolKind,
        stream: Stream,
    ) -> Option<DevicePtr> {
        let ParkedBlock { id, addr, .. } = self.parked.pop(size, pool, stream)?;
        self.map.blocks[id].parked = false;
        // The block kept its place in the block map while parked: no split changed.
        self.book_allocation(addr, Target::Block(id), size, requested, stream, pool, true);
        Some(addr)
    }

    /// Returns the parked blocks of sizes from `low` to `high` bytes to the free lists; returns
    /// whether there were any.
    pub(super) fn unpark_between(&mut self, low: usize, high: usize) -> bool {
        if self.parked.is_empty() {
            return false;
        }
        let taken = self.parked.take_between(low, high);
        self.release_parked(taken)
    }

    /// Returns every parked block to the free lists, merged with its free neighbours and owned
    /// by its stream, as a plain free would have. Returns whether there were any.
    pub(super) fn unpark_all(&mut self) -> bool {
        if self.parked.is_empty() {
            return false;
        }
        let taken = self.parked.take_all();
        self.release_parked(taken)
    }

    fn release_parked(&mut self, blocks: Vec<ParkedBlock>) -> bool {
        if blocks.is_empty() {
            return false;
        }
        for block in blocks {
            self.release_parked_block(block);
        }
        self.sync_split_stats();
        true
    }

    fn release_parked_block(&mut self, block: ParkedBlock) {
        self.map.blocks[block.id].parked = false;
        self.map
            .release_freed_in(block.id, Some(block.stream), block.freed_in);
    }

    /// Returns block `id`, being freed, to the free lists owned by `owner`, after its parked
    /// neighbours (so that they merge with it); the caller synchronises the split statistics.
    pub(super) fn release_block(&mut self, id: BlockId, owner: Option<Stream>) {
        let block = &self.map.blocks[id];
        for n in [block.prev, block.next].into_iter().flatten() {
            let neighbour = &self.map.blocks[n];
            if neighbour.parked {
                if let Some(parked) = self.parked.take(n, neighbour.size) {
                    self.release_parked_block(parked);
                }
            }
        }
        self.map.release(id, owner);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    use crate::pool::host_pool;

    fn block(id: BlockId, size: usize, stream: u64) -> ParkedBlock {
        ParkedBlock {
            id,
            addr: 0,
            size,
            stream: Stream(stream),
            pool: PoolKind::Large,
            parked_at: 0,
            freed_in: 0,
        }
    }

    /// A large block whose neighbours on both sides are parked or free is not parked: it
    /// merges with them at once, so the segment is one free block again; one with a single
    /// loose neighbour is parked.
    #[test]
    fn a_large_block_between_loose_memory_is_not_parked() {
        let pool = host_pool();
        let parked = |pool: &crate::Pool| crate::sync::lock(&pool.inner).parked.count;
        let whole = pool.malloc(12 * MIB, Stream::DEFAULT).unwrap();
        pool.free(whole).unwrap();
        let [a, x, b] = [(); 3].map(|_| pool.malloc(4 * MIB, Stream::DEFAULT).unwrap());
        assert_eq!(
            (a, x, b),
            (whole, whole + 4 * MIB as u64, whole + 8 * MIB as u64)
        );
        pool.free(a).unwrap();
        pool.free(b).unwrap();
        assert_eq!(parked(&pool), 2, "one loose neighbour each: parked");
        pool.free(x).unwrap();
        assert_eq!(parked(&pool), 0, "x merged with both, taking them back");
        let snapshot = crate::sync::lock(&pool.inner).snapshot();
        let blocks: Vec<_> = snapshot.segments.iter().map(|s| s.blocks.len()).collect();
        assert_eq!(blocks, [1]);
        pool.check_invariants().unwrap();
    }

    /// Through the pool: a free parks, a malloc of the same size takes the block back, and the
    /// statistics, which settle the pool, put parked blocks back in the free lists.
    #[test]
    fn the_pool_parks_frees_and_settles_for_its_statistics() {
        let pool = host_pool();
        let parked = |pool: &crate::Pool| crate::sync::lock(&pool.inner).parked.count;
        let a = pool.malloc(4 * MIB, Stream::DEFAULT).unwrap();
        let small = pool.malloc(4096, Stream::DEFAULT).unwrap();
        pool.free(a).unwrap();
        pool.free(small).unwrap();
        assert_eq!(parked(&pool), 2);
        assert_eq!(pool.malloc(4 * MIB, Stream::DEFAULT).unwrap(), a);
        assert_eq!(parked(&pool), 1);
        assert_eq!(pool.stats().allocated_bytes.all.current, 4 * MIB as i64);
        assert_eq!(parked(&pool), 0);
        pool.free(a).unwrap();
        pool.check_invariants().unwrap();
    }

    /// The fast path serves plain shared-pool requests only: a request made inside a sleep
    /// region, or one a swap placement wants swappable, takes no parked block.
    #[test]
    fn region_and_swappable_requests_take_no_parked_block() {
        let pool = host_pool();
        let a = pool.malloc(3 * MIB, Stream::DEFAULT).unwrap();
        pool.free(a).unwrap();
        pool.begin_region("weights").unwrap();
        let in_region = pool.malloc(3 * MIB, Stream::DEFAULT).unwrap();
        pool.end_region().unwrap();
        assert_ne!(in_region, a);
        assert_eq!(
            pool.region_info("weights").unwrap().allocated_bytes,
            3 * MIB
        );
        let b = pool.malloc(3 * MIB, Stream::DEFAULT).unwrap();
        pool.free(b).unwrap();
        pool.set_swap_placement(Some(std::sync::Arc::new(|size| size == 3 * MIB)));
        let swappable = pool.malloc(3 * MIB, Stream::DEFAULT).unwrap();
        assert_eq!(
            pool.is_swapped(swappable),
            Some(false),
            "a swappable allocation"
        );
        pool.set_swap_placement(None);
        let plain = pool.malloc(3 * MIB, Stream::DEFAULT).unwrap();
        assert_eq!(pool.is_swapped(plain), None);
        for ptr in [plain, in_region, swappable] {
            pool.free(ptr).unwrap();
        }
        pool.check_invariants().unwrap();
    }

    /// A request that finds frees waiting on events skips the fast path, and the full malloc,
    /// once it has finished them, still takes the parked block of its size.
    #[test]
    fn a_request_after_frees_waiting_on_events_still_takes_its_parked_block() {
        let device = crate::device::host::HostDevice::shared(0, Default::default()).unwrap();
        let pool = crate::Pool::new(device.clone(), crate::Config::default()).unwrap();
        let side = device.create_stream().unwrap();
        let a = pool.malloc(5 * MIB, Stream::DEFAULT).unwrap();
        pool.record_stream(a, side).unwrap();
        let b = pool.malloc(3 * MIB, Stream::DEFAULT).unwrap();
        pool.free(a).unwrap();
        pool.free(b).unwrap();
        assert_eq!(crate::sync::lock(&pool.inner).pending.len(), 1);
        device.synchronize_stream(side).unwrap();
        assert_eq!(pool.malloc(3 * MIB, Stream::DEFAULT).unwrap(), b);
        assert!(crate::sync::lock(&pool.inner).pending.is_empty());
        pool.free(b).unwrap();
        pool.check_invariants().unwrap();
        drop(pool);
        device.destroy_stream(side).unwrap();
    }

    /// A freed block of MERGE_FIRST bytes or more merges with its parked neighbour (and is not
    /// parked itself), so a request of their merged size takes that memory instead of
    /// splitting another block.
    #[test]
    fn a_freed_block_merges_with_its_parked_neighbour() {
        let pool = host_pool();
        let s = Stream::DEFAULT;
        let elsewhere = pool.malloc(160 * MIB, s).unwrap();
        let whole = pool.malloc(384 * MIB, s).unwrap();
        pool.free(whole).unwrap();
        let [a, b, c, d] = [64, 64, 64, 192].map(|m| pool.malloc(m * MIB, s).unwrap());
        assert_eq!((a, b), (whole, whole + 64 * MIB as u64));
        pool.free(elsewhere).unwrap();
        pool.stats(); // settles: `elsewhere` is a free block of 160 MiB
        pool.free(a).unwrap(); // parked: its neighbour is live
        pool.free(b).unwrap(); // next to a parked block: both go back, merged
        assert_eq!(crate::sync::lock(&pool.inner).parked.count, 0);
        assert_eq!(pool.malloc(128 * MIB, s).unwrap(), a);
        for ptr in [a, c, d] {
            pool.free(ptr).unwrap();
        }
        pool.check_invariants().unwrap();
    }

    /// A large request that would split a free block first brings back the parked blocks of
    /// sizes between, and takes the tighter one.
    #[test]
    fn a_large_request_takes_a_tighter_parked_block_before_splitting_a_free_one() {
        let pool = host_pool();
        let s = Stream::DEFAULT;
        let loose = pool.malloc(20 * MIB, s).unwrap();
        let whole = pool.malloc(24 * MIB, s).unwrap();
        pool.free(whole).unwrap();
        let [a, b, c] = [8, 8, 8].map(|m| pool.malloc(m * MIB, s).unwrap());
        pool.free(loose).unwrap();
        pool.stats(); // settles: `loose` is a free block of 20 MiB
        pool.free(b).unwrap(); // parked: both neighbours are live
        assert_eq!(crate::sync::lock(&pool.inner).parked.count, 1);
        assert_eq!(pool.malloc(6 * MIB, s).unwrap(), b);
        for ptr in [a, b, c] {
            pool.free(ptr).unwrap();
        }
        pool.check_invariants().unwrap();
    }

    #[test]
    fn a_block_comes_back_for_its_size_pool_and_stream_only() {
        let mut parked = Parked::default();
        assert!(!parked.push(block(1, 3 * MIB, 0)));
        assert!(!parked.push(block(2, 3 * MIB + 512, 0)));
        assert!(parked.pop(3 * MIB, PoolKind::Large, Stream(1)).is_none());
        assert!(parked.pop(3 * MIB, PoolKind::Small, Stream(0)).is_none());
        assert!(parked
            .pop(3 * MIB + 1024, PoolKind::Large, Stream(0))
            .is_none());
        assert_eq!(
            parked
                .pop(3 * MIB, PoolKind::Large, Stream(0))
                .map(|b| b.id),
            Some(1)
        );
        assert!(parked.pop(3 * MIB, PoolKind::Large, Stream(0)).is_none());
        assert!(!parked.is_empty());
        assert_eq!(parked.take_all().len(), 1);
        assert!(parked.is_empty());
    }

    #[test]
    fn the_newest_block_of_a_size_comes_back_first() {
        let mut parked = Parked::default();
        for id in 1..=3 {
            parked.push(block(id, MIB, 0));
        }
        let order: Vec<BlockId> = (0..3)
            .filter_map(|_| parked.pop(MIB, PoolKind::Large, Stream(0)))
            .map(|b| b.id)
            .collect();
        assert_eq!(order, [3, 2, 1]);
    }

    #[test]
    fn taking_a_size_range_leaves_the_other_classes() {
        let mut parked = Parked::default();
        for (id, size) in [(1, 512), (2, 4 * MIB), (3, 5 * MIB), (4, 64 * MIB)] {
            parked.push(block(id, size, 0));
        }
        let mut taken: Vec<BlockId> = parked
            .take_between(4 * MIB, 6 * MIB)
            .iter()
            .map(|b| b.id)
            .collect();
        taken.sort_unstable();
        assert_eq!(taken, [2, 3]);
        assert!(parked.pop(512, PoolKind::Large, Stream(0)).is_some());
        assert!(parked.pop(64 * MIB, PoolKind::Large, Stream(0)).is_some());
        assert!(parked.is_empty());
    }

    #[test]
    fn blocks_not_taken_back_within_the_window_leave() {
        let mut parked = Parked::default();
        parked.push(block(1, MIB, 0));
        let mut left = Vec::new();
        for n in 0..2 * WINDOW {
            let id = 2 + n;
            if parked.push(block(id, 2 * MIB, 0)) {
                left.extend(parked.take_stale());
            }
            // Every other block is taken back at once, as a training loop would.
            if n % 2 == 0 {
                parked.pop(2 * MIB, PoolKind::Large, Stream(0));
            }
        }
        assert!(left.iter().any(|b| b.id == 1), "the oldest block left");
        assert!(left
            .iter()
            .all(|b| b.size == MIB || b.parked_at + (WINDOW as u64) < parked.parks));
        assert_eq!(parked.count + left.len() + WINDOW, 1 + 2 * WINDOW);
    }
}
