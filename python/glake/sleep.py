"""Sleep and wake: give a region's GPU memory back and restore it, addresses unchanged.

    import glake.torch
    glake.torch.enable()
    with glake.torch.region("weights"):
        model = load_model().cuda()
    glake.torch.sleep("weights")     # physical memory back to the driver, bytes on the host
    glake.torch.wake("weights")      # same bytes at the same addresses: tensors stay valid

Tensors made inside `region(tag)` (on this thread) live in memory of their own; `sleep(tag)`
waits for the GPU, copies their bytes to pinned host memory kept for the next sleep (or, with
keep=False, drops them: KV caches, scratch) and gives every byte of the region's physical
memory back, cached free memory included; `wake(tag)` maps memory back at the same addresses
and restores the bytes. Tensors, pointers held by C++ operators and captured CUDA graphs stay
valid. Allocating in a sleeping region raises. Needs glake as PyTorch's allocator
(glake.torch.enable()).

`memory_saver` (also `glake.torch.torch_memory_saver`) offers torch_memory_saver's names
(`region(tag, enable_cpu_backup)`, `pause(tag)`, `resume(tag)`), so its users switch by
changing an import; `sleep_when_idle` puts a served module to sleep after an idle time and
wakes it when called."""

import contextlib
import ctypes
import threading
import time
import warnings

from . import _library

# (device, tag) -> keep: the regions made in this process and what their sleep keeps.
_regions = {}
_declared = False


def _lib():
    global _declared
    lib = _library.load()
    if not _declared:
        c_int, name = ctypes.c_int, ctypes.c_char_p
        lib.gmlake_region_begin.argtypes = [name, c_int]
        lib.gmlake_region_end.argtypes = [c_int]
        lib.gmlake_sleep.argtypes = [name, c_int, c_int]
        lib.gmlake_wake.argtypes = [name, c_int]
        lib.gmlake_region_info.argtypes = [name, c_int, ctypes.POINTER(ctypes.c_uint64)]
        lib.gmlake_sleep_prepare.argtypes = [name, c_int, ctypes.POINTER(ctypes.c_uint64)]
        for fn in (lib.gmlake_region_begin, lib.gmlake_region_end, lib.gmlake_sleep,
                   lib.gmlake_wake, lib.gmlake_region_info, lib.gmlake_sleep_prepare):
            fn.restype = c_int
        _declared = True
    return lib


def _device(device):
    from . import torch as _glake_torch

    if not _glake_torch.is_enabled():
        raise RuntimeError("glake is not PyTorch's allocator: call glake.torch.enable() first "
                           "(or run with GLAKE_ENABLE=1)")
    return _glake_torch._device_index(device)


def _tags(tag, device):
    if tag is not None:
        return [tag]
    return [t for (d, t) in _regions if d == device]


@contextlib.contextmanager
def region(tag="default", keep=True, device=None):
    """Tensors made on this thread inside the block go to region `tag` of `device` (the
    current one by default). `keep`: whether sleep() keeps their bytes by default (False for
    caches whose contents need not survive). Regions nest."""
    dev = _device(device)
    lib = _lib()
    _library.check(lib.gmlake_region_begin(tag.encode(), dev), f"region({tag!r})")
    _regions[(dev, tag)] = keep
    try:
        yield
    finally:
        _library.check(lib.gmlake_region_end(dev), f"ending region({tag!r})")


def sleep(tag=None, keep=None, device=None):
    """Gives the physical memory of region `tag` (every region of the device when None) back
    to the driver, addresses kept; `keep` (default: the region's) copies the bytes to host
    memory first, else they are dropped. Waits for the GPU and for its copies."""
    dev = _device(device)
    lib = _lib()
    for t in _tags(tag, dev):
        if tag is None and info(t, dev)["asleep"]:
            continue
        k = _regions.get((dev, t), True) if keep is None else keep
        _library.check(lib.gmlake_sleep(t.encode(), int(bool(k)), dev), f"sleep({t!r})")


def prepare(tag=None, device=None):
    """Makes ahead of time the host memory a first sleep of region `tag` (every region of the
    device when None) would make, so that the first sleep runs as fast as later ones (pinning
    memory runs at a few GB/s). Call once the region is filled; safe from a background thread
    while the model serves. Returns the bytes made."""
    dev = _device(device)
    lib = _lib()
    total = 0
    for t in _tags(tag, dev):
        made = ctypes.c_uint64(0)
        _library.check(lib.gmlake_sleep_prepare(t.encode(), dev, ctypes.byref(made)),
                       f"prepare({t!r})")
        total += made.value
    return total


def wake(tag=None, device=None):
    """Maps region `tag` (every sleeping region of the device when None) back at the same
    addresses and restores the bytes it kept; returns once they are in place."""
    dev = _device(device)
    lib = _lib()
    for t in _tags(tag, dev):
        if tag is None and not info(t, dev)["asleep"]:
            continue
        _library.check(lib.gmlake_wake(t.encode(), dev), f"wake({t!r})")


def info(tag, device=None):
    """What region `tag` holds: asleep, segments, resident_bytes, asleep_bytes,
    allocated_bytes, host_bytes."""
    dev = _device(device)
    out = (ctypes.c_uint64 * 6)()
    _library.check(_lib().gmlake_region_info(tag.encode(), dev, out), f"info({tag!r})")
    keys = ("asleep", "segments", "resident_bytes", "asleep_bytes", "allocated_bytes",
            "host_bytes")
    values = dict(zip(keys, out))
    values["asleep"] = bool(values["asleep"])
    return values


class MemorySaver:
    """torch_memory_saver's interface on glake's regions: `region(tag, enable_cpu_backup)`,
    `pause(tag)`, `resume(tag)` (None: every region). As there, a region keeps no bytes
    across a pause unless made with enable_cpu_backup=True."""

    enabled = True

    def region(self, tag="default", enable_cpu_backup=False):
        return region(tag, keep=enable_cpu_backup)

    def pause(self, tag=None):
        sleep(tag)

    def resume(self, tag=None):
        wake(tag)


memory_saver = MemorySaver()


class IdleSleeper:
    """Puts regions `tags` to sleep once `module` has not run for `idle_seconds`, and wakes
    them in a forward pre-hook before it runs again. `close()` stops watching (waking them)."""

    def __init__(self, module, idle_seconds=60.0, tags=None, device=None):
        self.idle_seconds = float(idle_seconds)
        self.device = _device(device)
        self.tags = list(tags) if tags is not None else None
        self.asleep = False
        self.sleeps = 0
        self._lock = threading.Lock()
        self._running = 0
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._hooks = [module.register_forward_pre_hook(self._before),
                       module.register_forward_hook(self._after)]
        self._thread = threading.Thread(target=self._watch, name="glake-idle-sleep",
                                        daemon=True)
        self._thread.start()

    def _each(self, fn):
        for t in (self.tags if self.tags is not None else [None]):
            fn(t, device=self.device)

    def _before(self, module, args):
        with self._lock:
            self._running += 1
            if self.asleep:
                self._each(wake)
                self.asleep = False

    def _after(self, module, args, output):
        with self._lock:
            self._running -= 1
            self._last = time.monotonic()

    def _watch(self):
        while not self._stop.wait(min(self.idle_seconds, 1.0) / 2):
            with self._lock:
                idle = time.monotonic() - self._last
                if self._running or self.asleep or idle < self.idle_seconds:
                    continue
                try:
                    self._each(sleep)
                    self.asleep = True
                    self.sleeps += 1
                except RuntimeError as err:  # keep serving awake; the next call may retry
                    warnings.warn(f"glake: idle sleep failed: {err}")
                    self._last = time.monotonic()

    def close(self):
        self._stop.set()
        self._thread.join()
        for hook in self._hooks:
            hook.remove()
        with self._lock:
            if self.asleep:
                self._each(wake)
                self.asleep = False


def sleep_when_idle(module, idle_seconds=60.0, tags=None, device=None):
    """Watches `module`: its regions (`tags`, default every region of the device) sleep after
    `idle_seconds` without a forward and wake before the next. Returns the IdleSleeper."""
    return IdleSleeper(module, idle_seconds, tags, device)


_auto = {"hook": None, "sleeper": None}


def enable_auto_idle(idle_seconds, tag):
    """Watches the first module called from now on as sleep_when_idle(module, idle_seconds,
    [tag]) does (what GLAKE_SLEEP_IDLE turns on)."""
    import torch

    if _auto["hook"] is not None:
        return

    def pre_hook(module, args):
        if _auto["hook"] is None:
            return
        _auto["hook"].remove()
        _auto["hook"] = None
        sleeper = IdleSleeper(module, idle_seconds, tags=[tag])
        _auto["sleeper"] = sleeper
        # Its own pre-hook missed this call; its post-hook will see it end.
        sleeper._before(module, args)

    _auto["hook"] = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
