//! Swappable allocations on the host backend: swapping out gives the physical memory back and
//! keeps the address; swapping in brings the same bytes back at the same address. Faults at
//! each driver call of both directions leave a consistent pool that loses no byte and leaks no
//! driver object.

mod common;

use std::sync::Arc;

use common::{check, has_pattern, host_device, host_pool as setup, write_pattern};
use glake::config::Config;
use glake::device::fault::FaultDevice;
use glake::device::{CallKind, DevicePtr, SharedDevice, Stream};
use glake::{ErrorKind, Pool};

const MIB: usize = 1 << 20;
const S: Stream = Stream::DEFAULT;

#[test]
fn swap_out_releases_memory_and_swap_in_restores_bytes_at_the_same_address() {
    let (host, device, pool) = setup(256 * MIB);
    let ptr = pool.malloc_swappable(5 * MIB + 3, S).expect("malloc");
    let size = 6 * MIB;
    assert_eq!(pool.allocation_of(ptr).expect("live").size, size);
    assert_eq!(pool.is_swapped(ptr), Some(false));
    write_pattern(&device, ptr, size, 7);
    let before = pool.stats();
    let created = host.created_bytes();
    assert_eq!(before.reserved_bytes.all.current, size as i64);
    assert_eq!(before.allocated_bytes.all.current, size as i64);

    pool.swap_out(ptr).expect("swap out");
    check(&pool);
    assert_eq!(pool.is_swapped(ptr), Some(true));
    let out = pool.stats();
    assert_eq!(out.reserved_bytes.all.current, 0);
    assert_eq!(out.swapped_bytes.current, size as i64);
    assert_eq!(
        out.allocated_bytes.all.current, size as i64,
        "still allocated"
    );
    assert_eq!(
        host.created_bytes(),
        created - size,
        "driver memory given back"
    );
    assert_eq!(
        host.live_objects(),
        (0, 0, 1),
        "only the reservation is left"
    );
    // empty_cache leaves a swapped range alone.
    pool.empty_cache().expect("empty_cache");
    check(&pool);
    assert_eq!(pool.is_swapped(ptr), Some(true));
    assert_eq!(pool.allocation_of(ptr).expect("live").base, ptr);

    pool.swap_in(ptr).expect("swap in");
    check(&pool);
    assert_eq!(pool.is_swapped(ptr), Some(false));
    assert!(
        has_pattern(&device, ptr, size, 7),
        "same bytes at the same address"
    );
    let back = pool.stats();
    assert_eq!(back.reserved_bytes.all.current, size as i64);
    assert_eq!(back.swapped_bytes.current, 0);
    assert_eq!(back.swapped_bytes.peak, size as i64);
    assert_eq!(host.created_bytes(), created);

    pool.free(ptr).expect("free");
    check(&pool);
    assert_eq!(pool.is_swapped(ptr), None);
    pool.empty_cache().expect("empty_cache");
    assert_eq!(host.live_objects(), (0, 0, 0));
}

#[test]
fn several_allocations_in_different_orders() {
    let (host, device, pool) = setup(256 * MIB);
    let sizes = [2 * MIB, 8 * MIB, 4 * MIB, 10 * MIB];
    let ptrs: Vec<DevicePtr> = sizes
        .iter()
        .map(|&s| pool.malloc_swappable(s, S).expect("malloc"))
        .collect();
    let plain = pool.malloc(3 * MIB, S).expect("plain malloc");
    write_pattern(&device, plain, 3 * MIB, 100);
    for (i, (&p, &s)) in ptrs.iter().zip(&sizes).enumerate() {
        write_pattern(&device, p, s, i as u64);
    }
    let total: usize = sizes.iter().sum();
    for &i in &[2usize, 0, 3, 1] {
        pool.swap_out(ptrs[i]).expect("swap out");
        check(&pool);
    }
    assert_eq!(pool.stats().swapped_bytes.current, total as i64);
    // New memory may come between the swapped ranges; it never takes their addresses.
    let other = pool.malloc(total, S).expect("malloc while swapped");
    for &p in &ptrs {
        assert!(other + total as u64 <= p || p + 2 * MIB as u64 <= other);
    }
    pool.free(other).expect("free");
    pool.empty_cache().expect("empty_cache");
    for &i in &[1usize, 3, 0] {
        pool.swap_in(ptrs[i]).expect("swap in");
        check(&pool);
        assert!(has_pattern(&device, ptrs[i], sizes[i], i as u64));
    }
    // Out again and in again, in another order.
    pool.swap_out(ptrs[3]).expect("swap out");
    pool.swap_in(ptrs[2]).expect("swap in");
    pool.swap_in(ptrs[3]).expect("swap in");
    check(&pool);
    for (i, (&p, &s)) in ptrs.iter().zip(&sizes).enumerate() {
        assert!(has_pattern(&device, p, s, i as u64), "allocation {i}");
    }
    assert!(has_pattern(&device, plain, 3 * MIB, 100));
    assert_eq!(pool.stats().swapped_bytes.current, 0);
    for p in ptrs.into_iter().chain([plain]) {
        pool.free(p).expect("free");
    }
    check(&pool);
    pool.empty_cache().expect("empty_cache");
    assert_eq!(host.live_objects(), (0, 0, 0));
}

#[test]
fn the_cap_stops_a_swap_in_until_memory_is_freed() {
    let (host, device, pool) = setup(256 * MIB);
    pool.set_memory_limit(8 * MIB).expect("limit");
    let a = pool.malloc_swappable(4 * MIB, S).expect("a");
    let b = pool.malloc_swappable(4 * MIB, S).expect("b");
    write_pattern(&device, a, 4 * MIB, 1);
    write_pattern(&device, b, 4 * MIB, 2);
    pool.swap_out(a).expect("swap out");
    let c = pool
        .malloc(4 * MIB, S)
        .expect("the freed memory serves others");
    let ooms = pool.stats().num_ooms;
    let err = pool.swap_in(a).expect_err("cap is full");
    assert_eq!(err.kind(), ErrorKind::OutOfMemory);
    assert_eq!(pool.stats().num_ooms, ooms + 1);
    assert_eq!(pool.is_swapped(a), Some(true), "stays swapped out");
    check(&pool);
    pool.free(c).expect("free c");
    // The freed block is cached; swapping in releases the cache to make room.
    pool.swap_in(a).expect("swap in after freeing");
    check(&pool);
    assert!(has_pattern(&device, a, 4 * MIB, 1));
    assert!(has_pattern(&device, b, 4 * MIB, 2));
    assert!(host.created_bytes() <= 8 * MIB);
    pool.free(a).expect("free");
    pool.free(b).expect("free");
}

#[test]
fn free_while_swapped_and_misuse_errors() {
    let (host, _device, pool) = setup(256 * MIB);
    let a = pool.malloc_swappable(MIB, S).expect("a");
    let plain = pool.malloc(4 * MIB, S).expect("plain");
    let kind = |r: glake::Result<()>| r.expect_err("must fail").kind();

    assert_eq!(
        kind(pool.swap_in(a)),
        ErrorKind::InvalidState,
        "not swapped"
    );
    pool.swap_out(a).expect("swap out");
    let stats = pool.stats();
    assert_eq!(kind(pool.swap_out(a)), ErrorKind::InvalidState, "twice");
    assert_eq!(pool.stats(), stats, "a refused call changes nothing");
    assert_eq!(kind(pool.swap_out(plain)), ErrorKind::InvalidPointer);
    assert_eq!(kind(pool.swap_in(plain)), ErrorKind::InvalidPointer);
    assert_eq!(kind(pool.swap_out(0x1234_5000)), ErrorKind::InvalidPointer);
    assert_eq!(kind(pool.swap_out(0)), ErrorKind::NullPointer);
    assert_eq!(kind(pool.swap_out(a + 512)), ErrorKind::InvalidPointer);
    check(&pool);

    pool.free(a).expect("free while swapped");
    check(&pool);
    assert_eq!(kind(pool.swap_in(a)), ErrorKind::InvalidPointer);
    assert_eq!(kind(pool.free(a)), ErrorKind::InvalidPointer);
    let stats = pool.stats();
    assert_eq!(stats.swapped_bytes.current, 0);
    assert_eq!(stats.allocated_bytes.all.current, 4 * MIB as i64);
    assert_eq!(stats.allocation.all.current, 1);
    pool.free(plain).expect("free");
    pool.empty_cache().expect("empty_cache");
    assert_eq!(host.live_objects(), (0, 0, 0));

    // A resident swappable allocation freed becomes ordinary cached memory.
    let b = pool.malloc_swappable(2 * MIB, S).expect("b");
    pool.free(b).expect("free");
    assert_eq!(pool.malloc(2 * MIB, S).expect("reuse"), b);
    // Dropping the pool with a swapped allocation releases everything.
    let c = pool.malloc_swappable(2 * MIB, S).expect("c");
    pool.swap_out(c).expect("swap out");
    drop(pool);
    assert_eq!(host.live_objects(), (0, 0, 0));
}

/// One run of a swap direction with the `n`-th call of `kind` failing (and the `then`-th call
/// after it, if given).
fn fault_run(kind: CallKind, n: u64, then: Option<u64>, swap_in: bool) -> Arc<FaultDevice> {
    let host = host_device(256 * MIB);
    let raw: SharedDevice = host.clone();
    let fault = Arc::new(FaultDevice::new(raw.clone()));
    let pool = Pool::new(fault.clone() as SharedDevice, Config::default()).expect("pool");
    let size = 6 * MIB;
    let a = pool.malloc_swappable(size, S).expect("a");
    let b = pool.malloc_swappable(2 * MIB, S).expect("b");
    write_pattern(&raw, a, size, 11);
    write_pattern(&raw, b, 2 * MIB, 12);
    if swap_in {
        pool.swap_out(a).expect("swap out");
    }
    fault.fail_nth(kind, n);
    if let Some(j) = then {
        fault.fail_after_failure(j);
    }
    let result = if swap_in {
        pool.swap_in(a)
    } else {
        pool.swap_out(a)
    };
    fault.clear();
    let what = format!(
        "{kind:?} #{n} (then call {then:?} after it) of swap_{}",
        if swap_in { "in" } else { "out" }
    );
    pool.check_invariants()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    // A call either did what it was asked or reports an error and changed nothing, except
    // that a swap out whose bytes are safe on the host completes (the teardown left is
    // retried later).
    let swapped = pool.is_swapped(a) == Some(true);
    if swap_in {
        assert_eq!(result.is_err(), swapped, "{what}: {result:?}");
    } else if !swapped {
        assert!(
            result.is_err(),
            "{what}: a swap out that did not happen is reported"
        );
    }
    if pool.is_swapped(a) == Some(true) {
        pool.swap_in(a)
            .unwrap_or_else(|e| panic!("{what}: swap in after the fault: {e}"));
    }
    pool.check_invariants()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(has_pattern(&raw, a, size, 11), "{what}: bytes lost");
    assert!(
        has_pattern(&raw, b, 2 * MIB, 12),
        "{what}: neighbour harmed"
    );
    // And the allocation still swaps cleanly.
    pool.swap_out(a).unwrap_or_else(|e| panic!("{what}: {e}"));
    pool.swap_in(a).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(has_pattern(&raw, a, size, 11), "{what}: bytes lost");
    pool.free(a).expect("free");
    pool.free(b).expect("free");
    pool.empty_cache().expect("empty_cache");
    pool.check_invariants()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(pool.stats().reserved_bytes.all.current, 0, "{what}");
    drop(pool);
    assert_eq!(
        host.live_objects(),
        (0, 0, 0),
        "{what}: driver objects leaked"
    );
    assert_eq!(host.created_bytes(), 0, "{what}");
    fault
}

/// Calls of each kind that one swap makes, counted on a clean run.
fn calls_of_swap(swap_in: bool) -> Vec<(CallKind, u64)> {
    let host = host_device(256 * MIB);
    let fault = Arc::new(FaultDevice::new(host as SharedDevice));
    let pool = Pool::new(fault.clone() as SharedDevice, Config::default()).expect("pool");
    let a = pool.malloc_swappable(6 * MIB, S).expect("a");
    if swap_in {
        pool.swap_out(a).expect("swap out");
    }
    common::calls_made(&fault, || {
        if swap_in {
            pool.swap_in(a).expect("swap in");
        } else {
            pool.swap_out(a).expect("swap out");
        }
    })
}

/// Each driver call of a swap out and of a swap in, synchronous and stream-ordered, failing in
/// turn (and each call right after a failure, for the synchronous ones): the pool stays
/// consistent, loses no byte, leaks nothing, and later swaps complete. Every call site the
/// inventory gives this sweep is failed.
#[test]
fn a_fault_at_each_driver_call_of_a_swap_leaves_a_consistent_pool() {
    let mut swept = common::sites::Swept::new("swap_memory");
    sweep_synchronous_swaps(&mut swept);
    sweep_stream_ordered_swaps(&mut swept);
    swept.assert_covers(None);
}

fn sweep_synchronous_swaps(swept: &mut common::sites::Swept) {
    for swap_in in [false, true] {
        let calls = calls_of_swap(swap_in);
        let expected: &[CallKind] = if swap_in {
            &[
                CallKind::CreatePhysical,
                CallKind::Map,
                CallKind::SetAccess,
                CallKind::SynchronizeStream,
                CallKind::Copy,
            ]
        } else {
            &[
                CallKind::ReleasePhysical,
                CallKind::Unmap,
                CallKind::SynchronizeStream,
                CallKind::Copy,
            ]
        };
        common::sweep_every_call(
            &format!("swap_in={swap_in}"),
            &calls,
            expected,
            1,
            swept,
            |kind, n, then| fault_run(kind, n, then, swap_in),
        );
    }
}

#[test]
fn out_of_memory_from_the_driver_keeps_the_allocation_swapped() {
    let host = host_device(256 * MIB);
    let raw: SharedDevice = host.clone();
    let fault = Arc::new(FaultDevice::new(raw.clone()));
    let pool = Pool::new(fault.clone() as SharedDevice, Config::default()).expect("pool");
    let a = pool.malloc_swappable(6 * MIB, S).expect("a");
    write_pattern(&raw, a, 6 * MIB, 3);
    pool.swap_out(a).expect("swap out");
    fault.fail_nth_with(CallKind::CreatePhysical, 2, ErrorKind::OutOfMemory);
    let err = pool.swap_in(a).expect_err("driver out of memory");
    assert_eq!(err.kind(), ErrorKind::OutOfMemory);
    assert_eq!(pool.is_swapped(a), Some(true));
    check(&pool);
    assert_eq!(
        host.live_objects(),
        (0, 0, 1),
        "the chunk created is released"
    );
    pool.swap_in(a).expect("swap in");
    assert!(has_pattern(&raw, a, 6 * MIB, 3));
    pool.free(a).expect("free");
}

/// The stream-ordered calls: a swap-out queues its copy and returns; the memory goes back once
/// the copy is seen done; a swap-in queues the copy back that the allocation's stream waits
/// for; a swap-in before the swap-out completed cancels it; a free while a copy is queued
/// waits for it; pinned buffers are made once per size; nothing leaks.
#[test]
fn stream_ordered_swaps_round_trip_cancel_and_reuse_buffers() {
    let host = host_device(256 * MIB);
    let fault = Arc::new(FaultDevice::new(host.clone()));
    let device: SharedDevice = fault.clone();
    let pool = Pool::new(device.clone(), Config::default()).expect("pool");
    let copy = device.create_stream().expect("copy stream");
    let size = 8 * MIB;
    let ptr = pool.malloc_swappable(size, S).expect("malloc");
    write_pattern(&device, ptr, size, 11);
    let reserved = pool.stats().reserved_bytes.all.current;
    for round in 0..3u64 {
        pool.swap_out_async(ptr, copy).expect("swap out");
        assert_eq!(
            pool.swap_out_async(ptr, copy).unwrap_err().kind(),
            ErrorKind::InvalidState
        );
        assert_eq!(pool.is_swapped(ptr), Some(false), "out only once done");
        assert_eq!(pool.finish_swap_outs(true).expect("finish"), 1);
        assert_eq!(pool.is_swapped(ptr), Some(true));
        let stats = pool.stats();
        assert_eq!(stats.reserved_bytes.all.current, reserved - size as i64);
        assert_eq!(stats.swapped_bytes.current, size as i64);
        check(&pool);
        pool.swap_in_async(ptr, copy).expect("swap in");
        assert_eq!(pool.is_swapped(ptr), Some(false));
        assert!(has_pattern(&device, ptr, size, 11), "round {round}");
        assert_eq!(pool.stats().reserved_bytes.all.current, reserved);
        check(&pool);
    }
    assert_eq!(
        fault.calls(CallKind::Pinned),
        1,
        "one pinned buffer, reused"
    );
    // Cancelled: swapped in before the swap-out completed; the memory never left.
    pool.swap_out_async(ptr, copy).expect("swap out");
    pool.swap_in_async(ptr, copy).expect("cancel");
    assert_eq!(pool.finish_swap_outs(true).expect("finish"), 0);
    assert_eq!(pool.stats().swapped_bytes.current, 0);
    assert!(has_pattern(&device, ptr, size, 11));
    // Freed with a copy queued, and freed while out.
    pool.swap_out_async(ptr, copy).expect("swap out");
    pool.free(ptr).expect("free while leaving");
    let other = pool.malloc_swappable(size, S).expect("malloc");
    write_pattern(&device, other, size, 12);
    pool.swap_out_async(other, copy).expect("swap out");
    pool.finish_swap_outs(true).expect("finish");
    pool.free(other).expect("free while out");
    assert_eq!(pool.stats().swapped_bytes.current, 0);
    check(&pool);
    device.destroy_stream(copy).expect("destroy");
    drop(pool);
    assert_eq!(host.live_objects(), (0, 0, 0));
    assert_eq!(host.created_bytes(), 0);
}

/// A swap-out cancelled by a swap-in leaves its copy queued on the copy stream, still reading
/// the allocation: a later waiting swap-out (which waits for the allocation's streams) and a
/// free must not take the memory away before that copy has read it. The copy stream is held
/// up by a host function until a helper thread opens it, so the copy is surely still queued.
#[test]
fn a_cancelled_swap_out_still_queued_keeps_its_memory_until_it_has_read_it() {
    let host = host_device(256 * MIB);
    let device: SharedDevice = host.clone();
    let pool = Pool::new(device.clone(), Config::default()).expect("pool");
    let copy = device.create_stream().expect("copy stream");
    // The allocation's own stream: not the default one, which the host backend (like CUDA's
    // legacy default stream) orders after every other.
    let own = device.create_stream().expect("stream");
    let size = 2 * MIB;
    let ptr = pool.malloc_swappable(size, own).expect("malloc");
    write_pattern(&device, ptr, size, 31);
    let (open, gate) = std::sync::mpsc::channel::<()>();
    host.enqueue_host_fn(
        copy,
        Box::new(move || {
            let _ = gate.recv();
        }),
    )
    .expect("gate");
    pool.swap_out_async(ptr, copy)
        .expect("swap out, queued behind the gate");
    pool.swap_in_async(ptr, own).expect("cancelled");
    let opened = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = opened.clone();
    let opener = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(200));
        flag.store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = open.send(());
    });
    // It waits for the queued copy out (on the copy stream), not only for the allocation's
    // stream, before it unmaps the memory that copy reads.
    pool.swap_out(ptr).expect("swap out, waiting");
    assert!(
        opened.load(std::sync::atomic::Ordering::SeqCst),
        "the memory went before the queued copy out had read it"
    );
    pool.swap_in(ptr).expect("swap in");
    assert!(has_pattern(&device, ptr, size, 31), "bytes kept");
    pool.free(ptr).expect("free");
    opener.join().expect("opener");
    device.synchronize_device().expect("sync");
    check(&pool);
    device.destroy_stream(copy).expect("destroy");
    device.destroy_stream(own).expect("destroy");
    drop(pool);
    assert_eq!(host.live_objects(), (0, 0, 0));
}

/// Each driver call of stream-ordered swaps failing in turn: from a fresh pool, a swap out
/// and back (the pinned buffer made), another with a non-blocking finish, one cancelled by
/// the swap-in, one freed while its copy is queued, and the pool dropped with a swap-out under
/// way and a buffer still busy. Each call that fails reports it, a retry completes, nothing is
/// lost and no driver object is left (a pinned buffer whose copy cannot be waited for is kept
/// by design, so pinned memory is not counted). A failed stream wait is also run with the
/// call right after it (its fallback) failing.
fn sweep_stream_ordered_swaps(swept: &mut common::sites::Swept) {
    let size = 4 * MIB;
    /// Runs the scenario from a fresh pool on a 64 MiB host device with `plan` made on its
    /// fault device first; the test's own reads and waits go to the device underneath (never
    /// failed, never counted). Returns the fault device and the calls of each kind made after
    /// the plan.
    fn scenario(
        what: &str,
        size: usize,
        plan: impl FnOnce(&FaultDevice),
    ) -> (Arc<FaultDevice>, Vec<(CallKind, u64)>) {
        let host = host_device(64 * MIB);
        let fault = Arc::new(FaultDevice::new(host.clone()));
        let device: SharedDevice = fault.clone();
        let io: SharedDevice = host.clone();
        let pool = Pool::new(device.clone(), Config::default()).expect("pool");
        let copy = io.create_stream().expect("copy stream");
        let ptr = pool.malloc_swappable(size, S).expect("malloc");
        let other = pool.malloc_swappable(size, S).expect("malloc");
        let third = pool.malloc_swappable(size, S).expect("malloc");
        write_pattern(&io, ptr, size, 7);
        write_pattern(&io, other, size, 8);
        let before: Vec<u64> = CallKind::ALL.iter().map(|&k| fault.calls(k)).collect();
        plan(&fault);
        // A failed call is retried (twice: the retry's own first call may be the one failed
        // after the first failure).
        let again = |f: &dyn Fn() -> glake::Result<()>| {
            if f().is_err() && f().is_err() {
                f().unwrap_or_else(|e| panic!("{what}: the retry fails: {e}"));
            }
        };
        // Out and back, the pinned buffer made.
        again(&|| pool.swap_out_async(ptr, copy));
        again(&|| pool.finish_swap_outs(true).map(|_| ()));
        again(&|| pool.swap_in_async(ptr, copy));
        io.synchronize_stream(S).expect("sync");
        // Out with a non-blocking finish first, and back.
        again(&|| pool.swap_out_async(ptr, copy));
        io.synchronize_stream(copy).expect("sync");
        again(&|| pool.finish_swap_outs(false).map(|_| ()));
        again(&|| pool.finish_swap_outs(true).map(|_| ()));
        again(&|| pool.swap_in_async(ptr, copy));
        // Cancelled by the swap-in.
        again(&|| pool.swap_out_async(ptr, copy));
        again(&|| pool.swap_in_async(ptr, copy));
        io.synchronize_stream(S).expect("sync");
        assert!(has_pattern(&io, ptr, size, 7), "{what}: bytes lost");
        // Freed while its copy is queued.
        again(&|| pool.swap_out_async(other, copy));
        pool.free(other)
            .unwrap_or_else(|e| panic!("{what}: free while leaving: {e}"));
        // Dropped with a buffer busy and a swap-out under way: the copy stream is held up
        // behind a gate until the pool is dropped (or for a while, when a failure makes the
        // pool wait for the stream).
        let (open, gate) = std::sync::mpsc::channel::<()>();
        host.enqueue_host_fn(
            copy,
            Box::new(move || {
                let _ = gate.recv_timeout(std::time::Duration::from_millis(100));
            }),
        )
        .expect("enqueue_host_fn");
        again(&|| pool.swap_out_async(ptr, copy));
        again(&|| pool.swap_in_async(ptr, copy));
        again(&|| pool.swap_out_async(third, copy));
        let _ = open.send(());
        pool.check_invariants()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        drop(pool);
        let made = CallKind::ALL
            .iter()
            .zip(before)
            .map(|(&k, b)| (k, fault.calls(k) - b))
            .filter(|&(_, n)| n > 0)
            .collect();
        fault.clear();
        assert_eq!(host.live_objects(), (0, 0, 0), "{what}");
        assert_eq!(host.created_bytes(), 0, "{what}");
        io.destroy_stream(copy).expect("destroy");
        (fault, made)
    }
    let (_, counts) = scenario("clean", size, |_| {});
    let mut fired = 0;
    for &(kind, total) in &counts {
        for n in 1..=total {
            let what = format!("{kind:?} call {n} of {total}");
            let (fault, made) = scenario(&what, size, |f| f.fail_nth(kind, n));
            let made = made.iter().find(|c| c.0 == kind).map_or(0, |c| c.1);
            // Queries and waits depend on when copies finish: a failure planned past the
            // calls this run made cannot fire.
            assert!(
                fault.injected() == 1 || made < n,
                "{what}: did not fire ({made} calls)"
            );
            fired += fault.injected();
            swept.add(&fault);
            // A failed ordering falls back to a wait: that wait failing too is swept as well.
            // (Other pairs include both of a tear-down's waits failing, after which memory is
            // left to the driver by design: the leak checks above would not hold.)
            if kind == CallKind::StreamWaitEvent
                && fault.injected() == 1
                && !fault.calls_after_failure().is_empty()
            {
                let what = format!("{what}, then the call after it");
                let (fault, _) = scenario(&what, size, |f| {
                    f.fail_nth(kind, n);
                    f.fail_after_failure(1);
                });
                fired += fault.injected();
                swept.add(&fault);
            }
        }
    }
    println!("swept {counts:?}: {fired} failures fired");
    assert!(fired >= 10, "only {fired} failures fired over {counts:?}");
}
