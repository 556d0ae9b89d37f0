"""Times the CUDA VMM calls a stitch makes, straight through the driver (ctypes, no glake).

A stitch maps N existing physical handles into a new virtual range and grants access to it;
the grant (cuMemSetAccess) costs about 25 us per handle. This measures whether that cost can be
cut by how the grant is issued: one call over the range, one call per handle, or the range split
over several threads at once (does the driver serialise them?), for handles of several sizes.

    python3 bench/vmm_calls.py [--total-mib 1024] [--repeats 5]
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ctx = setup()
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
