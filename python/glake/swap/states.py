"""Optimizer states off the device between two optimizer steps (SmartSwap's "memory"
preference): after a step, the states of the planned blocks' parameters are copied to pinned
host memory and their device memory freed during the next forward; during the backward they
come back, block by block, ahead of the step that needs them.

The state tensors stay the optimizer's own objects: their storage is emptied and refilled in
place (as FSDP does with parameters), so the optimizer, its foreach and fused kernels and its
state_dict see the same tensors. Between the first block's forward and the optimizer step a
moved state has no storage: code that reads optimizer states inside the step must not run
then."""

import weakref

import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                    register_optimizer_step_pre_hook)


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

    def after_step(self):
        """The optimizer step has run: start copying every planned group out."""
        for b, tensors in self.groups.items():
            if self.cuda:
                self.swapper.d2h.wait_stream(torch.cuda.current_stream(self.swapper.device))
            copies = []
            for t in tensors:
                storage = t.untyped_storage()
                buf = self.host.get(id(t))
                if buf is None or buf.numel() != storage.nbytes():
                    buf = torch.empty(storage.nbytes(), dtype=torch.uint8,
                                      pin_memory=self.cuda)
                    self.host[id(t)] = buf
                raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                copies.append((buf, raw))
                self.bytes_out += storage.nbytes()
            self.swapper.copy(copies, self.swapper.d2h if self.cuda else None)
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
        copies = [(torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()),
                   self.host[id(t)]) for t in tensors]
        self.swapper.copy(copies, self.swapper.h2d if self.cuda else None)
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


def _weakly(method):
    """A global hook calling `method` while its object lives: PyTorch's global optimizer
    hooks would otherwise keep a dropped SmartSwap, and its model, alive for good."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


class OptimizerStatesMixin:
    """SmartSwap's side of the "memory" preference: finding the optimizer, running its step
    block by block, and which states move in warm-up. A mixin of SmartSwap: it uses the
    instance's blocks, settings, phase and StateSwapper."""

    def _hook_optimizers(self, optimizer):
        """Under the "memory" preference, watches every optimizer step (PyTorch's global
        hooks) and adopts `optimizer` at once when given."""
        self._optimizer_hooks = []
        if self.settings.preference == "memory":
            self._optimizer_hooks = [
                register_optimizer_step_pre_hook(_weakly(self._before_step)),
                register_optimizer_step_post_hook(_weakly(self._after_step))]
            if optimizer is not None:
                self._adopt_optimizer(optimizer)

    def _unhook_optimizers(self):
        for hook in self._optimizer_hooks:
            hook.remove()
        self._optimizer_hooks = []
        if self._unwrap_optimizer is not None:
            self._unwrap_optimizer()
            self._unwrap_optimizer = None

    def _moves_states(self):
        return self.optimizer is not None and self.settings.preference == "memory"

    def _stop_moving_states(self):
        """Until the next plan: under the "memory" preference every block's optimizer states
        leave the device before the first block and come back during the backward (so warm-up
        fits in the least memory the executor can give it); otherwise they stay."""
        if self._moves_states():
            groups = {b: state_tensors(self.optimizer, block.parameters())
                      for b, block in enumerate(self.blocks)}
            groups = {b: g for b, g in groups.items() if g}
            self.states.plan(groups)
            self.state_release = {b: 0 for b in groups}
        else:
            self.states.plan({})
            self.state_release = {}

    def _adopt_optimizer(self, optimizer):
        """Makes `optimizer` the one whose states are planned, and runs its step block by
        block from now on: one call per block's parameters (and one for the rest), so the
        step's temporaries (a foreach AdamW makes several of its parameters' size) are one
        block's, not the model's. A step given a closure runs whole."""
        self.optimizer = optimizer
        parts = [{id(p) for p in block.parameters()} for block in self.blocks]
        in_blocks = set().union(*parts)
        whole = optimizer.step

        def step(closure=None):
            if closure is not None or not self.enabled:
                return whole(closure)
            groups = optimizer.param_groups
            rest = {id(p) for g in groups for p in g["params"]} - in_blocks
            self._before_step(optimizer, (), {})
            self._splitting = True
            try:
                for ids in [rest] + parts:
                    pairs = [(g, dict(g, params=[p for p in g["params"] if id(p) in ids]))
                             for g in groups]
                    pairs = [(g, sub) for g, sub in pairs if sub["params"]]
                    if not pairs:
                        continue
                    optimizer.param_groups = [sub for _, sub in pairs]
                    try:
                        whole()
                    finally:
                        optimizer.param_groups = groups
                        # A step that writes its group's settings writes them to the real group.
                        for g, sub in pairs:
                            for key, value in sub.items():
                                if key != "params" and g.get(key) is not value:
                                    g[key] = value
            finally:
                self._splitting = False
            self._after_step(optimizer, (), {})
            return None

        # A learning-rate scheduler made before checks that the step it wrapped is still
        # the one called; it still is, inside this one.
        if hasattr(whole, "_wrapped_by_lr_sched"):
            step._wrapped_by_lr_sched = True
        previous = vars(optimizer).get("step")  # a scheduler's wrapper, say

        def unwrap():
            if previous is None:
                vars(optimizer).pop("step", None)
            else:
                optimizer.step = previous

        optimizer.step = step
        self._unwrap_optimizer = unwrap

    def _before_step(self, optimizer, args, kwargs):
        if self._splitting:
            return
        if self.optimizer is None and self.enabled:
            mine = {id(p) for block in self.blocks for p in block.parameters()}
            if any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
                self._adopt_optimizer(optimizer)  # block by block from its next step
        if optimizer is self.optimizer:
            self.states.before_step()

    def _after_step(self, optimizer, args, kwargs):
        if self._splitting:
            return
        if optimizer is self.optimizer and self.enabled:
            if self.phase in ("warmup", "profile") and not self.states.groups:
                self._stop_moving_states()  # the states exist now (made by the first step)
            self.states.after_step()
