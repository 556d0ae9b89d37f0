//! The profiler's bookkeeping: turns what the hooks and the pool report during one iteration
//! (ops beginning and ending, tensors an op touches, allocations and frees) into a
//! [`Profile`] the planner reads. Device-free: op times come in as numbers (from events read
//! once the iteration has run), so every rule here is tested without a GPU.
//!
//! Rules:
//! - Memory allocated inside the iteration is a tracked tensor, from the op during which it
//!   was allocated (or the next op, when allocated between ops) to the op during which it was
//!   freed (or the last op before); memory still live at the end stays to the last op.
//! - Memory from before the iteration (weights, optimizer states made in an earlier step) is
//!   not planned here: its bytes, once touched, count in `base_bytes`.
//! - A freed address allocated again is a new tensor.

use std::collections::HashMap;

use super::profile::{Op, Phase, Profile, Tensor, TensorKind};
use super::SwapError;
use crate::device::DevicePtr;

/// Records one iteration at a time.
#[derive(Debug, Default)]
pub struct Recorder {
    ops: Vec<Op>,
    tensors: Vec<Tensor>,
    /// Live tracked tensors by address.
    live: HashMap<DevicePtr, usize>,
    /// Memory from before the iteration that ops touched, by address (counted once).
    base: HashMap<DevicePtr, usize>,
    /// Allocations made between ops, produced by the next op to begin.
    waiting: Vec<usize>,
    phase: Option<Phase>,
    /// The op running (begun, not ended), if any.
    running: Option<usize>,
    recording: bool,
    /// For each tensor of the last profile, which allocation of its iteration it was (0 for
    /// the iteration's first): how an executor finds it again in the next iteration.
    ordinals: Vec<usize>,
}

/// The kind of tensor memory made during `phase` is: what the planner's preference filters on.
fn kind_of(phase: Phase) -> TensorKind {
    match phase {
        Phase::Forward => TensorKind::Activation,
        Phase::Backward => TensorKind::Gradient,
        Phase::Optimizer => TensorKind::OptimizerState,
        Phase::Other => TensorKind::Other,
    }
}

impl Recorder {
    /// Starts recording an iteration, dropping anything recorded before. Allocations still
    /// live from earlier count as memory from before the iteration.
    pub fn begin_iteration(&mut self) {
        *self = Recorder {
            recording: true,
            ..Recorder::default()
        };
    }

    /// Whether an iteration is being recorded.
    pub fn is_recording(&self) -> bool {
        self.recording
    }

    /// The phase of the ops that begin from now on (a stage marker).
    pub fn set_phase(&mut self, phase: Phase) {
        self.phase = Some(phase);
    }

    /// An op begins; its index in the iteration.
    pub fn begin_op(&mut self, name: &str) -> Result<usize, SwapError> {
        self.check_recording()?;
        if let Some(op) = self.running {
            return Err(SwapError::InvalidProfile(format!(
                "op {} ({}) began while op {op} ({}) was still running",
                self.ops.len(),
                name,
                self.ops[op].name
            )));
        }
        let index = self.ops.len();
        self.ops.push(Op {
            name: name.to_string(),
            gpu_ns: 0,
            phase: self.phase.unwrap_or(Phase::Other),
        });
        for tensor in self.waiting.drain(..) {
            self.tensors[tensor].produced_at = index;
            self.tensors[tensor].freed_after = index;
        }
        self.running = Some(index);
        Ok(index)
    }

    /// The running op touches `bytes` at `ptr` (an input or an output).
    pub fn tensor(&mut self, ptr: DevicePtr, bytes: usize) -> Result<(), SwapError> {
        let op = self.running_op("a tensor hook")?;
        match self.live.get(&ptr) {
            Some(&t) => {
                let tensor = &mut self.tensors[t];
                if tensor.uses.last() != Some(&op) {
                    tensor.uses.push(op);
                }
                tensor.freed_after = tensor.freed_after.max(op);
            }
            None => {
                // Memory from before the iteration: counted once, never planned.
                self.base.entry(ptr).or_insert(bytes);
            }
        }
        Ok(())
    }

    /// The running op has ended.
    pub fn end_op(&mut self) -> Result<usize, SwapError> {
        let op = self.running_op("an end of op")?;
        self.running = None;
        Ok(op)
    }

    /// The device time of op `op`, known once its events have completed.
    pub fn set_op_time(&mut self, op: usize, gpu_ns: u64) -> Result<(), SwapError> {
        match self.ops.get_mut(op) {
            Some(o) => {
                o.gpu_ns = gpu_ns;
                Ok(())
            }
            None => Err(SwapError::InvalidProfile(format!(
                "time for op {op}, but {} ops were recorded",
                self.ops.len()
            ))),
        }
    }

    /// The pool made `bytes` at `ptr`.
    pub fn allocated(&mut self, ptr: DevicePtr, bytes: usize) {
        if !self.recording {
            return;
        }
        let at = self.running.unwrap_or(self.ops.len());
        let kind = kind_of(self.phase.unwrap_or(Phase::Other));
        let index = self.tensors.len();
        self.tensors.push(Tensor {
            bytes,
            produced_at: at,
            uses: Vec::new(),
            freed_after: at,
            recompute: None,
            kind,
        });
        if self.running.is_none() {
            self.waiting.push(index);
        }
        self.base.remove(&ptr);
        self.live.insert(ptr, index);
    }

    /// The pool took `ptr` back.
    pub fn freed(&mut self, ptr: DevicePtr) {
        if !self.recording {
            return;
        }
        let Some(t) = self.live.remove(&ptr) else {
            self.base.remove(&ptr);
            return;
        };
        match self.running {
            Some(op) => self.tensors[t].freed_after = self.tensors[t].freed_after.max(op),
            None if self.waiting.contains(&t) => {
                // Made and freed between two ops: it never lived while one ran.
                self.waiting.retain(|&w| w != t);
                self.tensors[t].bytes = 0;
            }
            None => {
                let last = self.ops.len().saturating_sub(1);
                self.tensors[t].freed_after = self.tensors[t].freed_after.max(last);
            }
        }
    }

    /// Ends the iteration and returns its profile; tensors still live stay to the last op.
    pub fn end_iteration(&mut self) -> Result<Profile, SwapError> {
        self.check_recording()?;
        if let Some(op) = self.running {
            return Err(SwapError::InvalidProfile(format!(
                "the iteration ended while op {op} ({}) was running",
                self.ops[op].name
            )));
        }
        self.recording = false;
        let last = self.ops.len().saturating_sub(1);
        let still_live: Vec<usize> = self.live.values().copied().collect();
        for t in still_live {
            self.tensors[t].freed_after = last;
        }
        let waiting = std::mem::take(&mut self.waiting);
        let (ordinals, tensors): (Vec<usize>, Vec<Tensor>) = std::mem::take(&mut self.tensors)
            .into_iter()
            .enumerate()
            .filter(|(i, t)| t.bytes > 0 && !waiting.contains(i))
            .unzip();
        self.ordinals = ordinals;
        let profile = Profile {
            ops: std::mem::take(&mut self.ops),
            tensors,
            base_bytes: self.base.values().sum(),
        };
        profile.validate()?;
        Ok(profile)
    }

    /// For each tensor of the profile the last iteration returned, its allocation's place in
    /// that iteration (the n-th allocation the pool reported, from 0).
    pub fn allocation_ordinals(&self) -> &[usize] {
        &self.ordinals
    }

    fn check_recording(&self) -> Result<(), SwapError> {
        if self.recording {
            Ok(())
        } else {
            Err(SwapError::InvalidProfile(
                "no iteration is being recorded".into(),
            ))
        }
    }

    fn running_op(&self, what: &str) -> Result<usize, SwapError> {
        self.check_recording()?;
        self.running
            .ok_or_else(|| SwapError::InvalidProfile(format!("{what} outside any op")))
    }
}

/// What identifies an iteration's shape for the phases: op names and phases, and each
/// tracked tensor's size and life. Two iterations with the same signature take the same plan;
/// a changed one sends the manager back to warm-up.
pub fn signature(profile: &Profile) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for op in &profile.ops {
        op.name.hash(&mut h);
        op.phase.hash(&mut h);
    }
    for t in &profile.tensors {
        (t.bytes, t.produced_at, t.freed_after, &t.uses).hash(&mut h);
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    /// A two-layer forward and backward: the planner's input as the hooks would build it.
    fn record() -> Profile {
        let mut r = Recorder::default();
        r.allocated(0x9000, 64 * MIB); // weights, made before the iteration: not tracked
        r.begin_iteration();
        r.set_phase(Phase::Forward);
        r.begin_op("linear1").unwrap();
        r.tensor(0x9000, 64 * MIB).unwrap();
        r.allocated(0x1000, 8 * MIB);
        r.tensor(0x1000, 8 * MIB).unwrap();
        r.end_op().unwrap();
        r.allocated(0x2000, 4 * MIB); // between ops: produced by the next op
        r.begin_op("linear2").unwrap();
        r.tensor(0x1000, 8 * MIB).unwrap();
        r.tensor(0x2000, 4 * MIB).unwrap();
        r.end_op().unwrap();
        r.set_phase(Phase::Backward);
        r.begin_op("linear2_grad").unwrap();
        r.tensor(0x2000, 4 * MIB).unwrap();
        r.freed(0x2000);
        r.end_op().unwrap();
        r.begin_op("linear1_grad").unwrap();
        r.tensor(0x1000, 8 * MIB).unwrap();
        r.allocated(0x3000, MIB);
        r.end_op().unwrap();
        r.freed(0x1000); // after the last op: freed after it
        r.allocated(0x4000, MIB);
        r.freed(0x4000); // made and freed between ops: never lived during one
        for op in 0..4 {
            r.set_op_time(op, 1000 * (op as u64 + 1)).unwrap();
        }
        r.end_iteration().unwrap()
    }

    #[test]
    fn lives_uses_and_base_memory() {
        let p = record();
        assert_eq!(p.ops.len(), 4);
        assert_eq!(p.ops[2].phase, Phase::Backward);
        assert_eq!(p.compute_ns(), 10_000);
        assert_eq!(p.base_bytes, 64 * MIB);
        assert_eq!(p.tensors.len(), 3, "{:?}", p.tensors);
        let a = &p.tensors[0];
        assert_eq!((a.bytes, a.produced_at, a.freed_after), (8 * MIB, 0, 3));
        assert_eq!(a.uses, vec![0, 1, 3]);
        assert_eq!(a.kind, TensorKind::Activation);
        let b = &p.tensors[1];
        assert_eq!((b.produced_at, b.freed_after), (1, 2));
        assert_eq!(b.uses, vec![1, 2]);
        // Still live at the end: to the last op.
        let c = &p.tensors[2];
        assert_eq!((c.bytes, c.produced_at, c.freed_after), (MIB, 3, 3));
        assert_eq!(c.kind, TensorKind::Gradient);
        // The baseline peak holds both activations and the weights at op 1.
        assert_eq!(p.baseline_peak(), (64 + 8 + 4) * MIB);
    }

    #[test]
    fn the_same_iteration_has_the_same_signature() {
        assert_eq!(signature(&record()), signature(&record()));
        let mut other = record();
        other.tensors[0].bytes += 512;
        assert_ne!(signature(&record()), signature(&other));
    }

    #[test]
    fn a_reused_address_is_a_new_tensor() {
        let mut r = Recorder::default();
        r.begin_iteration();
        r.begin_op("a").unwrap();
        r.allocated(0x1000, MIB);
        r.freed(0x1000);
        r.allocated(0x1000, 2 * MIB);
        r.end_op().unwrap();
        r.begin_op("b").unwrap();
        r.tensor(0x1000, 2 * MIB).unwrap();
        r.end_op().unwrap();
        let p = r.end_iteration().unwrap();
        assert_eq!(p.tensors.len(), 2);
        assert_eq!((p.tensors[0].bytes, p.tensors[0].freed_after), (MIB, 0));
        assert_eq!(
            (p.tensors[1].bytes, p.tensors[1].uses.clone()),
            (2 * MIB, vec![1])
        );
    }

    #[test]
    fn hooks_out_of_order_are_errors() {
        let mut r = Recorder::default();
        assert!(r.begin_op("x").is_err(), "no iteration");
        r.begin_iteration();
        assert!(r.tensor(0x1, 1).is_err(), "outside any op");
        assert!(r.end_op().is_err());
        r.begin_op("a").unwrap();
        assert!(r.begin_op("b").is_err(), "nested");
        assert!(r.end_iteration().is_err(), "op still running");
        r.end_op().unwrap();
        assert!(r.set_op_time(5, 1).is_err());
        assert!(r.end_iteration().is_ok());
        assert!(!r.is_recording());
        let mut empty = Recorder::default();
        empty.begin_iteration();
        assert!(empty.end_iteration().is_err(), "no ops");
    }
}
