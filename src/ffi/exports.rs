//! The exported functions and the structs that cross the boundary.

use std::ffi::{c_char, c_void, CString};

use bitflags::bitflags;
use static_assertions::{assert_eq_size, const_assert_eq};

use super::{glake_status, guard, handles, Failure};
use crate::config::{host_options_from_env, Config, DefragLevel};
use crate::device::{self, BackendChoice, BackendKind, Stream};
use crate::pool::Pool;
use crate::stats::{MemoryStats, Stat, StatArray};

/// Opaque pool handle.
pub struct glake_pool {
    _private: [u8; 0],
}

/// A stream: a `cudaStream_t`/`CUstream` on the CUDA backend (NULL is the default stream), a
/// value from `glake_stream_create` on the host backend.
pub type glake_stream = *mut c_void;

/// Which device backend a pool uses.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum glake_backend {
    /// CUDA when a usable GPU is present, else the host backend.
    GLAKE_BACKEND_AUTO = 0,
    /// Host memory (memfd + mmap): runs anywhere, for tests and examples.
    GLAKE_BACKEND_HOST = 1,
    GLAKE_BACKEND_CUDA = 2,
}

/// `glake_config.flags`: apply the environment variables (GLAKE_*, GMLake's names) on top of
/// the struct's values.
pub const GLAKE_CONFIG_READ_ENV: u32 = 1;

/// `glake_config.flags`: wrap the device so that `glake_pool_inject_fault` can make chosen
/// driver calls fail (for testing a program's error handling).
pub const GLAKE_CONFIG_FAULT_INJECTION: u32 = 2;

bitflags! {
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct ConfigFlags: u32 {
        const READ_ENV = GLAKE_CONFIG_READ_ENV;
        const FAULT_INJECTION = GLAKE_CONFIG_FAULT_INJECTION;
    }
}

/// Driver calls that `glake_pool_inject_fault` can fail.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum glake_driver_call {
    GLAKE_CALL_RESERVE = 0,
    GLAKE_CALL_UNRESERVE = 1,
    GLAKE_CALL_CREATE_PHYSICAL = 2,
    GLAKE_CALL_RELEASE_PHYSICAL = 3,
    GLAKE_CALL_MAP = 4,
    GLAKE_CALL_UNMAP = 5,
    GLAKE_CALL_SET_ACCESS = 6,
    GLAKE_CALL_CREATE_STREAM = 7,
    GLAKE_CALL_DESTROY_STREAM = 8,
    GLAKE_CALL_CREATE_EVENT = 9,
    GLAKE_CALL_DESTROY_EVENT = 10,
    GLAKE_CALL_RECORD_EVENT = 11,
    GLAKE_CALL_QUERY_EVENT = 12,
    GLAKE_CALL_SYNCHRONIZE_EVENT = 13,
    GLAKE_CALL_SYNCHRONIZE_STREAM = 14,
    GLAKE_CALL_SYNCHRONIZE_DEVICE = 15,
    GLAKE_CALL_STREAM_WAIT_EVENT = 16,
    GLAKE_CALL_COPY = 17,
    GLAKE_CALL_PINNED = 18,
    GLAKE_CALL_MEM_INFO = 19,
    GLAKE_CALL_HOST_REGISTER = 20,
    GLAKE_CALL_HOST_QUERY = 21,
    GLAKE_CALL_SHARE = 22,
}

const_assert_eq!(
    glake_driver_call::GLAKE_CALL_SHARE as usize + 1,
    device::CallKind::ALL.len()
);

/// Pool settings. Fill with `glake_config_default`, then change fields.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct glake_config {
    /// `sizeof(glake_config)`, set by `glake_config_default`; guards against header mismatch.
    pub struct_size: u32,
    /// `GLAKE_CONFIG_*` bits.
    pub flags: u32,
    /// Device ordinal.
    pub device: i32,
    /// A `glake_backend` value.
    pub backend: u32,
    /// 1: stitch free blocks (GMLake vmmDefragment=1); 0: plain caching.
    pub stitch: u32,
    /// 0: stitch before creating memory; 1: only when the device is full (GMLake defragLevel).
    pub defrag_level: u32,
    /// Free blocks smaller than this are not stitched (bytes; GMLake fragLimit).
    pub frag_limit: u64,
    /// A cached stitched block serves requests down to 1/reuse_limit of its size (reuseLimit).
    pub reuse_limit: f64,
    /// Cached stitched address space collected past this many bytes (GMLake autoGC, in bytes).
    pub auto_gc_bytes: u64,
    /// Cap on physical memory as a fraction of the device, in (0, 1].
    pub memory_fraction: f64,
    /// Largest request of the small pool, in bytes.
    pub small_limit: u64,
    /// Most pieces one stitched block maps.
    pub max_stitch_pieces: u32,
    /// Must be 0.
    pub reserved: u32,
}

const_assert_eq!(std::mem::size_of::<glake_config>(), 72);
assert_eq_size!(Stat, [i64; 4]);
assert_eq_size!(StatArray, [i64; 12]);
const_assert_eq!(std::mem::size_of::<MemoryStats>(), (9 * 12 + 17 + 12) * 8);

impl glake_config {
    fn from_config(config: &Config) -> Self {
        glake_config {
            struct_size: std::mem::size_of::<glake_config>() as u32,
            flags: 0,
            device: 0,
            backend: glake_backend::GLAKE_BACKEND_AUTO as u32,
            stitch: config.stitch as u32,
            defrag_level: config.defrag_level as u32,
            frag_limit: config.frag_limit as u64,
            reuse_limit: config.reuse_limit,
            auto_gc_bytes: config.auto_gc_bytes as u64,
            memory_fraction: config.memory_fraction,
            small_limit: config.small_limit as u64,
            max_stitch_pieces: config.max_stitch_pieces as u32,
            reserved: 0,
        }
    }

    fn to_config(self) -> Result<(Config, BackendChoice, i32), Failure> {
        let invalid =
            |what: String| Failure::new(glake_status::GLAKE_STATUS_INVALID_ARGUMENT, what);
        if self.struct_size as usize != std::mem::size_of::<glake_config>() {
            return Err(invalid(format!(
                "glake_config.struct_size is {}, expected {} (fill the struct with glake_config_default)",
                self.struct_size,
                std::mem::size_of::<glake_config>()
            )));
        }
        let flags = ConfigFlags::from_bits(self.flags).ok_or_else(|| {
            invalid(format!(
                "glake_config.flags has unknown bits {:#x}",
                self.flags
            ))
        })?;
        if self.reserved != 0 {
            return Err(invalid("glake_config.reserved must be 0".into()));
        }
        let backend = backend_of(self.backend)?;
        let stitch = match self.stitch {
            0 => false,
            1 => true,
            other => return Err(invalid(format!("stitch must be 0 or 1, not {other}"))),
        };
        let defrag_level = match self.defrag_level {
            0 => DefragLevel::BeforeGrow,
            1 => DefragLevel::WhenFull,
            other => return Err(invalid(format!("defrag_level must be 0 or 1, not {other}"))),
        };
        let mut config = Config {
            stitch,
            frag_limit: self.frag_limit as usize,
            reuse_limit: self.reuse_limit,
            defrag_level,
            auto_gc_bytes: self.auto_gc_bytes as usize,
            small_limit: self.small_limit as usize,
            memory_fraction: self.memory_fraction,
            max_stitch_pieces: self.max_stitch_pieces as usize,
            ..Config::default()
        };
        if flags.contains(ConfigFlags::READ_ENV) {
            config.apply_env();
        }
        config.validate()?;
        Ok((config, backend, self.device))
    }
}

/// The backend a `glake_backend` value names.
pub(super) fn backend_of(value: u32) -> Result<BackendChoice, Failure> {
    match value {
        0 => Ok(BackendChoice::Auto),
        1 => Ok(BackendChoice::Host),
        2 => Ok(BackendChoice::Cuda),
        other => Err(Failure::new(
            glake_status::GLAKE_STATUS_INVALID_ARGUMENT,
            format!("unknown backend {other}"),
        )),
    }
}

pub(super) fn stream_of(stream: glake_stream) -> Stream {
    Stream(stream as u64)
}

pub(super) fn pool_id(pool: *mut glake_pool) -> usize {
    pool as usize
}

/// Writes `value` through `out`, failing on NULL.
///
/// # Safety
/// A non-NULL `out` must be valid for a write of `T`.
pub(super) unsafe fn write_out<T>(out: *mut T, what: &str, value: T) -> Result<(), Failure> {
    if out.is_null() {
        return Err(Failure::null(what));
    }
    // SAFETY: non-NULL and valid per the caller's contract.
    unsafe { out.write(value) };
    Ok(())
}

/// Initialises logging (`GLAKE_LOG`, e.g. `GLAKE_LOG=debug`); safe to call many times, and a
/// logger installed by the program is kept.
#[no_mangle]
pub extern "C" fn glake_init() -> glake_status {
    guard(|| {
        crate::init_logging();
        Ok(())
    })
}

/// The library version as "MAJOR.MINOR.PATCH".
#[no_mangle]
pub extern "C" fn glake_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// Fills `out` with the default settings (stitching on, GMLake's defaults).
///
/// # Safety
/// `out` must be NULL or valid for writing a `glake_config`.
#[no_mangle]
pub unsafe extern "C" fn glake_config_default(out: *mut glake_config) -> glake_status {
    guard(|| unsafe { write_out(out, "out", glake_config::from_config(&Config::default())) })
}

/// Creates a pool on the configured device and backend.
///
/// # Safety
/// `config` must be NULL or point to a `glake_config`; `out` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn glake_pool_create(
    config: *const glake_config,
    out: *mut *mut glake_pool,
) -> glake_status {
    guard(|| {
        // Warnings about bad environment values must reach the user even if the program
        // never called glake_init.
        crate::init_logging();
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        if config.is_null() {
            return Err(Failure::null("config"));
        }
        // SAFETY: non-NULL, and points to a glake_config per the contract.
        let raw = unsafe { config.read() };
        let (config, backend, ordinal) = raw.to_config()?;
        let flags = ConfigFlags::from_bits_truncate(raw.flags);
        let mut device = device::open(backend, ordinal, host_options_from_env())?;
        let mut fault = None;
        if flags.contains(ConfigFlags::FAULT_INJECTION) {
            let wrapped = std::sync::Arc::new(device::fault::FaultDevice::new(device));
            device = wrapped.clone();
            fault = Some(wrapped);
        }
        let pool = crate::pool::Pool::new(device, config)?;
        let id = handles::insert(pool, fault);
        // SAFETY: checked non-NULL above.
        unsafe { out.write(id as *mut glake_pool) };
        Ok(())
    })
}

/// Destroys a pool: waits for the device, then releases all its memory (live allocations too,
/// with a warning). The handle is invalid afterwards.
#[no_mangle]
pub extern "C" fn glake_pool_destroy(pool: *mut glake_pool) -> glake_status {
    guard(|| {
        drop(handles::remove(pool_id(pool))?);
        Ok(())
    })
}

/// The backend a pool runs on (`glake_backend`).
///
/// # Safety
/// `out` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn glake_pool_backend(pool: *mut glake_pool, out: *mut u32) -> glake_status {
    guard(|| {
        let pool = handles::get(pool_id(pool))?;
        let backend = match pool.device().kind() {
            BackendKind::Host => glake_backend::GLAKE_BACKEND_HOST,
            BackendKind::Cuda => glake_backend::GLAKE_BACKEND_CUDA,
        };
        unsafe { write_out(out, "out", backend as u32) }
    })
}

/// Allocates `size` bytes for use on `stream`; at least 512-byte aligned.
///
/// # Safety
/// `out` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn glake_malloc(
    pool: *mut glake_pool,
    size: usize,
    stream: glake_stream,
    out: *mut *mut c_void,
) -> glake_status {
    // SAFETY: `out` is forwarded under this function's contract.
    unsafe { allocate_into(pool, out, |p| p.malloc(size, stream_of(stream))) }
}

/// Runs allocation `op` on `pool` and writes its pointer to `*out`: the shared checks of the
/// calls that allocate.
///
/// # Safety
/// `out` must be NULL or valid for a write.
unsafe fn allocate_into(
    pool: *mut glake_pool,
    out: *mut *mut c_void,
    op: impl FnOnce(&Pool) -> crate::Result<u64>,
) -> glake_status {
    guard(|| {
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let pool = handles::get(pool_id(pool))?;
        let ptr = op(&pool)?;
        unsafe { write_out(out, "out", ptr as *mut c_void) }
    })
}

/// Frees an allocation; its memory is reused on its stream at once, elsewhere once safe.
#[no_mangle]
pub extern "C" fn glake_free(pool: *mut glake_pool, ptr: *mut c_void) -> glake_status {
    on_allocation(pool, ptr, Pool::free)
}

/// Runs `op` on the allocation at `ptr` of `pool`: the shared checks of the calls that take
/// a pool and an allocation.
fn on_allocation(
    pool: *mut glake_pool,
    ptr: *mut c_void,
    op: impl FnOnce(&Pool, u64) -> crate::Result<()>,
) -> glake_status {
    guard(|| {
        let pool = handles::get(pool_id(pool))?;
        if ptr.is_null() {
            return Err(Failure::null("ptr"));
        }
        op(&pool, ptr as u64)?;
        Ok(())
    })
}

/// Allocates `size` bytes (rounded up to 512 bytes) for use on `stream`, in
/// memory of their own that `glake_swap_out` can give back to the device and `glake_swap_in`
/// bring back at the same address. Free it with `glake_free`, swapped out or not.
///
/// # Safety
/// `out` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn glake_malloc_swappable(
    pool: *mut glake_pool,
    size: usize,
    stream: glake_stream,
    out: *mut *mut c_void,
) -> glake_status {
    // SAFETY: `out` is forwarded under this function's contract.
    unsafe { allocate_into(pool, out, |p| p.malloc_swappable(size, stream_of(stream))) }
}

/// Swaps the swappable allocation at `ptr` out: waits for the work queued on its streams,
/// copies its bytes into host memory the pool keeps, and gives its device memory back; the
/// address stays reserved. GLAKE_STATUS_INVALID_STATE when it is already swapped out.
#[no_mangle]
pub extern "C" fn glake_swap_out(pool: *mut glake_pool, ptr: *mut c_void) -> glake_status {
    on_allocation(pool, ptr, Pool::swap_out)
}

/// Swaps the allocation at `ptr` back in at the same address. GLAKE_STATUS_OUT_OF_MEMORY when
/// the cap or the device is full (it stays swapped out, its bytes kept),
/// GLAKE_STATUS_INVALID_STATE when it is not swapped out.
#[no_mangle]
pub extern "C" fn glake_swap_in(pool: *mut glake_pool, ptr: *mut c_void) -> glake_status {
    on_allocation(pool, ptr, Pool::swap_in)
}

/// Queues the swap-out of the swappable allocation at `ptr` on `copy` (a stream of the pool's
/// device) and returns without waiting: the copy to a pinned buffer the pool keeps runs after
/// the work queued on the allocation's streams; its device memory goes back once
/// `glake_swap_finish` sees the copy done (until then it counts as resident).
/// GLAKE_STATUS_INVALID_STATE when it is swapped out or already on its way out.
#[no_mangle]
pub extern "C" fn glake_swap_out_async(
    pool: *mut glake_pool,
    ptr: *mut c_void,
    copy: glake_stream,
) -> glake_status {
    on_allocation(pool, ptr, |p, ptr| p.swap_out_async(ptr, stream_of(copy)))
}

/// Completes the queued swap-outs whose copies are done (with `wait` nonzero, all of them,
/// waiting for their copies): their device memory goes back. Writes how many completed to
/// `completed` (may be NULL).
///
/// # Safety
/// `completed` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn glake_swap_finish(
    pool: *mut glake_pool,
    wait: u32,
    completed: *mut u64,
) -> glake_status {
    guard(|| {
        let pool = handles::get(pool_id(pool))?;
        let n = pool.finish_swap_outs(wait != 0)?;
        if !completed.is_null() {
            // SAFETY: non-NULL, valid under this function's contract.
            unsafe { write_out(completed, "completed", n as u64)? };
        }
        Ok(())
    })
}

/// Brings the swappable allocation at `ptr` back without waiting: on its way out, the
/// swap-out is cancelled (its memory never left); swapped out, new memory is mapped at the
/// same address and filled by a copy on `copy` that the allocation's streams wait for. Errors
/// as `glake_swap_in`.
#[no_mangle]
pub extern "C" fn glake_swap_in_async(
    pool: *mut glake_pool,
    ptr: *mut c_void,
    copy: glake_stream,
) -> glake_status {
    on_allocation(pool, ptr, |p, ptr| p.swap_in_async(ptr, stream_of(copy)))
}

/// Marks the allocation at `ptr` as used on `stream` as well (like `Tensor.record_stream`).
#[no_mangle]
pub extern "C" fn glake_record_stream(
    pool: *mut glake_pool,
    ptr: *mut c_void,
    stream: glake_stream,
) -> glake_status {
    guard(|| {
        let pool = handles::get(pool_id(pool))?;
        if ptr.is_null() {
            return Err(Failure::null("ptr"));
        }
        pool.record_stream(ptr as u64, stream_of(stream))?;
        Ok(())
    })
}

/// Checks the pool's own bookkeeping (blocks, segments, statistics, swapped allocations):
/// GLAKE_STATUS_INTERNAL with the first inconsistency found as the message. For tests and
/// fuzzing; it takes the pool's lock for a walk over all its blocks.
#[no_mangle]
pub extern "C" fn glake_pool_check(pool: *mut glake_pool) -> glake_status {
    guard(|| {
        handles::get(pool_id(pool))?
            .check_invariants()
            .map_err(|m| Failure::new(glake_status::GLAKE_STATUS_INTERNAL, m))
    })
}

/// Returns cached, unused memory to the driver (after waiting for the device).
#[no_mangle]
pub extern "C" fn glake_empty_cache(pool: *mut glake_pool) -> glake_status {
    guard(|| {
        handles::get(pool_id(pool))?.empty_cache()?;
        Ok(())
    })
}

/// Caps the pool's physical memory at `fraction` of the device's memory, in [0, 1], kept as
/// the nearest byte (a fraction computed as budget / total gives the budget back exactly).
/// Replaces any earlier cap.
#[no_mangle]
pub extern "C" fn glake_set_memory_fraction(pool: *mut glake_pool, fraction: f64) -> glake_status {
    guard(|| {
        handles::get(pool_id(pool))?.set_memory_fraction(fraction)?;
        Ok(())
    })
}

/// Caps the pool's physical memory at `bytes` (more than the device has means the device's
/// total; 0 is an error). Memory is created in whole granules, so the usable part of the cap
/// is `bytes` rounded down to the granularity. Replaces any earlier cap.
#[no_mangle]
pub extern "C" fn glake_set_memory_limit(pool: *mut glake_pool, bytes: u64) -> glake_status {
    guard(|| {
        let bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
        handles::get(pool_id(pool))?.set_memory_limit(bytes)?;
        Ok(())
    })
}

/// Writes the pool's cap on physical memory in bytes to `out_bytes`, and, when `out_fraction`
/// is not NULL, the fraction last set (or the byte cap's share of the device) to it.
///
/// # Safety
/// `out_bytes` must be valid for a write (NULL is an error); `out_fraction` NULL or valid for a
/// write.
#[no_mangle]
pub unsafe extern "C" fn glake_get_memory_limit(
    pool: *mut glake_pool,
    out_bytes: *mut u64,
    out_fraction: *mut f64,
) -> glake_status {
    guard(|| {
        let pool = handles::get(pool_id(pool))?;
        unsafe { write_out(out_bytes, "out_bytes", pool.memory_limit() as u64)? };
        if !out_fraction.is_null() {
            unsafe { write_out(out_fraction, "out_fraction", pool.memory_fraction())? };
        }
        Ok(())
    })
}

/// Grants device `peer` access to all memory of the pool, now and for memory created later
/// (a VMM range is invisible to a peer GPU until access is granted).
#[no_mangle]
pub extern "C" fn glake_pool_enable_peer_access(pool: *mut glake_pool, peer: i32) -> glake_status {
    guard(|| {
        handles::get(pool_id(pool))?.enable_peer_access(peer)?;
        Ok(())
    })
}

/// Copies the pool's statistics (PyTorch's memory_stats fields plus stitch counters).
///
/// # Safety
/// `out` must be NULL or valid for writing a `glake_stats`.
#[no_mangle]
pub unsafe extern "C" fn glake_get_stats(
    pool: *mut glake_pool,
    out: *mut MemoryStats,
) -> glake_status {
    guard(|| {
        let stats = handles::get(pool_id(pool))?.stats();
        unsafe { write_out(out, "out", stats) }
    })
}

/// Sets every peak statistic to its current value.
#[no_mangle]
pub extern "C" fn glake_reset_peak_stats(pool: *mut glake_pool) -> glake_status {
    guard(|| {
        handles::get(pool_id(pool))?.reset_peak_stats();
        Ok(())
    })
}

/// Zeroes the running totals (allocated/freed) and event counters.
#[no_mangle]
pub extern "C" fn glake_reset_accumulated_stats(pool: *mut glake_pool) -> glake_status {
    guard(|| {
        handles::get(pool_id(pool))?.reset_accumulated_stats();
        Ok(())
    })
}

/// A new C string for `glake_string_free` (NUL bytes become spaces). Also used by the PyTorch
/// plug-in, whose strings the same function frees.
pub fn into_c_string(text: String) -> *mut c_char {
    CString::new(text.replace('\0', " "))
        .unwrap_or_default()
        .into_raw()
}

/// Writes a JSON text made from the pool through `out`, as a string for `glake_string_free`.
///
/// # Safety
/// `out` must be NULL or valid for a write.
unsafe fn json_out(
    pool: *mut glake_pool,
    out: *mut *mut c_char,
    json: impl FnOnce(&crate::pool::Pool) -> String,
) -> glake_status {
    guard(|| {
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let pool = handles::get(pool_id(pool))?;
        let text = json(&pool);
        unsafe { write_out(out, "out", into_c_string(text)) }
    })
}

/// A JSON snapshot of segments, blocks, stitched ranges and statistics. Free the string with
/// `glake_string_free`.
///
/// # Safety
/// `out` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn glake_snapshot_json(
    pool: *mut glake_pool,
    out: *mut *mut c_char,
) -> glake_status {
    // SAFETY: forwarded under this function's contract.
    unsafe { json_out(pool, out, |p| p.snapshot().to_json()) }
}

/// The statistics as a JSON object with PyTorch's `memory_stats()` key names. Free the string
/// with `glake_string_free`.
///
/// # Safety
/// `out` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn glake_stats_json(
    pool: *mut glake_pool,
    out: *mut *mut c_char,
) -> glake_status {
    // SAFETY: forwarded under this function's contract.
    unsafe { json_out(pool, out, |p| p.stats().to_json()) }
}

/// Frees a string returned by this library; NULL is ignored.
///
/// # Safety
/// `text` must be NULL or a string from this library, not freed before.
#[no_mangle]
pub unsafe extern "C" fn glake_string_free(text: *mut c_char) {
    if !text.is_null() {
        // SAFETY: made by CString::into_raw in this library, per the contract.
        let _ = std::panic::catch_unwind(|| drop(unsafe { CString::from_raw(text) }));
    }
}

/// Creates a stream on the pool's device.
///
/// # Safety
/// `out` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn glake_stream_create(
    pool: *mut glake_pool,
    out: *mut glake_stream,
) -> glake_status {
    guard(|| {
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let stream = handles::get(pool_id(pool))?.device().create_stream()?;
        unsafe { write_out(out, "out", stream.0 as glake_stream) }
    })
}

/// Destroys a stream made by `glake_stream_create`; queued work still completes.
#[no_mangle]
pub extern "C" fn glake_stream_destroy(
    pool: *mut glake_pool,
    stream: glake_stream,
) -> glake_status {
    guard(|| {
        handles::get(pool_id(pool))?
            .device()
            .destroy_stream(stream_of(stream))?;
        Ok(())
    })
}

/// Waits for all work queued on `stream`.
#[no_mangle]
pub extern "C" fn glake_stream_synchronize(
    pool: *mut glake_pool,
    stream: glake_stream,
) -> glake_status {
    guard(|| {
        handles::get(pool_id(pool))?
            .device()
            .synchronize_stream(stream_of(stream))?;
        Ok(())
    })
}

/// The pool of a copy call, after checking both addresses.
fn copy_pool(
    pool: *mut glake_pool,
    dst: *const c_void,
    src: *const c_void,
) -> Result<std::sync::Arc<crate::pool::Pool>, Failure> {
    let pool = handles::get(pool_id(pool))?;
    if dst.is_null() {
        return Err(Failure::null("dst"));
    }
    if src.is_null() {
        return Err(Failure::null("src"));
    }
    Ok(pool)
}

/// Queues a copy of `size` bytes from host memory to device memory of the pool on `stream`.
///
/// # Safety
/// `src` must stay valid for `size` bytes until the stream has run the copy.
#[no_mangle]
pub unsafe extern "C" fn glake_copy_to_device(
    pool: *mut glake_pool,
    dst: *mut c_void,
    src: *const c_void,
    size: usize,
    stream: glake_stream,
) -> glake_status {
    guard(|| {
        let pool = copy_pool(pool, dst, src)?;
        // SAFETY: the caller keeps `src` valid until the copy completes.
        unsafe {
            pool.device()
                .copy_to_device(dst as u64, src.cast(), size, stream_of(stream))?
        };
        Ok(())
    })
}

/// Queues a copy of `size` bytes from device memory to host memory on `stream`.
///
/// # Safety
/// `dst` must stay valid for `size` bytes until the stream has run the copy.
#[no_mangle]
pub unsafe extern "C" fn glake_copy_to_host(
    pool: *mut glake_pool,
    dst: *mut c_void,
    src: *const c_void,
    size: usize,
    stream: glake_stream,
) -> glake_status {
    guard(|| {
        let pool = copy_pool(pool, dst, src)?;
        // SAFETY: the caller keeps `dst` valid until the copy completes.
        unsafe {
            pool.device()
                .copy_to_host(dst.cast(), src as u64, size, stream_of(stream))?
        };
        Ok(())
    })
}

/// Makes the `nth` next call of kind `call` made by the pool fail with `status` (or panic
/// inside the library, for `GLAKE_STATUS_PANIC`). The pool must have been created with
/// `GLAKE_CONFIG_FAULT_INJECTION`. For testing how a program handles failures.
#[no_mangle]
pub extern "C" fn glake_pool_inject_fault(
    pool: *mut glake_pool,
    call: u32,
    nth: u64,
    status: u32,
) -> glake_status {
    guard(|| {
        let entry = handles::entry(pool_id(pool))?;
        let fault = entry.fault.ok_or_else(|| {
            Failure::new(
                glake_status::GLAKE_STATUS_INVALID_STATE,
                "the pool was not created with GLAKE_CONFIG_FAULT_INJECTION",
            )
        })?;
        let kind = *device::CallKind::ALL.get(call as usize).ok_or_else(|| {
            Failure::new(
                glake_status::GLAKE_STATUS_INVALID_ARGUMENT,
                format!("unknown driver call {call}"),
            )
        })?;
        if status == glake_status::GLAKE_STATUS_PANIC as u32 {
            fault.panic_nth(kind, nth);
            return Ok(());
        }
        let error = super::kind_of_status(status).ok_or_else(|| {
            Failure::new(
                glake_status::GLAKE_STATUS_INVALID_ARGUMENT,
                format!("status {status} cannot be injected"),
            )
        })?;
        fault.fail_nth_with(kind, nth, error);
        Ok(())
    })
}
