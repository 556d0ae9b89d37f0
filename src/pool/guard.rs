//! Guard-page mode (`Config::guard`, `GLAKE_GUARD=1`): every allocation of the shared pool gets
//! a segment of its own, reserved one mapping granule longer than it is mapped, and the
//! pointer handed out is placed so that the allocation ends where the unmapped granule begins
//! (256-byte aligned, as the driver's own allocations are: a write up to 255 bytes past a size
//! that is not a multiple of 256 lands in that slack, unseen). A write past the end faults at
//! once: on the GPU an illegal-address error, on the host backend SIGSEGV, after a line on
//! stderr naming the allocation (address, size, stream, its number in the pool's order). A
//! free waits for the allocation's streams and unmaps its memory at once, so a use after free
//! faults too.
//!
//! The pool keeps its books on the segment's start (the base); the pointer handed out maps to
//! it in [`Inner::guards`].

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Once;

use super::alloc::check_size;
use super::blocks::{PoolKind, GUARDED};
use super::{AllocationInfo, Inner, Target};
use crate::device::{align_up, BackendKind, DevicePtr, Stream};
use crate::error::{Error, ErrorKind, Result};

/// Alignment of a guarded allocation's pointer.
const GUARD_ALIGN: usize = 256;

impl Inner {
    /// Allocates `size` bytes in guard-page mode; see the module's documentation.
    pub(super) fn malloc_guarded(
        &mut self,
        device: &dyn crate::device::Device,
        size: usize,
        stream: Stream,
    ) -> Result<DevicePtr> {
        check_size(size)?;
        let used = align_up(size, GUARD_ALIGN)?;
        let rounded = align_up(used, self.granularity)?;
        let guard = self.granularity;
        let id = self.grow_own_segment(device, size, rounded, GUARDED, guard)?;
        self.map.take_front(id, rounded, stream);
        let base = self.map.blocks[id].addr;
        self.register(base, Target::Block(id), rounded, stream, PoolKind::Large);
        self.set_requested(base, size);
        let ptr = base + (rounded - used) as u64;
        self.guard_count += 1;
        let number = self.guard_count;
        self.guards.insert(ptr, base);
        self.guard_bases.insert(base, ptr);
        if device.kind() == BackendKind::Host {
            registry::add(ptr, used, guard, size, stream.0, number);
        }
        Ok(ptr)
    }

    /// What the books call pointer `ptr` from a caller: `Some(base)` for a guarded one (the
    /// start of its segment), `None` for any other. The base itself is refused: nobody was
    /// given it.
    pub(super) fn guarded_base(&self, ptr: DevicePtr) -> Result<Option<DevicePtr>> {
        if self.guards.is_empty() {
            return Ok(None);
        }
        if let Some(&base) = self.guards.get(&ptr) {
            return Ok(Some(base));
        }
        if self.guard_bases.contains_key(&ptr) {
            return Err(Error::new(
                crate::error::ErrorKind::InvalidPointer,
                format!("{ptr:#x} is inside memory of this pool (a guarded allocation)"),
            ));
        }
        Ok(None)
    }

    /// [`Inner::allocation_of`] for pointers from callers: a guarded allocation runs from the
    /// pointer handed out to its end.
    pub(super) fn guarded_allocation_of(&self, ptr: DevicePtr) -> Option<AllocationInfo> {
        let booked = self.guarded_base(ptr).ok()?.unwrap_or(ptr);
        let mut info = self.allocation_of(booked)?;
        if let Some(&user) = self.guard_bases.get(&info.base) {
            if ptr < user {
                return None;
            }
            info.size -= (user - info.base) as usize;
            info.base = user;
        }
        Some(info)
    }

    /// Forgets every guarded allocation (the pool is going; its memory goes with the rest).
    pub(super) fn settle_guards(&mut self) {
        for (ptr, _) in self.guards.drain() {
            registry::remove(ptr);
        }
        self.guard_bases.clear();
    }

    /// Frees guarded `ptr`, or, while a capture may be underway (a routing is active), holds the
    /// free until the last routing ends: its wait for the streams and its unmap would end the
    /// capture. The allocation stays booked as live until then; a second free meanwhile is a
    /// double free.
    pub(super) fn free_guarded_or_defer(
        &mut self,
        device: &dyn crate::device::Device,
        ptr: DevicePtr,
    ) -> Result<()> {
        if self.routing == 0 {
            return self.free_guarded(device, ptr);
        }
        if self.deferred_guarded.contains(&ptr) {
            return Err(Error::new(
                ErrorKind::DoubleFree,
                format!("{ptr:#x} was freed already (its free waits for the capture to end)"),
            ));
        }
        self.deferred_guarded.push(ptr);
        Ok(())
    }

    /// Frees guarded `ptr`: waits for its streams, then unmaps and releases its memory.
    pub(super) fn free_guarded(
        &mut self,
        device: &dyn crate::device::Device,
        ptr: DevicePtr,
    ) -> Result<()> {
        let Some(base) = self.guards.get(&ptr).copied() else {
            return Err(Error::internal("not a guarded allocation"));
        };
        let (stream, extra) = match self.live.get(&base) {
            Some(live) => (live.stream, live.extra_streams.clone()),
            None => return Err(Error::internal("a guarded allocation without its books")),
        };
        // A stream that cannot be waited for (destroyed since) is waited for with the device.
        let mut waited = Ok(());
        for s in std::iter::once(stream).chain(extra) {
            if let Err(err) = device.synchronize_stream(s) {
                device
                    .synchronize_device()
                    .map_err(|e| e.context("waiting for a guarded allocation's work"))?;
                waited = Err(err.context(
                    "waiting for a stream of a guarded allocation (the allocation is freed: \
                     the device was waited for instead)",
                ));
                break;
            }
        }
        self.guards.remove(&ptr);
        self.guard_bases.remove(&base);
        registry::remove(ptr);
        let live = self.unregister(base)?;
        let Target::Block(block) = live.target else {
            return Err(Error::internal("a guarded allocation that is not a block"));
        };
        let segment = self.map.blocks[block].segment;
        // Its streams are done: the memory is free for any stream, and goes at once.
        self.finish_free(live, None);
        self.release_segment(device, segment)?;
        waited
    }
}

/// The guarded allocations of every pool on the host backend, for the SIGSEGV handler: it
/// cannot lock or allocate, so the table is fixed and atomic. Allocations past its size are
/// guarded all the same, only not named.
mod registry {
    use super::*;

    const SLOTS: usize = 4096;

    struct Slot {
        ptr: AtomicU64,
        used: AtomicUsize,
        guard: AtomicUsize,
        size: AtomicUsize,
        stream: AtomicU64,
        number: AtomicU64,
    }

    #[allow(clippy::declare_interior_mutable_const)]
    const EMPTY: Slot = Slot {
        ptr: AtomicU64::new(0),
        used: AtomicUsize::new(0),
        guard: AtomicUsize::new(0),
        size: AtomicUsize::new(0),
        stream: AtomicU64::new(0),
        number: AtomicU64::new(0),
    };

    static TABLE: [Slot; SLOTS] = [EMPTY; SLOTS];
    static INSTALL: Once = Once::new();

    pub(super) fn add(
        ptr: DevicePtr,
        used: usize,
        guard: usize,
        size: usize,
        stream: u64,
        number: u64,
    ) {
        INSTALL.call_once(handler::install);
        for slot in &TABLE {
            if slot
                .ptr
                .compare_exchange(0, u64::MAX, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                slot.used.store(used, Ordering::Relaxed);
                slot.guard.store(guard, Ordering::Relaxed);
                slot.size.store(size, Ordering::Relaxed);
                slot.stream.store(stream, Ordering::Relaxed);
                slot.number.store(number, Ordering::Relaxed);
                slot.ptr.store(ptr, Ordering::Release);
                return;
            }
        }
    }

    pub(super) fn remove(ptr: DevicePtr) {
        for slot in &TABLE {
            if slot.ptr.load(Ordering::Acquire) == ptr {
                slot.ptr.store(0, Ordering::Release);
                return;
            }
        }
    }

    /// The guarded allocation whose guard (the granule after it) holds `addr`:
    /// (pointer, size asked for, stream, number, bytes past its end).
    pub(super) fn owner_of(addr: u64) -> Option<(u64, usize, u64, u64, u64)> {
        for slot in &TABLE {
            let ptr = slot.ptr.load(Ordering::Acquire);
            if ptr == 0 || ptr == u64::MAX {
                continue;
            }
            let end = ptr + slot.used.load(Ordering::Relaxed) as u64;
            if addr >= end && addr < end + slot.guard.load(Ordering::Relaxed) as u64 {
                return Some((
                    ptr,
                    slot.size.load(Ordering::Relaxed),
                    slot.stream.load(Ordering::Relaxed),
                    slot.number.load(Ordering::Relaxed),
                    addr - ptr - slot.size.load(Ordering::Relaxed) as u64,
                ));
            }
        }
        None
    }

    /// The SIGSEGV handler of guard-page mode on the host backend: names the allocation whose
    /// guard was hit, then gives the signal back to the handler that was there before.
    mod handler {
        use super::owner_of;
        use std::mem::MaybeUninit;
        use std::sync::atomic::{AtomicBool, Ordering};

        static mut PREVIOUS: MaybeUninit<libc::sigaction> = MaybeUninit::uninit();
        static SAVED: AtomicBool = AtomicBool::new(false);

        pub(in super::super) fn install() {
            // SAFETY: a zeroed sigaction is valid; the handler below is async-signal-safe
            // (atomics, a stack buffer and write(2)); PREVIOUS is written once, here, before
            // the handler can run.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_fault as *const () as usize;
                action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut action.sa_mask);
                let previous = &raw mut PREVIOUS;
                if libc::sigaction(libc::SIGSEGV, &action, (*previous).as_mut_ptr()) == 0 {
                    SAVED.store(true, Ordering::Release);
                }
            }
        }

        extern "C" fn on_fault(
            _signal: i32,
            info: *mut libc::siginfo_t,
            _context: *mut libc::c_void,
        ) {
            // SAFETY: the kernel passes a valid siginfo for SIGSEGV.
            let addr = unsafe { (*info).si_addr() } as u64;
            if let Some((ptr, size, stream, number, past)) = owner_of(addr) {
                let mut text = Line::default();
                text.push(b"glake: out-of-bounds access at ");
                text.hex(addr);
                text.push(b": ");
                text.dec(past + 1);
                text.push(b" bytes past the end of guarded allocation #");
                text.dec(number);
                text.push(b" of ");
                text.dec(size as u64);
                text.push(b" bytes at ");
                text.hex(ptr);
                text.push(b" (stream ");
                text.hex(stream);
                text.push(b")\n");
                // SAFETY: write(2) on stderr with a buffer of ours.
                unsafe { libc::write(2, text.buf.as_ptr().cast(), text.len) };
            }
            // Back to what was there before (or the default): the access runs again and that
            // handler, or the default action, takes it.
            // SAFETY: PREVIOUS was saved before this handler was installed.
            unsafe {
                if SAVED.load(Ordering::Acquire) {
                    let previous = &raw const PREVIOUS;
                    libc::sigaction(libc::SIGSEGV, (*previous).as_ptr(), std::ptr::null_mut());
                } else {
                    libc::signal(libc::SIGSEGV, libc::SIG_DFL);
                }
            }
        }

        /// A line built without allocating.
        struct Line {
            buf: [u8; 256],
            len: usize,
        }

        impl Default for Line {
            fn default() -> Self {
                Line {
                    buf: [0; 256],
                    len: 0,
                }
            }
        }

        impl Line {
            fn push(&mut self, bytes: &[u8]) {
                for &b in bytes {
                    if self.len < self.buf.len() {
                        self.buf[self.len] = b;
                        self.len += 1;
                    }
                }
            }

            fn hex(&mut self, mut n: u64) {
                let mut digits = [0u8; 16];
                let mut i = digits.len();
                loop {
                    i -= 1;
                    digits[i] = b"0123456789abcdef"[(n & 15) as usize];
                    n >>= 4;
                    if n == 0 {
                        break;
                    }
                }
                self.push(b"0x");
                self.push(&digits[i..]);
            }

            fn dec(&mut self, mut n: u64) {
                let mut digits = [0u8; 20];
                let mut i = digits.len();
                loop {
                    i -= 1;
                    digits[i] = b'0' + (n % 10) as u8;
                    n /= 10;
                    if n == 0 {
                        break;
                    }
                }
                self.push(&digits[i..]);
            }
        }
    }
}
