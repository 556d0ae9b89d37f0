//! Size classes: which pool (small or large) a request comes from, the unit its size is rounded
//! to, and the least remainder worth splitting off a block. Kept together so that rounding and
//! splitting agree on one unit per pool.

use super::blocks::PoolKind;
use crate::device::align_up;
use crate::error::Result;

/// Alignment and rounding unit of small requests.
pub const MIN_BLOCK: usize = 512;

/// The pool a request of `size` bytes comes from: small up to `small_limit`, else large.
pub(super) fn pool_of(size: usize, small_limit: usize) -> PoolKind {
    if size <= small_limit {
        PoolKind::Small
    } else {
        PoolKind::Large
    }
}

/// The rounding unit of `pool`: [`MIN_BLOCK`] for small requests, the mapping granularity for
/// large ones. A free block is split only when at least one unit would remain.
pub(super) fn unit(pool: PoolKind, granularity: usize) -> usize {
    match pool {
        PoolKind::Small => MIN_BLOCK,
        PoolKind::Large => granularity,
    }
}

/// `size` rounded up to the unit of `pool`.
pub(super) fn round(size: usize, pool: PoolKind, granularity: usize) -> Result<usize> {
    align_up(size, unit(pool, granularity))
}

/// Bytes of a new small-pool segment for a request of `size` (rounded) bytes: one granule, or
/// the request rounded up to whole granules when it is larger.
pub(super) fn small_segment(size: usize, granularity: usize) -> Result<usize> {
    align_up(granularity.max(size), granularity)
}
