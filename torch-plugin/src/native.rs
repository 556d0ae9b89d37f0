//! The C ABI of glake's native PyTorch allocator (`python/glake/native/gmlake_native.h`): the
//! allocator compiled against the installed torch calls these `gmlake_n_*` functions. Nothing
//! here throws or unwinds: every call runs inside `guarded` and returns a status
//! (`GMLAKE_N_*`), the failure's text kept for `gmlake_last_error`.
//! Routing to private pools is the caller's: a request names its pool.
#![allow(non_camel_case_types)]

use std::ffi::{c_int, c_void};
use std::mem::offset_of;

use glake::pool::events::{self, SegmentEvent, SegmentEventKind};
use glake::pool::snapshot::{BlockInfo, BlockUse, SegmentInfo, StitchedInfo};
use glake::pool::PrivatePoolId;
use glake::stats::MemoryStats;
use glake::{Error, ErrorKind, Pool};

use crate::{
    allocate_in, allocation_containing, devices, empty_caches, guarded, memory_limit_of,
    record_stream, release, set_memory_fraction, stats_of, stream_of, timing, MempoolId,
};

pub const GMLAKE_N_OK: c_int = 0;
pub const GMLAKE_N_OUT_OF_MEMORY: c_int = 1;
/// A bad argument, an unknown pointer or pool.
pub const GMLAKE_N_INVALID: c_int = 2;
/// Any other failure (a driver call, a panic caught).
pub const GMLAKE_N_FAILED: c_int = 3;

pub const GMLAKE_N_BLOCK_ALLOCATED: i32 = 0;
pub const GMLAKE_N_BLOCK_STITCHED: i32 = 1;
pub const GMLAKE_N_BLOCK_PENDING: i32 = 2;
pub const GMLAKE_N_BLOCK_FREE: i32 = 3;

pub const GMLAKE_N_SEGMENT_ALLOC: i32 = 0;
pub const GMLAKE_N_SEGMENT_FREE: i32 = 1;

/// A private pool's id; {0, 0} is no pool.
pub type gmlake_n_pool_id = MempoolId;

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct gmlake_n_block {
    pub address: u64,
    pub size: u64,
    /// 0 when free or a stitched piece.
    pub requested_size: u64,
    /// `GMLAKE_N_BLOCK_*`.
    pub state: i32,
    /// The stream that owns it, 0 when none.
    pub stream: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct gmlake_n_segment {
    pub address: u64,
    pub total_size: u64,
    /// Bytes of the blocks that are not free.
    pub allocated_size: u64,
    /// Sum of the blocks' requested sizes.
    pub requested_size: u64,
    /// The stream of its first owned block, 0 when none.
    pub stream: u64,
    /// 1 for the large pool, 0 for the small.
    pub is_large: i32,
    /// The private pool it belongs to, {0, 0} for the shared pool.
    pub pool: gmlake_n_pool_id,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct gmlake_n_stitched {
    pub address: u64,
    pub size: u64,
    pub in_use: i32,
    pub pieces: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct gmlake_n_event {
    /// `GMLAKE_N_SEGMENT_*`.
    pub kind: i32,
    pub device: i32,
    pub address: u64,
    pub size: u64,
    pub pool: gmlake_n_pool_id,
}

// The layouts of the header (its C++ test asserts the same numbers on the C side).
const _: () = {
    assert!(size_of::<gmlake_n_pool_id>() == 16);
    assert!(offset_of!(gmlake_n_pool_id, second) == 8);
    assert!(size_of::<gmlake_n_block>() == 40);
    assert!(offset_of!(gmlake_n_block, requested_size) == 16);
    assert!(offset_of!(gmlake_n_block, state) == 24);
    assert!(offset_of!(gmlake_n_block, stream) == 32);
    assert!(size_of::<gmlake_n_segment>() == 64);
    assert!(offset_of!(gmlake_n_segment, stream) == 32);
    assert!(offset_of!(gmlake_n_segment, is_large) == 40);
    assert!(offset_of!(gmlake_n_segment, pool) == 48);
    assert!(size_of::<gmlake_n_stitched>() == 24);
    assert!(offset_of!(gmlake_n_stitched, in_use) == 16);
    assert!(offset_of!(gmlake_n_stitched, pieces) == 20);
    assert!(size_of::<gmlake_n_event>() == 40);
    assert!(offset_of!(gmlake_n_event, device) == 4);
    assert!(offset_of!(gmlake_n_event, address) == 8);
    assert!(offset_of!(gmlake_n_event, size) == 16);
    assert!(offset_of!(gmlake_n_event, pool) == 24);
};

type SegmentCallback = unsafe extern "C" fn(
    ctx: *mut c_void,
    segment: *const gmlake_n_segment,
    blocks: *const gmlake_n_block,
    count: usize,
);
type StitchedCallback = unsafe extern "C" fn(ctx: *mut c_void, range: *const gmlake_n_stitched);
type AddressCallback = unsafe extern "C" fn(ctx: *mut c_void, address: u64);
type EventCallback = unsafe extern "C" fn(ctx: *mut c_void, event: *const gmlake_n_event);

impl MempoolId {
    /// {0, 0}: no private pool (the shared pool).
    const NONE: MempoolId = MempoolId {
        first: 0,
        second: 0,
    };

    /// The private pool named, None for {0, 0}.
    fn private(self) -> Option<PrivatePoolId> {
        (self != MempoolId::NONE).then_some(self.into())
    }

    /// The id of `pool`, {0, 0} for the shared pool.
    fn of(pool: Option<PrivatePoolId>) -> Self {
        pool.map_or(MempoolId::NONE, |(first, second)| MempoolId {
            first,
            second,
        })
    }
}

/// The header's status of a call's result.
fn n_status<T>(result: Result<T, ErrorKind>) -> c_int {
    match result {
        Ok(_) => GMLAKE_N_OK,
        Err(ErrorKind::OutOfMemory) => GMLAKE_N_OUT_OF_MEMORY,
        // A double free is a pointer that is not (any more) an allocation.
        Err(
            ErrorKind::InvalidArgument
            | ErrorKind::InvalidPointer
            | ErrorKind::InvalidState
            | ErrorKind::NullPointer
            | ErrorKind::DoubleFree,
        ) => GMLAKE_N_INVALID,
        Err(_) => GMLAKE_N_FAILED,
    }
}

/// Writes `value` through `out`, which must not be NULL.
///
/// # Safety
/// A non-NULL `out` must be valid for a write of `T`.
unsafe fn write<T>(out: *mut T, what: &str, value: T) -> glake::Result<()> {
    if out.is_null() {
        return Err(Error::new(
            ErrorKind::NullPointer,
            format!("{what} is NULL"),
        ));
    }
    // SAFETY: non-NULL, and valid for a write under the caller's contract.
    unsafe { out.write(value) };
    Ok(())
}

/// Writes `value` through `out` unless it is NULL.
///
/// # Safety
/// A non-NULL `out` must be valid for a write of `T`.
unsafe fn write_if_asked<T>(out: *mut T, value: T) {
    if !out.is_null() {
        // SAFETY: non-NULL, and valid for a write under the caller's contract.
        unsafe { out.write(value) };
    }
}

/// The pool of `device` for a call on its private pools: an error when it does not exist yet
/// (no private pool can be open there).
fn pool_with_private(device: c_int, id: MempoolId) -> glake::Result<&'static Pool> {
    devices::index(device)?;
    devices::existing(device).map(|p| &**p).ok_or_else(|| {
        Error::new(
            ErrorKind::InvalidState,
            format!(
                "private pool {:?} is not open: device {device} is not used yet",
                PrivatePoolId::from(id)
            ),
        )
    })
}

/// A private pool to create or route to: {0, 0} names none.
fn named(id: MempoolId) -> glake::Result<PrivatePoolId> {
    id.private()
        .ok_or_else(|| Error::invalid_argument("private pool {0, 0} names no pool"))
}

/// Allocates `size` (> 0) bytes on `device` for `stream`, from private pool `pool` when it is
/// not {0, 0}; `requested` (at most `size`) are the bytes the caller asked for before it rounded
/// them up (PyTorch's `roundup_power2_divisions`), booked as requested. `*out_stitched` (may be
/// NULL) gets the pieces of a stitched range, else 0.
///
/// # Safety
/// `out` must be valid for a write; `out_stitched` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gmlake_n_malloc(
    device: c_int,
    size: usize,
    requested: usize,
    stream: *mut c_void,
    pool: gmlake_n_pool_id,
    out: *mut *mut c_void,
    out_stitched: *mut u32,
) -> c_int {
    n_status(timing::timed(&timing::MALLOC, || {
        guarded(|| {
            if out.is_null() {
                return Err(Error::new(ErrorKind::NullPointer, "out is NULL"));
            }
            let count_pieces = !out_stitched.is_null();
            let (ptr, pieces) = allocate_in(
                device,
                size,
                requested,
                stream,
                pool.private(),
                count_pieces,
            )?;
            // SAFETY: `out` is non-NULL, both valid for a write under this function's contract.
            unsafe {
                out.write(ptr);
                write_if_asked(out_stitched, pieces);
            }
            Ok(())
        })
    }))
}

/// Allocates `size` bytes (`requested` asked for) on `device` for `stream` from the cached free
/// blocks of `pool` ({0, 0}: the shared pool) alone: GMLAKE_N_OUT_OF_MEMORY, with no
/// out-of-memory counted, when none fits. Nothing is created or waited for: a pool lent on
/// out-of-memory serves a request that failed elsewhere this way, as in PyTorch.
///
/// # Safety
/// `out` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gmlake_n_malloc_cached(
    device: c_int,
    size: usize,
    requested: usize,
    stream: *mut c_void,
    pool: gmlake_n_pool_id,
    out: *mut *mut c_void,
) -> c_int {
    n_status(guarded(|| {
        if out.is_null() {
            return Err(Error::new(ErrorKind::NullPointer, "out is NULL"));
        }
        devices::index(device)?;
        let Some(pool_of_device) = devices::existing(device) else {
            return Err(Error::out_of_memory(format!(
                "device {device} has no memory cached yet"
            )));
        };
        let ptr = pool_of_device
            .malloc_cached(size, requested, stream_of(stream), pool.private())?
            .ok_or_else(|| Error::out_of_memory("no cached block of the pool fits"))?;
        // SAFETY: `out` is non-NULL and valid for a write under this function's contract.
        unsafe { out.write(ptr as *mut c_void) };
        Ok(())
    }))
}

/// Takes one out-of-memory off `device`'s statistics: the caller served the request that ran
/// out another way (a pool lent on out-of-memory), and PyTorch counts none then.
#[no_mangle]
pub extern "C" fn gmlake_n_uncount_oom(device: c_int) -> c_int {
    n_status(guarded(|| {
        devices::index(device)?;
        if let Some(pool) = devices::existing(device) {
            pool.uncount_oom();
        }
        Ok(())
    }))
}

/// Allocates exactly `[address, address+size)` again on `device` for `stream`, from private
/// pool `pool` when it is not {0, 0}: restoring a graph pool's checkpoint brings allocations
/// freed since back at their addresses. Invalid (nothing changed) when the range is not free
/// memory of that pool usable on `stream`, or the device has no pool yet.
#[no_mangle]
pub extern "C" fn gmlake_n_malloc_at(
    device: c_int,
    address: *mut c_void,
    size: usize,
    stream: *mut c_void,
    pool: gmlake_n_pool_id,
) -> c_int {
    n_status(guarded(|| {
        devices::index(device)?;
        let Some(existing) = devices::existing(device) else {
            return Err(Error::new(
                ErrorKind::InvalidState,
                format!("device {device} has no pool yet: nothing to allocate again"),
            ));
        };
        existing.malloc_at(
            address as usize as u64,
            size,
            stream_of(stream),
            pool.private(),
        )
    }))
}

/// Frees `ptr`; `device` is a hint (-1: any); `*out_device` (may be NULL) gets the device.
///
/// # Safety
/// `out_device` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gmlake_n_free(
    ptr: *mut c_void,
    device: c_int,
    out_device: *mut c_int,
) -> c_int {
    n_status(timing::timed(&timing::FREE, || {
        guarded(|| {
            let freed_on = release(ptr, device)?;
            // SAFETY: NULL or valid for a write under this function's contract.
            unsafe { write_if_asked(out_device, freed_on) };
            Ok(())
        })
    }))
}

/// `Tensor.record_stream(stream)` for the allocation at `ptr`.
#[no_mangle]
pub extern "C" fn gmlake_n_record_stream(ptr: *mut c_void, stream: *mut c_void) -> c_int {
    n_status(guarded(|| record_stream(ptr, stream)))
}

/// Returns the unused cached memory of `device` (-1: every device) to the driver.
#[no_mangle]
pub extern "C" fn gmlake_n_empty_cache(device: c_int) -> c_int {
    n_status(guarded(|| empty_caches((device != -1).then_some(device))))
}

/// Counts `bytes` that a memory pool's own allocator is about to make on `device` against the
/// device's cap (its pool's cached memory goes back to the driver first when they do not fit).
/// GMLAKE_N_OUT_OF_MEMORY, with nothing counted, when they still do not.
#[no_mangle]
pub extern "C" fn gmlake_n_count_outside(device: c_int, bytes: usize) -> c_int {
    n_status(guarded(|| devices::pool(device)?.count_outside(bytes)))
}

/// Takes `bytes` counted by `gmlake_n_count_outside` off `device`'s books again.
#[no_mangle]
pub extern "C" fn gmlake_n_uncount_outside(device: c_int, bytes: usize) -> c_int {
    n_status(guarded(|| devices::pool(device)?.uncount_outside(bytes)))
}

/// Caps `device`'s pool at `fraction` of the device's memory.
#[no_mangle]
pub extern "C" fn gmlake_n_set_memory_fraction(device: c_int, fraction: f64) -> c_int {
    n_status(guarded(|| set_memory_fraction(device, fraction)))
}

/// The fraction last set for `device` (or its byte cap's share of the device).
///
/// # Safety
/// `out` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gmlake_n_memory_fraction(device: c_int, out: *mut f64) -> c_int {
    n_status(guarded(|| {
        let (_, fraction) = memory_limit_of(device)?;
        // SAFETY: valid for a write under this function's contract.
        unsafe { write(out, "out", fraction) }
    }))
}

/// Statistics of `device` as glake's `glake_stats`; all zero for a device not used yet.
///
/// # Safety
/// `out` must be valid for a write of a `glake_stats`.
#[no_mangle]
pub unsafe extern "C" fn gmlake_n_stats(device: c_int, out: *mut MemoryStats) -> c_int {
    n_status(guarded(|| {
        devices::index(device)?;
        // SAFETY: valid for a write under this function's contract.
        unsafe { write(out, "out", stats_of(device)) }
    }))
}

/// The allocation containing `ptr`: its start and size.
///
/// # Safety
/// `out_base` and `out_size` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gmlake_n_base(
    ptr: *mut c_void,
    out_base: *mut *mut c_void,
    out_size: *mut usize,
) -> c_int {
    n_status(guarded(|| {
        if out_base.is_null() || out_size.is_null() {
            return Err(Error::new(ErrorKind::NullPointer, "an out pointer is NULL"));
        }
        let info = allocation_containing(ptr)?;
        // SAFETY: both non-NULL, and valid for a write under this function's contract.
        unsafe {
            out_base.write(info.base as usize as *mut c_void);
            out_size.write(info.size);
        }
        Ok(())
    }))
}

/// Whether `device`'s pool exists yet (0 or 1); never creates it.
#[no_mangle]
pub extern "C" fn gmlake_n_device_used(device: c_int) -> c_int {
    let used = guarded(|| Ok(devices::existing(device).is_some()));
    c_int::from(used.unwrap_or(false))
}

/// Creates private pool `pool` on `device` or takes one more use of it.
#[no_mangle]
pub extern "C" fn gmlake_n_pool_retain(device: c_int, pool: gmlake_n_pool_id) -> c_int {
    n_status(guarded(|| {
        let id = named(pool)?;
        devices::pool(device)?.retain_private(id);
        Ok(())
    }))
}

/// Retains private pool `pool` and starts one routing to it: until it ends, driver calls run
/// in relaxed capture mode and frees that need events are held back.
#[no_mangle]
pub extern "C" fn gmlake_n_pool_begin(device: c_int, pool: gmlake_n_pool_id) -> c_int {
    n_status(guarded(|| {
        let id = named(pool)?;
        devices::pool(device)?.begin_private(id);
        Ok(())
    }))
}

/// Ends one routing to private pool `pool`.
#[no_mangle]
pub extern "C" fn gmlake_n_pool_end(device: c_int, pool: gmlake_n_pool_id) -> c_int {
    n_status(guarded(|| {
        pool_with_private(device, pool)?.end_private(pool.into())
    }))
}

/// Drops one use of private pool `pool`; at the last its memory joins the shared pool.
#[no_mangle]
pub extern "C" fn gmlake_n_pool_release(device: c_int, pool: gmlake_n_pool_id) -> c_int {
    n_status(guarded(|| {
        pool_with_private(device, pool)?.release_private(pool.into())
    }))
}

/// The uses of private pool `pool` (0 when it is not open).
///
/// # Safety
/// `out` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gmlake_n_pool_use_count(
    device: c_int,
    pool: gmlake_n_pool_id,
    out: *mut c_int,
) -> c_int {
    n_status(guarded(|| {
        devices::index(device)?;
        let uses = devices::existing(device).map_or(0, |p| p.private_use_count(pool.into()));
        // SAFETY: valid for a write under this function's contract.
        unsafe { write(out, "out", c_int::try_from(uses).unwrap_or(c_int::MAX)) }
    }))
}

/// Calls `cb` with each live allocation of private pool `pool`, in address order.
///
/// # Safety
/// `cb` must be NULL or a function that may be called with `ctx`.
#[no_mangle]
pub unsafe extern "C" fn gmlake_n_pool_live(
    device: c_int,
    pool: gmlake_n_pool_id,
    ctx: *mut c_void,
    cb: Option<AddressCallback>,
) -> c_int {
    n_status(guarded(|| {
        let live = pool_with_private(device, pool)?
            .private_allocations(pool.into())
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidState,
                    format!(
                        "private pool {:?} is not open on device {device}",
                        PrivatePoolId::from(pool)
                    ),
                )
            })?;
        if let Some(cb) = cb {
            for address in live {
                // SAFETY: the caller's callback, called as its contract says.
                unsafe { cb(ctx, address) };
            }
        }
        Ok(())
    }))
}

fn block_of(block: &BlockInfo) -> gmlake_n_block {
    gmlake_n_block {
        address: block.address,
        size: block.size as u64,
        requested_size: block.requested_size as u64,
        state: match block.state {
            BlockUse::Allocated => GMLAKE_N_BLOCK_ALLOCATED,
            BlockUse::Stitched => GMLAKE_N_BLOCK_STITCHED,
            BlockUse::PendingFree => GMLAKE_N_BLOCK_PENDING,
            BlockUse::Free => GMLAKE_N_BLOCK_FREE,
        },
        stream: block.stream.unwrap_or(0),
    }
}

fn segment_of(segment: &SegmentInfo) -> gmlake_n_segment {
    gmlake_n_segment {
        address: segment.address,
        total_size: segment.total_size as u64,
        allocated_size: segment.allocated_size as u64,
        requested_size: segment.blocks.iter().map(|b| b.requested_size as u64).sum(),
        stream: segment.blocks.iter().find_map(|b| b.stream).unwrap_or(0),
        is_large: i32::from(segment.pool == glake::pool::blocks::PoolKind::Large),
        pool: MempoolId::of(segment.private_pool),
    }
}

fn stitched_of(range: &StitchedInfo) -> gmlake_n_stitched {
    gmlake_n_stitched {
        address: range.address,
        size: range.size as u64,
        in_use: i32::from(range.in_use),
        pieces: u32::try_from(range.pieces.len()).unwrap_or(u32::MAX),
    }
}

/// Calls `segment` once per segment of `device` in address order with its blocks, then
/// `stitched` once per stitched range; nothing when the device is not used yet. The picture is
/// taken under the pool's lock and the callbacks run after it is released.
///
/// # Safety
/// Each callback must be NULL (skipped) or a function that may be called with `ctx`.
#[no_mangle]
pub unsafe extern "C" fn gmlake_n_snapshot(
    device: c_int,
    ctx: *mut c_void,
    segment: Option<SegmentCallback>,
    stitched: Option<StitchedCallback>,
) -> c_int {
    n_status(guarded(|| {
        devices::index(device)?;
        let Some(pool) = devices::existing(device) else {
            return Ok(());
        };
        let snapshot = pool.snapshot();
        if let Some(segment) = segment {
            let mut blocks = Vec::new();
            for s in &snapshot.segments {
                let info = segment_of(s);
                blocks.clear();
                blocks.extend(s.blocks.iter().map(block_of));
                // SAFETY: the caller's callback; both pointers live for the call.
                unsafe { segment(ctx, &info, blocks.as_ptr(), blocks.len()) };
            }
        }
        if let Some(stitched) = stitched {
            for range in &snapshot.stitched {
                let info = stitched_of(range);
                // SAFETY: the caller's callback; the pointer lives for the call.
                unsafe { stitched(ctx, &info) };
            }
        }
        Ok(())
    }))
}

/// Turns segment events on (nonzero) or off, for every thread.
#[no_mangle]
pub extern "C" fn gmlake_n_record_events(on: c_int) {
    let _ = guarded(|| {
        events::set_recording(on != 0);
        Ok(())
    });
}

fn event_of(event: &SegmentEvent) -> gmlake_n_event {
    gmlake_n_event {
        kind: match event.kind {
            SegmentEventKind::Alloc => GMLAKE_N_SEGMENT_ALLOC,
            SegmentEventKind::Free => GMLAKE_N_SEGMENT_FREE,
        },
        device: event.device,
        address: event.address,
        size: event.size as u64,
        pool: MempoolId::of(event.pool),
    }
}

/// Hands the calling thread's segment events to `cb` in order and forgets them; returns how
/// many there were (also when `cb` is NULL, which drops them).
///
/// # Safety
/// `cb` must be NULL or a function that may be called with `ctx`.
#[no_mangle]
pub unsafe extern "C" fn gmlake_n_take_events(
    ctx: *mut c_void,
    cb: Option<EventCallback>,
) -> usize {
    let taken = guarded(|| {
        let taken = events::take();
        if let Some(cb) = cb {
            for event in &taken {
                let event = event_of(event);
                // SAFETY: the caller's callback; the pointer lives for the call.
                unsafe { cb(ctx, &event) };
            }
        }
        Ok(taken.len())
    });
    taken.unwrap_or(0)
}
