"""glake's copy engine from Python (no PyTorch needed): host<->device copies over several
threads and, on machines with NVLink peers, several PCIe links at once, from and to any host
memory, pageable included. glake.torch builds tensor and state-dict moves on top of it.

One engine per device is made on first use and kept until the interpreter exits (making one
starts its threads and pins its staging buffers). GLAKE_COPY_* variables tune it; GLAKE_BACKEND
chooses the backend (auto, cuda or host) as for the allocator."""

import atexit
import ctypes
import os
import threading

from . import _library

_BACKENDS = {"auto": 0, "host": 1, "cuda": 2}
_READ_ENV = 1
_ASYNC = 1


_engines = {}
_lock = threading.Lock()


def _check(status, what):
    _library.check(status, what, c_api=True)


def engine(device):
    """The engine handle of `device` (an index), made on first use."""
    with _lock:
        if device in _engines:
            return _engines[device]
        lib = _library.load()
        backend = _BACKENDS.get(os.environ.get("GLAKE_BACKEND", "auto").lower())
        if backend is None:
            raise ValueError(f"GLAKE_BACKEND must be one of {sorted(_BACKENDS)}")
        out = ctypes.c_void_p()
        _check(lib.glake_transfer_create(backend, device, _READ_ENV, ctypes.byref(out)),
               f"starting the copy engine of device {device}")
        _engines[device] = out.value
        return out.value


def to_device(device, dst, src, nbytes, stream=None, non_blocking=False):
    """Copies `nbytes` from host address `src` to device address `dst` on `device`, ordered on
    `stream` (a raw CUDA stream pointer, None for the default stream). Blocking unless
    `non_blocking`; then pageable `src` may be reused at once, pinned `src` only once the
    stream has reached the copy."""
    lib = _library.load()
    flags = _ASYNC if non_blocking else 0
    _check(lib.glake_memcpy_htod(engine(device), dst, src, nbytes, stream, flags),
           f"copying {nbytes} bytes to device {device}")


def to_host(device, dst, src, nbytes, stream=None, non_blocking=False):
    """Copies `nbytes` from device address `src` on `device` to host address `dst`; as
    to_device. A pageable `dst` holds the data when the call returns."""
    lib = _library.load()
    flags = _ASYNC if non_blocking else 0
    _check(lib.glake_memcpy_dtoh(engine(device), dst, src, nbytes, stream, flags),
           f"copying {nbytes} bytes from device {device}")


def batch(device, pieces, to_device=True, stream=None, non_blocking=False):
    """Copies many (host address, device address, bytes) pieces in one direction as one copy:
    their chunks share the engine's lanes, so many small and mid-sized tensors move at the
    speed of one large copy. Ordering and completion as for to_device / to_host."""
    pieces = list(pieces)
    if not pieces:
        return
    lib = _library.load()
    piece = _library.CopyPiece
    array = (piece * len(pieces))(*[piece(h, d, n) for h, d, n in pieces])
    flags = _ASYNC if non_blocking else 0
    direction = 0 if to_device else 1
    total = sum(n for _, _, n in pieces)
    _check(lib.glake_memcpy_batch(engine(device), direction, array, len(pieces), stream,
                                       flags),
           f"copying {len(pieces)} pieces ({total} bytes) {'to' if to_device else 'from'} "
           f"device {device}")


def stats(device):
    """Counters of `device`'s engine: copies, bytes, driver_copies, engine_bytes, paths."""
    lib = _library.load()
    out = _library.TransferStats()
    _check(lib.glake_transfer_get_stats(engine(device), ctypes.byref(out)), "stats")
    names = [name for name, _ in out._fields_ if name != "reserved"]
    return {name: getattr(out, name) for name in names}


@atexit.register
def _shutdown():
    with _lock:
        if not _engines:
            return
        lib = _library.load()
        for handle in _engines.values():
            lib.glake_transfer_destroy(handle)
        _engines.clear()
