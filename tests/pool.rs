//! Behaviour of the caching allocator, on the backend chosen by `GLAKE_TEST_BACKEND`.

mod common;

use std::sync::Arc;

use glake::config::{Config, DefragLevel};
use glake::device::{SharedDevice, Stream};
use glake::pool::snapshot::BlockUse;
use glake::{ErrorKind, Pool};

const MIB: usize = 1 << 20;

fn pool_with(device: &SharedDevice, config: Config) -> Pool {
    Pool::new(device.clone(), config).expect("pool")
}

fn pool(device: &SharedDevice) -> Pool {
    pool_with(device, Config::default())
}

fn stitch_off() -> Config {
    Config {
        stitch: false,
        ..Config::default()
    }
}

/// A pool whose physical memory is capped at `budget` bytes.
fn budget_pool(device: &SharedDevice, config: Config, budget: usize) -> Pool {
    let total = device.mem_info().unwrap().total;
    let p = pool_with(device, config);
    p.set_memory_fraction(budget as f64 / total as f64).unwrap();
    p
}

/// Allocates `count` blocks of `size` bytes on the default stream and frees every other one
/// (the first, the third, ...), leaving holes that only a stitch can join. Returns them all.
fn with_holes(p: &Pool, count: usize, size: usize) -> Vec<u64> {
    let blocks: Vec<u64> = (0..count)
        .map(|_| p.malloc(size, Stream::DEFAULT).unwrap())
        .collect();
    for &b in blocks.iter().step_by(2) {
        p.free(b).unwrap();
    }
    blocks
}

/// Frees the blocks [`with_holes`] left live (the second, the fourth, ...) and checks the pool.
fn free_the_rest(p: &Pool, blocks: &[u64]) {
    for &b in blocks.iter().skip(1).step_by(2) {
        p.free(b).unwrap();
    }
    p.check_invariants().unwrap();
}

/// Fills `len` bytes at `ptr` with the pattern of `seed` and reads them back.
fn holds_its_bytes(device: &SharedDevice, ptr: u64, len: usize, seed: u64) {
    common::write_pattern(device, ptr, len, seed);
    assert!(common::has_pattern(device, ptr, len, seed));
}

#[test]
fn small_and_large_requests_are_aligned_and_hold_bytes() {
    let device = common::device();
    let p = pool(&device);
    let mut live = Vec::new();
    for (i, size) in [
        1usize,
        511,
        512,
        513,
        4096,
        MIB,
        MIB + 1,
        3 * MIB + 5,
        17 * MIB,
    ]
    .into_iter()
    .enumerate()
    {
        let ptr = p.malloc(size, Stream::DEFAULT).unwrap();
        assert_eq!(ptr % 512, 0, "{size} bytes at {ptr:#x}");
        common::write_pattern(&device, ptr, size, i as u64);
        live.push((ptr, size, i as u64));
    }
    for &(ptr, size, seed) in &live {
        assert!(common::has_pattern(&device, ptr, size, seed));
        let info = p.allocation_of(ptr + size as u64 - 1).unwrap();
        assert_eq!((info.base, info.requested), (ptr, size));
    }
    let stats = p.stats();
    assert_eq!(stats.allocation.all.current, live.len() as i64);
    assert_eq!(stats.allocation.small_pool.current, 6);
    assert_eq!(stats.allocation.large_pool.current, 3);
    assert_eq!(
        stats.requested_bytes.all.current,
        live.iter().map(|l| l.1 as i64).sum::<i64>()
    );
    for (ptr, _, _) in live {
        p.free(ptr).unwrap();
    }
    p.check_invariants().unwrap();
    assert_eq!(p.stats().allocated_bytes.all.current, 0);
    p.empty_cache().unwrap();
    assert_eq!(p.stats().reserved_bytes.all.current, 0);
}

#[test]
fn freed_memory_is_reused_on_the_same_stream() {
    let device = common::device();
    let p = pool(&device);
    let a = p.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    p.free(a).unwrap();
    let b = p.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(a, b);
    assert_eq!(p.stats().segment.all.current, 1);
    let c = p.malloc(1000, Stream::DEFAULT).unwrap();
    p.free(c).unwrap();
    let d = p.malloc(1000, Stream::DEFAULT).unwrap();
    assert_eq!(c, d);
    p.free(b).unwrap();
    p.free(d).unwrap();
}

/// A freed block is kept whole for the next request of its size (the fast path), yet counts
/// as free at once, and comes back to the free lists, merged with its neighbours, before the
/// pool would grow for a request it could serve.
#[test]
fn freed_blocks_count_as_free_and_merge_before_the_pool_grows() {
    let device = common::device();
    let p = pool(&device);
    let whole = p.malloc(12 * MIB, Stream::DEFAULT).unwrap();
    p.free(whole).unwrap();
    let reserved = p.stats().reserved_bytes.all.current;
    let [a, b, c] = [0; 3].map(|_| p.malloc(4 * MIB, Stream::DEFAULT).unwrap());
    assert_eq!((b - a, c - b), (4 * MIB as u64, 4 * MIB as u64));
    p.free(a).unwrap();
    p.free(b).unwrap();
    let stats = p.stats();
    assert_eq!(stats.allocated_bytes.all.current, 4 * MIB as i64);
    assert_eq!(stats.active.all.current, 1);
    assert_eq!(p.free(a).unwrap_err().kind(), ErrorKind::DoubleFree);
    let layout = block_layout(&p);
    assert!(
        layout
            .iter()
            .flatten()
            .any(|&(addr, size, use_)| addr == a && size == 8 * MIB && use_ == BlockUse::Free),
        "a and b merged into one free block: {layout:?}"
    );
    // Freed again and asked for as one: the two blocks merge rather than the pool growing.
    let b2 = p.malloc(4 * MIB, Stream::DEFAULT).unwrap();
    let a2 = p.malloc(4 * MIB, Stream::DEFAULT).unwrap();
    p.free(a2).unwrap();
    p.free(b2).unwrap();
    let both = p.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(both, a.min(b));
    assert_eq!(p.stats().reserved_bytes.all.current, reserved);
    p.check_invariants().unwrap();
    p.free(both).unwrap();
    p.free(c).unwrap();
    p.empty_cache().unwrap();
    assert_eq!(p.stats().reserved_bytes.all.current, 0);
}

/// Takes `ballast` bytes (kept live), then fills a 64 MiB budget above that with blocks of
/// `block` bytes, frees every other one, and asks for one block four times larger than any
/// free one. Returns the pool's result and the peak reserved bytes above the ballast.
fn fragment_then_ask(
    device: &SharedDevice,
    config: Config,
    ballast: usize,
    block: usize,
) -> (Result<u64, glake::Error>, i64) {
    const BUDGET: usize = 64 * MIB;
    // Less than a granule of slack: the cap, a fraction of the device, is not cut below it.
    let p = budget_pool(device, config, ballast + BUDGET + MIB);
    let held = (ballast > 0).then(|| p.malloc(ballast, Stream::DEFAULT).unwrap());
    // One segment of the whole budget, then split into blocks inside it.
    let whole = p.malloc(BUDGET, Stream::DEFAULT).unwrap();
    p.free(whole).unwrap();
    let blocks: Vec<u64> = (0..BUDGET / block)
        .map(|_| p.malloc(block, Stream::DEFAULT).unwrap())
        .collect();
    for (i, &b) in blocks.iter().enumerate() {
        common::write_pattern(device, b, block, i as u64);
    }
    for &b in blocks.iter().step_by(2) {
        p.free(b).unwrap();
    }
    let ask = 4 * block;
    let result = p.malloc(ask, Stream::DEFAULT);
    if let Ok(ptr) = result {
        common::write_pattern(device, ptr, ask, 99);
        for (i, &b) in blocks.iter().enumerate().skip(1).step_by(2) {
            assert!(common::has_pattern(device, b, block, i as u64));
        }
        assert!(common::has_pattern(device, ptr, ask, 99));
    }
    p.check_invariants().unwrap();
    let peak = p.stats().reserved_bytes.all.peak - ballast as i64;
    if let Some(held) = held {
        p.free(held).unwrap();
    }
    (result, peak)
}

/// Memory a pool holds before its 64 MiB segment is made of 8 MiB handles (1/512 of it, with
/// [`handles_of_1_512`]).
const LARGE_POOL: usize = 4 << 30;

/// The default configuration with handles of at most 1/512 of the pool's memory, so that the
/// tests reach large handles with a smaller ballast.
fn handles_of_1_512() -> Config {
    Config {
        chunk_divisor: 512,
        ..Config::default()
    }
}

#[test]
fn fixed_budget_fragmented_fits_with_stitching_only() {
    let device = common::device();
    // In a large pool a 64 MiB segment is made of 8 MiB handles: holes of whole handles
    // stitch. In a small pool (2 MiB handles) any hole does.
    for (ballast, block) in [(LARGE_POOL, 8 * MIB), (0, 4 * MIB)] {
        let (with, peak_with) = fragment_then_ask(&device, handles_of_1_512(), ballast, block);
        let (without, peak_without) = fragment_then_ask(&device, stitch_off(), ballast, block);
        println!(
            "fragmented 64 MiB budget, {} MiB blocks: stitch ok={} peak reserved {} MiB; caching ok={} peak reserved {} MiB",
            block >> 20,
            with.is_ok(),
            peak_with >> 20,
            without.is_ok(),
            peak_without >> 20
        );
        assert!(with.is_ok(), "stitching failed: {with:?}");
        assert_eq!(without.unwrap_err().kind(), ErrorKind::OutOfMemory);
        assert!(peak_with <= 64 * MIB as i64);
    }
}

#[test]
fn holes_without_a_whole_handle_are_not_stitched() {
    let device = common::device();
    // 4 MiB holes between 8 MiB handles: a stitch would need half handles, which CUDA cannot
    // map, so under a full budget the request fails cleanly (and the holes stay usable).
    let (result, peak) = fragment_then_ask(&device, handles_of_1_512(), LARGE_POOL, 4 * MIB);
    assert_eq!(result.unwrap_err().kind(), ErrorKind::OutOfMemory);
    assert!(peak <= 64 * MIB as i64);
    // GMLake's layout (2 MiB handles, whatever the pool) stitches them.
    let gmlake = Config {
        max_chunk: 2 * MIB,
        ..handles_of_1_512()
    };
    let (result, _) = fragment_then_ask(&device, gmlake, LARGE_POOL, 4 * MIB);
    assert!(result.is_ok(), "{result:?}");
}

/// A stitch starts in the free end of a chunk whose front is allocated and ends in the free
/// front of a chunk whose end is: no other piece could map such bytes, and the chunk's
/// allocated part is mapped in the stitched range too but never handed out.
/// A pool with a ballast of [`LARGE_POOL`] bytes and a 64 MiB segment of 8 MiB handles cut
/// into sixteen 4 MiB blocks (handle k holds blocks 2k and 2k+1), each with a pattern seeded
/// by its index; its memory is capped at `headroom` bytes above that.
fn two_blocks_per_handle(device: &SharedDevice, headroom: usize) -> (Pool, u64, Vec<u64>) {
    const SEGMENT: usize = 64 * MIB;
    let p = budget_pool(device, handles_of_1_512(), LARGE_POOL + SEGMENT + headroom);
    let ballast = p.malloc(LARGE_POOL, Stream::DEFAULT).unwrap();
    let whole = p.malloc(SEGMENT, Stream::DEFAULT).unwrap();
    p.free(whole).unwrap();
    let blocks: Vec<u64> = (0..16)
        .map(|_| p.malloc(4 * MIB, Stream::DEFAULT).unwrap())
        .collect();
    for (i, &b) in blocks.iter().enumerate() {
        common::write_pattern(device, b, 4 * MIB, i as u64);
    }
    (p, ballast, blocks)
}

/// Frees what [`two_blocks_per_handle`] made but the blocks `freed`, and checks that the pool
/// gives every byte back.
fn free_two_blocks_per_handle(p: Pool, ballast: u64, blocks: &[u64], freed: &[usize]) {
    for (i, &b) in blocks.iter().enumerate() {
        if !freed.contains(&i) {
            p.free(b).unwrap();
        }
    }
    p.free(ballast).unwrap();
    p.check_invariants().unwrap();
    p.empty_cache().unwrap();
    let stats = p.stats();
    assert_eq!(stats.reserved_bytes.all.current, 0);
    assert_eq!(stats.stitched_blocks.current, 0);
    assert_eq!(stats.stitched_mapped_bytes.current, 0);
}

/// Writes a pattern (seed 99) through `stitched`'s range and checks that its pieces' home
/// addresses read it back in order, and that the blocks of [`two_blocks_per_handle`] but the
/// `freed` ones keep theirs.
fn stitched_bytes_land_in_their_pieces(
    device: &SharedDevice,
    stitched: &glake::pool::snapshot::StitchedInfo,
    blocks: &[u64],
    freed: &[usize],
) {
    common::write_pattern(device, stitched.address, stitched.size, 99);
    let through_homes: Vec<u8> = stitched
        .pieces
        .iter()
        .flat_map(|&(home, len)| common::read(device, home, len))
        .collect();
    let size = through_homes.len();
    assert_eq!(common::read(device, stitched.address, size), through_homes);
    for (i, &b) in blocks.iter().enumerate() {
        if !freed.contains(&i) {
            assert!(
                common::has_pattern(device, b, 4 * MIB, i as u64),
                "block {i}"
            );
        }
    }
}

#[test]
fn a_stitch_begins_and_ends_in_chunks_shared_with_live_allocations() {
    let device = common::device();
    let (p, ballast, blocks) = two_blocks_per_handle(&device, MIB);
    // The end of chunk 0 and the front of chunk 2: no whole chunk is free.
    p.free(blocks[1]).unwrap();
    p.free(blocks[4]).unwrap();
    let reserved = p.stats().reserved_bytes.all.current;
    let big = p.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    let stats = p.stats();
    assert_eq!(stats.stitches, 1);
    assert_eq!(stats.reserved_bytes.all.current, reserved, "no growth");
    assert_eq!(
        stats.stitched_mapped_bytes.current,
        16 * MIB as i64,
        "both chunks whole"
    );
    let snap = p.snapshot();
    let stitched = snap.stitched.iter().find(|s| s.address == big).unwrap();
    assert_eq!(
        stitched.pieces,
        vec![(blocks[1], 4 * MIB), (blocks[4], 4 * MIB)]
    );
    assert_eq!(stitched.handle_count, 2);
    stitched_bytes_land_in_their_pieces(&device, stitched, &blocks, &[1, 4]);
    p.check_invariants().unwrap();
    // Freed, the range stays mapped and serves the same request again.
    p.free(big).unwrap();
    let again = p.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(again, big);
    assert_eq!(p.stats().stitch_reuse_hits, 1);
    assert!(common::has_pattern(&device, again, 8 * MIB, 99));
    p.free(again).unwrap();
    free_two_blocks_per_handle(p, ballast, &blocks, &[1, 4]);
}

/// When the free blocks fall short, new memory is mapped before the stitch's last piece, so
/// that piece can still end in the free front of a chunk whose end is held: here 8 MiB of new
/// memory serve a 16 MiB request, where whole chunks only would have needed 12 or 16.
#[test]
fn new_memory_goes_before_a_last_piece_that_ends_inside_a_held_chunk() {
    let device = common::device();
    let (p, ballast, blocks) = two_blocks_per_handle(&device, 9 * MIB);
    // The end of chunk 0 and the front of chunk 2.
    p.free(blocks[1]).unwrap();
    p.free(blocks[4]).unwrap();
    let reserved = p.stats().reserved_bytes.all.current;
    let big = p.malloc(16 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(p.stats().stitches, 1);
    assert_eq!(
        p.stats().reserved_bytes.all.current,
        reserved + 8 * MIB as i64
    );
    let snap = p.snapshot();
    let stitched = snap.stitched.iter().find(|s| s.address == big).unwrap();
    let homes: Vec<u64> = stitched.pieces.iter().map(|&(home, _)| home).collect();
    let lens: Vec<usize> = stitched.pieces.iter().map(|&(_, len)| len).collect();
    assert_eq!(lens, vec![4 * MIB, 8 * MIB, 4 * MIB]);
    assert_eq!((homes[0], homes[2]), (blocks[1], blocks[4]));
    stitched_bytes_land_in_their_pieces(&device, stitched, &blocks, &[1, 4]);
    p.check_invariants().unwrap();
    p.free(big).unwrap();
    free_two_blocks_per_handle(p, ballast, &blocks, &[1, 4]);
}

#[test]
fn stitched_bytes_are_the_bytes_of_the_pieces() {
    let device = common::device();
    let p = pool(&device);
    let blocks = with_holes(&p, 6, 6 * MIB);
    let reserved = p.stats().reserved_bytes.all.current;
    let big = p.malloc(18 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(p.stats().reserved_bytes.all.current, reserved, "no growth");
    assert_eq!(p.stats().stitches, 1);
    let snap = p.snapshot();
    let stitched = snap.stitched.iter().find(|s| s.address == big).unwrap();
    assert!(stitched.in_use);
    assert_eq!(stitched.size, 18 * MIB);
    assert_eq!(stitched.pieces.len(), 3);
    // Write through the stitched range; read each piece at its home address, and back.
    let data: Vec<u8> = (0..18 * MIB).map(|i| (i / 4096 % 251) as u8).collect();
    common::write(&device, big, &data);
    let mut offset = 0;
    for &(home, len) in &stitched.pieces {
        assert_eq!(common::read(&device, home, len), data[offset..offset + len]);
        offset += len;
    }
    let piece = stitched.pieces[1];
    common::write(&device, piece.0, &[7u8; 4096]);
    assert_eq!(
        common::read(&device, big + stitched.pieces[0].1 as u64, 4096),
        vec![7u8; 4096]
    );
    assert!(snap
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .any(|b| b.state == BlockUse::Stitched));
    // The requested bytes of the snapshot's blocks, the pieces' included, are the statistics'.
    let requested: usize = snap
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .map(|b| b.requested_size)
        .sum();
    assert_eq!(requested as i64, p.stats().requested_bytes.all.current);
    p.free(big).unwrap();
    // The same request again reuses the cached stitched range: no new stitch.
    let again = p.malloc(18 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(again, big);
    let stats = p.stats();
    assert_eq!((stats.stitches, stats.stitch_reuse_hits), (1, 1));
    p.free(again).unwrap();
    for &b in blocks.iter().skip(1).step_by(2) {
        p.free(b).unwrap();
    }
    p.check_invariants().unwrap();
    let waits = p.stats().num_sync_all_streams;
    p.empty_cache().unwrap();
    let stats = p.stats();
    assert_eq!(stats.reserved_bytes.all.current, 0);
    assert_eq!(stats.stitched_blocks.current, 0);
    assert_eq!(stats.stitch_collections, 1);
    assert_eq!(
        stats.num_sync_all_streams,
        waits + 1,
        "one wait for the device covers the idle stitched range and the segments"
    );
}

/// Stitched ranges that went stale one after another: `holes` 6 MiB holes, each filled; every
/// round frees the fillers of two holes, stitches 12 MiB over them, frees it and fills the holes
/// again (but in the last round), so each round's range goes stale but the last, whose pieces
/// stay free. Rounds: every pair of holes. A refill may put the two fillers in each other's
/// hole (which of two equal free blocks comes first depends on where the host backend's
/// mappings landed, and so on the tests running beside this one), so fillers are kept by hole:
/// a pair of holes freed twice would find its old range free and stitch nothing.
struct StaleRanges {
    blocks: Vec<u64>,
    fillers: Vec<u64>,
    last_pair: (usize, usize),
    last: u64,
    rounds: usize,
}

fn stitch_stale_ranges(p: &Pool, holes: usize) -> StaleRanges {
    let blocks = with_holes(p, 2 * holes, 6 * MIB);
    let mut fillers: Vec<u64> = (0..holes)
        .map(|_| p.malloc(6 * MIB, Stream::DEFAULT).unwrap())
        .collect();
    // A filler takes its hole whole, so its address names the hole.
    let holes_at = fillers.clone();
    let pairs: Vec<(usize, usize)> = (0..holes)
        .flat_map(|i| (i + 1..holes).map(move |j| (i, j)))
        .collect();
    let mut last = 0;
    for (round, &(i, j)) in pairs.iter().enumerate() {
        p.free(fillers[i]).unwrap();
        p.free(fillers[j]).unwrap();
        last = p.malloc(12 * MIB, Stream::DEFAULT).unwrap();
        assert_eq!(
            p.stats().stitches,
            round as i64 + 1,
            "round {round} stitched"
        );
        p.free(last).unwrap();
        if round + 1 < pairs.len() {
            let refilled = [(); 2].map(|_| p.malloc(6 * MIB, Stream::DEFAULT).unwrap());
            for filler in refilled {
                let hole = [i, j].into_iter().find(|&k| holes_at[k] == filler);
                fillers[hole.expect("a refill takes one of the two holes")] = filler;
            }
        }
    }
    StaleRanges {
        blocks,
        fillers,
        last_pair: pairs[pairs.len() - 1],
        last,
        rounds: pairs.len(),
    }
}

/// Frees what [`stitch_stale_ranges`] left allocated and checks the pool.
fn free_stale_ranges(p: &Pool, s: &StaleRanges) {
    let (i, j) = s.last_pair;
    for (k, &f) in s.fillers.iter().enumerate() {
        if k != i && k != j {
            p.free(f).unwrap();
        }
    }
    for &b in s.blocks.iter().skip(1).step_by(2) {
        p.free(b).unwrap();
    }
    p.check_invariants().unwrap();
}

#[test]
fn the_newest_free_stitched_range_is_reused_behind_many_stale_ones() {
    // 276 rounds leave 275 stale ranges of one size, more than a reuse attempt examines; a
    // training loop's next step asks for the last one again. On the host backend, whose layout
    // is the same on every machine (the policy under test does not depend on the device).
    let (_host, _device, p) = common::host_pool(1024 * MIB);
    let stale = stitch_stale_ranges(&p, 24);
    let again = p.malloc(12 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(
        again, stale.last,
        "the free range is found behind the stale ones"
    );
    let stats = p.stats();
    assert_eq!(stats.stitches, stale.rounds as i64);
    assert_eq!(stats.stitch_reuse_hits, 1);
    p.free(again).unwrap();
    free_stale_ranges(&p, &stale);
}

#[test]
fn idle_stitched_ranges_past_their_limit_go_a_quarter_at_once() {
    // 92 holes: 4186 rounds. When the 4097th idle range is one too many, the least recently
    // used go down to 3072 in one collection (one device-wide wait), and no other follows.
    let (_host, _device, p) = common::host_pool(4096 * MIB);
    let stale = stitch_stale_ranges(&p, 92);
    let stats = p.stats();
    assert_eq!(stats.stitch_collections, 4097 - 3072);
    assert_eq!(stats.num_sync_all_streams, 1);
    assert_eq!(stats.stitched_blocks.current, (stale.rounds - 1025) as i64);
    // The newest range survived the collection.
    let again = p.malloc(12 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(again, stale.last);
    p.free(again).unwrap();
    free_stale_ranges(&p, &stale);
}

#[test]
fn a_run_of_one_size_shares_packed_segments() {
    // Seven tensors of 5.5 MiB made one after another (a model's optimizer states): the first
    // three get 6 MiB each; the fourth, with three before it, a segment for four (22 MiB: 11
    // whole granules), which the next three fill. 40 MiB reserved, where a segment each would
    // take 42 and leave seven unusable half MiB rests.
    let (_host, _device, p) = common::host_pool(1024 * MIB);
    let odd = 11 * MIB / 2;
    let tensors: Vec<u64> = (0..7)
        .map(|_| p.malloc(odd, Stream::DEFAULT).unwrap())
        .collect();
    let stats = p.stats();
    assert_eq!(stats.reserved_bytes.all.current, 40 * MIB as i64);
    assert_eq!(stats.segment.all.current, 4);
    // The four of the packed segment lie back to back.
    for pair in tensors[3..].windows(2) {
        assert_eq!(pair[1].abs_diff(pair[0]), odd as u64);
    }
    // A request of another size breaks the run: the next 5.5 MiB gets its own granules again.
    let other = p.malloc(3 * MIB, Stream::DEFAULT).unwrap();
    let after = p.malloc(odd, Stream::DEFAULT).unwrap();
    let reserved = p.stats().reserved_bytes.all.current;
    assert_eq!(reserved, (40 + 4 + 6) * MIB as i64);
    for ptr in tensors.into_iter().chain([other, after]) {
        p.free(ptr).unwrap();
    }
    p.check_invariants().unwrap();
    // A packed segment is an ordinary one: free, it goes back to the device.
    p.empty_cache().unwrap();
    assert_eq!(p.stats().reserved_bytes.all.current, 0);

    // Under a cap with room for four segments of their own and not for a packed one, the
    // fourth of a run gets its own: packing never turns a request that fits into an
    // out-of-memory.
    let device = common::device();
    let q = budget_pool(&device, Config::default(), 24 * MIB);
    let four = [(); 4].map(|_| q.malloc(odd, Stream::DEFAULT).unwrap());
    assert_eq!(q.stats().reserved_bytes.all.current, 24 * MIB as i64);
    for ptr in four {
        q.free(ptr).unwrap();
    }

    // Nor past a soft limit (SmartSwap's), where it would give back cached memory: with 4 MiB
    // cached and 18 in use under a soft limit of 30, the fourth gets its own 6 MiB, and the
    // cached segment stays.
    let config = Config {
        stitch: false,
        ..Config::default()
    };
    let r = pool_with(&device, config);
    let cached = r.malloc(4 * MIB, Stream::DEFAULT).unwrap();
    r.free(cached).unwrap();
    r.set_soft_limit(Some(30 * MIB));
    let four = [(); 4].map(|_| r.malloc(odd, Stream::DEFAULT).unwrap());
    let stats = r.stats();
    assert_eq!(stats.reserved_bytes.all.current, 28 * MIB as i64);
    assert_eq!(stats.num_device_free, 0);
    for ptr in four {
        r.free(ptr).unwrap();
    }
}

#[test]
fn defrag_level_one_grows_before_stitching() {
    let device = common::device();
    let config = Config {
        defrag_level: DefragLevel::WhenFull,
        ..Config::default()
    };
    let p = pool_with(&device, config.clone());
    with_holes(&p, 4, 4 * MIB);
    let big = p.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(p.stats().stitches, 0, "room to grow: no stitch");
    p.free(big).unwrap();
    // Under a cap that is full, level 1 stitches.
    let q = budget_pool(&device, config, 16 * MIB);
    with_holes(&q, 4, 4 * MIB);
    let big = q.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(q.stats().stitches, 1);
    assert_eq!(q.stats().reserved_bytes.all.peak, 16 * MIB as i64);
    q.free(big).unwrap();
}

#[test]
fn frag_limit_keeps_small_pieces_out_of_stitches() {
    let device = common::device();
    let p = pool_with(
        &device,
        Config {
            frag_limit: 8 * MIB,
            ..Config::default()
        },
    );
    with_holes(&p, 4, 4 * MIB);
    let big = p.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(p.stats().stitches, 0, "4 MiB pieces are below fragLimit");
    assert_eq!(p.stats().reserved_bytes.all.current, 24 * MIB as i64);
    p.free(big).unwrap();
}

/// On devices whose total is not a round number (an H100's, for one), a cap given as
/// budget / total holds the whole budget, and a byte limit holds exactly its bytes.
#[test]
fn caps_hold_their_budget_on_any_device_total() {
    for total in [
        85_000_000_003,
        85_017_493_504,
        150_754_820_096,
        (64 << 30) - 1,
    ] {
        let device: SharedDevice = common::host_device(total);
        for config in [Config::default(), stitch_off()] {
            let p = budget_pool(&device, config.clone(), 16 * MIB);
            let whole = p.malloc(16 * MIB, Stream::DEFAULT).unwrap();
            assert_eq!(p.memory_limit(), 16 * MIB, "total {total}");
            assert!(p.malloc(2 * MIB, Stream::DEFAULT).is_err());
            p.free(whole).unwrap();
            let q = pool_with(&device, config);
            q.set_memory_limit(16 * MIB).unwrap();
            let whole = q.malloc(16 * MIB, Stream::DEFAULT).unwrap();
            assert!(q.malloc(2 * MIB, Stream::DEFAULT).is_err());
            q.free(whole).unwrap();
            assert_eq!(q.memory_fraction(), (16 * MIB) as f64 / total as f64);
        }
    }
}

#[test]
fn memory_fraction_caps_growth_and_oom_is_an_error() {
    let device = common::device();
    let p = budget_pool(&device, Config::default(), 32 * MIB);
    let a = p.malloc(20 * MIB, Stream::DEFAULT).unwrap();
    let err = p.malloc(20 * MIB, Stream::DEFAULT).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory);
    assert!(err.message().contains("cap"), "{err}");
    let stats = p.stats();
    assert_eq!(stats.num_ooms, 1);
    assert!(stats.num_alloc_retries >= 1);
    // The pool keeps working.
    let b = p.malloc(10 * MIB, Stream::DEFAULT).unwrap();
    p.free(a).unwrap();
    p.free(b).unwrap();
    assert!(p.set_memory_fraction(-0.1).is_err());
    assert!(p.set_memory_fraction(1.5).is_err());
    assert!(p.set_memory_fraction(f64::NAN).is_err());
    // A fraction of 0 (as PyTorch allows) lets nothing new be created.
    p.empty_cache().unwrap();
    p.set_memory_fraction(0.0).unwrap();
    assert_eq!(p.memory_fraction(), 0.0);
    let err = p.malloc(4 * MIB, Stream::DEFAULT).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory);
    p.set_memory_fraction(1.0).unwrap();
    p.free(p.malloc(4 * MIB, Stream::DEFAULT).unwrap()).unwrap();
}

/// Memory a pool's own allocator made counts against the cap with the pool's: growth stops
/// where both together reach it, counting in frees cached memory first, and a count past the
/// cap is an out-of-memory error that counts nothing.
#[test]
fn outside_memory_shares_the_cap() {
    let device = common::device();
    let p = budget_pool(&device, Config::default(), 64 * MIB);
    p.count_outside(40 * MIB).unwrap();
    assert_eq!(p.outside_bytes(), 40 * MIB);
    let a = p.malloc(20 * MIB, Stream::DEFAULT).unwrap();
    let err = p.malloc(20 * MIB, Stream::DEFAULT).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory);
    let err = p.count_outside(8 * MIB).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory);
    assert!(err.message().contains("own allocator"), "{err}");
    assert_eq!(p.outside_bytes(), 40 * MIB);
    // Freed memory is cached; counting more outside memory returns it to the driver.
    p.free(a).unwrap();
    assert!(p.stats().reserved_bytes.all.current > 0);
    p.count_outside(20 * MIB).unwrap();
    assert_eq!(p.stats().reserved_bytes.all.current, 0);
    let err = p.uncount_outside(61 * MIB).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    assert_eq!(p.outside_bytes(), 60 * MIB);
    p.uncount_outside(60 * MIB).unwrap();
    p.free(p.malloc(40 * MIB, Stream::DEFAULT).unwrap())
        .unwrap();
}

#[test]
fn bad_inputs_are_errors_with_messages() {
    let device = common::device();
    let p = pool(&device);
    let zero = p.malloc(0, Stream::DEFAULT).unwrap_err();
    assert_eq!(zero.kind(), ErrorKind::InvalidArgument);
    assert!(zero.message().contains("size 0"));
    let huge = p.malloc(usize::MAX - 10, Stream::DEFAULT).unwrap_err();
    assert_eq!(huge.kind(), ErrorKind::InvalidArgument);
    let total = device.mem_info().unwrap().total;
    let beyond = p.malloc(total + 4096, Stream::DEFAULT).unwrap_err();
    assert_eq!(beyond.kind(), ErrorKind::OutOfMemory);
    assert!(beyond.message().contains("larger than the device"));
    let a = p.malloc(4 * MIB, Stream::DEFAULT).unwrap();
    let inner = p.free(a + 512).unwrap_err();
    assert_eq!(inner.kind(), ErrorKind::InvalidPointer);
    assert!(inner.message().contains("inside memory of this pool"));
    p.free(a).unwrap();
    let twice = p.free(a).unwrap_err();
    assert_eq!(twice.kind(), ErrorKind::DoubleFree);
    assert!(twice.message().contains("double free"));
    let foreign = p.free(0x1000).unwrap_err();
    assert_eq!(foreign.kind(), ErrorKind::InvalidPointer);
    assert!(foreign.message().contains("not allocated by this pool"));
    assert_eq!(p.free(0).unwrap_err().kind(), ErrorKind::NullPointer);
    assert_eq!(
        p.record_stream(0x1000, Stream(1)).unwrap_err().kind(),
        ErrorKind::InvalidPointer
    );
    // A stream the backend does not know is refused when recorded, and the free stays clean
    // (the host backend knows its streams; CUDA cannot check a raw handle).
    if !common::backend_is_cuda() {
        let live = p.malloc(MIB, Stream::DEFAULT).unwrap();
        let unknown = p.record_stream(live, Stream(0xdead_beef)).unwrap_err();
        assert_eq!(unknown.kind(), ErrorKind::InvalidArgument);
        assert!(unknown.message().contains("unknown stream"), "{unknown}");
        p.free(live).unwrap();
    }
    p.check_invariants().unwrap();
}

#[test]
fn other_streams_wait_for_the_freeing_stream() {
    let device = common::device();
    let s1 = device.create_stream().unwrap();
    let s2 = device.create_stream().unwrap();
    let p = pool(&device);
    let a = p.malloc(8 * MIB, s1).unwrap();
    p.free(a).unwrap();
    let b = p.malloc(8 * MIB, s2).unwrap();
    assert_ne!(a, b, "memory freed on s1 is not reused on s2 unseen");
    let c = p.malloc(8 * MIB, s1).unwrap();
    assert_eq!(a, c, "but at once on s1");
    p.free(b).unwrap();
    p.free(c).unwrap();
    drop(p);
    device.destroy_stream(s1).unwrap();
    device.destroy_stream(s2).unwrap();
}

/// Always on the host backend: its streams can be held busy with a gate, so the test can see
/// what waits for them.
#[test]
fn record_stream_delays_reuse_until_the_stream_is_done() {
    let host = common::host_device(1 << 30);
    let shared: SharedDevice = host.clone();
    let s1 = shared.create_stream().unwrap();
    let s2 = shared.create_stream().unwrap();
    let p = Pool::new(shared.clone(), Config::default()).unwrap();
    let a = p.malloc(4 * MIB, s1).unwrap();
    p.record_stream(a, s2).unwrap();
    let (open, gate) = std::sync::mpsc::channel::<()>();
    host.enqueue_host_fn(
        s2,
        Box::new(move || {
            let _ = gate.recv();
        }),
    )
    .unwrap();
    p.free(a).unwrap();
    assert_eq!(p.stats().active.all.current, 1, "pending free stays active");
    assert_eq!(
        p.free(a).unwrap_err().kind(),
        ErrorKind::DoubleFree,
        "a pending free is freed already"
    );
    let b = p.malloc(4 * MIB, s1).unwrap();
    assert_ne!(a, b, "s2 may still use it");
    open.send(()).unwrap();
    shared.synchronize_stream(s2).unwrap();
    let c = p.malloc(4 * MIB, s1).unwrap();
    assert_eq!(a, c, "reused once s2 is done");
    assert_eq!(p.stats().active.all.current, 2);
    p.free(b).unwrap();
    p.free(c).unwrap();
    p.check_invariants().unwrap();
}

/// Always on the host backend (a gated stream): under a full cap, a request on s2 waits for
/// s1's queued work rather than failing.
#[test]
fn cross_stream_reuse_under_a_full_cap_waits_for_the_other_stream() {
    let host = common::host_device(16 * MIB);
    let shared: SharedDevice = host.clone();
    let s1 = shared.create_stream().unwrap();
    let s2 = shared.create_stream().unwrap();
    let p = Pool::new(shared.clone(), Config::default()).unwrap();
    let a = p.malloc(16 * MIB, s1).unwrap();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = done.clone();
    host.enqueue_host_fn(
        s1,
        Box::new(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            flag.store(true, std::sync::atomic::Ordering::SeqCst);
        }),
    )
    .unwrap();
    p.free(a).unwrap();
    let b = p.malloc(16 * MIB, s2).unwrap();
    assert!(done.load(std::sync::atomic::Ordering::SeqCst));
    assert_eq!(a, b);
    p.free(b).unwrap();
}

#[test]
fn empty_cache_releases_everything_unused() {
    let device = common::device();
    let p = pool(&device);
    let keep = p.malloc(3 * MIB, Stream::DEFAULT).unwrap();
    let ptrs: Vec<u64> = (0..8)
        .map(|i| p.malloc((i + 1) * MIB + 7, Stream::DEFAULT).unwrap())
        .collect();
    for ptr in ptrs {
        p.free(ptr).unwrap();
    }
    p.empty_cache().unwrap();
    let stats = p.stats();
    assert_eq!(stats.reserved_bytes.all.current, 4 * MIB as i64);
    assert!(stats.num_device_free >= 1);
    p.free(keep).unwrap();
    p.empty_cache().unwrap();
    assert_eq!(p.stats().reserved_bytes.all.current, 0);
}

#[test]
fn peak_stats_reset() {
    let device = common::device();
    let p = pool(&device);
    let a = p.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    p.free(a).unwrap();
    assert_eq!(p.stats().allocated_bytes.all.peak, 8 * MIB as i64);
    p.reset_peak_stats();
    assert_eq!(p.stats().allocated_bytes.all.peak, 0);
    assert_eq!(p.stats().reserved_bytes.all.peak, 8 * MIB as i64);
    p.reset_accumulated_stats();
    assert_eq!(p.stats().allocated_bytes.all.allocated, 0);
}

#[test]
fn snapshot_json_names_segments_blocks_and_stitches() {
    let device = common::device();
    let p = pool(&device);
    let a = p.malloc(4 * MIB, Stream::DEFAULT).unwrap();
    let b = p.malloc(700, Stream::DEFAULT).unwrap();
    let json = p.snapshot().to_json();
    assert!(json.starts_with("{\"segments\":["));
    assert!(json.contains("\"segment_type\":\"large\""));
    assert!(json.contains("\"segment_type\":\"small\""));
    assert!(json.contains("\"state\":\"active_allocated\""));
    assert!(json.contains("\"requested_size\":700"));
    assert!(json.contains("\"allocated_bytes.all.current\":"));
    p.free(a).unwrap();
    p.free(b).unwrap();
}

#[test]
fn a_larger_cached_stitch_serves_a_smaller_request_from_its_prefix() {
    let device = common::device();
    let p = pool(&device);
    let blocks = with_holes(&p, 6, 6 * MIB);
    let big = p.malloc(18 * MIB, Stream::DEFAULT).unwrap();
    p.free(big).unwrap();
    let reserved = p.stats().reserved_bytes.all.current;

    // 10 MiB from the 18 MiB stitched range: its first piece and 4 MiB of the second.
    let small = p.malloc(10 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(small, big, "served by the cached range");
    let stats = p.stats();
    assert_eq!((stats.stitches, stats.stitch_reuse_hits), (1, 1));
    assert_eq!(
        stats.allocated_bytes.all.current,
        10 * MIB as i64 + 3 * 6 * MIB as i64
    );
    assert_eq!(
        p.allocation_of(small + 10 * MIB as u64 - 1).unwrap().base,
        small
    );
    assert!(
        p.allocation_of(small + 12 * MIB as u64).is_none(),
        "the tail is not handed out"
    );
    common::write_pattern(&device, small, 10 * MIB, 5);

    // The third piece stayed free: another 6 MiB fits without growing.
    let other = p.malloc(6 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(p.stats().reserved_bytes.all.current, reserved);
    common::write_pattern(&device, other, 6 * MIB, 6);
    assert!(common::has_pattern(&device, small, 10 * MIB, 5));
    p.free(other).unwrap();
    p.free(small).unwrap();
    free_the_rest(&p, &blocks);
}

/// A request larger than an idle stitched range whose pieces are all free grows that range
/// where it is: the same address, its pieces kept, only the added pieces mapped; every byte
/// is the allocation's own, and the live blocks around keep theirs.
#[test]
fn a_larger_request_grows_an_idle_stitched_range_in_place() {
    let device = common::device();
    let p = pool(&device);
    let blocks = with_holes(&p, 10, 6 * MIB);
    let live: Vec<(usize, u64)> = blocks
        .iter()
        .copied()
        .enumerate()
        .skip(1)
        .step_by(2)
        .collect();
    for &(i, b) in &live {
        common::write_pattern(&device, b, 6 * MIB, i as u64);
    }
    let first = p.malloc(12 * MIB, Stream::DEFAULT).unwrap();
    p.free(first).unwrap();
    let (reserved, mapped) = {
        let s = p.stats();
        (
            s.reserved_bytes.all.current,
            s.stitched_mapped_bytes.current,
        )
    };

    let grown = p.malloc(24 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(grown, first, "grown at its address");
    assert_eq!(p.footprint().stitch_growths, 1);
    let s = p.stats();
    assert_eq!((s.stitches, s.stitched_blocks.current), (2, 1));
    assert_eq!(
        s.stitched_mapped_bytes.current - mapped,
        12 * MIB as i64,
        "only the two added holes are mapped"
    );
    assert_eq!(
        s.reserved_bytes.all.current, reserved,
        "free holes cover it"
    );
    let snap = p.snapshot();
    let range = snap.stitched.iter().find(|r| r.address == grown).unwrap();
    assert_eq!((range.size, range.pieces.len()), (24 * MIB, 4));
    holds_its_bytes(&device, grown, 24 * MIB, 77);
    for &(i, b) in &live {
        assert!(common::has_pattern(&device, b, 6 * MIB, i as u64));
    }
    p.check_invariants().unwrap();

    // Freed, the grown range serves its old size again from its prefix.
    p.free(grown).unwrap();
    let again = p.malloc(12 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!((again, p.stats().stitch_reuse_hits), (first, 1));
    p.free(again).unwrap();
    for &(_, b) in &live {
        p.free(b).unwrap();
    }
    p.check_invariants().unwrap();
    p.empty_cache().unwrap();
    assert_eq!(p.stats().reserved_bytes.all.current, 0);
}

/// With no free block left to add, an idle stitched range grows by new memory mapped after
/// it: the request costs the new handles alone, as growing an expandable segment would.
#[test]
fn an_idle_stitched_range_grows_by_new_memory_when_no_free_block_is_left() {
    let device = common::device();
    let p = pool(&device);
    let blocks = with_holes(&p, 4, 6 * MIB);
    let first = p.malloc(12 * MIB, Stream::DEFAULT).unwrap();
    p.free(first).unwrap();
    let reserved = p.stats().reserved_bytes.all.current;

    let grown = p.malloc(20 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(grown, first);
    assert_eq!(p.footprint().stitch_growths, 1);
    assert_eq!(
        p.stats().reserved_bytes.all.current - reserved,
        8 * MIB as i64,
        "the part the range lacked, new"
    );
    holds_its_bytes(&device, grown, 20 * MIB, 3);
    p.check_invariants().unwrap();

    // Twice the range's size and more has no room after it: a new range.
    p.free(grown).unwrap();
    let larger = p.malloc(48 * MIB, Stream::DEFAULT).unwrap();
    assert_ne!(larger, first);
    assert_eq!(p.footprint().stitch_growths, 1);
    holds_its_bytes(&device, larger, 48 * MIB, 4);
    p.free(larger).unwrap();
    free_the_rest(&p, &blocks);
}

/// Random mallocs and frees of 1-40 MiB on pools of large and small handles, tight and roomy:
/// ranges grow in place hundreds of times, and every live allocation keeps its bytes, the pool
/// stays consistent, and nothing is left on the device after it.
#[test]
fn random_work_that_grows_ranges_keeps_every_byte() {
    const SIZES_MIB: [usize; 13] = [1, 2, 3, 5, 6, 7, 9, 12, 14, 18, 24, 30, 40];
    let mut growths = 0;
    for (seed, chunk_divisor, total) in [
        (1u64, 1, 1usize << 30),
        (2, 64, 1 << 30),
        (3, 2048, 1 << 30),
        (4, 1, 160 << 20),
        (5, 2048, 160 << 20),
    ] {
        let host = common::host_device(total);
        let device: SharedDevice = host.clone();
        let config = Config {
            chunk_divisor,
            ..Config::default()
        };
        let p = pool_with(&device, config);
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut live: Vec<(u64, usize, u64)> = Vec::new();
        for step in 0..400 {
            if live.len() > 3 && (next() % 100 < 45 || live.len() > 40) {
                let (ptr, len, tag) = live.swap_remove(next() as usize % live.len());
                assert!(
                    common::has_pattern(&device, ptr, len, tag),
                    "seed {seed} step {step}"
                );
                p.free(ptr).unwrap();
            } else {
                let len = SIZES_MIB[next() as usize % SIZES_MIB.len()] * MIB
                    + (next() % 4) as usize * (MIB / 2);
                match p.malloc(len, Stream::DEFAULT) {
                    Ok(ptr) => {
                        let tag = next();
                        common::write_pattern(&device, ptr, len, tag);
                        live.push((ptr, len, tag));
                    }
                    Err(err) => assert_eq!(err.kind(), ErrorKind::OutOfMemory, "{err}"),
                }
            }
            if step % 8 == 0 {
                for &(ptr, len, tag) in &live {
                    assert!(
                        common::has_pattern(&device, ptr, len, tag),
                        "seed {seed} step {step}"
                    );
                }
                p.check_invariants()
                    .unwrap_or_else(|err| panic!("seed {seed} step {step}: {err}"));
            }
        }
        growths += p.footprint().stitch_growths;
        for (ptr, len, tag) in live {
            assert!(common::has_pattern(&device, ptr, len, tag), "seed {seed}");
            p.free(ptr).unwrap();
        }
        p.check_invariants().unwrap();
        drop(p);
        assert_eq!(
            host.live_objects(),
            (0, 0, 0),
            "seed {seed}: driver objects left"
        );
    }
    assert!(growths > 20, "only {growths} growths");
}

/// With `grow_stitched` off, a larger request stitches a range of its own.
#[test]
fn ranges_do_not_grow_when_growing_is_off() {
    let device = common::device();
    let config = Config {
        grow_stitched: false,
        ..Config::default()
    };
    let p = pool_with(&device, config);
    let blocks = with_holes(&p, 4, 6 * MIB);
    let first = p.malloc(12 * MIB, Stream::DEFAULT).unwrap();
    p.free(first).unwrap();
    let other = p.malloc(20 * MIB, Stream::DEFAULT).unwrap();
    assert_ne!(other, first);
    assert_eq!(p.footprint().stitch_growths, 0);
    holds_its_bytes(&device, other, 20 * MIB, 2);
    p.free(other).unwrap();
    free_the_rest(&p, &blocks);
}

/// Memory of a private pool (a CUDA graph's) is used only by requests routed to it, stays
/// through `empty_cache`, and joins the shared pool when the pool is released.
#[test]
fn private_pool_memory_is_kept_apart_until_released() {
    let device = common::device();
    let p = pool(&device);
    let id = (7, 0);
    let shared = p.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    p.free(shared).unwrap();

    p.begin_private(id);
    let graph_tmp = p.malloc_in(8 * MIB, Stream::DEFAULT, Some(id)).unwrap();
    assert_ne!(
        graph_tmp, shared,
        "a private pool must not reuse shared free memory"
    );
    let small = p.malloc_in(1000, Stream::DEFAULT, Some(id)).unwrap();
    let mut both = vec![graph_tmp, small];
    both.sort_unstable();
    assert_eq!(p.private_allocations(id), Some(both));
    assert_eq!(p.private_allocations((8, 0)), None);
    p.free(graph_tmp).unwrap();
    // Freed during the capture: reusable by the same capture, in stream order...
    let again = p.malloc_in(8 * MIB, Stream::DEFAULT, Some(id)).unwrap();
    assert_eq!(again, graph_tmp);
    p.free(again).unwrap();
    // ...but never by a shared request, nor released while a capture may be underway.
    let reserved = p.stats().reserved_bytes.all.current;
    p.empty_cache().unwrap();
    assert_eq!(p.stats().reserved_bytes.all.current, reserved);
    let outside = p.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    assert_ne!(outside, graph_tmp);
    p.end_private(id).unwrap();
    p.free(outside).unwrap();

    // After the capture the graph still replays into its free memory: kept by empty_cache.
    p.empty_cache().unwrap();
    let kept = p.stats().reserved_bytes.all.current;
    assert!(kept >= (8 * MIB) as i64, "private memory released early");
    let elsewhere = p.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    assert_ne!(elsewhere, graph_tmp);
    p.free(elsewhere).unwrap();

    // Released, it is shared memory like any other: empty_cache returns it.
    p.release_private(id).unwrap();
    assert_eq!(p.private_pool_count(), 0);
    p.free(small).unwrap();
    p.check_invariants().unwrap();
    p.empty_cache().unwrap();
    assert_eq!(p.stats().reserved_bytes.all.current, 0);
}

#[test]
fn private_pool_misuse_is_an_error() {
    let device = common::device();
    let p = pool(&device);
    let err = p.malloc_in(MIB, Stream::DEFAULT, Some((1, 2))).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidState);
    assert_eq!(
        p.end_private((1, 2)).unwrap_err().kind(),
        ErrorKind::InvalidState
    );
    assert_eq!(
        p.release_private((1, 2)).unwrap_err().kind(),
        ErrorKind::InvalidState
    );
    // Two captures sharing one pool: the memory stays until both have released it.
    p.begin_private((3, 4));
    p.begin_private((3, 4));
    let a = p.malloc_in(4 * MIB, Stream::DEFAULT, Some((3, 4))).unwrap();
    p.end_private((3, 4)).unwrap();
    p.end_private((3, 4)).unwrap();
    p.free(a).unwrap();
    p.release_private((3, 4)).unwrap();
    assert_eq!(p.private_pool_count(), 1);
    p.release_private((3, 4)).unwrap();
    assert_eq!(p.private_pool_count(), 0);
    p.check_invariants().unwrap();
}

/// Work held on a stream (a kernel still running) until this is dropped, also by a failing
/// assertion, so that a failed test does not hang on the stream.
struct Held(Arc<std::sync::atomic::AtomicBool>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Release);
    }
}

fn hold(host: &glake::device::host::HostDevice, stream: Stream) -> Held {
    let go = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = go.clone();
    host.enqueue_host_fn(
        stream,
        Box::new(move || {
            while !flag.load(std::sync::atomic::Ordering::Acquire) {
                std::thread::yield_now();
            }
        }),
    )
    .unwrap();
    Held(go)
}

/// A graph destroyed while its replay is still queued: the memory of its pool serves no
/// request until the device has been waited for as a whole, and then it does, without new
/// memory.
#[test]
fn a_released_graph_pool_waits_for_the_device_before_its_memory_is_reused() {
    let (host, device, p) = common::host_pool(64 * MIB);
    let replay = device.create_stream().unwrap();
    let other = device.create_stream().unwrap();
    let id = (5, 5);
    p.begin_private(id);
    let graph_tmp = p.malloc_in(8 * MIB, Stream::DEFAULT, Some(id)).unwrap();
    p.free(graph_tmp).unwrap();
    p.end_private(id).unwrap();
    // A device-wide wait before the replay: the free block is owned by no stream.
    p.empty_cache().unwrap();
    let replaying = hold(&host, replay);
    p.release_private(id).unwrap();
    p.check_invariants().unwrap();
    let while_replaying = p.malloc(8 * MIB, other).unwrap();
    assert_ne!(
        while_replaying, graph_tmp,
        "graph memory reused while its replay may run"
    );
    p.free(while_replaying).unwrap();
    drop(replaying);
    // Under memory pressure the pool waits for the device and then serves from that memory.
    p.set_memory_limit(16 * MIB).unwrap();
    let reserved = p.stats().reserved_bytes.all.current;
    let big = p.malloc(8 * MIB, other).unwrap();
    let again = p.malloc(8 * MIB, other).unwrap();
    assert!(
        [big, again].contains(&graph_tmp),
        "released memory not reused after the wait"
    );
    assert!(p.stats().reserved_bytes.all.current <= reserved);
    p.free(big).unwrap();
    p.free(again).unwrap();
    p.check_invariants().unwrap();
    p.empty_cache().unwrap();
    assert_eq!(p.stats().reserved_bytes.all.current, 0);
    drop(p);
    device.destroy_stream(replay).unwrap();
    device.destroy_stream(other).unwrap();
}

/// A pool dropped with a released graph pool's memory still waiting for a device-wide wait
/// gives every byte back.
#[test]
fn a_pool_dropped_with_a_released_graph_pool_loses_nothing() {
    let (host, device, p) = common::host_pool(64 * MIB);
    let id = (6, 6);
    p.begin_private(id);
    let kept = p.malloc_in(8 * MIB, Stream::DEFAULT, Some(id)).unwrap();
    let freed = p.malloc_in(4 * MIB, Stream::DEFAULT, Some(id)).unwrap();
    p.free(freed).unwrap();
    p.end_private(id).unwrap();
    p.release_private(id).unwrap();
    // Still live in the released pool: freed after the release, it stays apart as well.
    p.free(kept).unwrap();
    assert_ne!(p.malloc(8 * MIB, Stream::DEFAULT).unwrap(), kept);
    p.check_invariants().unwrap();
    drop(p);
    assert_eq!(
        host.live_objects(),
        (0, 0, 0),
        "memory left after the pool was dropped"
    );
    drop(device);
}

/// A free used on two extra streams whose second event cannot be recorded, and whose fallback
/// wait for the device fails too: its memory is not reused while the second stream may still
/// use it, and a later wait for the device makes it reusable.
#[test]
fn a_free_whose_events_were_only_partly_recorded_waits_for_the_device() {
    use glake::device::fault::FaultDevice;
    use glake::device::CallKind;
    let host = common::host_device(64 * MIB);
    let fault = Arc::new(FaultDevice::new(host.clone()));
    let device: SharedDevice = fault.clone();
    let p = pool(&device);
    let (s1, s2) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let a = p.malloc(4 * MIB, Stream::DEFAULT).unwrap();
    p.record_stream(a, s1).unwrap();
    p.record_stream(a, s2).unwrap();
    let busy = hold(&host, s2);
    fault.fail_nth(CallKind::RecordEvent, 2); // the event on s2
    fault.fail_nth(CallKind::SynchronizeDevice, 1); // and the wait for the device instead
    assert!(p.free(a).is_err());
    let b = p.malloc(4 * MIB, Stream::DEFAULT).unwrap();
    assert_ne!(b, a, "reused while s2 may still use it");
    drop(busy);
    p.free(b).unwrap();
    p.empty_cache().unwrap();
    p.check_invariants().unwrap();
    assert_eq!(p.stats().reserved_bytes.all.current, 0, "nothing lost");
    drop(p);
    device.destroy_stream(s1).unwrap();
    device.destroy_stream(s2).unwrap();
}

/// A free that needs events of other streams during a capture records them only after it.
#[test]
fn frees_on_extra_streams_wait_for_the_capture_to_end() {
    let device = common::device();
    let side = device.create_stream().unwrap();
    let p = pool(&device);
    let id = (9, 9);
    let a = p.malloc(4 * MIB, Stream::DEFAULT).unwrap();
    p.record_stream(a, side).unwrap();
    p.begin_private(id);
    p.free(a).unwrap();
    assert_eq!(p.free(a).unwrap_err().kind(), ErrorKind::DoubleFree);
    assert_eq!(p.stats().active_bytes.all.current, (4 * MIB) as i64);
    p.end_private(id).unwrap();
    device.synchronize_device().unwrap();
    // Completed events make the memory reusable at the next request.
    let b = p.malloc(4 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(b, a);
    p.free(b).unwrap();
    p.release_private(id).unwrap();
    p.check_invariants().unwrap();
    drop(p);
    device.destroy_stream(side).unwrap();
}

/// A request stitched from many freed pieces is usable end to end, and takes no new memory.
#[test]
fn stitched_from_many_pieces_is_usable_end_to_end() {
    let device = common::device();
    let p = pool(&device);
    let pieces: Vec<_> = (0..80)
        .map(|_| p.malloc(4 * MIB, Stream::DEFAULT).unwrap())
        .collect();
    for (i, &ptr) in pieces.iter().enumerate() {
        if i % 2 == 0 {
            p.free(ptr).unwrap();
        }
    }
    let reserved = p.stats().reserved_bytes.all.current;
    let big = p.malloc(160 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(
        p.stats().stitches,
        1,
        "the request is stitched from the freed pieces"
    );
    assert_eq!(p.stats().reserved_bytes.all.current, reserved);
    common::write_pattern(&device, big, 160 * MIB, 5);
    assert!(common::has_pattern(&device, big, 160 * MIB, 5));
    p.free(big).unwrap();
    for (i, &ptr) in pieces.iter().enumerate() {
        if i % 2 == 1 {
            p.free(ptr).unwrap();
        }
    }
    p.check_invariants().unwrap();
}

/// (address, size, state) of every block, segment by segment: what a graph pool's checkpoint
/// must find again after a restore.
fn block_layout(p: &Pool) -> Vec<Vec<(u64, usize, BlockUse)>> {
    p.snapshot()
        .segments
        .iter()
        .map(|s| {
            s.blocks
                .iter()
                .map(|b| (b.address, b.size, b.state))
                .collect()
        })
        .collect()
}

/// Always on the host backend (a gated stream holds a free pending). A graph pool's
/// checkpoint restored: allocations freed since come back at their addresses with
/// `malloc_at`, counted as any allocation, while ranges that are not free memory of the pool
/// usable on the stream are refused with nothing changed.
#[test]
fn malloc_at_restores_freed_allocations_of_a_private_pool() {
    let host = common::host_device(1 << 30);
    let device: SharedDevice = host.clone();
    let s1 = device.create_stream().unwrap();
    let s2 = device.create_stream().unwrap();
    let p = pool(&device);
    let id = (5, 6);
    let other = p.malloc(4 * MIB, s1).unwrap();
    p.free(other).unwrap();

    p.begin_private(id);
    // One 20 MiB segment split into a, b, keep and a free rest; one small segment for c, d.
    let big = p.malloc_in(20 * MIB, s1, Some(id)).unwrap();
    p.free(big).unwrap();
    let a = p.malloc_in(6 * MIB, s1, Some(id)).unwrap();
    let b = p.malloc_in(4 * MIB, s1, Some(id)).unwrap();
    let keep = p.malloc_in(4 * MIB, s1, Some(id)).unwrap();
    let c = p.malloc_in(1000, s1, Some(id)).unwrap();
    let d = p.malloc_in(3000, s1, Some(id)).unwrap();
    assert_eq!((a + (6 * MIB) as u64, b + (4 * MIB) as u64), (b, keep));
    let checkpoint = p.private_allocations(id).unwrap();
    let stats = p.stats();
    let layout = block_layout(&p);

    // b is used on s2 too, whose work is held back: its free stays pending.
    p.record_stream(b, s2).unwrap();
    let (open, gate) = std::sync::mpsc::channel::<()>();
    host.enqueue_host_fn(
        s2,
        Box::new(move || {
            let _ = gate.recv();
        }),
    )
    .unwrap();
    for ptr in [a, b, c] {
        p.free(ptr).unwrap();
    }
    let mut left = vec![keep, d];
    left.sort_unstable();
    assert_eq!(p.private_allocations(id), Some(left));
    let freed = p.stats();
    let freed_layout = block_layout(&p);
    let refused = |addr: u64, size: usize, stream: Stream, pool: Option<(u64, u64)>| {
        p.malloc_at(addr, size, stream, pool).unwrap_err().kind()
    };
    use ErrorKind::{InvalidArgument, InvalidState};
    assert_eq!(refused(b, 4 * MIB, s1, Some(id)), InvalidState, "pending");
    assert_eq!(refused(keep, 4 * MIB, s1, Some(id)), InvalidState, "live");
    assert_eq!(refused(a, 12 * MIB, s1, Some(id)), InvalidState, "overlaps");
    assert_eq!(refused(a, 6 * MIB, s2, Some(id)), InvalidState, "stream");
    assert_eq!(refused(a, 6 * MIB, s1, None), InvalidState, "shared");
    assert_eq!(refused(a, 6 * MIB, s1, Some((1, 1))), InvalidState);
    assert_eq!(refused(other, 4 * MIB, s1, Some(id)), InvalidState);
    assert_eq!(refused(0x1000, 4 * MIB, s1, Some(id)), InvalidState);
    assert_eq!(refused(a, 6 * MIB + 100, s1, Some(id)), InvalidArgument);
    assert_eq!(refused(a + 100, 2 * MIB, s1, Some(id)), InvalidArgument);
    assert_eq!(refused(c, 1000, s1, Some(id)), InvalidArgument);
    assert_eq!(refused(a, 0, s1, Some(id)), InvalidArgument);
    assert_eq!(p.stats(), freed, "a refusal changes nothing");
    assert_eq!(block_layout(&p), freed_layout);
    p.check_invariants().unwrap();

    // Restored while the routing is active, on the stream they were freed on.
    assert_eq!(p.malloc_at(a, 6 * MIB, s1, Some(id)).unwrap(), a);
    assert_eq!(p.malloc_at(c, 1024, s1, Some(id)).unwrap(), c);
    p.end_private(id).unwrap();
    assert_eq!(refused(b, 4 * MIB, s1, Some(id)), InvalidState, "s2 busy");
    open.send(()).unwrap();
    device.synchronize_stream(s2).unwrap();
    assert_eq!(p.malloc_at(b, 4 * MIB, s1, Some(id)).unwrap(), b);

    assert_eq!(p.private_allocations(id).unwrap(), checkpoint);
    assert_eq!(block_layout(&p), layout);
    let now = p.stats();
    for (name, before, after) in [
        ("allocation", stats.allocation, now.allocation),
        ("active", stats.active, now.active),
        (
            "allocated_bytes",
            stats.allocated_bytes,
            now.allocated_bytes,
        ),
        ("active_bytes", stats.active_bytes, now.active_bytes),
        ("inactive_split", stats.inactive_split, now.inactive_split),
        (
            "inactive_split_bytes",
            stats.inactive_split_bytes,
            now.inactive_split_bytes,
        ),
    ] {
        assert_eq!(before.all.current, after.all.current, "{name}");
        assert_eq!(
            before.small_pool.current, after.small_pool.current,
            "{name}"
        );
        assert_eq!(
            before.large_pool.current, after.large_pool.current,
            "{name}"
        );
    }
    assert_eq!(
        now.allocation.all.allocated,
        stats.allocation.all.allocated + 3
    );
    // A restore asks for the size it restores: c's 1000 bytes come back as 1024.
    assert_eq!(
        now.requested_bytes.all.current,
        stats.requested_bytes.all.current + 24
    );
    let info = p.allocation_of(c + 10).unwrap();
    assert_eq!((info.base, info.size, info.requested), (c, 1024, 1024));
    p.check_invariants().unwrap();

    // The restored allocations free like any other.
    for ptr in [a, b, c, keep, d] {
        p.free(ptr).unwrap();
    }
    assert_eq!(p.stats().allocation.all.current, 0);
    assert_eq!(p.stats().requested_bytes.all.current, 0);
    assert_eq!(p.private_allocations(id), Some(vec![]));
    p.check_invariants().unwrap();
    p.release_private(id).unwrap();
    p.empty_cache().unwrap();
    assert_eq!(p.stats().reserved_bytes.all.current, 0);
    drop(p);
    device.destroy_stream(s1).unwrap();
    device.destroy_stream(s2).unwrap();
}

/// The shared pool restores too, and a private pool's memory is not the shared pool's.
#[test]
fn malloc_at_in_the_shared_pool() {
    let device = common::device();
    let p = pool(&device);
    let a = p.malloc(4 * MIB, Stream::DEFAULT).unwrap();
    p.free(a).unwrap();
    assert_eq!(p.malloc_at(a, 4 * MIB, Stream::DEFAULT, None).unwrap(), a);
    assert_eq!(p.stats().allocated_bytes.all.current, (4 * MIB) as i64);
    assert_eq!(
        p.malloc_at(a, 4 * MIB, Stream::DEFAULT, None)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidState,
        "already live"
    );
    p.free(a).unwrap();
    p.check_invariants().unwrap();
}

/// A soft limit gives cached memory back before the pool grows past it, and, unlike the cap,
/// never fails a request: past it the pool grows as it would without one.
#[test]
fn a_soft_limit_releases_cache_before_growing_and_never_fails() {
    let device = common::device();
    let p = pool_with(&device, stitch_off());
    let s = Stream::DEFAULT;
    p.set_soft_limit(Some(24 * MIB));
    let a = p.malloc(16 * MIB, s).unwrap();
    p.free(a).unwrap(); // 16 MiB cached
    assert_eq!(p.stats().reserved_bytes.all.current as usize, 16 * MIB);
    // A 20 MiB request cannot use the cached 16 MiB: the cache goes back before the pool
    // grows past 24 MiB.
    let b = p.malloc(20 * MIB, s).unwrap();
    let stats = p.stats();
    assert_eq!(stats.reserved_bytes.all.current as usize, 20 * MIB);
    assert_eq!(stats.reserved_bytes.all.peak as usize, 20 * MIB);
    // Past the soft limit with nothing cached: the request still succeeds.
    let c = p.malloc(16 * MIB, s).unwrap();
    assert_eq!(p.stats().reserved_bytes.all.current as usize, 36 * MIB);
    p.set_soft_limit(None);
    p.free(b).unwrap();
    p.free(c).unwrap();
    p.check_invariants().unwrap();
}

/// A swappable allocation reuses a whole idle segment of its size, but never one that a cached
/// stitched range maps (swapping it out would release memory that range still maps).
#[test]
fn swappable_allocations_reuse_idle_segments_no_stitch_maps() {
    let device = common::device();
    let p = pool(&device);
    let s = Stream::DEFAULT;
    let seg = 6 * MIB;
    let first: Vec<u64> = (0..3)
        .map(|_| p.malloc_swappable(seg, s).unwrap())
        .collect();
    for &a in &first {
        p.free(a).unwrap();
    }
    let reserved = p.stats().reserved_bytes.all.current;
    // An idle segment of the size is taken again: no growth.
    let again = p.malloc_swappable(seg, s).unwrap();
    assert!(first.contains(&again));
    assert_eq!(p.stats().reserved_bytes.all.current, reserved);
    p.free(again).unwrap();
    // The three idle segments become the pieces of a stitched range, cached once freed.
    let big = p.malloc(3 * seg, s).unwrap();
    assert_eq!(p.stats().stitches, 1);
    p.free(big).unwrap();
    let fresh = p.malloc_swappable(seg, s).unwrap();
    assert!(
        !first.contains(&fresh),
        "took a segment a cached stitch maps"
    );
    assert_eq!(p.stats().reserved_bytes.all.current, reserved + seg as i64);
    p.swap_out(fresh).unwrap();
    p.swap_in(fresh).unwrap();
    // The cached stitched range is still whole and reused.
    let big2 = p.malloc(3 * seg, s).unwrap();
    assert_eq!((big2, p.stats().stitch_reuse_hits), (big, 1));
    p.free(big2).unwrap();
    p.free(fresh).unwrap();
    p.check_invariants().unwrap();
    p.empty_cache().unwrap();
    assert_eq!(p.stats().reserved_bytes.all.current, 0);
}

/// Holds every `Map` call of the device until released, to stand for a slow driver.
struct GatedMaps {
    gate: std::sync::Mutex<bool>,
    opened: std::sync::Condvar,
    waiting: std::sync::atomic::AtomicUsize,
}

impl glake::device::interpose::Interposer for GatedMaps {
    fn around<T>(
        &self,
        kind: glake::device::CallKind,
        _site: &'static std::panic::Location<'static>,
        call: impl FnOnce() -> glake::Result<T>,
    ) -> glake::Result<T> {
        if kind == glake::device::CallKind::Map {
            self.waiting
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut open = self.gate.lock().expect("gate");
            while !*open {
                open = self.opened.wait(open).expect("gate");
            }
        }
        call()
    }
}

/// While one thread's malloc of `request` bytes is inside a (held-up) Map call, another
/// thread allocates and frees `other` bytes from cached memory, and `meanwhile` runs; then
/// the first gets its memory. `prepare` leaves the pool as the case needs it.
fn mapping_does_not_hold_up_others(
    config: Config,
    prepare: impl FnOnce(&Pool),
    request: usize,
    other: usize,
    meanwhile: impl FnOnce(&Pool),
) -> Pool {
    // Two devices, so that access can be granted to a peer.
    let host = Arc::new(
        glake::device::host::HostDevice::new(
            0,
            glake::device::host::HostOptions {
                total_memory: 1 << 30,
                device_count: 2,
                ..Default::default()
            },
        )
        .expect("host device"),
    );
    let gated = Arc::new(glake::device::interpose::Interposed::with(
        host,
        GatedMaps {
            gate: std::sync::Mutex::new(true),
            opened: std::sync::Condvar::new(),
            waiting: std::sync::atomic::AtomicUsize::new(0),
        },
    ));
    let device: SharedDevice = gated.clone();
    let pool = Arc::new(pool_with(&device, config));
    prepare(&pool);
    *gated.hook().gate.lock().expect("gate") = false;
    let maps_before = gated
        .hook()
        .waiting
        .load(std::sync::atomic::Ordering::SeqCst);
    let grower = {
        let pool = pool.clone();
        std::thread::spawn(move || pool.malloc(request, Stream::DEFAULT))
    };
    while gated
        .hook()
        .waiting
        .load(std::sync::atomic::Ordering::SeqCst)
        == maps_before
    {
        std::thread::yield_now();
    }
    // The grower is inside a Map call now. Cached memory is served at once, and freed: an
    // other thread does it, so that a pool that held its lock fails here instead of hanging.
    let (done, finished) = std::sync::mpsc::channel();
    let others = {
        let pool = pool.clone();
        std::thread::spawn(move || {
            for _ in 0..100 {
                let ptr = pool
                    .malloc(other, Stream::DEFAULT)
                    .expect("malloc from cache");
                pool.free(ptr).expect("free");
            }
            done.send(()).expect("send");
        })
    };
    let served = finished.recv_timeout(std::time::Duration::from_secs(10));
    meanwhile(&pool);
    let grower_waited = !grower.is_finished();
    *gated.hook().gate.lock().expect("gate") = true;
    gated.hook().opened.notify_all();
    others.join().expect("other thread");
    assert!(
        served.is_ok(),
        "cached mallocs waited for another thread's mapping"
    );
    assert!(grower_waited, "the grower's map was still held");
    let ptr = grower
        .join()
        .expect("grower")
        .expect("malloc after the map");
    assert_eq!(pool.allocation_of(ptr).expect("live").size, request);
    pool.free(ptr).expect("free");
    common::check(&pool);
    Arc::try_unwrap(pool).ok().expect("the only owner")
}

/// Leaves one cached (free) segment of each size in `sizes`, made in that order.
fn free_segments(pool: &Pool, sizes: &[usize]) {
    let blocks: Vec<_> = sizes
        .iter()
        .map(|&size| pool.malloc(size, Stream::DEFAULT).expect("malloc"))
        .collect();
    for ptr in blocks {
        pool.free(ptr).expect("free");
    }
}

/// A malloc that makes a new segment does its driver calls without the pool's lock.
#[test]
fn a_new_segment_is_mapped_without_holding_up_other_threads() {
    let prepare = |pool: &Pool| free_segments(pool, &[4 * MIB]);
    mapping_does_not_hold_up_others(stitch_off(), prepare, 64 * MIB, 3 * MIB, |_| {});
}

/// A stitch maps its pieces without the pool's lock.
#[test]
fn a_stitch_is_mapped_without_holding_up_other_threads() {
    // Two free 8 MiB segments for the stitch, and a 2 MiB one for the other thread.
    let prepare = |pool: &Pool| free_segments(pool, &[8 * MIB, 2 * MIB, 8 * MIB]);
    let pool =
        mapping_does_not_hold_up_others(Config::default(), prepare, 16 * MIB, 3 * MIB / 2, |_| {});
    let stats = pool.stats();
    assert_eq!(stats.stitches, 1);
    assert_eq!(
        stats.reserved_bytes.all.current,
        18 * MIB as i64,
        "nothing grown"
    );
}

/// A stitch that grows an idle stitched range maps what it adds without the pool's lock; the
/// range stays out of other requests' reach meanwhile.
#[test]
fn a_stitched_range_grows_without_holding_up_other_threads() {
    // A 16 MiB stitch of two free 8 MiB segments, freed: 24 MiB grows it by new memory. The
    // other thread's requests come from a cached small-pool segment.
    let prepare = |pool: &Pool| {
        free_segments(pool, &[8 * MIB, MIB / 2, 8 * MIB]);
        pool.free(pool.malloc(16 * MIB, Stream::DEFAULT).expect("stitch"))
            .expect("free");
    };
    let meanwhile = |pool: &Pool| {
        // Held by the growth: not reusable, and the pool is consistent while it is mapped.
        assert_eq!(pool.stats().stitch_reuse_hits, 0);
        common::check(pool);
    };
    let pool =
        mapping_does_not_hold_up_others(Config::default(), prepare, 24 * MIB, MIB / 2, meanwhile);
    let stats = pool.stats();
    assert_eq!((stats.stitches, pool.footprint().stitch_growths), (2, 1));
    assert_eq!(stats.stitched_blocks.current, 1, "one range, grown");
}

/// Access granted to a peer while a stitch (with memory it makes for its shortfall) is being
/// mapped reaches everything booked afterwards: the stitch made with the old access is
/// dropped and made again.
#[test]
fn access_granted_during_a_stitch_reaches_its_memory() {
    // Three large free segments for the stitch, and a small one for the other thread.
    let prepare = |pool: &Pool| free_segments(pool, &[8 * MIB, 2 * MIB, 8 * MIB, 4096]);
    let grant = |pool: &Pool| pool.enable_peer_access(1).expect("peer access");
    // 20 MiB: the two 8 MiB pieces and 4 MiB of new memory.
    let pool = mapping_does_not_hold_up_others(Config::default(), prepare, 20 * MIB, 4096, grant);
    let peer = glake::device::host::HostDevice::new(
        1,
        glake::device::host::HostOptions {
            device_count: 2,
            ..Default::default()
        },
    )
    .expect("peer device");
    let mut byte = [0u8; 1];
    for segment in pool.snapshot().segments {
        let end = segment.address + segment.total_size as u64 - 1;
        for at in [segment.address, end] {
            // SAFETY: `byte` holds one byte; the peer only reads the device range.
            let read = unsafe {
                glake::device::Device::copy_to_host(
                    &peer,
                    byte.as_mut_ptr(),
                    at,
                    1,
                    Stream::DEFAULT,
                )
            };
            assert!(
                read.is_ok(),
                "{at:#x} of a segment is not reachable from the peer"
            );
        }
    }
}

/// A smaller request served by a larger cached stitched range leaves the range's last piece
/// free but mapped; `empty_cache` keeps that segment (the driver could not have it back while
/// the range maps it) and counts it, and gives it back once the range is gone.
#[test]
fn empty_cache_keeps_a_free_segment_that_a_stitched_range_in_use_maps() {
    let (host, _device, p) = common::host_pool(512 * MIB);
    let parts: Vec<u64> = [12 * MIB, 10 * MIB, 8 * MIB]
        .iter()
        .map(|&n| p.malloc(n, Stream::DEFAULT).expect("malloc"))
        .collect();
    for &ptr in &parts {
        p.free(ptr).expect("free");
    }
    let (wide, pieces) = p
        .malloc_in_with_pieces(30 * MIB, 30 * MIB, Stream::DEFAULT, None)
        .expect("stitch");
    assert_eq!(pieces, 3);
    p.free(wide).expect("free");
    // 21 MiB: the 12 MiB piece and 9 MiB of the 10 MiB one; the 8 MiB piece stays free.
    let (narrow, _) = p
        .malloc_in_with_pieces(21 * MIB, 21 * MIB, Stream::DEFAULT, None)
        .expect("reuse");
    assert_eq!(narrow, wide, "the cached range serves the smaller request");
    p.empty_cache().expect("empty_cache");
    common::check(&p);
    assert_eq!(
        p.stats().reserved_bytes.all.current as usize,
        host.created_bytes(),
        "reserved bytes are the memory the device holds"
    );
    assert!(
        host.created_bytes() >= 30 * MIB,
        "the mapped piece's segment stays"
    );
    p.free(narrow).expect("free");
    p.empty_cache().expect("empty_cache");
    assert_eq!(p.stats().reserved_bytes.all.current, 0);
    assert_eq!(host.created_bytes(), 0);
}

/// A small-pool segment that would raise the peak of reserved memory takes the place of an
/// idle large-pool segment of at most twice its size, given back first; a larger idle segment
/// stays cached and the peak rises.
#[test]
fn a_small_segment_past_the_peak_replaces_a_small_idle_large_segment() {
    for (large, given_back) in [(4 * MIB, true), (8 * MIB, false)] {
        let (host, _device, p) = common::host_pool(256 * MIB);
        let big = p.malloc(large, Stream::DEFAULT).expect("large");
        let smalls: Vec<u64> = (0..4)
            .map(|_| p.malloc(MIB / 2, Stream::DEFAULT).expect("small"))
            .collect();
        let peak = large + 2 * MIB;
        assert_eq!(p.stats().reserved_bytes.all.peak as usize, peak);
        p.free(big).expect("free");
        // Reading the statistics settles parked blocks: the large segment is idle.
        let _ = p.stats();
        let one_more = p.malloc(MIB / 2, Stream::DEFAULT).expect("small");
        let stats = p.stats();
        if given_back {
            assert_eq!(stats.reserved_bytes.all.peak as usize, peak, "no new peak");
            assert_eq!(stats.reserved_bytes.all.current as usize, 4 * MIB);
        } else {
            assert_eq!(stats.reserved_bytes.all.peak as usize, peak + 2 * MIB);
        }
        assert_eq!(
            stats.reserved_bytes.all.current as usize,
            host.created_bytes()
        );
        common::check(&p);
        for ptr in smalls.into_iter().chain([one_more]) {
            p.free(ptr).expect("free");
        }
        p.empty_cache().expect("empty_cache");
        assert_eq!(host.created_bytes(), 0);
    }
}

/// Stitch #2 of [`gather_small_segments`]: its allocation, the stitched range's pieces and
/// handles, and the gathered segments.
struct Gathering {
    ptr: u64,
    pieces: usize,
    handles: usize,
    gathered: i64,
    /// Handles of the four small segments, counted before stitch #2.
    small_handles: usize,
    reserved_before: i64,
    reserved_after: i64,
}

/// A pool on a 4 GiB host device whose new segments get handles up to 32 MiB (`chunk_divisor`
/// 1), holding a 256 MiB filler, then segments of 400 and 420 MiB and four of 160, 180, 200 and
/// 220 MiB (smaller handles: made while the pool was smaller), all allocated. Returns the
/// device, the pool, the filler, the first two and the four.
#[allow(clippy::type_complexity)]
fn six_segments_on_a_growing_pool() -> (
    Arc<glake::device::host::HostDevice>,
    Pool,
    u64,
    Vec<u64>,
    Vec<u64>,
) {
    let host = common::host_device(4 << 30);
    let config = Config {
        chunk_divisor: 1,
        ..Config::default()
    };
    let p = Pool::new(host.clone(), config).unwrap();
    let mibs = |list: &[usize]| -> Vec<u64> {
        list.iter()
            .map(|&m| p.malloc(m * MIB, Stream::DEFAULT).unwrap())
            .collect()
    };
    let filler = mibs(&[256])[0];
    let first = mibs(&[400, 420]);
    let small = mibs(&[160, 180, 200, 220]);
    (host, p, filler, first, small)
}

/// A stitch whose free blocks cover the request but gathers some of them into new memory:
/// the new memory goes before the last piece, which stops short of its last chunk's end
/// (here, where a live 2 MiB allocation holds that chunk's end), so the range handed out is
/// the pieces' bytes and nothing else (the new memory after that piece mapped the chunk's
/// held bytes into the middle of the allocation).
#[test]
fn new_memory_from_gathered_segments_goes_before_a_last_piece_cut_short() {
    let (host, p, filler, first, small) = six_segments_on_a_growing_pool();
    let shared: SharedDevice = host.clone();
    p.free(small[1]).unwrap();
    // The back of the 180 MiB segment.
    let held = p.malloc(2 * MIB, Stream::DEFAULT).unwrap();
    common::write_pattern(&shared, held, 2 * MIB, 7);
    for &b in [small[0], small[2], small[3]].iter().chain(&first) {
        p.free(b).unwrap();
    }
    let one = p.malloc(820 * MIB, Stream::DEFAULT).unwrap();
    p.free(one).unwrap();
    shared.synchronize_stream(Stream::DEFAULT).unwrap();
    let big = p.malloc(1417 * MIB, Stream::DEFAULT).unwrap();
    assert!(p.stats().gathered_segments > 0, "the stitch gathers");
    p.check_invariants().unwrap();
    let snap = p.snapshot();
    let stitched = snap.stitched.iter().find(|s| s.address == big).unwrap();
    assert!(stitched.size >= 1417 * MIB);
    common::write_pattern(&shared, big, 1417 * MIB, 9);
    let through_homes: Vec<u8> = stitched
        .pieces
        .iter()
        .flat_map(|&(home, len)| common::read(&shared, home, len))
        .take(1417 * MIB)
        .collect();
    assert!(common::read(&shared, big, 1417 * MIB) == through_homes);
    assert!(common::has_pattern(&shared, held, 2 * MIB, 7));
    for ptr in [big, held, filler] {
        p.free(ptr).unwrap();
    }
    p.check_invariants().unwrap();
}

/// A block whose whole chunks are fewer bytes than `fragLimit` serves only as a stitch's last
/// piece, and then with all its free bytes: enough for the rest of new memory's last granule
/// to come out of it.
#[test]
fn a_block_short_of_whole_chunks_ends_a_stitch_with_all_its_bytes() {
    let host = common::host_device(1 << 30);
    let shared: SharedDevice = host.clone();
    let config = Config {
        frag_limit: 2 * MIB + MIB / 2,
        defrag_level: DefragLevel::BeforeGrow,
        ..Config::default()
    };
    let p = Pool::new(shared.clone(), config).unwrap();
    let whole = p.malloc(6 * MIB, Stream::DEFAULT).unwrap();
    p.free(whole).unwrap();
    let y = p.malloc(2 * MIB, Stream::DEFAULT).unwrap();
    let w = p.malloc(2 * MIB + MIB / 2, Stream::DEFAULT).unwrap();
    let z = p.malloc(MIB + MIB / 2, Stream::DEFAULT).unwrap();
    common::write_pattern(&shared, y, 2 * MIB, 1);
    common::write_pattern(&shared, z, MIB + MIB / 2, 2);
    p.free(w).unwrap();
    let big = p.malloc(3 * MIB + MIB / 2, Stream::DEFAULT).unwrap();
    p.check_invariants().unwrap();
    common::write_pattern(&shared, big, 3 * MIB + MIB / 2, 3);
    assert!(common::has_pattern(&shared, big, 3 * MIB + MIB / 2, 3));
    assert!(common::has_pattern(&shared, y, 2 * MIB, 1));
    assert!(common::has_pattern(&shared, z, MIB + MIB / 2, 2));
    for ptr in [big, y, z] {
        p.free(ptr).unwrap();
    }
    p.check_invariants().unwrap();
}

/// A pool whose new segments get handles up to 32 MiB (`chunk_divisor` 1) holding four
/// segments of smaller handles freed early, and two more freed for a first stitch (820 MiB,
/// below the size that gathers), which records the stream's fence. A second stitch (1580 MiB)
/// then maps all six whole. With `gate`, the default stream is held busy from before the first
/// stitch until after the second, so that fence has not passed. Always on the host backend (a
/// gated stream).
fn gather_small_segments(gate: bool) -> (Arc<glake::device::host::HostDevice>, Pool, Gathering) {
    let (host, p, _filler, first, small) = six_segments_on_a_growing_pool();
    let shared: SharedDevice = host.clone();
    for &s in &small {
        p.free(s).unwrap();
    }
    let open = gate.then(|| {
        let (open, wait) = std::sync::mpsc::channel::<()>();
        host.enqueue_host_fn(
            Stream::DEFAULT,
            Box::new(move || {
                let _ = wait.recv();
            }),
        )
        .unwrap();
        open
    });
    for &f in &first {
        p.free(f).unwrap();
    }
    let small_handles: usize = p
        .snapshot()
        .segments
        .iter()
        .filter(|s| small.contains(&s.address))
        .map(|s| s.chunk_sizes.len())
        .sum();
    // Stitch #1 (400 + 420 MiB): no fence yet, so nothing is gathered; it records one.
    let one = p.malloc(820 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(p.stats().stitches, 1);
    assert_eq!(p.stats().gathered_segments, 0, "no fence has passed yet");
    p.free(one).unwrap();
    if !gate {
        // The work queued before the fence is done (as a step's end would see on a GPU).
        shared.synchronize_stream(Stream::DEFAULT).unwrap();
    }
    let reserved_before = p.stats().reserved_bytes.all.current;
    // Stitch #2 grows stitch #1's idle range in place (its two pieces stay) by the four
    // free segments, whole.
    let ptr = p.malloc(1580 * MIB, Stream::DEFAULT).unwrap();
    let stats = p.stats();
    assert_eq!(stats.stitches, 2);
    assert_eq!(
        (ptr, p.footprint().stitch_growths),
        (one, 1),
        "grown in place"
    );
    if let Some(open) = open {
        open.send(()).unwrap();
        shared.synchronize_stream(Stream::DEFAULT).unwrap();
    }
    let snap = p.snapshot();
    let stitched = snap.stitched.iter().find(|s| s.address == ptr).unwrap();
    let gathering = Gathering {
        ptr,
        pieces: stitched.pieces.len(),
        handles: stitched.handle_count,
        gathered: stats.gathered_segments,
        small_handles,
        reserved_before,
        reserved_after: stats.reserved_bytes.all.current,
    };
    (host, p, gathering)
}

/// Checks the bytes of a stitched allocation of `len` bytes, then frees everything.
fn check_and_release(host: &Arc<glake::device::host::HostDevice>, p: Pool, ptr: u64, len: usize) {
    let shared: SharedDevice = host.clone();
    common::write_pattern(&shared, ptr, len, 7);
    assert!(common::has_pattern(&shared, ptr, len, 7));
    p.free(ptr).unwrap();
    p.check_invariants().unwrap();
}

#[test]
fn a_stitch_gathers_idle_small_handle_segments_into_large_handles() {
    let (host, p, g) = gather_small_segments(false);
    // The four small segments (160-220 MiB in 16 MiB handles) went back to the device and
    // their 760 MiB came again in 32 MiB handles; the pool holds the same bytes.
    assert_eq!(g.gathered, 4);
    assert_eq!(p.stats().gathered_handles, g.small_handles as i64);
    assert_eq!(g.reserved_after, g.reserved_before);
    assert_eq!(g.pieces, 3, "stitch #1's two pieces and the new memory");
    let pieces_of_one = 2 * 14; // 400 and 420 MiB in 32 MiB handles, the rest in one more
    assert!(
        g.handles <= pieces_of_one + 760usize.div_ceil(32),
        "{} handles mapped",
        g.handles
    );
    let stats = p.stats();
    assert_eq!(
        host.live_objects().0 as i64,
        stats.num_device_alloc - stats.num_device_free,
        "every released handle is gone from the device"
    );
    check_and_release(&host, p, g.ptr, 1580 * MIB);
}

#[test]
fn segments_freed_before_a_fence_still_queued_are_not_gathered() {
    let (host, p, g) = gather_small_segments(true);
    assert_eq!(g.gathered, 0, "the stream may still read them");
    assert_eq!(g.pieces, 6);
    assert_eq!(g.reserved_after, g.reserved_before);
    check_and_release(&host, p, g.ptr, 1580 * MIB);
}

/// Frees move a stream's fence on, not only stitches: segments freed after the last stitch
/// are gathered by the next one once enough frees have looked at the fence (on a GPU the
/// host runs ahead, so the fence a stitch records has rarely passed by the next stitch of the
/// same step). They were parked until that stitch, and count as freed when their user freed
/// them. Host backend, where an event recorded on an idle stream completes at once.
#[test]
fn frees_move_the_fence_so_segments_freed_after_a_stitch_are_gathered() {
    for churn in [0, 600] {
        let host = common::host_device(4 << 30);
        let shared: SharedDevice = host.clone();
        let config = Config {
            chunk_divisor: 1,
            ..Config::default()
        };
        let p = Pool::new(shared, config).unwrap();
        let malloc = |mib: usize| p.malloc(mib * MIB, Stream::DEFAULT).unwrap();
        // A parked small block: the churn below takes it back each time, unparking nothing.
        p.free(p.malloc(4096, Stream::DEFAULT).unwrap()).unwrap();
        let filler = malloc(256);
        let first = [400, 420].map(malloc);
        let small = [160, 180, 200, 220].map(malloc);
        first.iter().for_each(|&f| p.free(f).unwrap());
        let one = malloc(820);
        p.free(one).unwrap();
        // Parked when freed; the stitch below unparks them, after the churn's fences: they
        // count as freed now, not then.
        small.iter().for_each(|&s| p.free(s).unwrap());
        for _ in 0..churn {
            let x = p.malloc(4096, Stream::DEFAULT).unwrap();
            p.free(x).unwrap();
        }
        let big = malloc(1580);
        let gathered = p.stats().gathered_segments;
        assert_eq!(gathered, if churn == 0 { 0 } else { 4 }, "{churn} frees");
        p.free(big).unwrap();
        p.free(filler).unwrap();
        p.check_invariants().unwrap();
    }
}

/// A request its caller rounded up (PyTorch's `roundup_power2_divisions`) books the bytes asked
/// for as requested on every path: new memory, a stitch, a reused stitched range, a parked
/// block. More asked for than allocated is refused, with nothing changed.
#[test]
fn bytes_asked_for_are_booked_as_requested_on_every_path() {
    let (_host, _device, p) = common::host_pool(512 * MIB);
    let requested = |p: &Pool| p.stats().requested_bytes.all.current as usize;
    let fresh = p
        .malloc_asked(12 * MIB, 11 * MIB, Stream::DEFAULT, None)
        .expect("new memory");
    assert_eq!(requested(&p), 11 * MIB);
    let others: Vec<u64> = [10 * MIB, 8 * MIB]
        .iter()
        .map(|&n| p.malloc(n, Stream::DEFAULT).expect("malloc"))
        .collect();
    p.free(fresh).expect("free");
    for &ptr in &others {
        p.free(ptr).expect("free");
    }
    assert_eq!(requested(&p), 0);
    let (wide, pieces) = p
        .malloc_in_with_pieces(30 * MIB, 25 * MIB, Stream::DEFAULT, None)
        .expect("stitch");
    assert_eq!(pieces, 3, "a stitched range");
    assert_eq!(requested(&p), 25 * MIB);
    assert_eq!(p.stats().active_bytes.all.current as usize, 30 * MIB);
    p.free(wide).expect("free");
    let again = p
        .malloc_asked(30 * MIB, 29 * MIB, Stream::DEFAULT, None)
        .expect("reuse");
    assert_eq!(again, wide, "the cached stitched range");
    assert_eq!(requested(&p), 29 * MIB);
    p.free(again).expect("free");
    let small = p
        .malloc_asked(4096, 3000, Stream::DEFAULT, None)
        .expect("small");
    p.free(small).expect("free");
    let parked = p
        .malloc_asked(4096, 2000, Stream::DEFAULT, None)
        .expect("parked");
    assert_eq!(parked, small, "the parked block");
    assert_eq!(requested(&p), 2000);
    p.free(parked).expect("free");
    let before = p.stats();
    let err = p
        .malloc_asked(MIB, MIB + 1, Stream::DEFAULT, None)
        .expect_err("more asked for than allocated");
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    assert_eq!(
        p.stats().allocation.all.allocated,
        before.allocation.all.allocated
    );
    common::check(&p);
}
