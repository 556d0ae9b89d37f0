//! SmartSwap's profiler on the backend under test: op hooks with device times from timed
//! events, and the pool's allocations, recorded into the planner's profile.

mod common;

use glake::smartswap::Profiler;
use glake::swap::{Phase, TensorKind};
use glake::ErrorKind;

const MIB: usize = 1 << 20;

/// A session's settings for the tests: one warm-up iteration, swap-ins one op ahead, and copies
/// planned as fast as ops here are short (~0.1 ms; the executor waits for copies anyway).
fn settings(target_bytes: usize) -> glake::smartswap::Settings {
    glake::smartswap::Settings {
        target_bytes,
        warmup_iterations: 1,
        prefetch: 1,
        preference: glake::swap::Preference::Performance,
        d2h_bytes_per_s: 1 << 40,
        h2d_bytes_per_s: 1 << 40,
    }
}

#[test]
fn ops_get_their_device_time_and_tensors_their_lives() {
    let device = common::device();
    let stream = device.create_stream().unwrap();
    let len = 32 * MIB;
    let va = device.reserve(len, device.granularity()).unwrap();
    let handle = device.create_physical(len).unwrap();
    device.map(va, len, handle, 0).unwrap();
    device.set_access(va, len, &[device.ordinal()]).unwrap();
    let data = vec![3u8; len];
    let copies = |n: usize| {
        for _ in 0..n {
            // SAFETY: `data` outlives the copies (the iteration ends with a wait on them).
            unsafe {
                device
                    .copy_to_device(va, data.as_ptr(), len, stream)
                    .unwrap()
            };
        }
    };
    let mut profiler = Profiler::new(device.clone());
    for _iteration in 0..2 {
        profiler.begin_iteration();
        profiler.set_phase(Phase::Forward);
        profiler.begin_op("light", stream).unwrap();
        profiler.allocated(0x1000, 4 * MIB);
        profiler.tensor(0x1000, 4 * MIB).unwrap();
        copies(1);
        profiler.end_op().unwrap();
        profiler.begin_op("heavy", stream).unwrap();
        copies(8);
        profiler.end_op().unwrap();
        profiler.set_phase(Phase::Backward);
        profiler.begin_op("grad", stream).unwrap();
        profiler.tensor(0x1000, 4 * MIB).unwrap();
        profiler.freed(0x1000);
        profiler.end_op().unwrap();
        let profile = profiler.end_iteration().unwrap();
        assert_eq!(profile.ops.len(), 3);
        let (light, heavy) = (profile.ops[0].gpu_ns, profile.ops[1].gpu_ns);
        assert!(light > 0, "{:?}", profile.ops);
        assert!(
            heavy > light,
            "8 copies ({heavy} ns) against 1 ({light} ns)"
        );
        assert_eq!(profile.tensors.len(), 1);
        let t = &profile.tensors[0];
        assert_eq!(
            (t.produced_at, t.freed_after, t.kind),
            (0, 2, TensorKind::Activation)
        );
        assert_eq!(t.uses, vec![0, 2]);
    }
    // Hooks out of order are errors, and the profiler goes on.
    let err = profiler.tensor(0x1, 1).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    profiler.begin_iteration();
    profiler.begin_op("a", stream).unwrap();
    assert!(profiler.begin_op("b", stream).is_err());
    profiler.end_op().unwrap();
    assert_eq!(profiler.end_iteration().unwrap().ops.len(), 1);
    drop(profiler);
    device.unmap(va, len).unwrap();
    device.release_physical(handle).unwrap();
    device.unreserve(va, len).unwrap();
    device.destroy_stream(stream).unwrap();
}

/// A timed event that cannot be made or recorded leaves its op without a time (0) while the
/// ops around it are timed; the profile still comes, and the hooks go on.
#[test]
fn ops_whose_timing_fails_keep_no_time() {
    use glake::device::fault::FaultDevice;
    use glake::device::{CallKind, SharedDevice};
    use std::sync::Arc;

    let fault = Arc::new(FaultDevice::new(common::device()));
    let device: SharedDevice = fault.clone();
    let stream = device.create_stream().unwrap();
    let len = 16 * MIB;
    let va = device.reserve(len, device.granularity()).unwrap();
    let handle = device.create_physical(len).unwrap();
    device.map(va, len, handle, 0).unwrap();
    device.set_access(va, len, &[device.ordinal()]).unwrap();
    let data = vec![5u8; len];
    let mut profiler = Profiler::new(device.clone());
    let mut run = || {
        profiler.begin_iteration();
        for name in ["a", "b", "c"] {
            profiler.begin_op(name, stream).unwrap();
            // SAFETY: `data` outlives the copy (the iteration's end waits for it).
            unsafe {
                device
                    .copy_to_device(va, data.as_ptr(), len, stream)
                    .unwrap()
            };
            profiler.end_op().unwrap();
        }
        let profile = profiler.end_iteration().unwrap();
        profile.ops.iter().map(|o| o.gpu_ns).collect::<Vec<_>>()
    };
    // The first event cannot be made: op a has no pair.
    fault.fail_nth(CallKind::CreateEvent, 1);
    let first = run();
    assert_eq!(fault.injected(), 1);
    assert!(first[0] == 0 && first[1] > 0 && first[2] > 0, "{first:?}");
    // Op a's end cannot be recorded (the second record of the iteration).
    fault.fail_nth(CallKind::RecordEvent, 2);
    let second = run();
    assert_eq!(fault.injected(), 2);
    assert!(
        second[0] == 0 && second[1] > 0 && second[2] > 0,
        "{second:?}"
    );
    // Nothing failing: every op is timed again.
    let third = run();
    assert!(third.iter().all(|&ns| ns > 0), "{third:?}");
    drop(profiler);
    device.unmap(va, len).unwrap();
    device.release_physical(handle).unwrap();
    device.unreserve(va, len).unwrap();
    device.destroy_stream(stream).unwrap();
}

/// Attached to a pool, the profiler learns tensors' lives from the pool's own allocations and
/// frees: memory from before the iteration is base memory, memory made inside it is tracked;
/// a detached or dropped profiler hears nothing more.
#[test]
fn an_attached_pool_reports_tensor_lives() {
    use glake::device::Stream;
    use glake::smartswap::attach;
    use glake::{Config, Pool};
    use std::sync::{Arc, Mutex};

    let device = common::device();
    let pool = Pool::new(device.clone(), Config::default()).unwrap();
    let profiler = Arc::new(Mutex::new(Profiler::new(device.clone())));
    attach(&pool, &profiler);
    let s = Stream::DEFAULT;
    let weights = pool.malloc(8 * MIB, s).unwrap(); // before the iteration
    let mut p = profiler.lock().unwrap();
    p.begin_iteration();
    p.set_phase(Phase::Forward);
    drop(p);
    let hook = |f: &dyn Fn(&mut Profiler)| f(&mut profiler.lock().unwrap());
    hook(&|p| {
        p.begin_op("layer", s).unwrap();
        p.tensor(weights, 8 * MIB).unwrap();
    });
    let act = pool.malloc(3 * MIB, s).unwrap();
    hook(&|p| {
        p.tensor(act, 3 * MIB).unwrap();
        p.end_op().unwrap();
        p.set_phase(Phase::Backward);
        p.begin_op("layer_grad", s).unwrap();
        p.tensor(act, 3 * MIB).unwrap();
    });
    pool.free(act).unwrap();
    hook(&|p| p.end_op().unwrap());
    let profile = profiler.lock().unwrap().end_iteration().unwrap();
    assert_eq!(profile.base_bytes, 8 * MIB);
    assert_eq!(profile.tensors.len(), 1);
    let t = &profile.tensors[0];
    assert!(t.bytes >= 3 * MIB, "{t:?}");
    assert_eq!((t.produced_at, t.freed_after), (0, 1));
    assert_eq!(t.uses, vec![0, 1]);
    // Dropped: the pool's later allocations go nowhere, and nothing breaks.
    drop(profiler);
    pool.free(pool.malloc(MIB, s).unwrap()).unwrap();
    pool.set_observer(None);
    pool.free(weights).unwrap();
}

/// A native training loop under a session: warm-up, a profiled iteration, then iterations
/// under a target 60% of the unplanned peak whose reserved peak stays within it, and whose
/// activations come back at their addresses with every byte.
#[test]
fn a_session_trains_under_its_target_and_keeps_every_byte() {
    use glake::device::Stream;
    use glake::smartswap::{Session, SessionPhase};
    use glake::{Config, Pool};
    use std::sync::Arc;

    const LAYERS: usize = 6;
    let act = 8 * MIB;
    let device = common::device();
    let pool = Arc::new(Pool::new(device.clone(), Config::default()).unwrap());
    let s = Stream::DEFAULT;
    let weights = pool.malloc(4 * MIB, s).unwrap();
    let unplanned_peak = 4 * MIB + LAYERS * act;
    let target = unplanned_peak * 6 / 10;
    let mut session = Session::new(pool.clone(), settings(target)).unwrap();
    for iteration in 0..6u64 {
        pool.reset_peak_stats();
        session.begin_iteration().unwrap();
        session.set_phase(Phase::Forward);
        let mut acts = Vec::new();
        for layer in 0..LAYERS {
            session.begin_op("layer", s).unwrap();
            session.tensor(weights, 4 * MIB).unwrap();
            let a = pool.malloc(act, s).unwrap();
            session.tensor(a, act).unwrap();
            common::write_pattern(&device, a, act, iteration * 100 + layer as u64);
            session.end_op().unwrap();
            acts.push(a);
        }
        session.set_phase(Phase::Backward);
        for layer in (0..LAYERS).rev() {
            session.begin_op("layer_grad", s).unwrap();
            let a = acts[layer];
            session.tensor(a, act).unwrap();
            assert!(
                common::has_pattern(&device, a, act, iteration * 100 + layer as u64),
                "iteration {iteration}, layer {layer}: contents changed"
            );
            pool.free(a).unwrap();
            session.end_op().unwrap();
        }
        session.end_iteration().unwrap();
        let stats = pool.stats();
        if iteration >= 2 {
            // Warm-up (iteration 0) and the profiled iteration (1) ran as written.
            assert_eq!(session.phase(), SessionPhase::Stable);
            // Swapped-out allocations stay allocated (their addresses are held) while their
            // physical memory is back with the device: reserved bytes are what the device
            // gives, and they stay within the target.
            let reserved = stats.reserved_bytes.all.peak as usize;
            assert!(
                reserved <= target,
                "iteration {iteration}: {reserved} > {target}"
            );
            assert!(stats.swapped_bytes.peak as usize >= 2 * act);
        } else {
            assert!(stats.allocated_bytes.all.peak as usize >= unplanned_peak);
        }
    }
    let report = session.report();
    assert!(report.planned_swaps > 0, "{report:?}");
    assert_eq!(
        report.swapped_out,
        4 * report.planned_swaps as u64,
        "{report:?}"
    );
    assert_eq!(report.swapped_out, report.swapped_in, "{report:?}");
    assert_eq!(report.restarts, 0);
    let predicted = report.prediction.unwrap().peak_bytes;
    assert!(predicted <= target, "{predicted} > {target}");
    drop(session);
    pool.free(weights).unwrap();
    pool.check_invariants().unwrap();
}

/// Under a plan, an op touching a tensor that is out gets it back first (bytes and address
/// kept), and an iteration that leaves the profile (one op more) brings everything back and
/// starts the session over.
#[test]
fn a_session_brings_back_what_an_op_touches_and_restarts_on_a_new_iteration() {
    use glake::device::Stream;
    use glake::smartswap::{Session, SessionPhase};
    use glake::{Config, Pool};
    use std::sync::Arc;

    const LAYERS: usize = 5;
    let act = 4 * MIB;
    let device = common::device();
    let pool = Arc::new(Pool::new(device.clone(), Config::default()).unwrap());
    let s = Stream::DEFAULT;
    let mut session = Session::new(pool.clone(), settings(LAYERS * act / 2)).unwrap();
    // `peek`: an extra op in the forward that reads layer 0's activation; `extra`: one more op
    // at the end of the iteration.
    let run = |session: &mut Session, seed: u64, peek: bool, extra: bool| {
        session.begin_iteration().unwrap();
        session.set_phase(Phase::Forward);
        let mut acts = Vec::new();
        for layer in 0..LAYERS {
            session.begin_op("layer", s).unwrap();
            let a = pool.malloc(act, s).unwrap();
            session.tensor(a, act).unwrap();
            common::write_pattern(&device, a, act, seed + layer as u64);
            session.end_op().unwrap();
            acts.push(a);
            if peek && layer == LAYERS - 1 {
                let was_out = (0..LAYERS).any(|o| session.is_out(o));
                session.tensor(acts[0], act).unwrap();
                assert!(was_out && common::has_pattern(&device, acts[0], act, seed));
            }
        }
        session.set_phase(Phase::Backward);
        for layer in (0..LAYERS).rev() {
            session.begin_op("layer_grad", s).unwrap();
            session.tensor(acts[layer], act).unwrap();
            assert!(common::has_pattern(
                &device,
                acts[layer],
                act,
                seed + layer as u64
            ));
            pool.free(acts[layer]).unwrap();
            session.end_op().unwrap();
        }
        if extra {
            session.begin_op("extra", s).unwrap();
            session.end_op().unwrap();
        }
        session.end_iteration().unwrap();
    };
    for i in 0..3 {
        run(&mut session, i * 10, false, false);
    }
    assert_eq!(session.phase(), SessionPhase::Stable);
    run(&mut session, 100, true, false);
    run(&mut session, 200, false, true);
    let report = session.report();
    assert_eq!(report.restarts, 1, "{report:?}");
    assert_eq!(report.off_plan, 1, "{report:?}"); // the peek
    assert_eq!(report.swapped_out, report.swapped_in, "{report:?}");
    assert_ne!(session.phase(), SessionPhase::Stable); // the departed iteration warmed up
    for i in 0..3 {
        run(&mut session, 300 + i * 10, false, false);
    }
    assert_eq!(session.phase(), SessionPhase::Stable);
    drop(session);
    assert_eq!(pool.stats().swapped_bytes.current, 0);
    pool.check_invariants().unwrap();
}

/// One driver call failing anywhere in a session's life (each call of each kind, in turn):
/// its creation, the warm-up iteration that profiles (timed events), the iteration planned
/// from it, a stable one, and the session's drop. The hook that made the call returns the
/// error, a retry of that hook completes, no byte is lost, the pool stays consistent, the next
/// iteration runs clean, and dropping everything leaves no physical memory, mapping or
/// reservation behind (nor a stream, unless ending it is what failed). Every call site the
/// inventory gives this sweep is failed.
#[test]
fn a_session_survives_any_driver_failure_in_its_life() {
    use glake::device::fault::FaultDevice;
    use glake::device::{CallKind, SharedDevice, Stream};
    use glake::smartswap::{Session, SessionPhase};
    use glake::{Config, Pool};
    use std::sync::Arc;

    const LAYERS: usize = 4;
    let act = 4 * MIB;
    let s = Stream::DEFAULT;
    // Runs one iteration; every hook that fails is retried (each planned failure fires once,
    // and at most two are planned). Returns the errors seen.
    fn retry<T>(errors: &mut Vec<String>, mut f: impl FnMut() -> glake::Result<T>) -> T {
        for _ in 0..2 {
            match f() {
                Ok(value) => return value,
                Err(err) => errors.push(err.to_string()),
            }
        }
        f().expect("the retry completes")
    }
    let iteration = |session: &mut Session, pool: &Pool, device: &SharedDevice, seed: u64| {
        let mut errors = Vec::new();
        retry(&mut errors, || session.begin_iteration());
        session.set_phase(Phase::Forward);
        let mut acts = Vec::new();
        for layer in 0..LAYERS {
            retry(&mut errors, || session.begin_op("layer", s));
            let a = retry(&mut errors, || pool.malloc(act, s));
            retry(&mut errors, || session.tensor(a, act));
            common::write_pattern(device, a, act, seed + layer as u64);
            retry(&mut errors, || session.end_op());
            acts.push(a);
        }
        session.set_phase(Phase::Backward);
        for layer in (0..LAYERS).rev() {
            retry(&mut errors, || session.begin_op("layer_grad", s));
            retry(&mut errors, || session.tensor(acts[layer], act));
            assert!(
                common::has_pattern(device, acts[layer], act, seed + layer as u64),
                "layer {layer} lost bytes; errors {errors:?}"
            );
            retry(&mut errors, || pool.free(acts[layer]));
            retry(&mut errors, || session.end_op());
        }
        retry(&mut errors, || session.end_iteration());
        errors
    };
    // A pool on a fault device; the test's own reads and writes go to the device underneath
    // (`device`): no failure is planned for them, and they are not counted.
    let setup = || {
        let host = common::host_device(1 << 30);
        let fault = Arc::new(FaultDevice::new(host.clone()));
        let faulty: SharedDevice = fault.clone();
        let pool = Arc::new(Pool::new(faulty, Config::default()).unwrap());
        let device: SharedDevice = host.clone();
        (host, fault, device, pool)
    };
    // The session's life up to its drop, with the failure planned by `plan` first; returns
    // the session, the errors seen and the calls of each kind made.
    let life = |fault: &FaultDevice,
                pool: &Arc<Pool>,
                device: &SharedDevice,
                plan: &dyn Fn(&FaultDevice)| {
        let before: Vec<u64> = CallKind::ALL.iter().map(|&k| fault.calls(k)).collect();
        plan(fault);
        let mut errors = Vec::new();
        let mut session = retry(&mut errors, || {
            Session::new(pool.clone(), settings(LAYERS * act / 2))
        });
        for seed in 0..3 {
            errors.extend(iteration(&mut session, pool, device, seed * 10));
        }
        let made: Vec<(CallKind, u64)> = CallKind::ALL
            .iter()
            .zip(before)
            .map(|(&k, b)| (k, fault.calls(k) - b))
            .filter(|&(_, n)| n > 0)
            .collect();
        (session, errors, made)
    };
    let mut swept = common::sites::Swept::new("smartswap");
    let (mut swept_runs, mut fired) = (0, 0);
    // A clean run counts the calls of the life and of the drop.
    let (host, fault, device, pool) = setup();
    let (mut session, errors, counts) = life(&fault, &pool, &device, &|_| {});
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(session.phase(), SessionPhase::Stable);
    assert!(iteration(&mut session, &pool, &device, 30).is_empty());
    assert!(session.report().swapped_out > 0);
    let drop_counts = common::calls_made(&fault, || drop(session));
    drop(pool);
    assert_eq!(host.live_streams(), 1);
    // The `n`-th call of `kind` failing (and the `then`-th call after it): returns the fault
    // device and whether the failure could fire.
    let one = |kind: CallKind, n: u64, then: Option<u64>, total: u64| {
        let (host, fault, device, pool) = setup();
        let (mut session, errors, made) = life(&fault, &pool, &device, &|f| {
            f.fail_nth(kind, n);
            if let Some(j) = then {
                f.fail_after_failure(j);
            }
        });
        let what = format!("{kind:?} call {n} of {total} (then call {then:?} after it)");
        // How many waits and queries the life makes depends on when copies finish: a
        // failure planned past the calls this run made cannot fire.
        let made = made.iter().find(|m| m.0 == kind).map_or(0, |m| m.1);
        assert!(
            fault.injected() > 0 || made < n,
            "{what}: the failure did not fire ({made} calls)"
        );
        fault.clear();
        pool.check_invariants()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let errors_after = iteration(&mut session, &pool, &device, 200);
        assert!(errors_after.is_empty(), "{what}: {errors_after:?}");
        drop(session);
        assert_eq!(pool.stats().swapped_bytes.current, 0, "{what}");
        drop(pool);
        assert_eq!(host.live_objects(), (0, 0, 0), "{what}: {errors:?}");
        assert_eq!(host.created_bytes(), 0, "{what}");
        // A stream whose destroy failed is left (a session being made gives up on it).
        let failed: Vec<CallKind> = fault.sites_failed().iter().map(|s| s.kind).collect();
        if !failed.contains(&CallKind::DestroyStream) {
            assert_eq!(host.live_streams(), 1, "{what}: streams left");
        }
        fault
    };
    for &(kind, total) in &counts {
        for n in 1..=total {
            let fault = one(kind, n, None, total);
            fired += fault.injected();
            swept.add(&fault);
            swept_runs += 1;
            // The clean-up of the failure failing too.
            if !fault.calls_after_failure().is_empty() {
                let fault = one(kind, n, Some(1), total);
                swept.add(&fault);
            }
        }
    }
    // The drop: its waits and the ends of the copy streams and of the profiler's events.
    for &(kind, total) in &drop_counts {
        for n in 1..=total {
            let (host, fault, device, pool) = setup();
            let (mut session, _, _) = life(&fault, &pool, &device, &|_| {});
            assert!(iteration(&mut session, &pool, &device, 30).is_empty());
            fault.fail_nth(kind, n);
            drop(session);
            let what = format!("{kind:?} call {n} of {total} of the drop");
            assert_eq!(fault.injected(), 1, "{what}: did not fire");
            fired += 1;
            fault.clear();
            swept.add(&fault);
            pool.check_invariants()
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(pool.stats().swapped_bytes.current, 0, "{what}");
            drop(pool);
            assert_eq!(host.live_objects(), (0, 0, 0), "{what}");
            assert_eq!(host.created_bytes(), 0, "{what}");
            // A copy stream that cannot be waited for is not destroyed (a copy may still run
            // on it); a failed destroy leaves its stream too.
            if !matches!(kind, CallKind::SynchronizeStream | CallKind::DestroyStream) {
                assert_eq!(host.live_streams(), 1, "{what}: streams left");
            }
            swept_runs += 1;
        }
    }
    println!("{swept_runs} failures planned, {fired} fired, over {counts:?} and {drop_counts:?}");
    assert!(
        fired > 10 && fired * 10 >= swept_runs * 9,
        "{fired} of {swept_runs} fired"
    );
    swept.assert_covers(None);
}

mod random_loops {
    //! Sessions under random training loops, some of which misbehave: layers of random sizes,
    //! iterations that change shape, skipped or extra hooks, hooks out of order, tensors
    //! touched at random. Whatever the hooks return, nothing panics, every activation read
    //! after a touch holds its bytes, the pool stays consistent, and dropping the session
    //! leaves nothing swapped out.
    use super::{common, settings, MIB};
    use glake::device::Stream;
    use glake::smartswap::Session;
    use glake::swap::Phase;
    use glake::{Config, Pool};
    use proptest::prelude::*;
    use std::sync::Arc;

    #[derive(Debug, Clone)]
    struct Iteration {
        /// Activation sizes in MiB, one per layer.
        layers: Vec<usize>,
        /// Layer whose activation an extra op touches in the middle of the forward.
        peek: Option<usize>,
        /// An op begun and never ended, or ended twice.
        stray_end: bool,
        stray_begin: bool,
    }

    fn iteration() -> impl Strategy<Value = Iteration> {
        (
            prop::collection::vec(1usize..6, 2..6),
            prop::option::of(0usize..6),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(layers, peek, stray_end, stray_begin)| Iteration {
                layers,
                peek,
                stray_end,
                stray_begin,
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::with_cases(24) })]

        #[test]
        fn sessions_survive_random_loops(
            fraction in 30usize..90,
            repeat in 1usize..4,
            iterations in prop::collection::vec(iteration(), 1..4),
        ) {
            let device = common::device();
            let pool = Arc::new(Pool::new(device.clone(), Config::default()).unwrap());
            let s = Stream::DEFAULT;
            let peak: usize = iterations.iter().map(|i| i.layers.iter().sum::<usize>()).max()
                .unwrap_or(1) * MIB;
            let mut session = Session::new(pool.clone(), settings(peak * fraction / 100)).unwrap();
            let mut seed = 0u64;
            // Each shape runs several times, so sessions reach their plans and then see the
            // shape change.
            for it in iterations.iter().flat_map(|i| std::iter::repeat_n(i, repeat + 2)) {
                let _ = session.begin_iteration();
                session.set_phase(Phase::Forward);
                let mut acts = Vec::new();
                for (layer, &mib) in it.layers.iter().enumerate() {
                    let _ = session.begin_op("layer", s);
                    let a = pool.malloc(mib * MIB, s).unwrap();
                    let _ = session.tensor(a, mib * MIB);
                    seed += 1;
                    common::write_pattern(&device, a, mib * MIB, seed);
                    let _ = session.end_op();
                    acts.push((a, mib * MIB, seed));
                    if it.peek == Some(layer) {
                        let _ = session.begin_op("peek", s);
                        let (p, len, sd) = acts[0];
                        if session.tensor(p, len).is_ok() {
                            prop_assert!(common::has_pattern(&device, p, len, sd));
                        }
                        let _ = session.end_op();
                    }
                }
                if it.stray_end {
                    let _ = session.end_op();
                }
                if it.stray_begin {
                    let _ = session.begin_op("stray", s);
                }
                session.set_phase(Phase::Backward);
                for &(a, len, sd) in acts.iter().rev() {
                    let _ = session.begin_op("layer_grad", s);
                    if session.tensor(a, len).is_ok() {
                        prop_assert!(common::has_pattern(&device, a, len, sd));
                    }
                    pool.free(a).unwrap();
                    let _ = session.end_op();
                }
                let _ = session.end_iteration();
                prop_assert!(pool.check_invariants().is_ok());
            }
            drop(session);
            prop_assert_eq!(pool.stats().swapped_bytes.current, 0);
            pool.empty_cache().unwrap();
            prop_assert_eq!(pool.stats().reserved_bytes.all.current, 0);
        }
    }
}
