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
