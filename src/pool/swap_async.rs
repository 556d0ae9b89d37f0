//! Stream-ordered swapping of swappable allocations, for an executor that must not wait for
//! the device: a swap-out queues the copy to a pinned buffer on the caller's copy stream after
//! the allocation's own streams, and the physical memory goes back once the copy is seen done
//! ([`Inner::finish_swap_outs`]); a swap-in maps new memory, queues the copy back on the copy
//! stream and makes the allocation's streams wait for it. Pinned buffers are made once per
//! size and reused (pinning is slow); a buffer returns to the pool's cache only once the copy
//! that reads it is done.
//!
//! A swap-out that cannot be queued changes nothing. One whose completion event cannot be
//! recorded waits for its copy and completes at once. A swap-in of an allocation still on its
//! way out cancels the swap-out: its memory never left.

use super::growth::Zombie;
use super::swapping::{wait_for_copy, HostBytes, HostCopy};
use super::Inner;
use crate::device::{DevicePtr, Event, Stream};
use crate::error::{Error, Result};

/// A pinned host buffer of the pool's (kept as an address: the pool is shared across threads
/// and only the pool touches the buffer, under its lock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PinnedBuf {
    addr: usize,
    pub(super) len: usize,
}

impl PinnedBuf {
    /// A buffer of `len` bytes at `ptr`, made by the device's `alloc_pinned`.
    pub(super) fn from_pinned(ptr: *mut u8, len: usize) -> PinnedBuf {
        PinnedBuf {
            addr: ptr as usize,
            len,
        }
    }

    pub(super) fn ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn ptr_mut(&self) -> *mut u8 {
        self.addr as *mut u8
    }
}

/// A swap-out queued and not yet seen done: the allocation's memory is still mapped.
#[derive(Debug)]
pub(super) struct Leaving {
    done: Event,
    buf: PinnedBuf,
}

/// The pool's pinned buffers: free ones by size, and ones still read by a queued copy.
#[derive(Debug, Default)]
pub(super) struct PinnedCache {
    free: Vec<PinnedBuf>,
    busy: Vec<(Event, PinnedBuf)>,
}

impl PinnedCache {
    /// The sizes of the free buffers.
    pub(super) fn free_sizes(&self) -> impl Iterator<Item = usize> + '_ {
        self.free.iter().map(|b| b.len)
    }
}

impl Inner {
    /// Queues the copy of swappable allocation `ptr` to host memory on `copy` (after the work
    /// already queued on the allocation's streams); its physical memory goes back to the
    /// device once [`Inner::finish_swap_outs`] sees the copy done.
    pub(super) fn swap_out_async(
        &mut self,
        device: &dyn crate::device::Device,
        ptr: DevicePtr,
        copy: Stream,
    ) -> Result<()> {
        let t = self.swap_target(ptr, false)?;
        let buf = self.pinned_buffer(device, t.size)?;
        let queued = (|| {
            for &stream in std::iter::once(&t.stream).chain(&t.extra_streams) {
                let event = self.take_event(device)?;
                let ordered = device
                    .record_event(event, stream)
                    .and_then(|()| device.stream_wait_event(copy, event));
                self.idle_events.push(event);
                ordered?;
            }
            // SAFETY: the pinned buffer holds `t.size` bytes and stays the pool's (busy or
            // leaving) until the copy is known done.
            unsafe { device.copy_to_host(buf.ptr_mut(), ptr, t.size, copy) }
        })();
        if let Err(err) = queued {
            // The copy may have been queued before a later step failed: wait before reuse.
            self.release_buffer_after(device, buf, copy);
            return Err(err.context("queueing a swap-out"));
        }
        let done = self.take_event(device).and_then(|e| {
            device.record_event(e, copy).map(|()| e).inspect_err(|_| {
                self.idle_events.push(e);
            })
        });
        match done {
            Ok(done) => {
                if let Some(entry) = self.swappable.get_mut(&ptr) {
                    entry.leaving = Some(Leaving { done, buf });
                }
                Ok(())
            }
            Err(err) => {
                // No event to look for later: wait for the copy and complete now.
                log::warn!("glake: a swap-out event failed ({err}); waiting for its copy");
                if let Err(err) = wait_for_copy(device, copy) {
                    // The copy may still write into the buffer: it never goes back to the cache.
                    log::error!("glake: a swap-out copy cannot be waited for; leaking its buffer");
                    return Err(err.context("waiting for a swap-out copy"));
                }
                self.complete_swap_out(device, ptr, t.block, t.size, HostBytes::Pinned(buf));
                Ok(())
            }
        }
    }

    /// Whether a swap-out is queued and not yet completed.
    pub(super) fn swaps_leaving(&self) -> bool {
        !self.swappable.is_empty() && self.swappable.values().any(|e| e.leaving.is_some())
    }

    /// Completes the swap-outs whose copies are done (all of them, waiting, with `wait`):
    /// their physical memory goes back to the device. Returns how many completed.
    pub(super) fn finish_swap_outs(
        &mut self,
        device: &dyn crate::device::Device,
        wait: bool,
    ) -> Result<usize> {
        self.recycle_busy(device, false);
        let leaving: Vec<DevicePtr> = self
            .swappable
            .iter()
            .filter(|(_, e)| e.leaving.is_some())
            .map(|(&p, _)| p)
            .collect();
        let mut completed = 0;
        for ptr in leaving {
            let Some(done) = self.swappable[&ptr].leaving.as_ref().map(|l| l.done) else {
                continue;
            };
            let finished = if wait {
                device.synchronize_event(done).map(|()| true)
            } else {
                device.query_event(done)
            };
            if !finished.map_err(|e| e.context("waiting for a swap-out"))? {
                continue;
            }
            let Some(leaving) = self.swappable.get_mut(&ptr).and_then(|e| e.leaving.take()) else {
                continue;
            };
            self.idle_events.push(leaving.done);
            let Some(live) = self.live.get(&ptr) else {
                continue;
            };
            let (size, target) = (live.size, live.target);
            let super::Target::Block(block) = target else {
                return Err(Error::internal("a swappable allocation is stitched"));
            };
            self.complete_swap_out(device, ptr, block, size, HostBytes::Pinned(leaving.buf));
            completed += 1;
        }
        Ok(completed)
    }

    /// Brings swappable allocation `ptr` back: one still on its way out keeps its memory (the
    /// swap-out is cancelled); one out gets new memory at its address, filled by a copy on
    /// `copy` that the allocation's streams wait for.
    pub(super) fn swap_in_async(
        &mut self,
        device: &dyn crate::device::Device,
        ptr: DevicePtr,
        copy: Stream,
    ) -> Result<()> {
        let leaving_done = self
            .swappable
            .get(&ptr)
            .and_then(|e| e.leaving.as_ref())
            .map(|l| l.done);
        if let Some(done) = leaving_done {
            // Never unmapped: the bytes are still there; the buffer is free once read. The
            // copy out may still read the memory: the allocation's streams wait for it, so a
            // later swap-out or free (which wait for those streams) cannot take the memory
            // away under it. On an error it is still on its way out.
            self.order_after_copy_out(device, ptr, done)?;
            if let Some(leaving) = self.swappable.get_mut(&ptr).and_then(|e| e.leaving.take()) {
                self.cache_busy(leaving.done, leaving.buf);
            }
            return Ok(());
        }
        let t = self.swap_target(ptr, true)?;
        let buf = match self.swappable.get(&ptr).and_then(|e| e.host.as_ref()) {
            Some(HostCopy {
                bytes: HostBytes::Pinned(buf),
                ..
            }) => *buf,
            // Swapped out by the waiting call: its pageable copy comes back the same way.
            _ => return self.swap_in(device, ptr),
        };
        let chunks = self.swap_in_memory(device, ptr, t.size)?;
        // SAFETY: the buffer stays the pool's until the copy is known done (busy below).
        let queued = unsafe { device.copy_to_device(ptr, buf.ptr(), t.size, copy) };
        if let Err(err) = queued {
            self.bury(device, Zombie::mapped(ptr, &chunks));
            return Err(err.context("queueing a swap-in"));
        }
        let ordered = self.take_event(device).and_then(|e| {
            let result = device.record_event(e, copy).and_then(|()| {
                std::iter::once(&t.stream)
                    .chain(&t.extra_streams)
                    .try_for_each(|&stream| device.stream_wait_event(stream, e))
            });
            match result {
                Ok(()) => Ok(e),
                Err(err) => {
                    self.idle_events.push(e);
                    Err(err)
                }
            }
        });
        match ordered {
            Ok(ready) => self.cache_busy(ready, buf),
            Err(err) => {
                // The streams cannot be ordered after the copy: wait for it here instead.
                log::warn!("glake: ordering a swap-in failed ({err}); waiting for its copy");
                if let Err(err) = wait_for_copy(device, copy) {
                    // The copy may still write into the new memory: it comes down only after
                    // a later wait for the device.
                    self.zombies.push(Zombie::mapped(ptr, &chunks));
                    return Err(err.context("waiting for a swap-in copy"));
                }
                self.pinned.free.push(buf);
            }
        }
        // The buffer is accounted for above (busy until the copy is done, or free).
        let _ = self.complete_swap_in(ptr, t.block, t.size, chunks);
        Ok(())
    }

    /// Makes the streams of allocation `ptr` wait for `done`, the end of a copy out still
    /// queued; where that cannot be ordered, waits for the copy here (an error when that
    /// fails too).
    fn order_after_copy_out(
        &mut self,
        device: &dyn crate::device::Device,
        ptr: DevicePtr,
        done: Event,
    ) -> Result<()> {
        let streams: Vec<Stream> = match self.live.get(&ptr) {
            Some(live) => std::iter::once(live.stream)
                .chain(live.extra_streams.iter().copied())
                .collect(),
            None => Vec::new(),
        };
        let ordered = streams
            .iter()
            .try_for_each(|&stream| device.stream_wait_event(stream, done));
        if let Err(err) = ordered {
            log::warn!("glake: ordering after a cancelled swap-out failed ({err}); waiting for it");
            device
                .synchronize_event(done)
                .map_err(|e| e.context("waiting for a cancelled swap-out's copy"))?;
        }
        Ok(())
    }

    /// Undoes a swap-out still under way for `ptr` (before a free): waits for its copy and
    /// gives its buffer back; the allocation is resident as before.
    pub(super) fn cancel_leaving(&mut self, device: &dyn crate::device::Device, ptr: DevicePtr) {
        if let Some(leaving) = self.swappable.get_mut(&ptr).and_then(|e| e.leaving.take()) {
            if device.synchronize_event(leaving.done).is_ok() {
                self.idle_events.push(leaving.done);
                self.pinned.free.push(leaving.buf);
            } else {
                // Whether the copy still reads the memory cannot be known: keep both.
                log::error!("glake: a swap-out copy cannot be waited for; leaking its buffer");
            }
        }
    }

    /// Gives a host copy's memory back: a pinned buffer to the cache, pageable memory to the
    /// process.
    pub(super) fn recycle_host(&mut self, bytes: HostBytes) {
        if let HostBytes::Pinned(buf) = bytes {
            self.pinned.free.push(buf);
        }
    }

    /// Waits for every queued swap copy and frees the pinned buffers (the pool is going).
    pub(super) fn settle_swaps(&mut self, device: &dyn crate::device::Device) {
        let leaving: Vec<DevicePtr> = self
            .swappable
            .iter()
            .filter(|(_, e)| e.leaving.is_some())
            .map(|(&p, _)| p)
            .collect();
        for ptr in leaving {
            self.cancel_leaving(device, ptr);
        }
        let hosts: Vec<HostBytes> = self
            .swappable
            .values_mut()
            .filter_map(|e| e.host.take().map(|h| h.bytes))
            .collect();
        for bytes in hosts {
            self.recycle_host(bytes);
        }
        self.recycle_busy(device, true);
        for buf in std::mem::take(&mut self.pinned.free) {
            // SAFETY: no queued copy reads or writes it any more (waited for above).
            if let Err(err) = unsafe { device.free_pinned(buf.ptr_mut()) } {
                log::warn!("glake: freeing a pinned swap buffer failed: {err}");
            }
        }
    }

    /// A pinned buffer of exactly `len` bytes: a cached one, else a new one.
    pub(super) fn pinned_buffer(
        &mut self,
        device: &dyn crate::device::Device,
        len: usize,
    ) -> Result<PinnedBuf> {
        self.recycle_busy(device, false);
        if let Some(i) = self.pinned.free.iter().position(|b| b.len == len) {
            return Ok(self.pinned.free.swap_remove(i));
        }
        let ptr = device
            .alloc_pinned(len)
            .map_err(|e| e.context("pinning host memory for a swap"))?;
        Ok(PinnedBuf::from_pinned(ptr, len))
    }

    /// A buffer a queued copy on `copy` may read: back to the cache once the stream is waited
    /// for (or kept forever when it cannot be).
    fn release_buffer_after(
        &mut self,
        device: &dyn crate::device::Device,
        buf: PinnedBuf,
        copy: Stream,
    ) {
        if wait_for_copy(device, copy).is_ok() {
            self.pinned.free.push(buf);
        } else {
            log::error!("glake: a swap copy cannot be waited for; leaking its buffer");
        }
    }

    fn cache_busy(&mut self, event: Event, buf: PinnedBuf) {
        self.pinned.busy.push((event, buf));
    }

    /// Buffers whose copies are done go back to the cache (all of them, waiting, with `wait`).
    fn recycle_busy(&mut self, device: &dyn crate::device::Device, wait: bool) {
        let mut still = Vec::new();
        for (event, buf) in std::mem::take(&mut self.pinned.busy) {
            let done = if wait {
                device.synchronize_event(event).is_ok()
            } else {
                device.query_event(event).unwrap_or(false)
            };
            if done {
                self.idle_events.push(event);
                self.pinned.free.push(buf);
            } else if wait {
                log::error!("glake: a swap copy cannot be waited for; leaking its buffer");
            } else {
                still.push((event, buf));
            }
        }
        self.pinned.busy = still;
    }
}
