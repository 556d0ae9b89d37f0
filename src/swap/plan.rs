//! A greedy planner: relieve the simulated peak one tensor at a time, cheapest bytes first, then
//! undo what turned out unnecessary.

use super::profile::{Profile, TensorKind};
use super::simulate::{simulate, validate_config, Choice, SimConfig, SimResult};
use super::SwapError;

/// Which tensors the planner may touch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Preference {
    /// Activations only: their gaps are long and moving them costs the least.
    Performance,
    /// Activations, optimizer states and gradients: more memory, more traffic.
    MemorySaving,
}

impl Preference {
    fn allows(self, kind: TensorKind) -> bool {
        match self {
            Preference::Performance => kind == TensorKind::Activation,
            Preference::MemorySaving => matches!(
                kind,
                TensorKind::Activation
                    | TensorKind::OptimizerState
                    | TensorKind::Gradient
                    | TensorKind::CarriedState
            ),
        }
    }
}

/// A plan with its predicted iteration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub choices: Vec<Choice>,
    pub result: SimResult,
}

/// The swap window of tensor `i` that spans op `at`: the touches just before and after it.
fn swap_window(profile: &Profile, i: usize, at: usize) -> Option<Choice> {
    let touches = profile.tensors.get(i)?.touches();
    touches
        .windows(2)
        .find(|w| w[0] < at && at < w[1])
        .map(|w| Choice::Swap {
            out_after: w[0],
            in_before: w[1],
        })
}

/// Options that take tensor `i` off the device during op `at`.
fn options(profile: &Profile, i: usize, at: usize) -> Vec<Choice> {
    let mut v = Vec::new();
    if let Some((out_after, in_before)) = profile.tensors[i].carried_window() {
        // Off the device outside its uses, or kept throughout (a first use at op 0 leaves
        // no room to bring it in).
        if in_before > 0 && (at < in_before || at > out_after) {
            v.push(Choice::Swap {
                out_after,
                in_before,
            });
        }
        return v;
    }
    if let Some(c) = swap_window(profile, i, at) {
        v.push(c);
    }
    let t = &profile.tensors[i];
    if t.recompute.is_some() {
        if let Some((last, first_bwd)) = profile.recompute_gap(i) {
            if last < at && at < first_bwd {
                v.push(Choice::Recompute);
            }
        }
    }
    v
}

/// `a` saves more per added nanosecond than `b` (`saved / (added + 1)`, compared exactly).
fn better(a: (u128, u128), b: (u128, u128)) -> bool {
    a.0 * (b.1 + 1) > b.0 * (a.1 + 1)
}

/// Chooses Keep/Swap/Recompute per tensor so the simulated peak is at most `target_bytes`, with
/// the step as short as the greedy search finds. Errors with the best peak when it cannot.
pub fn plan(
    profile: &Profile,
    target_bytes: usize,
    cfg: &SimConfig,
    pref: Preference,
) -> Result<Planned, SwapError> {
    profile.validate()?;
    validate_config(cfg)?;
    let mut choices = vec![Choice::Keep; profile.tensors.len()];
    let mut res = simulate(profile, &choices, cfg)?;

    while res.peak_bytes > target_bytes {
        // Best option lowering the peak, and, failing that, the best nominal one (the tensor
        // leaves a peak that another tensor still holds up; later steps lower it).
        let mut best: Option<((u128, u128), usize, Choice, SimResult)> = None;
        let mut nominal: Option<((u128, u128), usize, Choice, SimResult)> = None;
        for i in 0..profile.tensors.len() {
            if choices[i] != Choice::Keep || !pref.allows(profile.tensors[i].kind) {
                continue;
            }
            for c in options(profile, i, res.peak_op) {
                let mut trial = choices.clone();
                trial[i] = c;
                let r = simulate(profile, &trial, cfg)?;
                let added = r.step_ns.saturating_sub(res.step_ns) as u128;
                let saved = res.peak_bytes.saturating_sub(r.peak_bytes) as u128;
                if saved > 0 {
                    if best.as_ref().is_none_or(|b| better((saved, added), b.0)) {
                        best = Some(((saved, added), i, c, r));
                    }
                } else {
                    let bytes = profile.tensors[i].bytes as u128;
                    if nominal.as_ref().is_none_or(|b| better((bytes, added), b.0)) {
                        nominal = Some(((bytes, added), i, c, r));
                    }
                }
            }
        }
        match best.or(nominal) {
            Some((_, i, c, r)) => {
                choices[i] = c;
                res = r;
            }
            None => {
                return Err(SwapError::TargetUnreachable {
                    target: target_bytes,
                    best_peak: res.peak_bytes,
                })
            }
        }
    }

    let greedy = refine(profile, target_bytes, cfg, choices, res)?;
    // A second start: everything the preference allows rebuilt (full recomputation), then
    // refined the same way. The greedy descent above can end in a slower plan when the target
    // is far below the baseline; the faster of the two is kept.
    let all: Vec<Choice> = (0..profile.tensors.len())
        .map(|i| {
            let t = &profile.tensors[i];
            if pref.allows(t.kind) && t.recompute.is_some() && profile.recompute_gap(i).is_some() {
                Choice::Recompute
            } else {
                Choice::Keep
            }
        })
        .collect();
    let r = simulate(profile, &all, cfg)?;
    if r.peak_bytes <= target_bytes {
        let rebuilt = refine(profile, target_bytes, cfg, all, r)?;
        if rebuilt.result.step_ns < greedy.result.step_ns {
            return Ok(rebuilt);
        }
    }
    Ok(greedy)
}

/// Improves a plan that meets the target: a recompute turned into a swap over the same gap,
/// an unnecessary choice turned back into Keep, each only when the target holds and the step
/// does not slow down (a swap replacing a recompute must strictly speed it up).
fn refine(
    profile: &Profile,
    target_bytes: usize,
    cfg: &SimConfig,
    mut choices: Vec<Choice>,
    mut res: SimResult,
) -> Result<Planned, SwapError> {
    for i in 0..choices.len() {
        if choices[i] != Choice::Recompute {
            continue;
        }
        if let Some((out_after, in_before)) = profile.recompute_gap(i) {
            let mut trial = choices.clone();
            trial[i] = Choice::Swap {
                out_after,
                in_before,
            };
            if let Ok(r) = simulate(profile, &trial, cfg) {
                if r.peak_bytes <= target_bytes && r.step_ns < res.step_ns {
                    choices = trial;
                    res = r;
                }
            }
        }
    }
    for i in 0..choices.len() {
        if choices[i] == Choice::Keep {
            continue;
        }
        let mut trial = choices.clone();
        trial[i] = Choice::Keep;
        let r = simulate(profile, &trial, cfg)?;
        if r.peak_bytes <= target_bytes && r.step_ns <= res.step_ns {
            choices = trial;
            res = r;
        }
    }
    Ok(Planned {
        choices,
        result: res,
    })
}
