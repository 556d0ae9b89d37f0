//! Reading device memory on the host to hash and compare it: copies into pinned staging
//! buffers (double-buffered, so the next piece is copied while this one is hashed), worked on
//! by several threads, since one core hashes or compares far slower than the link copies.

use std::thread;

use xxhash_rust::xxh3::xxh3_128;

use crate::device::{Device, DevicePtr, Stream};
use crate::error::Result;

/// Bytes hashed as one unit: a run's hash is the hash of its units' hashes, so it does not
/// depend on how the staging cuts the run, and units hash in parallel.
const UNIT: usize = 1 << 20;
/// Bytes of each staging buffer (a multiple of `UNIT`).
const STAGE: usize = 32 << 20;

/// Pinned staging buffers of one device, freed on drop.
pub struct Reader<'a> {
    device: &'a dyn Device,
    stream: Stream,
    buffers: [*mut u8; 4],
    threads: usize,
    /// Every content hashes alike: the byte compare alone tells contents apart (a drill).
    weak: bool,
}

impl<'a> Reader<'a> {
    /// Staging on `stream` of `device`; `weak` makes every hash the same.
    pub fn new(device: &'a dyn Device, stream: Stream, weak: bool) -> Result<Self> {
        let mut reader = Reader {
            device,
            stream,
            buffers: [std::ptr::null_mut(); 4],
            threads: thread::available_parallelism()
                .map_or(4, |n| n.get())
                .clamp(1, 16),
            weak,
        };
        for i in 0..reader.buffers.len() {
            // On failure, drop frees the buffers already made.
            reader.buffers[i] = device.alloc_pinned(STAGE)?;
        }
        Ok(reader)
    }

    /// The stream the staging copies run on.
    pub fn stream(&self) -> Stream {
        self.stream
    }

    /// Queues the copy of `len` bytes at `va` into staging buffer `buffer`.
    fn stage(&self, buffer: usize, va: DevicePtr, len: usize) -> Result<()> {
        // SAFETY: the buffer is STAGE bytes, `len <= STAGE`, and it outlives the copy (every
        // caller synchronises the stream before reading it or returning).
        unsafe {
            self.device
                .copy_to_host(self.buffers[buffer], va, len, self.stream)
        }
    }

    fn staged(&self, buffer: usize, len: usize) -> &[u8] {
        // SAFETY: the buffer holds `len <= STAGE` bytes copied in, the stream synchronised.
        unsafe { std::slice::from_raw_parts(self.buffers[buffer], len) }
    }

    /// The content hash of `[va, va+len)`.
    pub fn hash(&mut self, va: DevicePtr, len: usize) -> Result<u128> {
        if self.weak {
            return Ok(0);
        }
        let mut digests = Vec::with_capacity(len.div_ceil(UNIT) * 16 + 8);
        let pieces = pieces(len);
        if let Some(&(offset, size)) = pieces.first() {
            self.stage(0, va + offset as u64, size)?;
        }
        self.device.synchronize_stream(self.stream)?;
        for (i, &(_, size)) in pieces.iter().enumerate() {
            if let Some(&(offset, next)) = pieces.get(i + 1) {
                self.stage((i + 1) % 2, va + offset as u64, next)?;
            }
            let staged = self.staged(i % 2, size);
            for digest in self.in_parallel(staged.chunks(UNIT), xxh3_128) {
                digests.extend_from_slice(&digest.to_le_bytes());
            }
            self.device.synchronize_stream(self.stream)?;
        }
        digests.extend_from_slice(&(len as u64).to_le_bytes());
        Ok(xxh3_128(&digests))
    }

    /// Whether `[a, a+len)` and `[b, b+len)` hold the same bytes.
    pub fn equal(&mut self, a: DevicePtr, b: DevicePtr, len: usize) -> Result<bool> {
        let pieces = pieces(len);
        let stage_pair = |reader: &Self, slot: usize, offset: usize, size: usize| {
            reader.stage(2 * slot, a + offset as u64, size)?;
            reader.stage(2 * slot + 1, b + offset as u64, size)
        };
        if let Some(&(offset, size)) = pieces.first() {
            stage_pair(self, 0, offset, size)?;
        }
        self.device.synchronize_stream(self.stream)?;
        for (i, &(_, size)) in pieces.iter().enumerate() {
            if let Some(&(offset, next)) = pieces.get(i + 1) {
                stage_pair(self, (i + 1) % 2, offset, next)?;
            }
            let slot = i % 2;
            let left = self.staged(2 * slot, size);
            let right = self.staged(2 * slot + 1, size);
            let same = self
                .in_parallel(left.chunks(UNIT).zip(right.chunks(UNIT)), |(l, r)| l == r)
                .into_iter()
                .all(|same| same);
            self.device.synchronize_stream(self.stream)?;
            if !same {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// `work` over every item, on up to `self.threads` threads, results in item order.
    fn in_parallel<I, T>(&self, items: I, work: impl Fn(I::Item) -> T + Sync) -> Vec<T>
    where
        I: Iterator,
        I::Item: Send,
        T: Send,
    {
        let items: Vec<I::Item> = items.collect();
        let per_thread = items.len().div_ceil(self.threads).max(1);
        if items.len() <= 1 || self.threads == 1 {
            return items.into_iter().map(work).collect();
        }
        let work = &work;
        let mut groups: Vec<Vec<I::Item>> = Vec::new();
        let mut items = items.into_iter().peekable();
        while items.peek().is_some() {
            groups.push(items.by_ref().take(per_thread).collect());
        }
        thread::scope(|scope| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|group| scope.spawn(move || group.into_iter().map(work).collect::<Vec<T>>()))
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        })
    }
}

/// `len` cut into staging-sized pieces, as (offset, length).
fn pieces(len: usize) -> Vec<(usize, usize)> {
    (0..len)
        .step_by(STAGE)
        .map(|offset| (offset, STAGE.min(len - offset)))
        .collect()
}

impl Drop for Reader<'_> {
    fn drop(&mut self) {
        // A copy may still be queued when an error cut a loop short: without knowing it is
        // done, the buffers are left to the process rather than freed under it.
        if let Err(err) = self.device.synchronize_stream(self.stream) {
            log::error!("dedup staging buffers kept (their copies may still run): {err}");
            return;
        }
        for &buffer in self.buffers.iter().filter(|b| !b.is_null()) {
            // SAFETY: made by alloc_pinned of this device; the stream is synchronised.
            if let Err(err) = unsafe { self.device.free_pinned(buffer) } {
                log::warn!("dedup staging buffer not freed: {err}");
            }
        }
    }
}
