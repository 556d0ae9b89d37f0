//! How a copy is cut and routed, on sizes and measured bandwidths only (no device calls), so
//! that the policy is tested without a GPU.
//!
//! A copy is cut into chunks; every path that takes part pulls the next chunk from one shared
//! cursor whenever it has a free staging slot, so each path carries bytes in proportion to its
//! speed in that very copy. The bandwidths measured once per engine decide which paths take
//! part at all (a path far slower than the best only lengthens the tail) and from which size on
//! the engine is worth its set-up over the driver's own call.

use std::sync::atomic::{AtomicUsize, Ordering};

pub use crate::device::HostMemory;

/// The direction of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    HostToDevice,
    DeviceToHost,
}

/// One way from the host to the target device: its own link, or a peer's link followed by a
/// peer copy (NVLink) into the target.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Path {
    /// None: the target's own link; Some(peer): relayed through device `peer`.
    pub via: Option<i32>,
    /// Measured GB/s of this path alone for pinned memory (0 when not measured).
    pub gbps: f64,
}

/// Thresholds and shares of the routing policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    /// Pageable host-to-device copies below this go straight to the driver (its own staging
    /// is quicker to start than waking the lanes).
    pub min_pageable: usize,
    /// Pageable device-to-host copies below this go straight to the driver (whose pageable
    /// device-to-host path is slow from small sizes on, so this is lower).
    pub min_pageable_d2h: usize,
    /// Pinned copies below this go straight to the driver (one link gains nothing from the
    /// engine; only relays do, and only once their set-up is paid back).
    pub min_relay: usize,
    /// A relay takes part only if its bandwidth is at least this share of the direct link's.
    pub min_share: f64,
}

impl Default for Policy {
    fn default() -> Self {
        // Measured on an H100 and an H200 (PCIe Gen5): the lanes beat the driver's pageable
        // copies from 16 MiB up host-to-device (at 8 MiB they were 0.8-1.4x of it) and from
        // 2 MiB up device-to-host (1.4-1.8x; at 1 MiB 0.89-2.0x).
        Policy {
            min_pageable: 16 << 20,
            min_pageable_d2h: 2 << 20,
            min_relay: 32 << 20,
            min_share: 0.25,
        }
    }
}

/// Where a copy goes.
#[derive(Debug, Clone, PartialEq)]
pub enum Route {
    /// One call of the driver on the caller's stream.
    Driver,
    /// The engine, over these paths (indexes into the paths given to [`route`]; the direct
    /// path, when present, comes first).
    Engine(Vec<usize>),
}

impl Policy {
    /// The smallest pageable copy in `direction` the lanes take.
    pub fn min_pageable(&self, direction: Direction) -> usize {
        match direction {
            Direction::HostToDevice => self.min_pageable,
            Direction::DeviceToHost => self.min_pageable_d2h,
        }
    }

    /// Whether a copy of `len` bytes goes to the driver whatever its host memory is, so that
    /// the engine need not even ask what kind of memory it is (small copies pay no lookup).
    pub fn surely_driver(&self, len: usize, direction: Direction) -> bool {
        len < self.min_pageable(direction).min(self.min_relay)
    }
}

/// Chooses the route of a copy of `len` bytes in `direction` whose host side is `host`, given
/// the engine's `paths` (the direct path first, then relays).
pub fn route(
    len: usize,
    direction: Direction,
    host: HostMemory,
    paths: &[Path],
    policy: &Policy,
) -> Route {
    let direct = paths.iter().position(|p| p.via.is_none());
    let best = paths.iter().map(|p| p.gbps).fold(0.0, f64::max);
    let relays: Vec<usize> = paths
        .iter()
        .enumerate()
        .filter(|(_, p)| p.via.is_some() && (best <= 0.0 || p.gbps >= policy.min_share * best))
        .map(|(i, _)| i)
        .collect();
    let use_relays = len >= policy.min_relay && !relays.is_empty();
    match host {
        HostMemory::Pinned if !use_relays => Route::Driver,
        HostMemory::Pageable if len < policy.min_pageable(direction) => Route::Driver,
        _ => {
            let mut chosen: Vec<usize> = direct.into_iter().collect();
            if use_relays {
                chosen.extend(relays);
            }
            if chosen.is_empty() {
                Route::Driver
            } else {
                Route::Engine(chosen)
            }
        }
    }
}

/// A chunk of a copy: the piece it belongs to (a batch copies several), its byte offset in
/// that piece and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub piece: usize,
    pub offset: usize,
    pub len: usize,
}

/// Hands out the chunks of one copy (of one or several pieces) to the paths that pull them,
/// each chunk once; a chunk never spans two pieces.
#[derive(Debug)]
pub struct Cursor {
    lens: Vec<usize>,
    /// Index of the first chunk of each piece, and the total number of chunks last.
    firsts: Vec<usize>,
    chunk: usize,
    next: AtomicUsize,
}

impl Cursor {
    /// Chunks of `chunk` bytes (the last may be shorter) over `len` bytes.
    pub fn new(len: usize, chunk: usize) -> Self {
        Cursor::over(vec![len], chunk)
    }

    /// Chunks of `chunk` bytes over pieces of the given lengths, piece after piece.
    pub fn over(lens: Vec<usize>, chunk: usize) -> Self {
        let chunk = chunk.max(1);
        let mut firsts = Vec::with_capacity(lens.len() + 1);
        let mut count = 0;
        for &len in &lens {
            firsts.push(count);
            count += len.div_ceil(chunk);
        }
        firsts.push(count);
        Cursor {
            lens,
            firsts,
            chunk,
            next: AtomicUsize::new(0),
        }
    }

    /// Bytes of all pieces together.
    pub fn len(&self) -> usize {
        self.lens.iter().sum()
    }

    /// Whether there is nothing to copy.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of chunks in all.
    pub fn count(&self) -> usize {
        self.firsts.last().copied().unwrap_or(0)
    }

    /// The next chunk not yet taken, or None when all are.
    pub fn take(&self) -> Option<Chunk> {
        self.chunk(self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// Chunk number `index` of the copy, or None past the last.
    pub fn chunk(&self, index: usize) -> Option<Chunk> {
        if index >= self.count() {
            return None;
        }
        // The piece whose chunks include `index`: the last one starting at or before it
        // (pieces of length 0 have no chunks and are skipped).
        let piece = self.firsts.partition_point(|&first| first <= index) - 1;
        let offset = (index - self.firsts[piece]) * self.chunk;
        Some(Chunk {
            piece,
            offset,
            len: self.chunk.min(self.lens[piece] - offset),
        })
    }
}

/// Splits chunks `0..count` into one contiguous range per path, in proportion to `weights`
/// (measured bandwidths; all equal when any is unknown), so that paths fed without the host
/// in the loop finish together. Every chunk is in exactly one range.
pub fn shares(count: usize, weights: &[f64]) -> Vec<std::ops::Range<usize>> {
    if weights.is_empty() {
        return Vec::new();
    }
    let known = weights.iter().all(|&w| w.is_finite() && w > 0.0);
    let weight = |i: usize| if known { weights[i] } else { 1.0 };
    let total: f64 = (0..weights.len()).map(weight).sum();
    let mut ranges = Vec::with_capacity(weights.len());
    let (mut start, mut before) = (0, 0.0);
    for i in 0..weights.len() {
        before += weight(i);
        let end = if i + 1 == weights.len() {
            count
        } else {
            ((count as f64 * before / total).round() as usize).clamp(start, count)
        };
        ranges.push(start..end);
        start = end;
    }
    ranges
}

/// Merges consecutive chunks of one piece that follow each other into one: a path that
/// stages nothing copies each run with one call.
pub fn runs(chunks: impl IntoIterator<Item = Chunk>) -> Vec<Chunk> {
    let mut merged: Vec<Chunk> = Vec::new();
    for chunk in chunks {
        match merged.last_mut() {
            Some(last) if last.piece == chunk.piece && last.offset + last.len == chunk.offset => {
                last.len += chunk.len;
            }
            _ => merged.push(chunk),
        }
    }
    merged
}

/// How many of `lanes` a copy of `len` bytes wakes: one per `per_lane` bytes, at least one, so
/// that a mid-sized copy does not pay for waking lanes that would each move little.
pub fn lanes_for(len: usize, lanes: usize, per_lane: usize) -> usize {
    (len / per_lane.max(1)).clamp(1, lanes.max(1))
}

/// The chunk size for a copy of `len` bytes over `lanes` parallel lanes: large enough to keep
/// per-chunk costs (a driver call, an event) small, small enough that every lane gets several
/// chunks and the last ones do not leave lanes idle; a multiple of 64 KiB, within
/// [`min`, `max`] (`max` wins, and need not be a multiple of 64 KiB).
pub fn chunk_size(len: usize, lanes: usize, min: usize, max: usize) -> usize {
    const ALIGN: usize = 64 << 10;
    let per_lane = len / (lanes.max(1) * 4);
    let size = per_lane.clamp(min.max(ALIGN), max.max(min).max(ALIGN));
    // Never above `max`: the slots a chunk is staged in hold exactly that much.
    (size.div_ceil(ALIGN) * ALIGN).min(max.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;
    const H2D: Direction = Direction::HostToDevice;

    fn paths() -> Vec<Path> {
        vec![
            Path {
                via: None,
                gbps: 55.0,
            },
            Path {
                via: Some(1),
                gbps: 50.0,
            },
            Path {
                via: Some(2),
                gbps: 5.0,
            },
        ]
    }

    #[test]
    fn shares_cover_every_chunk_once_in_proportion() {
        for count in [0, 1, 2, 7, 100, 4097] {
            for weights in [
                vec![55.0],
                vec![55.0, 50.0],
                vec![55.0, 0.0, 5.0],
                vec![1.0; 5],
            ] {
                let ranges = shares(count, &weights);
                assert_eq!(ranges.len(), weights.len());
                assert_eq!(ranges[0].start, 0);
                assert_eq!(ranges.last().map(|r| r.end), Some(count));
                for pair in ranges.windows(2) {
                    assert_eq!(pair[0].end, pair[1].start, "{count} {weights:?}");
                }
            }
        }
        assert_eq!(shares(100, &[60.0, 40.0]), vec![0..60, 60..100]);
        // An unmeasured path (0) makes the split even.
        assert_eq!(shares(10, &[55.0, 0.0]), vec![0..5, 5..10]);
    }

    #[test]
    fn runs_merge_what_follows_within_a_piece() {
        let cursor = Cursor::over(vec![5 * MIB, 0, 3 * MIB + 1], 2 * MIB);
        let all: Vec<Chunk> = (0..cursor.count())
            .filter_map(|i| cursor.chunk(i))
            .collect();
        let merged = runs(all.clone());
        assert_eq!(
            merged,
            vec![
                Chunk {
                    piece: 0,
                    offset: 0,
                    len: 5 * MIB
                },
                Chunk {
                    piece: 2,
                    offset: 0,
                    len: 3 * MIB + 1
                },
            ]
        );
        // A share that starts inside a piece keeps its offset.
        assert_eq!(runs(all[1..2].to_vec()), all[1..2].to_vec());
        assert!(runs(Vec::new()).is_empty());
    }

    #[test]
    fn chunk_by_index_matches_the_order_take_hands_out() {
        let cursor = Cursor::over(vec![5 * MIB, 0, 3 * MIB + 1], 2 * MIB);
        let by_index: Vec<Chunk> = (0..cursor.count())
            .filter_map(|i| cursor.chunk(i))
            .collect();
        let taken: Vec<Chunk> = std::iter::from_fn(|| cursor.take()).collect();
        assert_eq!(by_index, taken);
        assert_eq!(cursor.chunk(cursor.count()), None);
    }

    #[test]
    fn small_and_single_link_pinned_copies_go_to_the_driver() {
        let policy = Policy::default();
        let direct_only = &paths()[..1];
        assert_eq!(
            route(4096, H2D, HostMemory::Pageable, &paths(), &policy),
            Route::Driver
        );
        assert_eq!(
            route(1 << 30, H2D, HostMemory::Pinned, direct_only, &policy),
            Route::Driver
        );
        assert_eq!(
            route(MIB, H2D, HostMemory::Pinned, &paths(), &policy),
            Route::Driver
        );
        assert_eq!(
            route(64 * MIB, H2D, HostMemory::Pageable, direct_only, &policy),
            Route::Engine(vec![0])
        );
        // Device-to-host pageable copies take the lanes from a lower size on.
        let d2h = Direction::DeviceToHost;
        assert_eq!(
            route(4 * MIB, d2h, HostMemory::Pageable, direct_only, &policy),
            Route::Engine(vec![0])
        );
        assert_eq!(
            route(2 * MIB, H2D, HostMemory::Pageable, direct_only, &policy),
            Route::Driver
        );
        assert!(policy.surely_driver(2 * MIB - 1, d2h) && !policy.surely_driver(2 * MIB, d2h));
    }

    #[test]
    fn slow_relays_stay_out() {
        let policy = Policy::default();
        assert_eq!(
            route(1 << 30, H2D, HostMemory::Pinned, &paths(), &policy),
            Route::Engine(vec![0, 1])
        );
        assert_eq!(
            route(1 << 30, H2D, HostMemory::Pageable, &paths(), &policy),
            Route::Engine(vec![0, 1])
        );
        // Below the relay threshold a pageable copy uses its own link only.
        assert_eq!(
            route(24 * MIB, H2D, HostMemory::Pageable, &paths(), &policy),
            Route::Engine(vec![0])
        );
    }

    #[test]
    fn unmeasured_paths_all_take_part() {
        let unmeasured: Vec<Path> = paths()
            .into_iter()
            .map(|p| Path { gbps: 0.0, ..p })
            .collect();
        assert_eq!(
            route(
                1 << 30,
                H2D,
                HostMemory::Pinned,
                &unmeasured,
                &Policy::default()
            ),
            Route::Engine(vec![0, 1, 2])
        );
    }

    #[test]
    fn the_cursor_hands_out_every_byte_once() {
        for (len, chunk) in [(0, 4), (1, 4), (4, 4), (5, 4), (10 * MIB + 3, MIB)] {
            let cursor = Cursor::new(len, chunk);
            let mut covered = 0;
            let mut taken = 0;
            while let Some(c) = cursor.take() {
                assert_eq!(c.offset, covered);
                assert!(c.len > 0 && c.len <= chunk);
                covered += c.len;
                taken += 1;
            }
            assert_eq!(covered, len);
            assert_eq!(taken, cursor.count());
            assert_eq!(cursor.take(), None, "stays exhausted");
        }
    }

    #[test]
    fn the_cursor_walks_pieces_without_spanning_them() {
        let lens = vec![5, 0, 8, 1, 0];
        let cursor = Cursor::over(lens.clone(), 4);
        let mut seen = vec![0; lens.len()];
        while let Some(c) = cursor.take() {
            assert_eq!(c.offset, seen[c.piece], "in order within a piece");
            assert!(c.offset + c.len <= lens[c.piece]);
            seen[c.piece] += c.len;
        }
        assert_eq!(seen, lens);
        assert_eq!(cursor.count(), 2 + 2 + 1);
        assert_eq!(Cursor::over(Vec::new(), 4).take(), None);
    }

    #[test]
    fn the_cursor_is_shared_between_threads() {
        let cursor = Cursor::new(1000 * 4096 + 7, 4096);
        let total: usize = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        let mut sum = 0;
                        while let Some(c) = cursor.take() {
                            sum += c.len;
                        }
                        sum
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0)).sum()
        });
        assert_eq!(total, 1000 * 4096 + 7);
    }

    #[test]
    fn lanes_grow_with_the_copy() {
        assert_eq!(lanes_for(100, 16, MIB), 1);
        assert_eq!(lanes_for(4 * MIB, 16, MIB), 4);
        assert_eq!(lanes_for(1 << 30, 16, MIB), 16);
    }

    #[test]
    fn chunk_sizes_stay_in_bounds_and_aligned() {
        assert_eq!(chunk_size(1 << 30, 8, 2 * MIB, 16 * MIB), 16 * MIB);
        assert_eq!(chunk_size(4 * MIB, 8, 2 * MIB, 16 * MIB), 2 * MIB);
        // Slots of a size that is no multiple of the alignment are never overrun.
        assert_eq!(chunk_size(1 << 30, 8, 4096, 100 << 10), 100 << 10);
        assert_eq!(chunk_size(1 << 30, 8, 4096, 4096), 4096);
        let mid = chunk_size(200 * MIB, 8, MIB, 16 * MIB);
        assert!((MIB..=16 * MIB).contains(&mid) && mid % (64 << 10) == 0);
    }
}
