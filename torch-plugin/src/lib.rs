//! libgmlake.so: glake as PyTorch's `torch.cuda.memory.CUDAPluggableAllocator`, under GMLake's
//! symbol names and with torch 2.x's signatures.
//!
//! The allocator entry points (`gmlake_malloc`, `gmlake_free`, `gmlake_init`, `gmlake_reset`,
//! `gmlake_memory_fraction`, `gmlake_base_alloc`, `gmlake_record_stream` and the graph-pool
//! hooks) are what PyTorch calls. Failures that PyTorch must see become C++ exceptions thrown
//! by the C++ half (`trampoline.cpp`), which PyTorch turns into Python errors; `gmlake_free`
//! and `gmlake_release_pool` never throw (PyTorch calls them from deleters and destructors).
//! The `gmlake_*_json` and `gmlake_reset_*_stats` functions serve the Python package, and the
//! `gmlake_n_*` functions ([`native`]) the native allocator compiled against torch.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

mod devices;
pub mod native;
mod regions;
mod sharing;
mod timing;

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use glake::pool::{AllocationInfo, PrivatePoolId};
use glake::stats::MemoryStats;
use glake::{Error, ErrorKind, Stream};

extern "C-unwind" {
    fn gmlake_cxx_throw(out_of_memory: c_int, message: *const c_char) -> !;
}

extern "C" {
    fn gmlake_cxx_filter_take(filter: *mut c_void) -> *mut c_void;
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn remember(err: &Error) {
    // Out of memory reads like PyTorch's own message, which programs (batch-size finders, for
    // example) look for in a RuntimeError.
    let text = if err.kind() == ErrorKind::OutOfMemory {
        format!("CUDA out of memory. glake: {err}")
    } else {
        format!("glake: {err}")
    };
    let text = text.replace('\0', " ");
    let text = CString::new(text).unwrap_or_default();
    LAST_ERROR.with(|last| *last.borrow_mut() = text);
}

/// Runs `body`, turning a panic into an error and remembering any error's text.
fn guarded<T>(body: impl FnOnce() -> glake::Result<T>) -> Result<T, ErrorKind> {
    let result = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(result) => result,
        Err(_) => Err(Error::internal("a panic was caught inside the allocator")),
    };
    result.map_err(|err| {
        remember(&err);
        err.kind()
    })
}

/// Throws the remembered error as a C++ exception. Nothing with a destructor lives in this
/// frame, so the exception passes through it cleanly.
fn throw(kind: ErrorKind) -> ! {
    let message = LAST_ERROR.with(|last| last.borrow().as_ptr());
    let oom = c_int::from(kind == ErrorKind::OutOfMemory);
    // SAFETY: `message` points into this thread's LAST_ERROR, unchanged until the C++ side has
    // copied it into the exception.
    unsafe { gmlake_cxx_throw(oom, message) }
}

fn stream_of(stream: *mut c_void) -> Stream {
    Stream(stream as usize as u64)
}

/// PyTorch's `MempoolId_t` (a pair of 64-bit ids), passed by value; `gmlake_n_pool_id` of the
/// native ABI.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MempoolId {
    pub first: u64,
    pub second: u64,
}

impl From<MempoolId> for PrivatePoolId {
    fn from(id: MempoolId) -> Self {
        (id.first, id.second)
    }
}

/// Allocates `size` bytes on `device` for `stream` from private pool `private` (None: the
/// shared pool). With `count_pieces`, the number of pieces of a stitched range comes too (else
/// 0), looked up under the allocation's lock.
fn allocate_in(
    device: c_int,
    size: usize,
    asked: usize,
    stream: *mut c_void,
    private: Option<PrivatePoolId>,
    count_pieces: bool,
) -> glake::Result<(*mut c_void, u32)> {
    let pool = devices::pool(device)?;
    let stream = stream_of(stream);
    let (ptr, pieces) = if count_pieces {
        pool.malloc_in_with_pieces(size, asked, stream, private)?
    } else {
        (pool.malloc_asked(size, asked, stream, private)?, 0)
    };
    Ok((ptr as usize as *mut c_void, pieces))
}

fn allocate(size: usize, device: c_int, stream: *mut c_void) -> glake::Result<*mut c_void> {
    if size == 0 {
        // PyTorch gives empty tensors no memory: a null pointer of size 0, freed as such.
        return Ok(std::ptr::null_mut());
    }
    let private = devices::route_of(device, stream);
    allocate_in(device, size, size, stream, private, false).map(|(ptr, _)| ptr)
}

/// Frees `ptr` in the pool of `device`, or in whichever pool knows it; returns the device of
/// the pool that freed it.
fn release(ptr: *mut c_void, device: c_int) -> glake::Result<c_int> {
    let addr = ptr as usize as u64;
    if addr == 0 {
        return Err(Error::new(ErrorKind::NullPointer, "pointer is NULL"));
    }
    // The pool of `device` first (PyTorch's pluggable interface passes the allocation's
    // device), then every pool (the native allocator's deleter knows no device: -1). Pools
    // that do not own the pointer say so without building an error.
    if let Some(pool) = devices::existing(device) {
        if pool.free_if_owned(addr)? {
            return Ok(device);
        }
    }
    for (d, pool) in devices::all() {
        if d != device && pool.free_if_owned(addr)? {
            return Ok(d);
        }
    }
    // No pool owns it: the hinted (or first) pool says whether it is a double free, on this
    // error path only.
    let explain = devices::existing(device).or_else(|| devices::all().next().map(|(_, p)| p));
    Err(match explain.map(|p| p.free(addr)) {
        Some(Err(err)) if err.kind() != ErrorKind::InvalidPointer => err,
        _ => Error::new(
            ErrorKind::InvalidPointer,
            format!("{addr:#x} was not allocated by glake"),
        ),
    })
}

/// Allocates `size` bytes on `device` for use on `stream`; throws on failure (never NULL for
/// a nonzero size).
#[no_mangle]
pub extern "C-unwind" fn gmlake_malloc(
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let allocated = timing::timed(&timing::MALLOC, || {
        guarded(|| allocate(size, device, stream))
    });
    match allocated {
        Ok(ptr) => ptr,
        Err(kind) => throw(kind),
    }
}

/// Frees memory from `gmlake_malloc`. Never throws: a bad pointer is logged and ignored.
#[no_mangle]
pub extern "C" fn gmlake_free(ptr: *mut c_void, _size: usize, device: c_int, _stream: *mut c_void) {
    if ptr.is_null() {
        return;
    }
    let freed = timing::timed(&timing::FREE, || guarded(|| release(ptr, device)));
    if freed.is_err() {
        LAST_ERROR.with(|last| log::error!("{}", last.borrow().to_string_lossy()));
    }
}

/// Called once by PyTorch when CUDA is initialised. Pools are created per device on first use.
#[no_mangle]
pub extern "C" fn gmlake_init(device_count: c_int) {
    glake::init_logging();
    log::debug!("glake: PyTorch plug-in initialised for {device_count} devices");
}

/// Returns the unused memory of `device`'s pool (None: of every pool) to the driver; a device
/// whose pool does not exist yet has none. The first error is returned after all were tried.
fn empty_caches(device: Option<c_int>) -> glake::Result<()> {
    if let Some(device) = device {
        devices::index(device)?;
    }
    let mut first = None;
    for (_, pool) in devices::all().filter(|&(d, _)| device.is_none_or(|wanted| wanted == d)) {
        if let Err(err) = pool.empty_cache() {
            first.get_or_insert(err);
        }
    }
    first.map_or(Ok(()), Err)
}

/// `torch.cuda.empty_cache()`: returns every pool's unused memory to the driver.
#[no_mangle]
pub extern "C-unwind" fn gmlake_reset() {
    if let Err(kind) = guarded(|| empty_caches(None)) {
        throw(kind)
    }
}

/// Caps `device`'s pool (created if needed) at `fraction` of the device.
fn set_memory_fraction(device: c_int, fraction: f64) -> glake::Result<()> {
    devices::pool(device)?.set_memory_fraction(fraction)
}

/// `device`'s cap (its pool created if needed) in bytes, and the fraction last set or the
/// byte cap's share of the device.
fn memory_limit_of(device: c_int) -> glake::Result<(u64, f64)> {
    let pool = devices::pool(device)?;
    Ok((pool.memory_limit() as u64, pool.memory_fraction()))
}

/// `torch.cuda.set_per_process_memory_fraction(fraction, device)`.
#[no_mangle]
pub extern "C-unwind" fn gmlake_memory_fraction(fraction: f64, device: c_int) {
    if let Err(kind) = guarded(|| set_memory_fraction(device, fraction)) {
        throw(kind)
    }
}

/// Caps `device`'s pool at `bytes` of physical memory (`glake.torch.set_memory_limit`),
/// replacing any earlier cap. 0 on success, -1 with `gmlake_last_error` otherwise.
#[no_mangle]
pub extern "C" fn gmlake_set_memory_limit(bytes: u64, device: c_int) -> c_int {
    let bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
    status(guarded(|| devices::pool(device)?.set_memory_limit(bytes)))
}

/// `device`'s cap on physical memory in bytes and as a fraction of the device (the fraction
/// last set, or the byte cap's share). 0 on success, -1 with `gmlake_last_error` otherwise.
///
/// # Safety
/// `out_bytes` and `out_fraction` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gmlake_memory_limit(
    device: c_int,
    out_bytes: *mut u64,
    out_fraction: *mut f64,
) -> c_int {
    status(guarded(|| {
        if out_bytes.is_null() || out_fraction.is_null() {
            return Err(Error::new(ErrorKind::NullPointer, "an out pointer is NULL"));
        }
        let (bytes, fraction) = memory_limit_of(device)?;
        // SAFETY: non-null, and the caller passes pointers valid for a write.
        unsafe {
            *out_bytes = bytes;
            *out_fraction = fraction;
        }
        Ok(())
    }))
}

/// The live allocation containing `ptr`, in whichever pool holds it.
fn allocation_containing(ptr: *mut c_void) -> glake::Result<AllocationInfo> {
    let addr = ptr as usize as u64;
    devices::all()
        .find_map(|(_, p)| p.allocation_of(addr))
        .ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidPointer,
                format!("{addr:#x} is not inside a glake allocation"),
            )
        })
}

/// The start of the allocation containing `ptr`; its size goes to `*size`.
///
/// # Safety
/// `size` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C-unwind" fn gmlake_base_alloc(
    ptr: *mut c_void,
    size: *mut usize,
) -> *mut c_void {
    match guarded(|| allocation_containing(ptr)) {
        Ok(info) => {
            if !size.is_null() {
                // SAFETY: non-null and valid for a write under this function's contract.
                unsafe { *size = info.size };
            }
            info.base as usize as *mut c_void
        }
        Err(kind) => throw(kind),
    }
}

/// `Tensor.record_stream(stream)`: the memory is not reused before `stream`'s work queued by
/// the time of the free has completed.
#[no_mangle]
pub extern "C-unwind" fn gmlake_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    if let Err(kind) = guarded(|| record_stream(ptr, stream)) {
        throw(kind)
    }
}

/// Records that `stream` uses the allocation at `ptr`, in whichever pool holds it.
fn record_stream(ptr: *mut c_void, stream: *mut c_void) -> glake::Result<()> {
    let addr = ptr as usize as u64;
    let mut last = Error::new(
        ErrorKind::InvalidPointer,
        format!("{addr:#x} was not allocated by glake"),
    );
    for (_, pool) in devices::all() {
        match pool.record_stream(addr, stream_of(stream)) {
            Ok(()) => return Ok(()),
            Err(err) => last = err,
        }
    }
    Err(last)
}

/// Starts routing `device`'s requests on streams that `filter` selects to private pool `id`
/// (a CUDA graph capture or a `torch.cuda.MemPool` context). `filter` is PyTorch's
/// `std::function<bool(cudaStream_t)>`, passed by value (as a pointer to the caller's object,
/// which this function moves from).
///
/// # Safety
/// `filter` must point to a live `std::function<bool(cudaStream_t)>`.
#[no_mangle]
pub unsafe extern "C-unwind" fn gmlake_begin_allocate_to_pool(
    device: c_int,
    id: MempoolId,
    filter: *mut c_void,
) {
    let result = guarded(|| {
        // SAFETY: `filter` is the caller's std::function under this function's contract.
        let owned = unsafe { gmlake_cxx_filter_take(filter) };
        if owned.is_null() {
            return Err(Error::out_of_memory(
                "no host memory to keep a capture filter",
            ));
        }
        devices::begin_route(device, id.into(), owned)
    });
    if let Err(kind) = result {
        throw(kind)
    }
}

/// Ends the routing begun by `gmlake_begin_allocate_to_pool` (the capture has ended).
#[no_mangle]
pub extern "C-unwind" fn gmlake_end_allocate_to_pool(device: c_int, id: MempoolId) {
    if let Err(kind) = guarded(|| devices::end_route(device, id.into())) {
        throw(kind)
    }
}

/// The graph (or memory pool) is gone: its memory joins the shared pool. Never throws
/// (PyTorch calls it from destructors).
#[no_mangle]
pub extern "C" fn gmlake_release_pool(device: c_int, id: MempoolId) {
    let result = guarded(|| match devices::existing(device) {
        Some(pool) => pool.release_private(id.into()),
        None => Ok(()),
    });
    if result.is_err() {
        LAST_ERROR.with(|last| log::warn!("{}", last.borrow().to_string_lossy()));
    }
}

/// Writes a new C string to `*out` (free it with `glake_string_free`); 0 on success, -1 on
/// failure (the text is in `gmlake_last_error`).
fn text_out(out: *mut *mut c_char, text: impl FnOnce() -> glake::Result<String>) -> c_int {
    let result = guarded(|| {
        if out.is_null() {
            return Err(Error::new(ErrorKind::NullPointer, "out is NULL"));
        }
        let text = glake::ffi::into_c_string(text()?);
        // SAFETY: non-null, and the caller passes a pointer valid for a write.
        unsafe { *out = text };
        Ok(())
    });
    status(result)
}

/// The status code of the calls made through ctypes: 0 on success, -1 with the message kept
/// for `gmlake_last_error`.
fn status<T>(result: Result<T, ErrorKind>) -> c_int {
    if result.is_ok() {
        0
    } else {
        -1
    }
}

/// Statistics of `device` as one JSON object with PyTorch's `memory_stats()` keys (all zero
/// for a device not used yet).
///
/// # Safety
/// `out` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gmlake_stats_json(device: c_int, out: *mut *mut c_char) -> c_int {
    text_out(out, || Ok(stats_of(device).to_json()))
}

/// Statistics of `device`, all zero when its pool does not exist (which is not created).
fn stats_of(device: c_int) -> MemoryStats {
    devices::existing(device).map_or_else(MemoryStats::default, |p| p.stats())
}

/// A snapshot of `device`'s segments, blocks and stitched ranges as JSON, or `null` for a
/// device not used yet.
///
/// # Safety
/// `out` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gmlake_snapshot_json(device: c_int, out: *mut *mut c_char) -> c_int {
    text_out(out, || {
        Ok(
            devices::existing(device)
                .map_or_else(|| "null".to_string(), |p| p.snapshot().to_json()),
        )
    })
}

/// The live allocations of private pool `(first, second)` of `device` as a JSON array of
/// addresses, or `null` when the pool is not open.
///
/// # Safety
/// `out` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gmlake_pool_allocations_json(
    device: c_int,
    first: u64,
    second: u64,
    out: *mut *mut c_char,
) -> c_int {
    text_out(out, || {
        let ptrs = devices::existing(device).and_then(|p| p.private_allocations((first, second)));
        Ok(match ptrs {
            None => "null".to_string(),
            Some(ptrs) => {
                let items: Vec<String> = ptrs.iter().map(u64::to_string).collect();
                format!("[{}]", items.join(","))
            }
        })
    })
}

/// Calls of `gmlake_malloc`/`gmlake_free` (and `gmlake_n_malloc`/`gmlake_n_free`) and the
/// nanoseconds spent in them, as JSON; counted
/// only when `GLAKE_TIME_CALLS=1` was set at start.
///
/// # Safety
/// `out` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gmlake_call_times_json(out: *mut *mut c_char) -> c_int {
    text_out(out, || Ok(timing::to_json()))
}

/// `torch.cuda.reset_peak_memory_stats(device)`.
#[no_mangle]
pub extern "C" fn gmlake_reset_peak_stats(device: c_int) {
    // No panic may leave through the C boundary (it would abort the process).
    let _ = guarded(|| {
        if let Some(pool) = devices::existing(device) {
            pool.reset_peak_stats();
        }
        Ok(())
    });
}

/// `torch.cuda.reset_accumulated_memory_stats(device)`.
#[no_mangle]
pub extern "C" fn gmlake_reset_accumulated_stats(device: c_int) {
    let _ = guarded(|| {
        if let Some(pool) = devices::existing(device) {
            pool.reset_accumulated_stats();
        }
        Ok(())
    });
}

/// The text of the calling thread's last failure ("" if none). Valid until its next failure.
#[no_mangle]
pub extern "C" fn gmlake_last_error() -> *const c_char {
    LAST_ERROR.with(|last| last.borrow().as_ptr())
}
