//! Memory and virtual addresses of the host backend: physical chunks are first-fit ranges of the
//! device's sparse memfd, reservations are `mmap(PROT_NONE)` regions, and mapping a chunk places
//! its memfd range at a reserved address with access off until it is granted.

use std::collections::{BTreeMap, HashMap};
use std::ffi::CString;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use super::{lock, HostDevice};
use crate::device::{DevicePtr, PhysHandle};
use crate::error::{Error, ErrorKind, Result};

fn os_error(call: &str) -> Error {
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ENOMEM) && call.starts_with("mmap") {
        return Error::new(
            ErrorKind::ResourceLimit,
            format!("{call}: {err} (the process may have reached vm.max_map_count)"),
        );
    }
    Error::driver(format!("{call}: {err}"))
}

/// Creates the sparse memfd that holds device `ordinal`'s `total` bytes of memory; the caller
/// owns the returned descriptor.
pub(super) fn create_memfd(ordinal: i32, total: usize) -> Result<libc::c_int> {
    let name = CString::new(format!("glake-host-{ordinal}"))
        .map_err(|e| Error::internal(e.to_string()))?;
    // SAFETY: `name` is a valid C string; the returned descriptor is owned by the caller.
    let memfd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if memfd < 0 {
        return Err(os_error("memfd_create"));
    }
    // SAFETY: `memfd` is the descriptor just created.
    if unsafe { libc::ftruncate(memfd, total as libc::off_t) } != 0 {
        let err = os_error("ftruncate");
        // SAFETY: closing the descriptor we own.
        unsafe { libc::close(memfd) };
        return Err(err);
    }
    Ok(memfd)
}

/// First-fit allocator of offsets in the memfd.
#[derive(Debug)]
struct RangeAllocator {
    free: BTreeMap<usize, usize>,
}

impl RangeAllocator {
    fn new(total: usize) -> Self {
        let mut free = BTreeMap::new();
        if total > 0 {
            free.insert(0, total);
        }
        RangeAllocator { free }
    }

    fn allocate(&mut self, size: usize) -> Option<usize> {
        let (&start, &len) = self.free.iter().find(|(_, &len)| len >= size)?;
        self.free.remove(&start);
        if len > size {
            self.free.insert(start + size, len - size);
        }
        Some(start)
    }

    fn release(&mut self, start: usize, size: usize) {
        let mut start = start;
        let mut size = size;
        if let Some((&prev, &prev_len)) = self.free.range(..start).next_back() {
            if prev + prev_len == start {
                self.free.remove(&prev);
                start = prev;
                size += prev_len;
            }
        }
        if let Some(&next_len) = self.free.get(&(start + size)) {
            self.free.remove(&(start + size));
            size += next_len;
        }
        self.free.insert(start, size);
    }
}

#[derive(Debug)]
struct Chunk {
    offset: usize,
    size: usize,
    mappings: usize,
    released: bool,
    /// Shareable memory has a memfd of its own (`offset` is 0 in it), which the kernel keeps
    /// while any process holds it or maps it.
    own: Option<Shareable>,
}

#[derive(Debug)]
struct Shareable {
    fd: OwnedFd,
    /// Made by another process (or exported and imported again): not this device's memory.
    imported: bool,
}

#[derive(Debug, Clone, Copy)]
struct Mapping {
    size: usize,
    handle: PhysHandle,
    accessible: bool,
    writable: bool,
}

/// Everything a host device has created: chunks, reservations, mappings and pinned buffers.
#[derive(Debug)]
pub(super) struct Memory {
    offsets: RangeAllocator,
    chunks: HashMap<u64, Chunk>,
    reservations: BTreeMap<DevicePtr, usize>,
    mappings: BTreeMap<DevicePtr, Mapping>,
    created_bytes: usize,
    /// Bytes of live imported chunks (another process's memory, not counted as created).
    imported_bytes: usize,
    /// Buffers handed out as pinned memory, by address (kept here, under the same lock).
    pub(super) pinned: HashMap<usize, std::alloc::Layout>,
    next_handle: u64,
}

impl Memory {
    pub(super) fn new(total: usize) -> Self {
        Memory {
            offsets: RangeAllocator::new(total),
            chunks: HashMap::new(),
            reservations: BTreeMap::new(),
            mappings: BTreeMap::new(),
            created_bytes: 0,
            imported_bytes: 0,
            pinned: HashMap::new(),
            next_handle: 1,
        }
    }

    fn reservation_contains(&self, va: DevicePtr, size: usize) -> bool {
        match self.reservations.range(..=va).next_back() {
            Some((&start, &len)) => va + size as u64 <= start + len as u64,
            None => false,
        }
    }

    fn overlaps_mapping(&self, va: DevicePtr, size: usize) -> bool {
        let end = va + size as u64;
        if let Some((&start, m)) = self.mappings.range(..=va).next_back() {
            if start + m.size as u64 > va {
                return true;
            }
        }
        self.mappings.range(va..end).next().is_some()
    }

    /// True when every byte of `[va, va+len)` is mapped with access granted.
    pub(super) fn accessible(&self, va: DevicePtr, len: usize) -> bool {
        self.mapped_with(va, len, |m| m.accessible)
    }

    /// True when every byte of `[va, va+len)` is mapped with write access granted.
    pub(super) fn writable(&self, va: DevicePtr, len: usize) -> bool {
        self.mapped_with(va, len, |m| m.writable)
    }

    /// True when every byte of `[va, va+len)` is mapped by mappings that satisfy `granted`.
    fn mapped_with(&self, va: DevicePtr, len: usize, granted: impl Fn(&Mapping) -> bool) -> bool {
        let end = va + len as u64;
        let mut at = va;
        while at < end {
            match self.mappings.range(..=at).next_back() {
                Some((&start, m)) if start + m.size as u64 > at && granted(m) => {
                    at = start + m.size as u64;
                }
                _ => return false,
            }
        }
        true
    }

    /// Unmaps every reservation (and so every mapping in them), when the device goes away.
    pub(super) fn unmap_reservations(&self) {
        for (&va, &size) in self.reservations.iter() {
            // Grants to other devices end with the memory: the range may be mapped anew.
            super::process::revoke(va, size);
            // SAFETY: unmapping a reservation this object made.
            unsafe { libc::munmap(va as *mut libc::c_void, size) };
        }
    }
}

impl HostDevice {
    /// Bytes of physical memory currently created.
    pub fn created_bytes(&self) -> usize {
        lock(&self.memory).created_bytes
    }

    /// Number of live physical chunks, mappings and reservations (leak checks in tests).
    pub fn live_objects(&self) -> (usize, usize, usize) {
        let memory = lock(&self.memory);
        let chunks = memory.chunks.values().filter(|c| !c.released).count();
        (chunks, memory.mappings.len(), memory.reservations.len())
    }

    fn check_aligned(&self, what: &str, values: &[u64]) -> Result<()> {
        let g = self.options.granularity as u64;
        if values.iter().any(|v| v % g != 0) {
            return Err(Error::invalid_argument(format!(
                "{what}: {values:?} not multiples of the granularity {g}"
            )));
        }
        Ok(())
    }

    fn punch(&self, offset: usize, size: usize) {
        // SAFETY: the range lies inside our memfd; punching a hole only drops its pages.
        let rc = unsafe {
            libc::fallocate(
                self.memfd,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                size as libc::off_t,
            )
        };
        if rc != 0 {
            log::warn!("{}", os_error("fallocate(PUNCH_HOLE)"));
        }
    }

    fn retire_chunk(&self, memory: &mut Memory, handle: u64) {
        let done = match memory.chunks.get(&handle) {
            Some(chunk) => chunk.released && chunk.mappings == 0,
            None => false,
        };
        if done {
            if let Some(chunk) = memory.chunks.remove(&handle) {
                match chunk.own {
                    // Closing the descriptor drops this process's hold on the memory.
                    Some(Shareable { imported: true, .. }) => memory.imported_bytes -= chunk.size,
                    Some(Shareable {
                        imported: false, ..
                    }) => memory.created_bytes -= chunk.size,
                    None => {
                        self.punch(chunk.offset, chunk.size);
                        memory.offsets.release(chunk.offset, chunk.size);
                        memory.created_bytes -= chunk.size;
                    }
                }
            }
        }
    }

    /// Bytes of imported memory this device holds (another process's).
    pub fn imported_bytes(&self) -> usize {
        lock(&self.memory).imported_bytes
    }

    /// [`Device::create_shareable`](crate::device::Device::create_shareable): a memfd of its
    /// own, counted against the device's memory like any chunk.
    pub(super) fn create_shareable_chunk(&self, size: usize) -> Result<PhysHandle> {
        if size == 0 {
            return Err(Error::invalid_argument("create_shareable: size 0"));
        }
        self.check_aligned("create_shareable", &[size as u64])?;
        let mut memory = lock(&self.memory);
        if memory.created_bytes + size > self.options.total_memory {
            return Err(Error::out_of_memory(format!(
                "host device {}: cannot create {size} shareable bytes ({} of {} in use)",
                self.ordinal, memory.created_bytes, self.options.total_memory
            )));
        }
        let fd = create_memfd(self.ordinal, size)?;
        // SAFETY: `create_memfd` hands over a descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        memory.created_bytes += size;
        Ok(insert_shareable(&mut memory, size, fd, false))
    }

    /// [`Device::export_handle`](crate::device::Device::export_handle): a duplicate of the
    /// chunk's memfd.
    pub(super) fn export_chunk(&self, handle: PhysHandle) -> Result<OwnedFd> {
        let memory = lock(&self.memory);
        match memory.chunks.get(&handle.0) {
            Some(Chunk {
                released: false,
                own: Some(own),
                ..
            }) => own
                .fd
                .try_clone()
                .map_err(|e| Error::driver(format!("export: dup: {e}"))),
            Some(c) if !c.released => Err(Error::invalid_argument(format!(
                "export: handle {} was not created shareable",
                handle.0
            ))),
            _ => Err(Error::invalid_argument(format!(
                "export: unknown handle {}",
                handle.0
            ))),
        }
    }

    /// [`Device::import_handle`](crate::device::Device::import_handle): the descriptor must
    /// name a memfd of exactly `size` bytes.
    pub(super) fn import_chunk(&self, fd: BorrowedFd<'_>, size: usize) -> Result<PhysHandle> {
        self.check_aligned("import", &[size as u64])?;
        // SAFETY: an all-zero `stat` is a valid value to be overwritten.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat on a descriptor the caller lends; `stat` is a valid out-pointer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut stat) } != 0 {
            return Err(os_error("import: fstat"));
        }
        if stat.st_mode & libc::S_IFMT != libc::S_IFREG || stat.st_size as usize != size {
            return Err(Error::invalid_argument(format!(
                "import: the descriptor is not {size} bytes of shareable memory"
            )));
        }
        let fd = fd
            .try_clone_to_owned()
            .map_err(|e| Error::driver(format!("import: dup: {e}")))?;
        let mut memory = lock(&self.memory);
        memory.imported_bytes += size;
        Ok(insert_shareable(&mut memory, size, fd, true))
    }

    /// [`Device::reserve`](crate::device::Device::reserve).
    pub(super) fn reserve_range(&self, size: usize, align: usize) -> Result<DevicePtr> {
        let align = align.max(self.options.granularity);
        if size == 0 || !align.is_power_of_two() {
            return Err(Error::invalid_argument(format!(
                "reserve: size {size} align {align}"
            )));
        }
        self.check_aligned("reserve", &[size as u64])?;
        let span = size
            .checked_add(align)
            .ok_or_else(|| Error::invalid_argument("reserve: size overflows"))?;
        let hint = next_reservation_hint(span);
        // SAFETY: an anonymous PROT_NONE mapping; the kernel takes the hint only where it is
        // free, else chooses the address.
        let raw = unsafe {
            libc::mmap(
                hint as *mut libc::c_void,
                span,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(os_error("mmap(reserve)"));
        }
        let start = raw as usize;
        let aligned = (start + align - 1) & !(align - 1);
        // SAFETY: trimming the unaligned head and tail of the mapping made above.
        unsafe {
            if aligned > start {
                libc::munmap(raw, aligned - start);
            }
            let tail = start + span - (aligned + size);
            if tail > 0 {
                libc::munmap((aligned + size) as *mut libc::c_void, tail);
            }
        }
        lock(&self.memory)
            .reservations
            .insert(aligned as DevicePtr, size);
        Ok(aligned as DevicePtr)
    }

    /// [`Device::unreserve`](crate::device::Device::unreserve).
    pub(super) fn unreserve_range(&self, va: DevicePtr, size: usize) -> Result<()> {
        let mut memory = lock(&self.memory);
        match memory.reservations.get(&va) {
            Some(&len) if len == size => {}
            _ => {
                return Err(Error::invalid_argument(format!(
                    "unreserve: {va:#x}+{size} is not a reservation"
                )))
            }
        }
        if memory.overlaps_mapping(va, size) {
            return Err(Error::new(
                ErrorKind::InvalidState,
                format!("unreserve: {va:#x}+{size} still has mappings"),
            ));
        }
        // SAFETY: the range is a reservation of ours with nothing mapped in it.
        if unsafe { libc::munmap(va as *mut libc::c_void, size) } != 0 {
            return Err(os_error("munmap"));
        }
        memory.reservations.remove(&va);
        Ok(())
    }

    /// [`Device::create_physical`](crate::device::Device::create_physical).
    pub(super) fn create_chunk(&self, size: usize) -> Result<PhysHandle> {
        if size == 0 {
            return Err(Error::invalid_argument("create_physical: size 0"));
        }
        self.check_aligned("create_physical", &[size as u64])?;
        let mut memory = lock(&self.memory);
        let offset = memory.offsets.allocate(size).ok_or_else(|| {
            Error::out_of_memory(format!(
                "host device {}: cannot create {size} bytes ({} of {} in use)",
                self.ordinal, memory.created_bytes, self.options.total_memory
            ))
        })?;
        let handle = memory.next_handle;
        memory.next_handle += 1;
        memory.chunks.insert(
            handle,
            Chunk {
                offset,
                size,
                mappings: 0,
                released: false,
                own: None,
            },
        );
        memory.created_bytes += size;
        Ok(PhysHandle(handle))
    }

    /// [`Device::release_physical`](crate::device::Device::release_physical).
    pub(super) fn release_chunk(&self, handle: PhysHandle) -> Result<()> {
        let mut memory = lock(&self.memory);
        match memory.chunks.get_mut(&handle.0) {
            Some(chunk) if !chunk.released => chunk.released = true,
            _ => {
                return Err(Error::invalid_argument(format!(
                    "release_physical: unknown handle {}",
                    handle.0
                )))
            }
        }
        self.retire_chunk(&mut memory, handle.0);
        Ok(())
    }

    /// [`Device::map`](crate::device::Device::map).
    pub(super) fn map_chunk(
        &self,
        va: DevicePtr,
        size: usize,
        handle: PhysHandle,
        offset: usize,
    ) -> Result<()> {
        self.check_aligned("map", &[va, size as u64, offset as u64])?;
        let mut memory = lock(&self.memory);
        let (fd, file_offset) = match memory.chunks.get(&handle.0) {
            // Like CUDA, only a whole handle maps (cuMemMap's offset must be 0).
            Some(chunk) if !chunk.released && offset == 0 && size == chunk.size => (
                chunk.own.as_ref().map_or(self.memfd, |own| own.fd.as_raw_fd()),
                chunk.offset,
            ),
            _ => {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!(
                        "map: handle {} cannot back {size} bytes at offset {offset}: only whole handles map",
                        handle.0
                    ),
                ))
            }
        };
        if !memory.reservation_contains(va, size) || memory.overlaps_mapping(va, size) {
            return Err(Error::invalid_argument(format!(
                "map: {va:#x}+{size} is not a free part of a reservation"
            )));
        }
        // SAFETY: the target lies inside a reservation of ours and overlaps no mapping.
        let raw = unsafe {
            libc::mmap(
                va as *mut libc::c_void,
                size,
                libc::PROT_NONE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                file_offset as libc::off_t,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(os_error("mmap(map)"));
        }
        memory.mappings.insert(
            va,
            Mapping {
                size,
                handle,
                accessible: false,
                writable: false,
            },
        );
        if let Some(chunk) = memory.chunks.get_mut(&handle.0) {
            chunk.mappings += 1;
        }
        Ok(())
    }

    /// [`Device::unmap`](crate::device::Device::unmap).
    pub(super) fn unmap_range(&self, va: DevicePtr, size: usize) -> Result<()> {
        let mut memory = lock(&self.memory);
        // Like cuMemUnmap, the range must cover whole mappings exactly.
        let end = va + size as u64;
        let covered: Vec<(DevicePtr, Mapping)> = memory
            .mappings
            .range(va..end)
            .map(|(&a, &m)| (a, m))
            .collect();
        let exact = !covered.is_empty()
            && covered[0].0 == va
            && covered
                .windows(2)
                .all(|w| w[0].0 + w[0].1.size as u64 == w[1].0)
            && covered
                .last()
                .is_some_and(|(a, m)| a + m.size as u64 == end);
        if !exact {
            return Err(Error::invalid_argument(format!(
                "unmap: {va:#x}+{size} does not cover whole mappings"
            )));
        }
        // SAFETY: replacing our own mappings with a PROT_NONE placeholder keeps the reservation.
        let raw = unsafe {
            libc::mmap(
                va as *mut libc::c_void,
                size,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(os_error("mmap(unmap)"));
        }
        super::process::revoke(va, size);
        for (addr, mapping) in covered {
            memory.mappings.remove(&addr);
            if let Some(chunk) = memory.chunks.get_mut(&mapping.handle.0) {
                chunk.mappings -= 1;
            }
            self.retire_chunk(&mut memory, mapping.handle.0);
        }
        Ok(())
    }

    /// [`Device::set_access`](crate::device::Device::set_access) and
    /// [`Device::set_access_read_only`](crate::device::Device::set_access_read_only).
    pub(super) fn grant_access(
        &self,
        va: DevicePtr,
        size: usize,
        devices: &[i32],
        writable: bool,
    ) -> Result<()> {
        if devices.is_empty() {
            return Err(Error::invalid_argument("set_access: no devices"));
        }
        if let Some(bad) = devices
            .iter()
            .find(|&&d| d < 0 || d as usize >= self.options.device_count)
        {
            return Err(Error::invalid_argument(format!(
                "set_access: no host device {bad}"
            )));
        }
        let mut memory = lock(&self.memory);
        let end = va + size as u64;
        let mut at = va;
        let mut starts = Vec::new();
        while at < end {
            match memory.mappings.range(..=at).next_back() {
                Some((&start, m)) if start + m.size as u64 > at => {
                    starts.push(start);
                    at = start + m.size as u64;
                }
                _ => {
                    return Err(Error::invalid_argument(format!(
                        "set_access: {at:#x} is not mapped"
                    )))
                }
            }
        }
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: every page of the range is one of our shared mappings.
        if unsafe { libc::mprotect(va as *mut libc::c_void, size, prot) } != 0 {
            return Err(os_error("mprotect"));
        }
        for start in starts {
            if let Some(m) = memory.mappings.get_mut(&start) {
                m.accessible = true;
                m.writable = writable;
            }
        }
        // Read-only memory is this backend's own device's alone: no peer is granted it.
        if writable {
            super::process::grant(va, size, devices);
        }
        Ok(())
    }
}

/// Books a shareable chunk with its own descriptor.
fn insert_shareable(memory: &mut Memory, size: usize, fd: OwnedFd, imported: bool) -> PhysHandle {
    let handle = memory.next_handle;
    memory.next_handle += 1;
    memory.chunks.insert(
        handle,
        Chunk {
            offset: 0,
            size,
            mappings: 0,
            released: false,
            own: Some(Shareable { fd, imported }),
        },
    );
    PhysHandle(handle)
}

/// Where the next reservation is asked for. The kernel places hint-less mappings among the
/// process's others, from the top of the address space down, so the same program's
/// reservations land in other places and orders from run to run, and a pool that breaks ties
/// between equal free blocks by address then places requests differently (a trace replayed
/// twice made different stitches). Reservations asked for one after another upwards, in a
/// region of their own, come in the order CUDA's do, and at the same addresses each run where
/// they are made in the same order (one thread; threads reserving at once share the cursor):
/// replayed so, the recorded traces reach the peaks their CUDA replays reach.
static RESERVATION_HINT: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(RESERVATION_REGION.0);

/// The region hints are taken from: 64 TiB that end about 5 TiB below where position-independent
/// programs and their heap are loaded (about 85 TiB), far below the libraries and stacks the
/// kernel maps from the top of a 47-bit address space downwards.
const RESERVATION_REGION: (usize, usize) = (16 << 40, 80 << 40);

/// A hint for a reservation of `span` bytes (0: none), moving the next one past it.
fn next_reservation_hint(span: usize) -> usize {
    use std::sync::atomic::Ordering;
    let mut now = RESERVATION_HINT.load(Ordering::Relaxed);
    loop {
        let (hint, next) = hint_after(now, span);
        match RESERVATION_HINT.compare_exchange_weak(
            now,
            next,
            Ordering::Relaxed,
            Ordering::Relaxed,
        ) {
            Ok(_) => return hint,
            Err(seen) => now = seen,
        }
    }
}

/// The hint for `span` bytes with the cursor at `now`, and the cursor after it. A span that
/// does not fit before the region's end starts again at its beginning (where a hint taken by
/// a live reservation is the kernel's choice); one larger than the region gets no hint and
/// leaves the cursor where it is.
fn hint_after(now: usize, span: usize) -> (usize, usize) {
    let (start, end) = RESERVATION_REGION;
    let step = span.next_multiple_of(1 << 21);
    if step > end - start {
        return (0, now);
    }
    match now.checked_add(step) {
        Some(next) if next <= end => (now, next),
        _ => (start, start + step),
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_device as device;
    use crate::device::{Device, Stream};
    use crate::error::ErrorKind;

    #[test]
    fn chunks_mapped_in_reverse_order_read_and_write_through() {
        let d = device();
        let g = d.granularity();
        let a = d.create_physical(g).unwrap();
        let b = d.create_physical(g).unwrap();
        let home = d.reserve(2 * g, g).unwrap();
        d.map(home, g, a, 0).unwrap();
        d.map(home + g as u64, g, b, 0).unwrap();
        d.set_access(home, 2 * g, &[0]).unwrap();
        let stitched = d.reserve(2 * g, g).unwrap();
        d.map(stitched, g, b, 0).unwrap();
        d.map(stitched + g as u64, g, a, 0).unwrap();
        d.set_access(stitched, 2 * g, &[0]).unwrap();
        unsafe {
            *(home as *mut u8) = 7;
            *((home + g as u64) as *mut u8) = 9;
            assert_eq!(*(stitched as *const u8), 9);
            assert_eq!(*((stitched + g as u64) as *const u8), 7);
            *(stitched as *mut u8) = 11;
            assert_eq!(*((home + g as u64) as *const u8), 11);
        }
        d.unmap(stitched, 2 * g).unwrap();
        d.unmap(home, 2 * g).unwrap();
        d.release_physical(a).unwrap();
        d.release_physical(b).unwrap();
        d.unreserve(stitched, 2 * g).unwrap();
        d.unreserve(home, 2 * g).unwrap();
        assert_eq!(d.live_objects(), (0, 0, 0));
        assert_eq!(d.created_bytes(), 0);
    }

    #[test]
    fn misuse_is_an_error() {
        let d = device();
        let g = d.granularity();
        assert!(d.create_physical(g + 1).is_err());
        let h = d.create_physical(g).unwrap();
        let va = d.reserve(g, g).unwrap();
        assert!(d.map(va + 4096, g, h, 0).is_err());
        assert!(d.map(va, 2 * g, h, 0).is_err());
        d.map(va, g, h, 0).unwrap();
        assert!(d.map(va, g, h, 0).is_err(), "double map");
        assert!(unsafe { d.copy_to_device(va, [0u8; 4].as_ptr(), 4, Stream::DEFAULT) }.is_err());
        assert!(d.unreserve(va, g).is_err(), "still mapped");
        d.unmap(va, g).unwrap();
        assert!(d.unmap(va, g).is_err());
        d.release_physical(h).unwrap();
        assert!(d.release_physical(h).is_err());
        let too_big = d.options().total_memory + g;
        assert_eq!(
            d.create_physical(too_big).unwrap_err().kind(),
            ErrorKind::OutOfMemory
        );
    }

    #[test]
    fn reservation_hints_go_upwards_in_granules_and_start_again_past_the_region() {
        let start = super::RESERVATION_REGION.0;
        assert_eq!(super::hint_after(start, 1), (start, start + (2 << 20)));
        assert_eq!(
            super::hint_after(start, 5 << 20),
            (start, start + (6 << 20))
        );
        let end = super::RESERVATION_REGION.1;
        assert_eq!(
            super::hint_after(end - (2 << 20), 2 << 20),
            (end - (2 << 20), end)
        );
        assert_eq!(
            super::hint_after(end, 1),
            (start, start + (2 << 20)),
            "past the end: from the start again"
        );
        assert_eq!(
            super::hint_after(end - (2 << 20), 4 << 20),
            (start, start + (4 << 20))
        );
        let now = start + (6 << 20);
        assert_eq!(
            super::hint_after(now, end - start + 1),
            (0, now),
            "larger than the region: no hint, the cursor stays"
        );
    }
}
