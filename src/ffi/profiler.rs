//! C API of SmartSwap's profiler: `glake_profiler_*`, the operator hooks of a custom operator
//! (begin an op, name the tensors it touches, end it) and iteration and stage markers.

use std::ffi::{c_char, c_void, CStr};
use std::sync::{Arc, Mutex};

use static_assertions::const_assert_eq;

use super::exports::{glake_pool, glake_stream, stream_of, write_out};
use super::{glake_status, guard, handles, Failure};
use crate::smartswap::{attach, Profiler};
use crate::swap::Phase;
use crate::sync::lock;

/// A profiler recording the iterations of one pool's device: opaque handle.
#[repr(C)]
pub struct glake_profiler {
    _private: [u8; 0],
}

/// The stage an op belongs to (`glake_profiler_set_phase`).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum glake_phase {
    GLAKE_PHASE_FORWARD = 0,
    GLAKE_PHASE_BACKWARD = 1,
    GLAKE_PHASE_OPTIMIZER = 2,
    GLAKE_PHASE_OTHER = 3,
}

/// What one recorded iteration came to (`glake_profiler_end_iteration`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct glake_profile_summary {
    /// Ops recorded.
    pub ops: u64,
    /// Allocations made and tracked during the iteration.
    pub tensors: u64,
    /// Device time of all ops, from their events (ops whose timing failed count 0).
    pub compute_ns: u64,
    /// Bytes the ops touched that were allocated before the iteration (weights, states).
    pub base_bytes: u64,
    /// Most bytes live while an op ran, base bytes included, with no plan.
    pub peak_bytes: u64,
}
const_assert_eq!(std::mem::size_of::<glake_profile_summary>(), 40);

fn profiler_id(profiler: *mut glake_profiler) -> usize {
    profiler as usize
}

pub(super) fn phase_of(phase: u32) -> Result<Phase, Failure> {
    match phase {
        0 => Ok(Phase::Forward),
        1 => Ok(Phase::Backward),
        2 => Ok(Phase::Optimizer),
        3 => Ok(Phase::Other),
        other => Err(Failure::new(
            glake_status::GLAKE_STATUS_INVALID_ARGUMENT,
            format!("unknown phase {other}"),
        )),
    }
}

/// Runs `f` on the profiler behind a handle.
fn with_profiler(
    profiler: *mut glake_profiler,
    f: impl FnOnce(&mut Profiler) -> Result<(), Failure>,
) -> glake_status {
    guard(|| {
        let profiler = handles::profilers().get(profiler_id(profiler))?;
        let mut profiler = lock(&profiler);
        f(&mut profiler)
    })
}

/// Creates a profiler for the device of `pool`, which from now on reports its allocations and
/// frees to it (replacing a profiler created on that pool before).
///
/// # Safety
/// `out` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn glake_profiler_create(
    pool: *mut glake_pool,
    out: *mut *mut glake_profiler,
) -> glake_status {
    guard(|| {
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let pool = handles::get(pool as usize)?;
        let profiler = Arc::new(Mutex::new(Profiler::new(pool.device().clone())));
        attach(&pool, &profiler);
        let id = handles::profilers().insert(profiler);
        // SAFETY: checked non-NULL above; valid under this function's contract.
        unsafe { write_out(out, "out", id as *mut glake_profiler) }
    })
}

/// Destroys a profiler (its pool's reports then go nowhere). The handle is invalid afterwards.
#[no_mangle]
pub extern "C" fn glake_profiler_destroy(profiler: *mut glake_profiler) -> glake_status {
    guard(|| {
        drop(handles::profilers().remove(profiler_id(profiler))?);
        Ok(())
    })
}

/// Starts recording an iteration; anything recorded before is dropped.
#[no_mangle]
pub extern "C" fn glake_profiler_begin_iteration(profiler: *mut glake_profiler) -> glake_status {
    with_profiler(profiler, |p| {
        p.begin_iteration();
        Ok(())
    })
}

/// The stage (`glake_phase`) of the ops that begin from now on.
#[no_mangle]
pub extern "C" fn glake_profiler_set_phase(
    profiler: *mut glake_profiler,
    phase: u32,
) -> glake_status {
    with_profiler(profiler, |p| {
        p.set_phase(phase_of(phase)?);
        Ok(())
    })
}

/// An op named `name` (UTF-8, NUL-terminated) begins, its work queued on `stream`.
///
/// # Safety
/// `name` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn glake_profiler_begin_op(
    profiler: *mut glake_profiler,
    name: *const c_char,
    stream: glake_stream,
) -> glake_status {
    with_profiler(profiler, |p| {
        if name.is_null() {
            return Err(Failure::null("name"));
        }
        // SAFETY: non-NULL and NUL-terminated under this function's contract.
        let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
        p.begin_op(&name, stream_of(stream))?;
        Ok(())
    })
}

/// The running op touches `bytes` at `ptr` (an input or an output).
#[no_mangle]
pub extern "C" fn glake_profiler_tensor(
    profiler: *mut glake_profiler,
    ptr: *mut c_void,
    bytes: usize,
) -> glake_status {
    with_profiler(profiler, |p| {
        if ptr.is_null() {
            return Err(Failure::null("ptr"));
        }
        Ok(p.tensor(ptr as u64, bytes)?)
    })
}

/// The running op has ended (all its work is queued on its stream).
#[no_mangle]
pub extern "C" fn glake_profiler_end_op(profiler: *mut glake_profiler) -> glake_status {
    with_profiler(profiler, |p| Ok(p.end_op()?))
}

/// Ends the iteration: waits for its last op's work, reads every op's time, and writes a
/// summary to `out` (may be NULL).
///
/// # Safety
/// `out` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn glake_profiler_end_iteration(
    profiler: *mut glake_profiler,
    out: *mut glake_profile_summary,
) -> glake_status {
    with_profiler(profiler, |p| {
        let profile = p.end_iteration()?;
        if !out.is_null() {
            let summary = glake_profile_summary {
                ops: profile.ops.len() as u64,
                tensors: profile.tensors.len() as u64,
                compute_ns: profile.compute_ns(),
                base_bytes: profile.base_bytes as u64,
                peak_bytes: profile.baseline_peak() as u64,
            };
            // SAFETY: non-NULL, valid under this function's contract.
            unsafe { write_out(out, "out", summary)? };
        }
        Ok(())
    })
}
