//! Where the memory a replay reserved beyond its live bytes sits when the live bytes peak, and
//! when the reserved bytes do: the answer to "why is utilization not 1" (utilization is the
//! live peak over the reserved peak, and the two may come at different times). The trace is
//! replayed once with a timeline, which finds the first operation at which each reaches its
//! peak (the timeline leaves parked blocks alone, so sampling changes nothing), and once more
//! up to each of those operations, where a snapshot of the pool sorts every reserved byte into
//! one of the kinds below.
//!
//! Only whole physical chunks can be mapped (CUDA maps whole handles only), so free memory
//! that shares a chunk with a live allocation serves only requests that fit in it, or a stitch
//! that begins or ends in it; a free block no larger than `small_limit` at that point serves no
//! large request at all.

use glake::pool::blocks::PoolKind;
use glake::pool::snapshot::{BlockUse, SegmentInfo, Snapshot};

use super::replay::replay;
use super::{NamedConfig, ReplayOptions, Result, Trace, TraceError};

/// The point of a replay whose reserved bytes are sorted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Moment {
    /// The first operation after which the live bytes reach their peak.
    #[default]
    LivePeak,
    /// The first operation after which the reserved bytes reach their peak: what the pool
    /// held beyond the live bytes when its footprint was set.
    ReservedPeak,
}

/// The reserved bytes at a [`Moment`], by kind. The kinds add up to `reserved`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Waste {
    /// Which point of the replay this is.
    pub at: Moment,
    /// Index of the operation after which the moment came.
    pub op: usize,
    /// Reserved bytes then.
    pub reserved: u64,
    /// Reserved bytes at their own peak, over the whole replay (at least `reserved`).
    pub peak_reserved: u64,
    /// Bytes the live allocations asked for.
    pub requested: u64,
    /// Bytes handed out beyond the requests (rounding to the pool's unit).
    pub rounding: u64,
    /// Free bytes of the small pool's segments.
    pub small_free: u64,
    /// Free bytes of the large pool in whole chunks: a stitch can map them.
    pub whole_chunks: u64,
    /// Free bytes of the large pool sharing a chunk with allocated memory, in free blocks of at
    /// most `small_limit` bytes: no large request fits them and no stitch can map them.
    pub stranded: u64,
    /// How many such blocks.
    pub stranded_blocks: u64,
    /// Other free bytes of the large pool that share a chunk with allocated memory: only a
    /// request that fits the block, or a stitch's first or last piece, can use them.
    pub partial_chunks: u64,
    /// Of the stranded and partial bytes, those between a chunk boundary and their block's
    /// edge (the free end or front of a held chunk): a stitch's first or last piece can map
    /// them, where their block offers at least `fragLimit` bytes from that boundary. The rest
    /// lie in blocks inside one chunk, held on both sides.
    pub chunk_edges: u64,
    /// Bytes of blocks freed but still waiting for other streams, and anything the kinds above
    /// miss (0 in a replay of one stream, where nothing waits).
    pub other: u64,
}

/// Sorts the reserved memory of `trace` replayed with `config` at each of `moments`.
pub fn waste_at(
    trace: &Trace,
    config: &NamedConfig,
    options: &ReplayOptions,
    moments: &[Moment],
) -> Result<Vec<Waste>> {
    let sampled = ReplayOptions {
        timeline: true,
        snapshot_after: None,
        ..*options
    };
    let whole = replay(trace, config, &sampled)?;
    let Some(timeline) = whole.timeline else {
        return Err(TraceError::new("the replay kept no timeline"));
    };
    // Moments that fall on one operation share its replay.
    let mut sorted: Vec<Waste> = Vec::with_capacity(moments.len());
    for &at in moments {
        let series = match at {
            Moment::LivePeak => &timeline.live,
            Moment::ReservedPeak => &timeline.reserved,
        };
        // The first operation at which the series peaks.
        let Some((op, _)) = series
            .iter()
            .copied()
            .enumerate()
            .rev()
            .max_by_key(|&(_, bytes)| bytes)
        else {
            sorted.push(Waste {
                at,
                ..Waste::default()
            });
            continue;
        };
        let mut waste = match sorted.iter().find(|w| w.op == op) {
            Some(&same) => same,
            None => {
                let then = (timeline.reserved[op], timeline.live[op]);
                sorted_after(trace, config, &sampled, op, then)?
            }
        };
        waste.at = at;
        waste.peak_reserved = whole.peak_reserved_bytes;
        sorted.push(waste);
    }
    Ok(sorted)
}

/// Replays `trace` up to operation `op`, which the sampled replay reached with `then`
/// (reserved and live bytes), and sorts the reserved bytes there.
fn sorted_after(
    trace: &Trace,
    config: &NamedConfig,
    sampled: &ReplayOptions,
    op: usize,
    then: (u64, u64),
) -> Result<Waste> {
    let stopped = ReplayOptions {
        snapshot_after: Some(op),
        ..*sampled
    };
    let again = replay(trace, config, &stopped)?;
    // Placement can follow addresses (which of two equal free blocks comes first), and a new
    // device may map at other addresses: the second replay must reach the same state.
    let reached = again.timeline.as_ref().and_then(|t| {
        let at = t.len().checked_sub(1)?;
        Some((t.reserved[at], t.live[at]))
    });
    let (Some(snapshot), Some(reached)) = (again.snapshot, reached) else {
        return Err(TraceError::new(format!(
            "the replay did not stop after operation {op}"
        )));
    };
    if reached != then {
        return Err(TraceError::new(format!(
            "replaying up to operation {op} again gave {} reserved and {} live bytes, not {} \
             and {}: the replay's placements depend on addresses here",
            reached.0, reached.1, then.0, then.1
        )));
    }
    Ok(sort(&snapshot, op, then.1, config.config.small_limit))
}

/// Sorts the reserved bytes of `snapshot` (taken after operation `op`, with `requested` live
/// bytes asked for) by kind.
pub fn sort(snapshot: &Snapshot, op: usize, requested: u64, small_limit: usize) -> Waste {
    let mut waste = Waste {
        op,
        requested,
        ..Waste::default()
    };
    let mut allocated = 0u64;
    for segment in &snapshot.segments {
        waste.reserved += segment.total_size as u64;
        let bounds = chunk_bounds(segment);
        for block in &segment.blocks {
            let size = block.size as u64;
            match (block.state, segment.pool) {
                (BlockUse::Allocated | BlockUse::Stitched, _) => allocated += size,
                (BlockUse::PendingFree, _) => waste.other += size,
                (BlockUse::Free, PoolKind::Small) => waste.small_free += size,
                (BlockUse::Free, PoolKind::Large) => {
                    let offset = block.address - segment.address;
                    let whole = whole_bytes(&bounds, offset, size);
                    waste.chunk_edges += edge_bytes(&bounds, offset, size);
                    waste.whole_chunks += whole;
                    if whole == 0 && block.size <= small_limit {
                        waste.stranded += size;
                        waste.stranded_blocks += 1;
                    } else {
                        waste.partial_chunks += size - whole;
                    }
                }
            }
        }
    }
    // A stitched allocation's pieces are allocated blocks; its requested bytes count once.
    waste.rounding = allocated.saturating_sub(requested);
    let sorted = requested
        + waste.rounding
        + waste.small_free
        + waste.whole_chunks
        + waste.stranded
        + waste.partial_chunks
        + waste.other;
    waste.other += waste.reserved.saturating_sub(sorted);
    waste.peak_reserved = waste.reserved;
    waste
}

/// The offsets at which `segment`'s chunks start, and its end.
fn chunk_bounds(segment: &SegmentInfo) -> Vec<u64> {
    let mut bounds = vec![0u64];
    for &len in &segment.chunk_sizes {
        let last = bounds.last().copied().unwrap_or(0);
        bounds.push(last + len as u64);
    }
    bounds
}

/// Bytes of whole chunks (between consecutive `bounds`) inside `[offset, offset + len)`.
fn whole_bytes(bounds: &[u64], offset: u64, len: u64) -> u64 {
    let end = offset + len;
    bounds
        .windows(2)
        .filter(|w| w[0] >= offset && w[1] <= end)
        .map(|w| w[1] - w[0])
        .sum()
}

/// Bytes of `[offset, offset + len)` before its first and after its last chunk boundary (0 when
/// no boundary lies inside: the range is inside one chunk).
fn edge_bytes(bounds: &[u64], offset: u64, len: u64) -> u64 {
    let end = offset + len;
    let inside = |b: &&u64| **b >= offset && **b <= end;
    match (bounds.iter().find(inside), bounds.iter().rev().find(inside)) {
        (Some(&first), Some(&last)) => (first - offset) + (end - last),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn whole_chunks_are_those_inside_the_block() {
        let bounds = [0, 2 * MIB, 4 * MIB, 6 * MIB];
        assert_eq!(whole_bytes(&bounds, 0, 6 * MIB), 6 * MIB);
        assert_eq!(whole_bytes(&bounds, MIB, 4 * MIB), 2 * MIB);
        assert_eq!(whole_bytes(&bounds, MIB, 3 * MIB), 2 * MIB);
        assert_eq!(whole_bytes(&bounds, MIB, MIB + MIB / 2), 0);
        assert_eq!(whole_bytes(&bounds, 5 * MIB, MIB), 0);
    }

    #[test]
    fn edge_bytes_lie_between_a_boundary_and_the_block_edge() {
        let bounds = [0, 2 * MIB, 4 * MIB, 6 * MIB];
        assert_eq!(edge_bytes(&bounds, 0, 6 * MIB), 0);
        assert_eq!(edge_bytes(&bounds, MIB, 4 * MIB), 2 * MIB);
        assert_eq!(edge_bytes(&bounds, MIB, MIB), MIB, "ends at a boundary");
        assert_eq!(edge_bytes(&bounds, 2 * MIB, MIB), MIB, "starts at one");
        assert_eq!(
            edge_bytes(&bounds, MIB + MIB / 2, MIB),
            MIB,
            "one boundary inside"
        );
        assert_eq!(edge_bytes(&bounds, 5 * MIB / 2, MIB), 0, "inside one chunk");
    }
}
