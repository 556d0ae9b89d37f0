//! Free blocks of the small pool by exact size: one bin per 512-byte size up to
//! [`EXACT_UNITS`] units, and bitmaps that find the first non-empty bin at or above a size in
//! a few word operations. Best fit is then constant time, where an ordered set pays a tree
//! walk for every search, insertion and removal: the small pool handles most of a workload's
//! allocations, so these operations are its hot path. Equal-sized blocks are reused last in,
//! first out. Sizes above the exact bins (only when small segments are larger than 2 MiB) go
//! to an ordered set. No driver is called here.

use std::collections::BTreeSet;

use crate::device::DevicePtr;

/// Bytes per bin step: the allocator's rounding unit.
const UNIT: usize = super::sizes::MIN_BLOCK;
/// Bins of exact sizes, `UNIT` to `EXACT_UNITS * UNIT` bytes (2 MiB, a default small segment).
const EXACT_UNITS: usize = 4096;
const WORDS: usize = EXACT_UNITS / 64;
static_assertions::const_assert!(WORDS <= 64);

/// Where a block sits in the bins: its bin's list position, for removal in constant time.
pub type Slot = u32;

/// A free block as the bins hold it: (size, address, id).
type Entry = (usize, DevicePtr, usize);

#[derive(Debug)]
pub struct SizeBins {
    /// `bins[units - 1]`: ids of free blocks of exactly `units * UNIT` bytes.
    bins: Vec<Vec<(usize, DevicePtr)>>,
    /// Bit `u % 64` of word `u / 64`: bin `u` is not empty.
    words: [u64; WORDS],
    /// Bit `w`: word `w` is not zero.
    summary: u64,
    /// Free blocks larger than the exact bins, or of a size off the unit.
    other: BTreeSet<Entry>,
    len: usize,
}

impl Default for SizeBins {
    fn default() -> Self {
        SizeBins {
            bins: Vec::new(),
            words: [0; WORDS],
            summary: 0,
            other: BTreeSet::new(),
            len: 0,
        }
    }
}

/// The bin of a block of `size` bytes, if it has one.
fn bin_of(size: usize) -> Option<usize> {
    (size % UNIT == 0 && size > 0 && size <= EXACT_UNITS * UNIT).then(|| size / UNIT - 1)
}

impl SizeBins {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Adds free block `id` of `size` bytes at `addr`; returns its slot.
    pub fn insert(&mut self, size: usize, addr: DevicePtr, id: usize) -> Slot {
        self.len += 1;
        let Some(bin) = bin_of(size) else {
            self.other.insert((size, addr, id));
            return 0;
        };
        if self.bins.is_empty() {
            self.bins.resize_with(EXACT_UNITS, Vec::new);
        }
        let list = &mut self.bins[bin];
        list.push((id, addr));
        if list.len() == 1 {
            self.words[bin / 64] |= 1 << (bin % 64);
            self.summary |= 1 << (bin / 64);
        }
        (list.len() - 1) as Slot
    }

    /// Removes free block `id` of `size` bytes at `addr`, which sits at `slot`. Returns the
    /// block moved into that slot (its new slot is `slot`), if any.
    pub fn remove(&mut self, size: usize, addr: DevicePtr, id: usize, slot: Slot) -> Option<usize> {
        let Some(bin) = bin_of(size) else {
            if self.other.remove(&(size, addr, id)) {
                self.len -= 1;
            }
            return None;
        };
        let list = self.bins.get_mut(bin)?;
        let at = slot as usize;
        if list.get(at).map(|&(i, _)| i) != Some(id) {
            debug_assert!(false, "block {id} is not at slot {slot} of its bin");
            return None;
        }
        self.len -= 1;
        list.swap_remove(at);
        if list.is_empty() {
            self.words[bin / 64] &= !(1 << (bin % 64));
            if self.words[bin / 64] == 0 {
                self.summary &= !(1 << (bin / 64));
            }
        }
        list.get(at).map(|&(moved, _)| moved)
    }

    /// The smallest free block of at least `size` bytes, as (size, id): the newest of its
    /// size.
    pub fn best_fit(&self, size: usize) -> Option<(usize, usize)> {
        let binned = (size <= EXACT_UNITS * UNIT)
            .then(|| self.first_bin_from(size.div_ceil(UNIT).max(1) - 1))
            .flatten()
            .and_then(|bin| Some(((bin + 1) * UNIT, self.bins[bin].last()?.0)));
        if self.other.is_empty() {
            return binned;
        }
        let other = self.other.range((size, 0, 0)..).next();
        match (binned, other) {
            (Some(b), Some(&(s, _, id))) if s < b.0 => Some((s, id)),
            (Some(b), _) => Some(b),
            (None, o) => o.map(|&(s, _, id)| (s, id)),
        }
    }

    /// The first non-empty bin at or after `bin`.
    fn first_bin_from(&self, bin: usize) -> Option<usize> {
        let word = bin / 64;
        if word >= WORDS {
            return None;
        }
        let here = self.words[word] & (!0u64 << (bin % 64));
        if here != 0 {
            return Some(word * 64 + here.trailing_zeros() as usize);
        }
        let later = self.summary & (!0u64).checked_shl(word as u32 + 1).unwrap_or(0);
        if later == 0 {
            return None;
        }
        let word = later.trailing_zeros() as usize;
        Some(word * 64 + self.words[word].trailing_zeros() as usize)
    }

    /// Every free block, as (size, address, id), in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = Entry> + '_ {
        let binned = self.bins.iter().enumerate().flat_map(|(bin, list)| {
            list.iter()
                .map(move |&(id, addr)| ((bin + 1) * UNIT, addr, id))
        });
        binned.chain(self.other.iter().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference: smallest size at least `size`, any id of that size.
    fn reference(blocks: &[(usize, usize)], size: usize) -> Option<usize> {
        blocks.iter().map(|&(s, _)| s).filter(|&s| s >= size).min()
    }

    #[test]
    fn best_fit_finds_the_smallest_size_at_least_the_request() {
        let mut bins = SizeBins::default();
        let mut slots = std::collections::HashMap::new();
        let sizes = [512, 1024, 64 * 512, 65 * 512, 4096 * 512, 5000 * 512, 777];
        let mut live: Vec<(usize, usize)> = Vec::new();
        for (id, &size) in sizes.iter().enumerate() {
            slots.insert(id, bins.insert(size, id as u64 * 4096, id));
            live.push((size, id));
        }
        for request in [
            1,
            512,
            513,
            1024,
            1025,
            64 * 512,
            64 * 512 + 1,
            4096 * 512,
            4097 * 512,
            6000 * 512,
        ] {
            let got = bins.best_fit(request).map(|(s, _)| s);
            assert_eq!(got, reference(&live, request), "request {request}");
        }
        assert_eq!(bins.len(), sizes.len());
        assert_eq!(bins.iter().count(), sizes.len());
    }

    #[test]
    fn removal_keeps_slots_and_bitmaps_in_step() {
        let mut bins = SizeBins::default();
        let mut slot = std::collections::HashMap::new();
        // Many blocks over a few bins, removed in a scrambled order.
        let mut live: Vec<(usize, usize)> = Vec::new();
        for id in 0..600usize {
            let size = (1 + (id * 7919) % 130) * UNIT;
            slot.insert(id, bins.insert(size, id as u64, id));
            live.push((size, id));
        }
        let mut order: Vec<usize> = (0..600).collect();
        order.sort_by_key(|&i| (i * 104729) % 600);
        for (n, &id) in order.iter().enumerate() {
            let size = live
                .iter()
                .find(|&&(_, i)| i == id)
                .map(|&(s, _)| s)
                .unwrap();
            if let Some(moved) = bins.remove(size, id as u64, id, slot[&id]) {
                slot.insert(moved, slot[&id]);
            }
            live.retain(|&(_, i)| i != id);
            assert_eq!(bins.len(), live.len());
            if n % 37 == 0 {
                for request in [1, 3000, 20 * UNIT, 64 * UNIT + 1, 129 * UNIT] {
                    let got = bins.best_fit(request).map(|(s, _)| s);
                    assert_eq!(got, reference(&live, request), "request {request}");
                    if let Some((s, id)) = bins.best_fit(request) {
                        assert!(live.contains(&(s, id)));
                    }
                }
            }
        }
        assert!(bins.is_empty());
        assert_eq!(bins.summary, 0);
        assert!(bins.words.iter().all(|&w| w == 0));
    }

    #[test]
    fn equal_sizes_are_reused_last_in_first_out() {
        let mut bins = SizeBins::default();
        bins.insert(2048, 0, 1);
        bins.insert(2048, 4096, 2);
        assert_eq!(bins.best_fit(2000), Some((2048, 2)));
    }
}
