"""Optimizer states off the device between two optimizer steps (SmartSwap's "memory"
preference): after a step, the states of the planned blocks' parameters are copied to pinned
host memory and their device memory freed during the next forward; during the backward they
come back, block by block, ahead of the step that needs them.

The state tensors stay the optimizer's own objects: their storage is emptied and refilled in
place (as FSDP does with parameters), so the optimizer, its foreach and fused kernels and its
state_dict see the same tensors. Between the first block's forward and the optimizer step a
moved state has no storage: code that reads optimizer states inside the step must not run
then."""

import torch


def state_tensors(optimizer, params):
    """The device tensors the optimizer keeps for `params` (exp_avg, exp_avg_sq, ...): the
    per-parameter state entries that are tensors with elements on the parameter's device (a
    step counter on the host is left alone)."""
    out = []
    for p in params:
        for value in optimizer.state.get(p, {}).values():
            if (isinstance(value, torch.Tensor) and value.device == p.device
                    and value.dim() > 0 and value.numel() > 0):
                out.append(value)
    return out


class StateSwapper:
    """Moves groups of optimizer states (one group per block) out after the optimizer step and
    back before the next one, on the Swapper's copy streams; `release` points and `prefetch`
    calls come from SmartSwap at block boundaries."""

    def __init__(self, swapper):
        self.swapper = swapper
        self.groups = {}   # block -> [state tensors] the plan moves
        self.host = {}     # id(state tensor) -> pinned buffer, made once
        self.out = {}      # block -> (copy-out done event) while on the way out or out
        self.back = {}     # block -> copy-in ready event while coming back
        self.released = set()
        self.bytes_out = 0

    @property
    def cuda(self):
        return self.swapper.cuda

    def plan(self, groups):
        """Moves the states in `groups` ({block: [state tensors]}) from the next step on."""
        self.restore()
        self.groups = groups

    def bytes_of(self, block):
        return sum(t.untyped_storage().nbytes() for t in self.groups.get(block, []))

    def after_step(self):
        """The optimizer step has run: start copying every planned group out."""
        for b, tensors in self.groups.items():
            if self.cuda:
                self.swapper.d2h.wait_stream(torch.cuda.current_stream(self.swapper.device))
            for t in tensors:
                storage = t.untyped_storage()
                buf = self.host.get(id(t))
                if buf is None or buf.numel() != storage.nbytes():
                    buf = torch.empty(storage.nbytes(), dtype=torch.uint8,
                                      pin_memory=self.cuda)
                    self.host[id(t)] = buf
                raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                if self.cuda:
                    with torch.cuda.stream(self.swapper.d2h):
                        buf.copy_(raw, non_blocking=True)
                else:
                    buf.copy_(raw)
                self.bytes_out += storage.nbytes()
            done = None
            if self.cuda:
                done = torch.cuda.Event()
                done.record(self.swapper.d2h)
            self.out[b] = done

    def release(self, blocks):
        """Frees the device memory of the groups of `blocks` on their way out, once the
        current stream has waited for their copies (stream order: reusable at once)."""
        for b in blocks:
            if b in self.out and b not in self.released:
                if self.out[b] is not None:
                    self.swapper.wait_for(self.out[b])
                for t in self.groups[b]:
                    t.untyped_storage().resize_(0)
                self.released.add(b)

    def prefetch(self, block):
        """Starts bringing back the group of `block` (memory taken on the current stream)."""
        if block not in self.out:
            return
        self.release([block])  # never refill memory the copy out may still read
        done = self.out.pop(block)
        self.released.discard(block)
        tensors = self.groups[block]
        for t in tensors:
            t.untyped_storage().resize_(self.host[id(t)].numel())
        if self.cuda:
            h2d = self.swapper.h2d
            h2d.wait_stream(torch.cuda.current_stream(self.swapper.device))
            if done is not None:
                h2d.wait_event(done)
        for t in tensors:
            raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            if self.cuda:
                with torch.cuda.stream(self.swapper.h2d):
                    raw.copy_(self.host[id(t)], non_blocking=True)
            else:
                raw.copy_(self.host[id(t)])
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(self.swapper.h2d)
            self.back[block] = ready

    def before_step(self):
        """The optimizer step is about to run: every group back, and waited for."""
        for b in list(self.out):
            self.prefetch(b)
        for ready in self.back.values():
            self.swapper.wait_for(ready)
        self.back.clear()

    def restore(self):
        """Every state back on the device now (a plan change, a removal, an abandoned step)."""
        self.before_step()
        self.groups = {}
