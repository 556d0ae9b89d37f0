"""How fast host memory can be page-locked for the GPU's DMA engines: cuMemHostAlloc, and
cuMemHostRegister of fresh anonymous memory (4 KiB pages, and 2 MiB transparent huge pages by
madvise), 16 GiB in 256 MiB buffers from 1, 8 and 16 threads. Why the first sleep of a region
with pinned host buffers is slow (README, "Sleep and wake"); needs only the driver.

    python3 bench/pin_speed.py
"""
import ctypes
import threading
import time
cuda = ctypes.CDLL("libcuda.so.1")
def ck(r, what):
    if r != 0: raise RuntimeError(f"{what}: {r}")
ck(cuda.cuInit(0), "init")
dev = ctypes.c_int(); ck(cuda.cuDeviceGet(ctypes.byref(dev), 0), "dev")
ctx = ctypes.c_void_p(); ck(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "ctx")
ck(cuda.cuCtxSetCurrent(ctx), "set")
cuda.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
cuda.cuMemFreeHost.argtypes = [ctypes.c_void_p]
cuda.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
cuda.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
libc = ctypes.CDLL("libc.so.6")
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
TOTAL = 16 << 30
EACH = 256 << 20
N = TOTAL // EACH
def run(mode, threads):
    ptrs = [None] * N
    def work(idx):
        ck(cuda.cuCtxSetCurrent(ctx), "set")
        for i in idx:
            if mode == "hostalloc":
                p = ctypes.c_void_p(); ck(cuda.cuMemHostAlloc(ctypes.byref(p), EACH, 0), "alloc"); ptrs[i] = p.value
            else:
                p = libc.mmap(None, EACH, 3, 0x22 | (0x8000 if mode == "register-populate" else 0), -1, 0)
                if mode == "register-thp":
                    libc.madvise(p, EACH, 14)
                ck(cuda.cuMemHostRegister_v2(p, EACH, 0), "register"); ptrs[i] = p
    t0 = time.perf_counter()
    ts = [threading.Thread(target=work, args=(range(k, N, threads),)) for k in range(threads)]
    [t.start() for t in ts]; [t.join() for t in ts]
    dt = time.perf_counter() - t0
    print(f"{mode} threads={threads}: {dt:.2f} s, {TOTAL/dt/1e9:.1f} GB/s", flush=True)
    for p in ptrs:
        if mode == "hostalloc": cuda.cuMemFreeHost(p)
        else: cuda.cuMemHostUnregister(p); libc.munmap(p, EACH)
for mode in ["hostalloc", "register", "register-thp"]:
    for threads in [1, 8, 16]:
        run(mode, threads)
print(open("/sys/kernel/mm/transparent_hugepage/enabled").read())
