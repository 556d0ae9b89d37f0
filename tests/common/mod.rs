//! Helpers shared by the integration tests: the backend under test and byte patterns written
//! and read back through the device's own copy calls, so the same tests run on every backend.
#![allow(dead_code)]

pub mod sites;

use std::sync::Arc;

use glake::device::fault::FaultDevice;
use glake::device::host::{HostDevice, HostOptions};
use glake::device::{DevicePtr, SharedDevice, Stream};

/// `GLAKE_TEST_BACKEND=cuda` runs the suite on the GPU; the default is the host backend.
pub fn backend_is_cuda() -> bool {
    std::env::var("GLAKE_TEST_BACKEND").is_ok_and(|v| v == "cuda")
}

/// A fresh device of the backend under test.
pub fn device() -> SharedDevice {
    if backend_is_cuda() {
        Arc::new(glake::device::cuda::CudaDevice::open(0).expect("CUDA device 0"))
    } else {
        Arc::new(HostDevice::new(0, HostOptions::default()).expect("host device"))
    }
}

/// A host device with `total` bytes of memory (for budget tests that must run anywhere).
pub fn host_device(total: usize) -> Arc<HostDevice> {
    Arc::new(
        HostDevice::new(
            0,
            HostOptions {
                total_memory: total,
                ..HostOptions::default()
            },
        )
        .expect("host device"),
    )
}

pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The sample of offsets that a pattern covers: all of a small range, else its head, middle and
/// tail (whole multi-megabyte buffers would make the tests slow without finding more).
fn spans(len: usize) -> Vec<(usize, usize)> {
    const SPAN: usize = 4096;
    if len <= 3 * SPAN {
        return vec![(0, len)];
    }
    vec![(0, SPAN), (len / 2 - SPAN / 2, SPAN), (len - SPAN, SPAN)]
}

/// Writes the pattern of `seed` into `[ptr, ptr+len)` and waits for it.
pub fn write_pattern(device: &SharedDevice, ptr: DevicePtr, len: usize, seed: u64) {
    for (offset, n) in spans(len) {
        let bytes = pattern(seed ^ offset as u64, n);
        unsafe {
            device
                .copy_to_device(ptr + offset as u64, bytes.as_ptr(), n, Stream::DEFAULT)
                .expect("copy to device");
        }
        device.synchronize_stream(Stream::DEFAULT).expect("sync");
    }
}

/// True when `[ptr, ptr+len)` still holds the pattern of `seed`.
pub fn has_pattern(device: &SharedDevice, ptr: DevicePtr, len: usize, seed: u64) -> bool {
    spans(len).into_iter().all(|(offset, n)| {
        let mut back = vec![0u8; n];
        unsafe {
            device
                .copy_to_host(back.as_mut_ptr(), ptr + offset as u64, n, Stream::DEFAULT)
                .expect("copy to host");
        }
        device.synchronize_stream(Stream::DEFAULT).expect("sync");
        back == pattern(seed ^ offset as u64, n)
    })
}

/// Reads `len` bytes at `ptr`.
pub fn read(device: &SharedDevice, ptr: DevicePtr, len: usize) -> Vec<u8> {
    let mut back = vec![0u8; len];
    unsafe {
        device
            .copy_to_host(back.as_mut_ptr(), ptr, len, Stream::DEFAULT)
            .expect("copy to host");
    }
    device.synchronize_stream(Stream::DEFAULT).expect("sync");
    back
}

/// Writes `bytes` at `ptr`.
pub fn write(device: &SharedDevice, ptr: DevicePtr, bytes: &[u8]) {
    unsafe {
        device
            .copy_to_device(ptr, bytes.as_ptr(), bytes.len(), Stream::DEFAULT)
            .expect("copy to device");
    }
    device.synchronize_stream(Stream::DEFAULT).expect("sync");
}

/// The C API's default pool configuration on the host backend.
pub fn c_host_config() -> glake::ffi::glake_config {
    let mut config = std::mem::MaybeUninit::<glake::ffi::glake_config>::zeroed();
    // SAFETY: a valid place for one config.
    let status = unsafe { glake::ffi::glake_config_default(config.as_mut_ptr()) };
    assert_eq!(status, glake::ffi::glake_status::GLAKE_STATUS_SUCCESS);
    // SAFETY: written by glake_config_default.
    let mut config = unsafe { config.assume_init() };
    config.backend = glake::ffi::glake_backend::GLAKE_BACKEND_HOST as u32;
    config
}

/// The driver calls of each kind that `work` makes on `fault`, those it made at least once.
pub fn calls_made(
    fault: &glake::device::fault::FaultDevice,
    work: impl FnOnce(),
) -> Vec<(glake::device::CallKind, u64)> {
    use glake::device::CallKind;
    let before: Vec<u64> = CallKind::ALL.iter().map(|&k| fault.calls(k)).collect();
    work();
    CallKind::ALL
        .iter()
        .zip(before)
        .map(|(&k, b)| (k, fault.calls(k) - b))
        .filter(|&(_, n)| n > 0)
        .collect()
}

/// A pool with the default configuration on a host device of `total` bytes, with the device
/// as itself and as the seam.
pub fn host_pool(total: usize) -> (Arc<HostDevice>, SharedDevice, glake::Pool) {
    let host = host_device(total);
    let device: SharedDevice = host.clone();
    let pool = glake::Pool::new(device.clone(), glake::config::Config::default()).expect("pool");
    (host, device, pool)
}

/// The pool's own bookkeeping is consistent.
pub fn check(pool: &glake::Pool) {
    pool.check_invariants().expect("invariants");
}

/// A fault sweep: `calls` (from [`calls_made`]) must include every kind in `expected`; then
/// `run(kind, n, None)` replays the scenario with the `n`-th call of `kind` failing, for every
/// call made, checks what it must and returns its fault device, on which the failure must have
/// fired. Then each of the first `aftermath` calls that followed that failure fails in turn
/// too, in runs `run(kind, n, Some(j))` that plan
/// [`glake::device::fault::FaultDevice::fail_after_failure`]`(j)` as well (the clean-up of a
/// failure failing). The sites failed are added to `swept`.
pub fn sweep_every_call(
    what: &str,
    calls: &[(glake::device::CallKind, u64)],
    expected: &[glake::device::CallKind],
    aftermath: usize,
    swept: &mut sites::Swept,
    mut run: impl FnMut(glake::device::CallKind, u64, Option<u64>) -> Arc<FaultDevice>,
) {
    for kind in expected {
        assert!(
            calls.iter().any(|&(k, _)| k == *kind),
            "{what}: no {kind:?} in {calls:?}"
        );
    }
    for &(kind, count) in calls {
        for n in 1..=count {
            let fault = run(kind, n, None);
            assert_eq!(fault.injected(), 1, "{what}: {kind:?} #{n} did not fire");
            swept.add(&fault);
            let after = fault.calls_after_failure().len().min(aftermath);
            for j in 1..=after as u64 {
                let fault = run(kind, n, Some(j));
                assert_eq!(
                    fault.injected(),
                    2,
                    "{what}: {kind:?} #{n}, then call {j} after it: did not fire"
                );
                swept.add(&fault);
            }
        }
    }
}
