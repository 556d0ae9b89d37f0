//! Sleep regions for the Python package (`glake.torch.region`, `sleep`, `wake`): the calling
//! thread's allocations on a device go to a named region, whose memory can then sleep (its
//! physical memory given back, addresses kept) and wake (the same bytes at the same addresses).
//! Each returns 0 on success, -1 with `gmlake_last_error` otherwise.

use std::ffi::{c_char, c_int};

use glake::ffi::region_name;
use glake::pool::SleepMode;
use glake::{Error, ErrorKind};

use crate::{devices, guarded, status};

/// Makes this thread's allocations on `device` go to region `name` until `gmlake_region_end`.
///
/// # Safety
/// `name` must be NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn gmlake_region_begin(name: *const c_char, device: c_int) -> c_int {
    // SAFETY: forwarded under this function's contract.
    status(guarded(|| {
        devices::pool(device)?.begin_region(unsafe { region_name(name) }?)
    }))
}

/// Ends this thread's innermost region on `device`.
#[no_mangle]
pub extern "C" fn gmlake_region_end(device: c_int) -> c_int {
    status(guarded(|| devices::pool(device)?.end_region()))
}

/// Puts region `name` of `device` to sleep; `keep` nonzero keeps its bytes on the host.
///
/// # Safety
/// `name` must be NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn gmlake_sleep(name: *const c_char, keep: c_int, device: c_int) -> c_int {
    let mode = if keep != 0 {
        SleepMode::Keep
    } else {
        SleepMode::Drop
    };
    // SAFETY: forwarded under this function's contract.
    status(guarded(|| {
        devices::pool(device)?.sleep(unsafe { region_name(name) }?, mode)
    }))
}

/// Makes the host buffers a first sleep of region `name` of `device` would make; `out_bytes`
/// (may be NULL) receives their bytes.
///
/// # Safety
/// `name` must be NULL or NUL-terminated; `out_bytes` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gmlake_sleep_prepare(
    name: *const c_char,
    device: c_int,
    out_bytes: *mut u64,
) -> c_int {
    // SAFETY: forwarded under this function's contract.
    status(guarded(|| {
        let made = devices::pool(device)?.prepare_sleep(unsafe { region_name(name) }?)?;
        if !out_bytes.is_null() {
            // SAFETY: non-NULL, valid for a write per this function's contract.
            unsafe { out_bytes.write(made as u64) };
        }
        Ok(())
    }))
}

/// Wakes region `name` of `device`.
///
/// # Safety
/// `name` must be NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn gmlake_wake(name: *const c_char, device: c_int) -> c_int {
    // SAFETY: forwarded under this function's contract.
    status(guarded(|| {
        devices::pool(device)?.wake(unsafe { region_name(name) }?)
    }))
}

/// What region `name` of `device` holds: `out` receives asleep (0 or 1), segments, resident
/// bytes, asleep bytes, allocated bytes and host bytes.
///
/// # Safety
/// `name` must be NULL or NUL-terminated; `out` NULL or valid for 6 writes.
#[no_mangle]
pub unsafe extern "C" fn gmlake_region_info(
    name: *const c_char,
    device: c_int,
    out: *mut u64,
) -> c_int {
    status(guarded(|| {
        if out.is_null() {
            return Err(Error::new(ErrorKind::NullPointer, "out is NULL"));
        }
        // SAFETY: forwarded under this function's contract.
        let i = devices::pool(device)?.region_info(unsafe { region_name(name) }?)?;
        let values = [
            u64::from(i.asleep),
            i.segments as u64,
            i.resident_bytes as u64,
            i.asleep_bytes as u64,
            i.allocated_bytes as u64,
            i.host_bytes as u64,
        ];
        // SAFETY: the caller passes room for 6 values.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), out, values.len()) };
        Ok(())
    }))
}
