//! The copy engine on the backend under test (host by default; GLAKE_TEST_BACKEND=cuda on a
//! GPU): every size class, unaligned ends, pageable, pinned and registered host memory, device
//! memory from a pool (stitched ranges too) and from elsewhere, stream order, concurrent copies,
//! relays through a second device, and failures halfway through a copy.

mod common;

use std::sync::mpsc;
use std::sync::Arc;

use glake::device::cuda::CudaDevice;
use glake::device::fault::FaultDevice;
use glake::device::host::{HostDevice, HostOptions};
use glake::device::{CallKind, DevicePtr, HostMemory, SharedDevice, Stream};
use glake::transfer::staging::{DeviceBuffer, PinnedBuffer};
use glake::transfer::{Completion, CopyPiece, Direction, Engine, HostCopy, Policy, Route};
use glake::{Config, Pool, TransferConfig};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const CHUNK: usize = 256 * KIB;
const H2D: Direction = Direction::HostToDevice;

/// Small lanes and chunks, so that chunk edges and every route show up at small sizes.
fn config() -> TransferConfig {
    TransferConfig {
        lanes: 3,
        relay_lanes: 2,
        slots: 2,
        chunk: CHUNK,
        min_chunk: 64 * KIB,
        min_chunk_d2h: 64 * KIB,
        bytes_per_lane: 64 * KIB,
        max_peers: 1,
        measure: false,
        max_staging: 64 * MIB,
        yield_waits: true,
        fill_copy: HostCopy::Streaming,
        drain_copy: HostCopy::Streaming,
        policy: Policy {
            min_pageable: 64 * KIB,
            min_pageable_d2h: 64 * KIB,
            min_relay: MIB,
            min_share: 0.0,
        },
    }
}

/// Device 0 of the backend under test, and device 1 when there is one (always on the host
/// backend, which has as many devices as it is told).
fn devices() -> (SharedDevice, Option<SharedDevice>) {
    if common::backend_is_cuda() {
        let first: SharedDevice = Arc::new(CudaDevice::open(0).expect("CUDA device 0"));
        let second = CudaDevice::open(1)
            .ok()
            .map(|d| Arc::new(d) as SharedDevice);
        (first, second)
    } else {
        let options = HostOptions {
            device_count: 2,
            ..HostOptions::default()
        };
        let first: SharedDevice = Arc::new(HostDevice::new(0, options).expect("host 0"));
        let second: SharedDevice = Arc::new(HostDevice::new(1, options).expect("host 1"));
        (first, Some(second))
    }
}

/// Host memory of one kind, `len` bytes (plus slack for unaligned views).
enum HostBuf {
    Pageable(Vec<u8>),
    Pinned(PinnedBuffer),
}

impl HostBuf {
    fn new(device: &SharedDevice, kind: HostMemory, len: usize) -> Self {
        match kind {
            HostMemory::Pageable => HostBuf::Pageable(vec![0; len + 64]),
            HostMemory::Pinned => HostBuf::Pinned(PinnedBuffer::new(device, len + 64).unwrap()),
        }
    }

    fn ptr(&mut self) -> *mut u8 {
        match self {
            HostBuf::Pageable(v) => v.as_mut_ptr(),
            HostBuf::Pinned(p) => p.ptr(),
        }
    }

    fn slice(&mut self, offset: usize, len: usize) -> &mut [u8] {
        // SAFETY: every buffer has len + 64 bytes and offsets stay below 64.
        unsafe { std::slice::from_raw_parts_mut(self.ptr().add(offset), len) }
    }
}

/// H2D then D2H of `len` bytes through `engine`, from host offset `host_off` to device offset
/// `dev_off` of `dst`, with host memory of `kind`; checks the bytes that come back.
#[allow(clippy::too_many_arguments)]
fn round_trip(
    engine: &Engine,
    dst: DevicePtr,
    len: usize,
    kind: HostMemory,
    host_off: usize,
    dev_off: u64,
    completion: Completion,
    seed: u64,
) {
    let device = engine.target().clone();
    let mut src = HostBuf::new(&device, kind, len);
    let data = common::pattern(seed, len);
    src.slice(host_off, len).copy_from_slice(&data);
    let stream = Stream::DEFAULT;
    unsafe {
        engine
            .copy_to_device(
                dst + dev_off,
                src.ptr().add(host_off),
                len,
                stream,
                completion,
            )
            .unwrap_or_else(|e| panic!("H2D of {len} ({kind:?}): {e}"));
    }
    let mut back = HostBuf::new(&device, kind, len);
    unsafe {
        engine
            .copy_to_host(
                back.ptr().add(host_off),
                dst + dev_off,
                len,
                stream,
                completion,
            )
            .unwrap_or_else(|e| panic!("D2H of {len} ({kind:?}): {e}"));
    }
    if completion == Completion::StreamOrdered {
        device.synchronize_stream(stream).unwrap();
    }
    assert!(
        back.slice(host_off, len) == &data[..],
        "{len} bytes ({kind:?}, host +{host_off}, device +{dev_off}, {completion:?}) came back different"
    );
}

fn sizes() -> Vec<usize> {
    let mut sizes = vec![
        0,
        1,
        7,
        4095,
        4096,
        4097,
        64 * KIB - 1,
        64 * KIB,
        64 * KIB + 1,
    ];
    for edge in [CHUNK, 2 * CHUNK, 6 * CHUNK, MIB] {
        sizes.extend([edge - 1, edge, edge + 1]);
    }
    sizes.extend([3 * CHUNK + 7, 5 * MIB + 3]);
    sizes
}

#[test]
fn every_size_arrives_whole_on_every_route() {
    let (device, peer) = devices();
    let pool = Pool::new(device.clone(), Config::default()).unwrap();
    let dst = pool.malloc(6 * MIB, Stream::DEFAULT).unwrap();
    // One engine waits for its slots in the driver, the other by polling and yielding.
    let driver_waits = TransferConfig {
        yield_waits: false,
        ..config()
    };
    let direct = Engine::new(device.clone(), Vec::new(), driver_waits).unwrap();
    let relayed = Engine::new(device.clone(), peer.into_iter().collect(), config()).unwrap();
    let mut seed = 1;
    for engine in [&direct, &relayed] {
        for len in sizes() {
            for kind in [HostMemory::Pageable, HostMemory::Pinned] {
                for (host_off, dev_off) in [(0, 0), (3, 1), (1, 513)] {
                    for completion in [Completion::Blocking, Completion::StreamOrdered] {
                        seed += 1;
                        round_trip(engine, dst, len, kind, host_off, dev_off, completion, seed);
                    }
                }
            }
        }
    }
    let stats = relayed.stats();
    assert!(
        stats.driver_copies > 0 && stats.engine_bytes > 0,
        "{stats:?}"
    );
    pool.free(dst).unwrap();
}

#[test]
fn routes_follow_size_memory_kind_and_paths() {
    let (device, peer) = devices();
    let direct = Engine::new(device.clone(), Vec::new(), config()).unwrap();
    assert_eq!(
        direct.route(4 * KIB, H2D, HostMemory::Pageable),
        Route::Driver
    );
    assert_eq!(
        direct.route(MIB, H2D, HostMemory::Pageable),
        Route::Engine(vec![0])
    );
    assert_eq!(
        direct.route(64 * MIB, H2D, HostMemory::Pinned),
        Route::Driver
    );
    if let Some(peer) = peer {
        let relayed = Engine::new(device, vec![peer.clone()], config()).unwrap();
        assert_eq!(relayed.paths().len(), 2);
        assert_eq!(relayed.paths()[1].via, Some(peer.ordinal()));
        assert_eq!(
            relayed.route(64 * MIB, H2D, HostMemory::Pinned),
            Route::Engine(vec![0, 1])
        );
        assert_eq!(
            relayed.route(MIB - 1, H2D, HostMemory::Pinned),
            Route::Driver
        );
    }
}

#[test]
fn several_gib_round_trip() {
    let (device, peer) = devices();
    let len = 2 * (1 << 30) + 5;
    let buffer = DeviceBuffer::new(&device, len, &[]).unwrap();
    let engine = Engine::new(
        device.clone(),
        peer.into_iter().collect(),
        TransferConfig {
            chunk: 8 * MIB,
            ..config()
        },
    )
    .unwrap();
    let mut src = vec![0u8; len];
    for (i, b) in src.iter_mut().enumerate().step_by(4093) {
        *b = (i / 4093) as u8 | 1;
    }
    *src.last_mut().unwrap() = 0xa5;
    unsafe {
        engine
            .copy_to_device(
                buffer.va(),
                src.as_ptr(),
                len,
                Stream::DEFAULT,
                Completion::Blocking,
            )
            .unwrap();
    }
    let mut back = vec![0u8; len];
    unsafe {
        engine
            .copy_to_host(
                back.as_mut_ptr(),
                buffer.va(),
                len,
                Stream::DEFAULT,
                Completion::Blocking,
            )
            .unwrap();
    }
    assert!(src == back, "2 GiB + 5 bytes came back different");
}

#[test]
fn registered_host_memory_counts_as_pinned() {
    let (device, _) = devices();
    let engine = Engine::new(device.clone(), Vec::new(), config()).unwrap();
    let pool = Pool::new(device.clone(), Config::default()).unwrap();
    let dst = pool.malloc(4 * MIB, Stream::DEFAULT).unwrap();
    let mut host = vec![0u8; 4 * MIB];
    assert_eq!(
        device.host_memory(host.as_ptr(), host.len()).unwrap(),
        HostMemory::Pageable
    );
    unsafe { device.register_host(host.as_mut_ptr(), host.len()).unwrap() };
    assert_eq!(
        device.host_memory(host.as_ptr(), host.len()).unwrap(),
        HostMemory::Pinned
    );
    let data = common::pattern(77, host.len());
    host.copy_from_slice(&data);
    unsafe {
        engine
            .copy_to_device(
                dst,
                host.as_ptr(),
                host.len(),
                Stream::DEFAULT,
                Completion::Blocking,
            )
            .unwrap();
    }
    assert_eq!(common::read(&device, dst, host.len()), data);
    unsafe { device.unregister_host(host.as_mut_ptr()).unwrap() };
    assert_eq!(
        device.host_memory(host.as_ptr(), host.len()).unwrap(),
        HostMemory::Pageable
    );
    pool.free(dst).unwrap();
}

#[test]
fn concurrent_copies_from_many_threads() {
    let (device, peer) = devices();
    let engine =
        Arc::new(Engine::new(device.clone(), peer.into_iter().collect(), config()).unwrap());
    let pool = Arc::new(Pool::new(device.clone(), Config::default()).unwrap());
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let engine = engine.clone();
            let pool = pool.clone();
            s.spawn(move || {
                let dst = pool.malloc(3 * MIB, Stream::DEFAULT).unwrap();
                for i in 0..8u64 {
                    let len = [100 * KIB, 3 * MIB, MIB + 17, 5][(i % 4) as usize];
                    let kind = if (t + i) % 2 == 0 {
                        HostMemory::Pageable
                    } else {
                        HostMemory::Pinned
                    };
                    round_trip(
                        &engine,
                        dst,
                        len,
                        kind,
                        (i % 3) as usize,
                        0,
                        Completion::Blocking,
                        t * 100 + i,
                    );
                }
                pool.free(dst).unwrap();
            });
        }
    });
}

#[test]
fn copies_into_stitched_ranges() {
    let (device, _) = devices();
    let pool = Pool::new(
        device.clone(),
        Config {
            max_chunk: device.granularity(),
            ..Config::default()
        },
    )
    .unwrap();
    pool.set_memory_limit(16 * MIB).unwrap();
    let blocks: Vec<u64> = (0..4)
        .map(|_| pool.malloc(4 * MIB, Stream::DEFAULT).unwrap())
        .collect();
    for &b in blocks.iter().step_by(2) {
        pool.free(b).unwrap();
    }
    let stitched = pool.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(pool.stats().stitches, 1);
    let engine = Engine::new(device.clone(), Vec::new(), config()).unwrap();
    let len = 8 * MIB - 3;
    for kind in [HostMemory::Pageable, HostMemory::Pinned] {
        round_trip(&engine, stitched, len, kind, 1, 3, Completion::Blocking, 9);
    }
    // The bytes landed in the two blocks the range was stitched from, one half each.
    let data = common::pattern(9, len);
    let (head, tail) = (&data[..4 * MIB - 3], &data[4 * MIB - 3..]);
    let a = common::read(&device, blocks[0], 4 * MIB);
    let b = common::read(&device, blocks[2], 4 * MIB);
    let holds = |first: &[u8], second: &[u8]| &first[3..] == head && second == tail;
    assert!(
        holds(&a, &b) || holds(&b, &a),
        "the stitched bytes are not in its pieces"
    );
    pool.free(stitched).unwrap();
}

/// Always on the host backend: a gate holds the caller's stream, so the copy's device work
/// must wait for it (a pageable copy larger than the staging slots waits with it, as CUDA's
/// own pageable copies do), and work queued after the copy on that stream sees its data.
#[test]
fn copies_keep_stream_order() {
    let options = HostOptions {
        device_count: 2,
        ..HostOptions::default()
    };
    let host = Arc::new(HostDevice::new(0, options).unwrap());
    let peer: SharedDevice = Arc::new(HostDevice::new(1, options).unwrap());
    let device: SharedDevice = host.clone();
    for peers in [Vec::new(), vec![peer]] {
        let engine = Engine::new(device.clone(), peers, config()).unwrap();
        let pool = Pool::new(device.clone(), Config::default()).unwrap();
        for kind in [HostMemory::Pageable, HostMemory::Pinned] {
            let len = MIB + 5;
            let dst = pool.malloc(len, Stream::DEFAULT).unwrap();
            let copy = pool.malloc(len, Stream::DEFAULT).unwrap();
            common::write(&device, dst, &vec![0u8; len]);
            let stream = device.create_stream().unwrap();
            let (open, gate) = mpsc::channel::<()>();
            host.enqueue_host_fn(
                stream,
                Box::new(move || {
                    let _ = gate.recv();
                }),
            )
            .unwrap();
            // While the gate holds the stream, nothing of the copy may land.
            let watcher = {
                let device = device.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(std::time::Duration::from_millis(200));
                    let untouched = common::read(&device, dst, len).iter().all(|&b| b == 0);
                    let _ = open.send(());
                    untouched
                })
            };
            let data = common::pattern(5, len);
            let mut src = HostBuf::new(&device, kind, len);
            src.slice(0, len).copy_from_slice(&data);
            unsafe {
                engine
                    .copy_to_device(dst, src.ptr(), len, stream, Completion::StreamOrdered)
                    .unwrap();
            }
            device.copy_device(copy, dst, len, stream).unwrap();
            device.synchronize_stream(stream).unwrap();
            assert!(
                watcher.join().unwrap(),
                "{kind:?}: the copy ran before the gate opened"
            );
            assert_eq!(common::read(&device, copy, len), data, "{kind:?}");
            device.destroy_stream(stream).unwrap();
            pool.free(dst).unwrap();
            pool.free(copy).unwrap();
        }
    }
}

#[test]
fn relays_carry_bytes_and_are_measured() {
    let (device, peer) = devices();
    let Some(peer) = peer else {
        eprintln!("one device: no relay to test");
        return;
    };
    let mut engine = Engine::new(device.clone(), vec![peer], config()).unwrap();
    engine.measure().unwrap();
    assert!(
        engine.paths().iter().all(|p| p.gbps > 0.0),
        "{:?}",
        engine.paths()
    );
    let buffer = DeviceBuffer::new(&device, 32 * MIB, &[]).unwrap();
    for kind in [HostMemory::Pageable, HostMemory::Pinned] {
        let before = engine.stats().relay_bytes;
        round_trip(
            &engine,
            buffer.va(),
            32 * MIB - 3,
            kind,
            2,
            1,
            Completion::Blocking,
            3,
        );
        // The data is right, and part of it went through the peer.
        assert!(
            engine.stats().relay_bytes > before,
            "{kind:?}: no byte relayed"
        );
    }
}

/// A stream-ordered copy of page-locked memory through a relay is queued, not waited for: it
/// returns while the caller's stream is still held up by earlier work (with more chunks than
/// a lane has slots, so slots are reused in device order), and the data arrives once the
/// stream moves on. Host backend: a host function holds the stream.
#[test]
fn pinned_stream_ordered_copies_return_before_the_stream_gets_there() {
    let options = HostOptions {
        device_count: 2,
        ..HostOptions::default()
    };
    let host = Arc::new(HostDevice::new(0, options).unwrap());
    let device: SharedDevice = host.clone();
    let peer: SharedDevice = Arc::new(HostDevice::new(1, options).unwrap());
    let engine = Engine::new(device.clone(), vec![peer], config()).unwrap();
    let len = 40 * CHUNK + 5;
    let target = DeviceBuffer::new(&device, len, &[]).unwrap();
    let src = PinnedBuffer::new(&device, len).unwrap();
    let back = PinnedBuffer::new(&device, len).unwrap();
    let data = common::pattern(21, len);
    unsafe { std::slice::from_raw_parts_mut(src.ptr(), len).copy_from_slice(&data) };
    let stream = device.create_stream().unwrap();
    for direction in [Direction::HostToDevice, Direction::DeviceToHost] {
        let (release, held) = mpsc::channel::<()>();
        host.enqueue_host_fn(
            stream,
            Box::new(move || {
                let _ = held.recv();
            }),
        )
        .unwrap();
        let before = engine.stats().relay_bytes;
        unsafe {
            match direction {
                Direction::HostToDevice => engine.copy_to_device(
                    target.va(),
                    src.ptr(),
                    len,
                    stream,
                    Completion::StreamOrdered,
                ),
                Direction::DeviceToHost => engine.copy_to_host(
                    back.ptr(),
                    target.va(),
                    len,
                    stream,
                    Completion::StreamOrdered,
                ),
            }
        }
        .expect("queued while the stream is held");
        assert!(
            engine.stats().relay_bytes > before,
            "{direction:?}: relayed"
        );
        release.send(()).unwrap();
        device.synchronize_stream(stream).unwrap();
    }
    let arrived = unsafe { std::slice::from_raw_parts(back.ptr(), len) };
    assert!(arrived == &data[..], "bytes differ after the round trip");
    device.destroy_stream(stream).unwrap();
}

/// Always on the host backend, whose leak counters see every buffer, stream and mapping.
#[test]
fn failures_halfway_return_errors_and_leave_nothing_behind() {
    let options = HostOptions {
        device_count: 2,
        ..HostOptions::default()
    };
    let host = Arc::new(HostDevice::new(0, options).unwrap());
    let peer_host = Arc::new(HostDevice::new(1, options).unwrap());
    let faulty = Arc::new(FaultDevice::new(host.clone()));
    let device: SharedDevice = faulty.clone();
    let peer: SharedDevice = peer_host.clone();

    // A staging allocation fails while the engine starts: an error, and nothing is left.
    faulty.fail_nth(CallKind::Pinned, 4);
    assert!(Engine::new(device.clone(), vec![peer.clone()], config()).is_err());
    assert_eq!(host.live_pinned(), 0);
    assert_eq!(host.live_streams(), 1, "only the default stream");
    assert_eq!(peer_host.live_objects(), (0, 0, 0));

    let engine = Engine::new(device.clone(), vec![peer.clone()], config()).unwrap();
    let pool = Pool::new(host.clone(), Config::default()).unwrap();
    let dst = pool.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    let data = common::pattern(11, 8 * MIB);
    let mut back = vec![0u8; 8 * MIB];
    // Lanes poll their slots' events (QueryEvent); the caller waits for a blocking copy's
    // final events (SynchronizeEvent). A failure anywhere is the copy's error; a panic of the
    // device inside a lane is too (one on the caller's own thread is the caller's, as for any
    // Rust call, and the C API turns it into GLAKE_STATUS_PANIC).
    let calls = [
        (CallKind::Copy, true),
        (CallKind::RecordEvent, true),
        (CallKind::QueryEvent, true),
        (CallKind::SynchronizeEvent, false),
    ];
    for (round, (kind, in_lanes)) in calls.into_iter().enumerate() {
        let panics: &[bool] = if in_lanes { &[false, true] } else { &[false] };
        for &panic in panics {
            // A chunk's call fails (or panics) halfway through a copy each way.
            if panic {
                faulty.panic_nth(kind, 3);
            } else {
                faulty.fail_nth(kind, 3);
            }
            let h2d = unsafe {
                engine.copy_to_device(
                    dst,
                    data.as_ptr(),
                    data.len(),
                    Stream::DEFAULT,
                    Completion::Blocking,
                )
            };
            if panic {
                faulty.panic_nth(kind, 2);
            } else {
                faulty.fail_nth(kind, 2);
            }
            let d2h = unsafe {
                engine.copy_to_host(
                    back.as_mut_ptr(),
                    dst,
                    back.len(),
                    Stream::DEFAULT,
                    Completion::Blocking,
                )
            };
            assert!(
                h2d.is_err() && d2h.is_err(),
                "round {round} {kind:?}: {h2d:?} {d2h:?}"
            );
            faulty.clear();
            // Later copies work.
            for completion in [Completion::Blocking, Completion::StreamOrdered] {
                round_trip(
                    &engine,
                    dst,
                    8 * MIB,
                    HostMemory::Pageable,
                    0,
                    0,
                    completion,
                    round as u64,
                );
            }
        }
    }
    pool.free(dst).unwrap();
    drop(pool);
    drop(engine);
    assert_eq!(host.live_pinned(), 0, "staging buffers freed");
    assert_eq!(host.live_streams(), 1, "lane streams destroyed");
    assert_eq!(
        peer_host.live_objects(),
        (0, 0, 0),
        "relay buffers released"
    );
    assert_eq!(peer_host.live_streams(), 1);
}

#[test]
fn batches_of_pieces_arrive_whole() {
    let (device, peer) = devices();
    let engine = Engine::new(device.clone(), peer.into_iter().collect(), config()).unwrap();
    let pool = Pool::new(device.clone(), Config::default()).unwrap();
    let lens = [0, 1, 4097, CHUNK + 1, 3 * MIB + 5, 17, 2 * MIB];
    let dsts: Vec<u64> = lens
        .iter()
        .map(|&len| pool.malloc(len.max(1), Stream::DEFAULT).unwrap())
        .collect();
    // Pageable and pinned pieces mixed in one batch.
    let mut srcs: Vec<HostBuf> = lens
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let kind = if i % 2 == 0 {
                HostMemory::Pageable
            } else {
                HostMemory::Pinned
            };
            HostBuf::new(&device, kind, len)
        })
        .collect();
    let datas: Vec<Vec<u8>> = lens
        .iter()
        .enumerate()
        .map(|(i, &len)| common::pattern(40 + i as u64, len))
        .collect();
    let mut pieces = Vec::new();
    for (i, src) in srcs.iter_mut().enumerate() {
        src.slice(0, lens[i]).copy_from_slice(&datas[i]);
        pieces.push(CopyPiece {
            host: src.ptr() as usize,
            device: dsts[i],
            len: lens[i],
        });
    }
    for completion in [Completion::Blocking, Completion::StreamOrdered] {
        unsafe {
            engine
                .copy_pieces(
                    Direction::HostToDevice,
                    &pieces,
                    Stream::DEFAULT,
                    completion,
                )
                .unwrap();
        }
        let mut backs: Vec<HostBuf> = lens
            .iter()
            .map(|&len| HostBuf::new(&device, HostMemory::Pageable, len))
            .collect();
        let back_pieces: Vec<CopyPiece> = backs
            .iter_mut()
            .enumerate()
            .map(|(i, b)| CopyPiece {
                host: b.ptr() as usize,
                device: dsts[i],
                len: lens[i],
            })
            .collect();
        unsafe {
            engine
                .copy_pieces(
                    Direction::DeviceToHost,
                    &back_pieces,
                    Stream::DEFAULT,
                    completion,
                )
                .unwrap();
        }
        device.synchronize_stream(Stream::DEFAULT).unwrap();
        for (i, back) in backs.iter_mut().enumerate() {
            assert!(
                back.slice(0, lens[i]) == &datas[i][..],
                "piece {i} of {}",
                lens[i]
            );
        }
    }
    let bad = [CopyPiece {
        host: 0,
        device: dsts[1],
        len: 4,
    }];
    assert!(unsafe {
        engine.copy_pieces(
            Direction::HostToDevice,
            &bad,
            Stream::DEFAULT,
            Completion::Blocking,
        )
    }
    .is_err());
    for d in dsts {
        pool.free(d).unwrap();
    }
}

#[test]
fn staging_stays_within_its_cap() {
    let (device, peer) = devices();
    let relays = usize::from(peer.is_some());
    let capped = TransferConfig {
        lanes: 4,
        relay_lanes: 4,
        max_staging: 2 * CHUNK,
        ..config()
    };
    let engine = Engine::new(device.clone(), peer.into_iter().collect(), capped).unwrap();
    let c = engine.config();
    assert!(
        (c.lanes + relays * c.relay_lanes) * c.slots * c.chunk <= 2 * CHUNK,
        "{c:?}"
    );
    let buffer = DeviceBuffer::new(&device, 4 * MIB, &[]).unwrap();
    for kind in [HostMemory::Pageable, HostMemory::Pinned] {
        round_trip(
            &engine,
            buffer.va(),
            4 * MIB - 1,
            kind,
            1,
            0,
            Completion::Blocking,
            8,
        );
    }
}

/// The devices of one run of the engine's fault sweep: a target and a peer on the host
/// backend, each behind a fault device (`target`, `peer`) and each also used directly (`raw`,
/// `raw_peer`) for the test's own memory and waits, which are never failed nor counted.
struct Rig {
    raw: Arc<HostDevice>,
    raw_peer: Arc<HostDevice>,
    target: Arc<FaultDevice>,
    peer: Arc<FaultDevice>,
}

impl Rig {
    fn new() -> Rig {
        let options = HostOptions {
            device_count: 2,
            ..HostOptions::default()
        };
        let raw = Arc::new(HostDevice::new(0, options).unwrap());
        let raw_peer = Arc::new(HostDevice::new(1, options).unwrap());
        Rig {
            target: Arc::new(FaultDevice::new(raw.clone())),
            peer: Arc::new(FaultDevice::new(raw_peer.clone())),
            raw,
            raw_peer,
        }
    }

    /// Calls of each kind so far: the target's, then the peer's.
    fn calls(&self) -> Vec<u64> {
        [&self.target, &self.peer]
            .iter()
            .flat_map(|f| CallKind::ALL.iter().map(|&k| f.calls(k)))
            .collect()
    }

    /// Waits for everything queued on both devices, past the fault devices: after a copy
    /// whose waits were failed, its work may still run.
    fn settle(&self) {
        (self.raw.clone() as SharedDevice)
            .synchronize_device()
            .unwrap();
        (self.raw_peer.clone() as SharedDevice)
            .synchronize_device()
            .unwrap();
    }
}

/// One life of an engine with a relay through a peer (made with its bandwidths measured):
/// pageable and pinned copies each way, blocking and stream-ordered, through the lanes (both
/// paths) and small ones straight to the driver, then the engine's drop. `plan` is made on the
/// fault devices first. A copy that fails is retried (at most three failures are planned) and
/// must then carry its bytes; the engine's creation too. Returns the calls made after the plan
/// (the target's kinds, then the peer's).
fn engine_life(rig: &Rig, yield_waits: bool, what: &str, plan: impl FnOnce(&Rig)) -> Vec<u64> {
    let raw: SharedDevice = rig.raw.clone();
    let pool = Pool::new(raw.clone(), Config::default()).unwrap();
    let len = 3 * MIB;
    let dst = pool.malloc(len, Stream::DEFAULT).unwrap();
    let pinned_src = PinnedBuffer::new(&raw, len).unwrap();
    let pinned_back = PinnedBuffer::new(&raw, len).unwrap();
    let before = rig.calls();
    plan(rig);
    let retried = |f: &dyn Fn() -> glake::Result<()>| {
        for _ in 0..3 {
            let result = f();
            rig.settle();
            if result.is_ok() {
                return;
            }
        }
        f().unwrap_or_else(|e| panic!("{what}: the retry fails: {e}"));
        rig.settle();
    };
    let config = TransferConfig {
        yield_waits,
        measure: true,
        ..config()
    };
    let make = || {
        let peers = vec![rig.peer.clone() as SharedDevice];
        let made = Engine::new(rig.target.clone(), peers, config.clone());
        rig.settle();
        made
    };
    let engine = make()
        .or_else(|_| make())
        .or_else(|_| make())
        .unwrap_or_else(|e| panic!("{what}: making the engine: {e}"));
    assert_eq!(engine.paths().len(), 2, "{what}: the relay is used");
    for (i, (kind, completion)) in [
        (HostMemory::Pageable, Completion::Blocking),
        (HostMemory::Pinned, Completion::StreamOrdered),
        (HostMemory::Pinned, Completion::Blocking),
    ]
    .into_iter()
    .enumerate()
    {
        let data = common::pattern(i as u64 + 1, len);
        let (src, back): (*mut u8, *mut u8) = match kind {
            HostMemory::Pinned => (pinned_src.ptr(), pinned_back.ptr()),
            HostMemory::Pageable => (
                Box::leak(vec![0u8; len].into_boxed_slice()).as_mut_ptr(),
                Box::leak(vec![0u8; len].into_boxed_slice()).as_mut_ptr(),
            ),
        };
        unsafe { std::slice::from_raw_parts_mut(src, len).copy_from_slice(&data) };
        retried(&|| unsafe { engine.copy_to_device(dst, src, len, Stream::DEFAULT, completion) });
        retried(&|| unsafe { engine.copy_to_host(back, dst, len, Stream::DEFAULT, completion) });
        let came_back = unsafe { std::slice::from_raw_parts(back, len) } == &data[..];
        if kind == HostMemory::Pageable {
            // SAFETY: leaked above; every copy that used them has been waited for.
            unsafe {
                drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(src, len)));
                drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(back, len)));
            }
        }
        assert!(came_back, "{what}: {kind:?} {completion:?} bytes differ");
    }
    // Small copies go straight to the driver.
    let small = common::pattern(9, 4 * KIB);
    let mut small_back = vec![0u8; 4 * KIB];
    retried(&|| unsafe {
        engine.copy_to_device(
            dst,
            small.as_ptr(),
            small.len(),
            Stream::DEFAULT,
            Completion::Blocking,
        )
    });
    let back_ptr = small_back.as_mut_ptr();
    retried(&|| unsafe {
        engine.copy_to_host(
            back_ptr,
            dst,
            4 * KIB,
            Stream::DEFAULT,
            Completion::Blocking,
        )
    });
    assert_eq!(small_back, small, "{what}: small copy");
    drop(engine);
    let made = rig
        .calls()
        .iter()
        .zip(before)
        .map(|(now, then)| now - then)
        .collect();
    rig.target.clear();
    rig.peer.clear();
    drop((pinned_src, pinned_back));
    pool.free(dst).unwrap();
    drop(pool);
    made
}

/// Each call site of an engine's life failing in turn (its first call), on the target and on
/// the peer, with lanes that poll and lanes that wait; and the clean-up of a failed wait
/// failing too: the call right after it, and the device-wide waits that stand in for failed
/// waits. The copy reports the error, a retry carries the bytes, and the engine's drop gives
/// back every staging buffer and stream (a stream or event whose destroy fails is lost, and a
/// buffer whose release fails twice: a drop has no later chance). Every call site the
/// inventory gives this sweep is failed. (Lanes poll and wait as fast as copies finish, so
/// the engine's calls are failed by site, not by their number among all calls of a kind.)
#[test]
fn a_fault_at_each_driver_call_site_of_the_engine_loses_nothing() {
    use glake::device::fault::CallSite;
    let mut swept = common::sites::Swept::new("transfer");
    let mut runs = 0;
    for yield_waits in [true, false] {
        let clean = Rig::new();
        engine_life(&clean, yield_waits, "clean", |_| {});
        let sites: Vec<(bool, CallSite)> = [(false, &clean.target), (true, &clean.peer)]
            .into_iter()
            .flat_map(|(on_peer, f)| f.sites_called().into_iter().map(move |(s, _)| (on_peer, s)))
            .collect();
        for (on_peer, site) in sites {
            let fault = |rig: &Rig| {
                if on_peer {
                    rig.peer.clone()
                } else {
                    rig.target.clone()
                }
            };
            let what = format!(
                "{site} on the {}, yield_waits {yield_waits}",
                if on_peer { "peer" } else { "target" }
            );
            // Alone; and a failed wait also with the next call after it (on the same device)
            // failing, and then with the device-wide waits failing as well.
            let wait = matches!(
                site.kind,
                CallKind::SynchronizeStream | CallKind::SynchronizeEvent
            );
            for variant in 0..if wait { 3 } else { 1 } {
                // Which lane takes which chunk of a pageable copy depends on timing, so a site
                // of one path may go uncalled in a run: run again until the fault fires.
                let mut attempts = 0;
                let rig = loop {
                    attempts += 1;
                    let rig = Rig::new();
                    engine_life(&rig, yield_waits, &what, |rig| {
                        fault(rig).fail_at(site, 1);
                        if variant > 0 {
                            fault(rig).fail_after_failure(1);
                        }
                        if variant > 1 {
                            // They wait, then fail: on the host backend queued work still
                            // runs, where a lost device's would not.
                            rig.target
                                .fail_nth_after_call(CallKind::SynchronizeDevice, 1);
                            rig.peer.fail_nth_after_call(CallKind::SynchronizeDevice, 1);
                        }
                        if (on_peer, site.kind) == (true, CallKind::CreateEvent) {
                            // A lane whose peer event cannot be made destroys its target
                            // event.
                            rig.target.fail_nth(CallKind::DestroyEvent, 1);
                        }
                    });
                    if fault(&rig).injected() > 0 || attempts == 8 {
                        break rig;
                    }
                };
                let injected = fault(&rig).injected();
                assert!(injected > 0, "{what}: did not fire in {attempts} runs");
                runs += 1;
                swept.add(&rig.target);
                swept.add(&rig.peer);
                let failed: Vec<CallKind> = [&rig.target, &rig.peer]
                    .iter()
                    .flat_map(|f| f.sites_failed())
                    .map(|s| s.kind)
                    .collect();
                // A release whose second try fails too is lost (logged).
                let retry_failed = injected == 2 && fault(&rig).sites_failed().len() == 1;
                if !retry_failed {
                    assert_eq!(rig.raw.live_pinned(), 0, "{what}: pinned buffers left");
                    assert_eq!(
                        rig.raw_peer.live_objects(),
                        (0, 0, 0),
                        "{what}: relay buffers left"
                    );
                    assert_eq!(rig.raw.live_objects(), (0, 0, 0), "{what}");
                }
                if !failed.contains(&CallKind::DestroyStream) {
                    assert_eq!(rig.raw.live_streams(), 1, "{what}: lane streams left");
                    assert_eq!(rig.raw_peer.live_streams(), 1, "{what}");
                }
            }
        }
    }
    println!("{runs} runs");
    swept.assert_covers(None);
}
