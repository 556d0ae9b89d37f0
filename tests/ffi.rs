//! The C API: status codes and messages for each bad input, and a full round trip.

mod common;

use std::ffi::{c_void, CStr};
use std::ptr::null_mut;

use glake::ffi::*;
use glake_status::*;

const MIB: usize = 1 << 20;

fn message() -> String {
    unsafe { CStr::from_ptr(glake_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

fn host_config() -> glake_config {
    common::c_host_config()
}

fn create(config: &glake_config) -> *mut glake_pool {
    let mut pool = null_mut();
    let status = unsafe { glake_pool_create(config, &mut pool) };
    assert_eq!(status, GLAKE_STATUS_SUCCESS, "{}", message());
    pool
}

fn malloc(pool: *mut glake_pool, size: usize) -> (glake_status, *mut c_void) {
    let mut ptr = null_mut();
    let status = unsafe { glake_malloc(pool, size, null_mut(), &mut ptr) };
    (status, ptr)
}

#[test]
fn round_trip_with_stats_and_snapshot() {
    assert_eq!(glake_init(), GLAKE_STATUS_SUCCESS);
    let pool = create(&host_config());
    let mut backend = 0u32;
    assert_eq!(
        unsafe { glake_pool_backend(pool, &mut backend) },
        GLAKE_STATUS_SUCCESS
    );
    assert_eq!(backend, glake_backend::GLAKE_BACKEND_HOST as u32);
    let (status, ptr) = malloc(pool, 5 * MIB);
    assert_eq!(status, GLAKE_STATUS_SUCCESS);
    assert_eq!(ptr as usize % 512, 0);
    let data = [42u8; 256];
    let mut back = [0u8; 256];
    unsafe {
        assert_eq!(
            glake_copy_to_device(pool, ptr, data.as_ptr().cast(), 256, null_mut()),
            GLAKE_STATUS_SUCCESS
        );
        assert_eq!(
            glake_copy_to_host(pool, back.as_mut_ptr().cast(), ptr, 256, null_mut()),
            GLAKE_STATUS_SUCCESS
        );
    }
    assert_eq!(
        glake_stream_synchronize(pool, null_mut()),
        GLAKE_STATUS_SUCCESS
    );
    assert_eq!(back, data);
    let mut stats = std::mem::MaybeUninit::<glake::stats::MemoryStats>::zeroed();
    assert_eq!(
        unsafe { glake_get_stats(pool, stats.as_mut_ptr()) },
        GLAKE_STATUS_SUCCESS
    );
    let stats = unsafe { stats.assume_init() };
    assert_eq!(stats.allocated_bytes.all.current, 5 * MIB as i64);
    assert_eq!(stats.requested_bytes.all.current, 5 * MIB as i64);
    let mut json = null_mut();
    assert_eq!(
        unsafe { glake_snapshot_json(pool, &mut json) },
        GLAKE_STATUS_SUCCESS
    );
    let text = unsafe { CStr::from_ptr(json) }
        .to_string_lossy()
        .into_owned();
    unsafe { glake_string_free(json) };
    assert!(text.contains("\"segments\":[{"), "{text}");
    let mut stream = null_mut();
    assert_eq!(
        unsafe { glake_stream_create(pool, &mut stream) },
        GLAKE_STATUS_SUCCESS
    );
    assert_eq!(glake_record_stream(pool, ptr, stream), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_free(pool, ptr), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_stream_destroy(pool, stream), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_empty_cache(pool), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_reset_peak_stats(pool), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_reset_accumulated_stats(pool), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_pool_destroy(pool), GLAKE_STATUS_SUCCESS);
}

#[test]
fn each_bad_input_has_its_status_and_message() {
    let pool = create(&host_config());

    // NULL out-pointers and NULL pointers.
    assert_eq!(
        unsafe { glake_malloc(pool, 64, null_mut(), null_mut()) },
        GLAKE_STATUS_NULL_POINTER
    );
    assert!(message().contains("out is NULL"), "{}", message());
    assert_eq!(glake_free(pool, null_mut()), GLAKE_STATUS_NULL_POINTER);
    assert!(message().contains("ptr is NULL"));
    assert_eq!(
        unsafe { glake_pool_create(null_mut(), &mut null_mut()) },
        GLAKE_STATUS_NULL_POINTER
    );
    assert!(message().contains("config is NULL"));
    assert_eq!(
        unsafe { glake_config_default(null_mut()) },
        GLAKE_STATUS_NULL_POINTER
    );

    // Size 0 and absurd sizes.
    assert_eq!(malloc(pool, 0).0, GLAKE_STATUS_INVALID_ARGUMENT);
    assert!(message().contains("size 0"), "{}", message());
    assert_eq!(malloc(pool, usize::MAX).0, GLAKE_STATUS_INVALID_ARGUMENT);
    assert!(message().contains("beyond any device"), "{}", message());
    assert_eq!(malloc(pool, 1 << 50).0, GLAKE_STATUS_OUT_OF_MEMORY);
    assert!(
        message().contains("larger than the device"),
        "{}",
        message()
    );

    // Foreign pointer, interior pointer, double free.
    let mut local = 0u64;
    assert_eq!(
        glake_free(pool, (&mut local as *mut u64).cast()),
        GLAKE_STATUS_INVALID_POINTER
    );
    assert!(
        message().contains("not allocated by this pool"),
        "{}",
        message()
    );
    let (status, ptr) = malloc(pool, 4 * MIB);
    assert_eq!(status, GLAKE_STATUS_SUCCESS);
    let inside = unsafe { ptr.cast::<u8>().add(4096) }.cast();
    assert_eq!(glake_free(pool, inside), GLAKE_STATUS_INVALID_POINTER);
    assert!(
        message().contains("inside memory of this pool"),
        "{}",
        message()
    );
    assert_eq!(glake_free(pool, ptr), GLAKE_STATUS_SUCCESS);
    assert_eq!(message(), "", "success clears the message");
    assert_eq!(glake_free(pool, ptr), GLAKE_STATUS_DOUBLE_FREE);
    assert!(message().contains("double free"), "{}", message());
    assert_eq!(
        glake_record_stream(pool, ptr, null_mut()),
        GLAKE_STATUS_DOUBLE_FREE
    );

    // Out of range values.
    assert_eq!(
        glake_set_memory_fraction(pool, 1.5),
        GLAKE_STATUS_INVALID_ARGUMENT
    );
    assert!(message().contains("memory fraction"));
    assert_eq!(
        glake_set_memory_fraction(pool, f64::NAN),
        GLAKE_STATUS_INVALID_ARGUMENT
    );

    // Memory fraction: a request past the cap is out of memory, and the pool goes on.
    assert_eq!(glake_set_memory_fraction(pool, 1e-3), GLAKE_STATUS_SUCCESS);
    assert_eq!(malloc(pool, 512 * MIB).0, GLAKE_STATUS_OUT_OF_MEMORY);
    assert!(message().contains("cap"), "{}", message());
    let (status, small) = malloc(pool, 1000);
    assert_eq!(status, GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_free(pool, small), GLAKE_STATUS_SUCCESS);

    // Memory limit in bytes: read back exactly, and a fraction made from a budget likewise.
    assert_eq!(
        glake_set_memory_limit(pool, 0),
        GLAKE_STATUS_INVALID_ARGUMENT
    );
    assert!(message().contains("0 bytes"), "{}", message());
    assert_eq!(
        glake_set_memory_limit(pool, 64 * MIB as u64),
        GLAKE_STATUS_SUCCESS
    );
    let (mut bytes, mut fraction) = (0u64, 0f64);
    assert_eq!(
        unsafe { glake_get_memory_limit(pool, &mut bytes, &mut fraction) },
        GLAKE_STATUS_SUCCESS
    );
    assert_eq!(bytes, 64 * MIB as u64);
    let (status, within) = malloc(pool, 48 * MIB);
    assert_eq!(status, GLAKE_STATUS_SUCCESS);
    assert_eq!(malloc(pool, 32 * MIB).0, GLAKE_STATUS_OUT_OF_MEMORY);
    assert_eq!(glake_free(pool, within), GLAKE_STATUS_SUCCESS);
    let total = (bytes as f64 / fraction).round();
    let budget = 1_000_000_007u64;
    assert_eq!(
        glake_set_memory_fraction(pool, budget as f64 / total),
        GLAKE_STATUS_SUCCESS
    );
    assert_eq!(
        unsafe { glake_get_memory_limit(pool, &mut bytes, null_mut()) },
        GLAKE_STATUS_SUCCESS
    );
    assert_eq!(bytes, budget);
    assert_eq!(
        unsafe { glake_get_memory_limit(pool, null_mut(), null_mut()) },
        GLAKE_STATUS_NULL_POINTER
    );
    assert_eq!(glake_set_memory_fraction(pool, 1.0), GLAKE_STATUS_SUCCESS);

    // Peer access to a device that does not exist.
    assert_eq!(
        glake_pool_enable_peer_access(pool, 7),
        GLAKE_STATUS_UNSUPPORTED
    );
    assert!(message().contains("cannot access"), "{}", message());

    // Unknown streams on the host backend.
    assert_eq!(
        glake_stream_synchronize(pool, 0xdead0 as glake_stream),
        GLAKE_STATUS_INVALID_ARGUMENT
    );

    // Use after destroy, and a made-up handle.
    assert_eq!(glake_pool_destroy(pool), GLAKE_STATUS_SUCCESS);
    assert_eq!(malloc(pool, 64).0, GLAKE_STATUS_INVALID_HANDLE);
    assert!(message().contains("not a live pool"), "{}", message());
    assert_eq!(glake_pool_destroy(pool), GLAKE_STATUS_INVALID_HANDLE);
    assert_eq!(
        glake_empty_cache(0x1234 as *mut glake_pool),
        GLAKE_STATUS_INVALID_HANDLE
    );
    assert_eq!(glake_empty_cache(null_mut()), GLAKE_STATUS_NULL_POINTER);
}

#[test]
fn bad_configs_are_rejected() {
    let mut pool = null_mut();
    let mut config = host_config();
    config.flags = 0x80;
    assert_eq!(
        unsafe { glake_pool_create(&config, &mut pool) },
        GLAKE_STATUS_INVALID_ARGUMENT
    );
    assert!(message().contains("unknown bits 0x80"), "{}", message());
    let mut config = host_config();
    config.struct_size = 12;
    assert_eq!(
        unsafe { glake_pool_create(&config, &mut pool) },
        GLAKE_STATUS_INVALID_ARGUMENT
    );
    assert!(message().contains("struct_size"));
    let mut config = host_config();
    config.backend = 9;
    assert_eq!(
        unsafe { glake_pool_create(&config, &mut pool) },
        GLAKE_STATUS_INVALID_ARGUMENT
    );
    let mut config = host_config();
    config.reuse_limit = 0.1;
    assert_eq!(
        unsafe { glake_pool_create(&config, &mut pool) },
        GLAKE_STATUS_INVALID_ARGUMENT
    );
    assert!(message().contains("reuse_limit"));
    let mut config = host_config();
    config.device = 5;
    assert_eq!(
        unsafe { glake_pool_create(&config, &mut pool) },
        GLAKE_STATUS_NO_DEVICE
    );
    assert!(pool.is_null(), "nothing written on failure");
    let mut config = host_config();
    config.backend = glake_backend::GLAKE_BACKEND_CUDA as u32;
    let status = unsafe { glake_pool_create(&config, &mut pool) };
    if status == GLAKE_STATUS_SUCCESS {
        assert_eq!(glake_pool_destroy(pool), GLAKE_STATUS_SUCCESS);
    } else {
        assert_eq!(status, GLAKE_STATUS_NO_DEVICE, "{}", message());
    }
}

#[test]
fn status_names() {
    let name = |s: u32| {
        unsafe { CStr::from_ptr(glake_status_name(s)) }
            .to_str()
            .unwrap()
    };
    assert_eq!(
        name(GLAKE_STATUS_DOUBLE_FREE as u32),
        "GLAKE_STATUS_DOUBLE_FREE"
    );
    assert_eq!(name(999), "GLAKE_STATUS_UNKNOWN");
    let version = unsafe { CStr::from_ptr(glake_version()) }.to_str().unwrap();
    assert_eq!(version, env!("CARGO_PKG_VERSION"));
}

#[test]
fn transfers_copy_both_ways_and_refuse_bad_input() {
    let pool = create(&host_config());
    let mut transfer = null_mut();
    let host = glake_backend::GLAKE_BACKEND_HOST as u32;
    assert_eq!(
        unsafe { glake_transfer_create(host, 0, 0x80, &mut transfer) },
        GLAKE_STATUS_INVALID_ARGUMENT
    );
    assert!(message().contains("unknown bits"), "{}", message());
    assert_eq!(
        unsafe { glake_transfer_create(host, 0, GLAKE_TRANSFER_NO_PEERS, null_mut()) },
        GLAKE_STATUS_NULL_POINTER
    );
    assert_eq!(
        unsafe { glake_transfer_create(host, 0, GLAKE_TRANSFER_READ_ENV, &mut transfer) },
        GLAKE_STATUS_SUCCESS,
        "{}",
        message()
    );
    // Large enough for the lanes both ways, and one small copy for the driver.
    let len = 17 * MIB + 3;
    let (status, dst) = malloc(pool, len);
    assert_eq!(status, GLAKE_STATUS_SUCCESS);
    let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    let mut back = vec![0u8; len];
    unsafe {
        assert_eq!(
            glake_memcpy_htod(transfer, dst, data.as_ptr().cast(), len, null_mut(), 0),
            GLAKE_STATUS_SUCCESS,
            "{}",
            message()
        );
        assert_eq!(
            glake_memcpy_dtoh(
                transfer,
                back.as_mut_ptr().cast(),
                dst,
                len,
                null_mut(),
                GLAKE_MEMCPY_ASYNC
            ),
            GLAKE_STATUS_SUCCESS,
            "{}",
            message()
        );
    }
    assert!(
        back == data,
        "a pageable destination holds the data on return"
    );
    let mut one = [0u8; 1];
    unsafe {
        assert_eq!(
            glake_memcpy_dtoh(transfer, one.as_mut_ptr().cast(), dst, 1, null_mut(), 0),
            GLAKE_STATUS_SUCCESS
        );
    }
    assert_eq!(one[0], data[0]);
    let mut stats = glake_transfer_stats::default();
    assert_eq!(
        unsafe { glake_transfer_get_stats(transfer, &mut stats) },
        GLAKE_STATUS_SUCCESS
    );
    assert_eq!(stats.copies, 3);
    assert_eq!(stats.bytes, 2 * len as u64 + 1);
    assert_eq!(stats.driver_copies, 1);
    assert_eq!(stats.engine_bytes, 2 * len as u64);

    // Bad input: NULL pointers, unknown flags, a pool handle, a destroyed engine.
    unsafe {
        assert_eq!(
            glake_memcpy_htod(transfer, dst, std::ptr::null(), 16, null_mut(), 0),
            GLAKE_STATUS_NULL_POINTER
        );
        assert_eq!(
            glake_memcpy_htod(transfer, dst, data.as_ptr().cast(), 16, null_mut(), 4),
            GLAKE_STATUS_INVALID_ARGUMENT
        );
        assert_eq!(
            glake_memcpy_htod(pool.cast(), dst, data.as_ptr().cast(), 16, null_mut(), 0),
            GLAKE_STATUS_INVALID_HANDLE
        );
        assert_eq!(
            glake_memcpy_dtoh(null_mut(), back.as_mut_ptr().cast(), dst, 16, null_mut(), 0),
            GLAKE_STATUS_NULL_POINTER
        );
        assert_eq!(
            glake_transfer_get_stats(transfer, null_mut()),
            GLAKE_STATUS_NULL_POINTER
        );
    }
    assert_eq!(glake_transfer_destroy(transfer), GLAKE_STATUS_SUCCESS);
    assert_eq!(
        glake_transfer_destroy(transfer),
        GLAKE_STATUS_INVALID_HANDLE
    );
    unsafe {
        assert_eq!(
            glake_memcpy_htod(transfer, dst, data.as_ptr().cast(), 16, null_mut(), 0),
            GLAKE_STATUS_INVALID_HANDLE
        );
    }
    assert_eq!(glake_free(pool, dst), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_pool_destroy(pool), GLAKE_STATUS_SUCCESS);
}

/// SmartSwap's operator hooks through C: an iteration of ops on a pool, with the pool's own
/// allocations as the tensors; bad handles, phases and NULLs are refused.
#[test]
fn profiler_hooks_record_an_iteration() {
    let pool = create(&host_config());
    let mut profiler = null_mut();
    assert_eq!(
        unsafe { glake_profiler_create(pool, &mut profiler) },
        GLAKE_STATUS_SUCCESS,
        "{}",
        message()
    );
    let (status, weights) = malloc(pool, 4 * MIB);
    assert_eq!(status, GLAKE_STATUS_SUCCESS);
    assert_eq!(
        glake_profiler_begin_iteration(profiler),
        GLAKE_STATUS_SUCCESS
    );
    assert_eq!(
        glake_profiler_set_phase(profiler, glake_phase::GLAKE_PHASE_FORWARD as u32),
        GLAKE_STATUS_SUCCESS
    );
    let name = c"gmm_forward";
    assert_eq!(
        unsafe { glake_profiler_begin_op(profiler, name.as_ptr(), null_mut()) },
        GLAKE_STATUS_SUCCESS,
        "{}",
        message()
    );
    assert_eq!(
        glake_profiler_tensor(profiler, weights, 4 * MIB),
        GLAKE_STATUS_SUCCESS
    );
    let (_, act) = malloc(pool, 2 * MIB);
    assert_eq!(
        glake_profiler_tensor(profiler, act, 2 * MIB),
        GLAKE_STATUS_SUCCESS
    );
    assert_eq!(glake_profiler_end_op(profiler), GLAKE_STATUS_SUCCESS);
    assert_eq!(
        glake_profiler_set_phase(profiler, glake_phase::GLAKE_PHASE_BACKWARD as u32),
        GLAKE_STATUS_SUCCESS
    );
    let grad = c"gmm_backward";
    assert_eq!(
        unsafe { glake_profiler_begin_op(profiler, grad.as_ptr(), null_mut()) },
        GLAKE_STATUS_SUCCESS
    );
    assert_eq!(
        glake_profiler_tensor(profiler, act, 2 * MIB),
        GLAKE_STATUS_SUCCESS
    );
    assert_eq!(glake_free(pool, act), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_profiler_end_op(profiler), GLAKE_STATUS_SUCCESS);
    let mut summary = glake_profile_summary::default();
    assert_eq!(
        unsafe { glake_profiler_end_iteration(profiler, &mut summary) },
        GLAKE_STATUS_SUCCESS,
        "{}",
        message()
    );
    assert_eq!((summary.ops, summary.tensors), (2, 1));
    assert_eq!(summary.base_bytes, 4 * MIB as u64);
    assert_eq!(summary.peak_bytes, 6 * MIB as u64);

    // Refusals, each with its status; the profiler goes on.
    assert_eq!(
        glake_profiler_set_phase(profiler, 9),
        GLAKE_STATUS_INVALID_ARGUMENT
    );
    assert_eq!(
        glake_profiler_end_op(profiler),
        GLAKE_STATUS_INVALID_ARGUMENT
    );
    assert!(message().contains("no iteration"), "{}", message());
    assert_eq!(
        glake_profiler_begin_iteration(profiler),
        GLAKE_STATUS_SUCCESS
    );
    assert_eq!(
        unsafe { glake_profiler_begin_op(profiler, std::ptr::null(), null_mut()) },
        GLAKE_STATUS_NULL_POINTER
    );
    assert_eq!(
        glake_profiler_tensor(profiler, null_mut(), 1),
        GLAKE_STATUS_NULL_POINTER
    );
    assert_eq!(glake_profiler_destroy(profiler), GLAKE_STATUS_SUCCESS);
    assert_eq!(
        glake_profiler_destroy(profiler),
        GLAKE_STATUS_INVALID_HANDLE
    );
    assert_eq!(
        glake_profiler_begin_iteration(null_mut()),
        GLAKE_STATUS_NULL_POINTER
    );
    // The pool goes on without it.
    assert_eq!(glake_free(pool, weights), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_pool_destroy(pool), GLAKE_STATUS_SUCCESS);
}

/// Swappable allocations through C: out, in, at the same address, and their refusals.
#[test]
fn swappable_allocations_round_trip() {
    let pool = create(&host_config());
    let mut ptr: *mut c_void = null_mut();
    assert_eq!(
        unsafe { glake_malloc_swappable(pool, 3 * MIB, null_mut(), &mut ptr) },
        GLAKE_STATUS_SUCCESS
    );
    assert_eq!(
        unsafe { glake_malloc_swappable(pool, MIB, null_mut(), null_mut()) },
        GLAKE_STATUS_NULL_POINTER
    );
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    unsafe {
        assert_eq!(
            glake_copy_to_device(pool, ptr, data.as_ptr().cast(), data.len(), null_mut()),
            GLAKE_STATUS_SUCCESS
        );
        assert_eq!(
            glake_stream_synchronize(pool, null_mut()),
            GLAKE_STATUS_SUCCESS
        );
    }
    assert_eq!(glake_swap_out(pool, ptr), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_swap_out(pool, ptr), GLAKE_STATUS_INVALID_STATE);
    let mut stats = std::mem::MaybeUninit::<glake::stats::MemoryStats>::zeroed();
    assert_eq!(
        unsafe { glake_get_stats(pool, stats.as_mut_ptr()) },
        GLAKE_STATUS_SUCCESS
    );
    let stats = unsafe { stats.assume_init() };
    assert_eq!(stats.swapped_bytes.current, 4 * MIB as i64);
    assert_eq!(stats.reserved_bytes.all.current, 0);
    assert_eq!(glake_swap_in(pool, ptr), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_swap_in(pool, ptr), GLAKE_STATUS_INVALID_STATE);
    assert_eq!(glake_swap_in(pool, null_mut()), GLAKE_STATUS_NULL_POINTER);
    let mut back = vec![0u8; data.len()];
    unsafe {
        assert_eq!(
            glake_copy_to_host(pool, back.as_mut_ptr().cast(), ptr, back.len(), null_mut()),
            GLAKE_STATUS_SUCCESS
        );
        assert_eq!(
            glake_stream_synchronize(pool, null_mut()),
            GLAKE_STATUS_SUCCESS
        );
    }
    assert_eq!(back, data);
    let mut plain: *mut c_void = null_mut();
    assert_eq!(
        unsafe { glake_malloc(pool, MIB, null_mut(), &mut plain) },
        GLAKE_STATUS_SUCCESS
    );
    assert_eq!(glake_swap_out(pool, plain), GLAKE_STATUS_INVALID_POINTER);
    assert_eq!(glake_swap_out(pool, ptr), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_free(pool, ptr), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_free(pool, plain), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_pool_destroy(pool), GLAKE_STATUS_SUCCESS);
}

#[test]
fn regions_sleep_and_wake_through_the_c_api() {
    let pool = create(&host_config());
    let name = c"weights";
    assert_eq!(
        unsafe { glake_region_begin(pool, name.as_ptr()) },
        GLAKE_STATUS_SUCCESS
    );
    let (status, ptr) = malloc(pool, 5 * MIB);
    assert_eq!(status, GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_region_end(pool), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_region_end(pool), GLAKE_STATUS_INVALID_STATE);
    let data: Vec<u8> = (0..8192u32).map(|i| (i * 13 + 1) as u8).collect();
    unsafe {
        glake_copy_to_device(pool, ptr, data.as_ptr().cast(), data.len(), null_mut());
        glake_stream_synchronize(pool, null_mut());
    }
    // Host memory made ahead of the first sleep: one buffer of the region's segment, once.
    let prepare = |name: *const std::ffi::c_char, out: *mut usize| unsafe {
        glake_sleep_prepare(pool, name, out)
    };
    assert_eq!(
        prepare(std::ptr::null(), null_mut()),
        GLAKE_STATUS_NULL_POINTER
    );
    assert_eq!(
        prepare(c"unknown".as_ptr(), null_mut()),
        GLAKE_STATUS_INVALID_ARGUMENT
    );
    let mut made = 0usize;
    assert_eq!(prepare(name.as_ptr(), &mut made), GLAKE_STATUS_SUCCESS);
    assert!(made >= 5 * MIB, "{made}");
    assert_eq!(prepare(name.as_ptr(), &mut made), GLAKE_STATUS_SUCCESS);
    assert_eq!(made, 0, "nothing more to make");
    assert_eq!(prepare(name.as_ptr(), null_mut()), GLAKE_STATUS_SUCCESS);
    let sleep = |mode: u32| unsafe { glake_sleep(pool, name.as_ptr(), mode) };
    assert_eq!(sleep(7), GLAKE_STATUS_INVALID_ARGUMENT);
    assert!(message().contains("sleep mode 7"), "{}", message());
    assert_eq!(
        sleep(glake_sleep_mode::GLAKE_SLEEP_KEEP as u32),
        GLAKE_STATUS_SUCCESS
    );
    assert_eq!(
        sleep(glake_sleep_mode::GLAKE_SLEEP_KEEP as u32),
        GLAKE_STATUS_INVALID_STATE
    );
    let mut info = glake_region_info::default();
    assert_eq!(
        unsafe { glake_get_region_info(pool, name.as_ptr(), &mut info) },
        GLAKE_STATUS_SUCCESS
    );
    assert_eq!((info.asleep, info.resident_bytes), (1, 0));
    assert!(info.asleep_bytes >= 5 * MIB as u64 && info.host_bytes == info.asleep_bytes);
    assert_eq!(
        unsafe { glake_get_region_info(pool, name.as_ptr(), null_mut()) },
        GLAKE_STATUS_NULL_POINTER
    );
    assert_eq!(
        unsafe { glake_wake(pool, std::ptr::null()) },
        GLAKE_STATUS_NULL_POINTER
    );
    assert_eq!(
        unsafe { glake_wake(pool, c"unknown".as_ptr()) },
        GLAKE_STATUS_INVALID_ARGUMENT
    );
    let bad = [0xffu8, 0xfe, 0];
    assert_eq!(
        unsafe { glake_region_begin(pool, bad.as_ptr().cast()) },
        GLAKE_STATUS_INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { glake_region_begin(null_mut(), name.as_ptr()) },
        GLAKE_STATUS_NULL_POINTER
    );
    assert_eq!(
        unsafe { glake_wake(pool, name.as_ptr()) },
        GLAKE_STATUS_SUCCESS
    );
    assert_eq!(
        unsafe { glake_wake(pool, name.as_ptr()) },
        GLAKE_STATUS_INVALID_STATE
    );
    let mut back = vec![0u8; data.len()];
    unsafe {
        glake_copy_to_host(pool, back.as_mut_ptr().cast(), ptr, back.len(), null_mut());
        glake_stream_synchronize(pool, null_mut());
    }
    assert_eq!(back, data);
    assert_eq!(glake_free(pool, ptr), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_pool_destroy(pool), GLAKE_STATUS_SUCCESS);
}

/// Two blocks, forward then backward: each block's activation lives from its forward to its
/// backward; the planner's C API must bring the peak under a target and predict the same step
/// the simulator entry point predicts for the returned choices.
#[test]
fn planner_plans_and_simulates_through_the_c_api() {
    use glake_phase::*;
    let op = |gpu_ns: u64, phase: glake_phase| glake_swap_op {
        gpu_ns,
        phase: phase as u32,
    };
    let ops = [
        op(1_000_000, GLAKE_PHASE_FORWARD),
        op(1_000_000, GLAKE_PHASE_FORWARD),
        op(2_000_000, GLAKE_PHASE_BACKWARD),
        op(2_000_000, GLAKE_PHASE_BACKWARD),
    ];
    let uses0 = [3usize];
    let uses1 = [2usize];
    let tensor = |produced_at: usize, freed_after: usize, uses: &[usize]| glake_swap_tensor {
        bytes: 100 * MIB,
        produced_at,
        freed_after,
        uses: uses.as_ptr(),
        n_uses: uses.len(),
        can_recompute: 1,
        recompute_ns: 900_000,
        kind: glake_tensor_kind::GLAKE_TENSOR_ACTIVATION as u32,
    };
    let tensors = [tensor(0, 3, &uses0), tensor(1, 2, &uses1)];
    let config = glake_swap_config {
        d2h_bytes_per_s: 50_000_000_000,
        h2d_bytes_per_s: 50_000_000_000,
        prefetch: 1,
        preference: glake_swap_preference::GLAKE_SWAP_BETTER_PERFORMANCE as u32,
    };
    let base = 10 * MIB;
    // The planner over `ops` and the given tensors, writing choices for two tensors.
    let plan_into = |tensors: &[glake_swap_tensor],
                     target: usize,
                     config: *const glake_swap_config,
                     choices: &mut [glake_swap_choice; 2],
                     out: *mut glake_swap_prediction| unsafe {
        glake_swap_plan(
            ops.as_ptr(),
            ops.len(),
            tensors.as_ptr(),
            tensors.len(),
            base,
            target,
            config,
            choices.as_mut_ptr(),
            out,
        )
    };
    let simulate_into = |choices: &[glake_swap_choice; 2], out: &mut glake_swap_prediction| unsafe {
        glake_swap_simulate(
            ops.as_ptr(),
            ops.len(),
            tensors.as_ptr(),
            tensors.len(),
            base,
            choices.as_ptr(),
            &config,
            out,
        )
    };
    let mut choices = [glake_swap_choice::default(); 2];
    let mut predicted = glake_swap_prediction::default();
    let status = plan_into(
        &tensors,
        base + 150 * MIB,
        &config,
        &mut choices,
        &mut predicted,
    );
    assert_eq!(status, GLAKE_STATUS_SUCCESS, "{}", message());
    assert_eq!(predicted.baseline_peak_bytes, base + 200 * MIB);
    assert!(predicted.peak_bytes <= base + 150 * MIB, "{predicted:?}");
    assert_eq!(predicted.compute_ns, 6_000_000);
    assert!(predicted.step_ns >= predicted.compute_ns);
    assert!(
        choices
            .iter()
            .any(|c| c.action != glake_swap_action::GLAKE_SWAP_KEEP as u32),
        "something must leave the device: {choices:?}"
    );

    let mut again = glake_swap_prediction::default();
    let status = simulate_into(&choices, &mut again);
    assert_eq!(status, GLAKE_STATUS_SUCCESS, "{}", message());
    assert_eq!(again, predicted);

    // Below what any plan reaches (the base alone plus one block during its backward).
    let mut best = glake_swap_prediction::default();
    let status = plan_into(&tensors, base, &config, &mut choices, &mut best);
    assert_eq!(status, GLAKE_STATUS_OUT_OF_MEMORY);
    assert!(message().contains("cannot be met"), "{}", message());
    assert!(
        best.peak_bytes > base && best.peak_bytes < base + 200 * MIB,
        "{best:?}"
    );

    // Bad input: a NULL config, a use outside the tensor's life, an unknown action.
    let status = plan_into(&tensors, base, std::ptr::null(), &mut choices, null_mut());
    assert_eq!(status, GLAKE_STATUS_NULL_POINTER);
    let late = [3usize];
    let bad = [tensor(1, 2, &late)];
    let status = plan_into(&bad, base, &config, &mut choices, null_mut());
    assert_eq!(status, GLAKE_STATUS_INVALID_ARGUMENT);
    assert!(message().contains("outside"), "{}", message());
    let unknown = [glake_swap_choice {
        action: 7,
        ..Default::default()
    }; 2];
    let status = simulate_into(&unknown, &mut again);
    assert_eq!(status, GLAKE_STATUS_INVALID_ARGUMENT);
}

/// A synthetic training loop through the C API on the host backend: a session warms up,
/// profiles, plans for a target 60% of the unplanned peak, then keeps every iteration's
/// reserved memory within it while each activation comes back with its bytes at its address.
#[test]
fn smartswap_session_trains_under_its_target_through_the_c_api() {
    const LAYERS: usize = 6;
    let act = 4 * MIB;
    let pool = create(&host_config());
    let unplanned = LAYERS * act;
    let target = unplanned * 6 / 10;
    let settings = glake_smartswap_settings {
        target_bytes: target as u64,
        warmup_iterations: 1,
        config: glake_swap_config {
            d2h_bytes_per_s: 1 << 40,
            h2d_bytes_per_s: 1 << 40,
            prefetch: 1,
            preference: glake_swap_preference::GLAKE_SWAP_BETTER_PERFORMANCE as u32,
        },
    };
    // The defaults: the whole device as the target (nothing moves), one warm-up iteration.
    let mut defaults = std::mem::MaybeUninit::<glake_smartswap_settings>::zeroed();
    assert_eq!(
        unsafe { glake_smartswap_settings_default(pool, defaults.as_mut_ptr()) },
        GLAKE_STATUS_SUCCESS
    );
    let defaults = unsafe { defaults.assume_init() };
    assert!(defaults.target_bytes >= unplanned as u64 && defaults.warmup_iterations == 1);
    assert_eq!(
        unsafe { glake_smartswap_settings_default(pool, null_mut()) },
        GLAKE_STATUS_NULL_POINTER
    );
    let mut session = null_mut();
    assert_eq!(
        unsafe { glake_smartswap_create(pool, null_mut(), &mut session) },
        GLAKE_STATUS_NULL_POINTER
    );
    let zero = glake_smartswap_settings {
        target_bytes: 0,
        ..settings
    };
    assert_eq!(
        unsafe { glake_smartswap_create(pool, &zero, &mut session) },
        GLAKE_STATUS_INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { glake_smartswap_create(pool, &settings, &mut session) },
        GLAKE_STATUS_SUCCESS,
        "{}",
        message()
    );
    let ok = |status| assert_eq!(status, GLAKE_STATUS_SUCCESS, "{}", message());
    let fill = |seed: usize| -> Vec<u8> { (0..act).map(|i| (i * 31 + seed * 7) as u8).collect() };
    for iteration in 0..5usize {
        glake_reset_peak_stats(pool);
        ok(glake_smartswap_begin_iteration(session));
        ok(glake_smartswap_set_phase(
            session,
            glake_phase::GLAKE_PHASE_FORWARD as u32,
        ));
        let mut acts = Vec::new();
        for layer in 0..LAYERS {
            ok(unsafe { glake_smartswap_begin_op(session, c"layer".as_ptr(), null_mut()) });
            let (status, a) = malloc(pool, act);
            ok(status);
            ok(glake_smartswap_tensor(session, a, act));
            let data = fill(iteration * 10 + layer);
            unsafe {
                ok(glake_copy_to_device(
                    pool,
                    a,
                    data.as_ptr().cast(),
                    act,
                    null_mut(),
                ));
                ok(glake_stream_synchronize(pool, null_mut()));
            }
            ok(glake_smartswap_end_op(session));
            acts.push(a);
        }
        ok(glake_smartswap_set_phase(
            session,
            glake_phase::GLAKE_PHASE_BACKWARD as u32,
        ));
        for layer in (0..LAYERS).rev() {
            ok(unsafe { glake_smartswap_begin_op(session, c"layer_grad".as_ptr(), null_mut()) });
            ok(glake_smartswap_tensor(session, acts[layer], act));
            let mut back = vec![0u8; act];
            unsafe {
                ok(glake_copy_to_host(
                    pool,
                    back.as_mut_ptr().cast(),
                    acts[layer],
                    act,
                    null_mut(),
                ));
                ok(glake_stream_synchronize(pool, null_mut()));
            }
            assert!(
                back == fill(iteration * 10 + layer),
                "iteration {iteration} layer {layer}"
            );
            ok(glake_free(pool, acts[layer]));
            ok(glake_smartswap_end_op(session));
        }
        ok(glake_smartswap_end_iteration(session));
        let mut stats = std::mem::MaybeUninit::<glake::stats::MemoryStats>::zeroed();
        ok(unsafe { glake_get_stats(pool, stats.as_mut_ptr()) });
        let stats = unsafe { stats.assume_init() };
        let reserved = stats.reserved_bytes.all.peak as usize;
        if iteration >= 2 {
            assert!(
                reserved <= target,
                "iteration {iteration}: {reserved} > {target}"
            );
        } else {
            assert!(reserved >= unplanned);
        }
    }
    let mut report = glake_smartswap_report::default();
    ok(unsafe { glake_smartswap_get_report(session, &mut report) });
    assert_eq!(
        report.phase,
        glake_smartswap_phase::GLAKE_SMARTSWAP_STABLE as u32
    );
    assert_eq!(report.iterations, 5);
    assert!(report.planned_swaps > 0 && report.predicted_peak_bytes as usize <= target);
    assert_eq!(report.swapped_out, 3 * report.planned_swaps);
    assert_eq!(report.swapped_in, report.swapped_out);
    assert_eq!(
        unsafe { glake_smartswap_get_report(session, null_mut()) },
        GLAKE_STATUS_NULL_POINTER
    );
    ok(glake_smartswap_destroy(session));
    assert_eq!(
        glake_smartswap_destroy(session),
        GLAKE_STATUS_INVALID_HANDLE
    );
    ok(glake_pool_destroy(pool));
}

/// The stream-ordered swaps through the C API: queued out on a copy stream, completed by
/// glake_swap_finish, brought back by a copy the allocation's stream waits for; bad input and
/// states get their status.
#[test]
fn stream_ordered_swaps_through_the_c_api() {
    let pool = create(&host_config());
    let ok = |status| assert_eq!(status, GLAKE_STATUS_SUCCESS, "{}", message());
    let mut copy = null_mut();
    ok(unsafe { glake_stream_create(pool, &mut copy) });
    let mut ptr: *mut c_void = null_mut();
    ok(unsafe { glake_malloc_swappable(pool, 4 * MIB, null_mut(), &mut ptr) });
    let data: Vec<u8> = (0..4 * MIB).map(|i| (i * 13 + 5) as u8).collect();
    unsafe {
        ok(glake_copy_to_device(
            pool,
            ptr,
            data.as_ptr().cast(),
            data.len(),
            null_mut(),
        ));
    }
    ok(glake_swap_out_async(pool, ptr, copy));
    assert_eq!(
        glake_swap_out_async(pool, ptr, copy),
        GLAKE_STATUS_INVALID_STATE
    );
    assert_eq!(
        glake_swap_out_async(pool, null_mut(), copy),
        GLAKE_STATUS_NULL_POINTER
    );
    let mut completed = 0u64;
    ok(unsafe { glake_swap_finish(pool, 1, &mut completed) });
    assert_eq!(completed, 1);
    ok(unsafe { glake_swap_finish(pool, 0, null_mut()) });
    let mut stats = std::mem::MaybeUninit::<glake::stats::MemoryStats>::zeroed();
    ok(unsafe { glake_get_stats(pool, stats.as_mut_ptr()) });
    assert_eq!(
        unsafe { stats.assume_init() }.swapped_bytes.current,
        4 * MIB as i64
    );
    ok(glake_swap_in_async(pool, ptr, copy));
    assert_eq!(
        glake_swap_in_async(pool, ptr, copy),
        GLAKE_STATUS_INVALID_STATE
    );
    let mut back = vec![0u8; data.len()];
    unsafe {
        ok(glake_copy_to_host(
            pool,
            back.as_mut_ptr().cast(),
            ptr,
            back.len(),
            null_mut(),
        ));
        ok(glake_stream_synchronize(pool, null_mut()));
    }
    assert!(back == data);
    ok(glake_free(pool, ptr));
    ok(glake_stream_destroy(pool, copy));
    ok(glake_pool_destroy(pool));
}

/// Freeing memory used on a stream the caller has destroyed since: the free cannot order
/// itself after that stream, waits for the device instead, frees, and says both.
#[test]
fn a_free_after_its_stream_was_destroyed_frees_and_says_so() {
    let pool = create(&host_config());
    let mut stream = null_mut();
    assert_eq!(
        unsafe { glake_stream_create(pool, &mut stream) },
        GLAKE_STATUS_SUCCESS
    );
    let (status, ptr) = malloc(pool, MIB);
    assert_eq!(status, GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_record_stream(pool, ptr, stream), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_stream_destroy(pool, stream), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_free(pool, ptr), GLAKE_STATUS_INVALID_ARGUMENT);
    assert!(
        message().contains("the allocation is freed"),
        "{}",
        message()
    );
    assert_eq!(glake_free(pool, ptr), GLAKE_STATUS_DOUBLE_FREE);
    assert_eq!(glake_pool_check(pool), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_pool_destroy(pool), GLAKE_STATUS_SUCCESS);
}

#[test]
fn share_read_only_statuses() {
    let pool = create(&host_config());
    let (status, ptr) = malloc(pool, 8 * MIB);
    assert_eq!(status, GLAKE_STATUS_SUCCESS);
    let mut report = glake_share_report::default();
    // Nothing to do; NULL ranges with a count; a range outside every allocation.
    assert_eq!(
        unsafe { glake_share_read_only(pool, std::ptr::null(), 0, &mut report) },
        GLAKE_STATUS_SUCCESS
    );
    assert_eq!(
        report.shared_bytes + report.offered_bytes + report.kept_bytes,
        0
    );
    assert_eq!(
        unsafe { glake_share_read_only(pool, std::ptr::null(), 1, &mut report) },
        GLAKE_STATUS_NULL_POINTER
    );
    let outside = [glake_range {
        ptr: 64 as *mut c_void,
        bytes: 8,
    }];
    assert_eq!(
        unsafe { glake_share_read_only(pool, outside.as_ptr(), 1, &mut report) },
        GLAKE_STATUS_INVALID_POINTER
    );
    assert!(message().contains("not in an allocation"), "{}", message());
    let too_long = [glake_range {
        ptr,
        bytes: 9 * MIB,
    }];
    assert_eq!(
        unsafe { glake_share_read_only(pool, too_long.as_ptr(), 1, &mut report) },
        GLAKE_STATUS_INVALID_ARGUMENT
    );
    // The whole allocation: its four handles move to shareable memory and are offered (the
    // index lives in the user's default meeting directory). `out` may be NULL.
    let whole = [glake_range {
        ptr,
        bytes: 8 * MIB,
    }];
    assert_eq!(
        unsafe { glake_share_read_only(pool, whole.as_ptr(), 1, &mut report) },
        GLAKE_STATUS_SUCCESS,
        "{}",
        message()
    );
    assert_eq!(
        (
            report.shared_bytes + report.offered_bytes,
            report.kept_bytes
        ),
        (8 * MIB as u64, 0)
    );
    assert_eq!(
        unsafe { glake_share_read_only(pool, whole.as_ptr(), 1, null_mut()) },
        GLAKE_STATUS_SUCCESS
    );
    assert_eq!(glake_free(pool, ptr), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_pool_destroy(pool), GLAKE_STATUS_SUCCESS);
}

/// Each driver call the C API makes itself (streams, copies, the device's memory for the
/// SmartSwap settings), failed through `glake_pool_inject_fault`: the call returns the
/// injected status and names the failed call's site, the pool stays consistent, and the call
/// then succeeds. Every call site the inventory gives this sweep is failed.
#[test]
fn a_fault_at_each_driver_call_of_the_c_api_is_reported_and_passes() {
    use glake_driver_call::*;
    let mut config = host_config();
    config.flags |= GLAKE_CONFIG_FAULT_INJECTION;
    let pool = create(&config);
    let (status, ptr) = malloc(pool, MIB);
    assert_eq!(status, GLAKE_STATUS_SUCCESS);
    let data = [7u8; 4096];
    let mut back = [0u8; 4096];
    let mut stream: glake_stream = null_mut();
    let mut settings = std::mem::MaybeUninit::<glake_smartswap_settings>::zeroed();
    let mut swept = common::sites::Swept::new("ffi");
    let mut each = |call: glake_driver_call, what: &str, f: &mut dyn FnMut() -> glake_status| {
        let status =
            glake_pool_inject_fault(pool, call as u32, 1, GLAKE_STATUS_DRIVER_ERROR as u32);
        assert_eq!(status, GLAKE_STATUS_SUCCESS, "{}", message());
        assert_eq!(f(), GLAKE_STATUS_DRIVER_ERROR, "{what}");
        let reported = message();
        assert!(reported.contains("injected failure"), "{what}: {reported}");
        swept.add_reported(&reported);
        assert_eq!(
            glake_pool_check(pool),
            GLAKE_STATUS_SUCCESS,
            "{what}: {}",
            message()
        );
        assert_eq!(f(), GLAKE_STATUS_SUCCESS, "{what} again: {}", message());
    };
    each(
        GLAKE_CALL_CREATE_STREAM,
        "glake_stream_create",
        &mut || unsafe { glake_stream_create(pool, &mut stream) },
    );
    each(GLAKE_CALL_COPY, "glake_copy_to_device", &mut || unsafe {
        glake_copy_to_device(pool, ptr, data.as_ptr().cast(), data.len(), stream)
    });
    each(
        GLAKE_CALL_SYNCHRONIZE_STREAM,
        "glake_stream_synchronize",
        &mut || glake_stream_synchronize(pool, stream),
    );
    each(GLAKE_CALL_COPY, "glake_copy_to_host", &mut || unsafe {
        glake_copy_to_host(pool, back.as_mut_ptr().cast(), ptr, back.len(), stream)
    });
    assert_eq!(glake_stream_synchronize(pool, stream), GLAKE_STATUS_SUCCESS);
    each(
        GLAKE_CALL_MEM_INFO,
        "glake_smartswap_settings_default",
        &mut || unsafe { glake_smartswap_settings_default(pool, settings.as_mut_ptr()) },
    );
    let mut destroyed = false;
    each(
        GLAKE_CALL_DESTROY_STREAM,
        "glake_stream_destroy",
        &mut || {
            assert!(!destroyed, "destroyed twice");
            let status = glake_stream_destroy(pool, stream);
            destroyed = status == GLAKE_STATUS_SUCCESS;
            status
        },
    );
    assert_eq!(back, data);
    assert_eq!(glake_free(pool, ptr), GLAKE_STATUS_SUCCESS);
    assert_eq!(glake_pool_destroy(pool), GLAKE_STATUS_SUCCESS);
    swept.assert_covers(None);
}
