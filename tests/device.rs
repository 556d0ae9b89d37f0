//! The device seam's timed events (the profiler's op times), on the backend under test.

mod common;

use glake::ErrorKind;

const MIB: usize = 1 << 20;

/// Timed events around a copy measure it: a positive span that grows with the work between
/// them; plain events, events never recorded or not complete are refused, and nothing leaks.
#[test]
fn timed_events_measure_the_work_between_them() {
    let device = common::device();
    let stream = device.create_stream().unwrap();
    let start = device.create_timed_event().unwrap();
    let end = device.create_timed_event().unwrap();
    let plain = device.create_event().unwrap();
    // Never recorded: no time yet.
    let err = device.elapsed_ns(start, end).unwrap_err();
    if !common::backend_is_cuda() {
        assert_eq!(err.kind(), ErrorKind::InvalidState, "{err}");
    }
    let len = 64 * MIB;
    let va = device.reserve(len, device.granularity()).unwrap();
    let handle = device.create_physical(len).unwrap();
    device.map(va, len, handle, 0).unwrap();
    device.set_access(va, len, &[device.ordinal()]).unwrap();
    let data = vec![7u8; len];
    let span = |copies: usize| {
        device.record_event(start, stream).unwrap();
        for _ in 0..copies {
            // SAFETY: `data` outlives the copy, synchronised below; `va` holds `len` bytes.
            unsafe {
                device
                    .copy_to_device(va, data.as_ptr(), len, stream)
                    .unwrap()
            };
        }
        device.record_event(end, stream).unwrap();
        device.synchronize_stream(stream).unwrap();
        device.elapsed_ns(start, end).unwrap()
    };
    let one = span(1);
    let eight = span(8);
    assert!(one > 0, "a 64 MiB copy takes time");
    assert!(
        eight > one,
        "eight copies ({eight} ns) take longer than one ({one} ns)"
    );
    // A plain event has no time to give.
    device.record_event(plain, stream).unwrap();
    device.synchronize_stream(stream).unwrap();
    assert!(device.elapsed_ns(start, plain).is_err());
    device.destroy_event(plain).unwrap();
    device.destroy_event(start).unwrap();
    device.destroy_event(end).unwrap();
    if !common::backend_is_cuda() {
        // The driver's event handles are pointers: passing a destroyed one is undefined.
        assert!(
            device.elapsed_ns(start, end).is_err(),
            "destroyed events are unknown"
        );
    }
    device.unmap(va, len).unwrap();
    device.release_physical(handle).unwrap();
    device.unreserve(va, len).unwrap();
    device.destroy_stream(stream).unwrap();
}
