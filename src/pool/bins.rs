//! Free-block indexes with constant-time search, insertion and removal, for the allocator's
//! hot path (an ordered set pays a tree walk for each of them).
//!
//! - [`SizeBins`] (small pool): one bin per 512-byte size up to 2 MiB; best fit takes the
//!   newest block of the smallest size that fits (last in, first out).
//! - [`SizeClasses`] (large pool): log-linear size classes (16 per power of two); best fit is
//!   exact, the smallest (size, address) that fits, as an ordered set would give, found by
//!   scanning one or two short class lists. Stitching walks it from its large end.
//!
//! Both find the first non-empty bin or class at or after a size with [`NonEmpty`], a
//! two-level bitmap. Each block's position in its list is its [`Slot`], kept by the caller,
//! so that removal is a swap with the list's last entry. No driver is called here.

use std::collections::BTreeSet;

use crate::device::DevicePtr;

/// Bytes per size step: the allocator's rounding unit.
const UNIT: usize = super::sizes::MIN_BLOCK;
/// Where a block sits in its bin or class list, for removal in constant time.
pub type Slot = u32;
/// A free block: (size, address, id).
pub type Entry = (usize, DevicePtr, usize);

/// Which of up to 4096 lists are not empty.
#[derive(Debug, Clone)]
pub(super) struct NonEmpty {
    /// Bit `i % 64` of word `i / 64`: list `i` is not empty.
    words: [u64; 64],
    /// Bit `w`: word `w` is not zero.
    summary: u64,
}

impl Default for NonEmpty {
    fn default() -> Self {
        NonEmpty {
            words: [0; 64],
            summary: 0,
        }
    }
}

impl NonEmpty {
    pub(super) const CAPACITY: usize = 64 * 64;

    pub(super) fn set(&mut self, i: usize) {
        self.words[i / 64] |= 1 << (i % 64);
        self.summary |= 1 << (i / 64);
    }

    pub(super) fn clear(&mut self, i: usize) {
        self.words[i / 64] &= !(1 << (i % 64));
        if self.words[i / 64] == 0 {
            self.summary &= !(1 << (i / 64));
        }
    }

    /// The first set bit at or after `i`.
    pub(super) fn first_from(&self, i: usize) -> Option<usize> {
        let word = i / 64;
        if word >= 64 {
            return None;
        }
        let here = self.words[word] & (!0u64 << (i % 64));
        if here != 0 {
            return Some(word * 64 + here.trailing_zeros() as usize);
        }
        let later = self.summary & (!0u64).checked_shl(word as u32 + 1).unwrap_or(0);
        let word = (later != 0).then(|| later.trailing_zeros() as usize)?;
        Some(word * 64 + self.words[word].trailing_zeros() as usize)
    }

    /// The last set bit at or before `i`.
    fn last_to(&self, i: usize) -> Option<usize> {
        let word = (i / 64).min(63);
        let keep = if i / 64 > 63 { 63 } else { i % 64 };
        let here = self.words[word] & (!0u64 >> (63 - keep));
        if here != 0 {
            return Some(word * 64 + 63 - here.leading_zeros() as usize);
        }
        let earlier = self.summary & ((1u64 << word) - 1);
        let word = (earlier != 0).then(|| 63 - earlier.leading_zeros() as usize)?;
        Some(word * 64 + 63 - self.words[word].leading_zeros() as usize)
    }
}

/// Lists of free blocks indexed by a size class, with their non-empty bitmap.
#[derive(Debug, Default)]
struct Lists {
    lists: Vec<Vec<Entry>>,
    non_empty: NonEmpty,
    len: usize,
}

impl Lists {
    fn insert(&mut self, class: usize, entry: Entry) -> Slot {
        if self.lists.len() <= class {
            self.lists.resize_with(class + 1, Vec::new);
        }
        let list = &mut self.lists[class];
        list.push(entry);
        if list.len() == 1 {
            self.non_empty.set(class);
        }
        self.len += 1;
        (list.len() - 1) as Slot
    }

    /// Removes `entry` from `class` at `slot`; returns the id moved into that slot, if any.
    fn remove(&mut self, class: usize, entry: Entry, slot: Slot) -> Option<usize> {
        let list = self.lists.get_mut(class)?;
        let at = slot as usize;
        if list.get(at) != Some(&entry) {
            debug_assert!(false, "{entry:?} is not at slot {slot} of class {class}");
            return None;
        }
        list.swap_remove(at);
        self.len -= 1;
        if list.is_empty() {
            self.non_empty.clear(class);
        }
        list.get(at).map(|&(_, _, moved)| moved)
    }

    fn iter(&self) -> impl Iterator<Item = Entry> + '_ {
        self.lists.iter().flatten().copied()
    }
}

/// The small pool's free blocks by exact size (see the module documentation).
#[derive(Debug, Default)]
pub struct SizeBins {
    bins: Lists,
    /// Blocks larger than the bins (small segments larger than 2 MiB), or off the unit.
    other: BTreeSet<Entry>,
}

/// The bin of a block of `size` bytes, if it has one.
fn bin_of(size: usize) -> Option<usize> {
    (size % UNIT == 0 && size > 0 && size <= NonEmpty::CAPACITY * UNIT).then(|| size / UNIT - 1)
}

impl SizeBins {
    pub fn len(&self) -> usize {
        self.bins.len + self.other.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Adds free block `(size, addr, id)`; returns its slot.
    pub fn insert(&mut self, entry: Entry) -> Slot {
        match bin_of(entry.0) {
            Some(bin) => self.bins.insert(bin, entry),
            None => {
                self.other.insert(entry);
                0
            }
        }
    }

    /// Removes free block `entry`, which sits at `slot`; returns the id moved into that slot.
    pub fn remove(&mut self, entry: Entry, slot: Slot) -> Option<usize> {
        match bin_of(entry.0) {
            Some(bin) => self.bins.remove(bin, entry, slot),
            None => {
                self.other.remove(&entry);
                None
            }
        }
    }

    /// The smallest free block of at least `size` bytes: the newest of its size.
    pub fn best_fit(&self, size: usize) -> Option<Entry> {
        let binned = (size <= NonEmpty::CAPACITY * UNIT)
            .then(|| {
                self.bins
                    .non_empty
                    .first_from(size.div_ceil(UNIT).max(1) - 1)
            })
            .flatten()
            .and_then(|bin| self.bins.lists[bin].last().copied());
        let other = self.other.range((size, 0, 0)..).next().copied();
        match (binned, other) {
            (Some(b), Some(o)) => Some(if o.0 < b.0 { o } else { b }),
            (b, o) => b.or(o),
        }
    }

    /// Every free block, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = Entry> + '_ {
        self.bins.iter().chain(self.other.iter().copied())
    }
}

/// Classes per power of two of [`SizeClasses`] (as a shift): sizes in one class differ by at
/// most 1/16, so a class list holds few blocks that do not fit.
const SUB_BITS: u32 = 4;

/// The class of a block of `size` bytes: exact below `16 * UNIT`, then 16 per power of two.
pub(super) fn class_of(size: usize) -> usize {
    let units = (size / UNIT).max(1);
    let top = usize::BITS - 1 - units.leading_zeros();
    if top < SUB_BITS {
        return units;
    }
    let sub = (units >> (top - SUB_BITS)) - (1 << SUB_BITS);
    (((top - SUB_BITS + 1) as usize) << SUB_BITS) + sub
}

/// The large pool's free blocks by size class (see the module documentation).
#[derive(Debug, Default)]
pub struct SizeClasses {
    classes: Lists,
}

impl SizeClasses {
    pub fn len(&self) -> usize {
        self.classes.len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Adds free block `(size, addr, id)`; returns its slot.
    pub fn insert(&mut self, entry: Entry) -> Slot {
        self.classes.insert(class_of(entry.0), entry)
    }

    /// Removes free block `entry`, which sits at `slot`; returns the id moved into that slot.
    pub fn remove(&mut self, entry: Entry, slot: Slot) -> Option<usize> {
        self.classes.remove(class_of(entry.0), entry, slot)
    }

    /// The smallest (size, address) free block of at least `size` bytes. Blocks of a class
    /// are all smaller than those of any later class, so the request's own class, then the
    /// first non-empty class after it, hold the answer.
    pub fn best_fit(&self, size: usize) -> Option<Entry> {
        let own = class_of(size);
        let smallest = |class: usize| {
            self.classes.lists[class]
                .iter()
                .filter(|e| e.0 >= size)
                .min()
                .copied()
        };
        if let Some(found) = self
            .classes
            .non_empty
            .first_from(own)
            .filter(|&c| c == own)
            .and_then(smallest)
        {
            return Some(found);
        }
        self.classes
            .non_empty
            .first_from(own + 1)
            .and_then(smallest)
    }

    /// Free blocks of at least `min_size` bytes, largest first (equal sizes in no particular
    /// order), one class sorted at a time.
    pub fn largest_first(&self, min_size: usize) -> impl Iterator<Item = Entry> + '_ {
        let lowest = class_of(min_size);
        let mut next = self.classes.non_empty.last_to(NonEmpty::CAPACITY - 1);
        std::iter::from_fn(move || {
            let class = next.filter(|&c| c >= lowest)?;
            next = class
                .checked_sub(1)
                .and_then(|c| self.classes.non_empty.last_to(c));
            let mut entries: Vec<Entry> = self.classes.lists[class]
                .iter()
                .filter(|e| e.0 >= min_size)
                .copied()
                .collect();
            entries.sort_unstable_by(|a, b| b.cmp(a));
            Some(entries)
        })
        .flatten()
    }

    /// Every free block, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = Entry> + '_ {
        self.classes.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A deterministic mix of sizes: exact small ones, odd ones, and large ones up to GiBs.
    fn size_of(i: usize) -> usize {
        match i % 4 {
            0 => (1 + (i * 7919) % 130) * UNIT,
            1 => (1 + (i * 104729) % 4096) * UNIT,
            2 => ((i * 15485863) % (1 << 22) + 1) * UNIT,
            _ => 1000 + i,
        }
    }

    /// Inserts 800 blocks, removes them in a scrambled order, and checks best fit (and the
    /// large-first walk) against a sorted reference along the way.
    fn exercise(
        insert: &mut dyn FnMut(Entry) -> Slot,
        remove: &mut dyn FnMut(Entry, Slot) -> Option<usize>,
        check: &mut dyn FnMut(&BTreeSet<Entry>),
    ) {
        let mut slots = HashMap::new();
        let mut live = BTreeSet::new();
        let entries: Vec<Entry> = (0..800).map(|i| (size_of(i), i as u64 * 8192, i)).collect();
        for &e in &entries {
            slots.insert(e.2, insert(e));
            live.insert(e);
        }
        check(&live);
        let mut order: Vec<usize> = (0..800).collect();
        order.sort_by_key(|&i| (i * 104729) % 800);
        for (n, &i) in order.iter().enumerate() {
            let e = entries[i];
            if let Some(moved) = remove(e, slots[&i]) {
                slots.insert(moved, slots[&i]);
            }
            live.remove(&e);
            if n % 41 == 0 {
                check(&live);
            }
        }
        check(&live);
    }

    const REQUESTS: [usize; 10] = [
        1,
        513,
        3000,
        20 * UNIT,
        64 * UNIT + 1,
        4096 * UNIT,
        4097 * UNIT,
        (1 << 20) * UNIT,
        (1 << 22) * UNIT,
        usize::MAX / 2,
    ];

    #[test]
    fn bins_find_the_smallest_size_that_fits() {
        let bins = std::cell::RefCell::new(SizeBins::default());
        exercise(
            &mut |e| bins.borrow_mut().insert(e),
            &mut |e, s| bins.borrow_mut().remove(e, s),
            &mut |live| {
                let bins = bins.borrow();
                assert_eq!(bins.len(), live.len());
                assert_eq!(bins.iter().count(), live.len());
                for request in REQUESTS {
                    let want = live.range((request, 0, 0)..).next().map(|e| e.0);
                    let got = bins.best_fit(request);
                    assert_eq!(got.map(|e| e.0), want, "request {request}");
                    assert!(got.is_none_or(|e| live.contains(&e)));
                }
            },
        );
        assert!(bins.borrow().is_empty());
    }

    #[test]
    fn classes_find_what_an_ordered_set_finds() {
        let classes = std::cell::RefCell::new(SizeClasses::default());
        exercise(
            &mut |e| classes.borrow_mut().insert(e),
            &mut |e, s| classes.borrow_mut().remove(e, s),
            &mut |live| {
                let classes = classes.borrow();
                assert_eq!(classes.len(), live.len());
                for request in REQUESTS {
                    let want = live.range((request, 0, 0)..).next().copied();
                    assert_eq!(classes.best_fit(request), want, "request {request}");
                    let walk: Vec<usize> = classes.largest_first(request).map(|e| e.0).collect();
                    let sorted: Vec<usize> =
                        live.range((request, 0, 0)..).rev().map(|e| e.0).collect();
                    assert_eq!(walk, sorted, "largest first from {request}");
                }
            },
        );
        assert!(classes.borrow().is_empty());
    }

    #[test]
    fn classes_grow_with_size_and_stay_in_the_bitmap() {
        let mut last = 0;
        for units in 1..100_000usize {
            let class = class_of(units * UNIT);
            assert!(class >= last, "class of {units} units");
            last = class;
        }
        assert!(class_of(usize::MAX) < NonEmpty::CAPACITY);
    }

    #[test]
    fn equal_sizes_are_reused_last_in_first_out() {
        let mut bins = SizeBins::default();
        bins.insert((2048, 0, 1));
        bins.insert((2048, 4096, 2));
        assert_eq!(bins.best_fit(2000), Some((2048, 4096, 2)));
    }

    #[test]
    fn bitmap_searches_both_ways() {
        let mut bits = NonEmpty::default();
        for i in [0, 63, 64, 700, 4095] {
            bits.set(i);
        }
        assert_eq!(bits.first_from(1), Some(63));
        assert_eq!(bits.first_from(65), Some(700));
        assert_eq!(bits.first_from(701), Some(4095));
        assert_eq!(bits.last_to(4094), Some(700));
        assert_eq!(bits.last_to(63), Some(63));
        assert_eq!(bits.last_to(62), Some(0));
        bits.clear(0);
        assert_eq!(bits.last_to(62), None);
        assert_eq!(bits.first_from(4096), None);
    }
}
