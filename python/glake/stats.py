"""glake's statistics and snapshots, read from libgmlake.so (no PyTorch needed)."""

import ctypes
import json

from . import _library


def flat(device):
    """Statistics of `device` as PyTorch's flat memory_stats() dict, plus glake.* counters
    (zeros for a device not used yet)."""
    lib = _library.load()
    return json.loads(_library.text(lib.gmlake_stats_json, device))


def snapshot(device):
    """glake's snapshot of `device` (None for a device not used yet)."""
    lib = _library.load()
    return json.loads(_library.text(lib.gmlake_snapshot_json, device))


def pool_allocations(device, pool_id):
    """Addresses of the live allocations of private pool `pool_id` (PyTorch's MempoolId_t, a
    pair) of `device`, or None when that pool is not open."""
    lib = _library.load()
    first, second = pool_id
    return json.loads(_library.text(lib.gmlake_pool_allocations_json, device, first, second))


def call_times():
    """Calls of the allocator's malloc and free and the nanoseconds spent inside them, all
    devices together: {"enabled", "malloc_calls", "malloc_ns", "free_calls", "free_ns"}.
    Counted only when GLAKE_TIME_CALLS=1 was set before the library was loaded."""
    lib = _library.load()
    return json.loads(_library.text(lib.gmlake_call_times_json))


def nested(flat_stats):
    """PyTorch's nested form of memory_stats(): "a.b.c" -> {"a": {"b": {"c": value}}}."""
    out = {}
    for key, value in flat_stats.items():
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def reset_peak(device):
    _library.load().gmlake_reset_peak_stats(device)


def reset_accumulated(device):
    _library.load().gmlake_reset_accumulated_stats(device)


def set_memory_limit(device, limit):
    """Caps `device`'s physical memory at `limit` bytes (the device's total at most), replacing
    any earlier cap or fraction."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise ValueError(f"memory limit must be a positive number of bytes, not {limit!r}")
    _library.check(_library.load().gmlake_set_memory_limit(limit, device))


def memory_limit(device):
    """`device`'s cap as (bytes, fraction): the fraction last set, or the byte cap's share."""
    lib = _library.load()
    out_bytes, out_fraction = ctypes.c_uint64(), ctypes.c_double()
    _library.check(lib.gmlake_memory_limit(device, ctypes.byref(out_bytes), ctypes.byref(out_fraction)))
    return out_bytes.value, out_fraction.value
