//! C API of SmartSwap's planner: `glake_swap_plan` chooses keep, swap or recompute per tensor of
//! a profiled iteration for a memory target, `glake_swap_simulate` predicts a given plan. A
//! framework that profiles its own steps (glake's PyTorch side does) hands the profile over as
//! arrays and reads the choices back.

use super::exports::write_out;
use super::profiler::phase_of;
use super::{glake_status, guard, slice_of, Failure};
use crate::swap::{
    plan, simulate, Choice, Op, Preference, Profile, Recompute, SimConfig, SimResult, SwapError,
    Tensor, TensorKind,
};

/// What a planned tensor is; the preference says which kinds the planner may move.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum glake_tensor_kind {
    GLAKE_TENSOR_ACTIVATION = 0,
    GLAKE_TENSOR_OPTIMIZER_STATE = 1,
    GLAKE_TENSOR_GRADIENT = 2,
    GLAKE_TENSOR_OTHER = 3,
    /// An optimizer state whose block's step runs in the backward: kept throughout, or swapped
    /// across the iteration's end (`out_after` its last use, `in_before` its first).
    GLAKE_TENSOR_CARRIED_STATE = 4,
}

/// Which tensors the planner may move: activations only, or optimizer states and gradients too.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum glake_swap_preference {
    GLAKE_SWAP_BETTER_PERFORMANCE = 0,
    GLAKE_SWAP_BETTER_MEMORY_SAVING = 1,
}

/// What to do with one tensor.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum glake_swap_action {
    GLAKE_SWAP_KEEP = 0,
    /// Copy out after op `out_after`, back in before op `in_before`.
    GLAKE_SWAP_SWAP = 1,
    /// Free after the last forward use, rebuild before the first backward use.
    GLAKE_SWAP_RECOMPUTE = 2,
}

/// One op of the profiled iteration, in execution order.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct glake_swap_op {
    /// Device time of the op (from events).
    pub gpu_ns: u64,
    /// A `glake_phase` value.
    pub phase: u32,
}

/// One tensor the planner may act on, resident from the start of op `produced_at` to the end
/// of op `freed_after`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct glake_swap_tensor {
    pub bytes: usize,
    pub produced_at: usize,
    pub freed_after: usize,
    /// Sorted op indexes reading the tensor (may be NULL when `n_uses` is 0).
    pub uses: *const usize,
    pub n_uses: usize,
    /// Nonzero when the tensor can be rebuilt by rerunning its producer, at `recompute_ns`.
    pub can_recompute: u32,
    pub recompute_ns: u64,
    /// A `glake_tensor_kind` value.
    pub kind: u32,
}

/// Copy bandwidths of the swap paths, how far ahead swap-ins start, and what may move.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct glake_swap_config {
    pub d2h_bytes_per_s: u64,
    pub h2d_bytes_per_s: u64,
    /// A swap-in starts when op `in_before - prefetch` ends (at least one op ahead).
    pub prefetch: usize,
    /// A `glake_swap_preference` value.
    pub preference: u32,
}

/// One tensor's choice: a `glake_swap_action` and, for a swap, its window.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct glake_swap_choice {
    pub action: u32,
    pub out_after: usize,
    pub in_before: usize,
}

/// The predicted iteration under a plan.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct glake_swap_prediction {
    /// When the last op ends: compute, recompute and waits for swap-ins.
    pub step_ns: u64,
    /// Sum of op times (the step with nothing moved).
    pub compute_ns: u64,
    /// Compute stalled on swap-ins.
    pub exposed_wait_ns: u64,
    /// Compute spent rebuilding recomputed tensors.
    pub recompute_ns: u64,
    /// Most device bytes in use, base bytes included; when a target is unreachable, the lowest
    /// peak the planner reached.
    pub peak_bytes: usize,
    /// The peak with every tensor kept.
    pub baseline_peak_bytes: usize,
    /// The op during which the peak is reached.
    pub peak_op: usize,
}

fn invalid(message: String) -> Failure {
    Failure::new(glake_status::GLAKE_STATUS_INVALID_ARGUMENT, message)
}

fn kind_of(kind: u32) -> Result<TensorKind, Failure> {
    [
        (
            glake_tensor_kind::GLAKE_TENSOR_ACTIVATION,
            TensorKind::Activation,
        ),
        (
            glake_tensor_kind::GLAKE_TENSOR_OPTIMIZER_STATE,
            TensorKind::OptimizerState,
        ),
        (
            glake_tensor_kind::GLAKE_TENSOR_GRADIENT,
            TensorKind::Gradient,
        ),
        (glake_tensor_kind::GLAKE_TENSOR_OTHER, TensorKind::Other),
        (
            glake_tensor_kind::GLAKE_TENSOR_CARRIED_STATE,
            TensorKind::CarriedState,
        ),
    ]
    .into_iter()
    .find(|(c, _)| *c as u32 == kind)
    .map(|(_, k)| k)
    .ok_or_else(|| invalid(format!("unknown tensor kind {kind}")))
}

/// Builds the planning core's profile from the C arrays.
///
/// # Safety
/// As for [`glake_swap_plan`].
unsafe fn profile_of(
    ops: *const glake_swap_op,
    n_ops: usize,
    tensors: *const glake_swap_tensor,
    n_tensors: usize,
    base_bytes: usize,
) -> Result<Profile, Failure> {
    // SAFETY: the caller passes arrays of the stated lengths.
    let ops = unsafe { slice_of(ops, n_ops, "ops") }?;
    let tensors = unsafe { slice_of(tensors, n_tensors, "tensors") }?;
    let ops = ops
        .iter()
        .enumerate()
        .map(|(i, o)| {
            Ok(Op {
                name: format!("op{i}"),
                gpu_ns: o.gpu_ns,
                phase: phase_of(o.phase)?,
            })
        })
        .collect::<Result<Vec<_>, Failure>>()?;
    let tensors = tensors
        .iter()
        .map(|t| {
            // SAFETY: each tensor's `uses` holds `n_uses` values per the caller's contract.
            let uses = unsafe { slice_of(t.uses, t.n_uses, "tensor uses") }?.to_vec();
            Ok(Tensor {
                bytes: t.bytes,
                produced_at: t.produced_at,
                uses,
                freed_after: t.freed_after,
                recompute: (t.can_recompute != 0).then(|| Recompute {
                    ops: vec![t.produced_at],
                    gpu_ns: t.recompute_ns,
                }),
                kind: kind_of(t.kind)?,
            })
        })
        .collect::<Result<Vec<_>, Failure>>()?;
    let profile = Profile {
        ops,
        tensors,
        base_bytes,
    };
    profile.validate().map_err(swap_failure)?;
    Ok(profile)
}

pub(super) fn config_of(
    config: *const glake_swap_config,
) -> Result<(SimConfig, Preference), Failure> {
    if config.is_null() {
        return Err(Failure::null("config"));
    }
    // SAFETY: non-NULL; the caller passes a readable config.
    let c = unsafe { *config };
    let pref = match c.preference {
        0 => Preference::Performance,
        1 => Preference::MemorySaving,
        other => return Err(invalid(format!("unknown preference {other}"))),
    };
    Ok((
        SimConfig {
            d2h_bytes_per_s: c.d2h_bytes_per_s,
            h2d_bytes_per_s: c.h2d_bytes_per_s,
            prefetch: c.prefetch,
        },
        pref,
    ))
}

fn swap_failure(e: SwapError) -> Failure {
    let status = match e {
        SwapError::TargetUnreachable { .. } => glake_status::GLAKE_STATUS_OUT_OF_MEMORY,
        _ => glake_status::GLAKE_STATUS_INVALID_ARGUMENT,
    };
    Failure::new(status, e.to_string())
}

fn choice_to_c(c: &Choice) -> glake_swap_choice {
    match *c {
        Choice::Keep => glake_swap_choice::default(),
        Choice::Swap {
            out_after,
            in_before,
        } => glake_swap_choice {
            action: glake_swap_action::GLAKE_SWAP_SWAP as u32,
            out_after,
            in_before,
        },
        Choice::Recompute => glake_swap_choice {
            action: glake_swap_action::GLAKE_SWAP_RECOMPUTE as u32,
            ..Default::default()
        },
    }
}

fn choice_from_c(c: &glake_swap_choice) -> Result<Choice, Failure> {
    match c.action {
        0 => Ok(Choice::Keep),
        1 => Ok(Choice::Swap {
            out_after: c.out_after,
            in_before: c.in_before,
        }),
        2 => Ok(Choice::Recompute),
        other => Err(invalid(format!("unknown swap action {other}"))),
    }
}

fn prediction_of(profile: &Profile, r: &SimResult) -> glake_swap_prediction {
    glake_swap_prediction {
        step_ns: r.step_ns,
        compute_ns: profile.compute_ns(),
        exposed_wait_ns: r.exposed_wait_ns,
        recompute_ns: r.recompute_ns,
        peak_bytes: r.peak_bytes,
        baseline_peak_bytes: profile.baseline_peak(),
        peak_op: r.peak_op,
    }
}

/// Plans the profiled iteration (`n_ops` ops, `n_tensors` tensors, `base_bytes` never moved)
/// for a peak of at most `target_bytes`: writes one choice per tensor to `choices_out` and the
/// predicted iteration to `prediction_out` (may be NULL). When no plan reaches the target,
/// returns `GLAKE_STATUS_OUT_OF_MEMORY`, writes nothing to `choices_out`, and writes the lowest
/// peak reached to `prediction_out->peak_bytes`.
///
/// # Safety
/// `ops` and `tensors` point to arrays of the stated lengths (each tensor's `uses` to
/// `n_uses` values), `config` to one config, `choices_out` to `n_tensors` writable choices.
#[no_mangle]
pub unsafe extern "C" fn glake_swap_plan(
    ops: *const glake_swap_op,
    n_ops: usize,
    tensors: *const glake_swap_tensor,
    n_tensors: usize,
    base_bytes: usize,
    target_bytes: usize,
    config: *const glake_swap_config,
    choices_out: *mut glake_swap_choice,
    prediction_out: *mut glake_swap_prediction,
) -> glake_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let profile = unsafe { profile_of(ops, n_ops, tensors, n_tensors, base_bytes) }?;
        let (cfg, pref) = config_of(config)?;
        if n_tensors > 0 && choices_out.is_null() {
            return Err(Failure::null("choices_out"));
        }
        match plan(&profile, target_bytes, &cfg, pref) {
            Ok(planned) => {
                for (i, c) in planned.choices.iter().enumerate() {
                    // SAFETY: `choices_out` holds `n_tensors` writable choices.
                    unsafe { choices_out.add(i).write(choice_to_c(c)) };
                }
                if !prediction_out.is_null() {
                    // SAFETY: non-NULL and writable per the contract.
                    unsafe {
                        write_out(
                            prediction_out,
                            "prediction_out",
                            prediction_of(&profile, &planned.result),
                        )
                    }?;
                }
                Ok(())
            }
            Err(e) => {
                if let (SwapError::TargetUnreachable { best_peak, .. }, false) =
                    (&e, prediction_out.is_null())
                {
                    let best = glake_swap_prediction {
                        peak_bytes: *best_peak,
                        compute_ns: profile.compute_ns(),
                        baseline_peak_bytes: profile.baseline_peak(),
                        ..Default::default()
                    };
                    // SAFETY: non-NULL and writable per the contract.
                    unsafe { write_out(prediction_out, "prediction_out", best) }?;
                }
                Err(swap_failure(e))
            }
        }
    })
}

/// Predicts the profiled iteration under the given `choices` (one per tensor), as
/// [`glake_swap_plan`] predicts its own plans.
///
/// # Safety
/// As for [`glake_swap_plan`]; `choices` points to `n_tensors` readable choices and
/// `prediction_out` to one writable prediction.
#[no_mangle]
pub unsafe extern "C" fn glake_swap_simulate(
    ops: *const glake_swap_op,
    n_ops: usize,
    tensors: *const glake_swap_tensor,
    n_tensors: usize,
    base_bytes: usize,
    choices: *const glake_swap_choice,
    config: *const glake_swap_config,
    prediction_out: *mut glake_swap_prediction,
) -> glake_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let profile = unsafe { profile_of(ops, n_ops, tensors, n_tensors, base_bytes) }?;
        let (cfg, _) = config_of(config)?;
        // SAFETY: `choices` holds `n_tensors` readable choices.
        let plan = unsafe { slice_of(choices, n_tensors, "choices") }?
            .iter()
            .map(choice_from_c)
            .collect::<Result<Vec<_>, Failure>>()?;
        let r = simulate(&profile, &plan, &cfg).map_err(swap_failure)?;
        // SAFETY: per the contract.
        unsafe {
            write_out(
                prediction_out,
                "prediction_out",
                prediction_of(&profile, &r),
            )
        }
    })
}
