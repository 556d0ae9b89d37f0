//! Replays one iteration under a plan: compute in op order, one D2H and one H2D copy queue
//! (full duplex, each FIFO), and the device memory that results.

use super::profile::Profile;
use super::SwapError;

/// What to do with one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Choice {
    Keep,
    /// Copy out when op `out_after` ends, back in so that it is resident before `in_before`.
    /// For a carried state `out_after >= in_before`: the window spans the iteration's end, so
    /// the tensor is off the device at the start, comes in before `in_before` and leaves after
    /// `out_after`, both within the iteration.
    Swap {
        out_after: usize,
        in_before: usize,
    },
    /// Free after the last use before the first backward use, rebuild just before that use.
    Recompute,
}

/// Copy bandwidths and the prefetch distance of swap-ins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimConfig {
    pub d2h_bytes_per_s: u64,
    pub h2d_bytes_per_s: u64,
    /// A swap-in is issued when op `in_before - prefetch` ends (at least 1 op ahead), or as soon
    /// as its swap-out ended when that is later.
    pub prefetch: usize,
}

/// Device bytes in use from `t_ns` on (all events at `t_ns` applied).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemPoint {
    pub t_ns: u64,
    pub bytes: usize,
}

/// The predicted iteration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimResult {
    /// When the last op ends.
    pub step_ns: u64,
    /// Compute stalled waiting for swap-ins.
    pub exposed_wait_ns: u64,
    /// Compute spent rebuilding recomputed tensors.
    pub recompute_ns: u64,
    /// Highest device use, `base_bytes` included.
    pub peak_bytes: usize,
    /// When the peak is first reached.
    pub peak_at_ns: u64,
    /// The op whose window (previous op end to its end) holds the peak.
    pub peak_op: usize,
    /// Start and end of each op, stalls and recompute excluded.
    pub op_spans: Vec<(u64, u64)>,
    /// Step function of device use.
    pub timeline: Vec<MemPoint>,
}

/// Nanoseconds to move `bytes` at `bytes_per_s`, rounded up so a copy never looks free.
pub fn transfer_ns(bytes: usize, bytes_per_s: u64) -> u64 {
    if bytes_per_s == 0 {
        return u64::MAX;
    }
    let ns = (bytes as u128 * 1_000_000_000).div_ceil(bytes_per_s as u128);
    u64::try_from(ns).unwrap_or(u64::MAX)
}

/// Queues a copy of `bytes` on a copy queue free from `*free`, starting no earlier than
/// `ready`; the queue is busy until the copy ends. Returns (start, end).
fn enqueue(free: &mut u64, ready: u64, bytes: usize, bytes_per_s: u64) -> (u64, u64) {
    let start = ready.max(*free);
    let end = start.saturating_add(transfer_ns(bytes, bytes_per_s));
    *free = end;
    (start, end)
}

/// Checks a plan against its profile; the simulator relies on every rule here.
pub fn validate_plan(profile: &Profile, plan: &[Choice]) -> Result<(), SwapError> {
    if plan.len() != profile.tensors.len() {
        return Err(SwapError::InvalidPlan(format!(
            "{} choices for {} tensors",
            plan.len(),
            profile.tensors.len()
        )));
    }
    for (i, (t, c)) in profile.tensors.iter().zip(plan).enumerate() {
        match *c {
            Choice::Keep => {}
            Choice::Swap {
                out_after,
                in_before,
            } if out_after >= in_before => {
                if t.carried_window() != Some((out_after, in_before)) || in_before == 0 {
                    return Err(SwapError::InvalidPlan(format!(
                        "tensor {i}: a swap window ({out_after}, {in_before}) across the \
                         iteration's end must be a carried state's (its last use, its first \
                         use), the first use after op 0"
                    )));
                }
            }
            Choice::Swap {
                out_after,
                in_before,
            } => {
                if out_after < t.produced_at || out_after >= in_before || in_before > t.freed_after
                {
                    return Err(SwapError::InvalidPlan(format!(
                        "tensor {i}: swap window ({out_after}, {in_before}) must satisfy \
                         produced_at {} <= out_after < in_before <= freed_after {}",
                        t.produced_at, t.freed_after
                    )));
                }
                if let Some(u) = t.uses.iter().find(|&&u| u > out_after && u < in_before) {
                    return Err(SwapError::InvalidPlan(format!(
                        "tensor {i}: use {u} falls inside swap window ({out_after}, {in_before})"
                    )));
                }
            }
            Choice::Recompute => {
                if t.recompute.is_none() {
                    return Err(SwapError::InvalidPlan(format!(
                        "tensor {i}: recompute chosen but the profile has no recipe"
                    )));
                }
                if profile.recompute_gap(i).is_none() {
                    return Err(SwapError::InvalidPlan(format!(
                        "tensor {i}: recompute chosen but it has no backward use to rebuild for"
                    )));
                }
            }
        }
    }
    Ok(())
}

/// Checks bandwidths are usable.
pub fn validate_config(cfg: &SimConfig) -> Result<(), SwapError> {
    if cfg.d2h_bytes_per_s == 0 || cfg.h2d_bytes_per_s == 0 {
        return Err(SwapError::InvalidConfig(
            "bandwidths must be non-zero".into(),
        ));
    }
    Ok(())
}

#[derive(Clone, Copy)]
struct Event {
    t: u64,
    /// Frees sort before allocations at the same instant, like the baseline's per-op count.
    alloc: bool,
    bytes: usize,
}

/// Simulates one iteration of `profile` under `plan`. Deterministic, integer nanoseconds.
pub fn simulate(
    profile: &Profile,
    plan: &[Choice],
    cfg: &SimConfig,
) -> Result<SimResult, SwapError> {
    profile.validate()?;
    validate_plan(profile, plan)?;
    validate_config(cfg)?;
    let n = profile.ops.len();
    let prefetch = cfg.prefetch.max(1);

    // Per op: swap-outs after it (tensor order = D2H FIFO order), swap-ins issued after it,
    // swap-ins needed before it, recomputes before it, and frees after it.
    let tensors = &profile.tensors;
    let mut outs_after: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut ins_issued_after: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut ins_needed_before: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut recompute_before: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut produced_at: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut freed_after: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, (t, c)) in tensors.iter().zip(plan).enumerate() {
        if let Choice::Swap {
            out_after,
            in_before,
        } = *c
        {
            if out_after >= in_before {
                // A carried state swapped across the iteration's end: allocated when its copy
                // in starts, freed when its copy out ends.
                ins_issued_after[in_before.saturating_sub(prefetch)].push(i);
                ins_needed_before[in_before].push(i);
                outs_after[out_after].push(i);
                continue;
            }
        }
        produced_at[t.produced_at].push(i);
        freed_after[t.freed_after].push(i);
        match *c {
            Choice::Keep => {}
            Choice::Swap {
                out_after,
                in_before,
            } => {
                outs_after[out_after].push(i);
                let trigger = in_before.saturating_sub(prefetch).max(out_after);
                ins_issued_after[trigger].push(i);
                ins_needed_before[in_before].push(i);
            }
            Choice::Recompute => {
                if let Some((last_fwd, first_bwd)) = profile.recompute_gap(i) {
                    // Freed after its last forward use too; rebuilt before `first_bwd`.
                    recompute_before[first_bwd].push(i);
                    freed_after[last_fwd].push(i);
                }
            }
        }
    }
    // H2D FIFO order: by trigger op, then by the op needing the tensor, then by tensor.
    for list in &mut ins_issued_after {
        list.sort_by_key(|&i| match plan[i] {
            Choice::Swap { in_before, .. } => (in_before, i),
            _ => (usize::MAX, i),
        });
    }

    let mut events = Vec::new();
    let mut out_end = vec![0u64; tensors.len()];
    let mut in_ready = vec![0u64; tensors.len()];
    let mut d2h_free = 0u64;
    let mut h2d_free = 0u64;
    let mut now = 0u64;
    let mut wait = 0u64;
    let mut recompute_ns = 0u64;
    let mut op_spans = Vec::with_capacity(n);
    let mut windows = Vec::with_capacity(n);

    for op in 0..n {
        let window_start = now;
        for &i in &recompute_before[op] {
            events.push(Event {
                t: now,
                alloc: true,
                bytes: tensors[i].bytes,
            });
            let cost = tensors[i].recompute.as_ref().map_or(0, |r| r.gpu_ns);
            now += cost;
            recompute_ns += cost;
        }
        let ready = ins_needed_before[op]
            .iter()
            .map(|&i| in_ready[i])
            .max()
            .unwrap_or(0);
        if ready > now {
            wait += ready - now;
            now = ready;
        }
        let start = now;
        for &i in &produced_at[op] {
            events.push(Event {
                t: start,
                alloc: true,
                bytes: tensors[i].bytes,
            });
        }
        now += profile.ops[op].gpu_ns;
        let end = now;
        op_spans.push((start, end));
        windows.push((window_start, end));

        for &i in &freed_after[op] {
            events.push(Event {
                t: end,
                alloc: false,
                bytes: tensors[i].bytes,
            });
        }
        for &i in &outs_after[op] {
            let (_, e) = enqueue(&mut d2h_free, end, tensors[i].bytes, cfg.d2h_bytes_per_s);
            out_end[i] = e;
            events.push(Event {
                t: e,
                alloc: false,
                bytes: tensors[i].bytes,
            });
        }
        for &i in &ins_issued_after[op] {
            let ready = end.max(out_end[i]);
            let (s, e) = enqueue(&mut h2d_free, ready, tensors[i].bytes, cfg.h2d_bytes_per_s);
            in_ready[i] = e;
            events.push(Event {
                t: s,
                alloc: true,
                bytes: tensors[i].bytes,
            });
        }
    }

    events.sort_by_key(|e| (e.t, e.alloc));
    let mut bytes = profile.base_bytes as i128;
    let mut timeline: Vec<MemPoint> = vec![MemPoint {
        t_ns: 0,
        bytes: profile.base_bytes,
    }];
    for e in &events {
        if e.alloc {
            bytes += e.bytes as i128;
        } else {
            bytes -= e.bytes as i128;
        }
        let b = usize::try_from(bytes).unwrap_or(0);
        match timeline.last_mut() {
            Some(p) if p.t_ns == e.t => p.bytes = b,
            _ => timeline.push(MemPoint {
                t_ns: e.t,
                bytes: b,
            }),
        }
    }
    // Peak over instants (after all events of an instant), first occurrence.
    let mut peak = MemPoint {
        t_ns: 0,
        bytes: profile.base_bytes,
    };
    for p in &timeline {
        if p.bytes > peak.bytes {
            peak = *p;
        }
    }
    let peak_op = windows
        .iter()
        .position(|&(s, e)| peak.t_ns >= s && peak.t_ns < e)
        .unwrap_or(n - 1);

    Ok(SimResult {
        step_ns: now,
        exposed_wait_ns: wait,
        recompute_ns,
        peak_bytes: peak.bytes,
        peak_at_ns: peak.t_ns,
        peak_op,
        op_spans,
        timeline,
    })
}

#[cfg(test)]
mod tests {
    use super::transfer_ns;

    #[test]
    fn transfer_time_rounds_up() {
        assert_eq!(transfer_ns(1_000_000, 1_000_000_000_000), 1_000);
        assert_eq!(transfer_ns(1, 3_000_000_000), 1);
        assert_eq!(transfer_ns(3, 2_000_000_000), 2);
        assert_eq!(transfer_ns(1, 0), u64::MAX);
    }
}
