//! Stream-ordered reuse: what happens to memory when it is freed. A block freed on stream S is
//! reusable at once on S; a block also used on other streams (`record_stream`) waits for events
//! recorded on them at free time; other streams get free memory only after the allocator has
//! seen the owning stream's work complete. Frees that need events are held back while a
//! capture may be underway (see `private`).

use super::blocks::{RELEASED, SHARED};
use super::{Inner, Live, Target};
use crate::device::{DevicePtr, Event, Stream};
use crate::error::{Error, Result};

/// A freed allocation waiting for events recorded on the extra streams that used it.
#[derive(Debug)]
pub(super) struct PendingFree {
    pub(super) live: Live,
    pub(super) events: Vec<Event>,
    /// Its events could not all be recorded, nor the device waited for: only a later wait for
    /// the whole device completes it (its events cover only some of its streams).
    pub(super) device_wide: bool,
}

impl Inner {
    /// Adds `stream` to the streams that use the allocation at `ptr`.
    /// `known`: whether the backend knows `stream` (an unknown one is refused now rather than
    /// failing the free later).
    pub(super) fn record_stream(
        &mut self,
        ptr: DevicePtr,
        stream: Stream,
        known: bool,
    ) -> Result<()> {
        let live = match self.live.get_mut(&ptr) {
            Some(live) => live,
            None => {
                self.unpark_all();
                return Err(self.classify_unknown(ptr));
            }
        };
        if !known {
            return Err(Error::invalid_argument(format!(
                "record_stream: unknown stream {:#x}",
                stream.0
            )));
        }
        if stream != live.stream && !live.extra_streams.contains(&stream) {
            live.extra_streams.push(stream);
        }
        Ok(())
    }

    /// Takes the live allocation at `ptr` off the books: what every free does first.
    pub(super) fn unregister(&mut self, ptr: DevicePtr) -> Result<Live> {
        let Some(live) = self.live.remove(&ptr) else {
            // A parked block is freed memory: classified as such once back in the free lists.
            self.unpark_all();
            return Err(self.classify_unknown(ptr));
        };
        let stats = &mut self.stats;
        stats.allocation.decrease(live.pool, 1);
        stats.allocated_bytes.decrease(live.pool, live.size as u64);
        stats
            .requested_bytes
            .decrease(live.pool, live.requested as u64);
        self.observe(super::AllocationEvent::Freed { ptr });
        Ok(live)
    }

    pub(super) fn free(
        &mut self,
        device: &dyn crate::device::Device,
        ptr: DevicePtr,
    ) -> Result<()> {
        // Swappable allocations are rare: the common free pays one emptiness check for them.
        if !self.swappable.is_empty() {
            if self.swappable.get(&ptr).is_some_and(|e| e.host.is_some()) {
                return self.free_swapped(device, ptr);
            }
            // A copy out may still read it: wait for it before the memory can be reused.
            self.cancel_leaving(device, ptr);
            if self.live.contains_key(&ptr) {
                // Resident: freed like any allocation, its memory joins the cache.
                self.swappable.remove(&ptr);
            }
        }
        let live = self.unregister(ptr)?;
        self.count_free_for_fence(device, live.stream);
        if live.extra_streams.is_empty() {
            if !self.park(ptr, &live) {
                let stream = live.stream;
                self.finish_free(live, Some(stream));
            }
            return Ok(());
        }
        if self.routing > 0 {
            // An event recorded on a capturing stream would become part of the graph.
            self.set_target_pending(live.target);
            self.deferred.push(live);
            return Ok(());
        }
        self.free_after_events(device, live)
    }

    /// Frees an allocation used on extra streams: its memory waits for events recorded on them.
    pub(super) fn free_after_events(
        &mut self,
        device: &dyn crate::device::Device,
        live: Live,
    ) -> Result<()> {
        let mut events = Vec::with_capacity(live.extra_streams.len());
        for &stream in &live.extra_streams {
            let event = match self.take_event(device) {
                Ok(event) => event,
                Err(err) => {
                    self.pending.push(PendingFree {
                        live,
                        events,
                        device_wide: false,
                    });
                    return self.fail_pending(device, err);
                }
            };
            if let Err(err) = device.record_event(event, stream) {
                self.idle_events.push(event);
                self.pending.push(PendingFree {
                    live,
                    events,
                    device_wide: false,
                });
                return self.fail_pending(device, err);
            }
            events.push(event);
        }
        self.set_target_pending(live.target);
        self.pending.push(PendingFree {
            live,
            events,
            device_wide: false,
        });
        Ok(())
    }

    /// An event from the pool's idle ones, or a new one.
    pub(super) fn take_event(&mut self, device: &dyn crate::device::Device) -> Result<Event> {
        match self.idle_events.pop() {
            Some(event) => Ok(event),
            None => device.create_event(),
        }
    }

    /// A free whose events could not be recorded: wait for the device instead, so the memory is
    /// neither lost nor reused early, and report the error.
    fn fail_pending(&mut self, device: &dyn crate::device::Device, err: Error) -> Result<()> {
        if let Some(pending) = self.pending.last() {
            self.set_target_pending(pending.live.target);
        }
        if device.synchronize_device().is_ok() {
            if let Some(pending) = self.pending.pop() {
                self.idle_events.extend(pending.events);
                self.finish_free(pending.live, None);
            }
            return Err(err.context(
                "recording a stream event for a free (the allocation is freed: the device was waited for instead)",
            ));
        }
        if let Some(pending) = self.pending.last_mut() {
            pending.device_wide = true;
        }
        Err(err.context(
            "recording a stream event for a free (the allocation is freed; its memory waits for the streams it was used on)",
        ))
    }

    fn set_target_pending(&mut self, target: Target) {
        match target {
            Target::Block(id) => self.map.set_pending(id),
            Target::Stitched(id) => {
                if let Some(ids) = self.stitch_blocks.blocks.get(&id) {
                    for &b in ids {
                        self.map.set_pending(b);
                    }
                }
            }
        }
    }

    /// Returns the memory of a freed allocation to the free sets, owned by `owner`.
    pub(super) fn finish_free(&mut self, live: Live, owner: Option<Stream>) {
        match live.target {
            Target::Block(id) => {
                self.release_block(id, owner);
            }
            Target::Stitched(id) => {
                for b in self.stitch_blocks.blocks.remove(&id).unwrap_or_default() {
                    self.release_block(b, owner);
                }
                self.stitch.park(id);
            }
        }
        self.stats.active.decrease(live.pool, 1);
        self.stats
            .active_bytes
            .decrease(live.pool, live.size as u64);
        self.sync_split_stats();
    }

    /// Completes pending frees whose events have all completed.
    pub(super) fn process_pending(&mut self, device: &dyn crate::device::Device) -> Result<()> {
        if self.routing > 0 {
            return Ok(());
        }
        let mut index = 0;
        while index < self.pending.len() {
            if self.pending[index].device_wide {
                index += 1;
                continue;
            }
            let mut done = true;
            for &event in &self.pending[index].events {
                if !device.query_event(event)? {
                    done = false;
                    break;
                }
            }
            if done {
                let pending = self.pending.swap_remove(index);
                self.idle_events.extend(pending.events);
                let stream = pending.live.stream;
                self.finish_free(pending.live, Some(stream));
            } else {
                index += 1;
            }
        }
        Ok(())
    }

    /// Makes the free memory of other streams usable by `stream`, by waiting for the device
    /// when another stream owns free memory or frees are pending.
    pub(super) fn reclaim_other_streams(
        &mut self,
        device: &dyn crate::device::Device,
        stream: Stream,
    ) -> Result<()> {
        self.unpark_all();
        if self.routing > 0 {
            return Ok(());
        }
        self.process_pending(device)?;
        let others = self.map.owning_streams().iter().any(|&s| s != stream);
        if others || !self.pending.is_empty() || self.map.has_tag(RELEASED) {
            self.synchronize_all(device)?;
        }
        Ok(())
    }

    /// Waits for all work on the device, then makes all free memory unowned (parked blocks back
    /// in the free lists first) and completes all pending frees. A device-wide wait also
    /// covers streams the caller has destroyed since.
    pub(super) fn synchronize_all(&mut self, device: &dyn crate::device::Device) -> Result<()> {
        self.unpark_all();
        device.synchronize_device()?;
        self.stats.num_sync_all_streams += 1;
        for stream in self.map.owning_streams() {
            self.map.disown(stream);
        }
        for pending in std::mem::take(&mut self.pending) {
            self.idle_events.extend(pending.events);
            self.finish_free(pending.live, None);
        }
        // Released graph pools' replays have finished: their memory is the shared pool's now.
        self.retag(RELEASED, SHARED);
        self.sync_split_stats();
        self.settled_epoch = self.close_epoch();
        Ok(())
    }
}
