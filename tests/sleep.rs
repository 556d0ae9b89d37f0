//! Sleep regions on the host backend (and on CUDA with GLAKE_TEST_BACKEND=cuda where the test
//! does not need the host backend's counters): memory allocated in a region gives its
//! physical memory back on sleep and comes back at the same addresses with the same bytes on
//! wake; faults at each driver call of a sleep or a wake lose no byte and a retry completes.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{check, has_pattern, host_device, host_pool as setup, pattern, read, write_pattern};
use glake::config::{Config, SleepHost};
use glake::device::fault::FaultDevice;
use glake::device::host::HostDevice;
use glake::device::{CallKind, DevicePtr, SharedDevice, Stream};
use glake::pool::SleepMode;
use glake::{ErrorKind, Pool};

const MIB: usize = 1 << 20;
const S: Stream = Stream::DEFAULT;

/// Allocates `sizes` in region `name` and writes a pattern seeded `seed + i` into each.
fn fill(
    pool: &Pool,
    device: &SharedDevice,
    name: &str,
    sizes: &[usize],
    seed: u64,
) -> Vec<(DevicePtr, usize)> {
    pool.begin_region(name).expect("begin");
    let ptrs: Vec<(DevicePtr, usize)> = sizes
        .iter()
        .map(|&n| (pool.malloc(n, S).expect("malloc"), n))
        .collect();
    pool.end_region().expect("end");
    for (i, &(p, n)) in ptrs.iter().enumerate() {
        write_pattern(device, p, n, seed + i as u64);
    }
    ptrs
}

/// Frees `weights`, drops the pool and checks that no driver object and no pinned buffer is
/// left on `host`.
fn free_and_drop(pool: Pool, host: &HostDevice, weights: Vec<(DevicePtr, usize)>) {
    for (p, _) in weights {
        pool.free(p).expect("free");
    }
    drop(pool);
    assert_eq!(host.live_objects(), (0, 0, 0));
    assert_eq!(host.live_pinned(), 0, "host buffers freed with the pool");
}

fn intact(device: &SharedDevice, ptrs: &[(DevicePtr, usize)], seed: u64) -> bool {
    ptrs.iter()
        .enumerate()
        .all(|(i, &(p, n))| has_pattern(device, p, n, seed + i as u64))
}

#[test]
fn sleep_gives_memory_back_and_wake_restores_bytes_at_the_same_addresses() {
    let (host, device, pool) = setup(512 * MIB);
    // Large and small allocations, one freed so the region's segments have holes.
    let sizes = [24 * MIB, 6 * MIB + 5, 4096, 700, 40 * MIB];
    let weights = fill(&pool, &device, "weights", &sizes, 1);
    let other = pool.malloc(8 * MIB, S).expect("outside the region");
    write_pattern(&device, other, 8 * MIB, 99);
    pool.begin_region("weights").expect("begin");
    let hole = pool.malloc(2 * MIB, S).expect("hole");
    pool.end_region().expect("end");
    pool.free(hole).expect("free");
    let before = pool.stats().reserved_bytes.all.current;
    let info = pool.region_info("weights").expect("info");
    assert!(!info.asleep);
    assert!(info.allocated_bytes >= sizes.iter().sum::<usize>());
    let created = host.created_bytes();
    // A region's segments are one physical handle each, before and after a wake: sleep and
    // wake cost the driver per handle.
    let one_handle_each = |pool: &Pool| {
        let snap = pool.snapshot();
        let mine: Vec<_> = snap
            .segments
            .iter()
            .filter(|s| {
                let end = s.address + s.total_size as u64;
                weights.iter().any(|&(p, _)| p >= s.address && p < end)
            })
            .collect();
        !mine.is_empty() && mine.iter().all(|s| s.chunk_sizes.len() == 1)
    };
    assert!(one_handle_each(&pool));

    for cycle in 0..100 {
        pool.sleep("weights", SleepMode::Keep).expect("sleep");
        check(&pool);
        let asleep = pool.region_info("weights").expect("info");
        assert!(asleep.asleep && asleep.resident_bytes == 0, "{asleep:?}");
        assert_eq!(
            host.created_bytes(),
            created - info.resident_bytes,
            "cycle {cycle}: every byte of the region's physical memory is back"
        );
        assert_eq!(
            pool.stats().reserved_bytes.all.current,
            before - info.resident_bytes as i64
        );
        assert!(has_pattern(&device, other, 8 * MIB, 99), "others untouched");
        pool.wake("weights").expect("wake");
        check(&pool);
        assert!(intact(&device, &weights, 1), "cycle {cycle}: bytes differ");
        if cycle == 0 {
            assert!(one_handle_each(&pool), "woken segments are one handle each");
        }
        // All but the hole's cached segment, which sleep gave back for good.
        assert_eq!(
            pool.stats().reserved_bytes.all.current,
            before - 2 * MIB as i64
        );
    }
    // Whole allocations compared once, not only sampled.
    for (i, &(p, n)) in weights.iter().enumerate() {
        if n <= 6 * MIB + 5 {
            let bytes = read(&device, p, n);
            pool.sleep("weights", SleepMode::Keep).expect("sleep");
            pool.wake("weights").expect("wake");
            assert_eq!(read(&device, p, n), bytes, "allocation {i}");
        }
    }
    for (p, _) in weights {
        pool.free(p).expect("free");
    }
    pool.free(other).expect("free");
    pool.empty_cache().expect("empty_cache");
    check(&pool);
    assert_eq!(pool.stats().reserved_bytes.all.current, 0);
    drop(pool);
    assert_eq!(host.live_objects(), (0, 0, 0));
    assert_eq!(host.live_pinned(), 0, "host buffers freed with the pool");
}

#[test]
fn pageable_host_buffers_go_through_the_copy_engine() {
    let host = host_device(512 * MIB);
    let device: SharedDevice = host.clone();
    let config = Config {
        sleep_host: SleepHost::Pageable,
        ..Config::default()
    };
    let pool = Pool::new(device.clone(), config).expect("pool");
    let weights = fill(&pool, &device, "w", &[48 * MIB, 6 * MIB + 1, 300], 70);
    let whole = read(&device, weights[0].0, 48 * MIB);
    for cycle in 0..10 {
        pool.sleep("w", SleepMode::Keep).expect("sleep");
        assert!(pool.region_info("w").expect("w").host_bytes >= 54 * MIB);
        pool.wake("w").expect("wake");
        assert!(intact(&device, &weights, 70), "cycle {cycle}");
        check(&pool);
    }
    assert_eq!(read(&device, weights[0].0, 48 * MIB), whole);
    free_and_drop(pool, &host, weights);
}

#[test]
fn pinned_copies_relay_through_a_peer_where_there_is_one() {
    let host = Arc::new(
        HostDevice::new(
            0,
            glake::device::host::HostOptions {
                total_memory: 512 * MIB,
                device_count: 2,
                ..Default::default()
            },
        )
        .expect("host device"),
    );
    let device: SharedDevice = host.clone();
    let pool = Pool::new(device.clone(), Config::default()).expect("pool");
    let weights = fill(&pool, &device, "w", &[96 * MIB, 40 * MIB + 3, 700], 40);
    for cycle in 0..5 {
        pool.sleep("w", SleepMode::Keep).expect("sleep");
        assert_eq!(pool.region_info("w").expect("w").resident_bytes, 0);
        pool.wake("w").expect("wake");
        assert!(intact(&device, &weights, 40), "cycle {cycle}");
        check(&pool);
    }
    let stats = pool.sleep_transfer_stats().expect("an engine with a relay");
    assert!(stats.relay_bytes > 0, "the peer carried part: {stats:?}");
    free_and_drop(pool, &host, weights);
}

/// A pool on a fault device over host device 0 of a pretended two-device host (so sleep can
/// relay through device 1): the host device, it as the seam, the fault device and the pool.
fn two_device_faulty_pool() -> (Arc<HostDevice>, SharedDevice, Arc<FaultDevice>, Pool) {
    let options = glake::device::host::HostOptions {
        total_memory: 256 * MIB,
        device_count: 2,
        ..Default::default()
    };
    let host = Arc::new(HostDevice::new(0, options).expect("host device"));
    let raw: SharedDevice = host.clone();
    let fault = Arc::new(FaultDevice::new(raw.clone()));
    let pool = Pool::new(fault.clone() as SharedDevice, Config::default()).expect("pool");
    (host, raw, fault, pool)
}

/// A copy of a relayed sleep failing halfway (on the driver's route, which small regions take):
/// the sleep reports it after the copies queued before it are waited for, loses nothing, and a
/// second sleep completes; nothing is left when the pool goes.
#[test]
fn a_relayed_sleep_whose_copy_fails_loses_nothing() {
    let (host, raw, fault, pool) = two_device_faulty_pool();
    let weights = fill(&pool, &raw, "w", &[4 * MIB, 2 * MIB + 9, 700], 50);
    // The engine and the host buffers first: the failure is one of the sleep's own copies.
    pool.prepare_sleep("w").expect("prepare");
    fault.fail_nth(CallKind::Copy, 2);
    assert!(
        pool.sleep("w", SleepMode::Keep).is_err(),
        "the failure is reported"
    );
    assert!(fault.injected() == 1);
    check(&pool);
    pool.sleep("w", SleepMode::Keep).expect("sleep again");
    assert!(
        pool.sleep_transfer_stats().is_some(),
        "through the relaying engine"
    );
    pool.wake("w").expect("wake");
    assert!(intact(&raw, &weights, 50), "bytes kept");
    free_and_drop(pool, &host, weights);
}

/// An engine that cannot start (its staging cannot be pinned) leaves a pinned sleep on the
/// driver's copies over one link: the sleep still succeeds.
#[test]
fn a_pinned_sleep_goes_on_without_an_engine_that_cannot_start() {
    let (host, raw, fault, pool) = two_device_faulty_pool();
    let weights = fill(&pool, &raw, "w", &[40 * MIB, 300], 60);
    fault.fail_nth(CallKind::Pinned, 1);
    pool.sleep("w", SleepMode::Keep)
        .expect("sleep without the engine");
    assert_eq!(fault.injected(), 1);
    assert!(pool.sleep_transfer_stats().is_none());
    pool.wake("w").expect("wake");
    assert!(intact(&raw, &weights, 60));
    free_and_drop(pool, &host, weights);
}

#[test]
fn pinned_copies_on_one_device_need_no_engine() {
    let (_host, device, pool) = setup(256 * MIB);
    let weights = fill(&pool, &device, "w", &[64 * MIB], 3);
    pool.sleep("w", SleepMode::Keep).expect("sleep");
    pool.wake("w").expect("wake");
    assert!(intact(&device, &weights, 3));
    assert!(pool.sleep_transfer_stats().is_none());
}

#[test]
fn prepared_host_memory_serves_the_first_sleep_of_either_kind() {
    for sleep_host in [SleepHost::Pinned, SleepHost::Pageable] {
        let host = host_device(512 * MIB);
        let device: SharedDevice = host.clone();
        let fault = Arc::new(FaultDevice::new(device.clone()));
        let config = Config {
            sleep_host,
            ..Config::default()
        };
        let pool = Pool::new(fault.clone() as SharedDevice, config).expect("pool");
        let weights = fill(&pool, &device, "w", &[48 * MIB, 6 * MIB + 1, 300], 9);
        let segments = pool.region_info("w").expect("w").segments;
        let made = pool.prepare_sleep("w").expect("prepare");
        assert!(made >= 54 * MIB, "{sleep_host:?}: {made}");
        assert_eq!(pool.prepare_sleep("w").expect("again"), 0, "made once");
        if sleep_host == SleepHost::Pinned {
            assert_eq!(host.live_pinned(), segments, "a buffer per segment");
        }
        let pinned = host.live_pinned();
        // The first sleep makes no host memory: every buffer is there.
        let calls = common::calls_made(&fault, || {
            pool.sleep("w", SleepMode::Keep).expect("sleep");
        });
        assert!(
            !calls.iter().any(|&(k, n)| k == CallKind::Pinned && n > 0),
            "{sleep_host:?}: the sleep pinned memory: {calls:?}"
        );
        assert_eq!(host.live_pinned(), pinned);
        assert_eq!(pool.region_info("w").expect("w").host_bytes, made);
        pool.wake("w").expect("wake");
        assert!(intact(&device, &weights, 9), "{sleep_host:?}");
        assert!(pool.prepare_sleep("unknown").is_err());
        free_and_drop(pool, &host, weights);
    }
}

#[test]
fn a_default_region_takes_every_allocation_made_outside_another() {
    let host = host_device(512 * MIB);
    let device: SharedDevice = host.clone();
    let config = Config {
        default_region: Some("process".into()),
        ..Config::default()
    };
    let pool = Pool::new(device.clone(), config).expect("pool");
    let big = pool.malloc(12 * MIB, S).expect("big");
    let small = pool.malloc(1000, S).expect("small");
    write_pattern(&device, big, 12 * MIB, 81);
    write_pattern(&device, small, 1000, 82);
    let kv = fill(&pool, &device, "kv", &[4 * MIB], 83);
    let process = pool.region_info("process").expect("made with the pool");
    assert!(process.allocated_bytes >= 12 * MIB + 1000, "{process:?}");
    assert_eq!(pool.region_info("kv").expect("kv").allocated_bytes, 4 * MIB);
    pool.sleep("process", SleepMode::Keep).expect("sleep");
    // Everything outside "kv" sleeps; "kv" stays; a new allocation outside it is refused.
    assert_eq!(
        pool.stats().reserved_bytes.all.current,
        pool.region_info("kv").expect("kv").resident_bytes as i64
    );
    assert_eq!(
        pool.malloc(MIB, S).expect_err("asleep").kind(),
        ErrorKind::InvalidState
    );
    assert!(intact(&device, &kv, 83));
    pool.wake("process").expect("wake");
    assert!(has_pattern(&device, big, 12 * MIB, 81));
    assert!(has_pattern(&device, small, 1000, 82));
    check(&pool);
    let bad = Config {
        default_region: Some(String::new()),
        ..Config::default()
    };
    assert_eq!(
        Pool::new(device.clone(), bad).err().map(|e| e.kind()),
        Some(ErrorKind::InvalidArgument)
    );
}

#[test]
fn regions_sleep_apart_and_drop_mode_keeps_no_bytes() {
    let (host, device, pool) = setup(512 * MIB);
    let weights = fill(&pool, &device, "weights", &[16 * MIB, 3 * MIB], 10);
    let cache = fill(&pool, &device, "kv", &[32 * MIB], 20);
    assert_eq!(pool.region_names(), ["weights", "kv"]);
    let pinned = host.live_pinned();
    pool.sleep("kv", SleepMode::Drop).expect("sleep kv");
    assert_eq!(host.live_pinned(), pinned, "drop mode copies nothing");
    assert_eq!(pool.region_info("kv").expect("kv").host_bytes, 0);
    assert!(
        intact(&device, &weights, 10),
        "the other region stays awake"
    );
    pool.sleep("weights", SleepMode::Keep)
        .expect("sleep weights");
    assert!(pool.region_info("weights").expect("w").host_bytes >= 19 * MIB);
    pool.wake("kv").expect("wake kv");
    // The KV cache's memory is usable again at the same address; its bytes were dropped.
    write_pattern(&device, cache[0].0, 32 * MIB, 21);
    assert!(has_pattern(&device, cache[0].0, 32 * MIB, 21));
    pool.wake("weights").expect("wake weights");
    assert!(intact(&device, &weights, 10));
    check(&pool);
}

/// Allocates `size` in region `name`; returns the pointer and its stitched pieces (0: not
/// stitched).
fn malloc_in_region(pool: &Pool, name: &str, size: usize) -> (DevicePtr, u32) {
    pool.begin_region(name).expect("begin");
    let made = pool
        .malloc_in_with_pieces(size, size, S, None)
        .expect("malloc");
    pool.end_region().expect("end");
    made
}

/// A region stitches its own free segments for a larger request (no new memory), never the
/// shared pool's nor the other way round; the stitched allocation sleeps and wakes with its
/// region at its address and with its bytes, in both modes and over many cycles; freed while
/// asleep, its range goes; and nothing of the region's physical memory stays mapped while it
/// sleeps.
#[test]
fn a_region_stitches_its_own_free_segments_and_they_sleep_and_wake_with_it() {
    let (host, device, pool) = setup(512 * MIB);
    let kept = fill(
        &pool,
        &device,
        "kv",
        &[8 * MIB, 8 * MIB, 8 * MIB, 6 * MIB],
        60,
    );
    for &(p, _) in [kept[0], kept[2]].iter() {
        pool.free(p).expect("free");
    }
    let reserved = pool.stats().reserved_bytes.all.current;
    // 16 MiB from the two free 8 MiB segments of the region.
    let (stitched, pieces) = malloc_in_region(&pool, "kv", 16 * MIB);
    assert!(
        pieces >= 2,
        "stitched from the region's free segments: {pieces}"
    );
    assert_eq!(
        pool.stats().reserved_bytes.all.current,
        reserved,
        "no new memory"
    );
    write_pattern(&device, stitched, 16 * MIB, 70);
    let live = [
        (kept[1].0, 8 * MIB, 61),
        (kept[3].0, 6 * MIB, 63),
        (stitched, 16 * MIB, 70),
    ];
    let all_intact = || {
        live.iter()
            .all(|&(p, n, seed)| has_pattern(&device, p, n, seed))
    };
    let info = pool.region_info("kv").expect("info");
    assert_eq!(
        info.allocated_bytes,
        30 * MIB,
        "the stitched allocation counts: {info:?}"
    );

    // The shared pool does not stitch the region's free memory, nor the region the shared
    // pool's.
    let (loose, _) = malloc_in_region(&pool, "kv", 12 * MIB);
    let shared_a = pool.malloc(8 * MIB, S).expect("shared");
    let shared_b = pool.malloc(8 * MIB, S).expect("shared");
    pool.free(loose).expect("free");
    let reserved = || pool.stats().reserved_bytes.all.current as usize;
    let before = reserved();
    let shared = pool.malloc(16 * MIB, S).expect("shared");
    let why = "the region's free 12 MiB segment is not the shared pool's";
    assert_eq!(reserved(), before + 16 * MIB, "{why}");
    pool.free(shared_a).expect("free");
    pool.free(shared_b).expect("free");
    let before = reserved();
    // The region's free 12 MiB segment and 2 MiB of new memory, not the shared free 16 MiB.
    let (region_only, pieces) = malloc_in_region(&pool, "kv", 14 * MIB);
    assert_eq!(pieces, 2);
    let why = "the shared pool's free 16 MiB is not the region's";
    assert_eq!(reserved(), before + 2 * MIB, "{why}");
    pool.free(region_only).expect("free");
    pool.free(shared).expect("free");

    let stitches = pool.stats().stitched_blocks.current;
    let mapped = pool.stats().stitched_mapped_bytes.current;
    for cycle in 0..20 {
        let created = host.created_bytes();
        let info = pool.region_info("kv").expect("info");
        pool.sleep("kv", SleepMode::Keep).expect("sleep");
        check(&pool);
        assert_eq!(
            host.created_bytes(),
            created - info.resident_bytes,
            "cycle {cycle}: every byte of the region is back, stitched range included"
        );
        // A sleeping range maps nothing: only the shared pool's ranges count as mapped.
        assert!(pool.stats().stitched_mapped_bytes.current <= mapped - 16 * MIB as i64);
        pool.wake("kv").expect("wake");
        check(&pool);
        assert!(all_intact(), "cycle {cycle}: bytes differ");
    }
    // The region's idle stitched range (the freed 14 MiB) went with its first sleep; the one
    // in use stays.
    assert_eq!(pool.stats().stitched_blocks.current, stitches - 1);
    // Written through the stitched range after a wake, read back after the next one: the
    // range maps the pieces the sleep saved.
    write_pattern(&device, stitched, 16 * MIB, 71);
    pool.sleep("kv", SleepMode::Keep).expect("sleep");
    pool.wake("kv").expect("wake");
    assert!(has_pattern(&device, stitched, 16 * MIB, 71));
    // Drop mode: the range is usable again at its address (the region's bytes are gone, so
    // the others are written again too).
    pool.sleep("kv", SleepMode::Drop).expect("sleep");
    pool.wake("kv").expect("wake");
    for &(p, n, seed) in &live {
        write_pattern(&device, p, n, seed);
    }
    assert!(all_intact());
    // Freed while asleep: its range goes when the region wakes.
    let before = pool.stats().stitched_blocks.current;
    pool.sleep("kv", SleepMode::Keep).expect("sleep");
    pool.free(stitched).expect("free while asleep");
    check(&pool);
    pool.wake("kv").expect("wake");
    check(&pool);
    assert_eq!(pool.stats().stitched_blocks.current, before - 1);
    assert!(has_pattern(&device, kept[1].0, 8 * MIB, 61));
    assert!(has_pattern(&device, kept[3].0, 6 * MIB, 63));
    free_and_drop(pool, &host, vec![kept[1], kept[3]]);
}

/// A region's stitch may begin in the free end of a segment whose front is allocated (a
/// region's segments are one handle each): the range maps that handle whole, and it sleeps
/// and wakes with the region with every byte, its allocated front's included, while nothing of
/// the region stays made during a sleep.
#[test]
fn a_region_stitch_that_begins_inside_a_handle_sleeps_and_wakes_with_it() {
    let (host, device, pool) = setup(512 * MIB);
    for (p, _) in fill(&pool, &device, "kv", &[24 * MIB, 24 * MIB], 0) {
        pool.free(p).expect("free");
    }
    let kept = fill(&pool, &device, "kv", &[16 * MIB, 16 * MIB], 90);
    let reserved = pool.stats().reserved_bytes.all.current;
    // Each segment has 8 MiB free after its allocation: no whole handle is free.
    let (stitched, pieces) = malloc_in_region(&pool, "kv", 20 * MIB);
    assert!(pieces >= 2, "stitched: {pieces}");
    let grown = pool.stats().reserved_bytes.all.current - reserved;
    assert!(
        grown < 20 * MIB as i64,
        "the free ends served part of the request: {grown}"
    );
    let snap = pool.snapshot();
    let info = snap
        .stitched
        .iter()
        .find(|s| s.address == stitched)
        .unwrap();
    let segment_starts: Vec<DevicePtr> = snap.segments.iter().map(|s| s.address).collect();
    assert!(
        !segment_starts.contains(&info.pieces[0].0),
        "the first piece starts inside a handle: {info:?}"
    );
    write_pattern(&device, stitched, 20 * MIB, 95);
    let live = [
        (kept[0].0, 16 * MIB, 90),
        (kept[1].0, 16 * MIB, 91),
        (stitched, 20 * MIB, 95),
    ];
    let all_intact = || {
        live.iter()
            .all(|&(p, n, seed)| has_pattern(&device, p, n, seed))
    };
    assert!(all_intact());
    for mode in [SleepMode::Keep, SleepMode::Keep, SleepMode::Drop] {
        let created = host.created_bytes();
        let info = pool.region_info("kv").expect("info");
        pool.sleep("kv", mode).expect("sleep");
        check(&pool);
        assert_eq!(host.created_bytes(), created - info.resident_bytes);
        pool.wake("kv").expect("wake");
        check(&pool);
        if mode == SleepMode::Drop {
            for &(p, n, seed) in &live {
                write_pattern(&device, p, n, seed);
            }
        }
        assert!(all_intact(), "{mode:?}");
    }
    pool.free(stitched).expect("free");
    free_and_drop(pool, &host, kept);
}

/// A region serves a request from an idle stitched range only when the request reaches the
/// range's last piece: a piece left free under a range in use could have its segment given
/// back (by the sleep itself, or `empty_cache`) while the range maps it, and the wake could not
/// map it again. Granting a peer access while the region sleeps leaves its sleeping range
/// alone, and the wake maps it with that access.
#[test]
fn a_region_reuses_stitched_ranges_whole_and_its_sleeping_ranges_take_later_peer_access() {
    let (host, raw, _fault, pool) = two_device_faulty_pool();
    let kept = fill(&pool, &raw, "kv", &[8 * MIB, 8 * MIB, 8 * MIB, 6 * MIB], 80);
    for &(p, _) in &kept[..3] {
        pool.free(p).expect("free");
    }
    let (wide, pieces) = malloc_in_region(&pool, "kv", 24 * MIB);
    assert_eq!(pieces, 3);
    pool.free(wide).expect("free");
    let (narrow, _) = malloc_in_region(&pool, "kv", 12 * MIB);
    assert_ne!(
        narrow, wide,
        "the 24 MiB range would leave its last piece free"
    );
    write_pattern(&raw, narrow, 12 * MIB, 90);
    check(&pool);
    pool.sleep("kv", SleepMode::Keep).expect("sleep");
    check(&pool);
    pool.enable_peer_access(1)
        .expect("peer access while asleep");
    pool.wake("kv").expect("wake");
    check(&pool);
    assert!(has_pattern(&raw, narrow, 12 * MIB, 90));
    assert!(has_pattern(&raw, kept[3].0, 6 * MIB, 83));
    pool.empty_cache().expect("empty_cache");
    check(&pool);
    pool.sleep("kv", SleepMode::Drop).expect("sleep");
    pool.wake("kv").expect("wake");
    write_pattern(&raw, narrow, 12 * MIB, 91);
    assert!(has_pattern(&raw, narrow, 12 * MIB, 91));
    // A range of the size asked is reused whole.
    pool.free(narrow).expect("free");
    let (again, _) = malloc_in_region(&pool, "kv", 12 * MIB);
    assert_eq!(again, narrow, "reused");
    check(&pool);
    free_and_drop(pool, &host, vec![(again, 12 * MIB), kept[3]]);
}

/// Holds every Map call while `hold` is set.
#[derive(Default)]
struct HeldMaps {
    hold: std::sync::atomic::AtomicBool,
    waiting: std::sync::atomic::AtomicUsize,
}

impl glake::device::interpose::Interposer for HeldMaps {
    fn around<T>(
        &self,
        kind: CallKind,
        _site: &'static std::panic::Location<'static>,
        call: impl FnOnce() -> glake::Result<T>,
    ) -> glake::Result<T> {
        use std::sync::atomic::Ordering::SeqCst;
        // Only maps made while held count: the ones that made the region's segments before
        // must not tell the test that the stitch is under way.
        if kind == CallKind::Map && self.hold.load(SeqCst) {
            self.waiting.fetch_add(1, SeqCst);
            while self.hold.load(SeqCst) {
                std::thread::yield_now();
            }
        }
        call()
    }
}

/// A sleep of a region asked for while another thread's stitch in that region is being
/// mapped waits for it: the stitched allocation sleeps and wakes with the region (a stitch
/// mapped outside the pool's lock would be booked awake in a sleeping region, over memory the
/// sleep gave back).
#[test]
fn a_sleep_waits_for_a_stitch_of_its_region_in_progress() {
    use std::sync::atomic::Ordering::SeqCst;
    let host = host_device(512 * MIB);
    let held = Arc::new(glake::device::interpose::Interposed::with(
        host.clone(),
        HeldMaps::default(),
    ));
    let raw: SharedDevice = host.clone();
    let pool = Arc::new(Pool::new(held.clone() as SharedDevice, Config::default()).expect("pool"));
    let parts = fill(&pool, &raw, "kv", &[8 * MIB, 8 * MIB, 6 * MIB], 100);
    pool.free(parts[0].0).expect("free");
    pool.free(parts[1].0).expect("free");
    held.hook().hold.store(true, SeqCst);
    let stitcher = {
        let pool = pool.clone();
        // Two free 8 MiB segments and 4 MiB of new memory.
        std::thread::spawn(move || malloc_in_region(&pool, "kv", 20 * MIB))
    };
    while held.hook().waiting.load(SeqCst) == 0 {
        std::thread::yield_now();
    }
    let sleeper = {
        let pool = pool.clone();
        std::thread::spawn(move || pool.sleep("kv", SleepMode::Keep))
    };
    // Long enough for a sleep that did not wait to be over.
    std::thread::sleep(Duration::from_millis(300));
    held.hook().hold.store(false, SeqCst);
    let (stitched, pieces) = stitcher.join().expect("stitcher");
    assert!(pieces >= 2);
    sleeper.join().expect("sleeper").expect("sleep");
    check(&pool);
    let info = pool.region_info("kv").expect("info");
    assert!(info.asleep && info.resident_bytes == 0, "{info:?}");
    pool.wake("kv").expect("wake");
    write_pattern(&raw, stitched, 20 * MIB, 101);
    pool.sleep("kv", SleepMode::Keep).expect("sleep");
    pool.wake("kv").expect("wake");
    check(&pool);
    assert!(
        has_pattern(&raw, stitched, 20 * MIB, 101),
        "the stitched bytes slept"
    );
    assert!(has_pattern(&raw, parts[2].0, 6 * MIB, 102));
}

#[test]
fn misuse_gets_a_clear_status_and_changes_nothing() {
    let (_host, device, pool) = setup(256 * MIB);
    let kind = |r: glake::Result<()>| r.expect_err("refused").kind();
    assert_eq!(
        kind(pool.sleep("nothing", SleepMode::Keep)),
        ErrorKind::InvalidArgument
    );
    assert_eq!(kind(pool.wake("nothing")), ErrorKind::InvalidArgument);
    assert_eq!(kind(pool.begin_region("")), ErrorKind::InvalidArgument);
    assert_eq!(
        kind(pool.begin_region(&"x".repeat(256))),
        ErrorKind::InvalidArgument
    );
    assert_eq!(kind(pool.end_region()), ErrorKind::InvalidState);
    let weights = fill(&pool, &device, "w", &[4 * MIB], 3);
    assert_eq!(kind(pool.wake("w")), ErrorKind::InvalidState, "awake");
    pool.sleep("w", SleepMode::Keep).expect("sleep");
    assert_eq!(
        kind(pool.sleep("w", SleepMode::Keep)),
        ErrorKind::InvalidState,
        "double sleep"
    );
    // No allocation in a sleeping region; the shared pool is not affected.
    pool.begin_region("w").expect("begin");
    let refused = pool.malloc(MIB, S).expect_err("asleep");
    assert_eq!(refused.kind(), ErrorKind::InvalidState);
    assert!(refused.to_string().contains("asleep"), "{refused}");
    pool.end_region().expect("end");
    let shared = pool.malloc(MIB, S).expect("shared pool");
    pool.free(shared).expect("free");
    pool.wake("w").expect("wake");
    assert!(intact(&device, &weights, 3));
    check(&pool);
}

#[test]
fn regions_are_per_thread_and_nest() {
    let (_host, _device, pool) = setup(256 * MIB);
    let pool = Arc::new(pool);
    pool.begin_region("outer").expect("begin");
    pool.begin_region("inner").expect("begin");
    let a = pool.malloc(2 * MIB, S).expect("a");
    // Another thread allocates in the shared pool meanwhile.
    let other = {
        let pool = pool.clone();
        std::thread::spawn(move || pool.malloc(2 * MIB, S).expect("b"))
            .join()
            .expect("thread")
    };
    pool.end_region().expect("end inner");
    let b = pool.malloc(2 * MIB, S).expect("c");
    pool.end_region().expect("end outer");
    let info = |n: &str| pool.region_info(n).expect("info").allocated_bytes;
    assert_eq!(info("inner"), 2 * MIB);
    assert_eq!(info("outer"), 2 * MIB);
    pool.sleep("inner", SleepMode::Drop).expect("sleep");
    assert_eq!(
        pool.region_info("outer").expect("o").resident_bytes,
        2 * MIB
    );
    for p in [a, b, other] {
        pool.free(p).expect("free");
    }
    // `a` was freed while asleep: wake forgets its segment instead of mapping it again.
    pool.wake("inner").expect("wake");
    assert_eq!(pool.region_info("inner").expect("i").segments, 0);
    check(&pool);
}

#[test]
fn sleep_waits_for_queued_work_and_empty_cache_leaves_sleepers_alone() {
    let (host, device, pool) = setup(256 * MIB);
    let stream = device.create_stream().expect("stream");
    pool.begin_region("w").expect("begin");
    let p = pool.malloc(8 * MIB, stream).expect("malloc");
    pool.end_region().expect("end");
    // A copy held behind a slow host function on the allocation's stream: sleep must see it.
    let bytes = pattern(5, 8 * MIB);
    host.enqueue_host_fn(
        stream,
        Box::new(|| std::thread::sleep(Duration::from_millis(100))),
    )
    .expect("gate");
    unsafe { device.copy_to_device(p, bytes.as_ptr(), bytes.len(), stream) }.expect("copy");
    pool.sleep("w", SleepMode::Keep).expect("sleep");
    pool.empty_cache().expect("empty_cache");
    check(&pool);
    // Snapshots show a sleeping segment: its range, its allocation, no physical handles.
    let snapshot = pool.snapshot();
    let segment = snapshot
        .segments
        .iter()
        .find(|s| s.address <= p && p < s.address + s.total_size as u64)
        .expect("the sleeping segment is in the snapshot");
    assert!(segment.chunk_sizes.is_empty() && segment.allocated_size >= 8 * MIB);
    assert!(snapshot.to_json().contains("segments"));
    pool.wake("w").expect("wake");
    assert_eq!(read(&device, p, 8 * MIB), bytes);
    pool.free(p).expect("free");
    device.destroy_stream(stream).expect("destroy");
}

/// A pool on a fault-injecting host device (`raw` underneath, for the test's own reads) with
/// region "w": three filled allocations (`weights`) and a cached free segment, which sleep
/// releases.
struct Faulty {
    host: Arc<HostDevice>,
    raw: SharedDevice,
    fault: Arc<FaultDevice>,
    pool: Pool,
    weights: Vec<(DevicePtr, usize)>,
}

/// A [`Faulty`] region, asleep when `asleep`.
fn faulty_region(asleep: bool) -> Faulty {
    let host = host_device(256 * MIB);
    let raw: SharedDevice = host.clone();
    let fault = Arc::new(FaultDevice::new(raw.clone()));
    let pool = Pool::new(fault.clone() as SharedDevice, Config::default()).expect("pool");
    let mut weights = fill(&pool, &raw, "w", &[6 * MIB, 20 * MIB, 3000], 40);
    // A stitched allocation of two free segments of the region, with its pattern.
    let pieces = fill(&pool, &raw, "w", &[4 * MIB, 4 * MIB], 0);
    for (p, _) in pieces {
        pool.free(p).expect("free");
    }
    let (stitched, count) = malloc_in_region(&pool, "w", 8 * MIB);
    assert_eq!(count, 2, "stitched");
    write_pattern(&raw, stitched, 8 * MIB, 40 + weights.len() as u64);
    weights.push((stitched, 8 * MIB));
    pool.begin_region("w").expect("begin");
    let idle = pool.malloc(10 * MIB, S).expect("idle");
    pool.end_region().expect("end");
    pool.free(idle).expect("free");
    if asleep {
        pool.sleep("w", SleepMode::Keep).expect("sleep");
    }
    Faulty {
        host,
        raw,
        fault,
        pool,
        weights,
    }
}

/// Pinned copies out are waited for batch by batch and each batch's segments unmapped as soon
/// as they are done: when the copies of a later batch cannot be waited for at all (its
/// event, the stream and the device all fail), the segments copied before stay asleep and the
/// rest stay awake with their bytes. Sleeping again finishes, and so does waking instead; the
/// buffers whose copies could not be waited for are kept for good.
#[test]
fn a_sleep_unmaps_range_by_range_and_a_failed_wait_leaves_the_rest_awake() {
    for sleep_again in [true, false] {
        let Faulty {
            host,
            raw,
            fault,
            pool,
            weights,
        } = faulty_region(false);
        let pinned_before = host.live_pinned();
        // The sleep's first device-wide wait is the one before its copies.
        fault.fail_nth_after_call(CallKind::SynchronizeEvent, 2);
        fault.fail_nth_after_call(CallKind::SynchronizeStream, 1);
        fault.fail_nth_after_call(CallKind::SynchronizeDevice, 2);
        let result = pool.sleep("w", SleepMode::Keep);
        fault.clear();
        assert!(result.is_err(), "the failed wait is reported");
        assert_eq!(fault.injected(), 3);
        check(&pool);
        let info = pool.region_info("w").expect("info");
        assert!(info.asleep, "asleep in part");
        assert!(info.asleep_bytes > 0, "the first batch slept: {info:?}");
        assert!(info.resident_bytes > 0, "later batches stayed: {info:?}");
        if sleep_again {
            // A buffer was made for each segment; those of the segments still awake are not
            // reused.
            let segments = info.segments;
            pool.sleep("w", SleepMode::Keep).expect("sleep again");
            let info = pool.region_info("w").expect("info");
            assert_eq!(info.resident_bytes, 0, "{info:?}");
            assert!(
                host.live_pinned() - pinned_before > segments,
                "the buffers whose copies were not waited for are not reused"
            );
        }
        pool.wake("w").expect("wake");
        let info = pool.region_info("w").expect("info");
        assert!(!info.asleep && info.asleep_bytes == 0, "{info:?}");
        assert!(
            intact(&raw, &weights, 40),
            "bytes kept (slept again: {sleep_again})"
        );
        check(&pool);
    }
}

/// The call of a sleep's life a fault sweep fails calls in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Making host memory ahead of the first sleep.
    Prepare,
    Sleep,
    Wake,
}

/// One sleep and wake of a two-segment region with the `n`-th call of `kind` failing during
/// `stage` (a prepared region then sleeps): the call reports an error or completes, nothing
/// is lost, the pool stays consistent, a retry completes and nothing leaks.
fn fault_run(kind: CallKind, n: u64, then: Option<u64>, stage: Stage) -> Arc<FaultDevice> {
    let in_wake = stage == Stage::Wake;
    let Faulty {
        host,
        raw,
        fault,
        pool,
        weights,
    } = faulty_region(in_wake);
    fault.fail_nth(kind, n);
    if let Some(j) = then {
        fault.fail_after_failure(j);
    }
    let result = match stage {
        Stage::Prepare => pool.prepare_sleep("w").map(|_| ()),
        Stage::Sleep => pool.sleep("w", SleepMode::Keep),
        Stage::Wake => pool.wake("w"),
    };
    fault.clear();
    let what = format!("{kind:?} #{n} (then call {then:?} after it) of {stage:?}");
    pool.check_invariants()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let asleep = pool.region_info("w").expect("info").asleep;
    match stage {
        Stage::Wake => assert_eq!(result.is_err(), asleep, "{what}: {result:?}"),
        // A failed sleep is finished by sleeping again.
        Stage::Sleep if result.is_err() => pool
            .sleep("w", SleepMode::Keep)
            .unwrap_or_else(|e| panic!("{what}: sleep again: {e}")),
        Stage::Sleep => {}
        Stage::Prepare => {
            assert!(!asleep, "{what}");
            if result.is_err() {
                pool.prepare_sleep("w")
                    .unwrap_or_else(|e| panic!("{what}: prepare again: {e}"));
            }
            pool.sleep("w", SleepMode::Keep)
                .unwrap_or_else(|e| panic!("{what}: sleep after prepare: {e}"));
        }
    }
    if pool.region_info("w").expect("info").asleep {
        pool.wake("w")
            .unwrap_or_else(|e| panic!("{what}: wake after the fault: {e}"));
    }
    pool.check_invariants()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(intact(&raw, &weights, 40), "{what}: bytes lost");
    for (p, _) in weights {
        pool.free(p).expect("free");
    }
    pool.empty_cache().expect("empty_cache");
    assert_eq!(pool.stats().reserved_bytes.all.current, 0, "{what}");
    drop(pool);
    assert_eq!(
        host.live_objects(),
        (0, 0, 0),
        "{what}: driver objects leaked"
    );
    assert_eq!(host.created_bytes(), 0, "{what}");
    // Buffers whose copies neither their stream nor the device could be waited for are kept
    // for good by design (a copy may still write into them).
    let failed: Vec<CallKind> = fault.sites_failed().iter().map(|s| s.kind).collect();
    let unsettled = failed.contains(&CallKind::SynchronizeStream)
        && failed.contains(&CallKind::SynchronizeDevice);
    if !unsettled {
        assert_eq!(host.live_pinned(), 0, "{what}: pinned buffers leaked");
    }
    fault
}

/// A pool with region "w" asleep dropped with the `n`-th call of `kind` failing (and the
/// `then`-th after it): the drop gives every physical chunk, mapping, reservation and pinned
/// buffer back, and the sleep stream unless destroying it is what failed.
fn drop_run(kind: CallKind, n: u64, then: Option<u64>) -> Arc<FaultDevice> {
    let Faulty {
        host, fault, pool, ..
    } = faulty_region(true);
    fault.fail_nth(kind, n);
    if let Some(j) = then {
        fault.fail_after_failure(j);
    }
    drop(pool);
    fault.clear();
    let what = format!("{kind:?} #{n} (then call {then:?} after it) of the drop");
    let failed: Vec<CallKind> = fault.sites_failed().iter().map(|s| s.kind).collect();
    // When two waits for the device fail in a row (the tear-down's release and its retry),
    // whether queued work still uses the memory cannot be known: it is left to the driver, by
    // design.
    let device_lost =
        fault.injected() == 2 && failed.iter().all(|&k| k == CallKind::SynchronizeDevice);
    if !device_lost {
        assert_eq!(
            host.live_objects(),
            (0, 0, 0),
            "{what}: driver objects leaked"
        );
        assert_eq!(host.created_bytes(), 0, "{what}");
    }
    if !failed.contains(&CallKind::Pinned) {
        assert_eq!(host.live_pinned(), 0, "{what}: pinned buffers leaked");
    }
    if !failed.contains(&CallKind::DestroyStream) {
        assert_eq!(host.live_streams(), 1, "{what}: the sleep stream is left");
    }
    fault
}

/// The calls of each kind one prepare, sleep or wake makes, counted on a clean run.
fn calls_of(stage: Stage) -> Vec<(CallKind, u64)> {
    let Faulty { fault, pool, .. } = faulty_region(stage == Stage::Wake);
    common::calls_made(&fault, || match stage {
        Stage::Prepare => {
            pool.prepare_sleep("w").expect("prepare");
        }
        Stage::Sleep => pool.sleep("w", SleepMode::Keep).expect("sleep"),
        Stage::Wake => pool.wake("w").expect("wake"),
    })
}

/// Each driver call of a sleep, of a wake and of dropping a pool while asleep failing in turn
/// (and each call right after a failure): nothing is lost, a retry completes and nothing
/// leaks. Every call site the
/// inventory gives this sweep is failed.
#[test]
fn a_fault_at_each_driver_call_of_a_sleep_or_a_wake_loses_nothing() {
    let mut swept = common::sites::Swept::new("sleep");
    for stage in [Stage::Prepare, Stage::Sleep, Stage::Wake] {
        let calls = calls_of(stage);
        let expected: &[CallKind] = match stage {
            Stage::Prepare => &[CallKind::Pinned],
            Stage::Sleep => &[
                CallKind::SynchronizeDevice,
                CallKind::Copy,
                CallKind::CreateEvent,
                CallKind::RecordEvent,
                CallKind::SynchronizeEvent,
                CallKind::Unmap,
                CallKind::ReleasePhysical,
                CallKind::Unreserve,
            ],
            Stage::Wake => &[
                CallKind::CreatePhysical,
                CallKind::Map,
                CallKind::SetAccess,
                CallKind::Copy,
                CallKind::SynchronizeStream,
            ],
        };
        common::sweep_every_call(
            &format!("{stage:?}"),
            &calls,
            expected,
            1,
            &mut swept,
            |kind, n, then| fault_run(kind, n, then, stage),
        );
    }
    let calls = {
        let Faulty { fault, pool, .. } = faulty_region(true);
        common::calls_made(&fault, || drop(pool))
    };
    common::sweep_every_call(
        "drop while asleep",
        &calls,
        &[CallKind::DestroyStream, CallKind::Pinned],
        1,
        &mut swept,
        drop_run,
    );
    swept.assert_covers(None);
}
