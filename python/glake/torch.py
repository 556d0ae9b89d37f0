"""glake as PyTorch's CUDA allocator.

    import glake.torch
    glake.torch.enable()                      # before the first CUDA tensor
    glake.torch.enable(frag_limit="64M")      # with configuration

or with no code change: `GLAKE_ENABLE=1 python train.py` (installed package) or
`python -m glake.run train.py` (see glake.run).

enable() installs glake's native allocator: an implementation of PyTorch's C++ allocator
interface built for the installed torch on first use (glake/native), so that every PyTorch
memory tool (memory_stats, _record_memory_history and memory_viz, MemPool, CUDA graph pools,
typed out-of-memory errors and observers) answers from glake. Where it cannot be built (no C++
compiler or CUDA headers), enable() falls back to libgmlake.so through
torch.cuda.memory.CUDAPluggableAllocator, with statistics and snapshots served by glake, and
info() says which path is active and why.

Configuration: keywords of enable() (below), else the environment: GLAKE_* variables or
GMLake's names (vmmDefragment, fragLimit, reuseLimit, defragLevel, autoGC, ...).
"""

import os
import warnings

import torch as _torch

from . import _library, options
from . import transfer as _transfer
from . import stats as _stats
from . import sleep as _sleep
from . import dedup as _dedup

# Sleep and wake of regions (glake.sleep); torch_memory_saver's object under its own name, so
# `from glake.torch import torch_memory_saver` is the whole switch.
region, sleep, wake, region_info = _sleep.region, _sleep.sleep, _sleep.wake, _sleep.info
prepare_sleep = _sleep.prepare
sleep_when_idle, memory_saver = _sleep.sleep_when_idle, _sleep.memory_saver
torch_memory_saver = memory_saver
# Replicas of a model on one GPU hold its weights once (glake.dedup).
share_weights = _dedup.share_weights

_state = {"allocator": None, "path": None, "native": None, "reason": None}


def is_enabled():
    return _state["allocator"] is not None


def library_path():
    """Path of the libgmlake.so that enable() loads (or would load)."""
    return _library.path()


def info():
    """Which way glake serves PyTorch: {"enabled", "path" ("native": glake's implementation of
    PyTorch's C++ allocator interface, built for this torch; "pluggable": libgmlake.so through
    torch.cuda.memory.CUDAPluggableAllocator; None: not enabled), "library" (libgmlake.so),
    "native_library" (the built allocator, if native) and "reason" (why native is not used)}."""
    try:
        library = _library.path()
    except FileNotFoundError:
        library = None
    return {
        "enabled": is_enabled(),
        "path": _state["path"],
        "library": library,
        "native_library": _state["native"],
        "reason": _state["reason"],
    }


def _native_choice(native):
    """True: native or fail; False: pluggable; None: native where it builds, else pluggable."""
    if native is not None:
        return bool(native)
    value = os.environ.get("GLAKE_NATIVE", "auto").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return None


def enable(native=None, swap=None, **config):
    """Makes glake PyTorch's CUDA allocator. Call before any CUDA memory is allocated; calling
    again is a no-op. Raises RuntimeError when CUDA is already initialised.

    With GLAKE_SLEEP_IDLE=<seconds> every allocation goes to one sleep region
    (GLAKE_SLEEP_REGION, default "process") and the first module called sleeps it after that
    many idle seconds and wakes it before its next forward (glake.sleep.sleep_when_idle).

    `swap` turns on SmartSwap for the first model trained (glake.swap): True, or a dict of its
    settings ({"target": 0.6, ...}); by default on when GLAKE_SWAP_TARGET is set.

    `native` (default: $GLAKE_NATIVE, else automatic) chooses the way in: glake's own
    implementation of PyTorch's C++ allocator interface, built for the installed torch on first
    use and cached (every PyTorch memory tool works through it), or CUDAPluggableAllocator.
    Automatic takes the native path when it builds and says why when it does not (info())."""
    if is_enabled():
        return
    env = options.environment(**config)
    if swap is None and os.environ.get("GLAKE_SWAP_TARGET"):
        swap = True
    if swap:
        from . import swap as _swap

        _swap.enable_auto(**(swap if isinstance(swap, dict) else {}))
    idle = os.environ.get("GLAKE_SLEEP_IDLE")
    if idle and not _torch.cuda.is_initialized():
        # The whole process's memory in one region (read when the first pool is made), put
        # to sleep when the first module called has been idle that long.
        os.environ.setdefault("GLAKE_SLEEP_REGION", "process")
        _sleep.enable_auto_idle(float(idle), os.environ["GLAKE_SLEEP_REGION"])
    if _torch.cuda.is_initialized():
        raise RuntimeError(
            "glake.torch.enable() must run before CUDA is initialised in this process "
            "(before the first CUDA tensor, torch.cuda.* memory call or model.cuda()); "
            "call it at the top of the program"
        )
    os.environ.update(env)
    path = _library.path()
    _library.load()
    choice = _native_choice(native)
    if choice is not False:
        from . import native as _native

        try:
            _state["native"] = _native.install(path)
            _state["allocator"] = _state["path"] = "native"
            _state["reason"] = None
            _add_glake_counters()
            return
        except _native.Unavailable as err:
            if choice:
                raise
            _state["reason"] = str(err)
            warnings.warn(f"glake: the native allocator is unavailable ({err}); "
                          "using torch.cuda.memory.CUDAPluggableAllocator")
    else:
        _state["reason"] = "disabled by GLAKE_NATIVE=0 or enable(native=False)"
    _enable_pluggable(path)


def _enable_pluggable(path):
    lib = _library.load()
    allocator = _torch.cuda.memory.CUDAPluggableAllocator(path, "gmlake_malloc", "gmlake_free")
    hooks = allocator.allocator()
    address = _library.symbol_address
    hooks.set_init_fn(address(lib, "gmlake_init"))
    hooks.set_reset_fn(address(lib, "gmlake_reset"))
    hooks.set_memory_fraction_fn(address(lib, "gmlake_memory_fraction"))
    hooks.set_base_alloc_fn(address(lib, "gmlake_base_alloc"))
    hooks.set_record_stream_fn(address(lib, "gmlake_record_stream"))
    hooks.set_begin_allocate_to_pool(address(lib, "gmlake_begin_allocate_to_pool"))
    hooks.set_end_allocate_to_pool_fn(address(lib, "gmlake_end_allocate_to_pool"))
    hooks.set_release_pool(address(lib, "gmlake_release_pool"))
    _torch.cuda.memory.change_current_allocator(allocator)
    _state["allocator"] = allocator
    _state["path"] = "pluggable"
    _install_statistics()


def _device_index(device):
    if device is None:
        return _torch.cuda.current_device()
    if isinstance(device, int):
        return device
    return _torch.cuda._utils._get_device_index(device, optional=True)


def stats(device=None):
    """glake's statistics of `device` as a flat dict: PyTorch's memory_stats() keys, plus
    glake.* stitch counters."""
    return _stats.flat(_device_index(device))


def snapshot(device=None):
    """glake's own snapshot of `device`: segments and blocks, stitched ranges and their pieces,
    the memory cap and the statistics (None for a device not used yet)."""
    return _stats.snapshot(_device_index(device))


def set_memory_limit(limit, device=None):
    """Caps glake's physical memory on `device` at `limit` bytes, replacing any earlier cap or
    torch.cuda.set_per_process_memory_fraction() (whose fraction is kept to the nearest byte)."""
    _stats.set_memory_limit(_device_index(device), limit)


def memory_limit(device=None):
    """glake's cap on `device` as (bytes, fraction): the fraction last set, or the byte cap's
    share of the device."""
    return _stats.memory_limit(_device_index(device))


def to_device(tensor, device=None, non_blocking=False):
    """A copy of CPU tensor `tensor` on CUDA device `device` (the current one by default),
    moved by glake's copy engine: several threads and, where peers with NVLink exist, several
    PCIe links at once, from pageable memory several times faster than Tensor.to(). Works with or without
    glake as the allocator. Ordered on the current stream; with `non_blocking`, a pinned
    `tensor` must stay alive and unchanged until the stream has reached the copy (a pageable
    one may be reused at once). Tensors already on a GPU go through Tensor.to()."""
    index = _device_index(device)
    if tensor.device.type != "cpu":
        return tensor.to(_torch.device("cuda", index), non_blocking=non_blocking)
    src = tensor.contiguous()
    out = _torch.empty(src.shape, dtype=src.dtype, device=_torch.device("cuda", index))
    nbytes = src.numel() * src.element_size()
    if nbytes:
        stream = _torch.cuda.current_stream(index).cuda_stream
        _transfer.to_device(index, out.data_ptr(), src.data_ptr(), nbytes, stream, non_blocking)
    return out


def to_host(tensor, pin_memory=False):
    """A CPU copy of CUDA tensor `tensor`, moved by glake's copy engine (into pinned memory
    with `pin_memory`); returns once the data is there. A CPU tensor is returned as it is."""
    if tensor.device.type == "cpu":
        return tensor
    src = tensor.contiguous()
    out = _torch.empty(src.shape, dtype=src.dtype, pin_memory=pin_memory)
    nbytes = src.numel() * src.element_size()
    if nbytes:
        index = src.device.index
        stream = _torch.cuda.current_stream(index).cuda_stream
        _transfer.to_host(index, out.data_ptr(), src.data_ptr(), nbytes, stream)
    return out


def load_state_dict(state_dict, device=None, non_blocking=False):
    """`state_dict` with every CPU tensor moved to CUDA device `device` by glake's copy engine
    in one batch (for example a checkpoint loaded into ordinary memory): all tensors share the
    engine's lanes, so the load runs at the speed of one large copy. Other values are kept;
    tensors that are the same view of the same memory (tied weights) stay one tensor. Returns
    when all data has arrived unless `non_blocking` (then see to_device)."""
    index = _device_index(device)
    target = _torch.device("cuda", index)
    out = type(state_dict)() if isinstance(state_dict, dict) else {}
    moved, sources, pieces = {}, [], []
    for key, value in state_dict.items():
        if not isinstance(value, _torch.Tensor):
            out[key] = value
            continue
        if value.device.type != "cpu":
            out[key] = value.to(target, non_blocking=non_blocking)
            continue
        same = (value.data_ptr(), value.dtype, tuple(value.shape), tuple(value.stride()))
        if same not in moved:
            src = value.contiguous()
            dst = _torch.empty(src.shape, dtype=src.dtype, device=target)
            nbytes = src.numel() * src.element_size()
            if nbytes:
                sources.append(src)
                pieces.append((src.data_ptr(), dst.data_ptr(), nbytes))
            moved[same] = dst
        out[key] = moved[same]
    stream = _torch.cuda.current_stream(index).cuda_stream
    _transfer.batch(index, pieces, to_device=True, stream=stream, non_blocking=non_blocking)
    return out


def transfer_stats(device=None):
    """Counters of glake's copy engine on `device`: copies, bytes, driver_copies (copies small
    enough for the driver's own call), engine_bytes and paths (own link plus relays)."""
    return _transfer.stats(_device_index(device))


def call_times():
    """Time spent inside glake's malloc and free (see glake.stats.call_times); enable with
    enable(time_calls=True) or GLAKE_TIME_CALLS=1."""
    return _stats.call_times()


_BLOCK_STATES = {
    "active_allocated": "active_allocated",
    "active_stitched": "active_allocated",
    "active_pending_free": "active_pending_free",
    "inactive": "inactive",
}


def torch_snapshot():
    """A snapshot in the shape of torch.cuda.memory._snapshot(), with glake's stitched ranges
    under "glake_stitched". On the native path it is PyTorch's own snapshot (with history when
    recorded); on the pluggable path it is built from glake's: segments of every device used,
    blocks in PyTorch's states (stitched pieces count as allocated), no traces."""
    if _state["path"] == "native":
        return _torch.cuda.memory._snapshot()  # glake_stitched added by _add_glake_counters
    segments, traces = [], []
    for device in range(_torch.cuda.device_count()):
        traces.append([])
        snap = snapshot(device)
        if not snap:
            continue
        for seg in snap["segments"]:
            blocks = [
                {
                    "address": b["address"],
                    "size": b["size"],
                    "requested_size": b["requested_size"],
                    "state": _BLOCK_STATES[b["state"]],
                    "frames": [],
                }
                for b in seg["blocks"]
            ]
            active = sum(b["size"] for b in blocks if b["state"] != "inactive")
            segments.append(
                {
                    "device": device,
                    "address": seg["address"],
                    "total_size": seg["total_size"],
                    "allocated_size": seg["allocated_size"],
                    "active_size": active,
                    "requested_size": sum(b["requested_size"] for b in blocks),
                    "stream": 0,
                    "segment_type": seg["segment_type"],
                    "segment_pool_id": (0, 0),
                    "is_expandable": False,
                    "frames": [],
                    "blocks": blocks,
                }
            )
    return {
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": {},
        "glake_stitched": _stitched_ranges(),
    }


def _memory_stats(device):
    return _stats.nested(stats(device))


def _reset_peak(device):
    _stats.reset_peak(_device_index(device))


def _reset_accumulated(device):
    _stats.reset_accumulated(_device_index(device))


def _memory_snapshot(*_args, **_kwargs):
    return torch_snapshot()


def _check_pool_live_allocations(device, pool_id, expected):
    """CUDA graph trees (torch.compile mode="reduce-overhead") check that a graph pool holds
    exactly the allocations they track."""
    live = _stats.pool_allocations(_device_index(device), tuple(pool_id)) or []
    return set(live) == set(expected)


class _Checkpoint:
    """What glake records of a graph pool for CUDA graph trees: its live allocations."""

    def __init__(self, device, pool_id, live):
        self.device, self.pool_id, self.live = device, pool_id, frozenset(live)


def _get_checkpoint_state(device, pool_id):
    pool_id = tuple(pool_id)
    return _Checkpoint(device, pool_id, _stats.pool_allocations(device, pool_id) or [])


def _set_checkpoint_pool_state(device, state, stale_storages, storages_to_add_deleters_to=()):
    """Graph trees restore a checkpoint when they switch paths. glake can do so only when the
    pool already matches it; anything else is refused with a clear error rather than done
    wrong."""
    live = set(_stats.pool_allocations(device, state.pool_id) or [])
    if live == state.live and not stale_storages and not storages_to_add_deleters_to:
        return
    raise RuntimeError(
        "glake: restoring a CUDA graph tree checkpoint that differs from the graph pool's "
        "state is not supported; use torch.compile(mode='max-autotune-no-cudagraphs') or "
        "torch.cuda.graph for this model"
    )


# torch._C functions that raise "does not yet support" with a pluggable allocator. torch.cuda's
# Python functions (memory_allocated, memory_summary, ...) call these by attribute at each call,
# so replacing them serves every caller, including code that imported the functions earlier.
_REPLACEMENTS = {
    "_cuda_memoryStats": _memory_stats,
    "_cuda_resetPeakMemoryStats": _reset_peak,
    "_cuda_resetAccumulatedMemoryStats": _reset_accumulated,
    "_cuda_memorySnapshot": _memory_snapshot,
    "_cuda_checkPoolLiveAllocations": _check_pool_live_allocations,
    "_cuda_getCheckpointState": _get_checkpoint_state,
    "_cuda_setCheckpointPoolState": _set_checkpoint_pool_state,
    "_accelerator_getDeviceStats": _memory_stats,
    # torch.accelerator.memory_stats() returns {} unless PyTorch's own allocator registry says
    # it is initialised, which it does not know of a pluggable allocator.
    "_accelerator_isAllocatorInitialized": _torch.cuda.is_initialized,
    "_accelerator_allocatorInitialized": _torch.cuda.is_initialized,
    "_accelerator_resetPeakStats": _reset_peak,
    "_accelerator_resetAccumulatedStats": _reset_accumulated,
}


def _add_glake_counters():
    """On the native path PyTorch's memory_stats() and snapshots come from glake through
    PyTorch's own interface; this adds glake's stitching counters (glake.*) to the statistics
    and its stitched ranges ("glake_stitched") to the snapshots."""
    original = _torch._C._cuda_memoryStats

    def memory_stats_with_glake(device):
        out = original(device)
        extra = {k: v for k, v in stats(device).items() if k.startswith("glake.")}
        out.update(_stats.nested(extra))
        return out

    _torch._C._cuda_memoryStats = memory_stats_with_glake
    original_snapshot = _torch._C._cuda_memorySnapshot

    def snapshot_with_stitched(*args, **kwargs):
        snap = original_snapshot(*args, **kwargs)
        snap["glake_stitched"] = _stitched_ranges()
        return snap

    _torch._C._cuda_memorySnapshot = snapshot_with_stitched


def _stitched_ranges():
    """glake's stitched ranges of every device used, each with its device."""
    return [
        dict(s, device=device)
        for device in range(_torch.cuda.device_count())
        for s in (snapshot(device) or {}).get("stitched", [])
    ]


def _install_statistics():
    for name, replacement in _REPLACEMENTS.items():
        if hasattr(_torch._C, name):
            setattr(_torch._C, name, replacement)
