//! Statistics with the key set of PyTorch's `torch.cuda.memory_stats()`, plus stitch counters.
//!
//! Byte figures count what the allocator hands out (sizes rounded to the pool's unit), as
//! PyTorch does; `requested_bytes` counts what callers asked for.

use crate::pool::blocks::PoolKind;

/// One statistic: current value, peak since the last reset, and running totals of increases and
/// decreases since the last accumulated reset.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub current: i64,
    pub peak: i64,
    pub allocated: i64,
    pub freed: i64,
}

impl Stat {
    pub fn add(&mut self, amount: i64) {
        if amount >= 0 {
            self.allocated += amount;
        } else {
            self.freed -= amount;
        }
        self.current += amount;
        self.peak = self.peak.max(self.current);
    }

    /// `add(amount)` for an amount known not to be negative, without the sign test: the
    /// allocator's hot path books counts and sizes with it.
    #[inline]
    pub fn increase(&mut self, amount: u64) {
        let amount = amount as i64;
        self.allocated += amount;
        self.current += amount;
        self.peak = self.peak.max(self.current);
    }

    /// `add(-amount)`, as [`Stat::increase`]. The peak stays: it is never below the current
    /// value.
    #[inline]
    pub fn decrease(&mut self, amount: u64) {
        let amount = amount as i64;
        self.freed += amount;
        self.current -= amount;
    }

    fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }
}

/// A statistic split as PyTorch splits it: all, small pool, large pool.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StatArray {
    pub all: Stat,
    pub small_pool: Stat,
    pub large_pool: Stat,
}

impl StatArray {
    pub fn add(&mut self, pool: PoolKind, amount: i64) {
        if amount == 0 {
            return;
        }
        self.all.add(amount);
        match pool {
            PoolKind::Small => self.small_pool.add(amount),
            PoolKind::Large => self.large_pool.add(amount),
        }
    }

    /// `add(pool, amount)` for an amount known not to be negative (see [`Stat::increase`]).
    #[inline]
    pub fn increase(&mut self, pool: PoolKind, amount: u64) {
        self.all.increase(amount);
        match pool {
            PoolKind::Small => self.small_pool.increase(amount),
            PoolKind::Large => self.large_pool.increase(amount),
        }
    }

    /// `add(pool, -amount)` (see [`Stat::decrease`]).
    #[inline]
    pub fn decrease(&mut self, pool: PoolKind, amount: u64) {
        self.all.decrease(amount);
        match pool {
            PoolKind::Small => self.small_pool.decrease(amount),
            PoolKind::Large => self.large_pool.decrease(amount),
        }
    }

    fn each(&mut self, f: impl Fn(&mut Stat)) {
        f(&mut self.all);
        f(&mut self.small_pool);
        f(&mut self.large_pool);
    }

    /// The three parts with PyTorch's names.
    pub fn parts(&self) -> [(&'static str, &Stat); 3] {
        [
            ("all", &self.all),
            ("small_pool", &self.small_pool),
            ("large_pool", &self.large_pool),
        ]
    }
}

/// Everything `memory_stats()` reports, plus the stitch counters.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MemoryStats {
    /// Live allocations (count).
    pub allocation: StatArray,
    /// Physical segments (count).
    pub segment: StatArray,
    /// Allocated or waiting for other streams (count).
    pub active: StatArray,
    /// Free blocks inside split segments (count).
    pub inactive_split: StatArray,
    pub allocated_bytes: StatArray,
    pub reserved_bytes: StatArray,
    pub active_bytes: StatArray,
    pub inactive_split_bytes: StatArray,
    pub requested_bytes: StatArray,
    /// Times an allocation had to free cached memory and try again.
    pub num_alloc_retries: i64,
    /// Allocations that failed for lack of memory.
    pub num_ooms: i64,
    /// Times the allocator waited for all streams.
    pub num_sync_all_streams: i64,
    /// Physical memory creations and releases.
    pub num_device_alloc: i64,
    pub num_device_free: i64,
    /// Allocations served by a stitched block (new or reused).
    pub stitched_allocations: i64,
    /// Stitched blocks built (each maps pieces into a new range).
    pub stitches: i64,
    /// Bytes of all stitched blocks built.
    pub stitched_bytes: i64,
    /// Pieces mapped by all stitches.
    pub stitched_pieces: i64,
    /// Allocations served by reusing a cached stitched block.
    pub stitch_reuse_hits: i64,
    /// Stitched blocks unmapped by collection or `empty_cache`.
    pub stitch_collections: i64,
    /// Stitched blocks mapped now (in use or cached), and their bytes.
    pub stitched_blocks: Stat,
    pub stitched_mapped_bytes: Stat,
    /// Bytes of swappable allocations swapped out to host memory now.
    pub swapped_bytes: Stat,
    /// Bytes mapped from memory other processes made (read-only memory deduplicated): memory
    /// this process would hold otherwise. Counted in `reserved_bytes`, not against the cap.
    pub shared_bytes: i64,
    /// Bytes of this process's memory offered read-only to other processes.
    pub offered_bytes: i64,
    /// The whole device, all processes of this user sharing on it (from the dedup index, at
    /// most a second old; 0 until this pool shares): bytes of memory mapped by two or more
    /// processes, each counted once.
    pub device_shared_bytes: i64,
    /// The same: bytes the device would hold more without sharing (each shared range times
    /// the number of processes mapping it, less one).
    pub device_saved_bytes: i64,
    /// Idle segments of small handles a stitch released to make their bytes again in large
    /// handles, and the handles they had.
    pub gathered_segments: i64,
    pub gathered_handles: i64,
}

impl MemoryStats {
    /// Sets every peak to its current value.
    pub fn reset_peak(&mut self) {
        for array in self.arrays_mut() {
            array.each(Stat::reset_peak);
        }
        self.stitched_blocks.reset_peak();
        self.stitched_mapped_bytes.reset_peak();
        self.swapped_bytes.reset_peak();
    }

    /// Zeroes the running totals and the event counters.
    pub fn reset_accumulated(&mut self) {
        for array in self.arrays_mut() {
            array.each(Stat::reset_accumulated);
        }
        self.stitched_blocks.reset_accumulated();
        self.stitched_mapped_bytes.reset_accumulated();
        self.swapped_bytes.reset_accumulated();
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
        self.stitched_allocations = 0;
        self.stitches = 0;
        self.stitched_bytes = 0;
        self.stitched_pieces = 0;
        self.stitch_reuse_hits = 0;
        self.stitch_collections = 0;
        self.gathered_segments = 0;
        self.gathered_handles = 0;
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    fn arrays(&self) -> [(&'static str, &StatArray); 9] {
        [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ]
    }

    /// The flat key/value list of `torch.cuda.memory_stats()` ("allocated_bytes.all.current",
    /// ..., "num_ooms"), followed by the stitch counters under "glake.".
    pub fn flat(&self) -> Vec<(String, i64)> {
        let mut out = Vec::with_capacity(128);
        for (name, array) in self.arrays() {
            for (part, stat) in array.parts() {
                out.push((format!("{name}.{part}.current"), stat.current));
                out.push((format!("{name}.{part}.peak"), stat.peak));
                out.push((format!("{name}.{part}.allocated"), stat.allocated));
                out.push((format!("{name}.{part}.freed"), stat.freed));
            }
        }
        let counters = [
            ("num_alloc_retries", self.num_alloc_retries),
            ("num_ooms", self.num_ooms),
            ("num_sync_all_streams", self.num_sync_all_streams),
            ("num_device_alloc", self.num_device_alloc),
            ("num_device_free", self.num_device_free),
            ("max_split_size", -1),
            ("oversize_allocations.current", 0),
            ("oversize_allocations.peak", 0),
            ("oversize_allocations.allocated", 0),
            ("oversize_allocations.freed", 0),
            ("oversize_segments.current", 0),
            ("oversize_segments.peak", 0),
            ("oversize_segments.allocated", 0),
            ("oversize_segments.freed", 0),
            ("glake.stitched_allocations", self.stitched_allocations),
            ("glake.stitches", self.stitches),
            ("glake.stitched_bytes", self.stitched_bytes),
            ("glake.stitched_pieces", self.stitched_pieces),
            ("glake.stitch_reuse_hits", self.stitch_reuse_hits),
            ("glake.stitch_collections", self.stitch_collections),
            (
                "glake.stitched_blocks.current",
                self.stitched_blocks.current,
            ),
            ("glake.stitched_blocks.peak", self.stitched_blocks.peak),
            (
                "glake.stitched_mapped_bytes.current",
                self.stitched_mapped_bytes.current,
            ),
            (
                "glake.stitched_mapped_bytes.peak",
                self.stitched_mapped_bytes.peak,
            ),
            ("glake.swapped_bytes.current", self.swapped_bytes.current),
            ("glake.swapped_bytes.peak", self.swapped_bytes.peak),
            ("glake.shared_bytes", self.shared_bytes),
            ("glake.offered_bytes", self.offered_bytes),
            ("glake.device_shared_bytes", self.device_shared_bytes),
            ("glake.device_saved_bytes", self.device_saved_bytes),
            ("glake.gathered_segments", self.gathered_segments),
            ("glake.gathered_handles", self.gathered_handles),
        ];
        out.extend(counters.iter().map(|(k, v)| (k.to_string(), *v)));
        out
    }

    /// The flat list as one JSON object.
    pub fn to_json(&self) -> String {
        let body: Vec<String> = self
            .flat()
            .iter()
            .map(|(k, v)| format!("\"{k}\":{v}"))
            .collect();
        format!("{{{}}}", body.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_peak_and_totals() {
        let mut s = Stat::default();
        s.add(10);
        s.add(-4);
        s.add(2);
        assert_eq!(
            s,
            Stat {
                current: 8,
                peak: 10,
                allocated: 12,
                freed: 4
            }
        );
        s.reset_peak();
        assert_eq!(s.peak, 8);
    }

    #[test]
    fn flat_keys_match_pytorch_names() {
        let mut m = MemoryStats::default();
        m.allocated_bytes.add(PoolKind::Large, 4096);
        let flat = m.flat();
        let get = |k: &str| flat.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
        assert_eq!(get("allocated_bytes.all.current"), Some(4096));
        assert_eq!(get("allocated_bytes.large_pool.peak"), Some(4096));
        assert_eq!(get("allocated_bytes.small_pool.current"), Some(0));
        assert_eq!(get("num_ooms"), Some(0));
        assert!(m.to_json().contains("\"reserved_bytes.all.peak\":0"));
    }
}
