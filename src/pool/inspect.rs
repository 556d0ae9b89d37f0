//! Looking at the pool without changing it: which allocation a pointer belongs to, why an
//! unknown pointer is wrong (null, double free, inside memory of the pool, foreign), snapshots,
//! and the invariant checks the tests run. Errors and reports only; no allocator decisions.

use std::collections::HashMap;

use super::blocks::BlockState;
use super::{snapshot, AllocationInfo, Inner, Live, Target};
use crate::device::DevicePtr;
use crate::error::{Error, ErrorKind};

impl Inner {
    /// The error for `ptr`, which is not a live allocation.
    pub(super) fn classify_unknown(&self, ptr: DevicePtr) -> Error {
        if ptr == 0 {
            return Error::new(ErrorKind::NullPointer, "pointer is NULL");
        }
        if let Some(id) = self.map.block_at(ptr) {
            if self.map.blocks[id].state != BlockState::Allocated {
                return Error::new(
                    ErrorKind::DoubleFree,
                    format!("{ptr:#x} was already freed (double free)"),
                );
            }
        }
        if let Some(id) = self.stitch.by_va(ptr) {
            if !self.stitch.blocks[id].in_use {
                return Error::new(
                    ErrorKind::DoubleFree,
                    format!("{ptr:#x} was already freed (double free)"),
                );
            }
        }
        let held = self.pending.iter().map(|p| &p.live).chain(&self.deferred);
        if held.into_iter().any(|live| self.live_ptr(live) == ptr) {
            return Error::new(
                ErrorKind::DoubleFree,
                format!("{ptr:#x} was already freed (double free)"),
            );
        }
        if self.map.block_containing(ptr).is_some() || self.stitch.containing(ptr).is_some() {
            return Error::new(
                ErrorKind::InvalidPointer,
                format!("{ptr:#x} points inside memory of this pool but not at an allocation"),
            );
        }
        Error::new(
            ErrorKind::InvalidPointer,
            format!("{ptr:#x} was not allocated by this pool"),
        )
    }

    fn live_ptr(&self, live: &Live) -> DevicePtr {
        match live.target {
            Target::Block(id) => self.map.blocks[id].addr,
            Target::Stitched(id) => self.stitch.blocks[id].va,
        }
    }

    pub(super) fn base_of(&self, ptr: DevicePtr) -> Option<DevicePtr> {
        if self.live.contains_key(&ptr) {
            return Some(ptr);
        }
        if let Some(id) = self.stitch.containing(ptr) {
            // A reused stitched range may serve only a prefix of itself.
            let s = &self.stitch.blocks[id];
            let live = self.live.get(&s.va).filter(|_| s.in_use)?;
            return (ptr < s.va + live.size as u64).then_some(s.va);
        }
        let id = self.map.block_containing(ptr)?;
        let block = &self.map.blocks[id];
        (block.state == BlockState::Allocated && self.live.contains_key(&block.addr))
            .then_some(block.addr)
    }

    /// The live allocation containing `ptr`.
    pub(super) fn allocation_of(&self, ptr: DevicePtr) -> Option<AllocationInfo> {
        let base = self.base_of(ptr)?;
        let live = self.live.get(&base)?;
        Some(AllocationInfo {
            base,
            size: live.size,
            requested: live.requested,
            stream: live.stream,
            stitched: matches!(live.target, Target::Stitched(_)),
        })
    }

    /// The number of pieces of the live stitched allocation at `ptr`; 0 for any other pointer.
    pub(super) fn stitched_pieces(&self, ptr: DevicePtr) -> u32 {
        match self.live.get(&ptr).map(|l| l.target) {
            Some(Target::Stitched(id)) => self
                .stitch
                .blocks
                .get(id)
                .map_or(0, |s| u32::try_from(s.pieces.len()).unwrap_or(u32::MAX)),
            _ => 0,
        }
    }

    /// A picture of segments, blocks and stitched ranges.
    pub(super) fn snapshot(&self) -> snapshot::Snapshot {
        let requested: HashMap<DevicePtr, usize> = self
            .live
            .iter()
            .filter(|(_, l)| matches!(l.target, Target::Block(_)))
            .map(|(&p, l)| (p, l.requested))
            .collect();
        snapshot::take(
            &self.map,
            &self.stitch,
            &self.stats,
            self.cap.bytes(),
            &requested,
            &self.piece_requests(),
            |tag| self.private_of_tag(tag),
        )
    }

    /// The requested bytes of each live stitched allocation spread over its pieces in order
    /// (each piece full up to its size, the rest to the next), by piece address: a snapshot's
    /// requested sizes then add up to the statistics' requested bytes.
    fn piece_requests(&self) -> HashMap<DevicePtr, usize> {
        let mut out = HashMap::new();
        for live in self.live.values() {
            let Target::Stitched(id) = live.target else {
                continue;
            };
            let mut left = live.requested;
            for &b in self.stitch_blocks.blocks.get(&id).into_iter().flatten() {
                let block = &self.map.blocks[b];
                let here = left.min(block.size);
                out.insert(block.addr, here);
                left -= here;
            }
        }
        out
    }

    /// Checks that the block map, the statistics and the stitched ranges agree.
    pub(super) fn check_invariants(&self) -> std::result::Result<(), String> {
        self.map.check()?;
        // Swapped-out segments keep their range but no chunks: physical memory is the chunks.
        let reserved: usize = self
            .map
            .segments
            .iter()
            .flat_map(|(_, s)| s.chunks().iter().map(|c| c.len))
            .sum();
        if reserved as i64 != self.stats.reserved_bytes.all.current {
            return Err(format!(
                "segments hold {reserved} bytes, stats say {}",
                self.stats.reserved_bytes.all.current
            ));
        }
        let allocated: usize = self.live.values().map(|l| l.size).sum();
        if allocated as i64 != self.stats.allocated_bytes.all.current {
            return Err(format!(
                "live allocations hold {allocated} bytes, stats say {}",
                self.stats.allocated_bytes.all.current
            ));
        }
        if self.map.inactive_split.bytes != self.stats.inactive_split_bytes.all.current {
            return Err("inactive split bytes out of step".into());
        }
        let mut mapped = 0;
        for (id, s) in self.stitch.blocks.iter() {
            if s.in_use != self.stitch_blocks.blocks.contains_key(&id) {
                return Err(format!("stitched block {id} use flag out of step"));
            }
            // Its handles cover its bytes: the lead before the first piece, then each piece up
            // to its last handle's end.
            let handles = |p: &crate::stitch::Piece| p.handles.iter().map(|&(_, len)| len).sum();
            let covered = s.pieces.iter().enumerate().all(|(k, p)| {
                let lead = if k == 0 { s.lead } else { 0 };
                let room: usize = handles(p);
                p.len + lead <= room && (k + 1 == s.pieces.len() || p.len + lead == room)
            });
            if !covered {
                return Err(format!("stitched block {id}: pieces and handles disagree"));
            }
            if let (Some(ids), Some(live)) = (
                self.stitch_blocks.blocks.get(&id),
                self.live.get(&s.va).filter(|_| s.in_use),
            ) {
                // Every byte handed out lies in a block the stitch holds.
                let held = |addr: DevicePtr, len: usize| {
                    ids.iter().any(|&b| {
                        let b = &self.map.blocks[b];
                        b.state != BlockState::Free
                            && b.addr <= addr
                            && addr + len as u64 <= b.addr + b.size as u64
                    })
                };
                if !crate::stitch::prefix(&s.pieces, live.size).all(|(a, l)| held(a, l)) {
                    return Err(format!(
                        "stitched block {id}: bytes handed out at {:#x} that no piece holds",
                        s.va
                    ));
                }
            }
            if !s.asleep {
                mapped += s.mapped();
            }
        }
        if mapped != self.stitch.mapped_bytes
            || mapped as i64 != self.stats.stitched_mapped_bytes.current
        {
            return Err(format!(
                "stitched ranges map {mapped} bytes, the cache says {}, stats {}",
                self.stitch.mapped_bytes, self.stats.stitched_mapped_bytes.current
            ));
        }
        self.check_swappable()?;
        self.check_regions()
    }
}
