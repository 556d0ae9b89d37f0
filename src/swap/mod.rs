//! SmartSwap planning core, free of any device: an iteration profile and the recorder that
//! builds it from hook and pool events, a simulator of memory and copy queues, and a planner
//! choosing per tensor Keep, Swap or Recompute to fit a memory target.
//!
//! Kept device-free so plans can be reasoned about and tested exactly before any executor exists.

pub mod plan;
pub mod profile;
pub mod recorder;
pub mod simulate;

pub use plan::{plan, Planned, Preference};
pub use profile::{Op, Phase, Profile, Recompute, Tensor, TensorKind};
pub use recorder::{signature, Recorder};
pub use simulate::{simulate, Choice, MemPoint, SimConfig, SimResult};

use std::fmt;

/// Why a profile, a plan or a target was refused; typed so callers can read the best peak.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SwapError {
    /// The profile is inconsistent (an index out of range, unsorted uses...).
    InvalidProfile(String),
    /// The plan does not fit the profile (wrong length, a swap window over a use...).
    InvalidPlan(String),
    /// The simulator settings are unusable (a zero bandwidth...).
    InvalidConfig(String),
    /// No plan found brings the peak down to the target; `best_peak` is the lowest reached.
    TargetUnreachable { target: usize, best_peak: usize },
}

impl fmt::Display for SwapError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SwapError::InvalidProfile(m) => write!(f, "invalid profile: {m}"),
            SwapError::InvalidPlan(m) => write!(f, "invalid plan: {m}"),
            SwapError::InvalidConfig(m) => write!(f, "invalid simulator config: {m}"),
            SwapError::TargetUnreachable { target, best_peak } => write!(
                f,
                "target of {target} bytes cannot be met: the best peak reached is {best_peak} bytes"
            ),
        }
    }
}

impl std::error::Error for SwapError {}
