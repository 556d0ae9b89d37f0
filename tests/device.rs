//! The device seam's timed events (the profiler's op times), on the backend under test, and
//! the call sites a fault-injecting device records.

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

/// Each driver call names the line of the caller that made it, through a shared device, a
/// fault device over another fault device, and a forwarding function that is itself
/// `#[track_caller]`; a failure records the site it fired at.
#[test]
fn driver_calls_are_known_by_the_line_that_made_them() {
    use glake::device::fault::{CallSite, FaultDevice};
    use glake::device::{CallKind, SharedDevice};
    use std::sync::Arc;

    let inner = Arc::new(FaultDevice::new(common::device()));
    let fault = Arc::new(FaultDevice::new(inner.clone()));
    let device: SharedDevice = fault.clone();
    let site = |kind, line, column| CallSite {
        kind,
        file: file!(),
        line,
        column,
    };
    let first = line!() + 1;
    let event = device.create_event().unwrap();
    #[track_caller]
    fn record(device: &SharedDevice, event: glake::device::Event) -> glake::Result<()> {
        device.record_event(event, glake::device::Stream::DEFAULT)
    }
    fault.fail_nth(CallKind::RecordEvent, 1);
    let third = line!() + 1;
    assert!(record(&device, event).is_err());
    let fourth = line!() + 1;
    record(&device, event).unwrap();
    // Written over two lines: the line of the method's name is the site's.
    #[rustfmt::skip]
    let destroyed = device
        .destroy_event(event);
    let destroy = line!() - 1;
    destroyed.unwrap();
    assert_eq!(
        fault.sites_called(),
        vec![
            (site(CallKind::CreateEvent, first, 24), 1),
            (site(CallKind::DestroyEvent, destroy, 10), 1),
            (site(CallKind::RecordEvent, third, 13), 1),
            (site(CallKind::RecordEvent, fourth, 5), 1),
        ]
    );
    assert_eq!(
        fault.sites_failed(),
        vec![site(CallKind::RecordEvent, third, 13)]
    );
    // The column is that of the method's name; the inner device sees its caller, the outer
    // device's forwarding.
    assert!(inner
        .sites_called()
        .iter()
        .all(|(s, _)| s.file.ends_with("interpose.rs")));
}

/// A failure planned after another fails the call that many calls later, whatever its kind,
/// and only once the first failure has fired; the kinds of the calls after a failure are kept
/// until `clear`.
#[test]
fn a_failure_can_follow_another() {
    use glake::device::fault::FaultDevice;
    use glake::device::{CallKind, SharedDevice, Stream};
    use std::sync::Arc;

    let fault = Arc::new(FaultDevice::new(common::device()));
    let device: SharedDevice = fault.clone();
    fault.fail_nth(CallKind::RecordEvent, 2);
    fault.fail_after_failure(2);
    let event = device.create_event().unwrap();
    device.record_event(event, Stream::DEFAULT).unwrap();
    device.synchronize_stream(Stream::DEFAULT).unwrap();
    assert!(device.record_event(event, Stream::DEFAULT).is_err());
    device.query_event(event).unwrap();
    assert!(device.synchronize_stream(Stream::DEFAULT).is_err());
    device.synchronize_stream(Stream::DEFAULT).unwrap();
    assert_eq!(fault.injected(), 2);
    assert_eq!(
        fault.calls_after_failure(),
        vec![CallKind::SynchronizeStream]
    );
    fault.clear();
    device.query_event(event).unwrap();
    assert_eq!(
        fault.calls_after_failure(),
        vec![CallKind::SynchronizeStream]
    );
    let failed: Vec<CallKind> = fault.sites_failed().iter().map(|s| s.kind).collect();
    assert_eq!(
        failed,
        vec![CallKind::RecordEvent, CallKind::SynchronizeStream]
    );
    device.destroy_event(event).unwrap();
}

/// A failure planned at a call site fails that site's call, not another call of its kind; a
/// failure after the call makes the call first.
#[test]
fn a_failure_can_be_planned_at_a_call_site_or_after_the_call() {
    use glake::device::fault::FaultDevice;
    use glake::device::{CallKind, SharedDevice, Stream};
    use std::sync::Arc;

    let fault = Arc::new(FaultDevice::new(common::device()));
    let device: SharedDevice = fault.clone();
    let event = device.create_event().unwrap();
    let record = |device: &SharedDevice| device.record_event(event, Stream::DEFAULT);
    let sync = |device: &SharedDevice| device.synchronize_stream(Stream::DEFAULT);
    record(&device).unwrap();
    sync(&device).unwrap();
    let site = |kind| {
        fault
            .sites_called()
            .into_iter()
            .find(|(s, _)| s.kind == kind)
            .unwrap()
            .0
    };
    let record_site = site(CallKind::RecordEvent);
    fault.fail_at(record_site, 2);
    device.record_event(event, Stream::DEFAULT).unwrap(); // another site
    record(&device).unwrap();
    assert!(record(&device).is_err());
    record(&device).unwrap();
    assert_eq!(fault.sites_failed(), vec![record_site]);
    // Failing after the call: the recorded work was waited for all the same.
    fault.fail_nth_after_call(CallKind::SynchronizeStream, 1);
    assert!(sync(&device).is_err());
    assert!(device.query_event(event).unwrap());
    device.destroy_event(event).unwrap();
}
