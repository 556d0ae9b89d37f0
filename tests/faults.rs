//! Fault injection: every driver call the pool makes is failed in turn, one run per call.
//!
//! A fixed, deterministic workload (small and large allocations, frees that fragment, a stitch,
//! reuse of a cached stitched block, a stitch with new memory that triggers automatic collection
//! of cached stitched blocks, `record_stream` on a second stream, peer access, a tight memory cap
//! that forces the free-and-retry path, an out-of-memory request, `empty_cache`, and the final
//! tear-down) runs on a [`FaultDevice`] over a host device. A clean run first counts the calls of
//! each kind; then for each kind and each n up to that count, a fresh run fails the n-th call.
//!
//! After every step the pool's invariants hold, every live allocation still holds its bytes, the
//! statistics match the live allocations, and the device holds at least the objects the pool
//! books (exactly those in a clean run). At the end everything is freed, the pool is dropped, and
//! the host device must hold no physical memory, mapping or reservation, and every event created
//! must have been destroyed. A failure that fired must be reported as an error by a pool call of
//! the step in which it fired, except on the paths that deliberately keep quiet:
//!
//! * `Unmap`, `ReleasePhysical` and `Unreserve` are only called to tear down driver objects
//!   (released segments,
//!   collected stitched ranges, and the undo of a failed stitch). A failure there keeps the object
//!   as a "zombie" that `empty_cache` (and so the free-and-retry path and the tear-down) retries,
//!   so it is never lost; the retry succeeds, and nothing is reported.
//! * The automatic collection of cached stitched blocks after a successful stitch waits for the
//!   device first; if that wait fails the collection is skipped (logged) and the allocation,
//!   which did succeed, returns its pointer. So a `SynchronizeDevice` failure in a step whose
//!   clean run collected automatically may go unreported.
//! * Anything that fails while the pool is dropped: `Drop` cannot return an error, so it logs;
//!   the tear-down gives what it could not release a second pass, so one failure leaks nothing.
//! * A stream's fence (an event each stitch records and queries, so that small-handle segments
//!   freed before it may be gathered): a failure there only postpones gathering, and is logged.
//!
//! Each call of a kind is also failed right after another call failed (each call of the clean
//! run failing in turn, and the call after it of this kind failing too): the clean-up of a
//! failure failing, e.g. the device-wide wait a free falls back on when its stream event cannot
//! be recorded. Then the sweep checks that it failed every call site that
//! `tests/device_call_sites.txt` gives this binary for the kind.
//!
//! Further tests drop a busy pool (live plain and stitched allocations, a pending free) with each
//! tear-down call failing in turn, and make the driver report out of memory at each creation of
//! physical memory (the pool must free its cache and retry, or report out of memory).

mod common;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use glake::config::Config;
use glake::device::fault::FaultDevice;
use glake::device::host::{HostDevice, HostOptions};
use glake::device::{CallKind, DevicePtr, SharedDevice, Stream};
use glake::pool::blocks::PoolKind;
use glake::pool::snapshot::BlockUse;
use glake::stats::MemoryStats;
use glake::{ErrorKind, Pool};

const MIB: usize = 1 << 20;
const TOTAL: usize = 256 * MIB;

/// Call kinds the workload must make (the pool's whole use of the device).
const USED: [CallKind; 13] = [
    CallKind::Reserve,
    CallKind::Unreserve,
    CallKind::CreatePhysical,
    CallKind::ReleasePhysical,
    CallKind::Map,
    CallKind::Unmap,
    CallKind::SetAccess,
    CallKind::CreateEvent,
    CallKind::DestroyEvent,
    CallKind::RecordEvent,
    CallKind::QueryEvent,
    CallKind::SynchronizeDevice,
    CallKind::MemInfo,
];

#[derive(Debug, Clone, Copy)]
struct Live {
    ptr: DevicePtr,
    size: usize,
    seed: u64,
}

/// What one step did, for the clean run's record.
#[derive(Debug, Clone)]
struct StepRecord {
    name: &'static str,
    /// The step stitched and then collected cached stitched blocks automatically.
    auto_collected: bool,
    /// Statistics after the step.
    stats: Option<MemoryStats>,
    /// Errors pool calls returned during the step.
    errors: Vec<String>,
}

struct Run {
    fault: Arc<FaultDevice>,
    host: Arc<HostDevice>,
    /// The host device itself: patterns are written and read past the fault wrapper.
    bytes: SharedDevice,
    pool: Option<Pool>,
    side: Stream,
    live: Vec<Live>,
    next_seed: u64,
    /// Messages of the errors pool calls returned.
    errors: Vec<String>,
    steps: Vec<StepRecord>,
    /// The step during which the injected failure fired.
    fault_step: Option<usize>,
}

impl Run {
    fn new(plan: Option<(CallKind, u64)>) -> Run {
        let host = Arc::new(
            HostDevice::new(
                0,
                HostOptions {
                    total_memory: TOTAL,
                    device_count: 2,
                    ..HostOptions::default()
                },
            )
            .expect("host device"),
        );
        let bytes: SharedDevice = host.clone();
        let side = bytes.create_stream().expect("create_stream");
        let fault = Arc::new(FaultDevice::new(bytes.clone()));
        if let Some((kind, n)) = plan {
            fault.fail_nth(kind, n);
        }
        Run {
            fault,
            host,
            bytes,
            pool: None,
            side,
            live: Vec::new(),
            next_seed: 0,
            errors: Vec::new(),
            steps: Vec::new(),
            fault_step: None,
        }
    }

    fn report(&mut self, what: &str, result: glake::Result<()>) {
        if let Err(err) = result {
            self.errors.push(format!("{what}: {err}"));
        }
    }

    /// Runs one step, then checks the pool.
    fn step(&mut self, name: &'static str, f: impl FnOnce(&mut Run)) {
        let injected = self.fault.injected();
        let before = self.pool.as_ref().map(|p| p.stats());
        let errors_before = self.errors.len();
        f(self);
        if injected == 0 && self.fault.injected() > 0 {
            self.fault_step = Some(self.steps.len());
        }
        let after = self.pool.as_ref().map(|p| p.stats());
        let auto_collected = match (before, after) {
            (Some(b), Some(a)) => {
                a.stitches > b.stitches && a.stitch_collections > b.stitch_collections
            }
            _ => false,
        };
        self.steps.push(StepRecord {
            name,
            auto_collected,
            stats: after,
            errors: self.errors[errors_before..].to_vec(),
        });
        self.check(name);
    }

    fn check(&self, step: &str) {
        let Some(pool) = &self.pool else { return };
        if let Err(err) = pool.check_invariants() {
            panic!("after {step}: {err}");
        }
        // The pool's books against the device's objects: equal in a clean run; a failed
        // tear-down may leave extra objects on the device (kept to retry), never fewer.
        let snap = pool.snapshot();
        // One physical handle and one mapping per chunk of each segment; one mapping per
        // handle mapped into each stitched range.
        let segment_chunks: usize = snap.segments.iter().map(|s| s.chunk_sizes.len()).sum();
        let stitched_handles: usize = snap.stitched.iter().map(|s| s.handle_count).sum();
        let pool_objects = (
            segment_chunks,
            segment_chunks + stitched_handles,
            snap.segments.len() + snap.stitched.len(),
        );
        let device_objects = self.host.live_objects();
        let reserved = snap.stats.reserved_bytes.all.current as usize;
        let created = self.host.created_bytes();
        if self.fault.injected() == 0 {
            assert_eq!(
                (device_objects, created),
                (pool_objects, reserved),
                "after {step}: (chunks, mappings, reservations) and bytes of the device and pool"
            );
        } else {
            assert!(
                device_objects.0 >= pool_objects.0
                    && device_objects.1 >= pool_objects.1
                    && device_objects.2 >= pool_objects.2
                    && created >= reserved,
                "after {step}: the device holds {device_objects:?} objects and {created} bytes, \
                 the pool {pool_objects:?} and {reserved}"
            );
        }
        for l in &self.live {
            assert!(
                common::has_pattern(&self.bytes, l.ptr, l.size, l.seed),
                "after {step}: the bytes of {:#x} ({} bytes) changed",
                l.ptr,
                l.size
            );
        }
        let stats = pool.stats();
        assert_eq!(
            stats.allocation.all.current,
            self.live.len() as i64,
            "after {step}: allocations"
        );
        assert_eq!(
            stats.requested_bytes.all.current,
            self.live.iter().map(|l| l.size as i64).sum::<i64>(),
            "after {step}: requested bytes"
        );
    }

    fn malloc(&mut self, size: usize, stream: Stream) -> Option<DevicePtr> {
        let pool = self.pool.as_ref()?;
        match pool.malloc(size, stream) {
            Ok(ptr) => {
                self.next_seed += 1;
                common::write_pattern(&self.bytes, ptr, size, self.next_seed);
                self.live.push(Live {
                    ptr,
                    size,
                    seed: self.next_seed,
                });
                Some(ptr)
            }
            Err(err) => {
                self.errors.push(format!("malloc({size}): {err}"));
                None
            }
        }
    }

    fn free(&mut self, ptr: Option<DevicePtr>) {
        let (Some(pool), Some(ptr)) = (&self.pool, ptr) else {
            return;
        };
        let result = pool.free(ptr);
        // A free that reports an error may still have taken effect (the memory is returned
        // once the device is idle); the pool says which.
        let still_live = pool.allocation_of(ptr).is_some_and(|a| a.base == ptr);
        if result.is_ok() {
            assert!(!still_live, "{ptr:#x} is live after its free");
        }
        if !still_live {
            self.live.retain(|l| l.ptr != ptr);
        }
        self.report("free", result);
    }

    fn record_stream(&mut self, ptr: Option<DevicePtr>, stream: Stream) {
        let (Some(pool), Some(ptr)) = (&self.pool, ptr) else {
            return;
        };
        let result = pool.record_stream(ptr, stream);
        self.report("record_stream", result);
    }

    fn empty_cache(&mut self) {
        if let Some(pool) = &self.pool {
            let result = pool.empty_cache();
            self.report("empty_cache", result);
        }
    }

    fn set_memory_cap(&mut self, bytes: usize) {
        if let Some(pool) = &self.pool {
            let result = pool.set_memory_fraction((bytes as f64 / TOTAL as f64).min(1.0));
            self.report("set_memory_fraction", result);
        }
    }

    /// The workload. Each step tolerates the failure of any earlier one.
    fn workload(&mut self) {
        let s0 = Stream::DEFAULT;
        let side = self.side;
        let config = Config {
            auto_gc_bytes: 24 * MIB,
            ..Config::default()
        };
        self.step("create the pool", |r| {
            match Pool::new(r.fault.clone() as SharedDevice, config) {
                Ok(pool) => r.pool = Some(pool),
                Err(err) => r.errors.push(format!("Pool::new: {err}")),
            }
        });
        let mut small = Vec::new();
        self.step("small allocations", |r| {
            for size in [100, 512, 3000, 70_000, MIB, 200, 4096] {
                small.push(r.malloc(size, s0));
            }
        });
        let mut large = Vec::new();
        self.step("large allocations", |r| {
            for _ in 0..8 {
                large.push(r.malloc(4 * MIB, s0));
            }
        });
        self.step("peer access", |r| {
            if let Some(pool) = &r.pool {
                let result = pool.enable_peer_access(1);
                r.report("enable_peer_access", result);
            }
        });
        self.step("fragment", |r| {
            for &ptr in large.iter().step_by(2) {
                r.free(ptr);
            }
        });
        let mut stitched = None;
        self.step("stitch", |r| stitched = r.malloc(12 * MIB, s0));
        self.step("free the stitched block", |r| r.free(stitched));
        self.step("reuse the stitched block", |r| {
            stitched = r.malloc(12 * MIB, s0)
        });
        self.step("free it again", |r| r.free(stitched));
        self.step("stitch with new memory, collect", |r| {
            stitched = r.malloc(20 * MIB, s0)
        });
        self.step("free the grown stitched block", |r| r.free(stitched));
        let mut used_elsewhere = None;
        self.step("record_stream, free", |r| {
            used_elsewhere = r.malloc(6 * MIB, s0);
            r.record_stream(used_elsewhere, side);
            r.record_stream(small[1], side);
            r.free(used_elsewhere);
            r.free(small[1]);
            // The side stream has no work: its events complete now, so the next malloc sees them
            // complete on every run.
            r.bytes
                .synchronize_stream(side)
                .expect("synchronize_stream");
        });
        let mut on_side = None;
        self.step("allocate after pending frees", |r| {
            on_side = r.malloc(2 * MIB, side);
        });
        self.step("free on the side stream", |r| {
            r.free(on_side);
            let tmp = r.malloc(8 * MIB, side);
            r.free(tmp);
        });
        self.step("free the small allocations", |r| {
            for (i, &ptr) in small.iter().enumerate() {
                if i != 1 {
                    r.free(ptr);
                }
            }
        });
        self.step("retry under a tight cap", |r| {
            let Some(pool) = &r.pool else { return };
            let snap = pool.snapshot();
            let reserved = snap.stats.reserved_bytes.all.current as usize;
            let slack = 2 * MIB;
            let free_large: usize = snap
                .segments
                .iter()
                .filter(|s| s.pool == PoolKind::Large)
                .flat_map(|s| &s.blocks)
                .filter(|b| b.state == BlockUse::Free)
                .map(|b| b.size)
                .sum();
            let idle_small: usize = snap
                .segments
                .iter()
                .filter(|s| s.pool == PoolKind::Small && s.allocated_size == 0)
                .map(|s| s.total_size)
                .sum();
            r.set_memory_cap(reserved + slack);
            // More than the free large blocks and the slack together: only releasing the idle
            // small segments makes room.
            r.malloc(free_large + slack + idle_small, s0);
        });
        self.step("out of memory", |r| {
            r.malloc(TOTAL - 2 * MIB, s0);
            r.set_memory_cap(TOTAL);
        });
        self.step("stitch again", |r| {
            let a = r.malloc(4 * MIB, s0);
            let b = r.malloc(4 * MIB, s0);
            let c = r.malloc(4 * MIB, s0);
            r.free(a);
            r.free(c);
            let d = r.malloc(8 * MIB, s0);
            r.free(b);
            r.free(d);
        });
        self.step("empty_cache", |r| r.empty_cache());
        self.step("free everything", |r| {
            let ptrs: Vec<DevicePtr> = r.live.iter().map(|l| l.ptr).collect();
            for ptr in ptrs {
                r.free(Some(ptr));
            }
        });
        self.step("final empty_cache", |r| r.empty_cache());
        self.step("drop the pool", |r| drop(r.pool.take()));
    }

    /// The leak checks, after the pool is gone.
    fn assert_nothing_left(&self, what: &str) {
        assert!(self.pool.is_none());
        assert_eq!(
            self.host.live_objects(),
            (0, 0, 0),
            "{what}: chunks, mappings, reservations left"
        );
        assert_eq!(self.host.created_bytes(), 0, "{what}: physical bytes left");
    }
}

/// A clean run: its call counts and step records.
fn clean_run() -> (HashMap<CallKind, u64>, Run) {
    let mut run = Run::new(None);
    run.workload();
    let counts = CallKind::ALL
        .iter()
        .map(|&k| (k, run.fault.calls(k)))
        .collect();
    (counts, run)
}

#[test]
fn clean_run_takes_every_path_and_is_repeatable() {
    let (counts, run) = clean_run();
    run.assert_nothing_left("clean run");
    let unexpected: Vec<&String> = run
        .errors
        .iter()
        .filter(|e| !e.contains("OutOfMemory"))
        .collect();
    assert!(unexpected.is_empty(), "{unexpected:?}");
    assert_eq!(run.errors.len(), 1, "one request is out of memory");
    for kind in USED {
        assert!(counts[&kind] > 0, "the workload makes no {kind:?} call");
    }
    for (kind, &n) in &counts {
        assert!(
            n == 0 || USED.contains(kind),
            "the pool now makes {kind:?} calls: add the kind to USED"
        );
    }
    let (again, _) = clean_run();
    assert_eq!(counts, again, "the workload is not deterministic");
    assert!(
        run.steps.iter().any(|s| s.auto_collected),
        "no automatic collection of stitched blocks"
    );
    println!("calls of a clean run: {counts:?}");
}

#[test]
fn clean_run_statistics_show_each_path() {
    let (_, run) = clean_run();
    let before_empty = run
        .steps
        .iter()
        .position(|s| s.name == "empty_cache")
        .expect("step");
    let stats = run.steps[before_empty - 1]
        .stats
        .expect("statistics before empty_cache");
    assert!(stats.stitches >= 3, "stitches: {}", stats.stitches);
    assert!(stats.stitch_reuse_hits >= 1, "no reuse of a stitched block");
    assert!(stats.stitch_collections >= 1, "no collection");
    assert!(
        stats.num_alloc_retries >= 2,
        "retries: {}",
        stats.num_alloc_retries
    );
    assert_eq!(stats.num_ooms, 1);
    assert!(stats.num_sync_all_streams >= 1);
    assert!(stats.num_device_free >= 1);
}

/// How many of the calls after a failure a sweep fails in turn, each in a run of its own.
const AFTERMATH: usize = 1;

/// For each call of a clean run: the kinds of the calls that follow it when it fails.
fn aftermaths() -> &'static [(CallKind, u64, Vec<CallKind>)] {
    static TABLE: OnceLock<Vec<(CallKind, u64, Vec<CallKind>)>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let (counts, _) = clean_run();
        let mut table = Vec::new();
        for kind in USED {
            for n in 1..=counts[&kind] {
                let mut run = Run::new(Some((kind, n)));
                run.workload();
                table.push((kind, n, run.fault.calls_after_failure()));
            }
        }
        table
    })
}

/// Fails each call of `kind` in turn (with `error`, a driver error unless told otherwise).
/// Returns the calls whose failure went unreported, with their steps.
fn fail_each(kind: CallKind) -> Vec<(u64, &'static str)> {
    let (counts, clean) = clean_run();
    let total = counts[&kind];
    assert!(total > 0, "no {kind:?} call to fail");
    let mut quiet = Vec::new();
    let mut swept = common::sites::Swept::new("faults");
    for n in 1..=total {
        let mut run = Run::new(Some((kind, n)));
        run.workload();
        swept.add(&run.fault);
        let what = format!("{kind:?} call {n} of {total}");
        assert_eq!(run.fault.injected(), 1, "{what}: the failure did not fire");
        run.assert_nothing_left(&what);
        // Every event the pool created was destroyed (unless destroying one is what failed).
        let created =
            run.fault.calls(CallKind::CreateEvent) - u64::from(kind == CallKind::CreateEvent);
        let destroyed =
            run.fault.calls(CallKind::DestroyEvent) - u64::from(kind == CallKind::DestroyEvent);
        if kind != CallKind::DestroyEvent {
            assert_eq!(created, destroyed, "{what}: events created and destroyed");
        }
        let step = run.fault_step.expect("the step of the failure");
        let record = &run.steps[step];
        // Reported by a call of the step in which it happened, not later.
        let reported = record.errors.iter().any(|e| e.contains("injected failure"));
        let at_fence = run
            .fault
            .sites_failed()
            .iter()
            .all(|s| s.file.ends_with("src/pool/gather.rs"));
        let quiet_allowed = matches!(
            kind,
            CallKind::Unmap | CallKind::ReleasePhysical | CallKind::Unreserve
        ) || record.name == "drop the pool"
            || at_fence
            || (kind == CallKind::SynchronizeDevice && clean.steps[step].auto_collected);
        assert!(
            reported || quiet_allowed,
            "{what} (in step {:?}) was not reported; errors: {:?}",
            record.name,
            run.errors
        );
        // A fence's failure is quiet by design (it postpones gathering only).
        if !reported && !at_fence {
            quiet.push((n, record.name));
        }
    }
    println!("{kind:?}: {total} calls failed in turn; not reported: {quiet:?}");
    // The clean-up of a failure failing too: each call of `kind` made right after another
    // call failed.
    let mut doubled = 0;
    for (first, n, after) in aftermaths() {
        for (j, _) in after
            .iter()
            .take(AFTERMATH)
            .enumerate()
            .filter(|&(_, &k)| k == kind)
        {
            let mut run = Run::new(Some((*first, *n)));
            run.fault.fail_after_failure(j as u64 + 1);
            run.workload();
            swept.add(&run.fault);
            let what = format!(
                "{first:?} call {n}, then {kind:?} (call {} after it)",
                j + 1
            );
            assert_eq!(run.fault.injected(), 2, "{what}: did not fire");
            run.assert_nothing_left(&what);
            let failed = |k: CallKind| u64::from(*first == k) + u64::from(kind == k);
            if failed(CallKind::DestroyEvent) == 0 {
                assert_eq!(
                    run.fault.calls(CallKind::CreateEvent) - failed(CallKind::CreateEvent),
                    run.fault.calls(CallKind::DestroyEvent),
                    "{what}: events created and destroyed"
                );
            }
            doubled += 1;
        }
    }
    println!("{kind:?}: {doubled} calls failed right after another failure");
    swept.assert_covers(Some(kind));
    quiet
}

/// A driver that runs out of physical memory (rather than failing otherwise) sends the pool
/// down its free-and-retry path: each creation failing in turn costs at most an out-of-memory
/// error, never a driver error, a leak or a broken pool.
#[test]
fn driver_out_of_memory_is_retried() {
    let (counts, _) = clean_run();
    let total = counts[&CallKind::CreatePhysical];
    let mut recovered = 0;
    for n in 1..=total {
        let mut run = Run::new(None);
        run.fault
            .fail_nth_with(CallKind::CreatePhysical, n, ErrorKind::OutOfMemory);
        run.workload();
        let what = format!("out of memory at creation {n} of {total}");
        assert_eq!(run.fault.injected(), 1, "{what}: did not fire");
        run.assert_nothing_left(&what);
        let others: Vec<&String> = run
            .errors
            .iter()
            .filter(|e| !e.contains("OutOfMemory"))
            .collect();
        assert!(others.is_empty(), "{what}: {others:?}");
        if run.errors.len() == 1 {
            recovered += 1;
        }
    }
    println!("driver out of memory: {recovered} of {total} recovered by the retry");
    assert!(recovered > 0, "the retry never recovered");
}

/// A pool dropped while busy: live plain and stitched allocations, a pending free waiting for
/// a slow second stream, cached stitched blocks. Returns the run, ready to drop the pool.
fn busy_pool() -> Run {
    let mut run = Run::new(None);
    let s0 = Stream::DEFAULT;
    let side = run.side;
    run.pool = Some(Pool::new(run.fault.clone() as SharedDevice, Config::default()).expect("pool"));
    let small: Vec<_> = [300, 5000, 700_000]
        .map(|size| run.malloc(size, s0))
        .to_vec();
    let large: Vec<_> = (0..6).map(|_| run.malloc(4 * MIB, s0)).collect();
    for &ptr in large.iter().step_by(2) {
        run.free(ptr);
    }
    let cached = run.malloc(8 * MIB, s0);
    run.free(cached);
    let stitched = run.malloc(12 * MIB, s0);
    assert!(stitched.is_some());
    run.host
        .enqueue_host_fn(
            side,
            Box::new(|| std::thread::sleep(std::time::Duration::from_millis(20))),
        )
        .expect("enqueue_host_fn");
    run.record_stream(stitched, side);
    run.record_stream(small[1], side);
    run.free(stitched);
    run.free(small[1]);
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let stats = run.pool.as_ref().map(|p| p.stats()).expect("pool");
    assert_eq!(stats.stitches, 2);
    assert!(
        stats.active.all.current > stats.allocation.all.current,
        "pending frees"
    );
    run
}

/// Dropping a busy pool releases everything, also when one call of the tear-down fails: the
/// tear-down makes a second pass over what its first one could not release. (Were the wait for
/// the device to fail twice, the pool could not know whether queued work still uses its memory,
/// and would leave it to the driver.)
#[test]
fn dropping_a_busy_pool_releases_everything() {
    let run = busy_pool();
    let before: Vec<u64> = USED.iter().map(|&k| run.fault.calls(k)).collect();
    let mut run = run;
    drop(run.pool.take());
    run.assert_nothing_left("busy pool");
    let in_drop: Vec<(CallKind, u64)> = USED
        .iter()
        .zip(before)
        .map(|(&k, b)| (k, run.fault.calls(k) - b))
        .filter(|&(_, n)| n > 0)
        .collect();
    println!("calls of the tear-down: {in_drop:?}");
    for (kind, total) in in_drop {
        for n in 1..=total {
            let mut run = busy_pool();
            run.fault.fail_nth(kind, n);
            drop(run.pool.take());
            assert_eq!(run.fault.injected(), 1);
            let what = format!("{kind:?} call {n} of {total} in the tear-down");
            run.assert_nothing_left(&what);
            if kind != CallKind::DestroyEvent {
                assert_eq!(
                    run.fault.calls(CallKind::CreateEvent),
                    run.fault.calls(CallKind::DestroyEvent),
                    "{what}: events created and destroyed"
                );
            }
        }
    }
}

macro_rules! fault_tests {
    ($($name:ident => $kind:ident,)*) => {
        $(
            #[test]
            fn $name() {
                let quiet = fail_each(CallKind::$kind);
                if !matches!(
                    CallKind::$kind,
                    CallKind::Unmap
                        | CallKind::ReleasePhysical
                        | CallKind::Unreserve
                        | CallKind::SynchronizeDevice
                        | CallKind::DestroyEvent
                ) {
                    assert!(quiet.is_empty(), "{quiet:?}");
                }
            }
        )*
    };
}

fault_tests! {
    fail_reserve => Reserve,
    fail_unreserve => Unreserve,
    fail_create_physical => CreatePhysical,
    fail_release_physical => ReleasePhysical,
    fail_map => Map,
    fail_unmap => Unmap,
    fail_set_access => SetAccess,
    fail_create_event => CreateEvent,
    fail_destroy_event => DestroyEvent,
    fail_record_event => RecordEvent,
    fail_query_event => QueryEvent,
    fail_synchronize_device => SynchronizeDevice,
    fail_mem_info => MemInfo,
}

/// Runs `work` on a 4 GiB host device behind a fault device that fails as `plan` says, with a
/// pool whose handles may be as large as the memory it holds (so that a few hundred MiB of it
/// give segments of large handles); checks that nothing is left once the pool is dropped.
/// Returns the fault device and what `work` counted (0 if the pool could not be made).
fn large_handle_run(
    plan: Option<(CallKind, u64)>,
    work: impl FnOnce(&Pool, &SharedDevice) -> i64,
) -> (Arc<FaultDevice>, i64) {
    let host = common::host_device(4 << 30);
    let bytes: SharedDevice = host.clone();
    let fault = Arc::new(FaultDevice::new(bytes.clone()));
    if let Some((kind, n)) = plan {
        fault.fail_nth(kind, n);
    }
    let config = Config {
        chunk_divisor: 1,
        ..Config::default()
    };
    let counted =
        Pool::new(fault.clone() as SharedDevice, config).map_or(0, |pool| work(&pool, &bytes));
    assert_eq!(
        host.live_objects(),
        (0, 0, 0),
        "{plan:?}: driver objects left"
    );
    assert_eq!(host.created_bytes(), 0, "{plan:?}: physical bytes left");
    (fault, counted)
}

/// `mib` MiB on the default stream, or None where an injected failure refuses it.
fn malloc_mib(pool: &Pool, mib: usize) -> Option<DevicePtr> {
    pool.malloc(mib * MIB, Stream::DEFAULT).ok()
}

/// Frees `ptr` if there is one; a failure injected into the free is the sweep's to check.
fn free_if_any(pool: &Pool, ptr: Option<DevicePtr>) {
    if let Some(ptr) = ptr {
        let _ = pool.free(ptr);
    }
}

/// Stitches that begin in the free end of a held handle and end in the free front of one
/// (a 128 MiB segment of 16 MiB handles cut into 8 MiB blocks, the end of handle 0 and the
/// front of handle 2 freed): one of 16 MiB from those two alone, then one of 24 MiB that maps
/// new memory between them. Returns the device and the stitches made; each stitched
/// allocation made holds its bytes.
fn edges_run(plan: Option<(CallKind, u64)>) -> (Arc<FaultDevice>, i64) {
    large_handle_run(plan, |pool, bytes| {
        let (malloc, free) = (|mib| malloc_mib(pool, mib), |ptr| free_if_any(pool, ptr));
        // Made once the pool holds 256 MiB, the 128 MiB segment is of 16 MiB handles.
        let filler = malloc(256);
        free(malloc(128));
        let blocks: Vec<_> = (0..16).map(|_| malloc(8)).collect();
        free(blocks[1]);
        free(blocks[4]);
        for mib in [16, 24] {
            if let Some(big) = malloc(mib) {
                common::write_pattern(bytes, big, mib * MIB, 5);
                assert!(common::has_pattern(bytes, big, mib * MIB, 5), "{plan:?}");
                free(Some(big));
            }
        }
        pool.check_invariants()
            .unwrap_or_else(|err| panic!("{plan:?}: {err}"));
        for (i, &b) in blocks.iter().enumerate() {
            if i != 1 && i != 4 {
                free(b);
            }
        }
        free(filler);
        pool.stats().stitches
    })
}

/// Stitched ranges grown in place: six 6 MiB blocks with every other one freed, a 12 MiB
/// stitch of two holes freed, then 18 MiB (grown by the third hole) and 24 MiB (grown by new
/// memory). Returns the device and the growths made; each allocation made holds its bytes and
/// the live blocks keep theirs.
fn growth_run(plan: Option<(CallKind, u64)>) -> (Arc<FaultDevice>, i64) {
    large_handle_run(plan, |pool, bytes| {
        let (malloc, free) = (|mib| malloc_mib(pool, mib), |ptr| free_if_any(pool, ptr));
        let blocks: Vec<_> = (0..6).map(|_| malloc(6)).collect();
        for (i, &b) in blocks.iter().enumerate() {
            match (i % 2, b) {
                (0, _) => free(b),
                (_, Some(b)) => common::write_pattern(bytes, b, 6 * MIB, i as u64),
                _ => {}
            }
        }
        for mib in [12, 18, 24] {
            if let Some(big) = malloc(mib) {
                common::write_pattern(bytes, big, mib * MIB, 5);
                assert!(common::has_pattern(bytes, big, mib * MIB, 5), "{plan:?}");
                free(Some(big));
            }
        }
        for (i, &b) in blocks.iter().enumerate().skip(1).step_by(2) {
            if let Some(b) = b {
                assert!(common::has_pattern(bytes, b, 6 * MIB, i as u64), "{plan:?}");
            }
        }
        pool.check_invariants()
            .unwrap_or_else(|err| panic!("{plan:?}: {err}"));
        blocks.iter().skip(1).step_by(2).for_each(|&b| free(b));
        pool.footprint().stitch_growths as i64
    })
}

/// Each driver call of stitched ranges grown in place (by a free block, by new memory) fails
/// in turn: the range, its pieces and the pool stay consistent, each allocation made holds its
/// bytes, and dropping the pool leaks nothing.
#[test]
fn stitched_ranges_grown_in_place_survive_each_call_failing() {
    let (clean, growths) = growth_run(None);
    assert_eq!(growths, 2, "the clean run grows a range twice");
    let runs = fail_each_call_of(&clean, growth_run);
    assert!(runs > 20, "only {runs} calls failed in turn");
}

/// A 12 MiB stitched range of two free 6 MiB blocks, idle, then grown to 20 MiB by new
/// memory, with the `nth` call of `kind` of that growth failing (none: a clean run); then the
/// same request again, which must grow the range where it is; with `stuck_unmap`, the undoing
/// of the failed growth's first mapping fails too, and the retry, which cannot map there until
/// that unmap is retried, must be served elsewhere. Returns the growth's calls of `kind`.
/// Checks the bytes, the pool and that dropping it leaks nothing.
fn failed_growth_run(kind: CallKind, nth: Option<u64>, stuck_unmap: bool) -> u64 {
    let host = common::host_device(1 << 30);
    let bytes: SharedDevice = host.clone();
    let fault = Arc::new(FaultDevice::new(bytes.clone()));
    let pool = Pool::new(fault.clone() as SharedDevice, Config::default()).expect("pool");
    let malloc = |mib: usize| pool.malloc(mib * MIB, Stream::DEFAULT);
    let blocks: Vec<_> = (0..4).map(|_| malloc(6).expect("block")).collect();
    for &b in blocks.iter().step_by(2) {
        pool.free(b).expect("free");
    }
    let range = malloc(12).expect("stitch");
    pool.free(range).expect("free");
    let before = fault.calls(kind);
    if let Some(nth) = nth {
        fault.fail_nth(kind, nth);
    }
    if stuck_unmap {
        fault.fail_nth(CallKind::Unmap, 1);
    }
    let first = malloc(20);
    let calls = fault.calls(kind) - before;
    pool.check_invariants()
        .unwrap_or_else(|err| panic!("{kind:?} {nth:?}: {err}"));
    if let Ok(ptr) = first {
        pool.free(ptr).expect("free");
    }
    let again = malloc(20).unwrap_or_else(|err| panic!("{kind:?} {nth:?}: the retry: {err}"));
    if !stuck_unmap {
        assert_eq!(again, range, "{kind:?} {nth:?}: grown where it was");
    }
    common::write_pattern(&bytes, again, 20 * MIB, 9);
    assert!(common::has_pattern(&bytes, again, 20 * MIB, 9));
    pool.check_invariants()
        .unwrap_or_else(|err| panic!("{kind:?} {nth:?}: {err}"));
    pool.free(again).expect("free");
    for &b in blocks.iter().skip(1).step_by(2) {
        pool.free(b).expect("free");
    }
    drop(pool);
    assert_eq!(
        host.live_objects(),
        (0, 0, 0),
        "{kind:?} {nth:?}: driver objects left"
    );
    calls
}

/// A growth whose driver call fails (making its new memory, mapping it, granting access to
/// it) leaves nothing in its range's room: the range goes back to the idle ones and grows on
/// the next try.
#[test]
fn a_failed_growth_leaves_its_range_growable() {
    for kind in [CallKind::CreatePhysical, CallKind::Map, CallKind::SetAccess] {
        let calls = failed_growth_run(kind, None, false);
        assert!(calls > 0, "the growth makes {kind:?} calls");
        for nth in 1..=calls {
            failed_growth_run(kind, Some(nth), false);
        }
    }
    // The range's access grant fails, and so does unmapping what the growth had mapped.
    let grants = failed_growth_run(CallKind::SetAccess, None, false);
    failed_growth_run(CallKind::SetAccess, Some(grants), true);
}

/// Each driver call of stitches that begin and end inside held handles, one of them with new
/// memory before its last piece, fails in turn: the pool stays consistent, each allocation
/// made holds its bytes, and dropping the pool leaks nothing.
#[test]
fn stitches_inside_held_handles_survive_each_call_failing() {
    let (clean, stitches) = edges_run(None);
    assert_eq!(stitches, 2, "the clean run stitches twice");
    let runs = fail_each_call_of(&clean, edges_run);
    assert!(runs > 30, "only {runs} calls failed in turn");
}

/// A scenario run with the driver call `plan` names failing (none: a clean run): its fault
/// device and what it counted.
type FaultRun = fn(Option<(CallKind, u64)>) -> (Arc<FaultDevice>, i64);

/// Runs `run` once per driver call the `clean` run made, that call failing; checks that each
/// failure fired. Returns the runs made.
fn fail_each_call_of(clean: &FaultDevice, run: FaultRun) -> usize {
    let mut runs = 0;
    for kind in CallKind::ALL {
        for n in 1..=clean.calls(kind) {
            let (fault, _) = run(Some((kind, n)));
            assert_eq!(
                fault.injected(),
                1,
                "{kind:?} call {n}: the failure did not fire"
            );
            runs += 1;
        }
    }
    runs
}

/// A stitch that gathers small-handle segments (the scenario of tests/pool.rs: six whole idle
/// segments, four of them of 16 MiB handles, freed before a passed fence and mapped by no
/// stitched range, released and made again in 32 MiB handles). Returns the device and the
/// segments gathered; the stitched allocation, where it was made, holds its bytes.
fn gathering_run(plan: Option<(CallKind, u64)>) -> (Arc<FaultDevice>, i64) {
    large_handle_run(plan, |pool, bytes| {
        let (malloc, free) = (|mib| malloc_mib(pool, mib), |ptr| free_if_any(pool, ptr));
        let filler = malloc(256);
        let first: Vec<_> = [400, 420].map(malloc).into();
        let small: Vec<_> = [160, 180, 200, 220].map(malloc).into();
        small.into_iter().for_each(free);
        first.into_iter().for_each(free);
        free(malloc(820));
        bytes.synchronize_stream(Stream::DEFAULT).expect("sync");
        if let Some(big) = malloc(1580) {
            common::write_pattern(bytes, big, 1580 * MIB, 3);
            assert!(common::has_pattern(bytes, big, 1580 * MIB, 3), "{plan:?}");
            free(Some(big));
        }
        free(filler);
        pool.check_invariants()
            .unwrap_or_else(|err| panic!("{plan:?}: {err}"));
        pool.stats().gathered_segments
    })
}

/// Each driver call of a gathering stitch fails in turn (the fences' events, the release of
/// the gathered segments, the new memory, the mappings): the pool stays consistent, the
/// allocation holds its bytes where it is made, and dropping the pool leaks nothing.
#[test]
fn a_gathering_stitch_survives_each_call_failing() {
    let (clean, gathered) = gathering_run(None);
    assert_eq!(gathered, 4, "the clean run gathers");
    let runs = fail_each_call_of(&clean, gathering_run);
    assert!(runs > 100, "only {runs} calls failed in turn");
}
