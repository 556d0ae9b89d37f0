//! C API of cross-process deduplication: `glake_share_read_only` declares memory read-only and
//! shares it with other processes of the user holding the same bytes on the same device.

use std::ffi::c_void;

use super::exports::{glake_pool, pool_id, write_out};
use super::{glake_status, guard, handles, Failure};
use crate::pool::ShareReport;

/// What `glake_share_read_only` did with a range.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct glake_share_report {
    /// Bytes now mapped from another process's memory; their own memory went back to the
    /// device.
    pub shared_bytes: u64,
    /// Bytes moved into shareable memory of this process and offered to other processes.
    pub offered_bytes: u64,
    /// Bytes left as they were: parts of physical handles the range does not cover whole,
    /// bytes shared already, or bytes the cap left no room to move.
    pub kept_bytes: u64,
}

impl From<ShareReport> for glake_share_report {
    fn from(r: ShareReport) -> Self {
        glake_share_report {
            shared_bytes: r.shared_bytes,
            offered_bytes: r.offered_bytes,
            kept_bytes: r.kept_bytes,
        }
    }
}

/// A range of device memory.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct glake_range {
    pub ptr: *mut c_void,
    pub bytes: usize,
}

/// Declares each of `ranges` (`count` of them, each inside one live allocation of `pool`)
/// read-only from now on and shares it with the processes of this user that hold the same
/// bytes on the same device (replicas of a model's weights hold them once). Each run of whole
/// physical handles in a range is hashed and looked up in the device's index
/// (`GLAKE_DEDUP_DIR`); another process's equal memory, checked byte by byte, is mapped at the
/// same addresses and this process's own memory released; without one, the run moves into
/// shareable memory offered to later processes. Addresses do not change. Afterwards a write to
/// those handles faults (the device's access is read-only). Waits for all work on the device;
/// no work may use the ranges during the call. Ranges of stitched, swappable, guarded or
/// private-pool allocations are kept as they are. `out` (may be NULL) receives what was done.
/// GLAKE_STATUS_INVALID_POINTER or GLAKE_STATUS_INVALID_ARGUMENT for a range outside a live
/// allocation (nothing changes); GLAKE_STATUS_INVALID_STATE when the index is unreadable or a
/// graph capture may be underway. On an error every range keeps its bytes; runs done before
/// it stay shared.
///
/// # Safety
/// `ranges` must be valid for `count` reads (NULL only when `count` is 0); `out` must be NULL
/// or valid for writing a `glake_share_report`.
#[no_mangle]
pub unsafe extern "C" fn glake_share_read_only(
    pool: *mut glake_pool,
    ranges: *const glake_range,
    count: usize,
    out: *mut glake_share_report,
) -> glake_status {
    guard(|| {
        let ranges: Vec<(u64, usize)> = if count == 0 {
            Vec::new()
        } else if ranges.is_null() {
            return Err(Failure::null("ranges"));
        } else {
            // SAFETY: valid for `count` reads under this function's contract.
            unsafe { std::slice::from_raw_parts(ranges, count) }
                .iter()
                .map(|r| (r.ptr as u64, r.bytes))
                .collect()
        };
        let report = handles::get(pool_id(pool))?.share_read_only_many(&ranges)?;
        if out.is_null() {
            return Ok(());
        }
        // SAFETY: non-NULL and valid under this function's contract.
        unsafe { write_out(out, "out", glake_share_report::from(report)) }
    })
}
