//! Host memory copies into and out of the staging buffers.
//!
//! A lane copies every staged byte once on the CPU, and with many lanes at once host memory
//! bandwidth is what bounds a pageable copy. An ordinary copy first reads each destination
//! line it writes (to own it in cache), so it moves three bytes over the memory bus for every
//! byte copied; streaming (non-temporal) stores write whole lines straight to memory and move
//! two. Streaming also keeps the bytes out of the caches, which is right here: the staging
//! buffer is read next by a DMA engine, and a drained destination is not read by this thread.

/// How the lanes copy host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostCopy {
    /// The C library's `memcpy`.
    Plain,
    /// Streaming stores where the CPU has them (x86-64), `memcpy` elsewhere.
    Streaming,
    /// Streaming for copies of more than this many bytes in all, `memcpy` for smaller ones.
    /// A destination that fits the last-level cache may still be cached from its last use, and
    /// ordinary stores into cached lines beat streaming ones (measured on an H200's host: a
    /// 300 MiB cache; device-to-host 64-128 MiB copies were 10% slower streamed, 256 MiB-4 GiB
    /// ones 5-20% faster).
    StreamingAbove(usize),
}

/// Bytes below which streaming gains nothing over `memcpy` (its fences and alignment work
/// cost more than the bandwidth they save).
const STREAMING_MIN: usize = 64 << 10;

impl HostCopy {
    /// The way to copy the chunks of a copy of `total` bytes.
    pub fn for_copy(self, total: usize) -> HostCopy {
        match self {
            HostCopy::StreamingAbove(bytes) if total > bytes => HostCopy::Streaming,
            HostCopy::StreamingAbove(_) => HostCopy::Plain,
            other => other,
        }
    }

    /// Copies `len` bytes from `src` to `dst` (a [`HostCopy::StreamingAbove`] not resolved by
    /// [`HostCopy::for_copy`] copies plainly).
    ///
    /// # Safety
    /// `src` must be valid for reading and `dst` for writing `len` bytes, and the two ranges
    /// must not overlap.
    pub unsafe fn copy(self, dst: *mut u8, src: *const u8, len: usize) {
        if self == HostCopy::Streaming && len >= STREAMING_MIN {
            // SAFETY: forwarded from the caller.
            unsafe { streaming_copy(dst, src, len) }
        } else {
            // SAFETY: forwarded from the caller.
            unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
        }
    }
}

/// Copies with 16-byte streaming stores: an ordinary copy up to the first 64-byte boundary of
/// `dst`, whole lines streamed, the tail copied again ordinarily, then a store fence so that the
/// bytes are visible before anything this thread does next (such as queueing the DMA).
#[cfg(target_arch = "x86_64")]
unsafe fn streaming_copy(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    const LINE: usize = 64;
    let head = dst.align_offset(LINE).min(len);
    // SAFETY: every range below lies inside the caller's `len` bytes of `src` and `dst`; SSE2
    // is part of x86-64, so the intrinsics are always available; `d` is 16-byte aligned after
    // the head, as _mm_stream_si128 requires.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let lines = (len - head) / LINE;
        let mut s = src.add(head);
        let mut d = dst.add(head);
        for _ in 0..lines {
            let a = _mm_loadu_si128(s as *const __m128i);
            let b = _mm_loadu_si128(s.add(16) as *const __m128i);
            let c = _mm_loadu_si128(s.add(32) as *const __m128i);
            let e = _mm_loadu_si128(s.add(48) as *const __m128i);
            _mm_stream_si128(d as *mut __m128i, a);
            _mm_stream_si128(d.add(16) as *mut __m128i, b);
            _mm_stream_si128(d.add(32) as *mut __m128i, c);
            _mm_stream_si128(d.add(48) as *mut __m128i, e);
            s = s.add(LINE);
            d = d.add(LINE);
        }
        std::ptr::copy_nonoverlapping(s, d, len - head - lines * LINE);
        _mm_sfence();
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn streaming_copy(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: forwarded from the caller.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every alignment of both sides, lengths around the line and threshold edges: the bytes
    /// arrive, and nothing outside the destination range is written.
    #[test]
    fn streaming_above_a_size_resolves_per_copy() {
        let above = HostCopy::StreamingAbove(32 << 20);
        assert_eq!(above.for_copy(32 << 20), HostCopy::Plain);
        assert_eq!(above.for_copy((32 << 20) + 1), HostCopy::Streaming);
        assert_eq!(HostCopy::Plain.for_copy(usize::MAX), HostCopy::Plain);
        assert_eq!(HostCopy::Streaming.for_copy(1), HostCopy::Streaming);
    }

    #[test]
    fn streaming_copies_every_alignment_and_length() {
        let lens = [
            0,
            1,
            63,
            64,
            65,
            STREAMING_MIN - 1,
            STREAMING_MIN,
            STREAMING_MIN + 1,
            STREAMING_MIN + 63,
            (1 << 20) + 17,
        ];
        let source: Vec<u8> = (0..(1 << 20) + 256).map(|i| (i * 7 + 3) as u8).collect();
        for &len in &lens {
            for src_off in [0, 1, 15, 16, 33] {
                for dst_off in [0, 1, 8, 31, 63] {
                    for how in [HostCopy::Plain, HostCopy::Streaming] {
                        let mut dest = vec![0xEEu8; len + 128];
                        // SAFETY: both ranges lie inside their vectors and do not overlap.
                        unsafe {
                            how.copy(
                                dest.as_mut_ptr().add(dst_off),
                                source.as_ptr().add(src_off),
                                len,
                            )
                        };
                        assert_eq!(
                            &dest[dst_off..dst_off + len],
                            &source[src_off..src_off + len],
                            "{how:?} len {len} src+{src_off} dst+{dst_off}"
                        );
                        assert!(dest[..dst_off].iter().all(|&b| b == 0xEE));
                        assert!(dest[dst_off + len..].iter().all(|&b| b == 0xEE));
                    }
                }
            }
        }
    }
}
