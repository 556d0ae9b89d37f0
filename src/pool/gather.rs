//! Gathering small handles into large ones. A segment made while the pool was small is cut into
//! small physical handles, and every stitch that maps it pays CUDA's access grant once per
//! handle (about 25 us whatever the handle's size). When a stitch plans to map such a segment
//! whole and no stitched range maps it, the segment is released instead and its bytes are made
//! again with the stitch's new memory, in the large handles the pool makes now. The release
//! costs about what granting the small handles once would; every later stitch over that memory
//! maps a few large handles.
//!
//! A release takes effect at once, while work queued on the stream may still read the segment.
//! So every free stamps its segment with the block map's epoch, and a fence (an event recorded
//! on the stitching stream) closes the epoch it was recorded in. Only a segment freed in an epoch
//! that a passed fence, or a wait for the whole device, closed is gathered.

use std::collections::HashSet;

use super::blocks::{SegmentId, SHARED};
use super::growth::Zombie;
use super::Inner;
use crate::device::{Device, Event, Stream};
use crate::error::Result;
use crate::stitch::StitchPlan;

/// Stitches from this size on gather. Below it the gathered memory's large handles are later
/// split by small allocations, whose gaps strand partial handles: with stitches of any size,
/// swap_moe's replayed peak rose 0.7% (its 999 MiB logits stitches gathered), while
/// lora_vocab's and mix's 6-8 GB stitches gather the same either way.
const GATHER_FROM: usize = 1 << 30;

/// An event recorded on `stream` after every free stamped with an epoch up to `epoch`; `passed`
/// is the epoch of the last of its recordings seen complete (0: none yet).
#[derive(Debug)]
pub(super) struct Fence {
    stream: Stream,
    event: Event,
    epoch: u64,
    passed: u64,
}

/// Frees between two looks at the freeing stream's fence. Looking only at stitches left the
/// line a stitch apart: on the GPU, where the host runs ahead, a training run's stitches (a few
/// a step, every few steps) saw only segments freed steps before, and gathered none. A look
/// costs an event query and, when the fence has passed, a record: a few ns a free.
const FENCE_EVERY: u32 = 256;

/// Segments a stitch gathered: taken off the books, their driver teardown still to do.
#[derive(Debug, Default)]
pub(super) struct Gathered {
    pub(super) zombies: Vec<Zombie>,
    pub(super) bytes: usize,
}

impl Inner {
    /// The newest epoch whose frees on `stream` no queued work can still touch.
    fn settled_epoch(&mut self, device: &dyn Device, stream: Stream) -> u64 {
        let passed = self
            .advance_fence(device, stream)
            .map_or(0, |at| self.fences[at].passed);
        self.settled_epoch.max(passed)
    }

    /// Counts a free on `stream`; every [`FENCE_EVERY`] frees, looks at that stream's fence.
    #[inline]
    pub(super) fn count_free_for_fence(&mut self, device: &dyn Device, stream: Stream) {
        self.frees_since_fence += 1;
        if self.frees_since_fence >= FENCE_EVERY {
            self.frees_since_fence = 0;
            if self.config.gather && self.routing == 0 {
                self.advance_fence(device, stream);
            }
        }
    }

    /// Looks at `stream`'s fence (made on first use): once passed, it notes the epoch it closed
    /// and is recorded again, closing the current one. Returns the fence's place, if there is
    /// one. A fence's driver call that fails costs only gathering (logged).
    fn advance_fence(&mut self, device: &dyn Device, stream: Stream) -> Option<usize> {
        let Some(at) = self.fences.iter().position(|f| f.stream == stream) else {
            match device.create_event() {
                Ok(event) => match device.record_event(event, stream) {
                    Ok(()) => {
                        let epoch = self.close_epoch();
                        self.fences.push(Fence {
                            stream,
                            event,
                            epoch,
                            passed: 0,
                        });
                        return Some(self.fences.len() - 1);
                    }
                    Err(err) => {
                        log::warn!("glake: no fence on stream {:#x}: {err}", stream.0);
                        destroy_fence_event(device, event);
                    }
                },
                Err(err) => log::warn!("glake: no fence event: {err}"),
            }
            return None;
        };
        let fence = &self.fences[at];
        match device.query_event(fence.event) {
            Ok(true) => {}
            Ok(false) => return Some(at),
            Err(err) => {
                log::warn!("glake: a fence could not be queried: {err}");
                return Some(at);
            }
        }
        let (event, closed) = (fence.event, fence.epoch);
        if let Err(err) = device.record_event(event, stream) {
            // The stream is gone (or the device failed): this fence closes nothing more.
            log::warn!("glake: a fence on stream {:#x} ends: {err}", stream.0);
            self.fences.swap_remove(at);
            destroy_fence_event(device, event);
            return None;
        }
        let epoch = self.close_epoch();
        let fence = &mut self.fences[at];
        fence.passed = closed;
        fence.epoch = epoch;
        Some(at)
    }

    /// Ends the current epoch (a fence was just recorded, or the device waited for): returns
    /// it. Frees from now on belong to the next.
    pub(super) fn close_epoch(&mut self) -> u64 {
        let closed = self.map.epoch;
        self.map.epoch += 1;
        closed
    }

    /// Takes out of `plan` the pieces worth gathering (whole idle segments of the shared pool,
    /// of handles smaller than a new segment of `size` bytes would get, freed before a passed
    /// fence, mapped by no stitched range) when the stitch then maps fewer handles, and takes
    /// their segments off the books. Their bytes join the plan's shortfall.
    pub(super) fn gather(
        &mut self,
        device: &dyn Device,
        plan: &mut StitchPlan,
        size: usize,
        stream: Stream,
    ) -> Result<Gathered> {
        let settled = self.settled_epoch(device, stream);
        if size < GATHER_FROM {
            return Ok(Gathered::default());
        }
        let limit = self.chunk_limit(size);
        let whole_small = |inner: &Inner, block: usize, bytes: usize| -> Option<SegmentId> {
            let b = &inner.map.blocks[block];
            let s = &inner.map.segments[b.segment];
            let chunks = s.chunks();
            let small = !chunks.is_empty() && chunks.iter().all(|c| c.len < limit);
            (s.tag == SHARED
                && s.guard == 0
                && b.addr == s.va
                && b.size == s.size
                && bytes == s.size
                && small
                && !chunks.iter().any(|c| inner.shared.contains_key(&c.handle)))
            .then_some(b.segment)
        };
        let mut picked: Vec<(usize, SegmentId)> = plan
            .take
            .iter()
            .enumerate()
            .filter_map(|(i, &(block, bytes))| Some((i, whole_small(self, block, bytes)?)))
            .collect();
        if picked.is_empty() {
            return Ok(Gathered::default());
        }
        let whole = picked.len();
        picked.retain(|&(_, s)| self.map.segments[s].freed_at <= settled);
        let settled_count = picked.len();
        let mapped = self.stitched_over_any(picked.iter().map(|&(_, s)| s));
        picked.retain(|(_, segment)| !mapped.contains(segment));
        log::debug!(
            "glake: a stitch of {size} bytes plans {} pieces: {whole} whole idle segments of small \
             handles, {settled_count} of them freed by epoch {settled} (now {}), {} of those \
             mapped by no stitched range",
            plan.take.len(),
            self.map.epoch,
            picked.len()
        );
        // A stitch keeps at least one piece of its own (else it would map new memory twice).
        if picked.len() == plan.take.len() {
            picked.remove(0);
        }
        let handles: usize = picked
            .iter()
            .map(|&(_, s)| self.map.segments[s].chunks().len())
            .sum();
        let bytes: usize = picked.iter().map(|&(_, s)| self.map.segments[s].size).sum();
        // The handles of the new memory with and without the gathered bytes.
        let grown = super::sizes::large_segment(plan.shortfall, self.granularity)?;
        let new_handles = |bytes: usize| match bytes {
            0 => 0,
            _ => self.segment_chunks(bytes, SHARED).len(),
        };
        if new_handles(grown + bytes) >= new_handles(grown) + handles {
            return Ok(Gathered::default());
        }
        let mut gathered = Gathered::default();
        for &(_, segment) in &picked {
            gathered.zombies.push(self.retire_segment(device, segment)?);
        }
        gathered.bytes = bytes;
        self.stats.gathered_segments += picked.len() as i64;
        self.stats.gathered_handles += handles as i64;
        let taken: HashSet<usize> = picked.iter().map(|&(i, _)| i).collect();
        let mut index = 0;
        plan.take.retain(|_| {
            index += 1;
            !taken.contains(&(index - 1))
        });
        plan.shortfall += bytes;
        Ok(gathered)
    }

    /// Which of `segments` some stitched range (in use, idle or asleep) maps a piece of: one
    /// pass over every piece, each looked up among the few segments by address.
    fn stitched_over_any(&self, segments: impl Iterator<Item = SegmentId>) -> HashSet<SegmentId> {
        let mut ranges: Vec<(u64, u64, SegmentId)> = segments
            .map(|id| {
                let s = &self.map.segments[id];
                (s.va, s.va + s.size as u64, id)
            })
            .collect();
        ranges.sort_unstable();
        let mut mapped = HashSet::new();
        for piece in self.stitch.blocks.iter().flat_map(|(_, s)| &s.pieces) {
            // The last range starting at or before the piece is the only one that can hold it
            // (a piece lies inside one segment).
            let at = ranges.partition_point(|&(va, _, _)| va <= piece.addr);
            if let Some(&(_, end, id)) = at.checked_sub(1).map(|i| &ranges[i]) {
                if piece.addr < end {
                    mapped.insert(id);
                }
            }
        }
        mapped
    }

    /// Gives the fences' events back (the pool is going).
    pub(super) fn drop_fences(&mut self, device: &dyn Device) {
        for fence in self.fences.drain(..) {
            destroy_fence_event(device, fence.event);
        }
    }
}

fn destroy_fence_event(device: &dyn Device, event: Event) {
    if let Err(err) = device.destroy_event(event) {
        log::warn!("glake: a fence event was not destroyed: {err}");
    }
}
