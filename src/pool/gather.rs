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
//! that a passed fence, or a wait for the whole device, closed is gathered; one whose free block
//! no stream owns, or that came from another pool (a graph's), only after a wait for the whole
//! device.

use std::collections::HashSet;

use super::blocks::{self, SegmentId};
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
/// a step, every few steps) saw only segments freed steps before. A look is an event query and,
/// once the fence has passed, a record.
const FENCE_EVERY: u32 = 256;

/// Most fences kept: a program that makes a stream per request would otherwise gather one
/// event per stream it ever freed on. The fence looked at longest ago goes first.
const MAX_FENCES: usize = 32;

/// Segments a stitch gathered: taken off the books, their driver teardown still to do.
#[derive(Debug, Default)]
pub(super) struct Gathered {
    pub(super) zombies: Vec<Zombie>,
    pub(super) bytes: usize,
}

impl Inner {
    /// The newest epoch whose frees on `stream` no queued work can still touch.
    fn settled_on(&mut self, device: &dyn Device, stream: Stream) -> u64 {
        let passed = self
            .advance_fence(device, stream)
            .map_or(0, |at| self.fences[at].passed);
        self.settled_epoch.max(passed)
    }

    /// Counts a free on `stream`; every [`FENCE_EVERY`] frees, looks at that stream's fence.
    #[inline]
    pub(super) fn count_free_for_fence(&mut self, device: &dyn Device, stream: Stream) {
        if !self.config.gather {
            return;
        }
        self.frees_since_fence += 1;
        if self.frees_since_fence >= FENCE_EVERY {
            self.frees_since_fence = 0;
            if self.routing == 0 {
                self.advance_fence(device, stream);
            }
        }
    }

    /// Looks at `stream`'s fence (made on first use, its event from the pool's idle ones):
    /// once passed, it notes the epoch it closed and is recorded again, closing the current
    /// one. Returns the fence's place, if there is one. Fences are looked at only for a stream
    /// the caller uses now, so no event is recorded on a stream that may be gone. A driver call
    /// that fails costs only gathering (logged).
    fn advance_fence(&mut self, device: &dyn Device, stream: Stream) -> Option<usize> {
        let Some(at) = self.fences.iter().position(|f| f.stream == stream) else {
            return self.new_fence(device, stream);
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
            log::warn!("glake: a fence on stream {:#x} ends: {err}", stream.0);
            self.fences.remove(at);
            self.idle_events.push(event);
            return None;
        }
        let epoch = self.close_epoch();
        // The fence looked at last goes to the end: the first is the one to drop.
        let mut fence = self.fences.remove(at);
        fence.passed = closed;
        fence.epoch = epoch;
        self.fences.push(fence);
        Some(self.fences.len() - 1)
    }

    /// A fence for `stream`, recorded now; the oldest goes when there are [`MAX_FENCES`].
    fn new_fence(&mut self, device: &dyn Device, stream: Stream) -> Option<usize> {
        // Not `take_event`: a fence's failures are quiet, and the fault sweeps tell call sites
        // apart by where the driver is called.
        let event = match self
            .idle_events
            .pop()
            .map_or_else(|| device.create_event(), Ok)
        {
            Ok(event) => event,
            Err(err) => {
                log::warn!("glake: no fence event: {err}");
                return None;
            }
        };
        if let Err(err) = device.record_event(event, stream) {
            log::warn!("glake: no fence on stream {:#x}: {err}", stream.0);
            self.idle_events.push(event);
            return None;
        }
        if self.fences.len() >= MAX_FENCES {
            let oldest = self.fences.remove(0);
            self.idle_events.push(oldest.event);
        }
        let epoch = self.close_epoch();
        self.fences.push(Fence {
            stream,
            event,
            epoch,
            passed: 0,
        });
        Some(self.fences.len() - 1)
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
    /// fence, mapped by no stitched range) when the stitch's new memory, `grown` bytes without
    /// them, then has fewer handles, and takes their segments off the books. Their bytes join
    /// the plan's shortfall. The caller has checked that the stitch is of the shared pool.
    /// A plan that `grows` an idle stitched range may lose all its pieces so.
    pub(super) fn gather(
        &mut self,
        device: &dyn Device,
        plan: &mut StitchPlan,
        size: usize,
        grown: usize,
        stream: Stream,
        grows: bool,
    ) -> Result<Gathered> {
        // Looked at on every stitch, so that the line moves on with stitches too.
        let on_stream = self.settled_on(device, stream);
        if size < GATHER_FROM {
            return Ok(Gathered::default());
        }
        let limit = self.chunk_limit(size);
        let device_wide = self.settled_epoch;
        let whole_small = |inner: &Inner, block: usize, bytes: usize| -> Option<SegmentId> {
            let b = &inner.map.blocks[block];
            let s = &inner.map.segments[b.segment];
            let chunks = s.chunks();
            let small = !chunks.is_empty() && chunks.iter().all(|c| c.len < limit);
            (b.size == s.size
                && bytes == s.size
                && small
                && !chunks.iter().any(|c| inner.shared.contains_key(&c.handle)))
            .then_some(b.segment)
        };
        let mut picked: Vec<(usize, SegmentId)> = plan
            .take
            .iter()
            .map(|&(block, bytes)| (block, whole_small(self, block, bytes)))
            .filter_map(|(block, segment)| Some((block, segment?)))
            .collect();
        if picked.is_empty() {
            return Ok(Gathered::default());
        }
        let whole = picked.len();
        // A block no stream owns was last used on any stream: only a device-wide wait settles
        // it; so it does a segment another pool used.
        picked.retain(|&(block, s)| {
            let segment = &self.map.segments[s];
            let line = match self.map.blocks[block].owner {
                Some(_) => on_stream,
                None => device_wide,
            };
            segment.freed_at <= line && segment.joined_at <= device_wide
        });
        let settled = picked.len();
        let mapped = self.stitched_over_any(picked.iter().map(|&(_, s)| s));
        picked.retain(|(_, segment)| !mapped.contains(segment));
        log::debug!(
            "glake: a stitch of {size} bytes plans {} pieces: {whole} whole idle segments of small \
             handles, {settled} of them settled (epoch {on_stream} on the stream, {device_wide} \
             everywhere, now {}), {} of those mapped by no stitched range",
            plan.take.len(),
            self.map.epoch,
            picked.len()
        );
        // A stitch keeps at least one piece of its own (else it would map new memory twice);
        // a growth has its range's.
        if picked.len() == plan.take.len() && !grows {
            picked.remove(0);
        }
        let handles: usize = picked
            .iter()
            .map(|&(_, s)| self.map.segments[s].chunks().len())
            .sum();
        let bytes: usize = picked.iter().map(|&(_, s)| self.map.segments[s].size).sum();
        // The new memory's handles with and without the gathered bytes, as the shortfall's
        // segment will be laid out: after the gathered segments have left the pool.
        let reserved = self.reserved() - bytes;
        let new_handles = |total: usize| match total {
            0 => 0,
            _ => blocks::chunk_sizes(
                total,
                self.granularity,
                self.chunk_limit_at(reserved, total),
            )
            .len(),
        };
        if new_handles(grown + bytes) >= new_handles(grown) + handles {
            return Ok(Gathered::default());
        }
        let mut gathered = Gathered::default();
        for &(_, segment) in &picked {
            match self.retire_segment(device, segment) {
                Ok(zombie) => gathered.zombies.push(zombie),
                Err(err) => {
                    // Those retired already are off the books: torn down now.
                    self.bury_all(device, gathered.zombies);
                    return Err(err);
                }
            }
        }
        gathered.bytes = bytes;
        self.stats.gathered_segments += picked.len() as i64;
        self.stats.gathered_handles += handles as i64;
        plan.take
            .retain(|&(block, _)| !picked.iter().any(|&(taken, _)| taken == block));
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

    /// Returns the fences' events to the pool's idle ones (destroyed with them).
    pub(super) fn drop_fences(&mut self) {
        let events = self.fences.drain(..).map(|f| f.event);
        self.idle_events.extend(events);
    }
}

#[cfg(test)]
mod tests {
    use crate::device::Stream;

    const MIB: usize = 1 << 20;

    use crate::pool::host_pool;

    /// A wait for the whole device settles every free made before it, on every stream.
    #[test]
    fn a_device_wide_wait_settles_the_frees_before_it() {
        let pool = host_pool();
        let a = pool.malloc(8 * MIB, Stream::DEFAULT).unwrap();
        pool.free(a).unwrap();
        let mut inner = crate::sync::lock(&pool.inner);
        inner.unpark_all();
        let freed = inner
            .map
            .segments
            .iter()
            .map(|(_, s)| s.freed_at)
            .max()
            .unwrap();
        assert!(freed > inner.settled_epoch, "not settled before the wait");
        inner.synchronize_all(&*pool.device).unwrap();
        assert!(freed <= inner.settled_epoch);
    }

    /// A segment that moves to another pool counts as joining it then: only a later wait for
    /// the whole device settles it, whatever its frees' epochs.
    #[test]
    fn a_segment_joins_its_new_pool_at_the_current_epoch() {
        let pool = host_pool();
        pool.malloc(8 * MIB, Stream::DEFAULT).unwrap();
        let mut inner = crate::sync::lock(&pool.inner);
        let segment = inner.map.segments.iter().next().map(|(id, _)| id).unwrap();
        assert_eq!(inner.map.segments[segment].joined_at, 0, "made in its pool");
        let tag = inner.map.segments[segment].tag;
        inner.close_epoch();
        let now = inner.map.epoch;
        inner.map.retag_segment(segment, tag + 100);
        assert_eq!(inner.map.segments[segment].joined_at, now);
        inner.map.retag_segment(segment, tag);
    }

    /// Fences are kept for at most [`super::MAX_FENCES`] streams; the one looked at longest ago
    /// goes, its event back among the idle ones.
    #[test]
    fn fences_are_kept_for_a_bounded_number_of_streams() {
        let pool = host_pool();
        let streams: Vec<Stream> = (0..super::MAX_FENCES + 3)
            .map(|_| pool.device.create_stream().unwrap())
            .collect();
        let mut inner = crate::sync::lock(&pool.inner);
        for &stream in &streams {
            inner.advance_fence(&*pool.device, stream);
        }
        assert_eq!(inner.fences.len(), super::MAX_FENCES);
        assert_eq!(inner.fences[0].stream, streams[3]);
        // The first evicted event served the next new fence, and so on: one is left idle.
        assert_eq!(inner.idle_events.len(), 1);
        // Looked at again, a fence moves to the back of the line.
        inner.advance_fence(&*pool.device, streams[3]);
        assert_eq!(inner.fences.last().map(|f| f.stream), Some(streams[3]));
    }
}
