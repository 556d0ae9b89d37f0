//! C API of sleep regions: `glake_region_*`, `glake_sleep`, `glake_wake`. Memory allocated
//! while a thread has a region open lives apart, so the region can give its physical memory
//! back (sleep) and get it back at the same addresses with the same bytes (wake).

use std::ffi::{c_char, CStr};

use super::exports::{glake_pool, pool_id, write_out};
use super::{glake_status, guard, handles, Failure};
use crate::pool::{RegionInfo, SleepMode};

/// What a sleeping region keeps of its bytes (passed to `glake_sleep` as a `uint32_t`, so a
/// value outside the enum is refused rather than undefined).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum glake_sleep_mode {
    /// A host copy (pinned, kept for the next sleep), restored by `glake_wake`.
    GLAKE_SLEEP_KEEP = 0,
    /// Nothing: after `glake_wake` the memory holds undefined bytes (KV caches, scratch).
    GLAKE_SLEEP_DROP = 1,
}

/// What `glake_get_region_info` reports.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct glake_region_info {
    /// 1 from `glake_sleep` until a `glake_wake` completes, else 0.
    pub asleep: u32,
    /// Segments of the region, awake or asleep.
    pub segments: u64,
    /// Bytes of the region's segments that hold physical memory now.
    pub resident_bytes: u64,
    /// Bytes of the region's segments whose physical memory is given back.
    pub asleep_bytes: u64,
    /// Bytes of live allocations in the region.
    pub allocated_bytes: u64,
    /// Bytes of host copies held for the sleeping segments.
    pub host_bytes: u64,
}

impl From<RegionInfo> for glake_region_info {
    fn from(i: RegionInfo) -> Self {
        glake_region_info {
            asleep: u32::from(i.asleep),
            segments: i.segments as u64,
            resident_bytes: i.resident_bytes as u64,
            asleep_bytes: i.asleep_bytes as u64,
            allocated_bytes: i.allocated_bytes as u64,
            host_bytes: i.host_bytes as u64,
        }
    }
}

/// The region name at `name` (what every C entry point taking one reads): NULL and invalid
/// UTF-8 are refused.
///
/// # Safety
/// A non-NULL `name` must be NUL-terminated and outlive the returned name.
pub unsafe fn region_name<'a>(name: *const c_char) -> crate::Result<&'a str> {
    if name.is_null() {
        return Err(crate::Error::new(
            crate::ErrorKind::NullPointer,
            "the region name is NULL",
        ));
    }
    // SAFETY: non-NULL and NUL-terminated under the caller's contract.
    unsafe { CStr::from_ptr(name) }
        .to_str()
        .map_err(|_| crate::Error::invalid_argument("the region name is not UTF-8"))
}

fn pool_of(pool: *mut glake_pool) -> Result<std::sync::Arc<crate::Pool>, Failure> {
    handles::get(pool_id(pool))
}

/// Makes the calling thread's allocations from `pool` go to region `name` (1 to 255 bytes of
/// UTF-8; made on first use) until the matching `glake_region_end`. Regions nest; other
/// threads are not affected.
///
/// # Safety
/// `name` must be NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn glake_region_begin(
    pool: *mut glake_pool,
    name: *const c_char,
) -> glake_status {
    guard(|| {
        // SAFETY: forwarded under this function's contract.
        let name = unsafe { region_name(name) }?;
        pool_of(pool)?.begin_region(name)?;
        Ok(())
    })
}

/// Ends the calling thread's innermost region of `pool`. GLAKE_STATUS_INVALID_STATE when this
/// thread has none open.
#[no_mangle]
pub extern "C" fn glake_region_end(pool: *mut glake_pool) -> glake_status {
    guard(|| {
        pool_of(pool)?.end_region()?;
        Ok(())
    })
}

/// Gives the physical memory of region `name` back to the device, every address staying
/// reserved: cached free memory of the region goes back whole, allocated bytes are copied to
/// host memory (GLAKE_SLEEP_KEEP) or dropped. Waits for all work queued on the device first,
/// and returns once the copies are done; with pinned host buffers (the default) each range's
/// memory goes back as soon as its bytes are copied, while later ranges still copy. Until
/// `glake_wake`, allocations in the region fail
/// with GLAKE_STATUS_INVALID_STATE. GLAKE_STATUS_INVALID_ARGUMENT for an unknown region,
/// GLAKE_STATUS_INVALID_STATE when it is already asleep. On another error no byte is lost:
/// call again to finish, or wake.
///
/// # Safety
/// `name` must be NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn glake_sleep(
    pool: *mut glake_pool,
    name: *const c_char,
    mode: u32,
) -> glake_status {
    guard(|| {
        // SAFETY: forwarded under this function's contract.
        let name = unsafe { region_name(name) }?;
        let mode = match mode {
            m if m == glake_sleep_mode::GLAKE_SLEEP_KEEP as u32 => SleepMode::Keep,
            m if m == glake_sleep_mode::GLAKE_SLEEP_DROP as u32 => SleepMode::Drop,
            other => {
                return Err(Failure::new(
                    glake_status::GLAKE_STATUS_INVALID_ARGUMENT,
                    format!("sleep mode {other} is neither KEEP (0) nor DROP (1)"),
                ))
            }
        };
        pool_of(pool)?.sleep(name, mode)?;
        Ok(())
    })
}

/// Makes ahead of time the host buffers (and the copy engine) a first `glake_sleep` of region
/// `name` in GLAKE_SLEEP_KEEP mode would make, so that it runs at the link's speed instead of
/// the few GB/s of pinning memory. Call it once the region is filled (weights loaded), from
/// any thread: the buffers are made without holding up other calls on the pool. They cover
/// the region as it is now, and are kept until the pool is destroyed. `out_bytes` (may be
/// NULL) receives the bytes made. On an error those made are kept; call again to finish.
///
/// # Safety
/// `name` must be NULL or NUL-terminated; `out_bytes` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn glake_sleep_prepare(
    pool: *mut glake_pool,
    name: *const c_char,
    out_bytes: *mut usize,
) -> glake_status {
    guard(|| {
        // SAFETY: forwarded under this function's contract.
        let name = unsafe { region_name(name) }?;
        let made = pool_of(pool)?.prepare_sleep(name)?;
        if !out_bytes.is_null() {
            // SAFETY: non-NULL, valid for a write per this function's contract.
            unsafe { out_bytes.write(made) };
        }
        Ok(())
    })
}

/// Maps region `name`'s memory back at the same addresses and restores the bytes it kept;
/// returns once the copies are done, so work queued afterwards on any stream sees them.
/// GLAKE_STATUS_INVALID_STATE when it is awake; GLAKE_STATUS_OUT_OF_MEMORY when the device or
/// the cap has no room (the rest stays asleep with its bytes: free memory and call again).
///
/// # Safety
/// `name` must be NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn glake_wake(pool: *mut glake_pool, name: *const c_char) -> glake_status {
    guard(|| {
        // SAFETY: forwarded under this function's contract.
        let name = unsafe { region_name(name) }?;
        pool_of(pool)?.wake(name)?;
        Ok(())
    })
}

/// What region `name` holds now.
///
/// # Safety
/// `name` must be NULL or NUL-terminated; `out` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn glake_get_region_info(
    pool: *mut glake_pool,
    name: *const c_char,
    out: *mut glake_region_info,
) -> glake_status {
    guard(|| {
        // SAFETY: forwarded under this function's contract.
        let name = unsafe { region_name(name) }?;
        let info = pool_of(pool)?.region_info(name)?;
        // SAFETY: forwarded under this function's contract.
        unsafe { write_out(out, "out", info.into()) }
    })
}
