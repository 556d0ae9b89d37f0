//! The profile of one training iteration: ops in execution order and the tensors they make.

use super::SwapError;

/// Which part of the step an op belongs to; recompute frees between forward and backward uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    Forward,
    Backward,
    Optimizer,
    Other,
}

/// One op of the iteration, with its measured device time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Op {
    pub name: String,
    pub gpu_ns: u64,
    pub phase: Phase,
}

/// What a tensor is; the planner's [`Preference`](super::Preference) filters on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorKind {
    Activation,
    OptimizerState,
    Gradient,
    Other,
    /// An optimizer state whose block's step runs in the backward: it lives across iterations
    /// and is needed only around its uses, so a plan may keep it on the device throughout or
    /// swap it across the iteration's end (in before its first use, out after its last).
    CarriedState,
}

/// How to rebuild a tensor instead of keeping it: the ops to rerun and what they cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recompute {
    pub ops: Vec<usize>,
    pub gpu_ns: u64,
}

/// A tensor the profile tracks: resident from the start of `produced_at` to the end of
/// `freed_after` unless a plan says otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    pub bytes: usize,
    pub produced_at: usize,
    /// Op indexes reading the tensor, sorted, within `[produced_at, freed_after]`.
    pub uses: Vec<usize>,
    pub freed_after: usize,
    pub recompute: Option<Recompute>,
    pub kind: TensorKind,
}

impl Tensor {
    /// The swap across the iteration's end of a carried state (off the device from after its
    /// last use until before its first use of the next iteration); `None` for other kinds
    /// or a state with no use.
    pub fn carried_window(&self) -> Option<(usize, usize)> {
        if self.kind != TensorKind::CarriedState {
            return None;
        }
        Some((*self.uses.last()?, *self.uses.first()?))
    }

    /// Points where the tensor must be on the device: production and every use, sorted, unique.
    pub fn touches(&self) -> Vec<usize> {
        let mut t = Vec::with_capacity(self.uses.len() + 1);
        t.push(self.produced_at);
        for &u in &self.uses {
            if t.last() != Some(&u) {
                t.push(u);
            }
        }
        t
    }
}

/// One iteration: ops, tracked tensors, and `base_bytes` for what is never planned (weights,
/// workspace), counted in every peak.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Profile {
    pub ops: Vec<Op>,
    pub tensors: Vec<Tensor>,
    pub base_bytes: usize,
}

impl Profile {
    /// Checks every index and ordering the simulator relies on, naming the first offender.
    pub fn validate(&self) -> Result<(), SwapError> {
        let n = self.ops.len();
        let bad = |i: usize, m: String| Err(SwapError::InvalidProfile(format!("tensor {i}: {m}")));
        if n == 0 {
            return Err(SwapError::InvalidProfile("no ops".into()));
        }
        for (i, t) in self.tensors.iter().enumerate() {
            if t.produced_at >= n {
                return bad(
                    i,
                    format!("produced_at {} out of range ({n} ops)", t.produced_at),
                );
            }
            if t.freed_after >= n {
                return bad(
                    i,
                    format!("freed_after {} out of range ({n} ops)", t.freed_after),
                );
            }
            if t.freed_after < t.produced_at {
                return bad(
                    i,
                    format!(
                        "freed_after {} before produced_at {}",
                        t.freed_after, t.produced_at
                    ),
                );
            }
            if t.uses.windows(2).any(|w| w[0] > w[1]) {
                return bad(i, "uses not sorted".into());
            }
            if let Some(&u) = t
                .uses
                .iter()
                .find(|&&u| u < t.produced_at || u > t.freed_after)
            {
                return bad(
                    i,
                    format!(
                        "use {u} outside [produced_at {}, freed_after {}]",
                        t.produced_at, t.freed_after
                    ),
                );
            }
            if t.kind == TensorKind::CarriedState
                && (t.produced_at != 0 || t.freed_after != n - 1 || t.uses.is_empty())
            {
                return bad(
                    i,
                    "a carried state lives through the whole iteration (produced_at 0, \
                     freed_after the last op) and has a use"
                        .into(),
                );
            }
            if let Some(r) = &t.recompute {
                if let Some(&o) = r.ops.iter().find(|&&o| o >= n) {
                    return bad(i, format!("recompute op {o} out of range ({n} ops)"));
                }
            }
        }
        Ok(())
    }

    /// Bytes resident while each op runs (tensors with `produced_at <= i <= freed_after`, plus
    /// `base_bytes`): what the device must hold with no plan.
    pub fn baseline_timeline(&self) -> Vec<usize> {
        let n = self.ops.len();
        // Difference array: +bytes at production, -bytes after the free.
        let mut diff = vec![0i128; n + 1];
        for t in &self.tensors {
            if t.produced_at < n && t.freed_after < n {
                diff[t.produced_at] += t.bytes as i128;
                diff[t.freed_after + 1] -= t.bytes as i128;
            }
        }
        let mut live = self.base_bytes as i128;
        diff[..n]
            .iter()
            .map(|d| {
                live += d;
                usize::try_from(live).unwrap_or(0)
            })
            .collect()
    }

    /// The largest entry of [`baseline_timeline`](Self::baseline_timeline).
    pub fn baseline_peak(&self) -> usize {
        self.baseline_timeline()
            .into_iter()
            .max()
            .unwrap_or(self.base_bytes)
    }

    /// Sum of all op times: the step with no stalls and no recompute.
    pub fn compute_ns(&self) -> u64 {
        self.ops.iter().map(|o| o.gpu_ns).sum()
    }

    /// The gap a recompute frees across: (last use before the first backward use, that backward
    /// use). `None` when the tensor has no backward use after its production.
    pub fn recompute_gap(&self, tensor: usize) -> Option<(usize, usize)> {
        let t = self.tensors.get(tensor)?;
        let first_bwd = *t.uses.iter().find(|&&u| {
            u > t.produced_at && self.ops.get(u).is_some_and(|o| o.phase == Phase::Backward)
        })?;
        let last_before = t
            .touches()
            .into_iter()
            .filter(|&u| u < first_bwd)
            .max()
            .unwrap_or(t.produced_at);
        Some((last_before, first_bwd))
    }
}
