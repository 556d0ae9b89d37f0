//! SmartSwap's profiler on the backend under test: op hooks with device times from timed
//! events, and the pool's allocations, recorded into the planner's profile.

mod common;

use glake::smartswap::Profiler;
use glake::swap::{Phase, TensorKind};
use glake::ErrorKind;

const MIB: usize = 1 << 20;

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
