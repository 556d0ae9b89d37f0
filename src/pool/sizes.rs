//! Size classes: which pool (small or large) a request comes from, and the unit sizes are
//! rounded and blocks split at. Both pools carve their blocks at 512 bytes, as PyTorch does, so
//! no request pays for the mapping granularity; only new segments are whole granules.

use super::blocks::PoolKind;
use crate::device::align_up;
use crate::error::Result;

/// Alignment and rounding unit of every request, and the least remainder split off a block.
pub const MIN_BLOCK: usize = 512;

/// The pool a request of `size` bytes comes from: small up to `small_limit`, else large.
pub(super) fn pool_of(size: usize, small_limit: usize) -> PoolKind {
    if size <= small_limit {
        PoolKind::Small
    } else {
        PoolKind::Large
    }
}

/// `size` rounded up to [`MIN_BLOCK`].
pub(super) fn round(size: usize) -> Result<usize> {
    align_up(size, MIN_BLOCK)
}

/// Bytes of a new small-pool segment for a request of `size` (rounded) bytes: one granule, or
/// the request rounded up to whole granules when it is larger.
pub(super) fn small_segment(size: usize, granularity: usize) -> Result<usize> {
    align_up(granularity.max(size), granularity)
}

/// Bytes of a new large-pool segment for `size` (rounded) bytes: whole granules, the rest of
/// the last one left free for the next request.
pub(super) fn large_segment(size: usize, granularity: usize) -> Result<usize> {
    align_up(size, granularity)
}

/// Segments made for a run of requests of one size hold at most this many bytes.
const PACK_LIMIT: usize = 64 << 20;

/// The largest request a packed segment holds (two of it fill [`PACK_LIMIT`]).
pub(super) const PACKED_REQUEST_MOST: usize = PACK_LIMIT / 2;

/// Requests per packed segment are at most this many.
const PACK_MOST: usize = 16;

/// Large requests that needed new memory one after another, by rounded size. Each such
/// request gets a segment of its own rounded up to whole granules, and the rest of the last
/// granule serves no large request and no stitch while the allocation lives. A run of one size
/// (a model's optimizer states or per-expert weights, made one after another and kept for the
/// whole run) would leave one such rest per tensor: on a recorded MoE trace a burst of 720
/// requests of 5.5 MiB left 0.5 MiB each, 293 MiB in 618 rests at the live peak. Once a run is
/// long enough, a segment holds as many requests of the
/// run as fill whole granules (see [`packed_segment`]), and the next ones take the rest of it
/// as ordinary free memory.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct GrowthRun {
    size: usize,
    count: u32,
}

impl GrowthRun {
    /// How many requests of `size` (rounded) bytes got new memory just before this one.
    pub(super) fn before(&self, size: usize) -> u32 {
        if self.size == size {
            self.count
        } else {
            0
        }
    }

    /// Records that a request of `size` (rounded) bytes got new memory: a segment was made, or
    /// planned, for it.
    pub(super) fn record(&mut self, size: usize) {
        *self = GrowthRun {
            size,
            count: self.before(size).saturating_add(1),
        };
    }
}

/// Bytes of a new large-pool segment for a request of `size` (rounded) bytes that `repeats`
/// requests of its size needing new memory came just before: room for the fewest requests of
/// the size (2 to [`PACK_MOST`], within [`PACK_LIMIT`], and at most one more than the run has
/// had so far, so that a short run reserves little ahead of need) that leave less than a
/// sixteenth of one request over in their last granule; [`large_segment`] when no such number
/// is allowed.
pub(super) fn packed_segment(size: usize, granularity: usize, repeats: u32) -> Result<usize> {
    let own = large_segment(size, granularity)?;
    if own == size {
        return Ok(own);
    }
    let most = (repeats as usize).saturating_add(1).min(PACK_MOST);
    for k in 2..=most {
        let Some(bytes) = size.checked_mul(k).filter(|&b| b <= PACK_LIMIT) else {
            break;
        };
        let segment = large_segment(bytes, granularity)?;
        if (segment - bytes) * 16 <= size {
            return Ok(segment);
        }
    }
    Ok(own)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;
    const G: usize = 2 * MIB;

    #[test]
    fn a_run_of_one_size_is_packed_into_whole_granules() {
        let segment = |size, repeats| packed_segment(size, G, repeats).unwrap();
        // 5.5 MiB: four fill 11 granules, fewer leave more than a sixteenth over; room for
        // four is made once three came before.
        let odd = 11 * MIB / 2;
        assert_eq!(segment(odd, 0), 6 * MIB, "the first of a run");
        assert_eq!(segment(odd, 2), 6 * MIB);
        assert_eq!(segment(odd, 3), 22 * MIB);
        assert_eq!(segment(odd, 7), 22 * MIB);
        // Whole granules already: nothing to pack.
        assert_eq!(segment(8 * MIB, 3), 8 * MIB);
        // 3 MiB: two fill three granules.
        assert_eq!(segment(3 * MIB, 0), 4 * MIB);
        assert_eq!(segment(3 * MIB, 1), 6 * MIB);
        // No count within 64 MiB leaves less than a sixteenth over: a segment of its own.
        assert_eq!(segment(4_257_792, 15), 6 * MIB);
        // Too large to pack two within the limit.
        assert_eq!(segment(33 * MIB, 2), 34 * MIB);
    }

    #[test]
    fn a_run_counts_requests_of_one_size_in_a_row() {
        let mut run = GrowthRun::default();
        let mut grows = |size| {
            let before = run.before(size);
            run.record(size);
            before
        };
        assert_eq!(grows(5 * MIB), 0);
        assert_eq!(grows(5 * MIB), 1);
        assert_eq!(grows(5 * MIB), 2);
        assert_eq!(grows(7 * MIB), 0);
        assert_eq!(grows(5 * MIB), 0);
    }
}
