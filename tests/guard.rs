//! Guard-page mode on the host backend: every allocation ends where an unmapped range begins,
//! so a write one byte past its end faults at once (SIGSEGV, in a child process) after a line
//! naming the allocation; in-bounds use, frees, statistics and lookups work as without it.

mod common;

use std::process::Command;

use common::{check, has_pattern, host_device, write_pattern};
use glake::config::Config;
use glake::device::{DevicePtr, SharedDevice, Stream};
use glake::{ErrorKind, Pool};

const MIB: usize = 1 << 20;
const S: Stream = Stream::DEFAULT;
/// Set in the child processes the fault tests start.
const CHILD: &str = "GLAKE_GUARD_TEST_CHILD";

fn guarded_pool() -> (SharedDevice, Pool) {
    let device: SharedDevice = host_device(256 * MIB);
    let config = Config {
        guard: true,
        ..Config::default()
    };
    let pool = Pool::new(device.clone(), config).expect("pool");
    (device, pool)
}

#[test]
fn allocations_end_at_their_guard_and_behave_as_usual() {
    let (device, pool) = guarded_pool();
    let sizes = [1024, 1000, 3 * MIB, 1];
    let ptrs: Vec<DevicePtr> = sizes
        .iter()
        .map(|&n| pool.malloc(n, S).expect("malloc"))
        .collect();
    for (i, (&p, &n)) in ptrs.iter().zip(&sizes).enumerate() {
        assert_eq!(p % 256, 0, "aligned as the driver's allocations");
        write_pattern(&device, p, n, i as u64);
        // Every byte up to the 256-byte boundary is usable; the byte after it is the guard's.
        let end = p as usize + n.next_multiple_of(256);
        let info = pool
            .allocation_of(p + n as u64 - 1)
            .expect("an interior pointer");
        assert_eq!(info.base, p);
        assert_eq!(
            info.base as usize + info.size,
            end,
            "the allocation ends at its guard"
        );
        assert_eq!(info.requested, n);
        assert!(
            pool.allocation_of(end as u64).is_none(),
            "the guard is nobody's"
        );
    }
    for (i, (&p, &n)) in ptrs.iter().zip(&sizes).enumerate() {
        assert!(has_pattern(&device, p, n, i as u64));
    }
    let stats = pool.stats();
    assert_eq!(stats.allocation.all.current, 4);
    let stream = device.create_stream().expect("stream");
    pool.record_stream(ptrs[0], stream).expect("record_stream");
    // The start of a guarded allocation's memory is not a pointer anyone was given.
    let base = ptrs[1] & !(2 * MIB as u64 - 1);
    assert_ne!(base, ptrs[1]);
    assert_eq!(
        pool.free(base).expect_err("not handed out").kind(),
        ErrorKind::InvalidPointer
    );
    assert!(pool.record_stream(base, S).is_err());
    assert!(pool.allocation_of(base).is_none());
    assert!(!pool.free_if_owned(base).expect("asked"));
    // Misuse is refused as without guards.
    assert_eq!(
        pool.free(ptrs[2] + 8).expect_err("interior").kind(),
        ErrorKind::InvalidPointer
    );
    // A stream destroyed since it used the allocation: the free waits for the device instead,
    // frees, and says so.
    device.destroy_stream(stream).expect("destroy");
    let err = pool.free(ptrs[0]).expect_err("its stream is gone");
    assert!(err.to_string().contains("the allocation is freed"), "{err}");
    assert!(pool.allocation_of(ptrs[0]).is_none());
    for p in &ptrs[1..] {
        pool.free(*p).expect("free");
    }
    assert!(pool.free(ptrs[0]).is_err(), "a second free");
    check(&pool);
    // Freed memory goes back at once: a use after free would fault too.
    assert_eq!(pool.stats().reserved_bytes.all.current, 0);
}

#[test]
fn regions_and_swappable_allocations_keep_their_own_placement() {
    let (_device, pool) = guarded_pool();
    pool.begin_region("w").expect("begin");
    let in_region = pool.malloc(1000, S).expect("region");
    pool.end_region().expect("end");
    assert_eq!(
        pool.region_info("w").expect("w").allocated_bytes,
        1000usize.next_multiple_of(512)
    );
    let swappable = pool.malloc_swappable(MIB, S).expect("swappable");
    pool.swap_out(swappable).expect("swap out");
    pool.swap_in(swappable).expect("swap in");
    for p in [in_region, swappable] {
        pool.free(p).expect("free");
    }
    check(&pool);
}

/// Runs test `name` of this binary in a child process that does what the parent's test asks
/// (`what`), and returns its exit status and stderr.
fn child(name: &str, what: &str) -> (std::process::ExitStatus, String) {
    let out = Command::new(std::env::current_exe().expect("this test binary"))
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, what)
        .output()
        .expect("the child runs");
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The child's side of the fault tests: makes a guarded allocation of 1000 bytes, writes all
/// of it, then does what the parent asked. Does nothing in an ordinary test run.
#[test]
fn guard_child() {
    let Ok(what) = std::env::var(CHILD) else {
        return;
    };
    let (_device, pool) = guarded_pool();
    let p = pool.malloc(1000, S).expect("malloc") as *mut u8;
    // SAFETY: in bounds (the host backend's memory is this process's).
    unsafe { std::ptr::write_bytes(p, 7, 1024) };
    eprintln!("in bounds: fine");
    match what.as_str() {
        // SAFETY: deliberately not: the fault is what the parent checks.
        "overrun" => unsafe { std::ptr::write_volatile(p.add(1024), 1) },
        "after-free" => {
            pool.free(p as DevicePtr).expect("free");
            // SAFETY: deliberately not.
            unsafe { std::ptr::write_volatile(p, 1) }
        }
        _ => {}
    }
    eprintln!("no fault");
}

#[cfg(unix)]
#[test]
fn a_write_past_the_end_faults_at_once_and_names_the_allocation() {
    use std::os::unix::process::ExitStatusExt;
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let (status, stderr) = child("guard_child", "overrun");
    assert_eq!(status.signal(), Some(libc::SIGSEGV), "{status:?}: {stderr}");
    assert!(stderr.contains("in bounds: fine"), "{stderr}");
    assert!(!stderr.contains("no fault"), "{stderr}");
    assert!(
        stderr.contains("out-of-bounds access")
            && stderr.contains("25 bytes past the end of guarded allocation #1 of 1000 bytes"),
        "{stderr}"
    );
    let (status, stderr) = child("guard_child", "after-free");
    assert_eq!(
        status.signal(),
        Some(libc::SIGSEGV),
        "a use after free: {stderr}"
    );
    let (status, stderr) = child("guard_child", "nothing");
    assert!(status.success(), "in-bounds use: {stderr}");
    assert!(stderr.contains("no fault"), "{stderr}");
}

/// One life of a guarded pool on a fault device over a 256 MiB host device, with `plan` made
/// first: guarded allocations, one used on a second stream, freed (each free retried while it
/// reports an error and the allocation is still live), the cache emptied, the pool dropped.
/// Bytes of live allocations stay intact, the pool stays consistent, and nothing is left.
fn guarded_life(
    what: &str,
    plan: impl FnOnce(&glake::device::fault::FaultDevice),
) -> std::sync::Arc<glake::device::fault::FaultDevice> {
    use glake::device::fault::FaultDevice;
    use std::sync::Arc;
    let host = host_device(256 * MIB);
    let raw: SharedDevice = host.clone();
    let fault = Arc::new(FaultDevice::new(raw.clone()));
    let side = raw.create_stream().expect("stream");
    let config = Config {
        guard: true,
        ..Config::default()
    };
    // Each call is tried up to three times: at most two failures are planned.
    fn thrice<T>(f: impl Fn() -> glake::Result<T>) -> glake::Result<T> {
        f().or_else(|_| f()).or_else(|_| f())
    }
    plan(&fault);
    let pool = thrice(|| Pool::new(fault.clone(), config.clone()))
        .unwrap_or_else(|e| panic!("{what}: the pool: {e}"));
    let mut live = Vec::new();
    for (i, n) in [1000, 3 * MIB, 64].into_iter().enumerate() {
        let p = thrice(|| pool.malloc(n, S)).unwrap_or_else(|e| panic!("{what}: malloc: {e}"));
        write_pattern(&raw, p, n, i as u64);
        live.push((p, n, i as u64));
    }
    thrice(|| pool.record_stream(live[0].0, side))
        .unwrap_or_else(|e| panic!("{what}: record_stream: {e}"));
    while let Some((p, _, _)) = live.pop() {
        for &(q, m, s) in &live {
            assert!(has_pattern(&raw, q, m, s), "{what}: bytes lost");
        }
        for _ in 0..3 {
            if pool.free(p).is_ok() || pool.allocation_of(p).is_none() {
                break;
            }
        }
        assert!(pool.allocation_of(p).is_none(), "{what}: {p:#x} not freed");
        pool.check_invariants()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
    }
    thrice(|| pool.empty_cache()).unwrap_or_else(|e| panic!("{what}: empty_cache: {e}"));
    assert_eq!(pool.stats().reserved_bytes.all.current, 0, "{what}");
    drop(pool);
    fault.clear();
    assert_eq!(
        host.live_objects(),
        (0, 0, 0),
        "{what}: driver objects left"
    );
    assert_eq!(host.created_bytes(), 0, "{what}");
    raw.destroy_stream(side).expect("destroy");
    fault
}

/// Each driver call of a guarded pool's life failing in turn, and each call right after a
/// failure (a free whose stream cannot be waited for waits for the device instead: that wait
/// failing too). Every call site the inventory gives this sweep is failed.
#[test]
fn a_fault_at_each_driver_call_of_a_guarded_pool_loses_nothing() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let mut swept = common::sites::Swept::new("guard");
    let clean = guarded_life("clean", |_| {});
    let calls: Vec<(glake::device::CallKind, u64)> = glake::device::CallKind::ALL
        .iter()
        .map(|&k| (k, clean.calls(k)))
        .filter(|&(_, n)| n > 0)
        .collect();
    common::sweep_every_call(
        "guarded pool",
        &calls,
        &[glake::device::CallKind::SynchronizeStream],
        1,
        &mut swept,
        |kind, n, then| {
            let what = format!("{kind:?} call {n} (then call {then:?} after it)");
            guarded_life(&what, |f| {
                f.fail_nth(kind, n);
                if let Some(j) = then {
                    f.fail_after_failure(j);
                }
            })
        },
    );
    swept.assert_covers(None);
}

/// A request its caller rounded up ends at its guard after the bytes asked for: the rounding
/// would hide a write past them.
#[test]
fn a_rounded_request_ends_at_its_guard_after_the_bytes_asked_for() {
    let (_device, pool) = guarded_pool();
    let asked = 5 * MIB + 100;
    let p = pool.malloc_asked(8 * MIB, asked, S, None).expect("malloc");
    let end = p as usize + asked.next_multiple_of(256);
    let info = pool.allocation_of(p).expect("its allocation");
    assert_eq!(
        info.base as usize + info.size,
        end,
        "the guard follows the asked bytes"
    );
    assert_eq!(info.requested, asked);
    assert_eq!(pool.stats().requested_bytes.all.current as usize, asked);
    pool.free(p).expect("free");
    check(&pool);
}

/// A guarded allocation freed while a capture may be underway: its wait for the streams and
/// its unmap would end the capture, so the free waits for the capture's end; a second free
/// meanwhile is a double free, and nothing is lost.
#[test]
fn a_guarded_free_during_a_capture_waits_for_its_end() {
    use glake::device::fault::FaultDevice;
    use glake::device::CallKind;
    use std::sync::Arc;
    let fault = Arc::new(FaultDevice::new(host_device(256 * MIB)));
    let device: SharedDevice = fault.clone();
    let config = Config {
        guard: true,
        ..Config::default()
    };
    let pool = Pool::new(device.clone(), config).expect("pool");
    let a = pool.malloc(MIB, S).unwrap();
    let id = (7, 7);
    pool.begin_private(id);
    let calls = common::calls_made(&fault, || pool.free(a).unwrap());
    let teardown = [
        CallKind::SynchronizeStream,
        CallKind::SynchronizeDevice,
        CallKind::Unmap,
        CallKind::ReleasePhysical,
        CallKind::Unreserve,
    ];
    assert!(
        calls.iter().all(|(kind, _)| !teardown.contains(kind)),
        "a wait or teardown during a capture: {calls:?}"
    );
    assert_eq!(pool.free(a).unwrap_err().kind(), ErrorKind::DoubleFree);
    let calls = common::calls_made(&fault, || pool.end_private(id).unwrap());
    assert!(
        calls.iter().any(|(kind, _)| *kind == CallKind::Unmap),
        "the free made at the capture's end: {calls:?}"
    );
    // Freed and unmapped now: its address is no allocation of the pool.
    assert!(pool.free(a).is_err());
    pool.release_private(id).unwrap();
    check(&pool);
    pool.empty_cache().unwrap();
    assert_eq!(pool.stats().reserved_bytes.all.current, 0);
}
