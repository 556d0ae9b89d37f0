"""Finds and loads libgmlake.so, the allocator library this package drives."""

import ctypes
import os
import pathlib

ENV_LIBRARY = "GLAKE_LIBRARY"
_NAME = "libgmlake.so"


def candidates():
    """Where the library may be, in the order tried: $GLAKE_LIBRARY, this package, and the
    release build of the repository this package sits in (for development)."""
    here = pathlib.Path(__file__).resolve().parent
    found = []
    if os.environ.get(ENV_LIBRARY):
        found.append(pathlib.Path(os.environ[ENV_LIBRARY]))
    found.append(here / _NAME)
    found.append(here.parent.parent / "target" / "release" / _NAME)
    return found


def path():
    """The library's path; FileNotFoundError naming every place looked at."""
    tried = candidates()
    for candidate in tried:
        if candidate.is_file():
            return str(candidate)
    looked = ", ".join(str(c) for c in tried)
    raise FileNotFoundError(
        f"{_NAME} not found (looked at {looked}); build it with "
        f"`cargo build --release -p gmlake` or set {ENV_LIBRARY}"
    )


class TransferStats(ctypes.Structure):
    """glake_transfer_stats."""
    _fields_ = [
        ("copies", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("driver_copies", ctypes.c_uint64),
        ("engine_bytes", ctypes.c_uint64),
        ("paths", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


class CopyPiece(ctypes.Structure):
    """glake_copy_piece."""
    _fields_ = [("host", ctypes.c_void_p), ("device", ctypes.c_void_p), ("bytes", ctypes.c_size_t)]


_lib = None


def load():
    """The loaded library, with argument and result types declared for the calls made here."""
    global _lib
    if _lib is not None:
        return _lib
    lib = ctypes.CDLL(path())
    c_int, c_char_p = ctypes.c_int, ctypes.c_char_p
    out_text = ctypes.POINTER(ctypes.c_void_p)
    for name in ("gmlake_stats_json", "gmlake_snapshot_json"):
        fn = getattr(lib, name)
        fn.argtypes = [c_int, out_text]
        fn.restype = c_int
    for name in ("gmlake_reset_peak_stats", "gmlake_reset_accumulated_stats"):
        fn = getattr(lib, name)
        fn.argtypes = [c_int]
        fn.restype = None
    lib.gmlake_pool_allocations_json.argtypes = [
        c_int, ctypes.c_uint64, ctypes.c_uint64, out_text]
    lib.gmlake_pool_allocations_json.restype = c_int
    lib.gmlake_call_times_json.argtypes = [out_text]
    lib.gmlake_call_times_json.restype = c_int
    lib.glake_string_free.argtypes = [ctypes.c_void_p]
    lib.glake_string_free.restype = None
    lib.gmlake_set_memory_limit.argtypes = [ctypes.c_uint64, c_int]
    lib.gmlake_set_memory_limit.restype = c_int
    lib.gmlake_memory_limit.argtypes = [
        c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_double)]
    lib.gmlake_memory_limit.restype = c_int
    lib.gmlake_last_error.argtypes = []
    lib.gmlake_last_error.restype = c_char_p
    # The copy engine's C API (glake_*: statuses, message from glake_last_error_message).
    handle, u32 = ctypes.c_void_p, ctypes.c_uint32
    lib.glake_transfer_create.argtypes = [u32, ctypes.c_int32, u32, ctypes.POINTER(handle)]
    lib.glake_transfer_destroy.argtypes = [handle]
    for name in ("glake_memcpy_htod", "glake_memcpy_dtoh"):
        getattr(lib, name).argtypes = [handle, handle, handle, ctypes.c_size_t, handle, u32]
    lib.glake_memcpy_batch.argtypes = [handle, u32, ctypes.POINTER(CopyPiece), ctypes.c_size_t,
                                       handle, u32]
    lib.glake_transfer_get_stats.argtypes = [handle, ctypes.POINTER(TransferStats)]
    for name in ("glake_transfer_create", "glake_transfer_destroy", "glake_memcpy_htod",
                 "glake_memcpy_dtoh", "glake_memcpy_batch", "glake_transfer_get_stats"):
        getattr(lib, name).restype = u32
    # SmartSwap's planner (structures in glake.swap.planner, passed by pointer).
    size, ptr = ctypes.c_size_t, ctypes.c_void_p
    lib.glake_swap_plan.argtypes = [ptr, size, ptr, size, size, size, ptr, ptr, ptr]
    lib.glake_swap_simulate.argtypes = [ptr, size, ptr, size, size, ptr, ptr, ptr]
    lib.glake_swap_plan.restype = u32
    lib.glake_swap_simulate.restype = u32
    lib.glake_last_error_message.argtypes = []
    lib.glake_last_error_message.restype = c_char_p
    _lib = lib
    return lib


def check(status, what=None, c_api=False):
    """Raises RuntimeError with the library's message when `status` is not 0: the message of
    the glake_* C API when `c_api`, else the plug-in's (gmlake_*)."""
    if status == 0:
        return
    lib = load()
    message = (lib.glake_last_error_message() if c_api else lib.gmlake_last_error())
    message = message.decode(errors="replace")
    raise RuntimeError(f"glake: {what} failed: {message}" if what else message)


def text(fn, *args):
    """Calls a gmlake_*_json function with `args` and returns its text."""
    lib = load()
    out = ctypes.c_void_p()
    check(fn(*args, ctypes.byref(out)))
    try:
        return ctypes.string_at(out.value).decode()
    finally:
        lib.glake_string_free(out)


def symbol_address(lib, name):
    """The address of exported function `name` (what PyTorch's allocator setters take)."""
    address = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    if not address:
        raise RuntimeError(f"{name} is missing from {path()}")
    return address
