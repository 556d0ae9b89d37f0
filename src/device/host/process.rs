//! What the host devices of one process share, as CUDA's devices do: page-locked host ranges
//! (pinned memory is pinned for every device), access grants to peer devices (a range mapped on
//! one device and granted to another can be copied from the other's streams) and events (a
//! stream of one device may wait for an event of another).

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

use super::lock;
use crate::device::{DevicePtr, HostMemory};
use crate::error::{Error, Result};

/// Page-locked host ranges of the process, by start address: (length, registered rather than
/// allocated pinned).
fn page_locked() -> &'static Mutex<BTreeMap<usize, (usize, bool)>> {
    static RANGES: OnceLock<Mutex<BTreeMap<usize, (usize, bool)>>> = OnceLock::new();
    RANGES.get_or_init(|| Mutex::new(BTreeMap::new()))
}

/// Records `[start, start+len)` as page-locked; `registered` for ranges locked in place.
pub(super) fn lock_pages(start: usize, len: usize, registered: bool) -> Result<()> {
    let mut ranges = lock(page_locked());
    let end = start.saturating_add(len);
    let overlaps = ranges
        .range(..end)
        .next_back()
        .is_some_and(|(&s, &(l, _))| s + l > start);
    if overlaps {
        return Err(Error::invalid_argument(format!(
            "host range {start:#x}+{len} is already page-locked"
        )));
    }
    ranges.insert(start, (len, registered));
    Ok(())
}

/// Forgets the page-locked range starting at `start`; `registered` must match how it was made.
pub(super) fn unlock_pages(start: usize, registered: bool) -> Result<usize> {
    let mut ranges = lock(page_locked());
    match ranges.get(&start) {
        Some(&(len, was)) if was == registered => {
            ranges.remove(&start);
            Ok(len)
        }
        _ => Err(Error::invalid_argument(format!(
            "{start:#x} does not start a {} host range",
            if registered { "registered" } else { "pinned" }
        ))),
    }
}

/// Whether all of `[ptr, ptr+len)` lies in one page-locked range.
pub(super) fn host_memory(ptr: usize, len: usize) -> HostMemory {
    let end = ptr.saturating_add(len.max(1));
    let covered = lock(page_locked())
        .range(..=ptr)
        .next_back()
        .is_some_and(|(&s, &(l, _))| end <= s + l);
    if covered {
        HostMemory::Pinned
    } else {
        HostMemory::Pageable
    }
}

/// Device ranges granted to a set of devices (a bit per ordinal), by start address.
fn grants() -> &'static Mutex<BTreeMap<DevicePtr, (usize, u64)>> {
    static GRANTS: OnceLock<Mutex<BTreeMap<DevicePtr, (usize, u64)>>> = OnceLock::new();
    GRANTS.get_or_init(|| Mutex::new(BTreeMap::new()))
}

fn bit(device: i32) -> u64 {
    1u64.checked_shl(device as u32).unwrap_or(0)
}

/// Records that `devices` may access `[va, va+size)`.
pub(super) fn grant(va: DevicePtr, size: usize, devices: &[i32]) {
    let mask = devices.iter().fold(0, |m, &d| m | bit(d));
    lock(grants()).insert(va, (size, mask));
}

/// Drops every grant that overlaps `[va, va+size)` (its memory is being unmapped).
pub(super) fn revoke(va: DevicePtr, size: usize) {
    let end = va + size as u64;
    let mut grants = lock(grants());
    let overlapping: Vec<DevicePtr> = grants
        .range(..end)
        .filter(|(&s, &(l, _))| s + l as u64 > va)
        .map(|(&s, _)| s)
        .collect();
    for start in overlapping {
        grants.remove(&start);
    }
}

/// Whether `device` was granted access to all of `[va, va+len)` by one grant.
pub(super) fn granted(va: DevicePtr, len: usize, device: i32) -> bool {
    lock(grants())
        .range(..=va)
        .next_back()
        .is_some_and(|(&s, &(l, mask))| va + len as u64 <= s + l as u64 && mask & bit(device) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_locked_ranges() {
        let base = 0x7000_0000_0000usize;
        lock_pages(base, 4096, false).unwrap();
        assert!(lock_pages(base + 100, 10, true).is_err(), "overlap");
        assert_eq!(host_memory(base, 4096), HostMemory::Pinned);
        assert_eq!(
            host_memory(base + 10, 4096),
            HostMemory::Pageable,
            "runs past the end"
        );
        // Two ranges with a gap between them are not one page-locked range.
        lock_pages(base + 8192, 4096, true).unwrap();
        assert_eq!(host_memory(base, 12288), HostMemory::Pageable);
        assert_eq!(unlock_pages(base + 8192, true).unwrap(), 4096);
        assert!(unlock_pages(base, true).is_err(), "not registered");
        assert_eq!(unlock_pages(base, false).unwrap(), 4096);
        assert_eq!(host_memory(base, 1), HostMemory::Pageable);
    }

    #[test]
    fn grants_cover_ranges_until_revoked() {
        let va = 0x6000_0000_0000u64;
        grant(va, 1 << 21, &[0, 2]);
        assert!(granted(va + 4096, 4096, 2));
        assert!(!granted(va + 4096, 4096, 1));
        assert!(!granted(va + (1 << 21) - 1, 2, 0), "runs past the grant");
        revoke(va + (1 << 20), 1 << 20);
        assert!(!granted(va, 1, 0));
    }
}
