//! Memory made outside the pool that counts against its cap: PyTorch gives a `MemPool` its own
//! allocator (managed memory, NCCL buffers), and the process's memory fraction still bounds
//! that memory and the pool's together, as in PyTorch's own allocator. The pool never maps,
//! stitches or frees such memory; it only keeps its byte count beside its own.

use super::{Inner, Pool};
use crate::error::{Error, Result};
use crate::sync::lock;

impl Pool {
    /// Counts `bytes` made outside the pool against its cap. When they do not fit, the pool's
    /// cached memory goes back to the driver first; an out-of-memory error (nothing counted)
    /// when they still do not.
    pub fn count_outside(&self, bytes: usize) -> Result<()> {
        let mut inner = lock(&self.inner);
        if !inner.fits_cap(bytes) {
            inner.release_cached(&*self.device)?;
        }
        if !inner.fits_cap(bytes) {
            inner.stats.num_ooms += 1;
            return Err(Error::out_of_memory(format!(
                "{bytes} bytes from a memory pool's own allocator do not fit under the cap of \
                 {} bytes: {} bytes reserved by glake, {} by pools' own allocators",
                inner.cap.bytes(),
                inner.reserved(),
                inner.outside
            )));
        }
        inner.outside += bytes;
        Ok(())
    }

    /// Takes `bytes` counted by [`Pool::count_outside`] off again (their memory went back to
    /// the allocator that made it). More than is counted is an error and changes nothing.
    pub fn uncount_outside(&self, bytes: usize) -> Result<()> {
        let mut inner = lock(&self.inner);
        if bytes > inner.outside {
            return Err(Error::invalid_argument(format!(
                "uncounting {bytes} bytes of outside memory, but only {} are counted",
                inner.outside
            )));
        }
        inner.outside -= bytes;
        Ok(())
    }

    /// Bytes made outside the pool and counted against its cap.
    pub fn outside_bytes(&self) -> usize {
        lock(&self.inner).outside
    }
}

impl Inner {
    /// Bytes the cap bounds: the pool's own physical memory, memory being made for it outside
    /// its lock, and memory counted from outside.
    pub(super) fn capped_bytes(&self) -> usize {
        // Memory imported from other processes is theirs: it costs this device nothing more.
        self.reserved()
            .saturating_sub(self.shared_bytes)
            .saturating_add(self.growing)
            .saturating_add(self.outside)
    }
}
