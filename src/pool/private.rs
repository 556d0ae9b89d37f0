//! Private pools (PyTorch's graph pools): the memory of CUDA graph captures. Requests routed to
//! one are served only from its own segments, tagged apart from the shared pool; at its last
//! release its segments join the shared pool. While any routing is active a capture may be
//! underway, so driver calls that are not stream work run in relaxed capture mode and frees
//! that need events are deferred until the last routing ends.

use super::blocks::{Tag, RELEASED, SHARED};
use super::{Inner, Target};
use crate::device::{CaptureMode, DevicePtr, Stream};
use crate::error::{Error, ErrorKind, Result};

/// Names a private pool (PyTorch's `MempoolId_t`).
pub type PrivatePoolId = (u64, u64);

#[derive(Debug, Clone, Copy)]
pub(super) struct PrivatePool {
    tag: Tag,
    /// Uses taken (retains and routings begun) not yet matched by a release.
    uses: u32,
    /// Routings to this pool begun and not yet ended (each also counts in `Inner::routing`).
    routings: u32,
}

impl Inner {
    /// Allocates from private pool `private` when given (which must be open), else from the
    /// shared pool; while a capture may be underway, in relaxed capture mode.
    pub(super) fn malloc_in(
        &mut self,
        device: &dyn crate::device::Device,
        size: usize,
        asked: usize,
        stream: Stream,
        private: Option<PrivatePoolId>,
    ) -> Result<DevicePtr> {
        let tag = match private {
            None => match super::sleep::current_region(self.id).or(self.default_region) {
                Some(region) => {
                    self.check_region_awake(region)?;
                    region
                }
                None => SHARED,
            },
            Some(_) => self.tag_of(private)?,
        };
        if self.routing == 0 {
            // Guarded and swappable allocations get whole granules of their own: a caller's
            // rounding has no use there, and a guard page belongs right after the bytes asked
            // for.
            if tag == SHARED && self.config.guard {
                return self.malloc_guarded(device, asked, stream);
            }
            if tag == SHARED && self.wants_swappable(asked) {
                return self.malloc_swappable(device, asked, stream);
            }
            return self.malloc(device, size, asked, stream, tag);
        }
        // A capture may be underway on this thread: driver calls that are not stream work
        // (creating and mapping memory) must not count as unsafe calls that end it.
        let previous = device.exchange_capture_mode(CaptureMode::Relaxed)?;
        let result = self.malloc(device, size, asked, stream, tag);
        if let Err(err) = device.exchange_capture_mode(previous) {
            log::warn!("glake: restoring the stream capture mode failed: {err}");
        }
        result
    }

    /// Allocates exactly `[addr, addr+size)` again from private pool `private` when given
    /// (which must be open), else from the shared pool; see `Inner::malloc_at`.
    pub(super) fn malloc_at_in(
        &mut self,
        device: &dyn crate::device::Device,
        addr: DevicePtr,
        size: usize,
        stream: Stream,
        private: Option<PrivatePoolId>,
    ) -> Result<DevicePtr> {
        let tag = self.tag_of(private)?;
        self.malloc_at(device, addr, size, stream, tag)
    }

    /// The tag of private pool `private` (which must be open), or of the shared pool for None.
    pub(super) fn tag_of(&self, private: Option<PrivatePoolId>) -> Result<Tag> {
        match private {
            None => Ok(SHARED),
            Some(id) => self.private.get(&id).map(|p| p.tag).ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidState,
                    format!("private pool {id:?} is not open"),
                )
            }),
        }
    }

    /// Starts routing to private pool `id`, creating it or taking one more use of it.
    pub(super) fn begin_private(&mut self, id: PrivatePoolId) {
        self.retain_private(id);
        if let Some(pool) = self.private.get_mut(&id) {
            pool.routings += 1;
            self.routing += 1;
        }
    }

    /// Creates private pool `id` or takes one more use of it, without routing to it.
    pub(super) fn retain_private(&mut self, id: PrivatePoolId) {
        if let Some(pool) = self.private.get_mut(&id) {
            pool.uses += 1;
            return;
        }
        let tag = self.next_tag;
        self.next_tag += 1;
        self.private.insert(
            id,
            PrivatePool {
                tag,
                uses: 1,
                routings: 0,
            },
        );
    }

    /// The uses of private pool `id`, 0 when it is not open.
    pub(super) fn private_use_count(&self, id: PrivatePoolId) -> u32 {
        self.private.get(&id).map_or(0, |p| p.uses)
    }

    /// The private pool whose segments carry `tag` (None for the shared pool). A scan: few
    /// pools are open, and only snapshots and recorded events ask.
    pub(super) fn private_of_tag(&self, tag: Tag) -> Option<PrivatePoolId> {
        if tag == SHARED {
            return None;
        }
        self.private
            .iter()
            .find(|(_, p)| p.tag == tag)
            .map(|(&id, _)| id)
    }

    /// Ends one routing; at the last, the frees deferred meanwhile record their events.
    pub(super) fn end_private(
        &mut self,
        device: &dyn crate::device::Device,
        id: PrivatePoolId,
    ) -> Result<()> {
        match self.private.get_mut(&id) {
            Some(pool) if pool.routings > 0 => pool.routings -= 1,
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidState,
                    format!("no routing to private pool {id:?} to end"),
                ))
            }
        }
        self.end_routings(device, 1)
    }

    /// Ends `count` routings; at the last, the frees deferred meanwhile record their events.
    fn end_routings(&mut self, device: &dyn crate::device::Device, count: u32) -> Result<()> {
        self.routing = self.routing.saturating_sub(count);
        if self.routing > 0 {
            return Ok(());
        }
        let mut first_error = None;
        for live in std::mem::take(&mut self.deferred) {
            if let Err(err) = self.free_after_events(device, live) {
                first_error.get_or_insert(err);
            }
        }
        for ptr in std::mem::take(&mut self.deferred_guarded) {
            if let Err(err) = self.free_guarded(device, ptr) {
                first_error.get_or_insert(err);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Drops one use of private pool `id`; at the last, its segments join the shared pool at
    /// the next device-wide wait (see [`RELEASED`]) and any routing to it still open ends (a
    /// caller that releases without ending must not hold every other pool's frees and cache
    /// back for good).
    ///
    /// [`RELEASED`]: super::blocks::RELEASED
    pub(super) fn release_private(
        &mut self,
        device: &dyn crate::device::Device,
        id: PrivatePoolId,
    ) -> Result<()> {
        let Some(pool) = self.private.get_mut(&id) else {
            return Err(Error::new(
                ErrorKind::InvalidState,
                format!("private pool {id:?} is not open"),
            ));
        };
        pool.uses = pool.uses.saturating_sub(1);
        if pool.uses == 0 {
            let (tag, routings) = (pool.tag, pool.routings);
            self.private.remove(&id);
            self.retag(tag, RELEASED);
            self.sync_split_stats();
            if routings > 0 {
                return self.end_routings(device, routings);
            }
        }
        Ok(())
    }

    /// The live allocations of private pool `id`, by address (None when it is not open).
    pub(super) fn private_allocations(&self, id: PrivatePoolId) -> Option<Vec<DevicePtr>> {
        let tag = self.private.get(&id)?.tag;
        let mut ptrs: Vec<DevicePtr> = self
            .live
            .iter()
            .filter(|(_, live)| match live.target {
                Target::Block(b) => self.map.segments[self.map.blocks[b].segment].tag == tag,
                Target::Stitched(_) => false,
            })
            .map(|(&ptr, _)| ptr)
            .collect();
        ptrs.sort_unstable();
        Some(ptrs)
    }

    /// Ends all routing and joins every private pool to the shared pool (the pool is going).
    pub(super) fn close_private(&mut self) {
        self.routing = 0;
        let tags: Vec<Tag> = self.private.drain().map(|(_, p)| p.tag).collect();
        for tag in tags {
            self.retag(tag, SHARED);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::config::Config;
    use crate::device::host::{HostDevice, HostOptions};
    use crate::device::Stream;
    use crate::error::ErrorKind;
    use crate::pool::Pool;

    const MIB: usize = 1 << 20;

    fn pool() -> Pool {
        let device = Arc::new(HostDevice::new(0, HostOptions::default()).expect("host device"));
        Pool::new(device, Config::default()).expect("pool")
    }

    #[test]
    fn routings_are_counted_per_pool() {
        let p = pool();
        let (a, b) = ((1, 1), (2, 2));
        p.retain_private(a);
        p.begin_private(b);
        // Pool a was never routed to: ending it must not end b's routing.
        assert_eq!(
            p.end_private(a).expect_err("a is not routed").kind(),
            ErrorKind::InvalidState
        );
        // While b is routed, frees that need events wait and empty_cache holds back.
        let shared = p.malloc(MIB, Stream::DEFAULT).expect("malloc");
        p.free(shared).expect("free");
        // Released without an end: b's routing ends with its last use, and the pool works
        // normally again.
        p.release_private(b).expect("release");
        assert_eq!(p.private_use_count(b), 0);
        p.empty_cache().expect("empty_cache");
        assert_eq!(
            p.stats().segment.all.current,
            0,
            "nothing is held back any more"
        );
        p.release_private(a).expect("release");
        p.check_invariants().expect("invariants");
    }

    #[test]
    fn retain_takes_a_use_without_routing() {
        let p = pool();
        let id = (7, 9);
        assert_eq!(p.private_use_count(id), 0);
        p.retain_private(id);
        assert_eq!(p.private_use_count(id), 1);
        // Not routed to: nothing to end, and empty_cache is not held back.
        assert_eq!(
            p.end_private(id).expect_err("no routing").kind(),
            ErrorKind::InvalidState
        );
        let a = p
            .malloc_in(4 * MIB, Stream::DEFAULT, Some(id))
            .expect("malloc_in");
        let shared = p.malloc(MIB, Stream::DEFAULT).expect("malloc");
        p.free(shared).expect("free");
        p.empty_cache().expect("empty_cache");
        assert_eq!(
            p.stats().segment.all.current,
            1,
            "the shared segment is released"
        );

        p.begin_private(id);
        assert_eq!(p.private_use_count(id), 2);
        p.end_private(id).expect("end");
        assert_eq!(p.private_use_count(id), 2, "ending a routing keeps the use");
        p.release_private(id).expect("release");
        assert_eq!(p.private_use_count(id), 1);
        assert_eq!(p.private_allocations(id), Some(vec![a]));
        let snapshot = p.snapshot();
        assert_eq!(snapshot.segments[0].private_pool, Some(id));
        assert!(snapshot.to_json().contains("\"private_pool\":[7,9]"));

        p.release_private(id).expect("release");
        assert_eq!(p.private_use_count(id), 0);
        assert_eq!(p.private_allocations(id), None);
        let snapshot = p.snapshot();
        assert_eq!(snapshot.segments[0].private_pool, None);
        assert!(snapshot.to_json().contains("\"private_pool\":null"));
        assert_eq!(
            p.release_private(id).expect_err("not open").kind(),
            ErrorKind::InvalidState
        );
        p.free(a).expect("free");
        p.check_invariants().expect("invariants");
    }
}
