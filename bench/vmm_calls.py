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
    check(cuda.cuMemAddressFree(ctypes.c_ulonglong(va), ctypes.c_size_t(count * size)),
          "cuMemAddressFree")
    for h in handles:
        check(cuda.cuMemRelease(h), "cuMemRelease")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--overlap", action="store_true",
                        help="enqueue times beside a helper thread's map and grant")
    args = parser.parse_args()
    ctx = setup()
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
        check(cuda.cuMemAddressFree(ctypes.c_ulonglong(va), ctypes.c_size_t(count * size)),
              "cuMemAddressFree")
        for h in handles:
            check(cuda.cuMemRelease(h), "cuMemRelease")


if __name__ == "__main__":
    main()
