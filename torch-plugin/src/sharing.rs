//! Deduplication of read-only memory for the Python package (`glake.torch.share_weights`):
//! memory of a device declared read-only and shared with other processes holding the same
//! bytes. Returns 0 on success, -1 with `gmlake_last_error` otherwise.

use std::ffi::c_int;

use glake::{Error, ErrorKind};

use crate::{devices, guarded, status};

/// Declares the `count` ranges `ptrs[i]`, `bytes[i]` of `device`, each inside one live
/// allocation, read-only and shares them (see `glake_share_read_only`); `out` receives shared,
/// offered and kept bytes.
///
/// # Safety
/// `ptrs` and `bytes` must be valid for `count` reads; `out` NULL or valid for 3 writes.
#[no_mangle]
pub unsafe extern "C" fn gmlake_share_read_only(
    ptrs: *const u64,
    bytes: *const u64,
    count: usize,
    device: c_int,
    out: *mut u64,
) -> c_int {
    status(guarded(|| {
        if out.is_null() || (count > 0 && (ptrs.is_null() || bytes.is_null())) {
            return Err(Error::new(
                ErrorKind::NullPointer,
                "a pointer argument is NULL",
            ));
        }
        let ranges: Vec<(u64, usize)> = if count == 0 {
            Vec::new()
        } else {
            // SAFETY: both are valid for `count` reads under this function's contract.
            let (ptrs, bytes) = unsafe {
                (
                    std::slice::from_raw_parts(ptrs, count),
                    std::slice::from_raw_parts(bytes, count),
                )
            };
            ptrs.iter()
                .zip(bytes)
                .map(|(&p, &b)| (p, b as usize))
                .collect()
        };
        let r = devices::pool(device)?.share_read_only_many(&ranges)?;
        let values = [r.shared_bytes, r.offered_bytes, r.kept_bytes];
        // SAFETY: the caller passes room for 3 values.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), out, values.len()) };
        Ok(())
    }))
}
