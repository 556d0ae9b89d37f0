"""SmartSwap's executor for PyTorch: what a block keeps, swaps or recomputes between its forward
and its backward.

A planned block runs under torch.utils.checkpoint (non-reentrant) with a pair of dispatch modes
as its context: in the forward, `RecordingMode` keeps the outputs of the ops the plan keeps,
starts a copy to pinned host memory on a side stream for the ops it swaps, and lets the rest
go; in the backward's recompute, `ReplayMode` hands back the kept outputs, waits for the
swapped ones (already on their way: `Swapper.prefetch` starts their copies a block ahead) and
reruns everything else. The copies are exact, and rerun ops see the RNG state checkpoint
restores, so the step computes what it computes unplanned.

Ops are matched by their index in the block's forward; when the forward takes another path than
the profiled one (data-dependent routing), the block stops keeping anything from there on, so it
never holds more than planned."""

import logging
import os
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

KEEP, SWAP = "keep", "swap"

# Ops whose outputs cost far more to rebuild than their bytes to move: matmuls and attention.
HEAVY_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_grouped_mm",
    "_scaled_mm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward", "_efficient_attention_forward",
})


# Ops the recompute runs that the forward did not (checkpoint detaches the recomputed inputs):
# left out of the op count on both sides.
IGNORED_OPS = frozenset({torch.ops.aten.detach.default, torch.ops.prim.device.default})


def op_name(func):
    return func.overloadpacket.__name__


def _storages(tree):
    """(tensor, storage) pairs of the tensors in `tree`, one per distinct storage."""
    seen, out = set(), []
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            key = s.data_ptr()
            if key not in seen and s.nbytes() > 0:
                seen.add(key)
                out.append((t, s))
    return out


class Timer:
    """Device time of what runs between its creation and `stop()`: a pair of CUDA events (read
    once the device has passed them), or the host clock on CPU."""

    def __init__(self, cuda):
        if cuda:
            self.start, self.end = (torch.cuda.Event(enable_timing=True),
                                    torch.cuda.Event(enable_timing=True))
            self.start.record()
        else:
            self.start, self.end = time.perf_counter_ns(), None

    def stop(self):
        if isinstance(self.start, int):
            self.end = time.perf_counter_ns()
        else:
            self.end.record()

    def ns(self):
        if isinstance(self.start, int):
            return self.end - self.start
        return int(self.start.elapsed_time(self.end) * 1e6)


class TimedContext:
    """A context manager that appends a Timer of what runs inside it to `into`: given to
    torch.utils.checkpoint as the recompute context, it times a block's recompute in the
    backward, which is what running the block as written saves (on the MoE benchmark with the
    optimizer step in the backward, 8.5-11.2 ms against forwards of 4.9-7.3 ms)."""

    def __init__(self, cuda, into):
        self.cuda, self.into, self.timer = cuda, into, None

    def __enter__(self):
        self.timer = Timer(self.cuda)
        return self

    def __exit__(self, *exc):
        self.timer.stop()
        self.into.append(self.timer)
        return False


def _size_class(nbytes):
    """`nbytes` rounded up to the next of 8 steps per power of two (at most 12.5% more)."""
    if nbytes <= 4096:
        return 4096
    step = 1 << max(0, nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


class OpRecord:
    """One op of a profiled block forward: its name, the bytes of the storages it made, whether
    a later op wrote into them (caching such an output would replay the write twice), and its
    timer, read once the step is done (`gpu_ns`)."""

    __slots__ = ("func", "name", "bytes", "mutated", "timer")

    def __init__(self, func, nbytes, timer):
        self.func, self.name, self.bytes = func, op_name(func), nbytes
        self.mutated, self.timer = False, timer

    @property
    def gpu_ns(self):
        return self.timer.ns()

    @property
    def heavy(self):
        return self.name in HEAVY_OPS


def _relay_engine(device):
    """The device index whose glake copy engine swaps go through when GLAKE_SWAP_RELAY=1 and
    that engine relays through a peer GPU's host link as well as the device's own; else None,
    and swaps are the driver's copies on the device's own link. Off by default: on two H200s
    the planner swapped more at the doubled bandwidth, and the measured steps were no faster
    (BENCHMARKS.md)."""
    if device.type != "cuda" or os.environ.get("GLAKE_SWAP_RELAY", "0") != "1":
        return None
    if torch.cuda.device_count() < 2:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        from .. import transfer
        if transfer.stats(index)["paths"] > 1:
            return index
    except (OSError, RuntimeError) as err:
        logging.getLogger("glake.swap").info("glake.swap: no copy engine for swaps: %s", err)
    return None


class Swapper:
    """Moves cached outputs to pinned host memory and back on two side streams. Pinned buffers
    are made on first need and reused by size (pinning is slow: a planned step makes none once
    the first has run); on CPU (tests) the same path runs without streams. With
    GLAKE_SWAP_RELAY=1, where a peer GPU reaches this one over NVLink, the copies go through
    glake's copy engine, which also uses the peer's host link."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.relay = _relay_engine(self.device) if self.cuda else None
        if self.cuda:
            self.d2h = torch.cuda.Stream(self.device)
            self.h2d = torch.cuda.Stream(self.device)
        self.free_buffers = {}  # bytes -> [pinned buffers not holding a swapped output]
        self.pinned_bytes = 0
        self.pending = {}  # block -> handles not yet brought back
        self.bytes_out = 0
        self.bytes_in = 0
        self.waits = None  # a list: (before, after) events around each wait for a copy
        self.release_at = {}  # block -> the block before whose forward its outputs are freed
        self.held = []  # (release block, copy-out done event, source tensors)

    def exposed_wait_ns(self):
        """How long the consumer stream stood still waiting for copies in since the last call
        (timed only while `waits` is a list; reading it waits for the device)."""
        if not self.waits:
            return 0
        total = sum(int(a.elapsed_time(z) * 1e6) for a, z in self.waits)
        self.waits.clear()
        return total

    def copy(self, pairs, stream):
        """Queues copies of (destination, source) uint8 tensors, one side pinned host memory
        and the other this device, all in one direction, on `stream` (on CPU: copies them)."""
        if not pairs:
            return
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return
        if self.relay is not None:
            from .. import transfer
            to_device = pairs[0][0].is_cuda
            pieces = [(src.data_ptr(), dst.data_ptr(), dst.numel()) if to_device
                      else (dst.data_ptr(), src.data_ptr(), dst.numel()) for dst, src in pairs]
            transfer.batch(self.relay, pieces, to_device=to_device, stream=stream.cuda_stream,
                           non_blocking=True)
            return
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    def host_buffer(self, nbytes):
        """A pinned buffer of at least `nbytes`, rounded to a size class (an eighth of a power
        of two) so that outputs whose size changes from step to step (expert loads) still reuse
        buffers; without a free one of its class, a free one of up to twice the size serves
        (a step of shorter inputs than the planned ones pins no more). One given back by
        `swap_in` is free for the next copy out: that copy is ordered after the copy in (the
        main stream waited for it before the copy out's stream waits for the main stream)."""
        size = _size_class(nbytes)
        free = self.free_buffers.get(size)
        if not free:
            larger = [c for c, bufs in self.free_buffers.items() if bufs and size < c <= 2 * size]
            free = self.free_buffers[min(larger)] if larger else None
        if free:
            return free.pop()
        self.pinned_bytes += size
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda)

    def swap_out(self, key, out):
        """Starts copying the storages of `out` to host; returns the handle `swap_in` takes."""
        pieces, sources = [], []
        if self.cuda:
            main = torch.cuda.current_stream(self.device)
            self.d2h.wait_stream(main)
        copies = []
        for t, storage in _storages(out):
            raw = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
            whole = self.host_buffer(raw.numel())
            buf = whole[:raw.numel()]
            copies.append((buf, raw))
            if self.cuda:
                # The allocator must not hand this memory out before the copy has read it:
                # held until `release`, which frees it in stream order.
                sources.append(raw)
            pieces.append((storage.data_ptr(), buf, whole))
            self.bytes_out += raw.numel()
        self.copy(copies, self.d2h if self.cuda else None)
        done = None
        if self.cuda:
            done = torch.cuda.Event()
            done.record(self.d2h)
            self.held.append((self.release_at.get(key[0], key[0] + 1), done, sources))
        flat, spec = tree_flatten(out)
        layout = []
        for t in flat:
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                index = next((i for i, piece in enumerate(pieces) if piece[0] == ptr), None)
                layout.append(("tensor", index, t.dtype, t.size(), t.stride(),
                               t.storage_offset()))
            else:
                layout.append(("value", t))
        handle = {"pieces": [p[1] for p in pieces], "buffers": [p[2] for p in pieces],
                  "done": done, "layout": layout,
                  "spec": spec, "back": None, "ready": None}
        self.pending.setdefault(key[0], []).append(handle)
        return handle

    def _bring_back(self, handle):
        """Starts the copy in. The device memory comes from the consumer's stream (the one
        current here, where the backward runs): a side stream's pool of its own would hold
        memory the consumer cannot reuse, which a cap has no room for. The copy stream first
        waits for the consumer up to here, so it never writes memory the consumer freed to
        this allocation while an earlier kernel still reads it."""
        if handle["back"] is not None:
            return
        if self.cuda:
            back = [torch.empty(buf.numel(), dtype=torch.uint8, device=self.device)
                    for buf in handle["pieces"]]
            self.h2d.wait_stream(torch.cuda.current_stream(self.device))
            self.h2d.wait_event(handle["done"])
            self.copy(list(zip(back, handle["pieces"])), self.h2d)
            handle["ready"] = torch.cuda.Event()
            handle["ready"].record(self.h2d)
        else:
            back = [buf.clone() for buf in handle["pieces"]]
        for dev in back:
            self.bytes_in += dev.numel()
        handle["back"] = back

    def wait_for(self, event, timed=True):
        """Makes the current stream wait for `event`, timing the wait when asked to (`timed`
        False: a wait the plan does not predict, kept out of the measured ones)."""
        main = torch.cuda.current_stream(self.device)
        if self.waits is None or not timed:
            main.wait_event(event)
            return
        before = torch.cuda.Event(enable_timing=True)
        after = torch.cuda.Event(enable_timing=True)
        before.record(main)
        main.wait_event(event)
        after.record(main)
        self.waits.append((before, after))

    def release(self, block=None):
        """Frees the device memory of the swapped-out outputs due before `block`'s forward (all:
        None), on the consumer's stream once it has waited for their copies. Unlike
        record_stream, whose memory returns whenever the host sees the copy done, this frees
        the same memory at the same point of every step, so the allocator's placements (and
        its stitched ranges) repeat from step to step."""
        keep = []
        for entry in self.held:
            if block is None or entry[0] <= block:
                self.wait_for(entry[1])
            else:
                keep.append(entry)
        self.held = keep

    def prefetch(self, block):
        """Starts bringing back everything block `block` swapped out."""
        for handle in self.pending.pop(block, []):
            self._bring_back(handle)

    def swap_in(self, handle):
        """The swapped output, on the device and safe to use on the current stream."""
        self._bring_back(handle)
        back = handle["back"]
        if self.cuda:
            # Allocated on this stream, which now waits for the copy: no record_stream needed.
            self.wait_for(handle["ready"])
        flat = []
        for entry in handle["layout"]:
            if entry[0] == "value":
                flat.append(entry[1])
                continue
            _, index, dtype, size, stride, offset = entry
            if index is None:  # an empty tensor: nothing was copied
                flat.append(torch.empty_strided(size, stride, dtype=dtype, device=self.device))
                continue
            t = torch.empty(0, dtype=dtype, device=self.device)
            t.set_(back[index].untyped_storage(), offset, size, stride)
            flat.append(t)
        handle["back"] = None
        for whole in handle["buffers"]:
            self.free_buffers.setdefault(whole.numel(), []).append(whole)
        handle["pieces"], handle["buffers"] = [], []
        return tree_unflatten(flat, handle["spec"])

    def forget(self):
        """Drops pending handles (a step that ended without its backward)."""
        self.pending.clear()
        self.held.clear()


class _CountingMode(TorchDispatchMode):
    """Numbers the ops of a block's forward the same way in the forward and in its recompute:
    `next_index` gives None for ops only the recompute runs (they are run and not counted)."""

    def __init__(self):
        super().__init__()
        self.index = 0

    def next_index(self, func):
        if func in IGNORED_OPS:
            return None
        self.index += 1
        return self.index - 1


class RecordingMode(_CountingMode):
    """The forward of a checkpointed block: keeps, swaps or drops each op's outputs per
    `decisions` ({op index: KEEP or SWAP}); given a `records` list, it also appends each op
    there, timed (by CUDA events on CUDA)."""

    def __init__(self, block, decisions, cache, swapper, expected=None, records=None):
        super().__init__()
        self.block, self.decisions, self.cache = block, decisions, cache
        self.swapper, self.expected, self.records = swapper, expected, records
        self.diverged = False
        self.made = {}  # storage pointer -> record index (profiling only)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        i = self.next_index(func)
        if i is None:
            return func(*args, **kwargs)
        if self.expected is not None and not self.diverged:
            if i >= len(self.expected) or self.expected[i] is not func:
                self.diverged = True
        if self.records is None:
            out = func(*args, **kwargs)
        else:
            timer = Timer(self.swapper.cuda)
            out = func(*args, **kwargs)
            timer.stop()
            self._record(func, args, kwargs, out, timer)
        choice = None if self.diverged else self.decisions.get(i)
        if choice == KEEP:
            self.cache[i] = (func, KEEP, tree_map(
                lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out))
        elif choice == SWAP:
            self.cache[i] = (func, SWAP, self.swapper.swap_out((self.block, i), out))
        return out

    def _record(self, func, args, kwargs, out, timer):
        inputs = {s.data_ptr() for _, s in _storages((args, kwargs))}
        fresh = [(t, s) for t, s in _storages(out) if s.data_ptr() not in inputs]
        record = OpRecord(func, sum(s.nbytes() for _, s in fresh), timer)
        if func._schema.is_mutable:
            for ptr in inputs:
                if ptr in self.made:
                    self.records[self.made[ptr]].mutated = True
        for _, s in fresh:
            self.made[s.data_ptr()] = len(self.records)
        self.records.append(record)


class ReplayMode(_CountingMode):
    """The recompute of a checkpointed block in the backward: kept outputs come from the cache,
    swapped ones from host memory, the rest is computed again."""

    def __init__(self, cache, swapper):
        super().__init__()
        self.cache, self.swapper = cache, swapper

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        i = self.next_index(func)
        entry = None if i is None else self.cache.pop(i, None)
        if entry is None:
            return func(*args, **kwargs)
        cached_func, how, value = entry
        if cached_func is not func:
            raise RuntimeError(
                f"glake.swap: the recompute ran {op_name(func)} where the forward ran "
                f"{op_name(cached_func)} (op {i}); the block's forward must not depend on "
                "anything but its inputs and the RNG state")
        if how == SWAP:
            return self.swapper.swap_in(value)
        return value
