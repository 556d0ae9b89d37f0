//! The caching allocator of one device.
//!
//! Order of attempts for a large request (sizes rounded to the mapping granularity): best-fit
//! free block of the stream (split if larger) -> a cached stitched block within `reuse_limit`
//! -> stitch free blocks of the stream, creating only the missing bytes (defrag level 0) ->
//! create new physical memory -> take back other streams' free memory and retry -> free cached
//! memory and retry -> out of memory. Small requests (up to `small_limit`, rounded to 512 bytes)
//! come from 2 MiB segments and are never stitched.
//!
//! Private pools (PyTorch's graph pools) hold the memory of CUDA graph captures: requests routed
//! to one are served only from its own segments, and its memory, free or not, is neither
//! stitched, released nor handed to other requests until the pool is released; then it joins
//! the shared pool. While any routing is active (a capture may be underway) the allocator never
//! waits for the device, unmaps or releases, and defers event records of frees.
//!
//! Reuse is stream-ordered: a block freed on stream S is reusable at once on S; other streams
//! get it only after the allocator has seen S's work complete. Blocks used on extra streams
//! (`record_stream`) wait for events recorded on those streams at free time. Nothing is unmapped
//! or released before the streams that may touch it are synchronised.

pub mod blocks;
pub mod cap;
pub mod snapshot;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Mutex, MutexGuard};

use crate::config::{Config, DefragLevel};
use crate::device::{align_up, CaptureMode, DevicePtr, Event, PhysHandle, SharedDevice, Stream};
use crate::error::{Error, ErrorKind, Result};
use crate::stats::MemoryStats;
use crate::stitch::{self, Piece, StitchCache, StitchId};
use blocks::{BlockId, BlockMap, BlockState, Chunk, PoolKind, SegmentId, Tag, SHARED};
use cap::MemoryCap;

/// Names a private pool (PyTorch's `MempoolId_t`).
pub type PrivatePoolId = (u64, u64);

#[derive(Debug, Clone, Copy)]
struct PrivatePool {
    tag: Tag,
    /// Routings begun (captures and pool contexts) not yet matched by a release.
    uses: u32,
}

/// Alignment and rounding unit of small requests.
pub const MIN_BLOCK: usize = 512;

/// Most idle stitched ranges kept mapped, whatever their bytes (each is a driver object).
const MAX_IDLE_STITCHED: usize = 4096;

/// Idle stitched ranges examined per reuse attempt (bounds the cost of a miss).
const REUSE_SCAN: usize = 16;

/// Hasher for maps keyed by addresses and ids, which every malloc and free looks up. The keys
/// are not chosen by an adversary, so SipHash's protection is not needed; a folded multiply
/// mixes the zero low bits of aligned addresses into every bit of the hash.
#[derive(Debug, Default, Clone, Copy)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }

    fn write_u64(&mut self, n: u64) {
        const K: u64 = 0x9e37_79b9_7f4a_7c15;
        let product = u128::from(self.0 ^ n) * u128::from(K);
        self.0 = (product as u64) ^ ((product >> 64) as u64);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

type KeyMap<K, V> = HashMap<K, V, BuildHasherDefault<KeyHasher>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Block(BlockId),
    Stitched(StitchId),
}

#[derive(Debug, Clone)]
struct Live {
    target: Target,
    size: usize,
    requested: usize,
    stream: Stream,
    pool: PoolKind,
    extra_streams: Vec<Stream>,
}

#[derive(Debug)]
struct PendingFree {
    live: Live,
    events: Vec<Event>,
}

/// The pieces of a stitched allocation: block ids while in use.
#[derive(Debug, Default)]
struct StitchBlocks {
    blocks: KeyMap<StitchId, Vec<BlockId>>,
}

struct Inner {
    config: Config,
    granularity: usize,
    total_memory: usize,
    cap: MemoryCap,
    map: BlockMap,
    stitch: StitchCache,
    stitch_blocks: StitchBlocks,
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

fn lock(mutex: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    // A panic inside the allocator is a bug; the state it leaves is still the best we have.
    match mutex.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}

impl Pool {
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
        Ok(Pool {
            device,
            inner: Mutex::new(Inner {
                config,
                granularity,
                total_memory,
                cap,
                map: BlockMap::new(),
                stitch: StitchCache::default(),
                stitch_blocks: StitchBlocks::default(),
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
            }),
        })
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
        let mut inner = lock(&self.inner);
        let tag = match private {
            None => SHARED,
            Some(id) => match inner.private.get(&id) {
                Some(p) => p.tag,
                None => {
                    return Err(Error::new(
                        ErrorKind::InvalidState,
                        format!("private pool {id:?} is not open"),
                    ))
                }
            },
        };
        if inner.routing == 0 {
            return inner.malloc(&*self.device, size, stream, tag);
        }
        // A capture may be underway on this thread: driver calls that are not stream work
        // (creating and mapping memory) must not count as unsafe calls that end it.
        let previous = self.device.exchange_capture_mode(CaptureMode::Relaxed)?;
        let result = inner.malloc(&*self.device, size, stream, tag);
        if let Err(err) = self.device.exchange_capture_mode(previous) {
            log::warn!("glake: restoring the stream capture mode failed: {err}");
        }
        result
    }

    /// Starts routing requests to private pool `id`, creating it or taking one more use of it.
    /// Until the matching [`Pool::end_private`] nothing is unmapped, released or waited for.
    pub fn begin_private(&self, id: PrivatePoolId) {
        let mut inner = lock(&self.inner);
        inner.routing += 1;
        if let Some(pool) = inner.private.get_mut(&id) {
            pool.uses += 1;
            return;
        }
        let tag = inner.next_tag;
        inner.next_tag += 1;
        inner.private.insert(id, PrivatePool { tag, uses: 1 });
    }

    /// Ends one routing begun by [`Pool::begin_private`]; frees held back meanwhile record
    /// their events once no routing is left.
    pub fn end_private(&self, id: PrivatePoolId) -> Result<()> {
        let mut inner = lock(&self.inner);
        if !inner.private.contains_key(&id) || inner.routing == 0 {
            return Err(Error::new(
                ErrorKind::InvalidState,
                format!("no routing to private pool {id:?} to end"),
            ));
        }
        inner.routing -= 1;
        if inner.routing > 0 {
            return Ok(());
        }
        let mut first_error = None;
        for live in std::mem::take(&mut inner.deferred) {
            if let Err(err) = inner.free_after_events(&*self.device, live) {
                first_error.get_or_insert(err);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Drops one use of private pool `id`; at the last, its memory joins the shared pool
    /// (allocations still live return there when freed).
    pub fn release_private(&self, id: PrivatePoolId) -> Result<()> {
        let mut inner = lock(&self.inner);
        let Some(pool) = inner.private.get_mut(&id) else {
            return Err(Error::new(
                ErrorKind::InvalidState,
                format!("private pool {id:?} is not open"),
            ));
        };
        pool.uses = pool.uses.saturating_sub(1);
        if pool.uses == 0 {
            let tag = pool.tag;
            inner.private.remove(&id);
            inner.map.retag(tag, SHARED);
            inner.sync_split_stats();
        }
        Ok(())
    }

    /// The live allocations of private pool `id`, by address (None when the pool is not
    /// open). PyTorch's CUDA graph trees check these against the tensors they track.
    pub fn private_allocations(&self, id: PrivatePoolId) -> Option<Vec<DevicePtr>> {
        let inner = lock(&self.inner);
        let tag = inner.private.get(&id)?.tag;
        let mut ptrs: Vec<DevicePtr> = inner
            .live
            .iter()
            .filter(|(_, live)| match live.target {
                Target::Block(b) => inner.map.segments[inner.map.blocks[b].segment].tag == tag,
                Target::Stitched(_) => false,
            })
            .map(|(&ptr, _)| ptr)
            .collect();
        ptrs.sort_unstable();
        Some(ptrs)
    }

    /// Number of open private pools.
    pub fn private_pool_count(&self) -> usize {
        lock(&self.inner).private.len()
    }

    /// Frees an allocation. Memory becomes reusable on its stream at once, elsewhere later.
    pub fn free(&self, ptr: DevicePtr) -> Result<()> {
        let mut inner = lock(&self.inner);
        inner.free(&*self.device, ptr)
    }

    /// Records that `stream` uses the allocation at `ptr`: its memory is not reused before the
    /// work queued on `stream` by the time of the free has completed.
    pub fn record_stream(&self, ptr: DevicePtr, stream: Stream) -> Result<()> {
        let mut inner = lock(&self.inner);
        let live = match inner.live.get_mut(&ptr) {
            Some(live) => live,
            None => return Err(inner.classify_unknown(ptr)),
        };
        if stream != live.stream && !live.extra_streams.contains(&stream) {
            live.extra_streams.push(stream);
        }
        Ok(())
    }

    /// Returns unused physical memory to the driver, after waiting for the streams that may
    /// still use it. Memory that queued work may touch is never released.
    pub fn empty_cache(&self) -> Result<()> {
        let mut inner = lock(&self.inner);
        inner.release_cached(&*self.device)
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
        let mut inner = lock(&self.inner);
        if inner.access.contains(&peer) {
            return Ok(());
        }
        let mut access = inner.access.clone();
        access.push(peer);
        let ranges: Vec<(DevicePtr, usize)> = inner
            .map
            .segments
            .iter()
            .map(|(_, s)| (s.va, s.size))
            .chain(inner.stitch.blocks.iter().map(|(_, s)| (s.va, s.size)))
            .collect();
        for (va, size) in ranges {
            self.device.set_access(va, size, &access)?;
        }
        inner.access = access;
        Ok(())
    }

    pub fn stats(&self) -> MemoryStats {
        lock(&self.inner).stats
    }

    pub fn reset_peak_stats(&self) {
        lock(&self.inner).stats.reset_peak();
    }

    pub fn reset_accumulated_stats(&self) {
        lock(&self.inner).stats.reset_accumulated();
    }

    /// The allocation containing `ptr` (PyTorch's `base_alloc`).
    pub fn allocation_of(&self, ptr: DevicePtr) -> Option<AllocationInfo> {
        let inner = lock(&self.inner);
        let base = inner.base_of(ptr)?;
        let live = inner.live.get(&base)?;
        Some(AllocationInfo {
            base,
            size: live.size,
            requested: live.requested,
            stream: live.stream,
            stitched: matches!(live.target, Target::Stitched(_)),
        })
    }

    /// Number of live allocations.
    pub fn live_count(&self) -> usize {
        lock(&self.inner).live.len()
    }

    /// A picture of segments, blocks and stitched ranges.
    pub fn snapshot(&self) -> snapshot::Snapshot {
        let inner = lock(&self.inner);
        let requested: HashMap<DevicePtr, usize> = inner
            .live
            .iter()
            .filter(|(_, l)| matches!(l.target, Target::Block(_)))
            .map(|(&p, l)| (p, l.requested))
            .collect();
        snapshot::take(
            &inner.map,
            &inner.stitch,
            &inner.stats,
            inner.cap.bytes(),
            &requested,
        )
    }

    /// Checks internal invariants (tests).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let inner = lock(&self.inner);
        inner.map.check()?;
        let reserved: usize = inner.map.segments.iter().map(|(_, s)| s.size).sum();
        if reserved as i64 != inner.stats.reserved_bytes.all.current {
            return Err(format!(
                "segments hold {reserved} bytes, stats say {}",
                inner.stats.reserved_bytes.all.current
            ));
        }
        let allocated: usize = inner.live.values().map(|l| l.size).sum();
        if allocated as i64 != inner.stats.allocated_bytes.all.current {
            return Err(format!(
                "live allocations hold {allocated} bytes, stats say {}",
                inner.stats.allocated_bytes.all.current
            ));
        }
        if inner.map.inactive_split.bytes != inner.stats.inactive_split_bytes.all.current {
            return Err("inactive split bytes out of step".into());
        }
        for (id, s) in inner.stitch.blocks.iter() {
            if s.in_use != inner.stitch_blocks.blocks.contains_key(&id) {
                return Err(format!("stitched block {id} use flag out of step"));
            }
        }
        Ok(())
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

impl Inner {
    fn classify_unknown(&self, ptr: DevicePtr) -> Error {
        if ptr == 0 {
            return Error::new(ErrorKind::NullPointer, "pointer is NULL");
        }
        if let Some(id) = self.map.block_at(ptr) {
            if self.map.blocks[id].state != BlockState::Allocated {
                return Error::new(
                    ErrorKind::DoubleFree,
                    format!("{ptr:#x} was already freed (double free)"),
                );
            }
        }
        if let Some(id) = self.stitch.by_va(ptr) {
            if !self.stitch.blocks[id].in_use {
                return Error::new(
                    ErrorKind::DoubleFree,
                    format!("{ptr:#x} was already freed (double free)"),
                );
            }
        }
        let held = self.pending.iter().map(|p| &p.live).chain(&self.deferred);
        if held.into_iter().any(|live| self.live_ptr(live) == ptr) {
            return Error::new(
                ErrorKind::DoubleFree,
                format!("{ptr:#x} was already freed (double free)"),
            );
        }
        if self.map.block_containing(ptr).is_some() || self.stitch.containing(ptr).is_some() {
            return Error::new(
                ErrorKind::InvalidPointer,
                format!("{ptr:#x} points inside memory of this pool but not at an allocation"),
            );
        }
        Error::new(
            ErrorKind::InvalidPointer,
            format!("{ptr:#x} was not allocated by this pool"),
        )
    }

    fn live_ptr(&self, live: &Live) -> DevicePtr {
        match live.target {
            Target::Block(id) => self.map.blocks[id].addr,
            Target::Stitched(id) => self.stitch.blocks[id].va,
        }
    }

    fn base_of(&self, ptr: DevicePtr) -> Option<DevicePtr> {
        if self.live.contains_key(&ptr) {
            return Some(ptr);
        }
        if let Some(id) = self.stitch.containing(ptr) {
            // A reused stitched range may serve only a prefix of itself.
            let s = &self.stitch.blocks[id];
            let live = self.live.get(&s.va).filter(|_| s.in_use)?;
            return (ptr < s.va + live.size as u64).then_some(s.va);
        }
        let id = self.map.block_containing(ptr)?;
        let block = &self.map.blocks[id];
        (block.state == BlockState::Allocated && self.live.contains_key(&block.addr))
            .then_some(block.addr)
    }

    fn reserved(&self) -> usize {
        self.stats.reserved_bytes.all.current as usize
    }

    fn malloc(
        &mut self,
        device: &dyn crate::device::Device,
        size: usize,
        stream: Stream,
        tag: Tag,
    ) -> Result<DevicePtr> {
        if size == 0 {
            return Err(Error::invalid_argument("size 0 requested"));
        }
        if size > isize::MAX as usize {
            return Err(Error::invalid_argument(format!(
                "size {size} is beyond any device"
            )));
        }
        let pool = if size <= self.config.small_limit {
            PoolKind::Small
        } else {
            PoolKind::Large
        };
        let rounded = match pool {
            PoolKind::Small => align_up(size, MIN_BLOCK)?,
            PoolKind::Large => align_up(size, self.granularity)?,
        };
        if rounded > self.total_memory {
            self.stats.num_ooms += 1;
            return Err(Error::out_of_memory(format!(
                "request of {size} bytes is larger than the device's {} bytes",
                self.total_memory
            )));
        }
        if !self.pending.is_empty() {
            self.process_pending(device)?;
        }
        let ptr = match pool {
            PoolKind::Small => self.malloc_small(device, rounded, stream, tag)?,
            PoolKind::Large => self.malloc_large(device, rounded, stream, tag)?,
        };
        let ptr = match ptr {
            Some(ptr) => ptr,
            None => {
                self.stats.num_ooms += 1;
                return Err(Error::out_of_memory(format!(
                    "cannot allocate {size} bytes on device {}: {} bytes reserved of a {} byte cap, {} allocated",
                    device.ordinal(),
                    self.reserved(),
                    self.cap.bytes(),
                    self.stats.allocated_bytes.all.current
                )));
            }
        };
        if let Some(live) = self.live.get_mut(&ptr) {
            live.requested = size;
            let delta = size as i64;
            self.stats.requested_bytes.add(pool, delta);
        }
        Ok(ptr)
    }

    /// Records a new allocation and its statistics.
    fn register(
        &mut self,
        ptr: DevicePtr,
        target: Target,
        size: usize,
        stream: Stream,
        pool: PoolKind,
    ) {
        self.live.insert(
            ptr,
            Live {
                target,
                size,
                requested: 0,
                stream,
                pool,
                extra_streams: Vec::new(),
            },
        );
        self.stats.allocation.add(pool, 1);
        self.stats.allocated_bytes.add(pool, size as i64);
        self.stats.active.add(pool, 1);
        self.stats.active_bytes.add(pool, size as i64);
        self.sync_split_stats();
    }

    /// Brings the inactive-split statistics of both pools in step with the block map (one
    /// operation, such as merging after a wait for all streams, may change both pools).
    fn sync_split_stats(&mut self) {
        for pool in [PoolKind::Small, PoolKind::Large] {
            let now = self.map.inactive_split_by_pool[pool as usize];
            let (count, bytes) = match pool {
                PoolKind::Small => (
                    self.stats.inactive_split.small_pool.current,
                    self.stats.inactive_split_bytes.small_pool.current,
                ),
                PoolKind::Large => (
                    self.stats.inactive_split.large_pool.current,
                    self.stats.inactive_split_bytes.large_pool.current,
                ),
            };
            self.stats.inactive_split.add(pool, now.count - count);
            self.stats.inactive_split_bytes.add(pool, now.bytes - bytes);
        }
    }

    /// Takes free block `id` (split to `size`) as a plain allocation.
    fn allocate_block(
        &mut self,
        id: BlockId,
        size: usize,
        stream: Stream,
        pool: PoolKind,
    ) -> DevicePtr {
        let whole = self.map.blocks[id].size;
        let split = match pool {
            PoolKind::Small => whole - size >= MIN_BLOCK,
            PoolKind::Large => whole - size >= self.granularity,
        };
        let size = if split { size } else { whole };
        self.map.take_front(id, size, stream);
        let ptr = self.map.blocks[id].addr;
        self.register(ptr, Target::Block(id), size, stream, pool);
        ptr
    }

    fn malloc_small(
        &mut self,
        device: &dyn crate::device::Device,
        size: usize,
        stream: Stream,
        tag: Tag,
    ) -> Result<Option<DevicePtr>> {
        for attempt in 0..3 {
            if let Some(id) = self.map.best_fit(tag, PoolKind::Small, stream, size) {
                return Ok(Some(self.allocate_block(id, size, stream, PoolKind::Small)));
            }
            let segment_size = align_up(self.granularity.max(size), self.granularity)?;
            if let Some(id) = self.grow(device, PoolKind::Small, segment_size, tag)? {
                return Ok(Some(self.allocate_block(id, size, stream, PoolKind::Small)));
            }
            match attempt {
                0 => self.reclaim_other_streams(device, stream)?,
                1 => {
                    self.stats.num_alloc_retries += 1;
                    self.release_cached(device)?;
                }
                _ => {}
            }
        }
        Ok(None)
    }

    fn malloc_large(
        &mut self,
        device: &dyn crate::device::Device,
        size: usize,
        stream: Stream,
        tag: Tag,
    ) -> Result<Option<DevicePtr>> {
        // A private pool maps nothing twice: its graph replays use fixed addresses.
        let stitch = self.config.stitch && tag == SHARED;
        for attempt in 0..3 {
            if let Some(id) = self.map.best_fit(tag, PoolKind::Large, stream, size) {
                return Ok(Some(self.allocate_block(id, size, stream, PoolKind::Large)));
            }
            if stitch {
                if let Some(ptr) = self.reuse_stitched(size, stream) {
                    return Ok(Some(ptr));
                }
                let eager = self.config.defrag_level == DefragLevel::BeforeGrow || attempt > 0;
                if eager {
                    if let Some(ptr) = self.stitch_new(device, size, stream)? {
                        return Ok(Some(ptr));
                    }
                }
            }
            if let Some(id) = self.grow(device, PoolKind::Large, size, tag)? {
                return Ok(Some(self.allocate_block(id, size, stream, PoolKind::Large)));
            }
            if stitch && self.config.defrag_level == DefragLevel::WhenFull && attempt == 0 {
                if let Some(ptr) = self.stitch_new(device, size, stream)? {
                    return Ok(Some(ptr));
                }
            }
            match attempt {
                0 => self.reclaim_other_streams(device, stream)?,
                1 => {
                    self.stats.num_alloc_retries += 1;
                    self.release_cached(device)?;
                }
                _ => {}
            }
        }
        Ok(None)
    }

    /// Whether `bytes` more physical memory fits under the cap.
    fn fits_cap(&self, bytes: usize) -> bool {
        self.cap.fits(self.reserved(), bytes)
    }

    /// Creates a segment of `size` bytes from physical chunks (see [`blocks::chunk_sizes`] and
    /// [`blocks::chunk_limit`]), mapped at a new range with access set once. Returns its free
    /// block, or None when the cap or the device is full. Undoes every step if a later one
    /// fails.
    fn grow(
        &mut self,
        device: &dyn crate::device::Device,
        pool: PoolKind,
        size: usize,
        tag: Tag,
    ) -> Result<Option<BlockId>> {
        if !self.fits_cap(size) {
            return Ok(None);
        }
        let limit = blocks::chunk_limit(
            self.reserved(),
            self.granularity,
            self.config.max_chunk,
            self.config.chunk_divisor,
        );
        let sizes = blocks::chunk_sizes(size, self.granularity, limit);
        let mut chunks: Vec<Chunk> = Vec::with_capacity(sizes.len());
        let mut offset = 0;
        for len in sizes {
            match device.create_physical(len) {
                Ok(handle) => chunks.push(Chunk {
                    handle,
                    offset,
                    len,
                }),
                Err(err) => {
                    self.bury(device, Zombie::handles(&chunks));
                    if err.kind() == ErrorKind::OutOfMemory {
                        return Ok(None);
                    }
                    return Err(err.context("creating physical memory"));
                }
            }
            offset += len;
        }
        let layout = blocks::handle_layout(&chunks);
        let va = match map_range(device, &layout, self.granularity, &self.access) {
            Ok(va) => va,
            Err((err, zombie)) => {
                self.zombies.extend(zombie);
                self.bury(device, Zombie::handles(&chunks));
                return Err(err.context("mapping a new segment"));
            }
        };
        let count = chunks.len() as i64;
        let (_, block) = self.map.add_segment(va, size, chunks, pool, tag);
        self.stats.segment.add(pool, 1);
        self.stats.reserved_bytes.add(pool, size as i64);
        self.stats.num_device_alloc += count;
        Ok(Some(block))
    }

    /// Releases one idle segment: it leaves the books at once, and its mappings, handles and
    /// range are torn down now or, where a driver call fails, retried later.
    fn release_segment(
        &mut self,
        device: &dyn crate::device::Device,
        segment: SegmentId,
    ) -> Result<()> {
        let Some(removed) = self.map.remove_segment(segment) else {
            return Err(Error::internal("released a segment that is in use"));
        };
        self.stats.segment.add(removed.pool, -1);
        self.stats
            .reserved_bytes
            .add(removed.pool, -(removed.size as i64));
        self.stats.num_device_free += removed.chunks.len() as i64;
        self.sync_split_stats();
        let zombie = Zombie {
            unmaps: removed
                .chunks
                .iter()
                .map(|c| (removed.va + c.offset as u64, c.len))
                .collect(),
            handles: removed.chunks.iter().map(|c| c.handle).collect(),
            reservation: Some((removed.va, removed.size)),
        };
        self.bury(device, zombie);
        Ok(())
    }

    /// Serves `size` from an idle stitched range whose pieces are all free for `stream`.
    fn reuse_stitched(&mut self, size: usize, stream: Stream) -> Option<DevicePtr> {
        let max = ((size as f64) * self.config.reuse_limit) as usize;
        let found = self
            .stitch
            .idle_candidates(size, max.max(size))
            .take(REUSE_SCAN)
            .find(|&id| {
                stitch::prefix(&self.stitch.blocks[id].pieces, size).all(|(addr, len)| {
                    self.map.block_containing(addr).is_some_and(|b| {
                        let b = &self.map.blocks[b];
                        b.state == BlockState::Free
                            && (b.owner.is_none() || b.owner == Some(stream))
                            && addr + len as u64 <= b.addr + b.size as u64
                    })
                })
            })?;
        let mut ids = Vec::new();
        for (addr, len) in stitch::prefix(&self.stitch.blocks[found].pieces, size) {
            // Checked above: each part lies inside one free block usable on `stream`.
            ids.push(self.map.take_range(addr, len, stream)?);
        }
        self.stitch.acquire(found, stream);
        self.stitch_blocks.blocks.insert(found, ids);
        let va = self.stitch.blocks[found].va;
        self.register(va, Target::Stitched(found), size, stream, PoolKind::Large);
        self.stats.stitch_reuse_hits += 1;
        self.stats.stitched_allocations += 1;
        Some(va)
    }

    /// Builds a new stitched range of `size` bytes from free blocks of `stream`, creating new
    /// physical memory for any shortfall. Only whole chunks map, so a free block offers the run
    /// of whole chunks inside it (at least `frag_limit` bytes); the last piece maps its last
    /// chunk whole but takes from the block only the bytes the request needs.
    fn stitch_new(
        &mut self,
        device: &dyn crate::device::Device,
        size: usize,
        stream: Stream,
    ) -> Result<Option<DevicePtr>> {
        let min_piece = self.config.frag_limit.max(self.granularity);
        let map = &self.map;
        let candidates = map
            .largest_free_blocks(PoolKind::Large, stream, min_piece)
            .filter_map(|(_, id)| {
                let (_, len) = map.whole_chunks_of(id)?;
                (len >= min_piece).then_some((len, id))
            });
        let plan = match stitch::plan(candidates, size, self.config.max_stitch_pieces) {
            Some(plan) => plan,
            None => return Ok(None),
        };
        if plan.shortfall > 0 && !self.fits_cap(plan.shortfall) {
            return Ok(None);
        }
        // Where each planned piece lies and what maps it, before taking splits the blocks.
        let mut pieces: Vec<Piece> = Vec::with_capacity(plan.take.len() + 1);
        for &(id, bytes) in &plan.take {
            let Some((start, _)) = self.map.whole_chunks_of(id) else {
                return Err(Error::internal("a planned stitch piece has no whole chunk"));
            };
            let segment = &self.map.segments[self.map.blocks[id].segment];
            let handles = blocks::handle_layout(segment.chunks_covering(start, bytes));
            let len = handles.iter().map(|&(_, len)| len).sum();
            pieces.push(Piece {
                addr: start,
                len,
                handles,
            });
        }
        // Take the planned bytes first, so that growth cannot merge them.
        let mut ids: Vec<BlockId> = Vec::with_capacity(plan.take.len() + 1);
        for (piece, &(_, bytes)) in pieces.iter().zip(&plan.take) {
            match self.map.take_range(piece.addr, bytes, stream) {
                Some(id) => ids.push(id),
                None => {
                    self.give_back(&ids, stream);
                    return Err(Error::internal("a planned stitch piece is not free"));
                }
            }
        }
        if plan.shortfall > 0 {
            match self.grow(device, PoolKind::Large, plan.shortfall, SHARED) {
                Ok(Some(id)) => {
                    self.map.take(id, stream);
                    ids.push(id);
                    let b = &self.map.blocks[id];
                    let segment = &self.map.segments[b.segment];
                    pieces.push(Piece {
                        addr: b.addr,
                        len: b.size,
                        handles: blocks::handle_layout(&segment.chunks),
                    });
                }
                other => {
                    self.give_back(&ids, stream);
                    return other.map(|_| None);
                }
            }
        }
        let handles: Vec<(PhysHandle, usize)> = pieces
            .iter()
            .flat_map(|p| p.handles.iter().copied())
            .collect();
        let va = match map_range(device, &handles, self.granularity, &self.access) {
            Ok(va) => va,
            Err((err, zombie)) => {
                self.give_back(&ids, stream);
                self.zombies.extend(zombie);
                return Err(err);
            }
        };
        let piece_count = pieces.len();
        let id = self.stitch.insert(va, pieces, stream);
        let mapped = self.stitch.blocks[id].size;
        self.stitch_blocks.blocks.insert(id, ids);
        self.register(va, Target::Stitched(id), size, stream, PoolKind::Large);
        self.stats.stitches += 1;
        self.stats.stitched_bytes += size as i64;
        self.stats.stitched_pieces += piece_count as i64;
        self.stats.stitched_allocations += 1;
        self.stats.stitched_blocks.add(1);
        self.stats.stitched_mapped_bytes.add(mapped as i64);
        log::debug!(
            "glake: fuse {piece_count} pieces into {size} bytes at {va:#x} on device {}",
            device.ordinal()
        );
        if let Err(err) = self.collect_stitched(device, false) {
            log::warn!("glake: collecting stitched blocks failed: {err}");
        }
        Ok(Some(va))
    }

    /// Returns blocks taken for a stitch that did not happen to the free sets of `stream`.
    fn give_back(&mut self, ids: &[BlockId], stream: Stream) {
        for &id in ids {
            self.map.release(id, Some(stream));
        }
        self.sync_split_stats();
    }

    /// Unmaps idle stitched ranges: all of them when `all`, else the least recently used ones
    /// past the auto-GC byte limit or the idle-count limit.
    fn collect_stitched(&mut self, device: &dyn crate::device::Device, all: bool) -> Result<()> {
        if self.routing > 0 {
            return Ok(());
        }
        let over_bytes = self.stitch.mapped_bytes > self.config.auto_gc_bytes;
        let over_count = self.stitch.idle_count() > MAX_IDLE_STITCHED;
        if !all && !over_bytes && !over_count {
            return Ok(());
        }
        let mut victims = Vec::new();
        let mut mapped = self.stitch.mapped_bytes;
        let mut idle = self.stitch.idle_count();
        for id in self.stitch.idle_lru() {
            if !all && mapped <= self.config.auto_gc_bytes && idle <= MAX_IDLE_STITCHED {
                break;
            }
            mapped -= self.stitch.blocks[id].size;
            idle -= 1;
            victims.push(id);
        }
        if victims.is_empty() {
            return Ok(());
        }
        // The ranges were last used on some stream whose work may still be queued.
        device.synchronize_device()?;
        self.stats.num_sync_all_streams += 1;
        for id in victims {
            let s = self.stitch.remove(id);
            self.stats.stitch_collections += 1;
            self.stats.stitched_blocks.add(-1);
            self.stats.stitched_mapped_bytes.add(-(s.size as i64));
            let zombie = Zombie {
                unmaps: mappings(s.va, s.pieces.iter().flat_map(|p| &p.handles)),
                handles: Vec::new(),
                reservation: Some((s.va, s.size)),
            };
            self.bury(device, zombie);
        }
        Ok(())
    }

    /// Finishes tearing down a driver object; what fails is kept and retried later, so that a
    /// failed unmap neither loses track of memory nor leaves the books wrong.
    fn bury(&mut self, device: &dyn crate::device::Device, mut zombie: Zombie) {
        if let Err(err) = zombie.finish(device) {
            log::warn!("glake: releasing driver memory failed, will retry: {err}");
            self.zombies.push(zombie);
        }
    }

    fn retry_zombies(&mut self, device: &dyn crate::device::Device) -> Result<()> {
        let mut first_error = None;
        for mut zombie in std::mem::take(&mut self.zombies) {
            if let Err(err) = zombie.finish(device) {
                first_error.get_or_insert(err);
                self.zombies.push(zombie);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Makes the free memory of other streams usable by `stream`, by waiting for the device
    /// when another stream owns free memory or frees are pending.
    fn reclaim_other_streams(
        &mut self,
        device: &dyn crate::device::Device,
        stream: Stream,
    ) -> Result<()> {
        if self.routing > 0 {
            return Ok(());
        }
        self.process_pending(device)?;
        let others = self.map.owning_streams().iter().any(|&s| s != stream);
        if others || !self.pending.is_empty() {
            self.synchronize_all(device)?;
        }
        Ok(())
    }

    /// Waits for all work on the device, then makes all free memory unowned and completes all
    /// pending frees. A device-wide wait also covers streams the caller has destroyed since.
    fn synchronize_all(&mut self, device: &dyn crate::device::Device) -> Result<()> {
        device.synchronize_device()?;
        self.stats.num_sync_all_streams += 1;
        for stream in self.map.owning_streams() {
            self.map.disown(stream);
        }
        for pending in std::mem::take(&mut self.pending) {
            self.idle_events.extend(pending.events);
            self.finish_free(pending.live, None);
        }
        self.sync_split_stats();
        Ok(())
    }

    /// Frees all cached memory: idle stitched ranges and idle segments.
    fn release_cached(&mut self, device: &dyn crate::device::Device) -> Result<()> {
        if self.routing > 0 {
            // A capture may be underway: waiting for the device would end it.
            return Ok(());
        }
        self.synchronize_all(device)?;
        self.collect_stitched(device, true)?;
        for segment in self.map.idle_segments() {
            self.release_segment(device, segment)?;
        }
        self.retry_zombies(device)
    }

    fn free(&mut self, device: &dyn crate::device::Device, ptr: DevicePtr) -> Result<()> {
        let live = match self.live.remove(&ptr) {
            Some(live) => live,
            None => return Err(self.classify_unknown(ptr)),
        };
        self.stats.allocation.add(live.pool, -1);
        self.stats
            .allocated_bytes
            .add(live.pool, -(live.size as i64));
        self.stats
            .requested_bytes
            .add(live.pool, -(live.requested as i64));
        if live.extra_streams.is_empty() {
            let stream = live.stream;
            self.finish_free(live, Some(stream));
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
    fn free_after_events(&mut self, device: &dyn crate::device::Device, live: Live) -> Result<()> {
        let mut events = Vec::with_capacity(live.extra_streams.len());
        for &stream in &live.extra_streams {
            let event = match self.idle_events.pop() {
                Some(event) => event,
                None => match device.create_event() {
                    Ok(event) => event,
                    Err(err) => {
                        self.pending.push(PendingFree { live, events });
                        return self.fail_pending(device, err);
                    }
                },
            };
            if let Err(err) = device.record_event(event, stream) {
                self.idle_events.push(event);
                self.pending.push(PendingFree { live, events });
                return self.fail_pending(device, err);
            }
            events.push(event);
        }
        self.set_target_pending(live.target);
        self.pending.push(PendingFree { live, events });
        Ok(())
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
        }
        Err(err.context("recording a stream event for a free"))
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
    fn finish_free(&mut self, live: Live, owner: Option<Stream>) {
        match live.target {
            Target::Block(id) => {
                self.map.release(id, owner);
            }
            Target::Stitched(id) => {
                for b in self.stitch_blocks.blocks.remove(&id).unwrap_or_default() {
                    self.map.release(b, owner);
                }
                self.stitch.park(id);
            }
        }
        self.stats.active.add(live.pool, -1);
        self.stats.active_bytes.add(live.pool, -(live.size as i64));
        self.sync_split_stats();
    }

    /// Completes pending frees whose events have all completed.
    fn process_pending(&mut self, device: &dyn crate::device::Device) -> Result<()> {
        if self.routing > 0 {
            return Ok(());
        }
        let mut index = 0;
        while index < self.pending.len() {
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

    /// Releases everything: called when the pool is dropped.
    fn teardown(&mut self, device: &dyn crate::device::Device) -> Result<()> {
        // Nothing can capture once the pool is gone: private pools end here, and the frees
        // held back for them complete after the device wait that precedes every release.
        self.routing = 0;
        let tags: Vec<Tag> = self.private.drain().map(|(_, p)| p.tag).collect();
        for tag in tags {
            self.map.retag(tag, SHARED);
        }
        for live in std::mem::take(&mut self.deferred) {
            self.finish_free(live, None);
        }
        let ptrs: Vec<DevicePtr> = self.live.keys().copied().collect();
        for ptr in ptrs {
            if let Some(live) = self.live.remove(&ptr) {
                self.stats.allocation.add(live.pool, -1);
                self.stats
                    .allocated_bytes
                    .add(live.pool, -(live.size as i64));
                self.finish_free(live, None);
            }
        }
        // Nothing can retry after this: a failed step (and all it left untried) gets one more
        // pass. Memory that may still be in use stays if that fails; the idle events go anyway.
        let released = self
            .release_cached(device)
            .or_else(|_| self.release_cached(device));
        for event in self.idle_events.drain(..) {
            undo(device.destroy_event(event));
        }
        released
    }
}

/// Driver objects still to be torn down: mappings to unmap, then handles to release and a
/// range to free. Each step that succeeds is dropped from the lists, so a retry resumes.
#[derive(Debug)]
struct Zombie {
    unmaps: Vec<(DevicePtr, usize)>,
    handles: Vec<PhysHandle>,
    reservation: Option<(DevicePtr, usize)>,
}

impl Zombie {
    fn handles(chunks: &[Chunk]) -> Self {
        Zombie {
            unmaps: Vec::new(),
            handles: chunks.iter().map(|c| c.handle).collect(),
            reservation: None,
        }
    }

    fn finish(&mut self, device: &dyn crate::device::Device) -> Result<()> {
        while let Some(&(va, len)) = self.unmaps.last() {
            device.unmap(va, len)?;
            self.unmaps.pop();
        }
        while let Some(&handle) = self.handles.last() {
            device.release_physical(handle)?;
            self.handles.pop();
        }
        if let Some((va, size)) = self.reservation {
            device.unreserve(va, size)?;
            self.reservation = None;
        }
        Ok(())
    }
}

/// Where each of `handles` (with its length) lies when they are mapped one after another from
/// `va`; mappings are unmapped one by one, as they were made.
fn mappings<'a>(
    va: DevicePtr,
    handles: impl IntoIterator<Item = &'a (PhysHandle, usize)>,
) -> Vec<(DevicePtr, usize)> {
    let mut at = va;
    handles
        .into_iter()
        .map(|&(_, len)| {
            let mapping = (at, len);
            at += len as u64;
            mapping
        })
        .collect()
}

/// Reserves a range (aligned to `align`), maps `handles` (each with its length) one after
/// another into it, and grants access to the whole range in one call. On failure what was done
/// is undone, or handed back as a zombie to retry; the handles themselves stay with the caller.
fn map_range(
    device: &dyn crate::device::Device,
    handles: &[(PhysHandle, usize)],
    align: usize,
    access: &[i32],
) -> std::result::Result<DevicePtr, (Error, Option<Zombie>)> {
    let size = handles.iter().map(|&(_, len)| len).sum();
    let va = device.reserve(size, align).map_err(|e| (e, None))?;
    let mut mapped = Vec::with_capacity(handles.len());
    let mut failure = None;
    for ((at, len), &(handle, _)) in mappings(va, handles).into_iter().zip(handles) {
        if let Err(err) = device.map(at, len, handle, 0) {
            failure = Some(err);
            break;
        }
        mapped.push((at, len));
    }
    if failure.is_none() {
        // One grant over the whole range. Its cost is per handle; granting parts from several
        // threads, or one handle per call, was measured slower on an H200.
        match device.set_access(va, size, access) {
            Ok(()) => return Ok(va),
            Err(err) => failure = Some(err.context("setting access")),
        }
    }
    let mut zombie = Zombie {
        unmaps: mapped,
        handles: Vec::new(),
        reservation: Some((va, size)),
    };
    let err = failure.unwrap_or_else(|| Error::internal("mapping failed without an error"));
    match zombie.finish(device) {
        Ok(()) => Err((err, None)),
        Err(_) => Err((err, Some(zombie))),
    }
}

/// Logs the failure of a clean-up step taken after an earlier failure (the first error is the
/// one reported).
fn undo(result: Result<()>) {
    if let Err(err) = result {
        log::error!("glake: clean-up after a failed driver call also failed: {err}");
    }
}
