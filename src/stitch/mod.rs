//! Stitching (GMLake): when no free block is large enough, the physical pieces behind several
//! free blocks are mapped into one new contiguous virtual range.
//!
//! This module plans stitches and keeps the registry of stitched ranges; it works on addresses
//! and sizes only. A stitched range stays mapped after its allocation is freed (a cached
//! stitched block), so that a later request of a similar size reuses it without driver calls,
//! as long as all of its pieces are free again.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};

use slab::Slab;

use crate::device::{DevicePtr, PhysHandle, Stream};

pub type StitchId = usize;

/// One piece of a stitched range: `len` bytes of a segment, starting at `addr` in the segment's
/// own range, backed by `handles` (whole physical handles with their lengths, in order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub addr: DevicePtr,
    pub len: usize,
    pub handles: Vec<(PhysHandle, usize)>,
}

/// A mapped stitched range.
#[derive(Debug, Clone)]
pub struct Stitched {
    /// Where its bytes start: the address handed out.
    pub va: DevicePtr,
    /// Its bytes: the pieces' lengths.
    pub size: usize,
    /// Bytes mapped before `va`: the part of the first piece's first chunk that another
    /// allocation holds (see [`StitchPlan::first`]). Nothing hands them out.
    pub lead: usize,
    pub pieces: Vec<Piece>,
    /// Whether an allocation uses the range now.
    pub in_use: bool,
    /// The stream of the last allocation that used it (work there may still touch the range).
    pub stream: Stream,
    /// Logical time of the last use, for least-recently-used collection.
    pub last_use: u64,
    /// Its pieces lie in a sleep region that sleeps: the range stays reserved with nothing
    /// mapped, and is mapped again over the pieces' new memory when the region wakes (or
    /// freed then, if its allocation was freed meanwhile).
    pub asleep: bool,
    /// Address space reserved after the mapped bytes: a larger request can grow the range
    /// there, mapping (and paying the access grant of) only the handles it adds.
    pub room: usize,
}

impl Stitched {
    /// Where its mapping starts.
    pub fn base(&self) -> DevicePtr {
        self.va - self.lead as u64
    }

    /// Bytes it maps: its pieces' whole handles, which may reach beyond its bytes at both ends.
    pub fn mapped(&self) -> usize {
        self.pieces
            .iter()
            .flat_map(|p| &p.handles)
            .map(|&(_, len)| len)
            .sum()
    }

    /// Bytes of address space it holds from [`Stitched::base`].
    pub fn reserved(&self) -> usize {
        self.mapped() + self.room
    }

    /// Whether pieces mapped after its last handle would follow its bytes: its last piece
    /// ends where its last handle does.
    pub fn ends_on_a_handle(&self) -> bool {
        self.va + self.size as u64 == self.base() + self.mapped() as u64
    }
}

/// Where an idle range sorts: by size, then most recently used first. A range whose pieces
/// other allocations took stays idle, sinking behind the ranges of its size that were reused
/// since, so a bounded scan meets the ranges most likely to be free first.
type IdleKey = (usize, Reverse<u64>, StitchId);

/// The registry of stitched ranges.
#[derive(Debug, Default)]
pub struct StitchCache {
    pub blocks: Slab<Stitched>,
    idle_by_size: BTreeSet<IdleKey>,
    by_va: HashMap<DevicePtr, StitchId>,
    clock: u64,
    pub mapped_bytes: usize,
}

impl StitchCache {
    /// Registers a range mapped at `base` whose bytes start `lead` bytes into it, with `room`
    /// bytes of address space reserved after its mapping.
    pub fn insert(
        &mut self,
        base: DevicePtr,
        lead: usize,
        pieces: Vec<Piece>,
        stream: Stream,
        room: usize,
    ) -> StitchId {
        let size = pieces.iter().map(|p| p.len).sum();
        let va = base + lead as u64;
        self.clock += 1;
        let id = self.blocks.insert(Stitched {
            va,
            size,
            lead,
            pieces,
            in_use: true,
            stream,
            last_use: self.clock,
            asleep: false,
            room,
        });
        self.by_va.insert(va, id);
        self.mapped_bytes += self.blocks[id].mapped();
        id
    }

    pub fn by_va(&self, va: DevicePtr) -> Option<StitchId> {
        self.by_va.get(&va).copied()
    }

    /// The stitched range containing `addr`.
    pub fn containing(&self, addr: DevicePtr) -> Option<StitchId> {
        self.blocks
            .iter()
            .find(|(_, s)| addr >= s.va && addr < s.va + s.size as u64)
            .map(|(id, _)| id)
    }

    /// Marks a stitched range in use by an allocation on `stream`.
    pub fn acquire(&mut self, id: StitchId, stream: Stream) {
        self.clock += 1;
        let s = &mut self.blocks[id];
        self.idle_by_size.remove(&(s.size, Reverse(s.last_use), id));
        s.in_use = true;
        s.stream = stream;
        s.last_use = self.clock;
    }

    /// Appends `pieces`, mapped in its room after its last handle, to range `id`, which an
    /// allocation holds (so it sits in no idle list).
    pub fn grow(&mut self, id: StitchId, pieces: Vec<Piece>) {
        let s = &mut self.blocks[id];
        let added: usize = pieces
            .iter()
            .flat_map(|p| &p.handles)
            .map(|&(_, l)| l)
            .sum();
        debug_assert!(
            added <= s.room,
            "a growth maps {added} bytes into {} of room",
            s.room
        );
        s.size += pieces.iter().map(|p| p.len).sum::<usize>();
        s.room = s.room.saturating_sub(added);
        s.pieces.extend(pieces);
        self.mapped_bytes += added;
    }

    /// Marks a stitched range idle (its allocation was freed); it stays mapped.
    pub fn park(&mut self, id: StitchId) {
        let s = &mut self.blocks[id];
        s.in_use = false;
        self.idle_by_size.insert((s.size, Reverse(s.last_use), id));
    }

    /// Forgets a range (after it was unmapped).
    pub fn remove(&mut self, id: StitchId) -> Stitched {
        let s = self.blocks.remove(id);
        self.idle_by_size.remove(&(s.size, Reverse(s.last_use), id));
        self.by_va.remove(&s.va);
        if !s.asleep {
            self.mapped_bytes -= s.mapped();
        }
        s
    }

    /// Marks a range asleep (its mappings gone, its address kept) or awake again (mapped),
    /// keeping [`StitchCache::mapped_bytes`] to what is mapped. Returns whether it changed.
    pub fn set_asleep(&mut self, id: StitchId, asleep: bool) -> bool {
        let s = &mut self.blocks[id];
        if s.asleep == asleep {
            return false;
        }
        s.asleep = asleep;
        if asleep {
            self.mapped_bytes -= s.mapped();
        } else {
            self.mapped_bytes += s.mapped();
        }
        true
    }

    /// Idle ranges whose size lies in `[min, max]`, smallest first, and of one size the most
    /// recently used first.
    pub fn idle_candidates(
        &self,
        min: usize,
        max: usize,
    ) -> impl DoubleEndedIterator<Item = StitchId> + '_ {
        self.idle_by_size
            .range((min, Reverse(u64::MAX), 0)..=(max, Reverse(0), usize::MAX))
            .map(|&(_, _, id)| id)
    }

    pub fn idle_count(&self) -> usize {
        self.idle_by_size.len()
    }

    /// Idle ranges, least recently used first.
    pub fn idle_lru(&self) -> Vec<StitchId> {
        let mut ids: Vec<StitchId> = self.idle_by_size.iter().map(|&(_, _, id)| id).collect();
        ids.sort_unstable_by_key(|&id| self.blocks[id].last_use);
        ids
    }
}

/// The parts of `pieces` that back the first `size` bytes of their stitched range, as
/// (address in the home segment, length): whole pieces, then the front of the piece where
/// `size` ends. A cached stitched range larger than a request serves it from this prefix, so
/// the rest of its pieces stay free for others and nothing is handed out beyond the request.
pub fn prefix(pieces: &[Piece], size: usize) -> impl Iterator<Item = (DevicePtr, usize)> + '_ {
    let mut left = size;
    pieces.iter().map_while(move |p| {
        if left == 0 {
            return None;
        }
        let len = p.len.min(left);
        left -= len;
        Some((p.addr, len))
    })
}

/// Which free blocks a stitch uses: each entry of `take` takes the first `bytes` of block
/// `block` from its first chunk boundary on.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StitchPlan {
    /// The piece mapped first, taken from the very start of its block: the free end of a
    /// chunk whose front another allocation holds, then the whole chunks after it. The chunk
    /// is mapped whole and the stitched bytes start inside it, so free bytes no other stitch
    /// could map serve this one.
    pub first: Option<(usize, usize)>,
    pub take: Vec<(usize, usize)>,
    /// Bytes still missing after the free blocks, to be covered by new physical memory.
    pub shortfall: usize,
    /// The new memory is mapped before the last piece (not after it): that piece then ends in
    /// the free front of a chunk whose end another allocation holds, which no piece followed
    /// by another can map. Its bytes are then all it offers.
    pub new_memory_before_last: bool,
}

/// A free block as a stitch sees it: `whole` bytes of whole chunks from its first chunk
/// boundary, then `tail` free bytes of a chunk whose end another allocation holds (only the
/// last piece of a stitch may map such a chunk).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub block: usize,
    pub whole: usize,
    pub tail: usize,
}

/// Plans a stitch of `size` bytes: `first` (block, bytes), if given, then `candidates`
/// (largest first), each a middle piece of its whole chunks, and the one that completes the
/// request its last, with its tail if needed. When the free blocks fall short, the candidate
/// with the largest tail becomes the last piece, after the new memory.
///
/// Largest blocks first keeps the number of pieces (and so the per-handle access cost) low.
/// At most `max_pieces` pieces are used, one of them kept for the shortfall if the free blocks
/// do not cover the request. Returns None when no free block would be used.
pub fn plan(
    first: Option<(usize, usize)>,
    candidates: impl IntoIterator<Item = Candidate>,
    size: usize,
    max_pieces: usize,
) -> Option<StitchPlan> {
    let mut plan = StitchPlan {
        // A first piece that covers the request alone is a block a plain fit takes.
        first: first.filter(|&(_, bytes)| bytes < size && max_pieces >= 2),
        ..StitchPlan::default()
    };
    let mut covered = plan.first.map_or(0, |(_, bytes)| bytes);
    let mut pieces = usize::from(plan.first.is_some());
    // Middle pieces taken, and blocks passed over, whose tails could end the stitch.
    let (mut middles, mut tails_only) = (Vec::new(), Vec::new());
    let mut full = false;
    for c in candidates {
        if covered == size {
            break;
        }
        let left = size - covered;
        let last = c.whole + c.tail >= left;
        if !last && c.whole == 0 {
            tails_only.push(c);
            continue;
        }
        // A middle piece keeps one for the shortfall.
        if pieces + 1 + usize::from(!last) > max_pieces {
            full = true;
            break;
        }
        let bytes = if last { left } else { c.whole };
        plan.take.push((c.block, bytes));
        middles.push(c);
        pieces += 1;
        covered += bytes;
    }
    if covered < size && !full {
        end_with_a_tail(
            &mut plan,
            &middles,
            &tails_only,
            size - covered,
            pieces,
            max_pieces,
        );
    } else {
        plan.shortfall = size - covered;
    }
    if plan.take.is_empty() && plan.first.is_none() {
        return None;
    }
    Some(plan)
}

/// A plan `missing` bytes short: the middle piece or passed-over block with the largest tail
/// becomes its last piece, taking its whole chunks and as much of its tail as needed; new
/// memory, if still needed, goes before it.
fn end_with_a_tail(
    plan: &mut StitchPlan,
    middles: &[Candidate],
    tails_only: &[Candidate],
    missing: usize,
    pieces: usize,
    max_pieces: usize,
) {
    let best_middle = middles.iter().enumerate().max_by_key(|(_, c)| c.tail);
    let best_other = tails_only.iter().max_by_key(|c| c.tail);
    let middle_tail = best_middle.map_or(0, |(_, c)| c.tail);
    let (c, added_piece) = match (best_middle, best_other) {
        (_, Some(other)) if other.tail > middle_tail => (*other, true),
        (Some((k, c)), _) if c.tail > 0 => {
            plan.take.remove(k);
            (*c, false)
        }
        _ => {
            plan.shortfall = missing;
            return;
        }
    };
    if added_piece && pieces + 2 > max_pieces {
        plan.shortfall = missing;
        return;
    }
    let extra = c.tail.min(missing);
    plan.take.push((c.block, c.whole + extra));
    plan.shortfall = missing - extra;
    plan.new_memory_before_last = plan.shortfall > 0;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_cuts_the_last_piece() {
        let piece = |addr, len| Piece {
            addr,
            len,
            handles: Vec::new(),
        };
        let pieces = [piece(100, 8), piece(300, 8), piece(500, 8)];
        assert_eq!(
            prefix(&pieces, 12).collect::<Vec<_>>(),
            vec![(100, 8), (300, 4)]
        );
        assert_eq!(prefix(&pieces, 8).collect::<Vec<_>>(), vec![(100, 8)]);
        assert_eq!(prefix(&pieces, 24).count(), 3);
    }

    /// Candidates of whole chunks only, from `(bytes, block)` pairs.
    fn whole(pairs: &[(usize, usize)]) -> Vec<Candidate> {
        pairs
            .iter()
            .map(|&(whole, block)| Candidate {
                block,
                whole,
                tail: 0,
            })
            .collect()
    }

    #[test]
    fn plan_uses_largest_first_and_splits_the_last() {
        let c = whole(&[(8, 1), (6, 2), (4, 3)]);
        let p = plan(None, c, 12, 8).unwrap();
        assert_eq!(p.take, vec![(1, 8), (2, 4)]);
        assert_eq!(p.shortfall, 0);
    }

    #[test]
    fn plan_reports_shortfall_and_respects_piece_limit() {
        let c = whole(&[(4, 1), (4, 2), (4, 3)]);
        let p = plan(None, c.clone(), 20, 8).unwrap();
        assert_eq!(p.take.len(), 3);
        assert_eq!(p.shortfall, 8);
        let p = plan(None, c, 20, 3).unwrap();
        assert_eq!(p.take.len(), 2, "one piece kept for the shortfall");
        assert_eq!(p.shortfall, 12);
        assert!(plan(None, [], 20, 8).is_none());
    }

    #[test]
    fn a_partial_chunk_serves_as_the_first_or_the_last_piece_only() {
        let c = [
            // Whole chunks only.
            Candidate {
                block: 1,
                whole: 8,
                tail: 0,
            },
            // Its free bytes end inside a chunk: no middle piece.
            Candidate {
                block: 2,
                whole: 0,
                tail: 6,
            },
            Candidate {
                block: 3,
                whole: 4,
                tail: 3,
            },
        ];
        // 5 from the first piece, 8 whole, then not block 2 (its tail is short) but block
        // 3's 4 whole and all 3 of its tail.
        let p = plan(Some((9, 5)), c, 20, 8).unwrap();
        assert_eq!(p.first, Some((9, 5)));
        assert_eq!(p.take, vec![(1, 8), (3, 7)]);
        assert_eq!(p.shortfall, 0);
        // Block 2 completes a request its tail covers.
        let p = plan(Some((9, 5)), c, 18, 8).unwrap();
        assert_eq!(p.take, vec![(1, 8), (2, 5)]);
        // Too short: whole chunks, new memory, then the largest tail (block 2's) last.
        let p = plan(None, c, 30, 8).unwrap();
        assert_eq!(p.take, vec![(1, 8), (3, 4), (2, 6)]);
        assert_eq!(p.shortfall, 12);
        assert!(p.new_memory_before_last);
        // The first piece and new memory alone make a stitch.
        let p = plan(Some((9, 5)), [], 12, 8).unwrap();
        assert_eq!((p.first, p.take.len(), p.shortfall), (Some((9, 5)), 0, 7));
        // A middle piece with the largest tail moves to the end: here its tail completes the
        // request, with no new memory.
        let c = [
            Candidate {
                block: 3,
                whole: 4,
                tail: 3,
            },
            Candidate {
                block: 1,
                whole: 8,
                tail: 0,
            },
        ];
        let p = plan(None, c, 13, 8).unwrap();
        assert_eq!(p.take, vec![(1, 8), (3, 5)]);
        assert_eq!((p.shortfall, p.new_memory_before_last), (0, false));
        // Its tail all taken and still short: new memory goes before it.
        let p = plan(None, c, 20, 8).unwrap();
        assert_eq!(p.take, vec![(1, 8), (3, 7)]);
        assert_eq!((p.shortfall, p.new_memory_before_last), (5, true));
        // The pieces run out first: new memory last, as before.
        let p = plan(None, c, 20, 2).unwrap();
        assert_eq!(p.take, vec![(3, 4)]);
        assert_eq!((p.shortfall, p.new_memory_before_last), (16, false));
        // A first piece as large as the request, or no room for a second piece, is not used.
        assert_eq!(plan(Some((9, 12)), [], 12, 8), None);
        assert_eq!(plan(Some((9, 5)), [], 12, 1), None);
    }

    /// A piece of 4 bytes at `addr`, one handle.
    fn piece(addr: DevicePtr) -> Piece {
        Piece {
            addr,
            len: 4,
            handles: vec![(PhysHandle(1), 4)],
        }
    }

    #[test]
    fn ranges_of_one_size_are_offered_most_recently_used_first() {
        let mut c = StitchCache::default();
        let old = c.insert(100, 0, vec![piece(0)], Stream(1), 0);
        let new = c.insert(200, 0, vec![piece(8)], Stream(1), 0);
        let larger = c.insert(300, 0, vec![piece(16), piece(24)], Stream(1), 0);
        c.park(new);
        c.park(old);
        c.park(larger);
        assert_eq!(
            c.idle_candidates(4, 8).collect::<Vec<_>>(),
            vec![new, old, larger]
        );
        // Reused and freed again, the old range is now the most recent of its size.
        c.acquire(old, Stream(1));
        c.park(old);
        assert_eq!(
            c.idle_candidates(4, 8).collect::<Vec<_>>(),
            vec![old, new, larger]
        );
        assert_eq!(c.idle_lru(), vec![new, larger, old]);
        c.remove(new);
        assert_eq!(c.idle_candidates(4, 4).collect::<Vec<_>>(), vec![old]);
    }

    #[test]
    fn cache_reuse_by_size() {
        let mut c = StitchCache::default();
        let a = c.insert(100, 0, vec![piece(0), piece(8)], Stream(1), 0);
        let b = c.insert(200, 0, vec![piece(16)], Stream(1), 0);
        c.park(a);
        c.park(b);
        assert_eq!(c.idle_candidates(4, 40).collect::<Vec<_>>(), vec![b, a]);
        assert_eq!(c.idle_candidates(5, 40).collect::<Vec<_>>(), vec![a]);
        c.acquire(a, Stream(2));
        assert_eq!(c.idle_count(), 1);
        assert_eq!(c.by_va(100), Some(a));
        assert_eq!(c.containing(203), Some(b));
        let removed = c.remove(b);
        assert_eq!(removed.va, 200);
        assert_eq!(c.mapped_bytes, 8);
    }

    #[test]
    fn a_sleeping_range_counts_no_mapped_bytes_and_is_marked_once() {
        let mut c = StitchCache::default();
        let a = c.insert(100, 0, vec![piece(0), piece(8)], Stream(1), 0);
        let b = c.insert(200, 0, vec![piece(16)], Stream(1), 0);
        assert_eq!(c.mapped_bytes, 12);
        assert!(c.set_asleep(a, true));
        assert!(!c.set_asleep(a, true), "already asleep: nothing changes");
        assert_eq!(c.mapped_bytes, 4);
        assert!(c.set_asleep(a, false));
        assert!(!c.set_asleep(a, false));
        assert_eq!(c.mapped_bytes, 12);
        // A range removed while asleep takes no mapped bytes with it.
        assert!(c.set_asleep(b, true));
        c.remove(b);
        assert_eq!(c.mapped_bytes, 8);
    }

    #[test]
    fn a_range_grows_into_its_room_and_keeps_its_address() {
        let mut c = StitchCache::default();
        let a = c.insert(100, 0, vec![piece(0)], Stream(1), 12);
        assert!(c.blocks[a].ends_on_a_handle());
        assert_eq!(c.blocks[a].reserved(), 16);
        c.grow(a, vec![piece(8), piece(16)]);
        let s = &c.blocks[a];
        assert_eq!((s.va, s.size, s.mapped(), s.room), (100, 12, 12, 4));
        assert_eq!(s.reserved(), 16, "the address space held does not change");
        assert_eq!(c.mapped_bytes, 12);
        assert_eq!(c.by_va(100), Some(a));
        assert_eq!(c.containing(111), Some(a));
        // A last piece shorter than its handle leaves bytes after the range that are not its.
        let short = Piece {
            addr: 40,
            len: 3,
            handles: vec![(PhysHandle(2), 4)],
        };
        let b = c.insert(200, 0, vec![short], Stream(1), 4);
        assert!(!c.blocks[b].ends_on_a_handle());
    }
}
