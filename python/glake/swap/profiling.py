"""SmartSwap's profiled step: events and memory at block boundaries, each op's device time
(with the device held back so that events time the device, not the host's pace), the copy
bandwidth, and the block-level iteration the planner reads. A mixin of SmartSwap: it uses the
instance's blocks, marks, swapper and settings."""

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from . import planner
from .search import forward_scales, profiling_slowdown
from .states import state_tensors

log = logging.getLogger("glake.swap")


@dataclass
class Marks:
    """Events and memory figures taken at block boundaries in the profiled step."""
    fwd: dict = field(default_factory=dict)      # block -> (start event, end event)
    bwd: dict = field(default_factory=dict)      # block -> (event, allocated, peak before)
    alloc_before: dict = field(default_factory=dict)
    alloc_after: dict = field(default_factory=dict)
    end: tuple = None                            # (event, allocated, peak before)
    next_start: object = None
    tail_peak: int = None                        # peak allocated from the backward's end
    # (block 0's input gradient) to the next step's first block
    records: dict = field(default_factory=dict)  # block -> [OpRecord]
    # block -> how many of the swapper's timed waits came before its backward's mark (and
    # None: before the backward's end), to take each block's waits out of its backward time
    waits_before: dict = field(default_factory=dict)
    cycles_per_ms: float = None                  # of torch.cuda._sleep on this device
    issue_ms: float = None                       # host time the last block took to issue


def waits_by_block(times_ns, waits_before, n_blocks):
    """Splits the profiled step's timed waits (`times_ns`, in the order they were taken)
    among the blocks' backwards: block b's are those taken from its backward's mark up to the
    next block's (b - 1), block 0's up to the backward's end. `waits_before` maps each mark
    (a block, or None for the backward's end) to how many waits came before it; a block
    without both marks gets none."""
    out = {}
    for b in range(n_blocks):
        start = waits_before.get(b)
        end = waits_before.get(b - 1 if b > 0 else None)
        if start is not None and end is not None:
            out[b] = sum(times_ns[start:end])
    return out


def floored_profile(profile, meaning, scales, pace=1.0):
    """`profile` (ops and recompute times scaled by `pace`) with the forward op of each block
    whose scale is below 1, and the recompute times of that block's tensors (`meaning`: per
    tensor its block and ops, None or a state otherwise), unpaced and scaled by it; the other
    ops and tensors as they are. The profile's first ops are the blocks' forwards, in order."""
    def floored(ns, scale):
        return max(1, int(ns / pace * scale))

    ops = [(floored(ns, scales[i]), phase) if i < len(scales) and scales[i] < 1.0
           else (ns, phase) for i, (ns, phase) in enumerate(profile.ops)]
    tensors = [dataclasses.replace(t, recompute_ns=floored(t.recompute_ns, scales[m[0]]))
               if m is not None and m[0] != "state" and t.recompute_ns is not None
               and scales[m[0]] < 1.0 else t for t, m in zip(profile.tensors, meaning)]
    return dataclasses.replace(profile, ops=ops, tensors=tensors)


class ProfilingMixin:
    """The profiling half of SmartSwap (see the module's documentation)."""

    def _event(self):
        if not self.cuda:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _memory(self):
        """Allocated and peak allocated bytes for the profile's marks; when optimizer states
        are planned, less the states on the device at the time (they enter the plan as
        tensors of their own, wherever they were during the profiled step)."""
        if not self.cuda:
            return 0, 0
        resident = 0
        if self._moves_states():
            resident = sum(t.untyped_storage().nbytes() for block in self.blocks
                           for t in state_tensors(self.optimizer, block.parameters()))
        return (torch.cuda.memory_allocated(self.device) - resident,
                torch.cuda.max_memory_allocated(self.device) - resident)

    def _head_start(self):
        """Holds the device back before a profiled block, long enough for the host to issue the
        whole block: the timed ops then run back to back, so their events measure device time,
        not the host's pace (issuing ops with their events is slower than running the small
        ones)."""
        if not self.cuda:
            return
        if self.marks.cycles_per_ms is None:
            a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(1_000_000)
            z.record()
            z.synchronize()
            self.marks.cycles_per_ms = 1_000_000 / max(a.elapsed_time(z), 1e-3)
        ms = 20.0 if self.marks.issue_ms is None else 1.5 * self.marks.issue_ms + 1.0
        torch.cuda._sleep(int(ms * self.marks.cycles_per_ms))

    def _on_backward_end(self):
        if self.phase == "profile" and self.marks is not None:
            alloc, peak = self._memory()
            self.marks.end = (self._event(), alloc, peak)
            self.marks.waits_before[None] = len(self.swapper.waits or ())
            if self.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)

    def _measure_bandwidth(self):
        """Device-to-host and host-to-device bytes per second of the swapper's copies, the best
        of three rounds on an idle device (a copy that shares the link with other traffic
        would have the planner underrate it for the rest of the run)."""
        if not self.cuda:
            return 10e9, 10e9
        torch.cuda.synchronize(self.device)
        n = 64 << 20
        dev = torch.empty(n, dtype=torch.uint8, device=self.device)
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        rates = []
        for src, dst in ((dev, host), (host, dev)):
            stream = torch.cuda.Stream(self.device)
            best = 0.0
            # Through the swapper's own path: the peer's link counts where it relays.
            self.swapper.copy([(dst, src)], stream)
            for _ in range(3):
                a = torch.cuda.Event(enable_timing=True)
                z = torch.cuda.Event(enable_timing=True)
                a.record(stream)
                for _ in range(4):
                    self.swapper.copy([(dst, src)], stream)
                z.record(stream)
                z.synchronize()
                best = max(best, 4 * n / (a.elapsed_time(z) / 1e3))
            rates.append(best)
        return rates[0], rates[1]

    def _backward_waits_ns(self, n_blocks):
        """Per block, how long its backward stood waiting for copies in the profiled step
        (waits_by_block): with the optimizer step in the backward, every block's states come
        and go there. Those waits are the simulation's to predict for each plan, so they are
        taken out of the backward's time. (On dense-3b and dense-1b at 70-50% caps on one
        H200 they came to 0.2-0.3 ms per profiled step.)"""
        waits = self.swapper.waits or []
        if not self.cuda or not waits:
            return {}
        out = waits_by_block([int(a.elapsed_time(z) * 1e6) for a, z in waits],
                             self.marks.waits_before, n_blocks)
        total = sum(out.values())
        if total:
            log.info("glake.swap: the profiled backward waited %.1f ms for copies, taken out "
                     "of its blocks' times", total / 1e6)
        return out

    def _forward_scales(self, fwd_ns):
        """Per block, the factor its profiled forward and its ops' times are brought down by
        (search.forward_scales against warm-up's timed forwards; all 1 without them)."""
        if self.block_fwd_ms is None or len(self.block_fwd_ms) != len(fwd_ns):
            return [1.0] * len(fwd_ns)
        return forward_scales([int(ms * 1e6) for ms in self.block_fwd_ms], fwd_ns)

    def _floor_forwards(self):
        """Brings the forwards the profiling slowed (`forward_scales` below 1) to the forward
        warm-up timed (floored_profile). After the pace is applied: these forwards were timed
        at the step's pace already, and pacing them again would give the swaps more time to
        leave than the real forward does."""
        scales = self.forward_scales
        if min(scales, default=1.0) >= 1.0:
            return
        self.profile = floored_profile(self.profile, self.meaning, scales, self.pace)
        log.info("glake.swap: the profiled forwards took %.1f times the ones warm-up timed "
                 "(the profiling's own cost): the plan sees warm-up's",
                 profiling_slowdown(scales, self.profiled_fwd_ns))

    def _build_profile(self):
        """The block-level iteration the planner sees, and per tensor which (block, op indexes)
        it stands for. In step mode the states are no tensors of the plan: they are off the
        device but inside the optimizer step, whose profiled time already holds their copies.
        With the step in the backward each block's states are a carried state of the plan."""
        m, n_blocks = self.marks, len(self.blocks)
        ns = (lambda a, z: int(a.elapsed_time(z) * 1e6)) if self.cuda else (lambda a, z: 1000)
        fwd_ns = [ns(*m.fwd[b]) for b in range(n_blocks)]
        # The forwards as timed (slowed ones are brought down after pacing: _floor_forwards).
        self.forward_scales = self._forward_scales(fwd_ns)
        self.profiled_fwd_ns = fwd_ns
        timed_fwd_ns = [int(t * s) for t, s in zip(fwd_ns, self.forward_scales)]
        ops = [(t, planner.FORWARD) for t in fwd_ns]
        head = n_blocks
        ops.append((ns(m.fwd[n_blocks - 1][1], m.bwd[n_blocks - 1][0]) if self.cuda else 1000,
                    planner.OTHER))
        bwd_op = {}
        waits = self._backward_waits_ns(n_blocks)
        for b in range(n_blocks - 1, -1, -1):
            nxt = m.bwd.get(b - 1) if b > 0 else m.end
            total = (ns(m.bwd[b][0], nxt[0]) - waits.get(b, 0) if (self.cuda and nxt)
                     else 2 * fwd_ns[b])
            bwd_op[b] = len(ops)
            # The profiled backward recomputed the block unrecorded, at the timed forward's pace.
            ops.append((max(total - timed_fwd_ns[b], timed_fwd_ns[b]), planner.BACKWARD))
        tail = len(ops)
        last = m.end or m.bwd[0]
        ops.append((ns(last[0], m.next_start) if self.cuda else 1000, planner.OPTIMIZER))

        tensors, meaning = [], []
        base = m.alloc_before[0]
        fwd_end = m.alloc_after[n_blocks - 1]
        head_persist = max(0, m.bwd[n_blocks - 1][1] - fwd_end)
        head_peak = max(0, m.bwd[n_blocks - 1][2] - fwd_end)
        tensors.append(planner.Tensor(head_persist, head, tail, [head], kind=planner.OTHER_KIND))
        tensors.append(planner.Tensor(max(0, head_peak - head_persist), head, head, [head],
                                      kind=planner.OTHER_KIND))
        meaning += [None, None]
        if m.end is not None and m.tail_peak is not None:
            # What the optimizer step holds beyond the backward's end: its temporaries (a
            # foreach AdamW makes several of its parameters' size; 0.50 GiB on dense-3b, for
            # the parameters outside the blocks) and gradients made after the last mark.
            held = max(0, m.tail_peak - m.end[1])
            tensors.append(planner.Tensor(held, tail, tail, [tail], kind=planner.OTHER_KIND))
            meaning.append(None)
            log.info("glake.swap: the profiled optimizer step held %.2f GiB beyond the "
                     "backward's end", held / 2**30)
        # Cheap outputs: one group per block unless swap_bucket_size asks for smaller buckets
        # (each group is one more tensor for the planner, whose search grows with the square).
        bucket = self.settings.swap_bucket_size or float("inf")
        for b in range(n_blocks):
            grew = max(0, m.alloc_after[b] - m.alloc_before[b])
            tensors.append(planner.Tensor(grew, b, bwd_op[b], [bwd_op[b]],
                                          kind=planner.OTHER_KIND))
            meaning.append(None)
            candidates = 0
            group, group_bytes, group_ns = [], 0, 0
            for i, r in enumerate(m.records.get(b, [])):
                if r.mutated or r.bytes == 0:
                    continue
                if r.heavy:
                    tensors.append(planner.Tensor(r.bytes, b, bwd_op[b], [bwd_op[b]],
                                                  recompute_ns=max(r.gpu_ns, 1)))
                    meaning.append((b, [i]))
                    candidates += r.bytes
                    continue
                group.append(i)
                group_bytes += r.bytes
                group_ns += r.gpu_ns
                if group_bytes >= bucket:
                    tensors.append(planner.Tensor(group_bytes, b, bwd_op[b], [bwd_op[b]],
                                                  recompute_ns=max(group_ns, 1)))
                    meaning.append((b, group))
                    candidates += group_bytes
                    group, group_bytes, group_ns = [], 0, 0
            if group:
                tensors.append(planner.Tensor(group_bytes, b, bwd_op[b], [bwd_op[b]],
                                              recompute_ns=max(group_ns, 1)))
                meaning.append((b, group))
                candidates += group_bytes
            nxt = m.bwd.get(b - 1) if b > 0 else m.end
            if nxt is not None:
                persist = max(0, nxt[1] - m.bwd[b][1])
                transient = max(0, nxt[2] - m.bwd[b][1])
                # Weight gradients: counted, never moved (the executor moves activations only).
                tensors.append(planner.Tensor(persist, bwd_op[b], tail, [bwd_op[b]],
                                              kind=planner.OTHER_KIND))
                tensors.append(planner.Tensor(max(0, transient - persist - candidates),
                                              bwd_op[b], bwd_op[b], [bwd_op[b]],
                                              kind=planner.OTHER_KIND))
                meaning += [None, None]
        carried = self.backward_step == "on"
        if self._moves_states() and (carried or not self.states.in_step):
            # Each block's optimizer states, on the device from the step's start (op 0). With
            # the step in the backward they are needed only by the block's part of it, run in
            # its backward: the plan keeps them throughout or brings them in for it alone.
            # Otherwise they are needed from the block's backward to the optimizer step, so the
            # one window the planner can choose is out during the forward, in ahead of that
            # backward.
            for b in range(n_blocks):
                nbytes = self._state_bytes([b])
                if not nbytes:
                    continue
                if carried:
                    tensors.append(planner.Tensor(nbytes, 0, tail, [bwd_op[b]],
                                                  kind=planner.CARRIED_STATE))
                else:
                    tensors.append(planner.Tensor(nbytes, 0, tail,
                                                  list(range(bwd_op[b], tail + 1)),
                                                  kind=planner.OPTIMIZER_STATE))
                meaning.append(("state", b))
        return planner.Profile(ops=ops, tensors=tensors, base_bytes=max(0, base)), meaning
