//! The caching allocator of one device.
//!
//! Every request is rounded to 512 bytes and carved out of a segment's blocks at that unit, so
//! no request pays for the mapping granularity. Order of attempts for a large request: a block
//! of exactly its size freed on the stream and kept whole (`parked`) -> best-fit free block of
//! the stream (split if larger) -> a cached stitched block within `reuse_limit`
//! -> stitch free blocks of the stream, creating only the missing bytes (defrag level 0) ->
//! create new physical memory (whole granules; the rest of the last stays free) -> take back
//! other streams' free memory and retry -> free cached memory and retry -> out of memory.
//! Small requests (up to `small_limit`) come from 2 MiB segments and are never stitched.
//!
//! Private pools (PyTorch's graph pools) hold the memory of CUDA graph captures: requests routed
//! to one are served only from its own segments, and its memory, free or not, is neither
//! stitched, released nor handed to other requests until the pool is released; then it joins
//! the shared pool at the next wait for the whole device (a replay queued before the release
//! may still use it). While any routing is active (a capture may be underway) the allocator never
//! waits for the device, unmaps or releases, and defers event records of frees.
//!
//! Reuse is stream-ordered: a block freed on stream S is reusable at once on S; other streams
//! get it only after the allocator has seen S's work complete. Blocks used on extra streams
//! (`record_stream`) wait for events recorded on those streams at free time. Nothing is unmapped
//! or released before the streams that may touch it are synchronised.
//!
//! The engine is split by concern: `sizes` (size classes), `alloc` (the order of attempts),
//! `parked` (the fast path: freed blocks kept for the next request of their size),
//! `streams` (frees and stream-ordered reuse), `private` (graph pools and capture safety),
//! `growth` (creating, mapping and releasing physical memory), `unlocked` (new segments and
//! stitches made outside the lock), `stitching` (the pool's side of stitching) and `inspect`
//! (pointer lookups, errors, snapshots, invariants), with the bookkeeping in [`blocks`] and its
//! free-block indexes in `bins`, the memory cap in [`cap`], snapshots in [`snapshot`] and the
//! record of segments created and released in [`events`].

pub mod blocks;
pub mod cap;
pub mod events;
pub mod snapshot;

mod alloc;
mod bins;
mod dedup;
pub use dedup::ShareReport;
mod gather;
mod growth;
mod guard;
mod inspect;
mod keymap;
mod observe;
pub use observe::{AllocationEvent, AllocationObserver, SwapPlacement};
mod outside;
mod parked;
mod private;
mod sizes;
mod sleep;
pub use sleep::{RegionInfo, SleepMode, MAX_REGION_NAME};
mod stitching;
mod streams;
mod swap_async;
mod swapping;
mod unlocked;

/// A pool with default settings on a host device, for the unit tests of the pool's modules.
#[cfg(test)]
fn host_pool() -> Pool {
    let device = crate::device::host::HostDevice::shared(0, Default::default()).unwrap();
    Pool::new(device, Config::default()).unwrap()
}

use std::sync::Mutex;

use crate::config::Config;
use crate::device::{DevicePtr, Event, SharedDevice, Stream};
use crate::error::{Error, ErrorKind, Result};
use crate::stats::MemoryStats;
use crate::stitch::{StitchCache, StitchId};
use crate::sync::lock;
use blocks::{BlockId, BlockMap, PoolKind, Tag, SHARED};
use cap::MemoryCap;
use growth::Zombie;
use keymap::KeyMap;
use private::PrivatePool;
use stitching::StitchBlocks;
use streams::PendingFree;
use swapping::Swappable;

pub use private::PrivatePoolId;
pub use sizes::MIN_BLOCK;

/// What a live allocation maps: one block, or a stitched range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Block(BlockId),
    Stitched(StitchId),
}

/// A live allocation.
#[derive(Debug, Clone)]
struct Live {
    target: Target,
    size: usize,
    requested: usize,
    stream: Stream,
    pool: PoolKind,
    extra_streams: Vec<Stream>,
    /// A plain block of a shared-pool segment of its own pool: parked when freed on its
    /// stream alone (see `parked`). Decided when booked, while its block is at hand, so that
    /// the free reads neither the block nor its segment.
    parkable: bool,
}

/// The allocator's state, behind the pool's lock. Its methods live in the files of this
/// module, one concern each.
struct Inner {
    config: Config,
    granularity: usize,
    total_memory: usize,
    cap: MemoryCap,
    map: BlockMap,
    stitch: StitchCache,
    stitch_blocks: StitchBlocks,
    /// Stitches that grew an idle stitched range in place (see `stitching::Growth`).
    stitch_growths: u64,
    live: KeyMap<DevicePtr, Live>,
    pending: Vec<PendingFree>,
    stats: MemoryStats,
    idle_events: Vec<Event>,
    zombies: Vec<Zombie>,
    access: Vec<i32>,
    private: KeyMap<PrivatePoolId, PrivatePool>,
    next_tag: Tag,
    /// Routings to private pools begun and not ended: while nonzero a capture may be underway.
    routing: u32,
    /// Frees that need stream events, held back while a capture may be underway.
    deferred: Vec<Live>,
    /// Guarded allocations freed while a routing was active, freed when the last one ends.
    deferred_guarded: Vec<DevicePtr>,
    /// Swappable allocations by address (each alone in its segment), and their host copies
    /// while swapped out.
    swappable: KeyMap<DevicePtr, Swappable>,
    /// Bytes made by pools' own allocators outside this pool, bounded by its cap too.
    outside: usize,
    /// Told of every allocation and free (SmartSwap's profiler).
    observer: Option<observe::AllocationObserver>,
    /// Asked whether a shared-pool allocation should be swappable (SmartSwap's executor).
    placement: Option<observe::SwapPlacement>,
    /// Reserved bytes past which cached memory is given back before more is created.
    soft_limit: Option<usize>,
    /// Pinned host buffers of the stream-ordered swaps and of sleeping regions.
    pinned: swap_async::PinnedCache,
    /// This pool's number, unique in the process: threads name the regions they allocate in
    /// by pool number.
    id: u64,
    /// Sleep regions, in the order they were made.
    regions: Vec<sleep::Region>,
    /// The region of allocations made outside any other (`Config::default_region`).
    default_region: Option<Tag>,
    /// The stream of sleep and wake copies, made on first use.
    sleep_stream: Option<Stream>,
    /// The copy engine of pageable sleep buffers (`SleepHost::Pageable`), made on first use.
    sleep_engine: Option<crate::transfer::Engine>,
    /// Pageable buffers of woken regions, kept for the next sleep.
    pageable: Vec<Vec<u8>>,
    /// Guard-page mode's allocations, by the pointer handed out.
    guards: KeyMap<DevicePtr, DevicePtr>,
    /// The same, by the start of their memory (where the books have them).
    guard_bases: KeyMap<DevicePtr, DevicePtr>,
    /// Guarded allocations made so far (their numbers in fault reports).
    guard_count: u64,
    /// Set while a malloc may make its new segment outside the lock (see `unlocked`).
    planning: bool,
    /// The driver work such a malloc planned.
    planned: Option<unlocked::Planned>,
    /// Bytes of planned segments being made outside the lock, held against the cap.
    growing: usize,
    /// The device's dedup index, opened when memory is first shared.
    sharing: Option<std::sync::Arc<crate::dedup::Sharing>>,
    /// Handles shared with other processes (made here or imported), by handle.
    shared: KeyMap<crate::device::PhysHandle, dedup::SharedHandle>,
    /// Bytes of imported handles mapped: other processes' memory, outside this pool's cap.
    shared_bytes: usize,
    /// Bytes asked for by the request `malloc` is serving (0 otherwise): `register` books them
    /// with the new allocation, sparing a second lookup of it.
    request: usize,
    /// Large requests that needed new memory one after another (see [`sizes::GrowthRun`]).
    growth_run: sizes::GrowthRun,
    /// Freed blocks kept for the next request of their size on their stream (see `parked`).
    parked: parked::Parked,
    /// Per stream, the event that tells when its frees of an epoch are settled (see `gather`).
    fences: Vec<gather::Fence>,
    /// Frees stamped with this epoch or an earlier one are settled on every stream (the
    /// device was waited for).
    settled_epoch: u64,
    /// Frees since a stream's fence was last looked at (see `gather`).
    frees_since_fence: u32,
}

/// Fills the device-wide dedup statistics from `sharing`'s index: a file, read without the
/// pool's lock.
fn add_device_sharing(
    sharing: Option<std::sync::Arc<crate::dedup::Sharing>>,
    stats: &mut MemoryStats,
) {
    if let Some(sharing) = sharing {
        let device = sharing.device_totals();
        stats.device_shared_bytes = device.shared_bytes as i64;
        stats.device_saved_bytes = device.saved_bytes as i64;
    }
}

/// Numbers pools for the thread-local region routing.
static NEXT_POOL_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// What a pool holds of the device now, and the stitches it made (see [`Pool::footprint`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Footprint {
    /// Physical memory created and not yet released, in bytes.
    pub reserved: usize,
    /// Bytes mapped by stitched ranges (they share the reserved memory of their pieces).
    pub stitched_mapped: usize,
    /// Stitched ranges made, and requests served by a cached one, since the counters were
    /// last reset.
    pub stitches: u64,
    pub stitch_reuse_hits: u64,
    /// Of the stitches, those that grew an idle stitched range in place (mapping only the
    /// handles added), since the pool was made.
    pub stitch_growths: u64,
}

/// Refuses a request that asks for more bytes (`asked`, booked as requested) than it hands out
/// (`size`).
fn check_asked(size: usize, asked: usize) -> Result<()> {
    if asked > size {
        return Err(Error::invalid_argument(format!(
            "{asked} bytes asked for are more than the {size} bytes to allocate"
        )));
    }
    Ok(())
}

/// A thread-safe caching allocator for one device.
pub struct Pool {
    device: SharedDevice,
    inner: Mutex<Inner>,
}

/// What [`Pool::allocation_of`] knows about a pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocationInfo {
    /// Start of the allocation that contains the pointer.
    pub base: DevicePtr,
    /// Bytes handed out (rounded).
    pub size: usize,
    /// Bytes asked for.
    pub requested: usize,
    pub stream: Stream,
    pub stitched: bool,
}

impl Pool {
    /// The pool's state with its parked blocks back in the free lists (see `parked`), for the
    /// operations that read the whole block map or the statistics: statistics, snapshots,
    /// invariants, address-exact requests and read-only sharing see freed memory as free.
    fn settled(&self) -> std::sync::MutexGuard<'_, Inner> {
        let mut inner = lock(&self.inner);
        inner.unpark_all();
        inner
    }

    /// A pool on `device` with `config` (validated).
    pub fn new(device: SharedDevice, config: Config) -> Result<Pool> {
        config.validate()?;
        let granularity = device.granularity();
        if !granularity.is_power_of_two() || granularity < MIN_BLOCK {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("device granularity {granularity} is not a power of two >= 512"),
            ));
        }
        let total_memory = device.mem_info()?.total;
        let cap = MemoryCap::new(total_memory, config.memory_fraction, config.memory_limit)?;
        let access = vec![device.ordinal()];
        let default_region = config.default_region.clone();
        let pool = Pool {
            device,
            inner: Mutex::new(Inner {
                config,
                granularity,
                total_memory,
                cap,
                map: BlockMap::new(),
                stitch: StitchCache::default(),
                stitch_blocks: StitchBlocks::default(),
                stitch_growths: 0,
                live: KeyMap::default(),
                pending: Vec::new(),
                stats: MemoryStats::default(),
                idle_events: Vec::new(),
                zombies: Vec::new(),
                access,
                private: KeyMap::default(),
                next_tag: SHARED + 1,
                routing: 0,
                deferred: Vec::new(),
                deferred_guarded: Vec::new(),
                swappable: KeyMap::default(),
                outside: 0,
                observer: None,
                placement: None,
                soft_limit: None,
                pinned: swap_async::PinnedCache::default(),
                id: NEXT_POOL_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                regions: Vec::new(),
                default_region: None,
                sleep_stream: None,
                sleep_engine: None,
                pageable: Vec::new(),
                guards: KeyMap::default(),
                guard_bases: KeyMap::default(),
                guard_count: 0,
                planning: false,
                planned: None,
                growing: 0,
                sharing: None,
                shared: KeyMap::default(),
                shared_bytes: 0,
                request: 0,
                growth_run: sizes::GrowthRun::default(),
                parked: parked::Parked::default(),
                fences: Vec::new(),
                settled_epoch: 0,
                frees_since_fence: 0,
            }),
        };
        if let Some(name) = default_region {
            let mut inner = lock(&pool.inner);
            let tag = inner.region_tag(&name)?;
            inner.default_region = Some(tag);
        }
        Ok(pool)
    }

    pub fn device(&self) -> &SharedDevice {
        &self.device
    }

    pub fn config(&self) -> Config {
        lock(&self.inner).config.clone()
    }

    /// Allocates `size` bytes for use on `stream`.
    pub fn malloc(&self, size: usize, stream: Stream) -> Result<DevicePtr> {
        self.malloc_in(size, stream, None)
    }

    /// Allocates `size` bytes for use on `stream`, from private pool `private` when given
    /// (which must be routed to: between [`Pool::begin_private`] and [`Pool::end_private`]).
    pub fn malloc_in(
        &self,
        size: usize,
        stream: Stream,
        private: Option<PrivatePoolId>,
    ) -> Result<DevicePtr> {
        self.malloc_asked(size, size, stream, private)
    }

    /// `size` bytes (`asked` asked for, at most `size`) for `stream` from the cached free
    /// blocks of pool `private` (None: the shared pool) alone: Ok(None), with nothing counted,
    /// when none fits. Nothing is created, stitched or waited for. PyTorch's memory pools lent
    /// on out-of-memory serve a request that failed elsewhere this way.
    pub fn malloc_cached(
        &self,
        size: usize,
        asked: usize,
        stream: Stream,
        private: Option<PrivatePoolId>,
    ) -> Result<Option<DevicePtr>> {
        check_asked(size, asked)?;
        let mut inner = lock(&self.inner);
        let tag = inner.tag_of(private)?;
        inner.malloc_cached(&*self.device, size, asked, stream, tag)
    }

    /// Takes one out-of-memory off the statistics: a caller that served the failed request
    /// another way (a pool lent on out-of-memory) reports none, as PyTorch does.
    pub fn uncount_oom(&self) {
        let mut inner = lock(&self.inner);
        inner.stats.num_ooms = inner.stats.num_ooms.saturating_sub(1);
    }

    /// As [`Pool::malloc_in`], for a caller that rounded the request up itself (PyTorch's
    /// `roundup_power2_divisions`): `size` bytes are handed out, and the `asked` bytes (at most
    /// `size`, else an `InvalidArgument` error) are the ones the statistics book as requested.
    /// Guarded and swappable allocations, which get whole granules of their own, are made of
    /// the `asked` bytes.
    pub fn malloc_asked(
        &self,
        size: usize,
        asked: usize,
        stream: Stream,
        private: Option<PrivatePoolId>,
    ) -> Result<DevicePtr> {
        check_asked(size, asked)?;
        let device = &*self.device;
        let mut inner = lock(&self.inner);
        if private.is_none() {
            if let Some(ptr) = inner.malloc_parked(size, asked, stream) {
                return Ok(ptr);
            }
        }
        inner.planning = true;
        let result = inner.malloc_in(device, size, asked, stream, private);
        inner.planning = false;
        let Some(planned) = inner.planned.take() else {
            return result;
        };
        // Driver work is needed: done without the lock, so other threads go on meanwhile. A
        // capture another thread begins meanwhile must not end because of it: this thread's
        // calls are relaxed, as the locked path makes them while a capture may be underway.
        drop(inner);
        let previous = device.exchange_capture_mode(crate::device::CaptureMode::Relaxed);
        let result = self.finish_planned(planned, size, asked, stream, private);
        if let Ok(previous) = previous {
            if let Err(err) = device.exchange_capture_mode(previous) {
                log::warn!("glake: restoring the stream capture mode failed: {err}");
            }
        }
        result
    }

    /// Makes the driver work a malloc planned, without the lock, and books it with the lock.
    fn finish_planned(
        &self,
        planned: unlocked::Planned,
        size: usize,
        asked: usize,
        stream: Stream,
        private: Option<PrivatePoolId>,
    ) -> Result<DevicePtr> {
        let device = &*self.device;
        match planned {
            unlocked::Planned::Segment(plan) => {
                let made = plan.make(device);
                let mut inner = lock(&self.inner);
                inner.adopt(device, plan, made)?;
                inner.malloc_in(device, size, asked, stream, private)
            }
            unlocked::Planned::Stitch(mut job) => {
                let made = job.make(device);
                let mut inner = lock(&self.inner);
                match inner.finish_stitch(device, job, made)? {
                    Some(ptr) => {
                        inner.set_requested(ptr, asked);
                        Ok(ptr)
                    }
                    // The device was full: every attempt again, under the lock.
                    None => inner.malloc_in(device, size, asked, stream, private),
                }
            }
        }
    }

    /// As [`Pool::malloc_asked`], also giving the number of pieces when the memory is a stitched
    /// range (0 otherwise), read right after it: callers that trace stitching ask for it, the
    /// others pay nothing.
    pub fn malloc_in_with_pieces(
        &self,
        size: usize,
        asked: usize,
        stream: Stream,
        private: Option<PrivatePoolId>,
    ) -> Result<(DevicePtr, u32)> {
        let ptr = self.malloc_asked(size, asked, stream, private)?;
        Ok((ptr, lock(&self.inner).stitched_pieces(ptr)))
    }

    /// Allocates exactly `[addr, addr+size)` again for use on `stream`, from private pool
    /// `private` when given (which must be open; routing to it is not needed), else from the
    /// shared pool. The range must lie inside one free block of that pool usable on `stream`
    /// (else an `InvalidState` error), and `size` be a size the pool handed out before: it is
    /// not rounded again, and one off the pool's unit is an `InvalidArgument` error. Nothing
    /// changes on an error. The allocation is then like any other. PyTorch's CUDA graph trees
    /// restore a graph pool's checkpoint with this: allocations freed since come back at the
    /// addresses the captured graphs use.
    pub fn malloc_at(
        &self,
        addr: DevicePtr,
        size: usize,
        stream: Stream,
        private: Option<PrivatePoolId>,
    ) -> Result<DevicePtr> {
        self.settled()
            .malloc_at_in(&*self.device, addr, size, stream, private)
    }

    /// Makes the calling thread allocate from region `name` (made on first use) until the
    /// matching [`Pool::end_region`]: the region's memory can then sleep and wake as one
    /// ([`Pool::sleep`]). Regions nest; other threads are not affected; graph-pool routing
    /// takes precedence.
    pub fn begin_region(&self, name: &str) -> Result<()> {
        let (id, tag) = {
            let mut inner = lock(&self.inner);
            (inner.id, inner.region_tag(name)?)
        };
        sleep::push_region(id, tag);
        Ok(())
    }

    /// Ends the calling thread's innermost region of this pool.
    pub fn end_region(&self) -> Result<()> {
        let id = lock(&self.inner).id;
        sleep::pop_region(id)
    }

    /// Gives the physical memory of region `name` back to the device, keeping every address
    /// reserved and, in [`SleepMode::Keep`], the allocated bytes on the host. Waits for the
    /// device first and for its copies before returning. Allocations in the region are refused
    /// until [`Pool::wake`]. On an error nothing is lost: call again to finish, or wake.
    pub fn sleep(&self, name: &str, mode: SleepMode) -> Result<()> {
        if mode == SleepMode::Keep {
            self.ensure_sleep_engine()?;
        }
        lock(&self.inner).sleep(&*self.device, name, mode)
    }

    /// Starts the copy engine of sleep and wake once, without holding the pool's lock while
    /// it opens peers, pins its staging and measures its paths (a thread that gets there
    /// first wins; the other engine is dropped).
    fn ensure_sleep_engine(&self) -> Result<()> {
        let Some(sleep_host) = lock(&self.inner).sleep_engine_wanted()? else {
            return Ok(());
        };
        let engine = sleep::start_sleep_engine(&self.device, sleep_host)?;
        let mut inner = lock(&self.inner);
        if inner.sleep_engine.is_none() {
            inner.sleep_engine = engine;
        }
        Ok(())
    }

    /// Makes ahead of time what a first sleep of region `name` in [`SleepMode::Keep`] would
    /// make: a host buffer per segment holding allocations (pinned or ordinary memory, as
    /// `Config::sleep_host` says) and the copy engine. Pinning runs at a few GB/s, far below
    /// the link, so a first sleep that pins is slow; prepared, it runs at the speed of later
    /// ones. The engine and the buffers are made outside the pool's lock (other threads
    /// allocate meanwhile) and kept until the pool goes. Returns the bytes made; on an error
    /// those made so far are kept and the call may be repeated.
    pub fn prepare_sleep(&self, name: &str) -> Result<usize> {
        lock(&self.inner).region_index(name)?; // an unknown region starts nothing
        self.ensure_sleep_engine()?;
        let (kind, sizes) = lock(&self.inner).sleep_shortfall(name)?;
        let mut made = Vec::with_capacity(sizes.len());
        let mut failure = None;
        for size in sizes {
            match sleep::host_bytes_ahead(&*self.device, kind, size) {
                Ok(bytes) => made.push(bytes),
                Err(err) => {
                    failure = Some(err);
                    break;
                }
            }
        }
        let bytes = made.iter().map(|b| b.len()).sum();
        lock(&self.inner).adopt_sleep_buffers(made);
        match failure {
            Some(err) => Err(err.context(format!("preparing region {name:?} for sleep"))),
            None => Ok(bytes),
        }
    }

    /// Maps region `name`'s memory back at the same addresses and restores its bytes (kept
    /// mode); returns once the copies are done. On an error the segments not yet restored
    /// stay asleep with their bytes: call again to finish.
    pub fn wake(&self, name: &str) -> Result<()> {
        lock(&self.inner).wake(&*self.device, name)
    }

    /// Marks `[ptr, ptr+len)`, inside one live allocation, read-only from now on, and shares
    /// its memory with other processes of this user holding the same bytes on the same device
    /// (see [`crate::dedup`]). Waits for the device: no work may use the range meanwhile.
    /// Only whole physical handles inside the range are shared; a write to them afterwards
    /// faults.
    pub fn share_read_only(&self, ptr: DevicePtr, len: usize) -> Result<ShareReport> {
        self.share_read_only_many(&[(ptr, len)])
    }

    /// [`Pool::share_read_only`] of many ranges (address, length) at once: one wait for the
    /// device and one set of staging buffers for all (a model's tensors). Ranges of memory that
    /// cannot be shared (stitched, swappable, guarded or private-pool allocations) are kept
    /// as they are; one outside any allocation fails the call before anything changes.
    pub fn share_read_only_many(&self, ranges: &[(DevicePtr, usize)]) -> Result<ShareReport> {
        self.settled().share_read_only(&*self.device, ranges)
    }

    /// The counters of the copy engine sleep and wake go through, where the pool has one
    /// (pageable host buffers, or relays through peers; see [`Pool::sleep`]).
    pub fn sleep_transfer_stats(&self) -> Option<crate::transfer::TransferStats> {
        lock(&self.inner).sleep_engine.as_ref().map(|e| e.stats())
    }

    /// What region `name` holds now (an `InvalidArgument` error for an unknown name).
    pub fn region_info(&self, name: &str) -> Result<RegionInfo> {
        lock(&self.inner).region_info(name)
    }

    /// The names of this pool's regions, in the order they were made.
    pub fn region_names(&self) -> Vec<String> {
        lock(&self.inner).region_names()
    }

    /// Allocates `size` bytes (rounded up to 512 bytes) for use on `stream`, in a
    /// segment of their own: [`Pool::swap_out`] can then give the memory back to the device
    /// and [`Pool::swap_in`] bring it back at the same address. Counted like any allocation;
    /// never a stitch piece while live. Once freed its memory is ordinary cached memory.
    pub fn malloc_swappable(&self, size: usize, stream: Stream) -> Result<DevicePtr> {
        lock(&self.inner).malloc_swappable(&*self.device, size, stream)
    }

    /// Moves the swappable allocation at `ptr` to host memory the pool keeps: waits for the
    /// work queued on its streams, copies its bytes out, unmaps and releases its physical
    /// memory and keeps its address range reserved. Errors (nothing changes): not a swappable
    /// allocation (`InvalidPointer` and the kinds [`Pool::free`] reports), already swapped out
    /// or a private pool routed to (`InvalidState`), a failed wait or copy, or no host memory.
    pub fn swap_out(&self, ptr: DevicePtr) -> Result<()> {
        lock(&self.inner).swap_out(&*self.device, ptr)
    }

    /// Brings a swapped-out allocation back: creates physical memory under the cap (freeing
    /// cached memory if needed), maps it at the same address with the same access, and copies
    /// the bytes back on its stream. On any error (`OutOfMemory` when the cap or the device is
    /// full) the allocation stays swapped out and its bytes stay on the host.
    pub fn swap_in(&self, ptr: DevicePtr) -> Result<()> {
        lock(&self.inner).swap_in(&*self.device, ptr)
    }

    /// Queues the copy of the swappable allocation at `ptr` to a pinned buffer of the pool's on
    /// `copy`, after the work queued on the allocation's streams, and returns without waiting;
    /// its physical memory goes back to the device when [`Pool::finish_swap_outs`] sees the
    /// copy done. Until then it counts as resident. Errors as [`Pool::swap_out`] (nothing
    /// changes), and `InvalidState` for one already on its way out.
    pub fn swap_out_async(&self, ptr: DevicePtr, copy: Stream) -> Result<()> {
        lock(&self.inner).swap_out_async(&*self.device, ptr, copy)
    }

    /// Completes the asynchronous swap-outs whose copies are done (with `wait`, all of them,
    /// waiting for their copies): their physical memory goes back to the device. Returns how
    /// many completed.
    pub fn finish_swap_outs(&self, wait: bool) -> Result<usize> {
        lock(&self.inner).finish_swap_outs(&*self.device, wait)
    }

    /// Brings the swappable allocation at `ptr` back without waiting: one still on its way
    /// out is kept (its swap-out cancelled); one swapped out gets new memory at its address,
    /// filled by a copy on `copy` that the allocation's streams wait for. Errors as
    /// [`Pool::swap_in`].
    pub fn swap_in_async(&self, ptr: DevicePtr, copy: Stream) -> Result<()> {
        lock(&self.inner).swap_in_async(&*self.device, ptr, copy)
    }

    /// Whether the swappable allocation at `ptr` is swapped out; None for any other pointer.
    pub fn is_swapped(&self, ptr: DevicePtr) -> Option<bool> {
        lock(&self.inner)
            .swappable
            .get(&ptr)
            .map(|s| s.host.is_some())
    }

    /// Starts routing requests to private pool `id`, creating it or taking one more use of it.
    /// Until the matching [`Pool::end_private`] nothing is unmapped, released or waited for.
    pub fn begin_private(&self, id: PrivatePoolId) {
        lock(&self.inner).begin_private(id);
    }

    /// Creates private pool `id` or takes one more use of it, without routing to it: a caller
    /// that routes requests itself (`malloc_in`) keeps a pool alive with this and
    /// [`Pool::release_private`], as PyTorch's `MemPool` objects do.
    pub fn retain_private(&self, id: PrivatePoolId) {
        lock(&self.inner).retain_private(id);
    }

    /// The uses of private pool `id` (retains and routings begun, less releases); 0 when it is
    /// not open.
    pub fn private_use_count(&self, id: PrivatePoolId) -> u32 {
        lock(&self.inner).private_use_count(id)
    }

    /// Ends one routing begun by [`Pool::begin_private`]; frees held back meanwhile record
    /// their events once no routing is left.
    pub fn end_private(&self, id: PrivatePoolId) -> Result<()> {
        lock(&self.inner).end_private(&*self.device, id)
    }

    /// Drops one use of private pool `id`; at the last, its memory joins the shared pool once
    /// the pool has next waited for the whole device (`empty_cache`, or a request that finds no
    /// memory), since replays queued before may still use it; allocations still live return
    /// there when freed.
    pub fn release_private(&self, id: PrivatePoolId) -> Result<()> {
        lock(&self.inner).release_private(&*self.device, id)
    }

    /// The live allocations of private pool `id`, by address (None when the pool is not
    /// open). PyTorch's CUDA graph trees check these against the tensors they track.
    pub fn private_allocations(&self, id: PrivatePoolId) -> Option<Vec<DevicePtr>> {
        lock(&self.inner).private_allocations(id)
    }

    /// Number of open private pools.
    pub fn private_pool_count(&self) -> usize {
        lock(&self.inner).private.len()
    }

    /// Frees an allocation. Memory becomes reusable on its stream at once, elsewhere later.
    pub fn free(&self, ptr: DevicePtr) -> Result<()> {
        let mut inner = lock(&self.inner);
        match inner.guarded_base(ptr)? {
            Some(_) => inner.free_guarded_or_defer(&*self.device, ptr),
            None => inner.free(&*self.device, ptr),
        }
    }

    /// Frees `ptr` if it is an allocation of this pool (Ok(true)); Ok(false), with nothing
    /// changed and no error made, when it is not. For callers that look for a pointer's pool
    /// among several.
    pub fn free_if_owned(&self, ptr: DevicePtr) -> Result<bool> {
        let mut inner = lock(&self.inner);
        match inner.guarded_base(ptr) {
            Ok(Some(_)) => {
                return inner
                    .free_guarded_or_defer(&*self.device, ptr)
                    .map(|()| true)
            }
            Err(_) => return Ok(false),
            Ok(None) => {}
        }
        if !inner.live.contains_key(&ptr) && !inner.swappable.contains_key(&ptr) {
            return Ok(false);
        }
        inner.free(&*self.device, ptr).map(|()| true)
    }

    /// Records that `stream` uses the allocation at `ptr`: its memory is not reused before the
    /// work queued on `stream` by the time of the free has completed.
    pub fn record_stream(&self, ptr: DevicePtr, stream: Stream) -> Result<()> {
        let known = self.device.knows_stream(stream);
        let mut inner = lock(&self.inner);
        let ptr = inner.guarded_base(ptr)?.unwrap_or(ptr);
        inner.record_stream(ptr, stream, known)
    }

    /// Returns unused physical memory to the driver, after waiting for the streams that may
    /// still use it. Memory that queued work may touch is never released.
    pub fn empty_cache(&self) -> Result<()> {
        lock(&self.inner).release_cached(&*self.device)
    }

    /// Caps the physical memory this pool creates at `fraction` of the device's memory (the
    /// nearest byte; see [`cap`]). Replaces any earlier cap.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        let mut inner = lock(&self.inner);
        inner.cap.set_fraction(fraction)?;
        inner.config.memory_fraction = fraction;
        inner.config.memory_limit = None;
        Ok(())
    }

    /// Caps the physical memory this pool creates at `bytes` (the device's total at most).
    /// Replaces any earlier cap.
    pub fn set_memory_limit(&self, bytes: usize) -> Result<()> {
        let mut inner = lock(&self.inner);
        inner.cap.set_bytes(bytes)?;
        inner.config.memory_fraction = 1.0;
        inner.config.memory_limit = Some(bytes);
        Ok(())
    }

    /// Sets (or, with None, removes) a soft limit: creating physical memory past it first gives
    /// the pool's cached memory back (a device-wide wait and release, as under the cap), but
    /// unlike the cap it never makes a request fail. SmartSwap sets it at its target, so memory
    /// a plan frees is memory the pool reuses.
    pub fn set_soft_limit(&self, bytes: Option<usize>) {
        lock(&self.inner).soft_limit = bytes;
    }

    /// The cap on physical memory, in bytes.
    pub fn memory_limit(&self) -> usize {
        lock(&self.inner).cap.bytes()
    }

    /// The fraction last set, or the byte cap's share of the device.
    pub fn memory_fraction(&self) -> f64 {
        lock(&self.inner).cap.fraction()
    }

    /// Grants device `peer` access to all memory of this pool, now and from now on.
    pub fn enable_peer_access(&self, peer: i32) -> Result<()> {
        if !self.device.can_access_peer(peer)? {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "device {peer} cannot access device {}",
                    self.device.ordinal()
                ),
            ));
        }
        lock(&self.inner).grant_access(&*self.device, peer)
    }

    /// The statistics: the pool's own counters, with dedup's read from its index.
    pub fn stats(&self) -> MemoryStats {
        let inner = self.settled();
        let mut stats = inner.stats;
        let sharing = inner.dedup_stats(&mut stats);
        drop(inner);
        add_device_sharing(sharing, &mut stats);
        stats
    }

    /// Physical bytes reserved, bytes mapped by stitched ranges, and the stitch counters now:
    /// counters that parked blocks do not change, so unlike [`Pool::stats`] this leaves them
    /// parked. A tool that samples the pool after every call (a replay's timeline and marks)
    /// reads this, so that sampling does not change where later requests are placed.
    pub fn footprint(&self) -> Footprint {
        let inner = lock(&self.inner);
        let stats = &inner.stats;
        let bytes = |v: i64| v.max(0) as usize;
        let times = |v: i64| v.max(0) as u64;
        Footprint {
            reserved: bytes(stats.reserved_bytes.all.current),
            stitched_mapped: bytes(stats.stitched_mapped_bytes.current),
            stitches: times(stats.stitches),
            stitch_reuse_hits: times(stats.stitch_reuse_hits),
            stitch_growths: inner.stitch_growths,
        }
    }

    pub fn reset_peak_stats(&self) {
        self.settled().stats.reset_peak();
    }

    pub fn reset_accumulated_stats(&self) {
        lock(&self.inner).stats.reset_accumulated();
    }

    /// The allocation containing `ptr` (PyTorch's `base_alloc`).
    pub fn allocation_of(&self, ptr: DevicePtr) -> Option<AllocationInfo> {
        lock(&self.inner).guarded_allocation_of(ptr)
    }

    /// Number of live allocations.
    pub fn live_count(&self) -> usize {
        lock(&self.inner).live.len()
    }

    /// A picture of segments, blocks and stitched ranges.
    pub fn snapshot(&self) -> snapshot::Snapshot {
        let inner = self.settled();
        let mut snapshot = inner.snapshot();
        let sharing = inner.dedup_stats(&mut snapshot.stats);
        drop(inner);
        add_device_sharing(sharing, &mut snapshot.stats);
        snapshot
    }

    /// Checks internal invariants (tests).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.settled().check_invariants()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let mut inner = lock(&self.inner);
        if !inner.live.is_empty() {
            log::warn!(
                "glake: pool of device {} dropped with {} live allocations ({} bytes); releasing them",
                self.device.ordinal(),
                inner.live.len(),
                inner.stats.allocated_bytes.all.current
            );
        }
        if let Err(err) = inner.teardown(&*self.device) {
            log::error!("glake: releasing pool memory failed: {err}");
        }
    }
}
