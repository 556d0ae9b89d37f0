"""Optimizer states off the device between two optimizer steps (SmartSwap's "memory"
preference): after a step, the states of the planned blocks' parameters are copied to pinned
host memory and their device memory freed during the next forward; during the backward they
come back, block by block, ahead of the step that needs them.

The state tensors stay the optimizer's own objects: their storage is emptied and refilled in
place (as FSDP does with parameters), so the optimizer, its foreach and fused kernels and its
state_dict see the same tensors. Between the first block's forward and the optimizer step a
moved state has no storage: code that reads optimizer states inside the step must not run
then.

When even the parameters, their gradients and the states do not fit the target together
(`in_step`), the states stay off the device through the backward too: each block's come back
during the block-by-block optimizer step, one block ahead of the part that uses them, and go
out again once that part has run, so at most two blocks' states are on the device at once.

With `step_in_backward`, each block's part of the step runs in the backward instead, once the
block's gradients are complete (a post-accumulate-grad hook per parameter the optimizer
steps): its states come in two blocks ahead, leave after the part, and its gradients are
freed. A first step only watches, and keeps the mode off when gradients are accumulated over
several backwards, changed before the step, or the optimizer's settings are; a backward whose
step never comes turns it off while running, back to warm-up."""

import dataclasses
import gc
import logging
import types
import weakref
from typing import NamedTuple

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook, register_optimizer_step_pre_hook)


log = logging.getLogger("glake.swap")

# Share of the room under the goal that states kept on the device may take: warm-up's peak is
# one step's, and the next may allocate a little differently.
_STATE_ROOM = 0.8
# Blocks ahead whose states come back while a block's part of the step runs in the backward
# (and blocks behind whose copies out may still be under way before their memory is freed).
_STATES_AHEAD = 2
# Under the "performance" preference the parameters, their gradients and the optimizer's
# states stay on the device. Where they alone take over this share of the goal, no plan of
# activations leaves room for the step: on one H200 the MoE benchmark at a 50% cap (90%) and
# dense-3b at 60% (90%) ran out of memory in warm-up, while dense-1b at 40% (about 52%)
# trained. MoE at 60% (75.2%) trained either way, faster with the states moved (0.72 against
# 0.64 in one call). BENCHMARKS.md, 2026-11-25 and 2026-11-29.
_RESIDENT_SHARE = 0.75


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
        self.lagging = []  # blocks copied out in the backward, memory not yet freed
        self.bytes_out = 0
        self.in_step = False  # states come back in the optimizer step, not in the backward

    @property
    def cuda(self):
        return self.swapper.cuda

    def plan(self, groups, leave_now=False):
        """Moves the states in `groups` ({block: [state tensors]}) from the next step on. A
        group that stays planned stays where it is: off the device, it comes back when the new
        plan says (bringing every state back at once, at the start of a step whose plan counts
        them out, ran the first step of a new plan out of memory). The others come back now.
        With `leave_now` (a plan adopted before a step's first block, the optimizer step
        behind it), planned groups still on the device start leaving at once, so that the
        step's forward frees them where the plan counts them out: a plan adopted right after
        another that had brought them back would otherwise run its first step with them all
        on the device (on the MoE benchmark, 3.5 GB over the plan's peak)."""
        for b in list(self.out):
            if [id(t) for t in groups.get(b, ())] != [id(t) for t in self.groups[b]]:
                self.prefetch(b)
        self._wait_back()
        self.groups = groups
        if leave_now:
            for b in groups:
                if b not in self.out:
                    self._copy_out(b)

    def after_step(self):
        """The optimizer step has run: start copying every planned group out (in step mode
        the step moved each group out already)."""
        for b in self.groups:
            if b not in self.out:
                self._copy_out(b)

    def _copy_out(self, b):
        """Queues the copy of group `b` to its pinned host buffers after the current stream's
        work, and records when it is done."""
        if self.cuda:
            self.swapper.d2h.wait_stream(torch.cuda.current_stream(self.swapper.device))
        copies = []
        for t in self.groups[b]:
            storage = t.untyped_storage()
            buf = self.host.get(id(t))
            if buf is None or buf.numel() != storage.nbytes():
                buf = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=self.cuda)
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

    def step_block(self, b, run, tensors, next_block=None, release_now=True):
        """Step mode: runs `run` (block `b`'s part of the optimizer step) with its states on
        the device, the next block's already coming back, then sends them out again and
        frees them in stream order. `tensors()` gives the block's states once the part has
        run (the first step makes them). Without `release_now` (a part run in the backward,
        whose stream must not stand still for the copy out) the memory is freed later, by
        `release_lagging`."""
        self.prefetch(b)
        if next_block is not None:
            self.prefetch(next_block)
        ready = self.back.pop(b, None)
        if ready is not None:
            # In the optimizer step not timed: the profiled step holds these copies, not the
            # plan's waits. In the backward the plan holds them (carried states): timed.
            self.swapper.wait_for(ready, timed=not release_now)
        run()
        # Read again each step: a state made later (an expert first routed to) moves too.
        made = tensors()
        if not made:
            return
        self.groups[b] = made
        self._copy_out(b)
        if release_now:
            self.release([b], timed=False)
        else:
            self.lagging.append(b)

    def release_lagging(self, lag):
        """Frees the groups copied out by parts run in the backward but the last `lag`, the
        stream waiting for their copies where the link has not kept pace: at the same point of
        every step, so the allocator's placements repeat from step to step (freeing each one
        as soon as the host saw its copy done changed them from step to step, and the
        allocator stitched 4-5 new ranges in every step on dense-3b under a 60% cap)."""
        pending = [b for b in self.lagging if b in self.out and b not in self.released]
        for i, b in enumerate(pending):
            # (No event: copied already, by the host.)
            if self.out[b] is None or i < len(pending) - lag:
                self.release([b])  # a wait for the link in the backward: timed
        self.lagging = [b for b in pending if b not in self.released]

    def release(self, blocks, timed=True):
        """Frees the device memory of the groups of `blocks` on their way out, once the
        current stream has waited for their copies (stream order: reusable at once)."""
        for b in blocks:
            if b in self.out and b not in self.released:
                if self.out[b] is not None:
                    self.swapper.wait_for(self.out[b], timed)
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

    def full_bytes(self, tensors):
        """Bytes of state `tensors` wherever they are (a moved one counts its host copy)."""
        return sum(self.host[id(t)].numel() if id(t) in self.host and
                   t.untyped_storage().nbytes() == 0 else t.untyped_storage().nbytes()
                   for t in tensors)

    def backward_prefetch(self, block, in_backward_step=False):
        """The backward reached `block`: its states start coming back (in step mode only when
        the block's part of the step runs in the backward)."""
        if not self.in_step or in_backward_step:
            self.prefetch(block)

    def before_step(self, split=False):
        """The optimizer step is about to run: every group back, and waited for (in step
        mode a `split` step brings each back in its block's part instead). In step mode the
        waits are not timed: the profiled optimizer step holds those copies, not the plan's
        waits."""
        if not (self.in_step and split):
            self._bring_all_back(timed=not self.in_step)

    def _bring_all_back(self, timed=True):
        for b in list(self.out):
            self.prefetch(b)
        self._wait_back(timed)

    def _wait_back(self, timed=True):
        for ready in self.back.values():
            self.swapper.wait_for(ready, timed)
        self.back.clear()

    def restore(self):
        """Every state back on the device now (a plan change, a removal, an abandoned step)."""
        self._bring_all_back()
        self.groups = {}


def _settings_of(optimizer):
    """The optimizer's param-group settings (all but the parameters) as plain values, so that
    two readings compare with == (a tensor setting, a learning rate say, as its numbers)."""
    return [{k: (v.tolist() if isinstance(v, torch.Tensor) else v)
             for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _plain_step(args, kwargs):
    """Whether an optimizer step was called with no closure nor other argument, from the
    arguments PyTorch's step hooks get (the optimizer first): only such a step is split into
    blocks (the others' arguments are the whole step's)."""
    return all(value is None for value in (*args[1:], *kwargs.values()))


def _content_sum(grad):
    """A real dense gradient's sum, as a one-element tensor on its device (no wait for it), or
    None for a sparse, complex or meta one (left to the version check)."""
    if grad.is_sparse or grad.is_complex() or grad.device.type == "meta":
        return None
    return torch.sum(grad.detach(), dtype=torch.float32)


def _sums_unchanged(pairs):
    """Whether every (before, after) pair of _content_sum values is equal, NaN to NaN, with
    one wait per device."""
    by_device = {}
    for before, after in pairs:
        by_device.setdefault(before.device, []).append((before, after))
    return all(bool(torch.isclose(torch.stack([b for b, _ in same]),
                                  torch.stack([a for _, a in same]),
                                  rtol=0, atol=0, equal_nan=True).all())
               for same in by_device.values())


def _weakly(method, *first):
    """A hook calling `method(*first, *args)` while its object lives: PyTorch's global
    optimizer hooks, and the gradient hooks on the model's parameters, would otherwise keep a
    dropped SmartSwap, and its model, alive for good."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        if bound is not None:
            bound(*first, *args)

    return call


class OptimizerBytes(NamedTuple):
    """What an optimizer holds on the device (OptimizerStatesMixin._optimizer_bytes)."""
    params: int    # its parameters
    learning: int  # those that learn: as many bytes of gradients
    states: int    # its states as made (a moved one by its host copy), else as it will make them
    made: bool     # whether it has made any


def _states_per_parameter(optimizer):
    """Tensors of a parameter's size that `optimizer` keeps per parameter once it has stepped:
    none for plain SGD, one with momentum, else two (AdamW's)."""
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if any(g.get("momentum") for g in optimizer.param_groups) else 0
    return 2


class OptimizerStatesMixin:
    """SmartSwap's side of the "memory" preference: whether the default preference moves the
    states, finding the optimizer, running its step block by block, and which states move in
    warm-up. A mixin of SmartSwap: it uses the instance's blocks, settings, phase and
    StateSwapper."""

    def _choose_preference(self, optimizer, s):
        """Settings `s` with a preference: the one given, else "performance" unless
        _activations_cannot_meet_the_goal; then "memory" (_to_memory). A "performance" given
        where activations cannot meet the goal is kept, with a warning. With no preference
        given and no optimizer, "performance" until the optimizer is found at the first
        forward (_find_optimizer) or its first step shows its states (_decide_at_first_step)."""
        self._preference_pending = (s.preference is None and optimizer is None
                                    and self._resolve_target() is not None)
        self._switch_to_memory = None  # the optimizer whose first step chose "memory"
        self._looking = optimizer is None  # for the optimizer, at the first forward
        self._found = None  # the optimizer _find_optimizer took, until another is seen
        short = (s.preference in (None, "performance")
                 and self._activations_cannot_meet_the_goal(optimizer))
        if s.preference is None and short:
            return self._to_memory(s, short)
        if short:
            log.warning("glake.swap: %s, under the \"performance\" preference given: the "
                        "step may run out of memory (preference \"memory\" moves them)", short)
        # (While the choice waits for the first step, the step in the backward stays unset.)
        return dataclasses.replace(s, preference=s.preference or "performance",
                                   step_in_backward=(s.step_in_backward
                                                     if self._preference_pending
                                                     else bool(s.step_in_backward)))

    @staticmethod
    def _to_memory(s, why):
        """Settings `s` under the "memory" preference, with the optimizer step in the backward
        unless set off (it turns itself off after a first step that shows code changing the
        gradients between backward and step), said in a log line with `why`."""
        in_backward = s.step_in_backward is not False
        log.warning("glake.swap: %s: the optimizer states move too (preference \"memory\"%s; "
                    "set preference to choose)", why,
                    ", the step in the backward: gradients are None after it, so code that "
                    "reads them before the step needs step_in_backward=False" if in_backward
                    else "")
        return dataclasses.replace(s, preference="memory", step_in_backward=in_backward)

    def _find_optimizer(self):
        """At the first forward, where no optimizer was given and the preference needs one (not
        chosen yet, or "memory"): the one optimizer among the live objects that holds states
        of the blocks' parameters is taken as if given to `apply`. So states it holds already
        (loaded from a checkpoint) move from this step on, where they would stay on the device
        until its first step, and the preference is chosen with no second warm-up. One pass
        over the garbage collector's objects, once (0.34 s for 2.3 million objects on a 2-core
        host). None found (an optimizer without states: its first step makes them block by
        block), or several: left to the step hooks. One found that is not the one stepping
        the blocks is named at the first step of the other (_before_step)."""
        if not self._looking:
            return
        self._looking = False
        if self.optimizer is not None or not (self._preference_pending
                                              or self.settings.preference == "memory"):
            return
        # (type(), not isinstance: some lazy module attributes warn when asked their class.)
        found = [o for o in gc.get_objects()
                 if issubclass(type(o), torch.optim.Optimizer) and self._steps_blocks(o)
                 and any(state_tensors(o, block.parameters()) for block in self.blocks)]
        if len(found) != 1:
            return
        optimizer = found[0]
        if self._preference_pending:
            # Chosen now as if the optimizer had been given (the preference was left unset).
            self._drop_first_step_hooks()
            self.settings = self._choose_preference(
                optimizer, dataclasses.replace(self.settings, preference=None))
            self._hook_optimizers(optimizer)
        else:
            self._take_over(optimizer)  # "memory" given: its hooks are registered already
        self._found = optimizer

    def _decide_at_first_step(self, optimizer, args, kwargs):
        """The default preference's choice, at the first step of an optimizer stepping the
        blocks' parameters (PyTorch's global pre-step hook): "memory" if its states make
        activations alone unable to meet the goal: from this very step, which then runs block
        by block (_run_this_step_by_blocks), unless it was given a closure or other arguments
        (then from the next iteration on). Hooks cannot be added or removed while PyTorch runs
        them, so _settle_preference does the rest."""
        if not self._preference_pending or not self.enabled or not self._steps_blocks(optimizer):
            return
        self._preference_pending = False
        why = self._activations_cannot_meet_the_goal(optimizer)
        if not why:
            return
        if not _plain_step(args, kwargs):
            self._switch_to_memory = (optimizer, why)
            self._warn_if_first_step_exceeds_goal(optimizer)
            return
        self.settings = self._to_memory(self.settings, why)
        self._switch_to_memory = (optimizer, None)  # the hooks change at the next iteration
        # (States made before go out after this step, as every step's: not before it too.)
        self._adopt_optimizer(optimizer)
        self._run_this_step_by_blocks(optimizer)

    def _run_this_step_by_blocks(self, optimizer):
        """Inside PyTorch's pre-step hook of an optimizer just adopted: this step runs block by
        block now (the adopted step), each block's states sent out as soon as its part has made
        them (a whole first step makes every state at once beside every parameter and
        gradient: on the MoE benchmark at a 50% cap that alone ran out of memory). The whole
        step PyTorch runs after the hook then finds no gradient and skips every parameter; the
        gradients come back after it (_give_held_grads_back)."""
        optimizer.step()  # the adopted step
        self._held_grads = [(p, p.grad) for g in optimizer.param_groups for p in g["params"]
                            if p.grad is not None]
        for p, _ in self._held_grads:
            p.grad = None

    def _give_held_grads_back(self, optimizer=None, args=None, kwargs=None):
        """After the whole step that _run_this_step_by_blocks emptied (PyTorch's post-step
        hook): the gradients it held back are the parameters' again, as after any step."""
        if self._splitting or not self._held_grads:
            return
        for p, grad in self._held_grads:
            if p.grad is None:  # (never over a gradient made since)
                p.grad = grad
        self._held_grads = []

    def _warn_if_first_step_exceeds_goal(self, optimizer):
        """An optimizer first seen at a first step given arguments runs that step whole: it
        makes every state at once, beside every parameter and gradient (and a foreach step's
        temporaries), before any plan can move them. Says so where that alone is over the goal
        (CUDA)."""
        holds = self._optimizer_bytes(optimizer)
        if not self.cuda or holds.made:
            return
        to_make = holds.states
        held = torch.cuda.memory_allocated(self.device)
        goal = self._resolve_target() * (1 - self.settings.margin)
        if held + to_make > goal:
            log.warning("glake.swap: the optimizer's first step, given arguments, runs whole "
                        "and makes its states (%.2f GiB) beside the %.2f GiB allocated, over "
                        "the %.2f GiB goal, before they can move: a step without arguments "
                        "runs block by block", to_make / 2**30,
                        held / 2**30, goal / 2**30)

    def _settle_preference(self):
        """At an iteration's start, once _decide_at_first_step has decided: its hooks go (under
        "performance" no other is registered), and under a switch to "memory" the hooks of
        that preference come, with a fresh warm-up, the optimizer adopted (in its first step
        already, unless that step had arguments) and its states moving."""
        if self._preference_pending or not self._deciding:
            return
        self._drop_first_step_hooks()
        switch, self._switch_to_memory = self._switch_to_memory, None
        if switch is None:
            return
        optimizer, why = switch
        if self.optimizer is optimizer:
            self._optimizer_hooks = self._memory_hooks()
        else:
            self.settings = self._to_memory(self.settings, why)
            self._hook_optimizers(optimizer)
        self._restart()

    def _drop_first_step_hooks(self):
        """The hooks that waited for the first step (_hook_optimizers) go."""
        self._deciding = False
        for hook in self._optimizer_hooks:
            hook.remove()
        self._optimizer_hooks = []

    def _activations_cannot_meet_the_goal(self, optimizer):
        """Why no plan of activations alone can meet the goal (target less margin), or None:
        the optimizer's parameters, as many bytes of gradients and its states (until it has
        made them: _states_per_parameter) would take over _RESIDENT_SHARE of it by themselves.
        None too where the optimizer keeps no states or not even the parameters fit (no
        preference helps then), where there is no target, and where no optimizer is known yet
        (its states are not)."""
        target = self._resolve_target()
        if optimizer is None or target is None:
            return None
        param_bytes, learning_bytes, state_bytes, _ = self._optimizer_bytes(optimizer)
        resident = param_bytes + learning_bytes + state_bytes
        goal = target * (1 - self.settings.margin)
        # (No state to move, or not even the parameters fit: "memory" cannot help.)
        if state_bytes == 0 or goal <= param_bytes or resident <= _RESIDENT_SHARE * goal:
            return None
        return (f"parameters, gradients and optimizer states ({resident / 2**30:.2f} GiB) "
                f"would take {100 * resident / goal:.0f}% of the {goal / 2**30:.2f} GiB goal, "
                "so activations alone cannot meet it")

    def _hook_optimizers(self, optimizer):
        """Under the "memory" preference, watches every optimizer step (PyTorch's global
        hooks) and adopts `optimizer` at once when given."""
        self._optimizer_hooks, self._gradient_hooks = [], []
        self.backward_step = "off"  # "watching" the first step, then "on" or "off"
        self._watched = {}  # id(param) -> (param, grad pointer, version, backwards, sum)
        self.stepped_in_backward = set()  # blocks whose part ran in this step's backward
        self._grads_wanted, self._grads_left = {}, {}
        self._stepped_params = []  # per block: the parameters the optimizer steps
        self._watched_settings = None  # the optimizer's settings at the watched backward
        self._restart_pending = False  # the mode turned off while running: back to warm-up
        self._held_grads = []  # (parameter, gradient) held back by _run_this_step_by_blocks
        self._deciding = self._preference_pending  # the first step's hooks are registered
        if self._preference_pending:
            self._optimizer_hooks = [
                register_optimizer_step_pre_hook(_weakly(self._decide_at_first_step)),
                register_optimizer_step_post_hook(_weakly(self._give_held_grads_back))]
        if self.settings.preference == "memory":
            self._optimizer_hooks = self._memory_hooks()
            if optimizer is not None:
                self._take_over(optimizer)

    def _memory_hooks(self):
        """The "memory" preference's global hooks: every optimizer step watched."""
        return [register_optimizer_step_pre_hook(_weakly(self._before_step)),
                register_optimizer_step_post_hook(_weakly(self._after_step))]

    def _take_over(self, optimizer):
        """Adopts `optimizer` under the "memory" preference between two steps (given to
        `apply`, or found at the first forward). States made before (an optimizer that has
        stepped already) leave now, as after a step (_after_step), freed before the first
        block's forward: otherwise they would all stay through the next forward and backward,
        the peak this mode avoids. (An optimizer adopted by the step hooks is about to step,
        and is only adopted: its states go out after that step.)"""
        self._adopt_optimizer(optimizer)
        if not self.states.groups:
            self._stop_moving_states()
        self.states.after_step()

    def _unhook_optimizers(self):
        for hook in self._optimizer_hooks + self._gradient_hooks:
            hook.remove()
        self._optimizer_hooks, self._gradient_hooks = [], []
        if self._unwrap_optimizer is not None:
            self._unwrap_optimizer()
            self._unwrap_optimizer = None

    def _moves_states(self):
        return self.optimizer is not None and self.settings.preference == "memory"

    def _decide_states_in_step(self):
        """Whether the states come back only in the optimizer step (the `states_in_step`
        setting, else: when the parameters, their gradients and the states together take
        over 90% of the target left after the margin, so that holding them all at the step,
        as the backward's prefetch does, would not fit)."""
        setting = self.settings.states_in_step
        if self.backward_step in ("watching", "on") and self._moves_states():
            self.states.in_step = True  # each block's states come back for its part alone
            return
        if setting is not None or not self._moves_states():
            self.states.in_step = bool(setting) and self._moves_states()
            return
        target = self._resolve_target()
        if target is None:
            self.states.in_step = False
            return
        param_bytes, _, state_bytes, _ = self._optimizer_bytes(self.optimizer)
        self.states.in_step = (2 * param_bytes + state_bytes
                               > 0.9 * target * (1 - self.settings.margin))

    def _optimizer_bytes(self, optimizer):
        """What `optimizer` holds: its parameters, those that learn (as many bytes of
        gradients), and its states, as made (a moved one counts its host copy), else as it will
        make them (_states_per_parameter per learning parameter)."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        learning = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        made = state_tensors(optimizer, params)
        states = (self.states.full_bytes(made) if made
                  else _states_per_parameter(optimizer) * learning)
        return OptimizerBytes(param_bytes, learning, states, bool(made))

    def _steps_blocks(self, optimizer):
        """Whether `optimizer` steps any of the blocks' parameters (one found among live
        objects may not be whole yet: one without groups steps none)."""
        return any(id(p) in self._block_param_ids
                   for group in getattr(optimizer, "param_groups", ())
                   for p in group.get("params", ()))

    def _stop_moving_states(self):
        """Until the next plan: under the "memory" preference every block's optimizer states
        leave the device before the first block and come back during the backward, or in step
        mode inside the optimizer step (so warm-up fits in the least memory the executor can
        give it); otherwise they stay."""
        self._decide_states_in_step()
        self.resident_states = []  # every block's states move until a plan keeps some
        if self._moves_states():
            groups = self._state_groups()
            self.states.plan(groups)
            self.state_release = {b: 0 for b in groups}
        else:
            self.states.plan({})
            self.state_release = {}

    def _keep_states_that_fit(self, groups):
        """Step mode under a plan that recomputes every block (the memory warm-up ran in): the
        first blocks whose states fit in the room warm-up's peak left under the goal stay on
        the device (their copies cost the step time); the others' groups are returned."""
        full = (self.decisions is not None and len(self.decisions) == len(self.blocks)
                and not any(self.decisions.values()))
        kept = self._states_that_fit(groups) if full else []
        if kept != self.resident_states and kept:
            log.info("glake.swap: optimizer states of blocks 0-%d stay on the device (warm-up "
                     "peaked at %.2f GiB of a %.2f GiB goal)", kept[-1],
                     self.warm_peak / 2**30, self._goal() / 2**30)
        self.resident_states = kept
        return {b: g for b, g in groups.items() if b not in kept}

    def _states_that_fit(self, groups):
        """Step mode: the first blocks of `groups` whose states fit in the room warm-up's peak
        left under the goal (a share of it: the next step may allocate a little differently)."""
        peak, goal = self.warm_peak, self._goal()
        kept = []
        if self.backward_step == "off" and self.states.in_step and peak and goal and goal > peak:
            room = (goal - peak) * _STATE_ROOM
            for b in sorted(groups):
                size = self.states.full_bytes(groups[b])
                if size > room:
                    break
                room -= size
                kept.append(b)
        return kept

    def _state_groups(self):
        """Every block's optimizer states, by block (blocks without any left out)."""
        groups = {}
        for b, block in enumerate(self.blocks):
            tensors = state_tensors(self.optimizer, block.parameters())
            if tensors:
                groups[b] = tensors
        return groups

    def _adopt_optimizer(self, optimizer):
        """Makes `optimizer` the one whose states are planned, and runs its step block by
        block from now on: one call per block's parameters (and one for the rest), so the
        step's temporaries (a foreach AdamW makes several of its parameters' size) are one
        block's, not the model's. A step given a closure (or any argument) runs whole. With the
        `step_in_backward` setting, a block's part runs in the backward instead, once the
        first step has shown that nothing touches the gradients between backward and step."""
        self.optimizer = optimizer
        self._decide_states_in_step()
        if self.states.in_step and not self.states.groups:
            self._stop_moving_states()  # states made before (it has stepped already) move
        whole = optimizer.step
        whole_state_dict = optimizer.state_dict
        self._whole_step = whole

        # The replacements hold SmartSwap weakly: a scheduler made later keeps the step it
        # wraps after remove(), and would otherwise keep SmartSwap and its pinned buffers.
        me = weakref.ref(self)

        def step(_optimizer, closure=None, **kwargs):
            smart = me()
            if smart is None or closure is not None or kwargs or not smart.enabled:
                return whole(closure, **kwargs)
            smart._split_step(optimizer)
            return None

        def state_dict():
            # A checkpoint taken between steps reads every state: step mode brings them back.
            smart = me()
            if smart is not None and smart.enabled and smart.states.in_step and smart.states.out:
                smart._states_back_until_next_forward()
            return whole_state_dict()

        # A learning-rate scheduler made before checks that the step it wrapped is still
        # the one called; it still is, inside this one.
        if hasattr(whole, "_wrapped_by_lr_sched"):
            step._wrapped_by_lr_sched = True
        previous = vars(optimizer).get("step")  # a scheduler's wrapper, say

        previous_state_dict = vars(optimizer).get("state_dict")

        # A bound method, as PyTorch's own: a scheduler made later wraps it through __func__.
        mine = types.MethodType(step, optimizer)

        def unwrap():
            for name, before in (("step", previous), ("state_dict", previous_state_dict)):
                if name == "step" and vars(optimizer).get("step") is not mine:
                    continue  # wrapped since (a scheduler made later): it runs whole now
                if before is None:
                    vars(optimizer).pop(name, None)
                else:
                    setattr(optimizer, name, before)

        optimizer.step = mine
        optimizer.state_dict = state_dict
        self._unwrap_optimizer = unwrap
        self._hook_gradients()

    def _split_step(self, optimizer):
        """The adopted optimizer's step, block by block: the parameters outside the blocks
        first, then each block's not stepped in the backward already, with its states brought
        back for it in step mode."""
        groups = optimizer.param_groups
        rest = {id(p) for g in groups for p in g["params"]} - self._block_param_ids
        self._check_gradients_untouched()
        self._before_step(optimizer, (), {}, split=True)
        self._splitting = True
        try:
            self._optimizer_part(rest)
            for b, ids in enumerate(self._block_params):
                if b in self.stepped_in_backward:
                    continue  # its part ran in the backward
                if not self.states.in_step or b in self.resident_states:
                    self._optimizer_part(ids)
                    continue
                block = self.blocks[b]
                self.states.step_block(
                    b, lambda ids=ids: self._optimizer_part(ids),
                    lambda block=block: state_tensors(optimizer, block.parameters()),
                    b + 1 if b + 1 < len(self._block_params) else None)
        finally:
            self._splitting = False
            self.stepped_in_backward = set()
        self._after_step(optimizer, (), {})

    def _optimizer_part(self, ids):
        """Runs the optimizer's own step on the parameters whose ids are in `ids` alone (its
        param groups narrowed to them for the call)."""
        optimizer, groups = self.optimizer, self.optimizer.param_groups
        pairs = [(g, dict(g, params=[p for p in g["params"] if id(p) in ids])) for g in groups]
        pairs = [(g, sub) for g, sub in pairs if sub["params"]]
        if not pairs:
            return
        optimizer.param_groups = [sub for _, sub in pairs]
        try:
            self._whole_step()
        finally:
            optimizer.param_groups = groups
            # A step that writes its group's settings writes them to the real group.
            for g, sub in pairs:
                for key, value in sub.items():
                    if key != "params" and g.get(key) is not value:
                        g[key] = value

    # -- the optimizer step in the backward ---------------------------------------------------

    def _hook_gradients(self):
        """With `step_in_backward`: a hook on every block parameter that learns, called once
        its gradient of the backward is complete; a block's part of the step runs when all of
        its parameters' have been (PyTorch's "optimizer step in backward")."""
        if self._gradient_hooks:
            return  # hooked when first adopted
        self._grads_wanted = {}
        if not (self.settings.step_in_backward and self._moves_states()):
            return
        self.backward_step = "watching"
        stepped = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        self._stepped_params = []
        for b, block in enumerate(self.blocks):
            # The parameters this optimizer steps: another optimizer's keep their gradients.
            learning = [p for p in block.parameters() if p.requires_grad and id(p) in stepped]
            self._stepped_params.append(learning)
            self._grads_wanted[b] = len(learning)
            for p in learning:
                self._gradient_hooks.append(p.register_post_accumulate_grad_hook(
                    _weakly(self._gradient_ready, b)))
        self._grads_left = dict(self._grads_wanted)
        self.states.in_step = True

    def _gradient_ready(self, b, p):
        if not self.enabled or self.in_optimizer_step or self.backward_step == "off":
            return
        if self.backward_step == "watching":
            # The first step only watches: a gradient made twice (accumulation over several
            # backwards) or changed before the step (clipping, unscaling), or a setting of the
            # optimizer changed before the step (a learning rate set by hand), keeps this off.
            if not self._watched:
                self._watched_settings = _settings_of(self.optimizer)
            seen = self._watched.get(id(p))
            self._watched[id(p)] = (p, p.grad.data_ptr(), p.grad._version,
                                    1 + (seen[3] if seen else 0), _content_sum(p.grad))
            return
        self._grads_left[b] -= 1
        if self._grads_left[b] == 0:
            # Counted afresh: a second backward of the same forward must reach the part again
            # to be caught as accumulation.
            self._grads_left[b] = self._grads_wanted[b]
            self._step_block_in_backward(b)

    def _check_gradients_untouched(self):
        """At a step while watching: turns the step in the backward on from the next step
        when every gradient watched came from one backward and is as that backward left it."""
        if self.backward_step != "watching" or not self._watched:
            return
        why = None
        sums = []
        for p, ptr, version, count, before in self._watched.values():
            if count > 1:
                why = "a gradient was made by more than one backward before the step"
            elif p.grad is None or p.grad.data_ptr() != ptr or p.grad._version != version:
                why = "a gradient was changed between the backward and the step"
            if why:
                break
            if before is not None:
                sums.append((before, _content_sum(p.grad)))
        # Some in-place ops leave a tensor's version as it was (GradScaler's unscaling): the
        # gradients' sums, taken when the backward left them, must still be what they were.
        if why is None and not _sums_unchanged(sums):
            why = "a gradient's values were changed between the backward and the step"
        if why is None and self._watched_settings != _settings_of(self.optimizer):
            why = "a setting of the optimizer was changed between the backward and the step"
        self._watched = {}
        if why:
            self.backward_step = "off"
            log.warning("glake.swap: the optimizer step stays after the backward: %s", why)
            return
        self.backward_step = "on"
        log.info("glake.swap: each block's part of the optimizer step runs in the backward "
                 "from the next step on")

    def _turn_backward_step_off(self, why):
        """While running: the step goes back after the backward, and SmartSwap back to warm-up
        at the next step (its plan counted on gradients and states leaving in the backward)."""
        self.backward_step = "off"
        self.stepped_in_backward = set()
        self._restart_pending = True
        log.error("glake.swap: %s; the optimizer step stays after the backward from now on",
                  why)

    def _new_backward_step_iteration(self):
        """A forward starts (its first block): counts of gradients start afresh (an aborted
        backward leaves some behind), and blocks updated by a backward no step followed are
        reported, with the mode turned off."""
        self._grads_left = dict(self._grads_wanted)
        if self.backward_step == "on" and self.stepped_in_backward:
            self._turn_backward_step_off(
                "the optimizer step did not follow a backward that updated blocks "
                f"{sorted(self.stepped_in_backward)} (a skipped step, accumulation over "
                "several backwards, or an aborted backward)")

    def _step_block_in_backward(self, b):
        """Block `b`'s gradients are complete: its part of the step runs now, with its states
        brought back (the next blocks' already coming), then its states leave and its
        gradients are freed, so neither the whole model's gradients nor its states are ever
        on the device together."""
        if b in self.stepped_in_backward:
            # A second backward before the step: accumulation the first step did not show.
            # The first backward's update stands; this one's gradients go to the step.
            self._turn_backward_step_off(
                f"block {b}'s gradients were made by a second backward before the step: the "
                "first backward's gradients were applied in it, this one's are applied by the "
                "step")
            return
        for ahead in range(b - 1, max(-1, b - 1 - _STATES_AHEAD), -1):
            self.states.prefetch(ahead)
        block, ids = self.blocks[b], self._block_params[b]
        self._splitting = True
        try:
            if b in self.resident_states:
                self._optimizer_part(ids)
            else:
                self.states.step_block(
                    b, lambda: self._optimizer_part(ids),
                    lambda: state_tensors(self.optimizer, block.parameters()),
                    release_now=False)
        finally:
            self._splitting = False
        for p in self._stepped_params[b]:
            p.grad = None
        self.stepped_in_backward.add(b)
        self.states.release_lagging(_STATES_AHEAD)

    def _before_step(self, optimizer, args, kwargs, split=False):
        if self._splitting:
            return
        if (self._found is not None and optimizer is not self._found and self.enabled
                and self._steps_blocks(optimizer)):
            self._found = None
            log.warning("glake.swap: the optimizer found at the first forward, whose states "
                        "move, is not the one stepping the blocks, whose states stay on the "
                        "device: pass it to glake.swap.apply(model, optimizer=...)")
        if self.optimizer is None and self.enabled and self._steps_blocks(optimizer):
            self._adopt_optimizer(optimizer)  # (its states go out after this step)
            if _plain_step(args, kwargs):
                self._run_this_step_by_blocks(optimizer)
                return
        if optimizer is self.optimizer:
            self.in_optimizer_step = True  # a closure may run the forward from here
            self.states.before_step(split)

    def _after_step(self, optimizer, args, kwargs):
        if self._splitting:
            return
        self._give_held_grads_back()
        if optimizer is self.optimizer:
            self.in_optimizer_step = False
        if optimizer is self.optimizer and self.enabled:
            if self.phase in ("warmup", "profile") and not self.states.groups:
                self._stop_moving_states()  # the states exist now (made by the first step)
            # In step mode a whole step (given a closure) had every state back: they go out
            # now and are freed before the next forward's first block (`_run_block`).
            self.states.after_step()

    def _states_back_until_next_forward(self):
        """Step mode: every moved state on the device now, sent out again at once and freed
        before the next forward's first block (`_run_block`)."""
        self.states.before_step()
        self.states.after_step()
