//! The pool's side of stitching: serving a large request from free blocks that are not
//! adjacent, by mapping their chunks side by side at a new range. Plans and the cache of
//! stitched ranges live in [`crate::stitch`]; here blocks are taken from and given back to the
//! block map, ranges are mapped, reused and collected, and the statistics kept.

use super::blocks::{self, BlockId, BlockState, PoolKind, Tag, SHARED};
use super::growth::{map_at, map_range, mappings, Zombie};
use super::keymap::KeyMap;
use super::{Inner, Target};
use crate::device::{DevicePtr, PhysHandle, Stream};
use crate::error::{Error, Result};
use crate::stitch::{self, Piece, StitchId};

use super::unlocked::{GrowthPlan, Planned};

/// A stitch whose pieces are taken, to be mapped (outside the lock in planning mode).
#[derive(Debug)]
pub(super) struct StitchJob {
    size: usize,
    stream: Stream,
    /// The pool (shared, or a sleep region) whose free blocks the pieces are.
    tag: Tag,
    pieces: Vec<Piece>,
    /// Bytes of the first piece's first chunk mapped before the stitched bytes.
    lead: usize,
    ids: Vec<BlockId>,
    /// The segment to make for the bytes the free blocks lack.
    shortfall: Option<GrowthPlan>,
    shortfall_bytes: usize,
    /// The shortfall's segment is mapped before the last piece (see
    /// [`stitch::StitchPlan::new_memory_before_last`]).
    new_memory_before_last: bool,
    access: Vec<i32>,
    granularity: usize,
    /// Segments the stitch gathered, off the books: torn down before the shortfall is made,
    /// which takes their bytes.
    gathered: Vec<Zombie>,
    /// The idle stitched range the job grows, if it grows one rather than mapping a new range.
    grows: Option<Growth>,
    /// A new range reserves room to grow into (see [`growth_room`]): only the shared pool's
    /// ranges grow, and only with `Config::grow_stitched`.
    may_grow: bool,
}

/// A stitch that grows an idle stitched range in place: the range's pieces are all free and
/// taken for the request (in use, their blocks booked to it as an allocation's are), and the
/// job's pieces are mapped in its room after its last handle, so only they are mapped and
/// granted access. A shape a little larger than the last one (a longer sequence, a larger
/// image) then costs the handles it adds, not all of them again.
#[derive(Debug)]
pub(super) struct Growth {
    range: StitchId,
    /// Where the job's first handle maps: the range's mapped end.
    at: DevicePtr,
}

/// Address space a new stitched range reserves after its mapping (`mapped` bytes), to grow
/// into: as much as it maps, so a request up to about twice its size can grow it; none for a
/// range that never grows.
fn growth_room(mapped: usize, may_grow: bool) -> usize {
    if may_grow {
        mapped
    } else {
        0
    }
}

/// A segment just made: its range and chunks.
type NewSegment = (DevicePtr, Vec<blocks::Chunk>);

/// The handles of a segment just made, with their lengths, as a stitch maps them after its
/// pieces.
fn segment_handles(segment: &Option<NewSegment>) -> Vec<(PhysHandle, usize)> {
    segment
        .as_ref()
        .map_or_else(Vec::new, |(_, chunks)| blocks::handle_layout(chunks))
}

/// The handles of a stitch in the order they are mapped: its pieces', and the new segment's
/// after them or before the last piece.
fn mapping_order(
    pieces: &[Piece],
    segment: &Option<NewSegment>,
    before_last: bool,
) -> Vec<(PhysHandle, usize)> {
    let split = if before_last {
        pieces.len().saturating_sub(1)
    } else {
        pieces.len()
    };
    let (before, after) = pieces.split_at(split);
    let handles = |p: &Piece| p.handles.clone();
    before
        .iter()
        .flat_map(handles)
        .chain(segment_handles(segment))
        .chain(after.iter().flat_map(handles))
        .collect()
}

/// What the driver made of a stitch job: the stitched range, and the shortfall's segment
/// (its range and chunks) when there is one; or an error, or None when the device is full;
/// with what could not be torn down.
pub(super) struct StitchMade {
    result: Result<Option<(DevicePtr, Option<NewSegment>)>>,
    leftovers: Vec<Zombie>,
}

impl StitchJob {
    /// The driver's part: the gathered segments torn down, the shortfall's segment made, then
    /// every piece mapped side by side.
    pub(super) fn make(&mut self, device: &dyn crate::device::Device) -> StitchMade {
        let mut leftovers = Vec::new();
        for mut zombie in std::mem::take(&mut self.gathered) {
            if zombie.finish(device).is_err() {
                leftovers.push(zombie);
            }
        }
        let segment: Option<NewSegment> = match &self.shortfall {
            None => None,
            Some(plan) => {
                let made = plan.make(device);
                leftovers.extend(made.leftovers);
                match made.result {
                    Ok(Some(segment)) => Some(segment),
                    other => {
                        return StitchMade {
                            result: other.map(|_| None),
                            leftovers,
                        }
                    }
                }
            }
        };
        let handles = mapping_order(&self.pieces, &segment, self.new_memory_before_last);
        let mapped = match &self.grows {
            // The mappings a failure left in the range's room go at once: the range goes back
            // to the idle ones, and its next growth maps there again.
            Some(growth) => map_at(device, growth.at, &handles, &self.access)
                .map(|()| growth.at)
                .map_err(|(err, mut zombie)| match zombie.finish(device) {
                    Ok(()) => (err, None),
                    Err(_) => (err, Some(zombie)),
                }),
            None => {
                let mapped = handles.iter().map(|&(_, len)| len).sum();
                let room = growth_room(mapped, self.may_grow);
                map_range(device, &handles, room, self.granularity, &self.access)
            }
        };
        match mapped {
            Ok(va) => StitchMade {
                result: Ok(Some((va, segment))),
                leftovers,
            },
            Err((err, zombie)) => {
                leftovers.extend(zombie);
                if let Some((va, chunks)) = segment {
                    let mut undo = Zombie {
                        reservation: Some((va, chunks.iter().map(|c| c.len).sum())),
                        ..Zombie::mapped(va, &chunks)
                    };
                    if undo.finish(device).is_err() {
                        leftovers.push(undo);
                    }
                }
                StitchMade {
                    result: Err(err),
                    leftovers,
                }
            }
        }
    }
}

/// Most idle stitched ranges kept mapped, whatever their bytes (each is a driver object).
const MAX_IDLE_STITCHED: usize = 4096;

/// Idle stitched ranges left after a collection forced by their count: a quarter of the
/// limit goes at once, so a loop that keeps stitching pays one device-wide wait per thousand
/// new ranges rather than one per range.
const IDLE_STITCHED_AFTER_COLLECTION: usize = MAX_IDLE_STITCHED / 4 * 3;

/// Idle stitched ranges examined per reuse attempt (bounds the cost of a miss), smallest
/// first and of one size the most recently used first. Ranges stitched in earlier steps of a
/// loop lose pieces to other allocations and pile up at the request's size: 16 examined by
/// slot order saw only stale ones, and a trace of SmartSwap under a cap made 8 new stitches a
/// step where the order and scan here make 2-3. A new stitch costs CUDA about 25 us per handle
/// it maps (100-190 handles for 1 GB), far more than checking a candidate's pieces.
const REUSE_SCAN: usize = 256;

/// The pieces of a stitched allocation: block ids while in use.
#[derive(Debug, Default)]
pub(super) struct StitchBlocks {
    pub(super) blocks: KeyMap<StitchId, Vec<BlockId>>,
}

impl Inner {
    /// Whether a stitched range (in use or cached) maps memory of `[va, va+size)`.
    pub(super) fn stitched_over(&self, va: DevicePtr, size: usize) -> bool {
        let end = va + size as u64;
        self.stitch.blocks.iter().any(|(_, s)| {
            s.pieces
                .iter()
                .any(|p| p.addr < end && va < p.addr + p.len as u64)
        })
    }

    /// Serves `size` from an idle stitched range of `tag`'s blocks whose leading pieces are
    /// free for `stream`.
    pub(super) fn reuse_stitched(
        &mut self,
        size: usize,
        stream: Stream,
        tag: Tag,
    ) -> Option<DevicePtr> {
        let max = ((size as f64) * self.config.reuse_limit) as usize;
        let found = self
            .stitch
            .idle_candidates(size, max.max(size))
            .take(REUSE_SCAN)
            .find(|&id| {
                let pieces = &self.stitch.blocks[id].pieces;
                // In a region every piece of a range in use must stay allocated: a free one's
                // segment could be given back while the range maps it, and a wake could not map
                // it again.
                let whole = !blocks::is_region(tag)
                    || pieces.iter().rev().skip(1).map(|p| p.len).sum::<usize>() < size;
                whole
                    && !self.stitch.blocks[id].asleep
                    && stitch::prefix(&self.stitch.blocks[id].pieces, size)
                        .all(|(addr, len)| self.free_for(addr, len, tag, stream))
            })?;
        let mut ids = Vec::new();
        for (addr, len) in stitch::prefix(&self.stitch.blocks[found].pieces, size) {
            // Checked above: each part lies inside one free block usable on `stream`.
            ids.push(self.map.take_range(addr, len, stream)?);
        }
        self.stitch.acquire(found, stream);
        self.stitch_blocks.blocks.insert(found, ids);
        let va = self.stitch.blocks[found].va;
        self.register(va, Target::Stitched(found), size, stream, PoolKind::Large);
        self.stats.stitch_reuse_hits += 1;
        self.stats.stitched_allocations += 1;
        Some(va)
    }

    /// Builds a new stitched range of `size` bytes from free blocks of `tag` and `stream`,
    /// creating new physical memory (of `tag`) for any shortfall. Only whole chunks map, so a
    /// free block offers the run of whole chunks inside it (at least `frag_limit` bytes); the
    /// last piece maps its last chunk whole but takes from the block only the bytes the
    /// request needs. In planning mode
    /// (see `unlocked`) the driver calls are left to be made outside the lock.
    pub(super) fn stitch_new(
        &mut self,
        device: &dyn crate::device::Device,
        size: usize,
        stream: Stream,
        tag: Tag,
    ) -> Result<Option<DevicePtr>> {
        let job = match self.prepare_growth(device, size, stream, tag)? {
            Some(job) => Some(job),
            None => self.prepare_stitch(device, size, stream, tag)?,
        };
        let Some(mut job) = job else {
            return Ok(None);
        };
        // A region's stitch is made under the lock, as its growth is: a sleep of the region
        // cannot come between taking its pieces and mapping them.
        if self.planning && self.routing == 0 && tag == SHARED {
            self.planned = Some(Planned::Stitch(job));
            return Ok(None);
        }
        let made = job.make(device);
        self.finish_stitch(device, job, made)
    }

    /// The part of a stitch made under the lock first: the plan, its pieces taken out of the
    /// free blocks (so no other request takes them), and the shortfall's bytes held against
    /// the cap.
    fn prepare_stitch(
        &mut self,
        device: &dyn crate::device::Device,
        size: usize,
        stream: Stream,
        tag: Tag,
    ) -> Result<Option<StitchJob>> {
        let min_piece = self.config.frag_limit.max(self.granularity);
        let (first, candidates) = self.stitch_candidates(tag, stream, min_piece);
        let Some(plan) = stitch::plan(first, candidates, size, self.config.max_stitch_pieces)
        else {
            return Ok(None);
        };
        self.take_plan(device, plan, size, stream, tag, None)
    }

    /// A stitch that grows the largest idle stitched range of the shared pool that is smaller
    /// than `size`, has all its pieces free for `stream` and room enough (see [`Growth`]): the
    /// range's pieces are taken, and the rest of the request is planned as a stitch of its
    /// own (free blocks, new memory, or both) to be mapped after them.
    fn prepare_growth(
        &mut self,
        device: &dyn crate::device::Device,
        size: usize,
        stream: Stream,
        tag: Tag,
    ) -> Result<Option<StitchJob>> {
        if !self.ranges_grow(tag) {
            return Ok(None);
        }
        let Some(range) = self.growable_range(size, stream) else {
            return Ok(None);
        };
        let s = &self.stitch.blocks[range];
        let (at, room, have) = (s.base() + s.mapped() as u64, s.room, s.size);
        // Its own piece count bounds the growth.
        let max_pieces = self.config.max_stitch_pieces.saturating_sub(s.pieces.len());
        if max_pieces == 0 {
            return Ok(None);
        }
        let parts: Vec<(DevicePtr, usize)> = s.pieces.iter().map(|p| (p.addr, p.len)).collect();
        let mut ids = Vec::with_capacity(parts.len());
        for (addr, len) in parts {
            match self.map.take_range(addr, len, stream) {
                Some(id) => ids.push(id),
                None => {
                    self.give_back(&ids, stream);
                    return Err(Error::internal(
                        "a growable stitched range's piece is not free",
                    ));
                }
            }
        }
        // In use from now on, so that no collection unmaps it while the job is made.
        self.stitch.acquire(range, stream);
        self.stitch_blocks.blocks.insert(range, ids);
        let rest = size - have;
        let min_piece = self.config.frag_limit.max(self.granularity);
        let (_, candidates) = self.stitch_candidates(tag, stream, min_piece);
        // With no free block to use, new memory alone.
        let plan = stitch::plan(None, candidates, rest, max_pieces).unwrap_or(stitch::StitchPlan {
            shortfall: rest,
            ..stitch::StitchPlan::default()
        });
        let job = self.take_plan(device, plan, size, stream, tag, Some(room));
        match job {
            Ok(Some(mut job)) => {
                job.grows = Some(Growth { range, at });
                Ok(Some(job))
            }
            other => {
                self.let_go(Some(Growth { range, at }), stream);
                other
            }
        }
    }

    /// Whether `tag`'s stitched ranges grow in place: the shared pool's, with growing on and
    /// no capture routing requests to a private pool.
    fn ranges_grow(&self, tag: Tag) -> bool {
        self.config.grow_stitched && tag == SHARED && self.routing == 0
    }

    /// The idle stitched range a request of `size` bytes grows (see [`Inner::prepare_growth`]),
    /// largest first among those of at least half its size.
    fn growable_range(&self, size: usize, stream: Stream) -> Option<StitchId> {
        self.stitch
            .idle_candidates(size / 2, size.checked_sub(1)?)
            .rev()
            .take(REUSE_SCAN)
            .find(|&id| {
                let s = &self.stitch.blocks[id];
                !s.asleep
                    && s.ends_on_a_handle()
                    && size - s.size <= s.room
                    // Mappings a failed teardown left in its room would refuse the growth's.
                    && !self.unmap_pending(s.base() + s.mapped() as u64, s.room)
                    && s.pieces
                        .iter()
                        .all(|p| self.free_for(p.addr, p.len, SHARED, stream))
            })
    }

    /// Whether `[addr, addr+len)` lies inside one free block of `tag` usable on `stream`.
    fn free_for(&self, addr: DevicePtr, len: usize, tag: Tag, stream: Stream) -> bool {
        self.map.block_containing(addr).is_some_and(|b| {
            let b = &self.map.blocks[b];
            self.map.segments[b.segment].tag == tag
                && b.state == BlockState::Free
                && (b.owner.is_none() || b.owner == Some(stream))
                && addr + len as u64 <= b.addr + b.size as u64
        })
    }

    /// A growth that did not happen: the range's pieces go back to the free blocks and the
    /// range back to the idle ones.
    fn let_go(&mut self, growth: Option<Growth>, stream: Stream) {
        if let Some(growth) = growth {
            let ids = self.stitch_blocks.blocks.remove(&growth.range);
            self.give_back(&ids.unwrap_or_default(), stream);
            self.stitch.park(growth.range);
        }
    }

    /// Takes the blocks of `plan` out of the free sets and books what it needs of new memory,
    /// as a job for the driver serving a request of `size` bytes (a growth's plan covers the
    /// part its range lacks). With `room`, none when the plan would map more than that.
    fn take_plan(
        &mut self,
        device: &dyn crate::device::Device,
        mut plan: stitch::StitchPlan,
        size: usize,
        stream: Stream,
        tag: Tag,
        room: Option<usize>,
    ) -> Result<Option<StitchJob>> {
        // New memory comes in whole granules; what the request leaves of the last one stays
        // free in its segment.
        let grown = super::sizes::large_segment(plan.shortfall, self.granularity)?;
        if grown > 0 && !self.fits_cap(grown) {
            return Ok(None);
        }
        if room.is_some_and(|room| {
            self.plan_maps(&plan)
                .is_none_or(|maps| maps.saturating_add(grown) > room)
        }) {
            return Ok(None);
        }
        // Gathered segments leave the books now (their bytes join the shortfall, the cap sees
        // no change); their memory goes back to the device before the shortfall is made.
        let gathered = if self.config.gather && tag == SHARED && self.routing == 0 {
            self.gather(device, &mut plan, size, grown, stream, room.is_some())?
        } else {
            super::gather::Gathered::default()
        };
        let grown = grown + gathered.bytes;
        if grown > 0 && !plan.new_memory_before_last && self.stops_short(plan.take.last()) {
            // New memory mapped after the last piece would follow its last chunk's end, not
            // its bytes (a plan that covered the request, whose gathered segments became new
            // memory): it goes before that piece.
            plan.new_memory_before_last = true;
        }
        if plan.new_memory_before_last {
            // The new segment is taken whole, so that the last piece follows it: the part of
            // its last granule the request would have left is taken from the last piece (at
            // least a piece's worth, more than a granule's rest).
            let slack = grown - plan.shortfall;
            let last = plan.take.last_mut().filter(|last| last.1 > slack);
            let Some(last) = last else {
                self.bury_all(device, gathered.zombies);
                return Err(Error::internal(
                    "a stitch's last piece is shorter than a granule",
                ));
            };
            last.1 -= slack;
            plan.shortfall = grown;
        }
        // Where each planned piece lies and what maps it, before taking splits the blocks.
        let takes: Vec<(BlockId, usize, bool)> = (plan.first.iter().map(|&(id, b)| (id, b, true)))
            .chain(plan.take.iter().map(|&(id, b)| (id, b, false)))
            .collect();
        let mut pieces: Vec<Piece> = Vec::with_capacity(takes.len() + 1);
        let mut lead = 0;
        for &(id, bytes, first) in &takes {
            let Some(piece) = self.stitch_piece(id, bytes, first) else {
                self.bury_all(device, gathered.zombies);
                return Err(Error::internal(
                    "a planned stitch piece has no chunk boundary",
                ));
            };
            if first {
                lead = piece.1;
            }
            pieces.push(piece.0);
        }
        let mut ids: Vec<BlockId> = Vec::with_capacity(takes.len() + 1);
        for (piece, &(_, bytes, _)) in pieces.iter().zip(&takes) {
            match self.map.take_range(piece.addr, bytes, stream) {
                Some(id) => ids.push(id),
                None => {
                    self.give_back(&ids, stream);
                    self.bury_all(device, gathered.zombies);
                    return Err(Error::internal("a planned stitch piece is not free"));
                }
            }
        }
        self.sync_split_stats();
        if grown > 0 {
            // With the pieces taken, giving cached memory back cannot take them.
            let room = self
                .respect_soft_limit(device, grown)
                .map(|()| self.fits_cap(grown));
            if room != Ok(true) {
                self.give_back(&ids, stream);
                self.bury_all(device, gathered.zombies);
                return room.map(|_| None);
            }
        }
        let shortfall = (grown > 0).then(|| {
            self.growing += grown;
            GrowthPlan::new(self, PoolKind::Large, grown, tag)
        });
        Ok(Some(StitchJob {
            size,
            stream,
            tag,
            pieces,
            lead,
            ids,
            shortfall,
            shortfall_bytes: plan.shortfall,
            new_memory_before_last: plan.new_memory_before_last,
            access: self.access.clone(),
            granularity: self.granularity,
            gathered: gathered.zombies,
            grows: None,
            may_grow: self.ranges_grow(tag),
        }))
    }

    /// Bytes the free blocks of `plan` map: the whole chunks of each of its pieces (None when
    /// one of them cannot be mapped as a piece). Gathering and the new memory's place move
    /// bytes between the pieces and the new memory, never adding any.
    fn plan_maps(&self, plan: &stitch::StitchPlan) -> Option<usize> {
        let first = plan.first.iter().map(|&(id, b)| (id, b, true));
        let rest = plan.take.iter().map(|&(id, b)| (id, b, false));
        first
            .chain(rest)
            .map(|(id, bytes, first)| {
                let (piece, _) = self.stitch_piece(id, bytes, first)?;
                Some(piece.handles.iter().map(|&(_, len)| len).sum::<usize>())
            })
            .sum()
    }

    /// The free blocks of `tag` usable on `stream` that a stitch could map part of (at least
    /// `min_piece` bytes), largest first, and the one to map first: the block with the most
    /// free bytes at the end of a chunk whose front is allocated (no other piece can map them).
    fn stitch_candidates(
        &self,
        tag: Tag,
        stream: Stream,
        min_piece: usize,
    ) -> (Option<(BlockId, usize)>, Vec<stitch::Candidate>) {
        let map = &self.map;
        let mut first: Option<(usize, BlockId, usize)> = None;
        let mut candidates = Vec::new();
        for (_, id) in map.largest_free_blocks(tag, PoolKind::Large, stream, min_piece) {
            let Some((lo, hi)) = map.chunk_edges_of(id) else {
                continue;
            };
            let b = &map.blocks[id];
            let head = (lo - b.addr) as usize;
            let whole = (hi - lo) as usize;
            let tail = (b.addr + b.size as u64 - hi) as usize;
            if head > 0 && head + whole >= min_piece && first.is_none_or(|(most, ..)| head > most) {
                first = Some((head, id, head + whole));
            }
            if whole + tail >= min_piece {
                // Fewer whole bytes than a piece is worth: only as the last piece, which takes
                // them and the tail after them as one run.
                let (whole, tail) = if whole >= min_piece {
                    (whole, tail)
                } else {
                    (0, whole + tail)
                };
                candidates.push(stitch::Candidate {
                    block: id,
                    whole,
                    tail,
                });
            }
        }
        let first = first.map(|(_, id, bytes)| (id, bytes));
        if let Some((id, _)) = first {
            candidates.retain(|c| c.block != id);
        }
        (first, candidates)
    }

    /// Whether the take `(block, bytes)` (from the block's first chunk boundary) stops before
    /// the end of the whole chunks it starts in: a piece mapped after it would not follow its
    /// bytes.
    fn stops_short(&self, take: Option<&(BlockId, usize)>) -> bool {
        take.and_then(|&(id, bytes)| {
            let (lo, hi) = self.map.chunk_edges_of(id)?;
            Some(lo + bytes as u64 != hi)
        })
        .unwrap_or(false)
    }

    /// The piece that takes `bytes` of free block `id`, from its start when it is the stitch's
    /// `first` piece, else from its first chunk boundary; with the bytes its first chunk maps
    /// before it. The piece ends with its last chunk or, where another allocation holds the
    /// end of that chunk, with its block.
    fn stitch_piece(&self, id: BlockId, bytes: usize, first: bool) -> Option<(Piece, usize)> {
        let b = &self.map.blocks[id];
        let (lo, _) = self.map.chunk_edges_of(id)?;
        let start = if first { b.addr } else { lo };
        let segment = &self.map.segments[b.segment];
        let chunks = segment.chunks_covering(start, bytes);
        let (head, last) = (chunks.first()?, chunks.last()?);
        let chunk_end = segment.va + (last.offset + last.len) as u64;
        let end = chunk_end.min(b.addr + b.size as u64);
        let lead = (start - (segment.va + head.offset as u64)) as usize;
        let piece = Piece {
            addr: start,
            len: (end - start) as usize,
            handles: blocks::handle_layout(chunks),
        };
        Some((piece, lead))
    }

    /// Tears down `zombies` now, keeping what fails for a retry.
    pub(super) fn bury_all(&mut self, device: &dyn crate::device::Device, zombies: Vec<Zombie>) {
        for zombie in zombies {
            self.bury(device, zombie);
        }
    }

    /// The last part of a stitch, under the lock: the shortfall's segment booked, the range
    /// registered as the allocation; on failure the pieces go back to the free blocks.
    pub(super) fn finish_stitch(
        &mut self,
        device: &dyn crate::device::Device,
        job: StitchJob,
        made: StitchMade,
    ) -> Result<Option<DevicePtr>> {
        let StitchJob {
            size,
            stream,
            tag,
            mut pieces,
            lead,
            mut ids,
            shortfall,
            shortfall_bytes,
            new_memory_before_last,
            access,
            grows,
            may_grow,
            ..
        } = job;
        self.zombies.extend(made.leftovers);
        if let Some(plan) = &shortfall {
            self.growing -= plan.size();
        }
        let (va, segment) = match made.result {
            Ok(Some(done)) => done,
            other => {
                self.give_back(&ids, stream);
                self.let_go(grows, stream);
                return other.map(|_| None);
            }
        };
        if access != self.access {
            // A peer was granted access meanwhile: nothing made with the old access is booked
            // (the allocation is made again under the lock).
            let handles = mapping_order(&pieces, &segment, new_memory_before_last);
            let mapped: usize = handles.iter().map(|&(_, len)| len).sum();
            // A grown range keeps its own reservation: only the added mappings go.
            let stitched = Zombie {
                unmaps: mappings(va, &handles),
                handles: Vec::new(),
                reservation: grows
                    .is_none()
                    .then(|| (va, mapped + growth_room(mapped, may_grow))),
            };
            self.discard(device, stitched);
            if let Some((segment_va, chunks)) = &segment {
                let size = chunks.iter().map(|c| c.len).sum();
                self.discard(
                    device,
                    Zombie {
                        reservation: Some((*segment_va, size)),
                        ..Zombie::mapped(*segment_va, chunks)
                    },
                );
            }
            self.give_back(&ids, stream);
            self.let_go(grows, stream);
            return Ok(None);
        }
        if let (Some(plan), Some((segment_va, chunks))) = (shortfall, segment) {
            let handles = blocks::handle_layout(&chunks);
            let id = self.add_new_segment(
                device,
                segment_va,
                plan.size(),
                chunks,
                PoolKind::Large,
                tag,
                0,
            );
            self.map.take_front(id, shortfall_bytes, stream);
            let at = if new_memory_before_last {
                pieces.len().saturating_sub(1)
            } else {
                pieces.len()
            };
            ids.insert(at, id);
            pieces.insert(
                at,
                Piece {
                    addr: segment_va,
                    len: plan.size(),
                    handles,
                },
            );
        }
        let piece_count = pieces.len();
        let grows_range = grows.is_some();
        let mapped: usize = pieces.iter().flat_map(|p| &p.handles).map(|h| h.1).sum();
        let id = match grows {
            Some(growth) => {
                self.stitch.grow(growth.range, pieces);
                let own = self.stitch_blocks.blocks.remove(&growth.range);
                ids.splice(0..0, own.unwrap_or_default());
                self.stitch_growths += 1;
                growth.range
            }
            None => {
                self.stats.stitched_blocks.add(1);
                let room = growth_room(mapped, may_grow);
                self.stitch.insert(va, lead, pieces, stream, room)
            }
        };
        let va = self.stitch.blocks[id].va;
        self.stitch_blocks.blocks.insert(id, ids);
        self.register(va, Target::Stitched(id), size, stream, PoolKind::Large);
        self.stats.stitches += 1;
        self.stats.stitched_bytes += size as i64;
        self.stats.stitched_pieces += piece_count as i64;
        self.stats.stitched_allocations += 1;
        self.stats.stitched_mapped_bytes.add(mapped as i64);
        if log::log_enabled!(log::Level::Debug) {
            // What a stitch costs on CUDA grows with the handles it maps; an idle range at least
            // as large that could not be reused had some of its pieces in use.
            let handles = &self.stitch.blocks[id].pieces;
            let mappings: usize = handles[handles.len() - piece_count..]
                .iter()
                .map(|p| p.handles.len())
                .sum();
            let idle_larger = self.stitch.idle_candidates(size, usize::MAX).count();
            let grew = if grows_range { " (grown in place)" } else { "" };
            log::debug!(
                "glake: fuse {piece_count} pieces ({mappings} handles) into {size} bytes at {va:#x}{grew} on device {} ({idle_larger} idle stitched ranges as large were not free)",
                device.ordinal()
            );
        }
        if let Err(err) = self.collect_stitched(device, false) {
            log::warn!("glake: collecting stitched blocks failed: {err}");
        }
        Ok(Some(va))
    }

    /// The pool (shared, or a sleep region) whose blocks stitched range `id` maps.
    pub(super) fn stitch_tag(&self, id: StitchId) -> Option<Tag> {
        let piece = self.stitch.blocks[id].pieces.first()?;
        let block = self.map.block_containing(piece.addr)?;
        Some(self.map.segments[self.map.blocks[block].segment].tag)
    }

    /// The stitched ranges of `tag`'s blocks that `keep` selects.
    fn stitches_of(&self, tag: Tag, keep: impl Fn(&stitch::Stitched) -> bool) -> Vec<StitchId> {
        self.stitch
            .blocks
            .iter()
            .filter(|(_, s)| keep(s))
            .map(|(id, _)| id)
            .filter(|&id| self.stitch_tag(id) == Some(tag))
            .collect()
    }

    /// Marks stitched range `id` asleep (unmapped, its address kept) or awake (mapped again),
    /// in the cache and in the statistics of mapped bytes.
    fn set_stitch_asleep(&mut self, id: StitchId, asleep: bool) {
        if self.stitch.set_asleep(id, asleep) {
            let size = self.stitch.blocks[id].mapped() as i64;
            self.stats
                .stitched_mapped_bytes
                .add(if asleep { -size } else { size });
        }
    }

    /// Region `tag` is going to sleep (the device is idle): its idle stitched ranges go, and
    /// the ranges in use lose their mappings but keep their addresses, so that no mapping
    /// holds the region's physical memory once its segments give it back. Their bytes live in
    /// their pieces, which are allocated blocks of the region's segments: the sleep keeps them.
    pub(super) fn sleep_stitches(&mut self, device: &dyn crate::device::Device, tag: Tag) {
        for id in self.stitches_of(tag, |s| !s.asleep) {
            let s = &self.stitch.blocks[id];
            if s.in_use {
                let unmaps = mappings(s.base(), s.pieces.iter().flat_map(|p| &p.handles));
                self.set_stitch_asleep(id, true);
                self.bury(
                    device,
                    Zombie {
                        unmaps,
                        handles: Vec::new(),
                        reservation: None,
                    },
                );
            } else {
                self.drop_stitched(device, id);
            }
        }
    }

    /// Unmaps (unless asleep) and forgets idle stitched range `id`, its range freed.
    fn drop_stitched(&mut self, device: &dyn crate::device::Device, id: StitchId) {
        let s = self.stitch.remove(id);
        self.stats.stitch_collections += 1;
        self.stats.stitched_blocks.add(-1);
        let unmaps = if s.asleep {
            Vec::new()
        } else {
            self.stats.stitched_mapped_bytes.add(-(s.mapped() as i64));
            mappings(s.base(), s.pieces.iter().flat_map(|p| &p.handles))
        };
        let zombie = Zombie {
            unmaps,
            handles: Vec::new(),
            reservation: Some((s.base(), s.reserved())),
        };
        self.bury(device, zombie);
    }

    /// Region `tag`'s sleeping stitched ranges whose allocations were freed: their ranges go
    /// (nothing maps them).
    pub(super) fn drop_freed_stitches(&mut self, device: &dyn crate::device::Device, tag: Tag) {
        for id in self.stitches_of(tag, |s| s.asleep && !s.in_use) {
            self.drop_stitched(device, id);
        }
    }

    /// Region `tag`'s segments hold memory again: its sleeping stitched ranges are mapped over
    /// their pieces' new handles, at the addresses they had. On failure the ranges not yet
    /// mapped stay asleep (and the region with them); calling again goes on from there.
    pub(super) fn wake_stitches(
        &mut self,
        device: &dyn crate::device::Device,
        tag: Tag,
    ) -> Result<()> {
        for id in self.stitches_of(tag, |s| s.asleep && s.in_use) {
            let (va, size) = (
                self.stitch.blocks[id].base(),
                self.stitch.blocks[id].mapped(),
            );
            self.clear_old_mappings(device, va, size)?;
            let mut pieces = Vec::with_capacity(self.stitch.blocks[id].pieces.len());
            for piece in &self.stitch.blocks[id].pieces {
                let before: usize = piece.handles.iter().map(|&(_, len)| len).sum();
                let handles = self
                    .map
                    .block_containing(piece.addr)
                    .map(|b| &self.map.segments[self.map.blocks[b].segment])
                    .map(|segment| {
                        blocks::handle_layout(segment.chunks_covering(piece.addr, piece.len))
                    })
                    .unwrap_or_default();
                if handles.iter().map(|&(_, len)| len).sum::<usize>() != before {
                    return Err(Error::internal(
                        "a sleeping stitched range's piece is not whole chunks of an awake segment",
                    ));
                }
                pieces.push(handles);
            }
            let handles: Vec<(PhysHandle, usize)> = pieces.iter().flatten().copied().collect();
            if let Err((err, zombie)) = map_at(device, va, &handles, &self.access) {
                self.bury(device, zombie);
                return Err(err.context("mapping a stitched range back"));
            }
            let s = &mut self.stitch.blocks[id];
            for (piece, handles) in s.pieces.iter_mut().zip(pieces) {
                piece.handles = handles;
            }
            self.set_stitch_asleep(id, false);
        }
        Ok(())
    }

    /// Returns blocks taken for a stitch that did not happen to the free sets of `stream`.
    fn give_back(&mut self, ids: &[BlockId], stream: Stream) {
        for &id in ids {
            self.release_block(id, Some(stream));
        }
        self.sync_split_stats();
    }

    /// Unmaps idle stitched ranges: all of them when `all`, else the least recently used ones
    /// past the auto-GC byte limit, or, past the idle-count limit, down to
    /// [`IDLE_STITCHED_AFTER_COLLECTION`] of them.
    pub(super) fn collect_stitched(
        &mut self,
        device: &dyn crate::device::Device,
        all: bool,
    ) -> Result<()> {
        if self.routing > 0 {
            return Ok(());
        }
        let victims = self.stitched_victims(all);
        if victims.is_empty() {
            return Ok(());
        }
        // The ranges were last used on some stream whose work may still be queued.
        device.synchronize_device()?;
        self.stats.num_sync_all_streams += 1;
        self.drop_idle_stitched(device, victims);
        Ok(())
    }

    /// Unmaps every idle stitched range, right after a wait for the whole device (which no
    /// queued work can outlast), so without another one.
    pub(super) fn drop_all_idle_stitched(&mut self, device: &dyn crate::device::Device) {
        let victims = self.stitched_victims(true);
        self.drop_idle_stitched(device, victims);
    }

    fn drop_idle_stitched(&mut self, device: &dyn crate::device::Device, victims: Vec<StitchId>) {
        for id in victims {
            self.drop_stitched(device, id);
        }
    }

    /// The idle stitched ranges [`Inner::collect_stitched`] would unmap, least recently used
    /// first.
    fn stitched_victims(&self, all: bool) -> Vec<StitchId> {
        let over_bytes = self.stitch.mapped_bytes > self.config.auto_gc_bytes;
        let over_count = self.stitch.idle_count() > MAX_IDLE_STITCHED;
        let keep_idle = if over_count {
            IDLE_STITCHED_AFTER_COLLECTION
        } else {
            MAX_IDLE_STITCHED
        };
        if !all && !over_bytes && !over_count {
            return Vec::new();
        }
        let mut victims = Vec::new();
        let mut mapped = self.stitch.mapped_bytes;
        let mut idle = self.stitch.idle_count();
        for id in self.stitch.idle_lru() {
            if !all && mapped <= self.config.auto_gc_bytes && idle <= keep_idle {
                break;
            }
            // A range freed while its region sleeps maps nothing.
            if !self.stitch.blocks[id].asleep {
                mapped -= self.stitch.blocks[id].mapped();
            }
            idle -= 1;
            victims.push(id);
        }
        victims
    }
}
