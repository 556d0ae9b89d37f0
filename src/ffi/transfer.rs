//! C API of the copy engine: `glake_transfer_*` and `glake_memcpy_*`.

use std::ffi::c_void;
use std::sync::Arc;

use bitflags::bitflags;
use static_assertions::const_assert_eq;

use super::exports::{backend_of, glake_stream, stream_of, write_out};
use super::{glake_status, guard, handles, slice_of, Failure};
use crate::config::{host_options_from_env, TransferConfig};
use crate::device;
use crate::transfer::{Completion, CopyPiece, Direction, Engine};

/// An opaque copy engine of one target device.
#[repr(C)]
pub struct glake_transfer {
    _private: [u8; 0],
}

/// `glake_transfer_create` flags: apply the `GLAKE_COPY_*` environment variables.
pub const GLAKE_TRANSFER_READ_ENV: u32 = 1;
/// `glake_transfer_create` flags: use the target's own link only (no relays through peers).
pub const GLAKE_TRANSFER_NO_PEERS: u32 = 2;

bitflags! {
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct TransferFlags: u32 {
        const READ_ENV = GLAKE_TRANSFER_READ_ENV;
        const NO_PEERS = GLAKE_TRANSFER_NO_PEERS;
    }
}

/// `glake_memcpy_*` flags: order the copy on the stream and return as early as the host memory
/// allows (see `glake_memcpy_htod`); without it the call returns when the data has arrived.
pub const GLAKE_MEMCPY_ASYNC: u32 = 1;

bitflags! {
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct MemcpyFlags: u32 {
        const ASYNC = GLAKE_MEMCPY_ASYNC;
    }
}

/// Counters of a copy engine.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct glake_transfer_stats {
    pub copies: u64,
    pub bytes: u64,
    /// Copies handed straight to the driver (small, or pinned with no relay worth it).
    pub driver_copies: u64,
    /// Bytes moved by the engine's lanes.
    pub engine_bytes: u64,
    /// Paths of the engine: the target's own link plus relays.
    pub paths: u32,
    pub reserved: u32,
}

const_assert_eq!(std::mem::size_of::<glake_transfer_stats>(), 40);

fn transfer_id(transfer: *mut glake_transfer) -> usize {
    transfer as usize
}

fn flags_of<F: bitflags::Flags<Bits = u32>>(bits: u32, what: &str) -> Result<F, Failure> {
    F::from_bits(bits).ok_or_else(|| {
        Failure::new(
            glake_status::GLAKE_STATUS_INVALID_ARGUMENT,
            format!("{what} has unknown bits {bits:#x}"),
        )
    })
}

/// Creates a copy engine for device `device` of `backend` (a `glake_backend` value), relaying
/// through every other device of that backend that can reach it unless
/// `GLAKE_TRANSFER_NO_PEERS` is given. Starts its threads and pins its staging buffers now
/// (tens of milliseconds): create one per device and keep it.
///
/// # Safety
/// `out` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn glake_transfer_create(
    backend: u32,
    device: i32,
    flags: u32,
    out: *mut *mut glake_transfer,
) -> glake_status {
    guard(|| {
        crate::init_logging();
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let flags: TransferFlags = flags_of(flags, "flags")?;
        let choice = backend_of(backend)?;
        let target = device::open(choice, device, host_options_from_env())?;
        let mut config = TransferConfig::default();
        if flags.contains(TransferFlags::READ_ENV) {
            config.apply_env();
        }
        if flags.contains(TransferFlags::NO_PEERS) {
            config.max_peers = 0;
        }
        let peers = device::open_peers(&target, config.max_peers, host_options_from_env());
        let engine = Engine::new(target, peers, config)?;
        let id = handles::transfers().insert(Arc::new(engine));
        // SAFETY: checked non-NULL above.
        unsafe { out.write(id as *mut glake_transfer) };
        Ok(())
    })
}

/// Stops a copy engine and frees its staging memory (after waiting for its work). The handle
/// is invalid afterwards.
#[no_mangle]
pub extern "C" fn glake_transfer_destroy(transfer: *mut glake_transfer) -> glake_status {
    guard(|| {
        drop(handles::transfers().remove(transfer_id(transfer))?);
        Ok(())
    })
}

/// Copies `bytes` from host memory at `src` (pageable, pinned or registered: any) to device
/// memory at `dst` on the engine's device (from glake's pools or from anywhere else).
///
/// Ordering is that of `cuMemcpyHtoDAsync` on `stream` (NULL: the default stream): the copy
/// starts after the work queued on `stream` before the call, and work queued on `stream`
/// afterwards sees the data. Without `GLAKE_MEMCPY_ASYNC` the call returns when the data has
/// arrived. With it, a pageable `src` may be reused when the call returns (it has been read;
/// a copy larger than the staging buffers therefore waits for the stream's earlier work, as
/// the driver's own pageable copies do), while a page-locked `src` must stay unchanged until
/// the stream reaches the copy.
///
/// # Safety
/// `src` must be valid for `bytes` bytes of reads (as long as said above); `dst` must be device
/// memory of the engine's device.
#[no_mangle]
pub unsafe extern "C" fn glake_memcpy_htod(
    transfer: *mut glake_transfer,
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    stream: glake_stream,
    flags: u32,
) -> glake_status {
    let piece = CopyPiece {
        host: src as usize,
        device: dst as u64,
        len: bytes,
    };
    // SAFETY: forwarded under the caller's contract.
    guard(|| unsafe { copy(transfer, Direction::HostToDevice, &[piece], stream, flags) })
}

/// Copies `bytes` from device memory at `src` on the engine's device to host memory at `dst`.
/// Ordering as for `glake_memcpy_htod`. With `GLAKE_MEMCPY_ASYNC` a pageable `dst` holds the
/// data when the call returns; a page-locked one once the stream has reached the copy.
///
/// # Safety
/// `dst` must be valid for `bytes` bytes of writes (as long as said above); `src` must be device
/// memory of the engine's device.
#[no_mangle]
pub unsafe extern "C" fn glake_memcpy_dtoh(
    transfer: *mut glake_transfer,
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    stream: glake_stream,
    flags: u32,
) -> glake_status {
    let piece = CopyPiece {
        host: dst as usize,
        device: src as u64,
        len: bytes,
    };
    // SAFETY: forwarded under the caller's contract.
    guard(|| unsafe { copy(transfer, Direction::DeviceToHost, &[piece], stream, flags) })
}

/// The copy behind every `glake_memcpy_*` call.
///
/// # Safety
/// As for the calls: every piece's host memory valid as their contracts say.
unsafe fn copy(
    transfer: *mut glake_transfer,
    direction: Direction,
    pieces: &[CopyPiece],
    stream: glake_stream,
    flags: u32,
) -> Result<(), Failure> {
    let engine = handles::transfers().get(transfer_id(transfer))?;
    let completion = completion_of(flags)?;
    // SAFETY: forwarded under the caller's contract.
    unsafe { engine.copy_pieces(direction, pieces, stream_of(stream), completion)? };
    Ok(())
}

/// The direction of a `glake_memcpy_batch`.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum glake_copy_direction {
    GLAKE_HOST_TO_DEVICE = 0,
    GLAKE_DEVICE_TO_HOST = 1,
}

/// One piece of a `glake_memcpy_batch`: host memory, device memory and bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct glake_copy_piece {
    pub host: *mut c_void,
    pub device: *mut c_void,
    pub bytes: usize,
}

const_assert_eq!(std::mem::size_of::<glake_copy_piece>(), 24);

/// Copies `count` pieces in `direction` (a `glake_copy_direction` value) as one copy: their
/// chunks share the engine's lanes, so many tensors (a state dict) move at the speed of one
/// large copy. Ordering, flags and host memory rules as for `glake_memcpy_htod` and
/// `glake_memcpy_dtoh`, for every piece.
///
/// # Safety
/// `pieces` must point to `count` pieces (or be NULL with `count` 0), each valid as the
/// single-copy calls require.
#[no_mangle]
pub unsafe extern "C" fn glake_memcpy_batch(
    transfer: *mut glake_transfer,
    direction: u32,
    pieces: *const glake_copy_piece,
    count: usize,
    stream: glake_stream,
    flags: u32,
) -> glake_status {
    guard(|| {
        const TO_DEVICE: u32 = glake_copy_direction::GLAKE_HOST_TO_DEVICE as u32;
        const TO_HOST: u32 = glake_copy_direction::GLAKE_DEVICE_TO_HOST as u32;
        let direction = match direction {
            TO_DEVICE => Direction::HostToDevice,
            TO_HOST => Direction::DeviceToHost,
            other => {
                return Err(Failure::new(
                    glake_status::GLAKE_STATUS_INVALID_ARGUMENT,
                    format!("unknown copy direction {other}"),
                ))
            }
        };
        if count == 0 {
            // Nothing to copy, but the handle and flags are still checked.
            // SAFETY: no pieces.
            return unsafe { copy(transfer, direction, &[], stream, flags) };
        }
        // SAFETY: `count` pieces long per the contract.
        let raw = unsafe { slice_of(pieces, count, "pieces") }?;
        let pieces: Vec<CopyPiece> = raw
            .iter()
            .map(|p| CopyPiece {
                host: p.host as usize,
                device: p.device as u64,
                len: p.bytes,
            })
            .collect();
        // SAFETY: forwarded under the caller's contract.
        unsafe { copy(transfer, direction, &pieces, stream, flags) }
    })
}

fn completion_of(flags: u32) -> Result<Completion, Failure> {
    let flags: MemcpyFlags = flags_of(flags, "flags")?;
    Ok(if flags.contains(MemcpyFlags::ASYNC) {
        Completion::StreamOrdered
    } else {
        Completion::Blocking
    })
}

/// Copies the engine's counters to `out`.
///
/// # Safety
/// `out` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn glake_transfer_get_stats(
    transfer: *mut glake_transfer,
    out: *mut glake_transfer_stats,
) -> glake_status {
    guard(|| {
        let engine = handles::transfers().get(transfer_id(transfer))?;
        let stats = engine.stats();
        let value = glake_transfer_stats {
            copies: stats.copies,
            bytes: stats.bytes,
            driver_copies: stats.driver_copies,
            engine_bytes: stats.engine_bytes,
            paths: engine.paths().len() as u32,
            reserved: 0,
        };
        // SAFETY: forwarded under the caller's contract.
        unsafe { write_out(out, "out", value) }
    })
}
