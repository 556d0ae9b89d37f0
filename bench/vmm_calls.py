"""Times the CUDA VMM calls a stitch makes, straight through the driver (ctypes, no glake).

A stitch maps N existing physical handles into a new virtual range and grants access to it;
the grant (cuMemSetAccess) costs about 25 us per handle. This measures whether that cost can be
cut by how the grant is issued: one call over the range, one call per handle, or the range split
over several threads at once (does the driver serialise them?), for handles of several sizes.

    python3 bench/vmm_calls.py [--total-mib 1024] [--repeats 5]

With --overlap it asks instead whether a stitch's map and grant on a helper thread hold up the
thread that launches work: the main thread enqueues small asynchronous memsets back to back and
times each enqueue, alone and while a helper thread maps and grants --total-mib of 2 MiB handles
(as a stitch would), and prints both distributions. If the enqueues go on at their usual pace,
a stitch's driver calls could be taken off the launching thread; if they stall for the grant,
the driver serialises them and only fewer handles help.

    python3 bench/vmm_calls.py --overlap [--total-mib 1024] [--repeats 5]

With --deferred-grant it asks whether a range may be handed out mapped but not yet granted:
work on it is enqueued behind a stream wait on a host flag, a helper thread grants access and
then sets the flag. It prints what the driver answers for pointer queries, memsets and copies
enqueued before the grant, whether the bytes arrive, and how long the launching thread and the
helper each took.

    python3 bench/vmm_calls.py --deferred-grant [--total-mib 1024]
"""
import argparse
import ctypes
import statistics
import threading
import time

cuda = ctypes.CDLL("libcuda.so.1")


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed: {rc}")


def setup():
    check(cuda.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


PROP = Prop(type=1, requestedHandleTypes=0, location=Location(1, 0))
ACCESS = AccessDesc(location=Location(1, 0), flags=3)


def create(size):
    h = ctypes.c_ulonglong()
    check(cuda.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(PROP),
                           ctypes.c_ulonglong(0)), "cuMemCreate")
    return h


def reserve(size):
    va = ctypes.c_ulonglong()
    check(cuda.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                   ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)),
          "cuMemAddressReserve")
    return va.value


def map_all(va, handles, size):
    for i, h in enumerate(handles):
        check(cuda.cuMemMap(ctypes.c_ulonglong(va + i * size), ctypes.c_size_t(size),
                            ctypes.c_size_t(0), h, ctypes.c_ulonglong(0)), "cuMemMap")


def grant(va, length):
    check(cuda.cuMemSetAccess(ctypes.c_ulonglong(va), ctypes.c_size_t(length),
                              ctypes.byref(ACCESS), ctypes.c_size_t(1)), "cuMemSetAccess")


def unmap(va, length):
    check(cuda.cuMemUnmap(ctypes.c_ulonglong(va), ctypes.c_size_t(length)), "cuMemUnmap")


def release(va, length, handles):
    """Frees an unmapped range and its handles."""
    check(cuda.cuMemAddressFree(ctypes.c_ulonglong(va), ctypes.c_size_t(length)),
          "cuMemAddressFree")
    for h in handles:
        check(cuda.cuMemRelease(h), "cuMemRelease")


def grant_threads(ctx, va, count, size, threads):
    """The range's handles split into `threads` equal runs, each granted on its own thread."""
    per = (count + threads - 1) // threads
    errors = []

    def work(first):
        try:
            check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            n = min(per, count - first)
            if n > 0:
                grant(va + first * size, n * size)
        except RuntimeError as e:
            errors.append(e)

    workers = [threading.Thread(target=work, args=(t * per,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def enqueue_times(buf, stream, keep_going, least):
    """Microseconds of each cuMemsetD8Async on `stream`, enqueued back to back while
    `keep_going()` holds and at least `least` times."""
    times = []
    while keep_going() or len(times) < least:
        t = time.perf_counter()
        check(cuda.cuMemsetD8Async(buf, ctypes.c_ubyte(len(times) & 255), ctypes.c_size_t(1 << 16),
                                   stream), "cuMemsetD8Async")
        times.append((time.perf_counter() - t) * 1e6)
        if len(times) % 512 == 0:
            check(cuda.cuStreamSynchronize(stream), "cuStreamSynchronize")
    check(cuda.cuStreamSynchronize(stream), "cuStreamSynchronize")
    return times


def overlap(ctx, total, repeats):
    """Enqueue times alone and beside a helper thread's map and grant (see the module text)."""
    size = 2 << 20
    count = total // size
    handles = [create(size) for _ in range(count)]
    va = reserve(count * size)
    buf = ctypes.c_ulonglong()
    check(cuda.cuMemAlloc_v2(ctypes.byref(buf), ctypes.c_size_t(1 << 16)), "cuMemAlloc")
    stream = ctypes.c_void_p()
    check(cuda.cuStreamCreate(ctypes.byref(stream), ctypes.c_uint(1)), "cuStreamCreate")

    def summary(name, times, grant_ms=None):
        times = sorted(times)
        p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
        extra = f" | {grant_ms:.2f}" if grant_ms is not None else " | -"
        print(f"| {name} | {len(times)} | {statistics.median(times):.1f} | {p99:.1f} "
              f"| {times[-1]:.1f}{extra} |", flush=True)

    print(f"| enqueues of a 64 KiB memset | count | median us | p99 us | max us | helper's map "
          f"and grant of {count} x 2 MiB, ms |")
    print("|---|---|---|---|---|---|")
    for _ in range(repeats):
        summary("alone", enqueue_times(buf, stream, lambda: False, 4000))
        done = threading.Event()
        took = []

        def helper():
            check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            t = time.perf_counter()
            map_all(va, handles, size)
            grant(va, count * size)
            took.append((time.perf_counter() - t) * 1e3)
            done.set()

        worker = threading.Thread(target=helper)
        worker.start()
        times = enqueue_times(buf, stream, lambda: not done.is_set(), 1)
        worker.join()
        unmap(va, count * size)
        summary("beside the helper", times, took[0] if took else None)
    check(cuda.cuStreamDestroy_v2(stream), "cuStreamDestroy")
    check(cuda.cuMemFree_v2(buf), "cuMemFree")
    release(va, count * size, handles)


def deferred_grant(ctx, total):
    """Work enqueued on a mapped, not yet granted range behind a flag (see the module text)."""
    size = 2 << 20
    count = total // size
    handles = [create(size) for _ in range(count)]
    va = reserve(count * size)
    dev = ctypes.c_int()
    check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    for name, attr in (("stream memory operations", 92), ("wait NOR", 94)):
        v = ctypes.c_int()
        rc = cuda.cuDeviceGetAttribute(ctypes.byref(v), attr, dev)
        print(f"attribute {name}: rc {rc} value {v.value}")
    flag_host = ctypes.c_void_p()
    check(cuda.cuMemHostAlloc(ctypes.byref(flag_host), ctypes.c_size_t(4), ctypes.c_uint(3)),
          "cuMemHostAlloc")
    ctypes.memset(flag_host, 0, 4)
    flag_dev = ctypes.c_ulonglong()
    check(cuda.cuMemHostGetDevicePointer_v2(ctypes.byref(flag_dev), flag_host, 0),
          "cuMemHostGetDevicePointer")
    src_host = ctypes.c_void_p()
    check(cuda.cuMemHostAlloc(ctypes.byref(src_host), ctypes.c_size_t(1 << 20), ctypes.c_uint(1)),
          "cuMemHostAlloc")
    ctypes.memset(src_host, 0x5A, 1 << 20)
    other = ctypes.c_ulonglong()
    check(cuda.cuMemAlloc_v2(ctypes.byref(other), ctypes.c_size_t(1 << 20)), "cuMemAlloc")
    check(cuda.cuMemsetD8_v2(other, ctypes.c_ubyte(0x3C), ctypes.c_size_t(1 << 20)), "cuMemsetD8")
    stream = ctypes.c_void_p()
    check(cuda.cuStreamCreate(ctypes.byref(stream), ctypes.c_uint(1)), "cuStreamCreate")

    t0 = time.perf_counter()
    map_all(va, handles, size)
    mapped_ms = (time.perf_counter() - t0) * 1e3
    for name, attr in (("context", 1), ("memory type", 2), ("device ordinal", 9),
                       ("range start", 11), ("mapped", 16)):
        v = ctypes.c_ulonglong()
        rc = cuda.cuPointerGetAttribute(ctypes.byref(v), attr, ctypes.c_ulonglong(va + size))
        print(f"before the grant, pointer attribute {name}: rc {rc} value {v.value:#x}")
    t1 = time.perf_counter()
    rc = cuda.cuStreamWaitValue32_v2(stream, flag_dev, ctypes.c_uint(1), ctypes.c_uint(0), 0)
    print(f"cuStreamWaitValue32_v2 (GEQ) enqueue: rc {rc}")
    last = va + (count - 1) * size
    ops = (
        ("cuMemsetD8Async over the range", lambda: cuda.cuMemsetD8Async(
            ctypes.c_ulonglong(va), ctypes.c_ubyte(7), ctypes.c_size_t(count * size), stream)),
        ("cuMemcpyHtoDAsync to the last handle", lambda: cuda.cuMemcpyHtoDAsync_v2(
            ctypes.c_ulonglong(last), src_host, ctypes.c_size_t(1 << 20), stream)),
        ("cuMemcpyDtoDAsync to the first handle", lambda: cuda.cuMemcpyDtoDAsync_v2(
            ctypes.c_ulonglong(va), other, ctypes.c_size_t(1 << 20), stream)),
        ("cuMemcpyAsync (unified) to the second handle", lambda: cuda.cuMemcpyAsync(
            ctypes.c_ulonglong(va + size), other, ctypes.c_size_t(1 << 20), stream)),
    )
    for name, op in ops:
        print(f"before the grant, {name}: rc {op()}")
    enqueued_ms = (time.perf_counter() - t1) * 1e3
    rc = cuda.cuStreamQuery(stream)
    print(f"stream query while the flag is down: rc {rc} (600 = not ready)")
    granted = []

    def helper():
        check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        t = time.perf_counter()
        grant(va, count * size)
        granted.append((time.perf_counter() - t) * 1e3)
        ctypes.memmove(flag_host, ctypes.byref(ctypes.c_uint32(1)), 4)

    worker = threading.Thread(target=helper)
    worker.start()
    t2 = time.perf_counter()
    rc = cuda.cuStreamSynchronize(stream)
    waited_ms = (time.perf_counter() - t2) * 1e3
    worker.join()
    print(f"stream synchronize after the helper's grant: rc {rc}")
    out = (ctypes.c_ubyte * 16)()
    for name, addr, want in (("third handle (memset)", va + 2 * size, 7),
                             ("last handle (host copy)", last, 0x5A),
                             ("first handle (device copy)", va, 0x3C),
                             ("second handle (unified copy)", va + size, 0x3C)):
        check(cuda.cuMemcpyDtoH_v2(out, ctypes.c_ulonglong(addr + 4096), ctypes.c_size_t(16)),
              "cuMemcpyDtoH")
        print(f"bytes of the {name}: {'as written' if all(b == want for b in out) else list(out)}")
    print(f"| handles | map ms | enqueue of 5 operations ms | helper's grant ms | launching "
          f"thread's wait for the stream ms |")
    print("|---|---|---|---|---|")
    print(f"| {count} | {mapped_ms:.2f} | {enqueued_ms:.3f} | {granted[0]:.2f} | {waited_ms:.2f} |")
    unmap(va, count * size)
    check(cuda.cuStreamDestroy_v2(stream), "cuStreamDestroy")
    check(cuda.cuMemFree_v2(other), "cuMemFree")
    check(cuda.cuMemFreeHost(src_host), "cuMemFreeHost")
    check(cuda.cuMemFreeHost(flag_host), "cuMemFreeHost")
    release(va, count * size, handles)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--overlap", action="store_true",
                        help="enqueue times beside a helper thread's map and grant")
    parser.add_argument("--deferred-grant", action="store_true",
                        help="work enqueued on a mapped range before its access is granted")
    args = parser.parse_args()
    ctx = setup()
    if args.deferred_grant:
        deferred_grant(ctx, args.total_mib << 20)
        return
    if args.overlap:
        overlap(ctx, args.total_mib << 20, args.repeats)
        return
    total = args.total_mib << 20
    print("| handle MiB | handles | map ms | one grant ms | grant per handle ms "
          "| 2 threads ms | 4 threads ms | 8 threads ms | unmap ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for handle_mib in (2, 4, 8, 20, 64):
        size = handle_mib << 20
        count = total // size
        handles = [create(size) for _ in range(count)]
        va = reserve(count * size)
        times = {k: [] for k in ("map", "one", "each", "t2", "t4", "t8", "unmap")}

        def timed(key, fn):
            t = time.perf_counter()
            fn()
            times[key].append((time.perf_counter() - t) * 1e3)

        for _ in range(args.repeats):
            for key, how in (("one", lambda: grant(va, count * size)),
                             ("each", lambda: [grant(va + i * size, size) for i in range(count)]),
                             ("t2", lambda: grant_threads(ctx, va, count, size, 2)),
                             ("t4", lambda: grant_threads(ctx, va, count, size, 4)),
                             ("t8", lambda: grant_threads(ctx, va, count, size, 8))):
                timed("map", lambda: map_all(va, handles, size))
                timed(key, how)
                timed("unmap", lambda: unmap(va, count * size))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"| {handle_mib} | {count} | {med['map']:.2f} | {med['one']:.2f} | {med['each']:.2f} "
              f"| {med['t2']:.2f} | {med['t4']:.2f} | {med['t8']:.2f} | {med['unmap']:.2f} |",
              flush=True)
        release(va, count * size, handles)


if __name__ == "__main__":
    main()
