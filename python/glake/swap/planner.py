"""glake's SmartSwap planner (glake_swap_plan / glake_swap_simulate in the C API) from Python:
a profiled iteration goes in as ops and tensors, one choice per tensor comes back with the
predicted step time and peak."""

import ctypes
from dataclasses import dataclass, field

from .. import _library

FORWARD, BACKWARD, OPTIMIZER, OTHER = 0, 1, 2, 3
# CARRIED_STATE: an optimizer state whose block's step runs in the backward (kept throughout,
# or swapped across the iteration's end: out after its last use, in before its first).
ACTIVATION, OPTIMIZER_STATE, GRADIENT, OTHER_KIND, CARRIED_STATE = 0, 1, 2, 3, 4
KEEP, SWAP, RECOMPUTE = 0, 1, 2
PREFERENCES = {"performance": 0, "memory": 1}
_OUT_OF_MEMORY = 5


class _Op(ctypes.Structure):
    _fields_ = [("gpu_ns", ctypes.c_uint64), ("phase", ctypes.c_uint32)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("bytes", ctypes.c_size_t),
        ("produced_at", ctypes.c_size_t),
        ("freed_after", ctypes.c_size_t),
        ("uses", ctypes.POINTER(ctypes.c_size_t)),
        ("n_uses", ctypes.c_size_t),
        ("can_recompute", ctypes.c_uint32),
        ("recompute_ns", ctypes.c_uint64),
        ("kind", ctypes.c_uint32),
    ]


class _Config(ctypes.Structure):
    _fields_ = [
        ("d2h_bytes_per_s", ctypes.c_uint64),
        ("h2d_bytes_per_s", ctypes.c_uint64),
        ("prefetch", ctypes.c_size_t),
        ("preference", ctypes.c_uint32),
    ]


class _Choice(ctypes.Structure):
    _fields_ = [
        ("action", ctypes.c_uint32),
        ("out_after", ctypes.c_size_t),
        ("in_before", ctypes.c_size_t),
    ]


class _Prediction(ctypes.Structure):
    _fields_ = [
        ("step_ns", ctypes.c_uint64),
        ("compute_ns", ctypes.c_uint64),
        ("exposed_wait_ns", ctypes.c_uint64),
        ("recompute_ns", ctypes.c_uint64),
        ("peak_bytes", ctypes.c_size_t),
        ("baseline_peak_bytes", ctypes.c_size_t),
        ("peak_op", ctypes.c_size_t),
    ]


@dataclass
class Tensor:
    """A tensor of the profiled iteration; `uses` are op indexes, `recompute_ns` None when it
    cannot be rebuilt."""
    bytes: int
    produced_at: int
    freed_after: int
    uses: list
    recompute_ns: int = None
    kind: int = ACTIVATION


@dataclass
class Profile:
    """Ops as (gpu_ns, phase) in execution order, tensors, and bytes never moved."""
    ops: list = field(default_factory=list)
    tensors: list = field(default_factory=list)
    base_bytes: int = 0


@dataclass
class Prediction:
    step_ns: int
    compute_ns: int
    exposed_wait_ns: int
    recompute_ns: int
    peak_bytes: int
    baseline_peak_bytes: int
    peak_op: int


class TargetUnreachable(RuntimeError):
    """No plan brings the peak to the target; `best_peak` is the lowest the planner reached."""

    def __init__(self, message, best_peak):
        super().__init__(message)
        self.best_peak = best_peak


def _arrays(profile):
    ops = (_Op * len(profile.ops))(*[_Op(int(ns), int(ph)) for ns, ph in profile.ops])
    keep = []
    tensors = (_Tensor * len(profile.tensors))()
    for i, t in enumerate(profile.tensors):
        uses = (ctypes.c_size_t * len(t.uses))(*t.uses)
        keep.append(uses)
        tensors[i] = _Tensor(int(t.bytes), t.produced_at, t.freed_after,
                             ctypes.cast(uses, ctypes.POINTER(ctypes.c_size_t)), len(t.uses),
                             int(t.recompute_ns is not None), int(t.recompute_ns or 0), t.kind)
    return ops, tensors, keep


def _config(d2h, h2d, prefetch, preference):
    if preference not in PREFERENCES:
        raise ValueError(f"preference must be one of {sorted(PREFERENCES)}, not {preference!r}")
    return _Config(int(d2h), int(h2d), int(prefetch), PREFERENCES[preference])


def _message(lib):
    return lib.glake_last_error_message().decode(errors="replace")


def _prediction(p):
    return Prediction(p.step_ns, p.compute_ns, p.exposed_wait_ns, p.recompute_ns, p.peak_bytes,
                      p.baseline_peak_bytes, p.peak_op)


def plan(profile, target_bytes, d2h_bytes_per_s, h2d_bytes_per_s, prefetch=2,
         preference="performance"):
    """(choices, Prediction): one (action, out_after, in_before) per tensor. Raises
    TargetUnreachable when no plan reaches `target_bytes`, ValueError on a bad profile."""
    lib = _library.load()
    ops, tensors, _keep = _arrays(profile)
    cfg = _config(d2h_bytes_per_s, h2d_bytes_per_s, prefetch, preference)
    choices = (_Choice * len(profile.tensors))()
    pred = _Prediction()
    status = lib.glake_swap_plan(ctypes.addressof(ops), len(profile.ops),
                                 ctypes.addressof(tensors), len(profile.tensors),
                                 int(profile.base_bytes), int(target_bytes),
                                 ctypes.addressof(cfg), ctypes.addressof(choices),
                                 ctypes.addressof(pred))
    if status == _OUT_OF_MEMORY:
        raise TargetUnreachable(_message(lib), pred.peak_bytes)
    if status != 0:
        raise ValueError(f"glake_swap_plan: {_message(lib)}")
    return [(c.action, c.out_after, c.in_before) for c in choices], _prediction(pred)


def simulate(profile, choices, d2h_bytes_per_s, h2d_bytes_per_s, prefetch=2):
    """The Prediction of `choices` (as plan() returns them) on `profile`."""
    lib = _library.load()
    ops, tensors, _keep = _arrays(profile)
    cfg = _config(d2h_bytes_per_s, h2d_bytes_per_s, prefetch, "performance")
    arr = (_Choice * len(choices))(*[_Choice(a, o, i) for a, o, i in choices])
    pred = _Prediction()
    status = lib.glake_swap_simulate(ctypes.addressof(ops), len(profile.ops),
                                     ctypes.addressof(tensors), len(profile.tensors),
                                     int(profile.base_bytes), ctypes.addressof(arr),
                                     ctypes.addressof(cfg), ctypes.addressof(pred))
    if status != 0:
        raise ValueError(f"glake_swap_simulate: {_message(lib)}")
    return _prediction(pred)
