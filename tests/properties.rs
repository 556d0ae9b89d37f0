//! Property tests: random sequences of pool operations, on one to four threads sharing one
//! pool, checked against a shadow model of the live allocations.
//!
//! Each thread keeps its own list of live (pointer, size, seed) and writes a byte pattern into
//! every allocation; the patterns must survive everything the other operations do (splits,
//! stitches, reuse of cached stitched blocks, `empty_cache`, out-of-memory retries). A shared map
//! of live ranges checks that no two live allocations of any thread overlap. The statistics must
//! match the model, the block map must pass its own checks, and once everything is freed the pool
//! must give all of its memory back (on the host backend: no chunk, mapping or reservation left).

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use glake::config::{Config, DefragLevel};
use glake::device::host::HostDevice;
use glake::device::{SharedDevice, Stream};
use glake::pool::blocks::PoolKind;
use glake::pool::snapshot::BlockUse;
use glake::{ErrorKind, Pool};
use proptest::prelude::*;
use proptest::sample::Index;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// Memory of the device (or the cap, on CUDA) in the cases that want a small budget.
const BUDGET: usize = 512 * MIB;

/// Ops between two full pattern checks of a thread's live allocations.
const CHECK_EVERY: usize = 8;

#[derive(Debug, Clone)]
enum Op {
    Malloc {
        size: usize,
        stream: usize,
    },
    Free {
        index: Index,
    },
    RecordStream {
        index: Index,
        stream: usize,
    },
    /// Frees a live allocation and asks for the same size on the same stream again (what a
    /// training step does; it reuses cached stitched blocks).
    Again {
        index: Index,
    },
    /// Allocates `count` blocks of `size` bytes on one stream and frees every other one, leaving
    /// free holes that only a stitch can combine; then asks for `ask` times `size` (plus a byte)
    /// on that stream, and frees that again when `then_free`.
    Fragment {
        count: usize,
        size: usize,
        stream: usize,
        ask: usize,
        then_free: bool,
    },
    EmptyCache,
    /// Caps the pool at `Some(MiB)`, or back to the case's base budget.
    SetBudget {
        mib: Option<usize>,
    },
    /// Checks the patterns of all live allocations of the thread.
    Check,
}

/// Request sizes: small-pool sizes, sizes up to 1 MiB, and large ones, many of them repeated
/// multiples of 2 MiB so that cached stitched blocks get reused.
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => 1usize..=4096,
        2 => 4097usize..=MIB,
        3 => (1usize..=12).prop_map(|k| 2 * k * MIB),
        2 => (MIB + 1)..64 * MIB,
    ]
}

/// Stream index: mostly the default stream, so that frees on one stream can be stitched.
fn stream() -> impl Strategy<Value = usize> {
    prop_oneof![3 => Just(0usize), 2 => 1..4usize]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (size(), stream()).prop_map(|(size, stream)| Op::Malloc { size, stream }),
        7 => any::<Index>().prop_map(|index| Op::Free { index }),
        2 => (any::<Index>(), stream())
            .prop_map(|(index, stream)| Op::RecordStream { index, stream }),
        2 => any::<Index>().prop_map(|index| Op::Again { index }),
        2 => (
            2usize..=8,
            (1usize..=4).prop_map(|k| 2 * k * MIB),
            stream(),
            2usize..=4,
            any::<bool>(),
        )
            .prop_map(|(count, size, stream, ask, then_free)| Op::Fragment {
                count,
                size,
                stream,
                ask,
                then_free,
            }),
        1 => Just(Op::EmptyCache),
        1 => prop_oneof![Just(None), (16usize..=512).prop_map(Some)]
            .prop_map(|mib| Op::SetBudget { mib }),
        1 => Just(Op::Check),
    ]
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(), 1..60)
}

fn config() -> impl Strategy<Value = Config> {
    (
        prop_oneof![3 => Just(true), 1 => Just(false)],
        prop_oneof![Just(DefragLevel::BeforeGrow), Just(DefragLevel::WhenFull)],
        prop_oneof![3 => Just(2 * MIB), 1 => Just(8 * MIB)],
        prop_oneof![Just(1.0), Just(10.0)],
        prop_oneof![Just(1000 * GIB), Just(32 * MIB)],
        prop_oneof![Just(2usize), Just(4), Just(256)],
        // GMLake's 2 MiB handles, or segments of up to 8 larger ones (with no cap relative to
        // the pool's size, so that the small pools here get them).
        prop_oneof![Just((2 * MIB, 512)), Just((32 * MIB, 1))],
    )
        .prop_map(
            |(
                stitch,
                defrag_level,
                frag_limit,
                reuse_limit,
                auto_gc_bytes,
                max_stitch_pieces,
                (max_chunk, chunk_divisor),
            )| {
                Config {
                    stitch,
                    defrag_level,
                    frag_limit,
                    reuse_limit,
                    auto_gc_bytes,
                    max_stitch_pieces,
                    max_chunk,
                    chunk_divisor,
                    ..Config::default()
                }
            },
        )
}

/// A device for one case; `host` is set on the host backend, for the leak checks.
struct TestDevice {
    shared: SharedDevice,
    host: Option<Arc<HostDevice>>,
    /// The cap the case starts with and `SetBudget { mib: None }` goes back to.
    base_fraction: f64,
}

fn open(small_budget: bool) -> TestDevice {
    if common::backend_is_cuda() {
        let shared = common::device();
        let total = shared.mem_info().expect("mem_info").total;
        let base_fraction = if small_budget {
            (BUDGET as f64 / total as f64).min(1.0)
        } else {
            1.0
        };
        return TestDevice {
            shared,
            host: None,
            base_fraction,
        };
    }
    let host = common::host_device(if small_budget { BUDGET } else { 64 * GIB });
    TestDevice {
        shared: host.clone(),
        host: Some(host),
        base_fraction: 1.0,
    }
}

#[derive(Debug, Clone, Copy)]
struct Live {
    ptr: u64,
    /// Bytes asked for (the pattern covers them).
    size: usize,
    /// Bytes handed out, as the pool reports them.
    rounded: usize,
    seed: u64,
    stream: usize,
}

/// Live ranges of all threads, start -> end.
type Ranges = Mutex<BTreeMap<u64, u64>>;

struct Shared {
    pool: Arc<Pool>,
    device: SharedDevice,
    streams: [Stream; 4],
    ranges: Ranges,
    total: usize,
    base_fraction: f64,
}

fn lock(ranges: &Ranges) -> std::sync::MutexGuard<'_, BTreeMap<u64, u64>> {
    ranges.lock().unwrap_or_else(|p| p.into_inner())
}

fn claim(ranges: &Ranges, start: u64, len: usize) {
    let end = start + len as u64;
    let mut map = lock(ranges);
    if let Some((&s, &e)) = map.range(..end).next_back() {
        assert!(
            e <= start,
            "live allocation {start:#x}..{end:#x} overlaps live {s:#x}..{e:#x}"
        );
    }
    map.insert(start, end);
}

fn unclaim(ranges: &Ranges, start: u64) {
    assert!(lock(ranges).remove(&start).is_some(), "{start:#x} not live");
}

/// Checks the statistics against the model (`live`: every live allocation of every thread) and
/// against a snapshot of the pool, and the pool's own invariants. No other thread may run.
fn check_model(pool: &Pool, live: &[Live]) {
    pool.check_invariants().expect("pool invariants");
    let stats = pool.stats();
    assert_eq!(
        stats.allocation.all.current,
        live.len() as i64,
        "allocations"
    );
    let requested: usize = live.iter().map(|l| l.size).sum();
    let rounded: usize = live.iter().map(|l| l.rounded).sum();
    assert_eq!(stats.requested_bytes.all.current, requested as i64);
    assert_eq!(stats.allocated_bytes.all.current, rounded as i64);
    assert!(stats.allocated_bytes.all.current >= stats.requested_bytes.all.current);
    check_snapshot(pool);
}

/// Statistics that must agree with a snapshot (taken under the same lock as its statistics), so
/// this holds while other threads run too.
fn check_snapshot(pool: &Pool) {
    let snap = pool.snapshot();
    let stats = snap.stats;
    for (kind, seg_count, seg_bytes, split_count, split_bytes) in [
        (
            PoolKind::Small,
            stats.segment.small_pool.current,
            stats.reserved_bytes.small_pool.current,
            stats.inactive_split.small_pool.current,
            stats.inactive_split_bytes.small_pool.current,
        ),
        (
            PoolKind::Large,
            stats.segment.large_pool.current,
            stats.reserved_bytes.large_pool.current,
            stats.inactive_split.large_pool.current,
            stats.inactive_split_bytes.large_pool.current,
        ),
    ] {
        let segments: Vec<_> = snap.segments.iter().filter(|s| s.pool == kind).collect();
        assert_eq!(seg_count, segments.len() as i64, "{kind:?} segments");
        let bytes: usize = segments.iter().map(|s| s.total_size).sum();
        assert_eq!(seg_bytes, bytes as i64, "{kind:?} reserved bytes");
        let split_free: Vec<usize> = segments
            .iter()
            .filter(|s| s.blocks.len() > 1)
            .flat_map(|s| &s.blocks)
            .filter(|b| b.state == BlockUse::Free)
            .map(|b| b.size)
            .collect();
        assert_eq!(
            (split_count, split_bytes),
            (
                split_free.len() as i64,
                split_free.iter().sum::<usize>() as i64
            ),
            "{kind:?} inactive split (count, bytes)"
        );
    }
    let small_allocated: usize = snap
        .segments
        .iter()
        .filter(|s| s.pool == PoolKind::Small)
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state == BlockUse::Allocated)
        .map(|b| b.size)
        .sum();
    assert_eq!(
        stats.allocated_bytes.small_pool.current, small_allocated as i64,
        "small pool allocated bytes"
    );
}

fn check_patterns(device: &SharedDevice, live: &[Live]) {
    for l in live {
        assert!(
            common::has_pattern(device, l.ptr, l.size, l.seed),
            "the bytes of {:#x} ({} bytes) changed",
            l.ptr,
            l.size
        );
    }
}

/// Allocates, checks what the pool says about the allocation, claims its range and writes its
/// pattern. None when the pool is out of memory (the only error allowed).
fn malloc(
    shared: &Shared,
    size: usize,
    stream: usize,
    next_seed: &mut u64,
    check_cap: bool,
) -> Option<Live> {
    let pool = &*shared.pool;
    let reserved_before = pool.stats().reserved_bytes.all.current as usize;
    match pool.malloc(size, shared.streams[stream]) {
        Ok(ptr) => {
            if check_cap {
                // Growth stays under the cap (which may be below what is already held).
                let snap = pool.snapshot();
                let reserved = snap.stats.reserved_bytes.all.current as usize;
                assert!(
                    reserved <= reserved_before || reserved <= snap.memory_cap,
                    "grew to {reserved} bytes over the cap {}",
                    snap.memory_cap
                );
            }
            assert_ne!(ptr, 0);
            assert_eq!(ptr % 512, 0, "{size} bytes at {ptr:#x}");
            let info = pool.allocation_of(ptr).expect("a live allocation is known");
            assert_eq!((info.base, info.requested), (ptr, size));
            assert!(info.size >= size);
            let end = pool
                .allocation_of(ptr + size as u64 - 1)
                .expect("last byte");
            assert_eq!(end.base, ptr);
            claim(&shared.ranges, ptr, info.size);
            *next_seed += 1;
            common::write_pattern(&shared.device, ptr, size, *next_seed);
            Some(Live {
                ptr,
                size,
                rounded: info.size,
                seed: *next_seed,
                stream,
            })
        }
        Err(err) => {
            assert_eq!(
                err.kind(),
                ErrorKind::OutOfMemory,
                "malloc({size}) failed: {err}"
            );
            None
        }
    }
}

/// Checks the pattern of a live allocation, gives up its range and frees it.
fn free(shared: &Shared, l: Live) {
    check_patterns(&shared.device, &[l]);
    unclaim(&shared.ranges, l.ptr);
    shared.pool.free(l.ptr).expect("free");
}

/// Runs one thread's operations; returns its live allocations.
fn run_thread(shared: &Shared, thread: usize, ops: &[Op], check_each_op: bool) -> Vec<Live> {
    let pool = &*shared.pool;
    let mut live: Vec<Live> = Vec::new();
    let mut next_seed = (thread as u64) << 32;
    for (step, op) in ops.iter().enumerate() {
        match *op {
            Op::Malloc { size, stream } => {
                if let Some(l) = malloc(shared, size, stream, &mut next_seed, check_each_op) {
                    live.push(l);
                }
            }
            Op::Fragment {
                count,
                size,
                stream,
                ask,
                then_free,
            } => {
                let mut made = Vec::new();
                for _ in 0..count {
                    if let Some(l) = malloc(shared, size, stream, &mut next_seed, check_each_op) {
                        made.push(l);
                    }
                }
                for (i, l) in made.into_iter().enumerate() {
                    if i % 2 == 0 {
                        free(shared, l);
                    } else {
                        live.push(l);
                    }
                }
                let big = malloc(
                    shared,
                    ask * size + 1,
                    stream,
                    &mut next_seed,
                    check_each_op,
                );
                match big {
                    Some(l) if then_free => free(shared, l),
                    Some(l) => live.push(l),
                    None => {}
                }
            }
            Op::Free { index } => {
                if !live.is_empty() {
                    let l = live.swap_remove(index.index(live.len()));
                    free(shared, l);
                }
            }
            Op::Again { index } => {
                if !live.is_empty() {
                    let l = live.swap_remove(index.index(live.len()));
                    free(shared, l);
                    if let Some(l) = malloc(shared, l.size, l.stream, &mut next_seed, check_each_op)
                    {
                        live.push(l);
                    }
                }
            }
            Op::RecordStream { index, stream } => {
                if !live.is_empty() {
                    let l = live[index.index(live.len())];
                    pool.record_stream(l.ptr, shared.streams[stream])
                        .expect("record_stream");
                }
            }
            Op::EmptyCache => pool.empty_cache().expect("empty_cache"),
            Op::SetBudget { mib } => {
                let fraction = match mib {
                    Some(mib) => ((mib * MIB) as f64 / shared.total as f64).min(1.0),
                    None => shared.base_fraction,
                };
                pool.set_memory_fraction(fraction)
                    .expect("set_memory_fraction");
            }
            Op::Check => check_patterns(&shared.device, &live),
        }
        if check_each_op {
            check_model(pool, &live);
        } else {
            check_snapshot(pool);
        }
        if step % CHECK_EVERY == CHECK_EVERY - 1 {
            check_patterns(&shared.device, &live);
        }
    }
    check_patterns(&shared.device, &live);
    live
}

/// One case: `threads` op sequences on one pool, then the model checks and the leak checks.
fn run_case(config: Config, small_budget: bool, threads: Vec<Vec<Op>>) {
    let device = open(small_budget);
    let total = device.shared.mem_info().expect("mem_info").total;
    let mut streams = [Stream::DEFAULT; 4];
    for s in streams.iter_mut().skip(1) {
        *s = device.shared.create_stream().expect("create_stream");
    }
    let pool = Arc::new(Pool::new(device.shared.clone(), config).expect("pool"));
    pool.set_memory_fraction(device.base_fraction)
        .expect("set_memory_fraction");
    let shared = Arc::new(Shared {
        pool: pool.clone(),
        device: device.shared.clone(),
        streams,
        ranges: Mutex::new(BTreeMap::new()),
        total,
        base_fraction: device.base_fraction,
    });
    let check_each_op = threads.len() == 1;
    let handles: Vec<_> = threads
        .into_iter()
        .enumerate()
        .map(|(thread, ops)| {
            let shared = shared.clone();
            std::thread::spawn(move || run_thread(&shared, thread, &ops, check_each_op))
        })
        .collect();
    let mut live = Vec::new();
    for handle in handles {
        match handle.join() {
            Ok(mut l) => live.append(&mut l),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
    check_model(&pool, &live);
    check_patterns(&device.shared, &live);
    for l in &live {
        unclaim(&shared.ranges, l.ptr);
        pool.free(l.ptr).expect("free");
    }
    check_model(&pool, &[]);
    pool.empty_cache().expect("empty_cache");
    pool.check_invariants().expect("pool invariants");
    let stats = pool.stats();
    assert_eq!(
        stats.reserved_bytes.all.current, 0,
        "reserved after empty_cache"
    );
    assert_eq!(stats.active.all.current, 0, "active after empty_cache");
    assert_eq!(
        stats.stitched_blocks.current, 0,
        "stitched after empty_cache"
    );
    assert!(pool.snapshot().segments.is_empty());
    drop(shared);
    let pool = Arc::try_unwrap(pool)
        .ok()
        .expect("the pool is no longer shared");
    drop(pool);
    for &s in streams.iter().skip(1) {
        device.shared.destroy_stream(s).expect("destroy_stream");
    }
    if let Some(host) = &device.host {
        assert_eq!(
            host.live_objects(),
            (0, 0, 0),
            "chunks, mappings, reservations"
        );
        assert_eq!(host.created_bytes(), 0, "physical bytes");
    }
}

/// 24 cases per property unless `PROPTEST_CASES` asks for more (a longer hunt).
fn proptest_config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24);
    ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::with_cases(cases)
    }
}

proptest! {
    #![proptest_config(proptest_config())]

    /// One thread, with the model checked after every operation.
    #[test]
    fn one_thread_matches_the_model(
        config in config(),
        small_budget in any::<bool>(),
        ops in ops(),
    ) {
        run_case(config, small_budget, vec![ops]);
    }

    /// Up to four threads on one pool; the model is checked once they are done.
    #[test]
    fn threads_sharing_a_pool_match_the_model(
        config in config(),
        small_budget in any::<bool>(),
        threads in prop::collection::vec(ops(), 1..=4),
    ) {
        run_case(config, small_budget, threads);
    }
}

/// Found by the properties above: merging free blocks of the small pool while waiting for all
/// streams (here in `empty_cache`) was booked as a change of the large pool's inactive-split
/// statistics, which went negative.
#[test]
fn inactive_split_statistics_stay_with_their_pool() {
    let device = open(false);
    let s1 = device.shared.create_stream().expect("create_stream");
    let pool = Pool::new(device.shared.clone(), Config::default()).expect("pool");
    let a = pool.malloc(1, Stream::DEFAULT).expect("malloc");
    let b = pool.malloc(5, s1).expect("malloc");
    let c = pool.malloc(4 * MIB, s1).expect("malloc");
    // Two free blocks of one small segment, owned by different streams: they cannot merge yet.
    pool.free(a).expect("free");
    pool.free(b).expect("free");
    check_snapshot(&pool);
    pool.empty_cache().expect("empty_cache");
    check_snapshot(&pool);
    let stats = pool.stats();
    assert_eq!(stats.inactive_split.all.current, 0);
    assert_eq!(stats.inactive_split.small_pool.current, 0);
    assert_eq!(stats.inactive_split.large_pool.current, 0);
    assert_eq!(stats.inactive_split_bytes.large_pool.current, 0);
    pool.free(c).expect("free");
    drop(pool);
    device.shared.destroy_stream(s1).expect("destroy_stream");
}
