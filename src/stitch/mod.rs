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
    pub va: DevicePtr,
    pub size: usize,
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
    pub fn insert(&mut self, va: DevicePtr, pieces: Vec<Piece>, stream: Stream) -> StitchId {
        let size = pieces.iter().map(|p| p.len).sum();
        self.clock += 1;
        let id = self.blocks.insert(Stitched {
            va,
            size,
            pieces,
            in_use: true,
            stream,
            last_use: self.clock,
            asleep: false,
        });
        self.by_va.insert(va, id);
        self.mapped_bytes += size;
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
            self.mapped_bytes -= s.size;
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
            self.mapped_bytes -= s.size;
        } else {
            self.mapped_bytes += s.size;
        }
        true
    }

    /// Idle ranges whose size lies in `[min, max]`, smallest first, and of one size the most
    /// recently used first.
    pub fn idle_candidates(&self, min: usize, max: usize) -> impl Iterator<Item = StitchId> + '_ {
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

/// Which free blocks a stitch uses: each entry takes the first `bytes` of block `block`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StitchPlan {
    pub take: Vec<(usize, usize)>,
    /// Bytes still missing after the free blocks, to be covered by new physical memory.
    pub shortfall: usize,
}

/// Plans a stitch of `size` bytes from `candidates` (`(size, block)` pairs, largest first).
///
/// Largest blocks first keeps the number of pieces (and so the per-handle access cost) low.
/// At most `max_pieces` pieces are used, one of them kept for the shortfall if the free blocks
/// do not cover the request. Returns None when no free block would be used. Candidates are
/// drawn only as far as needed, so a lazy iterator spares sorting all free blocks.
pub fn plan(
    candidates: impl IntoIterator<Item = (usize, usize)>,
    size: usize,
    max_pieces: usize,
) -> Option<StitchPlan> {
    let mut plan = StitchPlan::default();
    let mut covered = 0usize;
    let mut candidates = candidates.into_iter();
    while covered < size {
        let Some((block_size, block)) = candidates.next() else {
            break;
        };
        let room_for_shortfall = if covered + block_size >= size { 0 } else { 1 };
        if plan.take.len() + 1 + room_for_shortfall > max_pieces {
            break;
        }
        let bytes = block_size.min(size - covered);
        plan.take.push((block, bytes));
        covered += bytes;
    }
    if plan.take.is_empty() {
        return None;
    }
    plan.shortfall = size - covered;
    Some(plan)
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

    #[test]
    fn plan_uses_largest_first_and_splits_the_last() {
        let c = [(8, 1), (6, 2), (4, 3)];
        let p = plan(c, 12, 8).unwrap();
        assert_eq!(p.take, vec![(1, 8), (2, 4)]);
        assert_eq!(p.shortfall, 0);
    }

    #[test]
    fn plan_reports_shortfall_and_respects_piece_limit() {
        let c = [(4, 1), (4, 2), (4, 3)];
        let p = plan(c, 20, 8).unwrap();
        assert_eq!(p.take.len(), 3);
        assert_eq!(p.shortfall, 8);
        let p = plan(c, 20, 3).unwrap();
        assert_eq!(p.take.len(), 2, "one piece kept for the shortfall");
        assert_eq!(p.shortfall, 12);
        assert!(plan([], 20, 8).is_none());
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
        let old = c.insert(100, vec![piece(0)], Stream(1));
        let new = c.insert(200, vec![piece(8)], Stream(1));
        let larger = c.insert(300, vec![piece(16), piece(24)], Stream(1));
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
        let a = c.insert(100, vec![piece(0), piece(8)], Stream(1));
        let b = c.insert(200, vec![piece(16)], Stream(1));
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
        let a = c.insert(100, vec![piece(0), piece(8)], Stream(1));
        let b = c.insert(200, vec![piece(16)], Stream(1));
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
}
