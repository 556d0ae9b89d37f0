//! Sleep regions: memory allocated inside a named region (weights, a KV cache) lives in
//! segments of its own, so the whole region can give its physical memory back to the device
//! (sleep) while every virtual address stays reserved, and get it back at the same addresses
//! (wake), with its bytes when it slept in `Keep` mode. Pointers held anywhere, C++ operators'
//! and captured graphs' included, stay valid across a sleep and a wake.
//!
//! A region's free memory is cached and released like the shared pool's, but never lent to
//! other allocations or stitched with theirs: its segments are exactly the memory that sleeps.
//! Its free segments are stitched for its own larger requests; such a range loses its
//! mappings when the region sleeps (an idle one goes) and is mapped again, at its address,
//! over its pieces' new memory when the region wakes.
//!
//! Sleep waits for the device, gives back the region's cached free segments, copies every
//! allocated byte range to host buffers (pinned ones, copied by the device; or ordinary memory
//! through the copy engine, `Config::sleep_host`; pinned copies also go through the engine where
//! a peer GPU can relay them over its own host link; either kind is kept by the pool afterwards,
//! so a later sleep neither pins nor faults in pages again) and unmaps and releases the
//! segments: pinned copies range by range, each batch as soon as its copies are done while
//! later ones still copy. A failure to copy changes no segment that was not fully copied; the
//! region is then asleep in part, and sleeping it again finishes. Wake maps new memory at each
//! sleeping segment's range and copies the bytes back; a failure leaves the segments not yet
//! restored asleep with their bytes, and a retry goes on from there. Both return once their
//! copies are done, so work queued afterwards on any stream sees the bytes.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use super::blocks::{self, SegmentId, Tag, FIRST_REGION};
use super::growth::Zombie;
use super::swap_async::PinnedBuf;
use super::swapping::{wait_for_copy, HostBytes};
use super::Inner;
use crate::config::SleepHost;
use crate::device::{DevicePtr, Event, SharedDevice, Stream};
use crate::error::{Error, ErrorKind, Result};
use crate::transfer::{Completion, CopyPiece, Direction, Engine};

/// Bytes of a sleep's or a wake's copies queued through the copy engine at once: enough for
/// its relays (which take copies from 32 MiB on) to carry a share of segments smaller than
/// that.
const COPY_BATCH_BYTES: usize = 256 << 20;

/// Longest region name accepted (names are labels, not data).
pub const MAX_REGION_NAME: usize = 255;

/// What a sleeping region keeps of its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SleepMode {
    /// A host copy, restored on wake (weights).
    Keep,
    /// Nothing: after wake the memory holds undefined bytes (KV caches, scratch).
    Drop,
}

/// What [`super::Pool::region_info`] reports of a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RegionInfo {
    /// Sleep was asked for and wake has not completed.
    pub asleep: bool,
    /// Segments of the region, awake or asleep.
    pub segments: usize,
    /// Bytes of the region's segments that hold physical memory now.
    pub resident_bytes: usize,
    /// Bytes of the region's segments whose physical memory is given back.
    pub asleep_bytes: usize,
    /// Bytes allocated in the region (live allocations).
    pub allocated_bytes: usize,
    /// Bytes of host copies held for the sleeping segments.
    pub host_bytes: usize,
}

/// A named region of a pool.
#[derive(Debug)]
pub(super) struct Region {
    name: String,
    tag: Tag,
    /// Sleep was asked for and wake has not completed: allocations in the region are refused.
    asleep: bool,
    sleepers: Vec<Sleeper>,
}

/// A segment of a region whose physical memory is given back.
#[derive(Debug)]
struct Sleeper {
    segment: SegmentId,
    va: DevicePtr,
    size: usize,
    /// None in `Drop` mode.
    saved: Option<Saved>,
}

/// A sleeping segment's bytes on the host.
#[derive(Debug)]
struct Saved {
    /// The allocated ranges copied out, as (offset, length).
    ranges: Vec<(usize, usize)>,
    /// A buffer of the segment's size holding them at the same offsets.
    buf: HostBytes,
}

impl Saved {
    /// The bytes its ranges hold.
    fn bytes(&self) -> usize {
        self.ranges.iter().map(|&(_, len)| len).sum()
    }

    /// The engine's pieces for the ranges of a segment at `va`.
    fn pieces(&self, va: DevicePtr) -> Vec<CopyPiece> {
        self.ranges
            .iter()
            .map(|&(offset, len)| CopyPiece {
                host: self.buf.ptr() as usize + offset,
                device: va + offset as u64,
                len,
            })
            .collect()
    }
}

/// Where a sleep's time went, for its log line.
#[derive(Debug, Default)]
struct SleepTimes {
    /// Waiting for copies out.
    waiting: std::time::Duration,
    /// Unmapping and releasing segments.
    unmapping: std::time::Duration,
}

/// Regions begun and not ended, process-wide: while zero, allocations skip the thread-local
/// lookup.
static OPEN_REGIONS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's open regions, innermost last: (pool id, region tag).
    static THREAD_REGIONS: RefCell<Vec<(u64, Tag)>> = const { RefCell::new(Vec::new()) };
}

/// Whether any thread has a region open (of any pool).
pub(super) fn any_region_open() -> bool {
    OPEN_REGIONS.load(Ordering::Relaxed) != 0
}

/// The region this thread allocates in from pool `pool_id`, if any.
pub(super) fn current_region(pool_id: u64) -> Option<Tag> {
    if !any_region_open() {
        return None;
    }
    THREAD_REGIONS.with(|r| {
        r.borrow()
            .iter()
            .rev()
            .find(|(p, _)| *p == pool_id)
            .map(|&(_, t)| t)
    })
}

/// Opens region `tag` of pool `pool_id` on this thread.
pub(super) fn push_region(pool_id: u64, tag: Tag) {
    THREAD_REGIONS.with(|r| r.borrow_mut().push((pool_id, tag)));
    OPEN_REGIONS.fetch_add(1, Ordering::Relaxed);
}

/// Closes this thread's innermost region of pool `pool_id`.
pub(super) fn pop_region(pool_id: u64) -> Result<()> {
    let popped = THREAD_REGIONS.with(|r| {
        let mut r = r.borrow_mut();
        let at = r.iter().rposition(|(p, _)| *p == pool_id)?;
        Some(r.remove(at))
    });
    match popped {
        Some(_) => {
            OPEN_REGIONS.fetch_sub(1, Ordering::Relaxed);
            Ok(())
        }
        None => Err(Error::new(
            ErrorKind::InvalidState,
            "no region of this pool is open on this thread",
        )),
    }
}

fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_REGION_NAME {
        return Err(Error::invalid_argument(format!(
            "a region name has 1 to {MAX_REGION_NAME} bytes, not {}",
            name.len()
        )));
    }
    Ok(())
}

impl Inner {
    /// The tag of region `name`, made on first use.
    pub(super) fn region_tag(&mut self, name: &str) -> Result<Tag> {
        check_name(name)?;
        if let Some(r) = self.regions.iter().find(|r| r.name == name) {
            return Ok(r.tag);
        }
        let tag = FIRST_REGION
            .checked_add(self.regions.len() as Tag)
            .ok_or_else(|| Error::new(ErrorKind::ResourceLimit, "too many regions"))?;
        self.regions.push(Region {
            name: name.to_owned(),
            tag,
            asleep: false,
            sleepers: Vec::new(),
        });
        Ok(tag)
    }

    pub(super) fn region_index(&self, name: &str) -> Result<usize> {
        check_name(name)?;
        self.regions
            .iter()
            .position(|r| r.name == name)
            .ok_or_else(|| {
                Error::invalid_argument(format!("no region named {name:?} in this pool"))
            })
    }

    /// Refuses allocations in a region that is asleep (or half asleep after a failure).
    pub(super) fn check_region_awake(&self, tag: Tag) -> Result<()> {
        match self.regions.iter().find(|r| r.tag == tag) {
            Some(r) if r.asleep => Err(Error::new(
                ErrorKind::InvalidState,
                format!(
                    "region {:?} is asleep: wake it before allocating in it",
                    r.name
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Puts region `name` to sleep; see the module's documentation.
    pub(super) fn sleep(
        &mut self,
        device: &dyn crate::device::Device,
        name: &str,
        mode: SleepMode,
    ) -> Result<()> {
        let index = self.region_index(name)?;
        let (tag, asleep) = (self.regions[index].tag, self.regions[index].asleep);
        if self.routing > 0 {
            return Err(Error::new(
                ErrorKind::InvalidState,
                "cannot sleep while a graph capture may be under way",
            ));
        }
        let awake = self.awake_segments(tag);
        if asleep && awake.is_empty() {
            return Err(Error::new(
                ErrorKind::InvalidState,
                format!("region {name:?} is already asleep"),
            ));
        }
        // Nothing is unmapped while queued work may touch it.
        self.synchronize_all(device)?;
        if self.swaps_leaving() {
            self.finish_swap_outs(device, true)?;
        }
        self.regions[index].asleep = true;
        let result = self.sleep_segments(device, index, mode);
        if result.is_err() && self.regions[index].sleepers.is_empty() {
            // Nothing slept: the stitched ranges come back too, or the region stays asleep
            // for a wake to finish.
            match self.wake_stitches(device, tag) {
                Ok(()) => self.regions[index].asleep = false,
                Err(err) => log::warn!("glake: mapping stitched ranges back failed: {err}"),
            }
        }
        result
    }

    /// The region's segments that hold physical memory.
    fn awake_segments(&self, tag: Tag) -> Vec<SegmentId> {
        self.map
            .segments
            .iter()
            .filter(|(_, s)| s.tag == tag && !s.chunks().is_empty())
            .map(|(id, _)| id)
            .collect()
    }

    fn sleep_segments(
        &mut self,
        device: &dyn crate::device::Device,
        index: usize,
        mode: SleepMode,
    ) -> Result<()> {
        let tag = self.regions[index].tag;
        let started = Instant::now();
        // No stitched range may hold the region's memory once its segments give it back.
        self.sleep_stitches(device, tag);
        // Cached free memory of the region goes back whole, range included.
        for segment in self.map.idle_segments() {
            if self.map.segments[segment].tag == tag {
                self.release_segment(device, segment)?;
            }
        }
        let released = started.elapsed();
        let segments = self.awake_segments(tag);
        // Counted for the log line only.
        let handles: usize = if log::log_enabled!(log::Level::Info) {
            segments
                .iter()
                .map(|&s| self.map.segments[s].chunks().len())
                .sum()
        } else {
            0
        };
        let count = segments.len();
        let mut spent = SleepTimes::default();
        let bytes = match mode {
            SleepMode::Drop => {
                let unmapping = Instant::now();
                for segment in segments {
                    self.put_to_sleep(device, index, segment, None);
                }
                spent.unmapping = unmapping.elapsed();
                0
            }
            SleepMode::Keep => self.sleep_kept(device, index, segments, &mut spent)?,
        };
        // Where a sleep's time goes (GLAKE_LOG=info): copies against the driver's tear-down,
        // which overlap where the copies are pipelined.
        let copying = started.elapsed() - released;
        log::info!(
            "glake: sleep of region {:?}: {:.1} ms releasing cached segments, {:.1} ms copying \
             {bytes} bytes out and unmapping {count} segments of {handles} handles ({:.1} GB/s); \
             of that {:.1} ms waiting for copies and {:.1} ms unmapping",
            self.regions[index].name,
            released.as_secs_f64() * 1e3,
            copying.as_secs_f64() * 1e3,
            bytes as f64 / copying.as_secs_f64().max(1e-9) / 1e9,
            spent.waiting.as_secs_f64() * 1e3,
            spent.unmapping.as_secs_f64() * 1e3,
        );
        Ok(())
    }

    /// Segment `segment` of region `index` gives its physical memory back, keeping `saved`.
    fn put_to_sleep(
        &mut self,
        device: &dyn crate::device::Device,
        index: usize,
        segment: SegmentId,
        saved: Option<Saved>,
    ) {
        let (va, size) = (
            self.map.segments[segment].va,
            self.map.segments[segment].size,
        );
        self.unmap_segment(device, segment);
        self.regions[index].sleepers.push(Sleeper {
            segment,
            va,
            size,
            saved,
        });
    }

    /// Sleeps `segments` of region `index` in `Keep` mode; returns the bytes copied out. Pinned
    /// buffers are pipelined ([`Self::sleep_pipelined`]); pageable ones are copied by the
    /// engine's host threads, all before any segment is unmapped.
    fn sleep_kept(
        &mut self,
        device: &dyn crate::device::Device,
        index: usize,
        segments: Vec<SegmentId>,
        spent: &mut SleepTimes,
    ) -> Result<usize> {
        let stream = self.sleep_stream(device)?;
        let saved = self.sleep_buffers(device, &segments)?;
        let bytes = saved.iter().map(Saved::bytes).sum();
        if self.config.sleep_host == SleepHost::Pinned {
            self.sleep_pipelined(device, index, segments, saved, stream, spent)?;
            return Ok(bytes);
        }
        let vas: Vec<DevicePtr> = segments.iter().map(|&s| self.map.segments[s].va).collect();
        let copied = Instant::now();
        if let Err((err, settled)) = self.copy_out_whole(device, &saved, &vas, stream) {
            self.give_up_saved(saved, settled);
            return Err(err.context("copying a sleeping region to the host"));
        }
        spent.waiting = copied.elapsed();
        let unmapping = Instant::now();
        for (segment, saved) in segments.into_iter().zip(saved) {
            self.put_to_sleep(device, index, segment, Some(saved));
        }
        spent.unmapping = unmapping.elapsed();
        Ok(bytes)
    }

    /// A host buffer (from the pool's caches) for each of `segments`, of its size, with the
    /// allocated ranges to copy into it. On failure no buffer is kept.
    fn sleep_buffers(
        &mut self,
        device: &dyn crate::device::Device,
        segments: &[SegmentId],
    ) -> Result<Vec<Saved>> {
        let mut saved = Vec::with_capacity(segments.len());
        for &segment in segments {
            let size = self.map.segments[segment].size;
            let ranges = self.map.used_ranges(segment);
            match self.host_buffer(device, size) {
                Ok(buf) => saved.push(Saved { ranges, buf }),
                Err(err) => {
                    self.give_up_saved(saved, true);
                    return Err(err.context("copying a sleeping region to the host"));
                }
            }
        }
        Ok(saved)
    }

    /// Buffers of a sleep that did not complete: back to the cache when no copy may still
    /// write into them (`settled`), else never freed nor reused.
    fn give_up_saved(&mut self, saved: impl IntoIterator<Item = Saved>, settled: bool) {
        if !settled {
            log::error!("glake: sleep copies cannot be waited for; leaking their buffers");
        }
        for s in saved {
            if settled {
                self.recycle_saved(s.buf);
            } else {
                std::mem::forget(s.buf);
            }
        }
    }

    /// Copies `segments` out to the pinned buffers `saved` and unmaps them range by range:
    /// every batch of copies is queued on the sleep stream (through the engine's relays where
    /// there is an engine, in batches large enough for them; else a segment per batch) with an
    /// event after it, and each batch's segments are unmapped as soon as its event completes,
    /// while later batches still copy. A failure to queue changes no segment. A failure to
    /// wait leaves the segments from that batch on awake (their buffers kept for good when
    /// the copies cannot be waited for at all): the region is asleep in part, and sleeping it
    /// again finishes.
    fn sleep_pipelined(
        &mut self,
        device: &dyn crate::device::Device,
        index: usize,
        segments: Vec<SegmentId>,
        saved: Vec<Saved>,
        stream: Stream,
        spent: &mut SleepTimes,
    ) -> Result<()> {
        let batch_bytes = self.copy_batch_bytes();
        // The end (exclusive index into `segments`) of each batch queued, and its event.
        let mut marks: Vec<(usize, Event)> = Vec::new();
        let mut batch: Vec<CopyPiece> = Vec::new();
        let mut batched = 0;
        let mut queued = Ok(());
        for (i, (s, &segment)) in saved.iter().zip(&segments).enumerate() {
            batch.extend(s.pieces(self.map.segments[segment].va));
            batched += s.bytes();
            if batched < batch_bytes && i + 1 < segments.len() {
                continue;
            }
            queued = self.queue_copy(device, Direction::DeviceToHost, &batch, stream);
            if queued.is_ok() {
                queued = self
                    .mark(device, stream)
                    .map(|event| marks.push((i + 1, event)));
            }
            if queued.is_err() {
                break;
            }
            batch.clear();
            batched = 0;
        }
        if let Err(err) = queued {
            let settled = wait_for_copy(device, stream).is_ok();
            self.idle_events.extend(marks.into_iter().map(|(_, e)| e));
            self.give_up_saved(saved, settled);
            return Err(err.context("copying a sleeping region to the host"));
        }
        let mut sleeping = segments.into_iter().zip(saved);
        let mut slept = 0;
        let mut failure = None;
        for &(end, event) in &marks {
            let waiting = Instant::now();
            let waited = device.synchronize_event(event).or_else(|err| {
                log::warn!(
                    "glake: waiting for a sleep copy's event failed, waiting for the stream: {err}"
                );
                wait_for_copy(device, stream)
            });
            spent.waiting += waiting.elapsed();
            if let Err(err) = waited {
                failure = Some(err);
                break;
            }
            let unmapping = Instant::now();
            for (segment, saved) in sleeping.by_ref().take(end - slept) {
                self.put_to_sleep(device, index, segment, Some(saved));
            }
            spent.unmapping += unmapping.elapsed();
            slept = end;
        }
        self.idle_events.extend(marks.into_iter().map(|(_, e)| e));
        if let Some(err) = failure {
            self.give_up_saved(sleeping.map(|(_, s)| s), false);
            return Err(err.context("waiting for a sleeping region's copies"));
        }
        Ok(())
    }

    /// An event recorded on `stream` now: it completes when the work queued so far has.
    fn mark(&mut self, device: &dyn crate::device::Device, stream: Stream) -> Result<Event> {
        let event = self.take_event(device)?;
        if let Err(err) = device.record_event(event, stream) {
            self.idle_events.push(event);
            return Err(err);
        }
        Ok(event)
    }

    /// Copies the ranges of the segments at `vas[i]` out to `saved[i]` and waits, all at
    /// once: through the copy engine (which pageable buffers always have), else on the sleep
    /// stream. An error says whether the copies are settled (false: they cannot be waited for,
    /// and the buffers must never be freed nor reused).
    fn copy_out_whole(
        &mut self,
        device: &dyn crate::device::Device,
        saved: &[Saved],
        vas: &[DevicePtr],
        stream: Stream,
    ) -> std::result::Result<(), (Error, bool)> {
        let pieces: Vec<CopyPiece> = saved
            .iter()
            .zip(vas)
            .flat_map(|(s, &va)| s.pieces(va))
            .collect();
        if let Some(engine) = &self.sleep_engine {
            // SAFETY: every piece lies inside a live buffer of the pool's; a blocking copy is
            // done when it returns.
            let copied = unsafe {
                engine.copy_pieces(
                    Direction::DeviceToHost,
                    &pieces,
                    stream,
                    Completion::Blocking,
                )
            };
            return copied.map_err(|err| {
                // Copies queued before the failure may still run: settled only once waited for.
                (err, wait_for_copy(device, stream).is_ok())
            });
        }
        let queued = queue_pinned(device, Direction::DeviceToHost, &pieces, stream);
        if let Err(err) = wait_for_copy(device, stream) {
            return Err((err.context("waiting for a sleeping region's copies"), false));
        }
        queued.map_err(|e| (e, true))
    }

    /// A host buffer of `len` bytes for a sleeping segment, of the kind the configuration
    /// asks for: a cached one, else a new one.
    fn host_buffer(&mut self, device: &dyn crate::device::Device, len: usize) -> Result<HostBytes> {
        match self.config.sleep_host {
            SleepHost::Pinned => self.pinned_buffer(device, len).map(HostBytes::Pinned),
            SleepHost::Pageable => {
                if let Some(i) = self.pageable.iter().position(|b| b.len() == len) {
                    return Ok(HostBytes::Pageable(self.pageable.swap_remove(i)));
                }
                zeroed(len).map(HostBytes::Pageable)
            }
        }
    }

    /// The host buffers a sleep of region `name` in `Keep` mode would have to make now: one
    /// per segment holding allocations, of its size, less the cached ones of that size; and
    /// of which kind.
    pub(super) fn sleep_shortfall(&self, name: &str) -> Result<(SleepHost, Vec<usize>)> {
        let tag = self.regions[self.region_index(name)?].tag;
        let idle = self.map.idle_segments();
        let mut cached: Vec<usize> = match self.config.sleep_host {
            SleepHost::Pinned => self.pinned.free_sizes().collect(),
            SleepHost::Pageable => self.pageable.iter().map(Vec::len).collect(),
        };
        let mut missing = Vec::new();
        for segment in self.awake_segments(tag) {
            if idle.contains(&segment) {
                continue;
            }
            let size = self.map.segments[segment].size;
            match cached.iter().position(|&c| c == size) {
                Some(i) => {
                    cached.swap_remove(i);
                }
                None => missing.push(size),
            }
        }
        Ok((self.config.sleep_host, missing))
    }

    /// Keeps host buffers made ahead of a sleep for it.
    pub(super) fn adopt_sleep_buffers(&mut self, made: Vec<HostBytes>) {
        for bytes in made {
            self.recycle_saved(bytes);
        }
    }

    /// Keeps a sleeping segment's buffer for the next sleep.
    fn recycle_saved(&mut self, bytes: HostBytes) {
        match bytes {
            HostBytes::Pinned(_) => self.recycle_host(bytes),
            HostBytes::Pageable(v) => self.pageable.push(v),
        }
    }

    /// Whether a sleep engine should be started now: none yet, and no capture under way
    /// (starting one measures its paths on the device). Returns the kind of host buffers.
    pub(super) fn sleep_engine_wanted(&self) -> Result<Option<SleepHost>> {
        if self.sleep_engine.is_some() {
            return Ok(None);
        }
        if self.routing > 0 {
            return Err(Error::new(
                ErrorKind::InvalidState,
                "cannot sleep while a graph capture may be under way",
            ));
        }
        Ok(Some(self.config.sleep_host))
    }

    /// The pool's stream for sleep and wake copies, made on first use.
    fn sleep_stream(&mut self, device: &dyn crate::device::Device) -> Result<Stream> {
        if let Some(stream) = self.sleep_stream {
            return Ok(stream);
        }
        let stream = device
            .create_stream()
            .map_err(|e| e.context("creating the sleep stream"))?;
        self.sleep_stream = Some(stream);
        Ok(stream)
    }

    /// Wakes region `name`; see the module's documentation. Segments are mapped one after
    /// another while the copies of those mapped already run (pinned buffers: queued at once,
    /// on the sleep stream or through the engine's relays; pageable ones: one batch through
    /// the engine at the end).
    pub(super) fn wake(&mut self, device: &dyn crate::device::Device, name: &str) -> Result<()> {
        let index = self.region_index(name)?;
        if !self.regions[index].asleep {
            return Err(Error::new(
                ErrorKind::InvalidState,
                format!("region {name:?} is awake"),
            ));
        }
        // Stitched ranges freed while asleep go before their pieces' segments may.
        self.drop_freed_stitches(device, self.regions[index].tag);
        self.drop_freed_sleepers(device, index)?;
        let stream = self.sleep_stream(device)?;
        let mut waiting = std::mem::take(&mut self.regions[index].sleepers);
        let mut mapped: Vec<(Sleeper, Vec<blocks::Chunk>)> = Vec::new();
        let mut failure = None;
        // Sleepers from this index of `mapped` on had copies that could not all be queued:
        // their memory is not filled.
        let mut unfilled = None;
        // Copies of pinned buffers are queued as segments are mapped, gathered into batches
        // large enough for the engine's relays where there is an engine; pageable ones go
        // through the engine's lanes in one batch at the end.
        let queued_each =
            self.sleep_engine.is_none() || self.config.sleep_host == SleepHost::Pinned;
        let batch_bytes = self.copy_batch_bytes();
        let mut batch: Vec<CopyPiece> = Vec::new();
        let mut batch_first = 0;
        let started = Instant::now();
        let mut mapping = std::time::Duration::ZERO;
        let mut batched = 0;
        loop {
            let mut stop = true;
            if let Some(sleeper) = waiting.pop() {
                let map_started = Instant::now();
                let chunks = self.map_for_wake(device, &sleeper);
                mapping += map_started.elapsed();
                match chunks {
                    Ok(chunks) => {
                        if let (true, Some(saved)) = (queued_each, &sleeper.saved) {
                            batched += saved.bytes();
                            batch.extend(saved.pieces(sleeper.va));
                        }
                        mapped.push((sleeper, chunks));
                        stop = false;
                    }
                    Err(err) => {
                        waiting.push(sleeper);
                        failure = Some(err);
                    }
                }
            }
            let done = stop || waiting.is_empty();
            if !batch.is_empty() && (done || batched >= batch_bytes) {
                if let Err(err) = self.queue_copy(device, Direction::HostToDevice, &batch, stream) {
                    // Part of the batch may be queued: it waits with the others below, then
                    // the new memory of its sleepers goes.
                    unfilled = Some(batch_first);
                    failure.get_or_insert(err);
                    break;
                }
                batch.clear();
                batched = 0;
                batch_first = mapped.len();
            }
            if done {
                break;
            }
        }
        let copied = match &self.sleep_engine {
            Some(engine) if !queued_each => {
                let pieces: Vec<CopyPiece> = mapped
                    .iter()
                    .filter_map(|(s, _)| s.saved.as_ref().map(|saved| saved.pieces(s.va)))
                    .flatten()
                    .collect();
                // SAFETY: every piece lies inside a host buffer its sleeper keeps; a blocking
                // copy is done when it returns.
                unsafe {
                    engine.copy_pieces(
                        Direction::HostToDevice,
                        &pieces,
                        stream,
                        Completion::Blocking,
                    )
                }
            }
            _ => wait_for_copy(device, stream),
        };
        let bytes: usize = mapped
            .iter()
            .filter_map(|(s, _)| s.saved.as_ref())
            .map(Saved::bytes)
            .sum();
        // Where a wake's time goes (GLAKE_LOG=info): mapping runs while earlier copies do.
        log::info!(
            "glake: wake of region {:?}: {:.1} ms in all for {bytes} bytes ({:.1} GB/s), {:.1} ms \
             of it mapping {} segments",
            self.regions[index].name,
            started.elapsed().as_secs_f64() * 1e3,
            bytes as f64 / started.elapsed().as_secs_f64().max(1e-9) / 1e9,
            mapping.as_secs_f64() * 1e3,
            mapped.len(),
        );
        for (i, (sleeper, chunks)) in mapped.into_iter().enumerate() {
            if copied.is_err() {
                // Copies in only read the host buffers: the sleeper keeps its bytes. Copies
                // not waited for may still write into the new memory: it comes down only after
                // a later wait for the device.
                self.zombies.push(Zombie::mapped(sleeper.va, &chunks));
                waiting.push(sleeper);
            } else if unfilled.is_some_and(|first| i >= first) {
                self.bury(device, Zombie::mapped(sleeper.va, &chunks));
                waiting.push(sleeper);
            } else {
                self.complete_wake(sleeper, chunks);
            }
        }
        self.regions[index].sleepers = waiting;
        if let Err(err) = copied {
            return Err(err.context("copying a sleeping region back"));
        }
        if let Some(err) = failure {
            return Err(err.context("waking a region"));
        }
        let tag = self.regions[index].tag;
        self.wake_stitches(device, tag)
            .map_err(|err| err.context("waking a region"))?;
        self.regions[index].asleep = false;
        Ok(())
    }

    /// Bytes of copies queued at once: batches large enough for the engine's relays where
    /// there is an engine; else every segment on its own (0).
    fn copy_batch_bytes(&self) -> usize {
        if self.sleep_engine.is_some() {
            COPY_BATCH_BYTES
        } else {
            0
        }
    }

    /// Queues a sleep's or a wake's copies of `pieces` (inside pinned buffers the pool keeps
    /// until the copies are waited for) on `stream`: through the copy engine where the pool
    /// has one (relays through peers), else the driver's calls.
    fn queue_copy(
        &self,
        device: &dyn crate::device::Device,
        direction: Direction,
        pieces: &[CopyPiece],
        stream: Stream,
    ) -> Result<()> {
        match &self.sleep_engine {
            // SAFETY: page-locked buffers that stay unchanged until the stream is waited for.
            Some(engine) => unsafe {
                engine.copy_pieces(direction, pieces, stream, Completion::StreamOrdered)
            },
            None => queue_pinned(device, direction, pieces, stream),
        }
    }

    /// A sleeping segment's memory is mapped and filled: resident from here.
    fn complete_wake(&mut self, sleeper: Sleeper, chunks: Vec<blocks::Chunk>) {
        self.remap_segment(sleeper.segment, chunks);
        if let Some(saved) = sleeper.saved {
            self.recycle_saved(saved.buf);
        }
    }

    /// Forgets sleepers whose segment no longer holds allocations (freed while asleep): an
    /// idle one is released now; one released already (by `empty_cache`) is gone.
    fn drop_freed_sleepers(
        &mut self,
        device: &dyn crate::device::Device,
        index: usize,
    ) -> Result<()> {
        let tag = self.regions[index].tag;
        let idle = self.map.idle_segments();
        let mut kept = Vec::new();
        for sleeper in std::mem::take(&mut self.regions[index].sleepers) {
            let alive = self
                .map
                .segments
                .get(sleeper.segment)
                .is_some_and(|s| s.tag == tag && s.va == sleeper.va && s.chunks().is_empty());
            if alive && !idle.contains(&sleeper.segment) {
                kept.push(sleeper);
                continue;
            }
            if alive {
                self.release_segment(device, sleeper.segment)?;
            }
            if let Some(saved) = sleeper.saved {
                self.recycle_saved(saved.buf);
            }
        }
        self.regions[index].sleepers = kept;
        Ok(())
    }

    /// New physical memory for a sleeping segment, mapped at its range with the pool's access,
    /// laid out as a region's new segments are.
    fn map_for_wake(
        &mut self,
        device: &dyn crate::device::Device,
        sleeper: &Sleeper,
    ) -> Result<Vec<blocks::Chunk>> {
        let layout = blocks::region_chunks(sleeper.size);
        self.map_new_memory(device, sleeper.va, sleeper.size, &layout)
    }

    /// What region `name` holds now.
    pub(super) fn region_info(&self, name: &str) -> Result<RegionInfo> {
        let region = &self.regions[self.region_index(name)?];
        let mut info = RegionInfo {
            asleep: region.asleep,
            ..RegionInfo::default()
        };
        for (_, s) in self
            .map
            .segments
            .iter()
            .filter(|(_, s)| s.tag == region.tag)
        {
            info.segments += 1;
            if s.chunks().is_empty() {
                info.asleep_bytes += s.size;
            } else {
                info.resident_bytes += s.size;
            }
        }
        info.allocated_bytes = self
            .live
            .values()
            .filter(|l| match l.target {
                super::Target::Block(b) => {
                    self.map.segments[self.map.blocks[b].segment].tag == region.tag
                }
                super::Target::Stitched(id) => self.stitch_tag(id) == Some(region.tag),
            })
            .map(|l| l.size)
            .sum();
        info.host_bytes = region
            .sleepers
            .iter()
            .filter_map(|s| s.saved.as_ref().map(|saved| saved.buf.len()))
            .sum();
        Ok(info)
    }

    /// The names of the pool's regions, in the order they were made.
    pub(super) fn region_names(&self) -> Vec<String> {
        self.regions.iter().map(|r| r.name.clone()).collect()
    }

    /// Gives the sleeping regions' host buffers to the pinned cache (the pool is going; their
    /// segments go with the rest) and the sleep stream back.
    pub(super) fn settle_regions(&mut self, device: &dyn crate::device::Device) {
        for index in 0..self.regions.len() {
            for sleeper in std::mem::take(&mut self.regions[index].sleepers) {
                if let Some(saved) = sleeper.saved {
                    self.recycle_saved(saved.buf);
                }
            }
        }
        if let Some(stream) = self.sleep_stream.take() {
            if let Err(err) = device.destroy_stream(stream) {
                log::warn!("glake: destroying the sleep stream failed: {err}");
            }
        }
    }

    /// Region segments' invariants: a segment without chunks is a swapped-out swappable
    /// allocation or a sleeper of its region, and every sleeper names such a segment.
    pub(super) fn check_regions(&self) -> std::result::Result<(), String> {
        for region in &self.regions {
            for sleeper in &region.sleepers {
                let Some(s) = self.map.segments.get(sleeper.segment) else {
                    continue; // released while asleep; forgotten at wake
                };
                if s.va == sleeper.va && s.tag == region.tag && !s.chunks().is_empty() {
                    return Err(format!(
                        "region {:?}: sleeping segment at {:#x} holds memory",
                        region.name, s.va
                    ));
                }
            }
            if !region.asleep && !region.sleepers.is_empty() {
                return Err(format!("region {:?} is awake with sleepers", region.name));
            }
        }
        for (id, s) in self.stitch.blocks.iter() {
            let region = self
                .stitch_tag(id)
                .and_then(|tag| self.regions.iter().find(|r| r.tag == tag));
            if s.asleep && !region.is_some_and(|r| r.asleep) {
                return Err(format!(
                    "stitched range at {:#x} sleeps outside a sleeping region",
                    s.va
                ));
            }
            // A region's range in use maps only allocated memory of its region: a piece's
            // segment given back under it could not be mapped again by a wake.
            if let (Some(region), true) = (region, s.in_use) {
                for piece in &s.pieces {
                    let segment = self
                        .map
                        .block_containing(piece.addr)
                        .map(|b| &self.map.segments[self.map.blocks[b].segment]);
                    let held = segment.is_some_and(|g| {
                        g.tag == region.tag && (s.asleep || !g.chunks().is_empty())
                    });
                    if !held {
                        return Err(format!(
                            "stitched range at {:#x} of region {:?} maps a piece at {:#x} outside its awake segments",
                            s.va, region.name, piece.addr
                        ));
                    }
                }
            }
        }
        for (id, s) in self.map.segments.iter() {
            if !blocks::is_region(s.tag) || !s.chunks().is_empty() {
                continue;
            }
            let known = self
                .regions
                .iter()
                .any(|r| r.tag == s.tag && r.sleepers.iter().any(|z| z.segment == id));
            if !known {
                return Err(format!(
                    "region segment at {:#x} has no memory and no sleeper",
                    s.va
                ));
            }
        }
        Ok(())
    }
}

/// Starts the copy engine that sleep and wake copies go through (made by the caller without
/// the pool's lock: it opens peers, pins staging and measures paths): always for pageable host
/// buffers (the engine's lanes stage them), and for pinned ones where a peer GPU reaches this
/// one and has its own host link (`GLAKE_COPY_PEERS`), so that the copies also run over the
/// peer's link. None for pinned buffers otherwise: the driver's own calls on one link are as
/// fast, and they need no device memory, which may be short when a region is put to sleep.
pub(super) fn start_sleep_engine(
    device: &SharedDevice,
    sleep_host: SleepHost,
) -> Result<Option<Engine>> {
    let mut config = crate::config::TransferConfig::from_env();
    let peers = sleep_relays(device, config.max_peers);
    if sleep_host == SleepHost::Pinned {
        if peers.is_empty() {
            return Ok(None);
        }
        // Pinned copies use the first lane of each path: no staging to fill.
        config.lanes = 1;
        config.relay_lanes = 1;
    }
    match Engine::new(device.clone(), peers, config) {
        Ok(engine) => Ok(Some(engine)),
        Err(err) if sleep_host == SleepHost::Pinned => {
            log::warn!("glake: no copy engine for sleep ({err}); copies use one link");
            Ok(None)
        }
        Err(err) => Err(err.context("starting the copy engine for sleep")),
    }
}

/// The peer devices sleep copies may relay through: those `device` reaches, at most `most`.
/// A host-backend peer is opened with the target's device count, so tests of a pretended
/// multi-device host see their peers.
fn sleep_relays(device: &SharedDevice, most: usize) -> Vec<SharedDevice> {
    if most == 0 || device.device_count().map_or(true, |n| n < 2) {
        return Vec::new();
    }
    let mut options = crate::config::host_options_from_env();
    options.device_count = options.device_count.max(device.device_count().unwrap_or(1));
    crate::device::open_peers(device, most, options)
}

/// Queues the copies of `pieces` (inside pinned buffers of the pool's, which stay the pool's
/// until the copies are known done) on `stream`; stops at the first that cannot be queued.
fn queue_pinned(
    device: &dyn crate::device::Device,
    direction: Direction,
    pieces: &[CopyPiece],
    stream: Stream,
) -> Result<()> {
    for piece in pieces {
        // SAFETY: per this function's contract.
        unsafe {
            match direction {
                Direction::DeviceToHost => {
                    device.copy_to_host(piece.host as *mut u8, piece.device, piece.len, stream)
                }
                Direction::HostToDevice => {
                    device.copy_to_device(piece.device, piece.host as *const u8, piece.len, stream)
                }
            }
        }?;
    }
    Ok(())
}

/// Host memory for a sleeping segment of `len` bytes made ahead of the sleep, outside the
/// pool's lock: a pinned buffer, or ordinary memory with every page faulted in already.
pub(super) fn host_bytes_ahead(
    device: &dyn crate::device::Device,
    kind: SleepHost,
    len: usize,
) -> Result<HostBytes> {
    match kind {
        SleepHost::Pinned => {
            let ptr = device
                .alloc_pinned(len)
                .map_err(|e| e.context("pinning host memory ahead of a sleep"))?;
            Ok(HostBytes::Pinned(PinnedBuf::from_pinned(ptr, len)))
        }
        SleepHost::Pageable => {
            let mut bytes = zeroed(len)?;
            // A write per page faults it in now rather than during the sleep's copies.
            for page in bytes.chunks_mut(4096) {
                page[0] = 0;
                std::hint::black_box(&page[0]);
            }
            Ok(HostBytes::Pageable(bytes))
        }
    }
}

/// `len` zeroed bytes of ordinary memory: fresh pages from the system, so nothing is written
/// before the copy does (a large zeroed allocation is untouched mapped memory).
fn zeroed(len: usize) -> Result<Vec<u8>> {
    let no_memory = || Error::out_of_memory(format!("no host memory for {len} sleeping bytes"));
    if len == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(len).map_err(|_| no_memory())?;
    // SAFETY: a layout of nonzero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(no_memory());
    }
    // SAFETY: allocated by the global allocator with this layout, and every byte initialised
    // (zeroed).
    Ok(unsafe { Vec::from_raw_parts(ptr, len, len) })
}
