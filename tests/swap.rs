//! SmartSwap core on hand-built iterations whose numbers are worked out by hand.

use glake::swap::{
    plan, simulate, Choice, MemPoint, Op, Phase, Preference, Profile, Recompute, Recorder,
    SimConfig, SwapError, Tensor, TensorKind,
};

const B: usize = 1_000_000;
const BASE: usize = 100;
const OP_NS: u64 = 10_000;

fn op(name: &str, phase: Phase) -> Op {
    Op {
        name: name.into(),
        gpu_ns: OP_NS,
        phase,
    }
}

fn act(layer: usize, n: usize, bytes: usize, recompute_ns: Option<u64>) -> Tensor {
    let bwd = 2 * n - 1 - layer;
    Tensor {
        bytes,
        produced_at: layer,
        uses: vec![layer, bwd],
        freed_after: bwd,
        recompute: recompute_ns.map(|gpu_ns| Recompute {
            ops: vec![layer],
            gpu_ns,
        }),
        kind: TensorKind::Activation,
    }
}

/// `n` forward ops each making one activation of `B` bytes, read back in reverse by `n`
/// backward ops.
fn transformer(n: usize, recompute_ns: Option<u64>) -> Profile {
    let mut ops: Vec<Op> = (0..n)
        .map(|i| op(&format!("fwd{i}"), Phase::Forward))
        .collect();
    ops.extend((0..n).map(|i| op(&format!("bwd{}", n - 1 - i), Phase::Backward)));
    Profile {
        ops,
        tensors: (0..n).map(|l| act(l, n, B, recompute_ns)).collect(),
        base_bytes: BASE,
    }
}

fn cfg(d2h: u64, h2d: u64, prefetch: usize) -> SimConfig {
    SimConfig {
        d2h_bytes_per_s: d2h,
        h2d_bytes_per_s: h2d,
        prefetch,
    }
}

/// 1 MB in 1 us.
const AMPLE: u64 = 1_000_000_000_000;
/// 1 MB in 100 us: ten ops.
const TINY: u64 = 10_000_000_000;

fn keep_all(p: &Profile) -> Vec<Choice> {
    vec![Choice::Keep; p.tensors.len()]
}

#[test]
fn baseline_timeline_and_peak() {
    let p = transformer(4, None);
    p.validate().unwrap();
    let tl: Vec<usize> = [1, 2, 3, 4, 4, 3, 2, 1]
        .iter()
        .map(|k| BASE + k * B)
        .collect();
    assert_eq!(p.baseline_timeline(), tl);
    assert_eq!(p.baseline_peak(), BASE + 4 * B);
    assert_eq!(p.compute_ns(), 80_000);
}

#[test]
fn keep_all_matches_baseline() {
    let p = transformer(4, None);
    let r = simulate(&p, &keep_all(&p), &cfg(AMPLE, AMPLE, 2)).unwrap();
    assert_eq!(r.step_ns, 80_000);
    assert_eq!(r.exposed_wait_ns, 0);
    assert_eq!(r.recompute_ns, 0);
    assert_eq!(r.peak_bytes, p.baseline_peak());
    assert_eq!(r.peak_at_ns, 30_000);
    assert_eq!(r.peak_op, 3);
    // A point wherever the count changes: nothing changes between ops 3 and 4.
    let points: Vec<(u64, usize)> = r.timeline.iter().map(|m| (m.t_ns, m.bytes)).collect();
    let want: Vec<(u64, usize)> = [(0, 1), (10, 2), (20, 3), (30, 4), (50, 3), (60, 2), (70, 1)]
        .iter()
        .map(|&(us, k)| (us * 1_000, BASE + k * B))
        .chain([(80_000, BASE)])
        .collect();
    assert_eq!(points, want);
    assert_eq!(r.op_spans[5], (50_000, 60_000));
}

#[test]
fn swap_with_ample_bandwidth_is_hidden() {
    let p = transformer(4, None);
    let mut plan = keep_all(&p);
    plan[0] = Choice::Swap {
        out_after: 0,
        in_before: 7,
    };
    let r = simulate(&p, &plan, &cfg(AMPLE, AMPLE, 2)).unwrap();
    assert_eq!(r.step_ns, 80_000);
    assert_eq!(r.exposed_wait_ns, 0);
    assert_eq!(r.peak_bytes, BASE + 3 * B);
    // Out ends 11 us (released), in starts when op 5 ends at 60 us.
    assert!(r.timeline.contains(&MemPoint {
        t_ns: 11_000,
        bytes: BASE + B
    }));
    // When op 5 ends (60 us) a2 is freed as a0 starts coming back.
    assert!(r.timeline.contains(&MemPoint {
        t_ns: 60_000,
        bytes: BASE + 2 * B
    }));
}

#[test]
fn swap_with_tiny_bandwidth_exposes_the_shortfall() {
    let p = transformer(4, None);
    let mut plan = keep_all(&p);
    plan[0] = Choice::Swap {
        out_after: 0,
        in_before: 7,
    };
    // H2D takes 100 us, issued at 60 us (end of op 5), needed at 70 us: 90 us exposed.
    let r = simulate(&p, &plan, &cfg(AMPLE, TINY, 2)).unwrap();
    assert_eq!(r.exposed_wait_ns, 100_000 - (70_000 - 60_000));
    assert_eq!(r.step_ns, 80_000 + 90_000);
    assert_eq!(r.op_spans[7], (160_000, 170_000));
    // Both directions slow: the swap-in cannot start before the 100 us swap-out ends at
    // 110 us, so it is ready at 210 us instead of 70 us; a0 never leaves in time.
    let r = simulate(&p, &plan, &cfg(TINY, TINY, 2)).unwrap();
    assert_eq!(r.exposed_wait_ns, 140_000);
    assert_eq!(r.step_ns, 220_000);
    assert_eq!(r.peak_bytes, BASE + 4 * B);
}

#[test]
fn recompute_adds_exactly_its_cost() {
    let p = transformer(4, Some(3_000));
    let mut plan = keep_all(&p);
    plan[1] = Choice::Recompute;
    let r = simulate(&p, &plan, &cfg(AMPLE, AMPLE, 2)).unwrap();
    assert_eq!(r.recompute_ns, 3_000);
    assert_eq!(r.step_ns, 83_000);
    assert_eq!(r.exposed_wait_ns, 0);
    assert_eq!(r.peak_bytes, BASE + 3 * B);
    // Freed when op 1 ends (20 us, as a2 arrives), back at the start of the recompute (60 us,
    // as a2 is freed).
    assert!(r.timeline.contains(&MemPoint {
        t_ns: 20_000,
        bytes: BASE + 2 * B
    }));
    assert!(r.timeline.contains(&MemPoint {
        t_ns: 60_000,
        bytes: BASE + 2 * B
    }));
    assert_eq!(r.op_spans[6], (63_000, 73_000));
}

#[test]
fn queues_are_fifo_and_full_duplex() {
    // 1 MB takes 10 us each way. W (1 MB) goes out after op 0 and back before op 2; X (2 MB)
    // and Y (1 MB) go out after op 0 and back before op 7.
    let ops: Vec<Op> = (0..8)
        .map(|i| op(&format!("op{i}"), Phase::Other))
        .collect();
    let t = |bytes, last: usize| Tensor {
        bytes,
        produced_at: 0,
        uses: vec![0, last],
        freed_after: last,
        recompute: None,
        kind: TensorKind::Activation,
    };
    let p = Profile {
        ops,
        tensors: vec![t(B, 2), t(2 * B, 7), t(B, 7)],
        base_bytes: 0,
    };
    let sw = |in_before| Choice::Swap {
        out_after: 0,
        in_before,
    };
    let r = simulate(
        &p,
        &[sw(2), sw(7), sw(7)],
        &cfg(100_000_000_000, 100_000_000_000, 1),
    )
    .unwrap();
    // D2H: W 10-20 us, X 20-40 us, Y 40-50 us (FIFO behind each other).
    // H2D: W 20-30 us while X is still going out (full duplex); op 2 waits 10 us.
    // Then op 2 runs 30-40, ops 3-6 to 80 us; X in 80-100 us, Y 100-110 us; op 7 waits 30 us.
    assert_eq!(r.exposed_wait_ns, 10_000 + 30_000);
    assert_eq!(r.step_ns, 120_000);
    assert_eq!(r.op_spans[2], (30_000, 40_000));
    assert_eq!(r.op_spans[7], (110_000, 120_000));
    let expect = vec![
        MemPoint {
            t_ns: 0,
            bytes: 4 * B,
        },
        MemPoint {
            t_ns: 20_000,
            bytes: 4 * B,
        },
        MemPoint {
            t_ns: 40_000,
            bytes: B,
        },
        MemPoint {
            t_ns: 50_000,
            bytes: 0,
        },
        MemPoint {
            t_ns: 80_000,
            bytes: 2 * B,
        },
        MemPoint {
            t_ns: 100_000,
            bytes: 3 * B,
        },
        MemPoint {
            t_ns: 120_000,
            bytes: 0,
        },
    ];
    assert_eq!(r.timeline, expect);
    assert_eq!(r.peak_bytes, 4 * B);
}

#[test]
fn planner_meets_target_with_hidden_swaps() {
    let p = transformer(4, None);
    let got = plan(
        &p,
        BASE + 3 * B,
        &cfg(AMPLE, AMPLE, 2),
        Preference::Performance,
    )
    .unwrap();
    assert!(got.result.peak_bytes <= BASE + 3 * B);
    assert_eq!(got.result.step_ns, 80_000);
    assert_eq!(got.result.exposed_wait_ns, 0);
    let swaps = got
        .choices
        .iter()
        .filter(|c| matches!(c, Choice::Swap { .. }))
        .count();
    assert!(swaps >= 1);
    assert!(!got.choices.contains(&Choice::Recompute));
    // The plan replays to the same result.
    assert_eq!(
        simulate(&p, &got.choices, &cfg(AMPLE, AMPLE, 2)).unwrap(),
        got.result
    );
}

#[test]
fn planner_prefers_swap_on_fast_links() {
    let p = transformer(4, Some(3_000));
    let got = plan(
        &p,
        BASE + 3 * B,
        &cfg(AMPLE, AMPLE, 2),
        Preference::Performance,
    )
    .unwrap();
    assert!(got.result.peak_bytes <= BASE + 3 * B);
    assert_eq!(got.result.step_ns, 80_000);
    assert!(!got.choices.contains(&Choice::Recompute));
    assert!(got.choices.iter().any(|c| matches!(c, Choice::Swap { .. })));
}

#[test]
fn planner_prefers_cheap_recompute_on_slow_links() {
    let p = transformer(4, Some(3_000));
    // 1 MB takes 1 ms: any swap stalls for most of a millisecond.
    let slow = cfg(1_000_000_000, 1_000_000_000, 2);
    let got = plan(&p, BASE + 3 * B, &slow, Preference::Performance).unwrap();
    assert!(got.result.peak_bytes <= BASE + 3 * B);
    assert!(got
        .choices
        .iter()
        .all(|c| !matches!(c, Choice::Swap { .. })));
    let recomputes = got
        .choices
        .iter()
        .filter(|&&c| c == Choice::Recompute)
        .count();
    assert_eq!(recomputes, 1);
    assert_eq!(got.result.recompute_ns, 3_000);
    assert_eq!(got.result.step_ns, 83_000);
}

#[test]
fn planner_reports_the_best_peak_when_the_target_is_impossible() {
    // a3 is produced by op 3 and read by op 4: it can never leave, so BASE + B is a floor.
    let p = transformer(4, Some(3_000));
    let err = plan(
        &p,
        BASE + B / 2,
        &cfg(AMPLE, AMPLE, 2),
        Preference::Performance,
    )
    .unwrap_err();
    match err {
        SwapError::TargetUnreachable { target, best_peak } => {
            assert_eq!(target, BASE + B / 2);
            assert_eq!(best_peak, BASE + 2 * B);
        }
        e => panic!("unexpected {e}"),
    }
    assert!(err.to_string().contains(&format!("{}", BASE + 2 * B)));
}

#[test]
fn memory_saving_may_move_optimizer_state() {
    // A prologue op makes a 2 MB optimizer state S read again only by the optimizer op; the
    // four layers shift one op later.
    let mut p = transformer(4, None);
    p.ops.insert(0, op("load", Phase::Other));
    p.ops.push(op("adam", Phase::Optimizer));
    for t in &mut p.tensors {
        t.produced_at += 1;
        t.freed_after += 1;
        t.uses.iter_mut().for_each(|u| *u += 1);
    }
    p.tensors.push(Tensor {
        bytes: 2 * B,
        produced_at: 0,
        uses: vec![0, 9],
        freed_after: 9,
        recompute: None,
        kind: TensorKind::OptimizerState,
    });
    p.validate().unwrap();
    assert_eq!(p.baseline_peak(), BASE + 6 * B);
    let c = cfg(AMPLE, AMPLE, 2);
    // Activations alone: S (2 MB) plus a3 and a2 (still copying out when op 4 starts) stay.
    let err = plan(&p, BASE + 3 * B, &c, Preference::Performance).unwrap_err();
    assert_eq!(
        err,
        SwapError::TargetUnreachable {
            target: BASE + 3 * B,
            best_peak: BASE + 4 * B
        }
    );
    let got = plan(&p, BASE + 3 * B, &c, Preference::MemorySaving).unwrap();
    assert!(got.result.peak_bytes <= BASE + 3 * B);
    assert_eq!(
        got.choices[4],
        Choice::Swap {
            out_after: 0,
            in_before: 9
        }
    );
    assert_eq!(got.result.step_ns, 100_000);
    assert_eq!(got.result.exposed_wait_ns, 0);
}

/// Four layers whose activations the planner may not move, and a 2 MB carried state (a
/// block's optimizer state, its step run in the backward) read only by op 5, the backward of
/// layer 2.
fn carried_state_profile() -> Profile {
    let mut p = transformer(4, None);
    for t in &mut p.tensors {
        t.kind = TensorKind::Other;
    }
    p.tensors.push(Tensor {
        bytes: 2 * B,
        produced_at: 0,
        uses: vec![5],
        freed_after: 7,
        recompute: None,
        kind: TensorKind::CarriedState,
    });
    p.validate().unwrap();
    p
}

#[test]
fn a_carried_state_is_swapped_across_the_iterations_end() {
    let p = carried_state_profile();
    let across = Choice::Swap {
        out_after: 5,
        in_before: 5,
    };
    let mut choices = vec![Choice::Keep; 5];
    let kept = simulate(&p, &choices, &cfg(AMPLE, AMPLE, 1)).unwrap();
    assert_eq!(kept.peak_bytes, BASE + 6 * B);
    choices[4] = across;
    // Prefetch 1: its copy in starts when op 4 ends (t = 50 us), as layer 3's activation is
    // freed; it takes 2 us, which op 5 waits for; op 5 ends at 62 us and the copy out 2 us
    // later, leaving layers 0 and 1.
    let r = simulate(&p, &choices, &cfg(AMPLE, AMPLE, 1)).unwrap();
    assert_eq!(r.peak_bytes, BASE + 5 * B);
    assert_eq!(r.exposed_wait_ns, 2_000);
    assert_eq!(r.step_ns, 82_000);
    // Off the device when the iteration starts: only layer 0's activation then.
    assert_eq!(r.timeline[0].bytes, BASE + B);
    assert_eq!(kept.timeline[0].bytes, BASE + 3 * B);
    assert!(r.timeline.contains(&MemPoint {
        t_ns: 64_000,
        bytes: BASE + 2 * B
    }));
    // Prefetch 2: in when op 3 ends, no wait, but on the device beside every activation.
    let early = simulate(&p, &choices, &cfg(AMPLE, AMPLE, 2)).unwrap();
    assert_eq!((early.peak_bytes, early.exposed_wait_ns), (BASE + 6 * B, 0));
    // The planner finds it under the memory preference, and only there.
    let got = plan(
        &p,
        BASE + 5 * B,
        &cfg(AMPLE, AMPLE, 1),
        Preference::MemorySaving,
    )
    .unwrap();
    assert_eq!(got.choices[4], across);
    assert_eq!(got.result.peak_bytes, BASE + 5 * B);
    assert!(plan(
        &p,
        BASE + 5 * B,
        &cfg(AMPLE, AMPLE, 1),
        Preference::Performance
    )
    .is_err());
    // With room for it, it stays.
    let roomy = plan(
        &p,
        BASE + 6 * B,
        &cfg(AMPLE, AMPLE, 1),
        Preference::MemorySaving,
    )
    .unwrap();
    assert_eq!(roomy.choices[4], Choice::Keep);
    // A window across the iteration's end is a carried state's alone, and exactly its own.
    let mut bad = vec![Choice::Keep; 5];
    bad[0] = Choice::Swap {
        out_after: 7,
        in_before: 0,
    };
    assert!(matches!(
        simulate(&p, &bad, &cfg(AMPLE, AMPLE, 1)),
        Err(SwapError::InvalidPlan(m)) if m.contains("carried state")
    ));
    let mut bad = vec![Choice::Keep; 5];
    bad[4] = Choice::Swap {
        out_after: 6,
        in_before: 5,
    };
    assert!(simulate(&p, &bad, &cfg(AMPLE, AMPLE, 1)).is_err());
    // A carried state lives through the whole iteration; one used at op 0 stays on the device.
    let mut short = p.clone();
    short.tensors[4].freed_after = 6;
    assert!(matches!(short.validate(), Err(SwapError::InvalidProfile(m)) if m.contains("carried")));
    let mut first = p.clone();
    first.tensors[4].uses = vec![0];
    assert!(matches!(
        plan(
            &first,
            BASE + 5 * B,
            &cfg(AMPLE, AMPLE, 1),
            Preference::MemorySaving
        ),
        Err(SwapError::TargetUnreachable { .. })
    ));
}

#[test]
fn invalid_profiles_plans_and_configs_are_rejected() {
    let good = transformer(2, None);
    let c = cfg(AMPLE, AMPLE, 2);
    let mut p = good.clone();
    p.tensors[0].uses = vec![3, 0];
    assert!(matches!(p.validate(), Err(SwapError::InvalidProfile(m)) if m.contains("not sorted")));
    let mut p = good.clone();
    p.tensors[0].produced_at = 9;
    assert!(
        matches!(p.validate(), Err(SwapError::InvalidProfile(m)) if m.contains("produced_at 9"))
    );
    let mut p = good.clone();
    p.tensors[1].uses = vec![0, 1];
    assert!(
        matches!(p.validate(), Err(SwapError::InvalidProfile(m)) if m.contains("use 0 outside"))
    );
    let mut p = good.clone();
    p.tensors[1].freed_after = 0;
    assert!(p.validate().is_err());
    let mut p = good.clone();
    p.tensors[0].recompute = Some(Recompute {
        ops: vec![4],
        gpu_ns: 1,
    });
    assert!(p.validate().is_err());
    assert!(simulate(&p, &keep_all(&good), &c).is_err());
    assert!(plan(&p, 0, &c, Preference::Performance).is_err());
    let empty = Profile::default();
    assert!(empty.validate().is_err());

    // Plans: wrong length, a use inside the window, recompute without a recipe, zero bandwidth.
    assert!(matches!(
        simulate(&good, &[Choice::Keep], &c),
        Err(SwapError::InvalidPlan(_))
    ));
    let p3 = transformer(3, None);
    let mut pl = keep_all(&p3);
    pl[0] = Choice::Swap {
        out_after: 0,
        in_before: 6,
    };
    assert!(matches!(
        simulate(&p3, &pl, &c),
        Err(SwapError::InvalidPlan(_))
    ));
    pl[0] = Choice::Swap {
        out_after: 3,
        in_before: 2,
    };
    assert!(matches!(
        simulate(&p3, &pl, &c),
        Err(SwapError::InvalidPlan(_))
    ));
    pl[0] = Choice::Recompute;
    assert!(
        matches!(simulate(&p3, &pl, &c), Err(SwapError::InvalidPlan(m)) if m.contains("no recipe"))
    );
    assert!(matches!(
        simulate(&good, &keep_all(&good), &cfg(0, AMPLE, 1)),
        Err(SwapError::InvalidConfig(_))
    ));
}

/// A training step as the hooks and the pool report it (8 layers, each saving a 16 MB
/// activation for its backward op), recorded into a profile, then planned to 60% of its peak:
/// the plan swaps activations, meets the target and costs a bounded stall at these speeds.
#[test]
fn a_recorded_step_is_planned_under_a_cap() {
    const LAYERS: usize = 8;
    const ACT: usize = 16 * B;
    let mut r = Recorder::default();
    r.allocated(0xF000_0000, 50 * B); // weights, from before the step
    r.begin_iteration();
    r.set_phase(Phase::Forward);
    for layer in 0..LAYERS {
        let at = r.begin_op(&format!("fwd{layer}")).unwrap();
        r.tensor(0xF000_0000, 50 * B).unwrap();
        r.allocated(0x1000_0000 + layer as u64 * 0x100_0000, ACT);
        r.end_op().unwrap();
        r.set_op_time(at, 1_000_000).unwrap();
    }
    r.set_phase(Phase::Backward);
    for layer in (0..LAYERS).rev() {
        let ptr = 0x1000_0000 + layer as u64 * 0x100_0000;
        let at = r.begin_op(&format!("bwd{layer}")).unwrap();
        r.tensor(ptr, ACT).unwrap();
        r.freed(ptr);
        r.end_op().unwrap();
        r.set_op_time(at, 2_000_000).unwrap();
    }
    let profile = r.end_iteration().unwrap();
    assert_eq!(profile.ops.len(), 2 * LAYERS);
    assert_eq!(profile.base_bytes, 50 * B);
    assert_eq!(profile.tensors.len(), LAYERS);
    let peak = profile.baseline_peak();
    assert_eq!(peak, 50 * B + LAYERS * ACT);
    let target = peak * 6 / 10;
    // 25 GB/s each way: 0.64 ms per activation against 1-2 ms ops.
    let speeds = cfg(25_000_000_000, 25_000_000_000, 2);
    let planned = plan(&profile, target, &speeds, Preference::Performance).unwrap();
    assert!(planned.result.peak_bytes <= target, "{:?}", planned.result);
    assert!(planned
        .choices
        .iter()
        .any(|c| matches!(c, Choice::Swap { .. })));
    // The step may stall for copies, but not by more than the copies themselves take.
    let copies_ns = (2 * LAYERS * ACT) as u64 * 1_000_000_000 / 25_000_000_000;
    assert!(
        planned.result.step_ns <= profile.compute_ns() + copies_ns,
        "{:?}",
        planned.result
    );
}

/// On tight targets the planner is never slower than rebuilding everything: here each
/// activation costs little to rebuild, the link is slow, and the target leaves room for one
/// activation only, so full recomputation (refined) is the plan to beat.
#[test]
fn planner_is_never_slower_than_full_recomputation() {
    let p = transformer(8, Some(OP_NS / 2));
    let c = cfg(TINY, TINY, 1);
    let all = vec![Choice::Recompute; p.tensors.len()];
    let full = simulate(&p, &all, &c).unwrap();
    for target in [
        full.peak_bytes,
        full.peak_bytes + B,
        full.peak_bytes + 3 * B,
    ] {
        let planned = plan(&p, target, &c, Preference::Performance).unwrap();
        assert!(planned.result.peak_bytes <= target);
        assert!(
            planned.result.step_ns <= full.step_ns,
            "target {target}: planned {} ns, full recomputation {} ns",
            planned.result.step_ns,
            full.step_ns
        );
    }
}
