//! The pool's side of cross-process deduplication (see [`crate::dedup`]): marking a live
//! allocation's memory read-only, and putting memory of other processes in its place.
//!
//! Only whole physical handles inside the marked range are shared (CUDA maps whole handles).
//! Runs of neighbouring handles become one shared handle each, so an importer maps few. Each
//! run is hashed; an offer of another process with the same hash is imported, compared byte by
//! byte and, when equal, mapped read-only at the run's addresses, the run's own memory
//! released. Without one, the run moves into shareable memory of its own (a device copy) and is
//! offered to the others. Either way the run's addresses stay the same.
//!
//! The segment holding a shared run leaves the shared pool for [`READ_ONLY`]: its free blocks
//! are never handed out again (a write would reach the other processes' bytes), and it goes
//! back to the device once wholly free.

use super::blocks::{is_region, Chunk, SegmentId, READ_ONLY, SHARED};
use super::growth::Zombie;
use super::{Inner, Target};
use crate::dedup::content::Reader;
use crate::dedup::Sharing;
use crate::device::{Device, DevicePtr, PhysHandle, Stream};
use crate::error::{Error, ErrorKind, Result};
use std::time::{Duration, Instant};

/// Largest run made into one shared handle: larger runs cost more transient memory when
/// moved into shareable memory, smaller ones more mappings for each importer.
const MAX_RUN: usize = 1 << 30;

/// What marking memory read-only did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShareReport {
    /// Bytes now mapped from another process's memory, their own memory released.
    pub shared_bytes: u64,
    /// Bytes moved into shareable memory and offered to other processes.
    pub offered_bytes: u64,
    /// Bytes of the range left as they were: parts of handles the range does not cover
    /// whole, or handles shared already.
    pub kept_bytes: u64,
}

/// A handle of this pool that other processes may map, or that maps another's memory.
#[derive(Debug, Clone, Copy)]
pub(super) struct SharedHandle {
    len: usize,
    /// Its number in this process's offers.
    export: u64,
    /// Memory of another process (not counted against this pool's cap).
    imported: bool,
}

/// A run of `count` whole chunks of one segment, the first `offset` bytes into it, at `va`.
/// (Chunk indexes shift as earlier runs of the segment become one chunk each.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Run {
    segment: SegmentId,
    offset: usize,
    count: usize,
    va: DevicePtr,
    len: usize,
}

impl Inner {
    /// Marks each of `ranges` (address, length), each inside one live allocation, read-only
    /// from now on and shares their whole handles with other processes holding the same bytes.
    /// A range of memory that cannot be shared (stitched, swappable, guarded, private pools)
    /// is kept as it is; a range outside any allocation fails the call before anything
    /// changes. Waits for the device; no work may use the ranges while the call runs.
    pub(super) fn share_read_only(
        &mut self,
        device: &dyn Device,
        ranges: &[(DevicePtr, usize)],
    ) -> Result<ShareReport> {
        if self.routing > 0 {
            return Err(Error::new(
                ErrorKind::InvalidState,
                "memory cannot be shared while a graph capture may be underway",
            ));
        }
        let segments = ranges
            .iter()
            .map(|&(ptr, len)| match self.shareable_segment(ptr, len) {
                Ok(segment) => Ok(Some(segment)),
                Err(err) if err.kind() == ErrorKind::Unsupported => {
                    log::info!("glake: dedup: {ptr:#x}+{len} kept: {err}");
                    Ok(None)
                }
                Err(err) => Err(err),
            })
            .collect::<Result<Vec<_>>>()?;
        self.synchronize_all(device)?;
        if self.sharing.is_none() {
            let identity = device.identity()?;
            let sharing = Sharing::open(self.config.dedup_dir.as_deref(), &identity)?;
            self.sharing = Some(std::sync::Arc::new(sharing));
        }
        let mut report = ShareReport::default();
        let mut runs = Vec::new();
        for (&(ptr, len), segment) in ranges.iter().zip(segments) {
            let found = segment.map_or_else(Vec::new, |s| self.runs(s, ptr, len));
            let covered: usize = found.iter().map(|r| r.len).sum();
            report.kept_bytes += (len - covered) as u64;
            runs.extend(found);
        }
        // Ranges given twice or overlapping make overlapping runs: the first of each is done.
        runs.sort_unstable();
        let mut end = (usize::MAX, 0);
        runs.retain(|r| {
            let overlaps = end.0 == r.segment && r.offset < end.1;
            if !overlaps {
                end = (r.segment, r.offset + r.len);
            }
            !overlaps
        });
        // Cached stitched ranges may map these handles too: they go first.
        if runs.iter().any(|r| self.stitched_over(r.va, r.len)) {
            self.collect_stitched(device, true)?;
        }
        let stream = device.create_stream()?;
        let result = self.share_runs(device, stream, runs, &mut report);
        if let Err(err) = device.destroy_stream(stream) {
            log::warn!("glake: dedup stream not destroyed: {err}");
        }
        result.map(|()| report)
    }

    /// The segment of the live allocation holding `[ptr, ptr+len)`, if its memory may be
    /// shared.
    fn shareable_segment(&self, ptr: DevicePtr, len: usize) -> Result<SegmentId> {
        let base = self.base_of(ptr).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidPointer,
                format!("{ptr:#x} is not in an allocation of this pool"),
            )
        })?;
        let live = self
            .live
            .get(&base)
            .ok_or_else(|| Error::internal("an allocation without its record"))?;
        let end = ptr.checked_add(len as u64);
        if len == 0 || end.is_none_or(|end| end > base + live.size as u64) {
            return Err(Error::invalid_argument(format!(
                "{ptr:#x}+{len} is empty or leaves the allocation at {base:#x} ({} bytes)",
                live.size
            )));
        }
        let refuse = |what: &str| {
            Err(Error::new(
                ErrorKind::Unsupported,
                format!("memory of {what} is not shared between processes"),
            ))
        };
        let Target::Block(block) = live.target else {
            return refuse("a stitched allocation");
        };
        if self.swappable.contains_key(&base) {
            return refuse("a swappable allocation");
        }
        let segment = self.map.blocks[block].segment;
        let tag = self.map.segments[segment].tag;
        if is_region(tag) {
            // Its segments sleep and wake as one; a read-only one could do neither.
            return refuse("a sleep region");
        }
        if tag != SHARED && tag != READ_ONLY {
            return refuse("a private or guarded pool");
        }
        Ok(segment)
    }

    /// The runs of whole chunks of `segment` inside `[ptr, ptr+len)` not shared already.
    fn runs(&self, segment: SegmentId, ptr: DevicePtr, len: usize) -> Vec<Run> {
        let s = &self.map.segments[segment];
        let mut runs: Vec<Run> = Vec::new();
        let Some((start, whole)) = s.whole_chunks(ptr, len) else {
            return runs;
        };
        for chunk in s.chunks_covering(start, whole) {
            if self.shared.contains_key(&chunk.handle) {
                continue;
            }
            match runs.last_mut() {
                Some(run)
                    if run.offset + run.len == chunk.offset && run.len + chunk.len <= MAX_RUN =>
                {
                    run.count += 1;
                    run.len += chunk.len;
                }
                _ => runs.push(Run {
                    segment,
                    offset: chunk.offset,
                    count: 1,
                    va: s.va + chunk.offset as u64,
                    len: chunk.len,
                }),
            }
        }
        runs
    }

    fn share_runs(
        &mut self,
        device: &dyn Device,
        stream: Stream,
        runs: Vec<Run>,
        report: &mut ShareReport,
    ) -> Result<()> {
        let mut reader = Reader::new(device, stream, self.config.dedup_weak_hash)?;
        let mut phases = Phases::default();
        let book = self.sharing_ref()?.offer_book()?;
        let mut served = Vec::new();
        // Processes that failed to answer are not asked again in this call (each try may wait
        // seconds while the pool's lock is held).
        let mut failed = std::collections::HashSet::new();
        let result = (|| {
            for run in &runs {
                let hash = phases.time(|p| &mut p.hash, || reader.hash(run.va, run.len))?;
                let mut offers = book
                    .get(&(hash, run.len as u64))
                    .cloned()
                    .unwrap_or_default();
                if offers.is_empty() {
                    // A process starting at the same time may have offered since the book was
                    // read: look again before copying.
                    offers = self.sharing_ref()?.offers_now(hash, run.len)?;
                }
                offers.retain(|o| !failed.contains(&o.owner));
                let found = self.matching_offer(
                    device,
                    &mut reader,
                    run,
                    offers,
                    &mut phases,
                    &mut failed,
                )?;
                if let Some((handle, fd, origin)) = found {
                    phases.time(|p| &mut p.map, || self.put_in_place(device, run, handle))?;
                    // This process serves the memory too, so later importers still find it
                    // after its first owner is gone.
                    let export = self.serve(hash, run.len, fd, Some(origin), &mut served);
                    self.shared_bytes += run.len;
                    report.shared_bytes += run.len as u64;
                    self.note_shared(handle, run.len, export, true);
                    continue;
                }
                if !self.fits_cap(run.len) {
                    report.kept_bytes += run.len as u64;
                    continue;
                }
                let handle =
                    phases.time(|p| &mut p.copy, || self.shareable_copy(device, stream, run))?;
                phases.time(|p| &mut p.map, || self.put_in_place(device, run, handle))?;
                report.offered_bytes += run.len as u64;
                let export = device
                    .export_handle(handle)
                    .and_then(|fd| self.serve(hash, run.len, fd, None, &mut served));
                self.note_shared(handle, run.len, export, false);
            }
            Ok(())
        })();
        let published = phases.time(|p| &mut p.publish, || self.sharing_ref()?.publish(&served));
        if published.is_err() {
            // Those offers stopped: nothing of them is offered any more.
            for shared in self.shared.values_mut() {
                if served.iter().any(|r| r.export == shared.export) {
                    shared.export = 0;
                }
            }
        }
        log::info!(
            "glake: dedup of {} runs ({} bytes): {phases}",
            runs.len(),
            runs.iter().map(|r| r.len).sum::<usize>()
        );
        result.and(published)
    }

    /// Serves `fd`, keeping its record for the index.
    fn serve(
        &self,
        hash: u128,
        len: usize,
        fd: std::os::fd::OwnedFd,
        origin: Option<u64>,
        served: &mut Vec<crate::dedup::index::Record>,
    ) -> Result<u64> {
        let record = self.sharing_ref()?.serve(hash, len, fd, origin)?;
        served.push(record);
        Ok(record.export)
    }

    fn sharing_ref(&self) -> Result<&Sharing> {
        self.sharing
            .as_deref()
            .ok_or_else(|| Error::internal("dedup used before its index was opened"))
    }

    /// Books `handle` as shared; a failed offer only means other processes cannot get it.
    fn note_shared(&mut self, handle: PhysHandle, len: usize, export: Result<u64>, imported: bool) {
        let export = match export {
            Ok(export) => export,
            Err(err) => {
                log::warn!("glake: dedup: memory not offered to other processes: {err}");
                0
            }
        };
        self.shared.insert(
            handle,
            SharedHandle {
                len,
                export,
                imported,
            },
        );
    }

    /// Another process's memory with the bytes of `run`, imported and checked equal byte by
    /// byte, with its descriptor and the origin of the offer.
    fn matching_offer(
        &mut self,
        device: &dyn Device,
        reader: &mut Reader<'_>,
        run: &Run,
        offers: Vec<crate::dedup::index::Record>,
        phases: &mut Phases,
        failed: &mut std::collections::HashSet<u64>,
    ) -> Result<Option<(PhysHandle, std::os::fd::OwnedFd, u64)>> {
        for offer in offers {
            if failed.contains(&offer.owner) {
                continue;
            }
            let started = Instant::now();
            let fetched = self.sharing_ref()?.fetch(&offer);
            phases.find += started.elapsed();
            let fd = match fetched {
                Ok(Some(fd)) => fd,
                Ok(None) => continue,
                Err(err) => {
                    log::info!(
                        "glake: dedup: process {:x} is not asked again: {err}",
                        offer.owner
                    );
                    failed.insert(offer.owner);
                    continue;
                }
            };
            let handle = match device.import_handle(std::os::fd::AsFd::as_fd(&fd), run.len) {
                Ok(handle) => handle,
                Err(err) => {
                    log::info!(
                        "glake: dedup: offer of process {:x} skipped: {err}",
                        offer.owner
                    );
                    continue;
                }
            };
            let started = Instant::now();
            let same = self.same_bytes(device, reader, handle, run);
            phases.compare += started.elapsed();
            match same {
                Ok(true) => return Ok(Some((handle, fd, offer.origin))),
                Ok(false) => log::info!(
                    "glake: dedup: {} bytes of process {:x} hash alike but differ",
                    run.len,
                    offer.owner
                ),
                Err(err) => log::info!("glake: dedup: compare failed: {err}"),
            }
            if let Err(err) = device.release_physical(handle) {
                self.bury(device, Zombie::handles(&[chunk_of(handle, 0, run.len)]));
                log::warn!("glake: dedup: {err}");
            }
        }
        Ok(None)
    }

    /// Whether `handle`, mapped read-only in a range of its own for the check, holds the bytes
    /// of `run`.
    fn same_bytes(
        &mut self,
        device: &dyn Device,
        reader: &mut Reader<'_>,
        handle: PhysHandle,
        run: &Run,
    ) -> Result<bool> {
        self.with_scratch_mapping(device, handle, run.len, true, |va| {
            match device.equal_bytes(va, run.va, run.len, reader.stream()) {
                // Without a device comparison, both are read through the host.
                Err(err) if err.kind() == ErrorKind::Unsupported => {
                    reader.equal(va, run.va, run.len)
                }
                other => other,
            }
        })
    }

    /// Runs `work` with `handle` (`len` bytes) mapped in a range of its own, read-only or
    /// not; the range is torn down afterwards (what fails to come down is retried later).
    fn with_scratch_mapping<T>(
        &mut self,
        device: &dyn Device,
        handle: PhysHandle,
        len: usize,
        read_only: bool,
        work: impl FnOnce(DevicePtr) -> Result<T>,
    ) -> Result<T> {
        let va = device.reserve(len, self.granularity)?;
        let mut scratch = Zombie {
            unmaps: Vec::new(),
            handles: Vec::new(),
            reservation: Some((va, len)),
        };
        let mapped = device.map(va, len, handle, 0);
        if mapped.is_ok() {
            scratch.unmaps.push((va, len));
        }
        let me = [device.ordinal()];
        let out = mapped
            .and_then(|()| {
                if read_only {
                    device.set_access_read_only(va, len, &me)
                } else {
                    device.set_access(va, len, &me)
                }
            })
            .and_then(|()| work(va));
        // After a failure, copies from or into the range may still be queued: it comes down
        // only once the device is known idle, else later with the other leftovers.
        if out.is_ok() || device.synchronize_device().is_ok() {
            self.bury(device, scratch);
        } else {
            self.zombies.push(scratch);
        }
        out
    }

    /// New shareable memory holding a copy of `run`'s bytes.
    fn shareable_copy(
        &mut self,
        device: &dyn Device,
        stream: Stream,
        run: &Run,
    ) -> Result<PhysHandle> {
        let handle = device.create_shareable(run.len)?;
        let copied = self.with_scratch_mapping(device, handle, run.len, false, |va| {
            device
                .copy_device(va, run.va, run.len, stream)
                .and_then(|()| device.synchronize_stream(stream))
        });
        if let Err(err) = copied {
            if device.release_physical(handle).is_err() {
                self.bury(device, Zombie::handles(&[chunk_of(handle, 0, run.len)]));
            }
            return Err(err);
        }
        Ok(handle)
    }

    /// Maps `handle` read-only at `run`'s addresses in place of its chunks, which are
    /// released. On failure the chunks are mapped back and `handle` released: nothing changed.
    fn put_in_place(&mut self, device: &dyn Device, run: &Run, handle: PhysHandle) -> Result<()> {
        let segment = &self.map.segments[run.segment];
        let first = segment
            .chunks()
            .iter()
            .position(|c| c.offset == run.offset)
            .ok_or_else(|| Error::internal("a run's first chunk is gone"))?;
        let span = first..first + run.count;
        let old: Vec<Chunk> = segment.chunks()[span.clone()].to_vec();
        let segment_va = segment.va;
        let swapped = (|| {
            for (i, c) in old.iter().enumerate() {
                if let Err(err) = device.unmap(segment_va + c.offset as u64, c.len) {
                    return Err((err, i));
                }
            }
            device
                .map(run.va, run.len, handle, 0)
                .and_then(|()| {
                    device
                        .set_access_read_only(run.va, run.len, &self.access)
                        .or_else(|err| twice(|| device.unmap(run.va, run.len)).and(Err(err)))
                })
                .map_err(|err| (err, old.len()))
        })();
        if let Err((err, unmapped)) = swapped {
            // Back as it was: the old chunks mapped and granted again. Each step of the undo
            // gets a second try: giving up leaves the allocation without memory.
            let restore = old[..unmapped].iter().try_for_each(|c| {
                let va = segment_va + c.offset as u64;
                twice(|| device.map(va, c.len, c.handle, 0))?;
                twice(|| device.set_access(va, c.len, &self.access))
            });
            if let Err(again) = restore {
                log::error!("glake: dedup: restoring {:#x} failed: {again}", run.va);
            }
            if device.release_physical(handle).is_err() {
                self.bury(device, Zombie::handles(&[chunk_of(handle, 0, run.len)]));
            }
            return Err(err);
        }
        self.bury(device, Zombie::handles(&old));
        let segment = &mut self.map.segments[run.segment];
        let mut chunks = segment.chunks().to_vec();
        chunks.splice(span, [chunk_of(handle, run.offset, run.len)]);
        segment.set_chunks(chunks);
        // No request may be served from this segment's free memory again.
        self.map.retag_segment(run.segment, READ_ONLY);
        self.recheck_parkable(run.segment);
        self.stats.num_device_free += old.len() as i64;
        // Imported handles count too: releasing them later counts a free.
        self.stats.num_device_alloc += 1;
        Ok(())
    }

    /// Forgets `chunks` leaving the pool: shared ones stop being offered.
    pub(super) fn forget_shared(&mut self, chunks: &[Chunk]) {
        if self.shared.is_empty() {
            return;
        }
        for chunk in chunks {
            let Some(shared) = self.shared.remove(&chunk.handle) else {
                continue;
            };
            if shared.imported {
                self.shared_bytes -= shared.len;
            }
            if let (Some(sharing), true) = (&self.sharing, shared.export != 0) {
                sharing.withdraw(shared.export);
            }
        }
    }

    /// Fills this pool's dedup statistics (bytes it maps from other processes' memory, bytes
    /// it offers) into `stats`, taken under the same lock; returns the index for the
    /// device-wide figures, which are read without it.
    pub(super) fn dedup_stats(
        &self,
        stats: &mut crate::stats::MemoryStats,
    ) -> Option<std::sync::Arc<Sharing>> {
        let offered: usize = self
            .shared
            .values()
            .filter(|s| !s.imported)
            .map(|s| s.len)
            .sum();
        stats.shared_bytes = self.shared_bytes as i64;
        stats.offered_bytes = offered as i64;
        self.sharing.clone()
    }
}

/// Where a share call spent its time (logged at info level).
#[derive(Debug, Default)]
struct Phases {
    hash: Duration,
    find: Duration,
    compare: Duration,
    copy: Duration,
    map: Duration,
    publish: Duration,
}

impl Phases {
    fn time<T>(&mut self, phase: fn(&mut Self) -> &mut Duration, f: impl FnOnce() -> T) -> T {
        let started = Instant::now();
        let out = f();
        *phase(self) += started.elapsed();
        out
    }
}

impl std::fmt::Display for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = |d: Duration| d.as_secs_f64();
        write!(
            f,
            "hash {:.3} s, fetch {:.3} s, compare {:.3} s, copy {:.3} s, map {:.3} s, publish {:.3} s",
            s(self.hash),
            s(self.find),
            s(self.compare),
            s(self.copy),
            s(self.map),
            s(self.publish)
        )
    }
}

fn chunk_of(handle: PhysHandle, offset: usize, len: usize) -> Chunk {
    Chunk {
        handle,
        offset,
        len,
    }
}

/// Runs a step of an undo, and once more if it fails.
fn twice(mut step: impl FnMut() -> Result<()>) -> Result<()> {
    step().or_else(|_| step())
}
