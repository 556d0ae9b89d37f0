//! C API of SmartSwap for native training loops: `glake_smartswap_*`. A session on a pool takes
//! the same op hooks as the profiler; it warms up, profiles one iteration, plans for its target
//! and from then on swaps the planned allocations out and back in at the hooks, at the same
//! addresses.

use std::ffi::{c_char, c_void, CStr};
use std::sync::{Arc, Mutex};

use static_assertions::const_assert_eq;

use super::exports::{glake_pool, glake_stream, stream_of, write_out};
use super::planner::{config_of, glake_swap_config};
use super::profiler::phase_of;
use super::{glake_status, guard, handles, Failure};
use crate::smartswap::{Session, SessionPhase, Settings};
use crate::sync::lock;

/// A SmartSwap session on one pool: opaque handle.
#[repr(C)]
pub struct glake_smartswap {
    _private: [u8; 0],
}

/// What a session aims for.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct glake_smartswap_settings {
    /// Peak bytes of an iteration (the pool's memory) the plan must stay within; the pool's
    /// soft limit while the plan runs.
    pub target_bytes: u64,
    /// Iterations run as written before the profiled one.
    pub warmup_iterations: u64,
    /// The planner's bandwidths, prefetch distance (ops) and preference.
    pub config: glake_swap_config,
}

/// Where a session stands.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum glake_smartswap_phase {
    GLAKE_SMARTSWAP_WARMUP = 0,
    GLAKE_SMARTSWAP_PROFILE = 1,
    GLAKE_SMARTSWAP_STABLE = 2,
}

/// What a session has done (`glake_smartswap_get_report`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct glake_smartswap_report {
    /// A `glake_smartswap_phase` value.
    pub phase: u32,
    pub _reserved: u32,
    pub iterations: u64,
    /// Allocations the plan swaps each iteration, and their bytes.
    pub planned_swaps: u64,
    pub planned_swap_bytes: u64,
    /// The plan's predicted peak and step (0 before a plan).
    pub predicted_peak_bytes: u64,
    pub predicted_step_ns: u64,
    /// Swaps done, out and in.
    pub swapped_out: u64,
    pub swapped_in: u64,
    /// Returns to warm-up after an iteration left the profile.
    pub restarts: u64,
    /// Swap-ins the plan did not schedule (an op touched a tensor while it was out).
    pub off_plan: u64,
}
const_assert_eq!(std::mem::size_of::<glake_smartswap_report>(), 80);

fn session_id(session: *mut glake_smartswap) -> usize {
    session as usize
}

fn with_session(
    session: *mut glake_smartswap,
    f: impl FnOnce(&mut Session) -> Result<(), Failure>,
) -> glake_status {
    guard(|| {
        let session = handles::sessions().get(session_id(session))?;
        let mut session = lock(&session);
        f(&mut session)
    })
}

/// Writes the default settings for `pool`'s device to `out`, with the environment's
/// overrides (`GLAKE_SWAP_TARGET`: a fraction of the device when at most 1, else bytes;
/// `GLAKE_SWAP_PREFETCH`, `GLAKE_SWAP_PREFERENCE`, `GLAKE_SWAP_WARMUP`,
/// `GLAKE_SWAP_BANDWIDTH`). Without a target the whole device is the target.
///
/// # Safety
/// `out` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn glake_smartswap_settings_default(
    pool: *mut glake_pool,
    out: *mut glake_smartswap_settings,
) -> glake_status {
    guard(|| {
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let pool = handles::get(pool as usize)?;
        let total = pool.device().mem_info()?.total;
        let s = Settings::from_env(total);
        let settings = glake_smartswap_settings {
            target_bytes: s.target_bytes as u64,
            warmup_iterations: s.warmup_iterations as u64,
            config: glake_swap_config {
                d2h_bytes_per_s: s.d2h_bytes_per_s,
                h2d_bytes_per_s: s.h2d_bytes_per_s,
                prefetch: s.prefetch,
                preference: match s.preference {
                    crate::swap::Preference::Performance => 0,
                    crate::swap::Preference::MemorySaving => 1,
                },
            },
        };
        // SAFETY: non-NULL, valid under this function's contract.
        unsafe { write_out(out, "out", settings) }
    })
}

/// Creates a session on `pool` with `settings`; the pool reports its allocations to it and
/// makes the planned ones swappable (replacing a profiler or session made on it before). While
/// the plan runs, the pool's soft limit is the target: it gives cached memory back before it
/// grows past it, and never fails a request because of it.
/// `GLAKE_STATUS_INVALID_ARGUMENT` for a zero target or bandwidth or an unknown preference.
///
/// # Safety
/// `settings` must be NULL or readable; `out` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn glake_smartswap_create(
    pool: *mut glake_pool,
    settings: *const glake_smartswap_settings,
    out: *mut *mut glake_smartswap,
) -> glake_status {
    guard(|| {
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        if settings.is_null() {
            return Err(Failure::null("settings"));
        }
        // SAFETY: non-NULL and readable under this function's contract.
        let s = unsafe { *settings };
        let (cfg, preference) = config_of(&s.config)?;
        if s.target_bytes == 0 {
            return Err(Failure::new(
                glake_status::GLAKE_STATUS_INVALID_ARGUMENT,
                "target_bytes must be positive",
            ));
        }
        let pool = handles::get(pool as usize)?;
        let session = Session::new(
            pool,
            Settings {
                target_bytes: usize::try_from(s.target_bytes).unwrap_or(usize::MAX),
                warmup_iterations: usize::try_from(s.warmup_iterations).unwrap_or(usize::MAX),
                prefetch: cfg.prefetch,
                preference,
                d2h_bytes_per_s: cfg.d2h_bytes_per_s,
                h2d_bytes_per_s: cfg.h2d_bytes_per_s,
            },
        )?;
        let id = handles::sessions().insert(Arc::new(Mutex::new(session)));
        // SAFETY: checked non-NULL above; valid under this function's contract.
        unsafe { write_out(out, "out", id as *mut glake_smartswap) }
    })
}

/// Destroys a session: everything it has out comes back, the pool's cap and observer are
/// restored. The handle is invalid afterwards.
#[no_mangle]
pub extern "C" fn glake_smartswap_destroy(session: *mut glake_smartswap) -> glake_status {
    guard(|| {
        drop(handles::sessions().remove(session_id(session))?);
        Ok(())
    })
}

/// An iteration (a training step) begins.
#[no_mangle]
pub extern "C" fn glake_smartswap_begin_iteration(session: *mut glake_smartswap) -> glake_status {
    with_session(session, |s| Ok(s.begin_iteration()?))
}

/// The stage (`glake_phase`) of the ops that begin from now on.
#[no_mangle]
pub extern "C" fn glake_smartswap_set_phase(
    session: *mut glake_smartswap,
    phase: u32,
) -> glake_status {
    with_session(session, |s| {
        s.set_phase(phase_of(phase)?);
        Ok(())
    })
}

/// An op named `name` (UTF-8, NUL-terminated) begins on `stream`; under the plan, what it and
/// the ops within the prefetch distance need is brought back first.
///
/// # Safety
/// `name` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn glake_smartswap_begin_op(
    session: *mut glake_smartswap,
    name: *const c_char,
    stream: glake_stream,
) -> glake_status {
    with_session(session, |s| {
        if name.is_null() {
            return Err(Failure::null("name"));
        }
        // SAFETY: non-NULL and NUL-terminated under this function's contract.
        let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
        Ok(s.begin_op(&name, stream_of(stream))?)
    })
}

/// The running op touches `bytes` at `ptr`; a planned allocation that is out comes back first.
#[no_mangle]
pub extern "C" fn glake_smartswap_tensor(
    session: *mut glake_smartswap,
    ptr: *mut c_void,
    bytes: usize,
) -> glake_status {
    with_session(session, |s| {
        if ptr.is_null() {
            return Err(Failure::null("ptr"));
        }
        Ok(s.tensor(ptr as u64, bytes)?)
    })
}

/// The running op has queued its work; what the plan moves out after it goes.
#[no_mangle]
pub extern "C" fn glake_smartswap_end_op(session: *mut glake_smartswap) -> glake_status {
    with_session(session, |s| Ok(s.end_op()?))
}

/// The iteration has ended: the profiled one is planned (`GLAKE_STATUS_OUT_OF_MEMORY` when no
/// plan meets the target: the session warms up again), and anything still out comes back.
#[no_mangle]
pub extern "C" fn glake_smartswap_end_iteration(session: *mut glake_smartswap) -> glake_status {
    with_session(session, |s| Ok(s.end_iteration()?))
}

/// Writes what the session has done so far to `out`.
///
/// # Safety
/// `out` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn glake_smartswap_get_report(
    session: *mut glake_smartswap,
    out: *mut glake_smartswap_report,
) -> glake_status {
    with_session(session, |s| {
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let r = s.report();
        let phase = match s.phase() {
            SessionPhase::Warmup => glake_smartswap_phase::GLAKE_SMARTSWAP_WARMUP,
            SessionPhase::Profile => glake_smartswap_phase::GLAKE_SMARTSWAP_PROFILE,
            SessionPhase::Stable => glake_smartswap_phase::GLAKE_SMARTSWAP_STABLE,
        };
        let report = glake_smartswap_report {
            phase: phase as u32,
            _reserved: 0,
            iterations: r.iterations,
            planned_swaps: r.planned_swaps as u64,
            planned_swap_bytes: r.planned_swap_bytes as u64,
            predicted_peak_bytes: r.prediction.as_ref().map_or(0, |p| p.peak_bytes as u64),
            predicted_step_ns: r.prediction.as_ref().map_or(0, |p| p.step_ns),
            swapped_out: r.swapped_out,
            swapped_in: r.swapped_in,
            restarts: r.restarts,
            off_plan: r.off_plan,
        };
        // SAFETY: non-NULL, valid under this function's contract.
        unsafe { write_out(out, "out", report) }
    })
}
