#!/usr/bin/env python3
"""Training under a memory cap: SmartSwap (glake.swap on glake's allocator) against what users
have today (full activation checkpointing, save_on_cpu with pinned memory, on PyTorch's native
allocator), on dense decoder-only transformers of two widths and a mixture of experts, each
method in its own process with the same seed and batches (its caps in turn, the caps after one
that ran out of memory in a fresh process).

    python3 bench/swap_bench.py                                   # every model, every cap
    python3 bench/swap_bench.py --models dense-1b --caps 0.6 --steps 6
    python3 bench/swap_bench.py --markdown swap.md --jsonl swap.jsonl
    python3 bench/swap_bench.py --plot swap.png --from-jsonl swap.jsonl   # plot only

For each model the unconstrained run comes first: its peak reserved bytes P and step time are
the reference (it runs again after the methods, and the table says how far its step moved:
the machine's drift over the call). Then each method runs under caps of P times each --caps
fraction (set with torch.cuda.set_per_process_memory_fraction; glake's SmartSwap gets the
same bytes as its target). Per cap: tokens per second (median step, each step synchronised,
warm-up left out, and SmartSwap's warm-up and search: it runs until it is stable), that
relative to unconstrained, peak reserved and allocated bytes, and for SmartSwap the planner's
predicted step time and peak beside the measured ones. An out-of-memory error is reported as
OOM. The glake process also checks the loss: with deterministic kernels
(torch.use_deterministic_algorithms, math attention), 20 steps under SmartSwap capped at 60%
of the unplanned peak against 20 unplanned steps from the same seed, bit for bit.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
METHODS = ("glake", "checkpoint", "save_on_cpu")  # and glake-performance, glake-memory,
# glake-stepbwd, glake-enable, -relay/-1link suffixes, method@allocator
MODELS = {
    # name: (width, layers, heads, ffn, experts, batch, sequence)
    "dense-1b": (2048, 22, 16, 5632, 0, 8, 2048),
    "dense-3b": (3072, 26, 24, 8192, 0, 4, 2048),
    "moe": (1024, 12, 16, 2816, 8, 8, 1024),
}
VOCAB = 32000
GIB = 2**30


def build(name, torch):
    """The model (bf16, on the GPU) of MODELS[name] with its repeated blocks in `.layers`."""
    import torch.nn.functional as F
    width, layers, heads, ffn, experts, _, _ = MODELS[name]
    nn = torch.nn

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(width, ffn, bias=False)
            self.up = nn.Linear(width, ffn, bias=False)
            self.down = nn.Linear(ffn, width, bias=False)

        def forward(self, x):
            return self.down(F.silu(self.gate(x)) * self.up(x))

    class Moe(nn.Module):
        """Top-2 routing over `experts` MLPs; expert loads change with the tokens."""

        def __init__(self):
            super().__init__()
            self.router = nn.Linear(width, experts, bias=False)
            self.experts = nn.ModuleList(Mlp() for _ in range(experts))

        def forward(self, x):
            flat = x.flatten(0, 1)
            weights, chosen = torch.topk(F.softmax(self.router(flat), -1, dtype=torch.float), 2)
            weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
            out = torch.zeros_like(flat)
            for e, expert in enumerate(self.experts):
                token, slot = torch.where(chosen == e)
                out = out.index_add(0, token, expert(flat[token]) * weights[token, slot, None])
            return out.view_as(x)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.RMSNorm(width)
            self.qkv = nn.Linear(width, 3 * width, bias=False)
            self.out = nn.Linear(width, width, bias=False)
            self.norm2 = nn.RMSNorm(width)
            self.mlp = Moe() if experts else Mlp()

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, heads, width // heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(b, s, width))
            return x + self.mlp(self.norm2(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, width)
            self.layers = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.RMSNorm(width)
            self.head = nn.Linear(width, VOCAB, bias=False)

        def forward(self, ids):
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            logits = self.head(self.norm(x)).float()
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Model()
    torch.set_default_dtype(torch.float32)
    return model


def sequence_lengths(seq, fractions):
    """The sequence lengths that take turns step by step: `fractions` (comma separated) of the
    model's `seq`, each at least 16 tokens."""
    try:
        shares = [float(f) for f in fractions.split(",")]
    except ValueError:
        shares = []
    if not shares or any(not 0 < f <= 1 for f in shares):
        raise SystemExit(f"--lengths takes fractions in (0, 1], not {fractions!r}")
    return [max(16, int(seq * f)) for f in shares]


def write_planning_record(logs, label, smart):
    """The planner's inputs and trials (SmartSwap.planning_record) under `logs`, to simulate
    away from the GPU machine; nothing without `logs` or before the profiled step."""
    record = smart.planning_record() if logs else None
    if record is not None:
        path = pathlib.Path(logs) / f"{label}.plan.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))


def child(args):
    """One method on one model in this process; prints one JSON line per cap."""
    # A fixed cuBLAS workspace, so that the loss check below can ask for determinism.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    spec, name = args.child_method, args.child_model
    method, _, allocator = spec.partition("@")
    # "glake-memory": SmartSwap with the "memory" preference (optimizer states move too).
    # A "-relay" suffix: swaps also over a peer GPU's link (GLAKE_SWAP_RELAY=1); "-1link":
    # the device's own link only (the default).
    for suffix, relay in (("-relay", "1"), ("-1link", "0")):
        if method.endswith(suffix):
            os.environ["GLAKE_SWAP_RELAY"] = relay
            method = method[: -len(suffix)]
    # "glake-stepbwd": the "memory" preference with each block's part of the optimizer step
    # run in the backward (SmartSwap's step_in_backward setting). "glake-performance":
    # activations only, whatever the target. "glake": SmartSwap's default, which picks one.
    # "glake-enable": the default as glake.torch.enable(swap=...) applies it, with no
    # optimizer given (a fresh one at each cap: the choice is made in its first step).
    given_optimizer = method != "glake-enable"
    preference = {"glake-memory": "memory", "glake-stepbwd": "memory",
                  "glake-performance": "performance"}.get(method)
    step_in_backward = {"glake-stepbwd": True, "glake-memory": False}.get(method)
    method = "glake" if method.startswith("glake-") else method
    if (allocator or ("glake" if method == "glake" else "native")) == "glake":
        import glake.torch
        glake.torch.enable()
    if method == "glake":
        import glake.swap
    if args.logs:
        import logging
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch
    from torch.utils.checkpoint import checkpoint
    if args.alloc_trace_dir:
        import record_trace  # beside this file; imports torch, so after glake's allocator
        os.makedirs(args.alloc_trace_dir, exist_ok=True)

    _, _, _, _, _, batch, seq = MODELS[name]
    total = torch.cuda.mem_get_info()[1]
    model = build(name, torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator(device="cuda").manual_seed(1)
    lengths = sequence_lengths(seq, args.lengths)
    # Four batches of each length, the lengths taking turns step by step.
    batches = [torch.randint(0, VOCAB, (batch, length), device="cuda", generator=gen)
               for _ in range(4) for length in lengths]
    originals = [layer.forward for layer in model.layers]

    def use(kind):
        for layer, original in zip(model.layers, originals):
            layer.forward = original
        if kind == "checkpoint":
            for layer, original in zip(model.layers, originals):
                layer.forward = (lambda f: lambda *a, **k: checkpoint(
                    f, *a, use_reentrant=False, **k))(original)

    def step(i):
        ids = batches[i % len(batches)]
        if method == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                loss = model(ids)
        else:
            loss = model(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    counters = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc",
                "num_device_free", "glake.stitches", "glake.stitch_reuse_hits",
                "glake.stitched_allocations")

    def run(steps, warm, smart=None, trace=None, alloc_trace=None):
        """`warm` unmeasured steps (for SmartSwap: until it is stable, at most 80), then
        `steps` measured; the allocator's counters over the measured steps; with `trace` (a
        path less its suffix), one more step's profile: a timeline (.json) and two tables by
        device and by host time (.txt); with `alloc_trace` (a path), every allocation event
        of the run in glake-replay's format, each measured step marked."""
        times, losses, marks, tokens = [], [], [], []
        torch.cuda.synchronize()
        if alloc_trace:
            record_trace.start()
        finished = False
        try:
            i = 0
            # (SmartSwap's phases advance on steps of the longest length alone.)
            most = 80 * len(lengths)
            while i < warm or (smart is not None and smart.phase != "stable" and i < most):
                losses.append(step(i).item())
                i += 1
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_stats()
            for j in range(steps):
                if alloc_trace:
                    marks.append((record_trace.recorded(), f"measured step {j}"))
                t = time.perf_counter()
                losses.append(step(i + j).item())
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
                tokens.append(batches[(i + j) % len(batches)].numel())
            finished = True
        finally:  # a run that ran out of memory keeps its trace, marked so
            if alloc_trace:
                end = "end" if finished else "out of memory"
                record_trace.write(alloc_trace, marks=marks + [(float("inf"), end)])
        after = torch.cuda.memory_stats()
        peaks = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
        if trace:  # one more step, not timed: the profiler slows it
            activities = [torch.profiler.ProfilerActivity.CPU,
                          torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as profiler:
                step(i + steps)
                torch.cuda.synchronize()
            profiler.export_chrome_trace(trace + ".json")
            table = profiler.key_averages()
            with open(trace + ".txt", "w") as f:
                f.write(table.table(sort_by="cuda_time_total", row_limit=30) + "\n")
                f.write(table.table(sort_by="self_cpu_time_total", row_limit=30) + "\n")
        after = torch.cuda.memory_stats()
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in counters}
        return times, losses, delta, peaks, tokens

    caps = [None] if method == "unconstrained" else [float(c) for c in args.caps.split(",")]
    for n, cap in enumerate(caps, 1):
        row = {"model": name, "method": spec, "cap": cap,
               "tokens_per_step": batch * sum(lengths) / len(lengths)}
        if len(lengths) > 1:
            row["lengths"] = lengths
        smart = None
        if not given_optimizer and n > 1:
            # As in a process that starts with glake.torch.enable(swap=...): an optimizer not
            # yet stepped. (The last cap's, holding states, would be found at the first
            # forward; before SmartSwap looked there, its states went over the next cap.)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        torch.cuda.empty_cache()
        limit = int(cap * args.reference_peak) if cap else None
        torch.cuda.set_per_process_memory_fraction(limit / total if limit else 1.0)
        try:
            if method == "glake":
                use(None)
                smart = glake.swap.apply(model, optimizer=opt if given_optimizer else None,
                                         target=limit, preference=preference,
                                         step_in_backward=step_in_backward)
            else:
                use(method if method == "checkpoint" else None)
            label = f"{name}-{spec.replace('@', '-on-')}-{cap}"
            trace = os.path.join(args.trace_dir, label) if args.trace_dir and cap else None
            alloc_trace = (os.path.join(args.alloc_trace_dir, label + ".txt.gz")
                           if args.alloc_trace_dir and cap else None)
            # Every length measured as often (the methods start measuring at other steps).
            steps = -(-args.steps // len(lengths)) * len(lengths)
            times, _, delta, peaks, tokens = run(steps, 2, smart, trace, alloc_trace)
            step_s = statistics.median(times)
            # Lengths taking turns: every measured step's tokens over their time.
            tokens_per_s = (batch * seq / step_s if len(lengths) == 1 else
                            sum(tokens) / sum(times))
            row.update(step_ms=step_s * 1e3, tokens_per_s=tokens_per_s,
                       step_times_ms=[round(t * 1e3, 2) for t in times],
                       peak_reserved=peaks[0], peak_allocated=peaks[1], oom=False,
                       allocator_counters=delta)
            if smart is not None:
                report = smart.report()
                plan = report["plan"] or {}
                row.update(phase=report["phase"], plan=plan, trials=report["trials"],
                           recompute_ms=report["recompute_ms"],
                           warmup_recompute_ms=report["warmup_recompute_ms"],
                           warmup_steps=report["warmup_steps"],
                           block_fwd_ms=report["block_fwd_ms"],
                           block_recompute_ms=report["block_recompute_ms"],
                           profile_ms=report["profile_ms"],
                           warmup_forward_ms=report["warmup_forward_ms"],
                           resident_state_blocks=report["resident_state_blocks"],
                           step_in_backward=report["step_in_backward"],
                           pace=report["pace"], saving_scale=report["saving_scale"],
                           profiling_slowdown=report["profiling_slowdown"],
                           predicted_step_ms=plan.get("predicted_step_ms"),
                           searched_step_ms=plan.get("searched_step_ms"),
                           predicted_peak=plan.get("predicted_peak_bytes"))
                write_planning_record(args.logs, label, smart)
        except torch.OutOfMemoryError as e:
            row.update(oom=True, error=str(e).splitlines()[0][:800])
            if smart is not None:  # where SmartSwap was when the step ran out
                report = smart.report()
                row.update(phase=report["phase"], iteration=report["iteration"],
                           plan=report["plan"], trials=report["trials"],
                           # still held by the failed step's frames (the exception's)
                           allocated_at_oom=torch.cuda.memory_allocated(),
                           state_bytes_on_device=sum(
                               t.untyped_storage().nbytes()
                               for g in smart.states.groups.values() for t in g),
                           state_blocks_out=sorted(smart.states.out))
                write_planning_record(args.logs, label, smart)
            opt.zero_grad(set_to_none=True)
        finally:
            if smart is not None:
                if preference is None:  # SmartSwap chose it
                    row["preference"] = smart.report()["preference"]
                smart.remove()
        row["limit"] = limit
        print(json.dumps(row), flush=True)
        if row.get("oom") and n < len(caps):
            # The next caps run in a fresh process (spawn): a step that ran out of memory
            # leaves the allocator's cache laid out around what it held, which a lower cap
            # would inherit (on the MoE benchmark a 40% run began with more reserved than its
            # cap after a 50% run ran out of memory); a user's run starts clean.
            return
    if method in ("glake", "unconstrained") and args.loss_steps:
        # Bit-identity of the loss: deterministic kernels (math attention, as flash
        # attention's backward is not deterministic; cuBLAS with a fixed workspace), fresh
        # model and optimizer per run. The glake process runs the unplanned step on its own
        # allocator twice first (the reference that differs only by the plan, and whether the
        # model itself repeats), then SmartSwap capped at 60% of that run's peak reserved.
        # Ops PyTorch has no deterministic kernel for are named.
        import warnings
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_flash_sdp(False)
        del opt, model
        row = {"model": name, "method": spec}
        runs = ((False, "losses_unplanned"), (False, "losses_unplanned_again"),
                (True, "losses")) if method == "glake" else ((False, "losses"),)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            unplanned_peak = None
            for planned, key in runs:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                limit = int(0.6 * unplanned_peak) if planned and unplanned_peak else None
                torch.cuda.set_per_process_memory_fraction(limit / total if limit else 1.0)
                model = build(name, torch)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
                smart = (glake.swap.apply(model, optimizer=opt if given_optimizer else None,
                                          target=limit, preference=preference,
                                          step_in_backward=step_in_backward)
                         if planned else None)
                try:
                    row[key] = run(0, args.loss_steps)[1]
                except torch.OutOfMemoryError as e:
                    row[key] = None
                    row["error"] = str(e).splitlines()[0][:200]
                if smart is not None:
                    smart.remove()
                    row["loss_cap"] = limit
                else:
                    unplanned_peak = torch.cuda.max_memory_reserved()
                del opt, model
        row["nondeterministic"] = sorted({str(w.message).split(" does not have")[0]
                                          for w in seen if "deterministic" in str(w.message)})
        print(json.dumps(row), flush=True)


def spawn(method, name, args, reference_peak=0):
    """The rows of `method` on model `name` at every cap, from child processes: one, and a
    fresh one for the caps after a cap that ran out of memory."""
    caps = args.caps.split(",")
    rows = []
    while caps:
        got = spawn_once(method, name, args, reference_peak, ",".join(caps))
        rows += got
        done = len([r for r in got if "cap" in r])
        if method == "unconstrained" or done == 0:
            break
        caps = caps[done:]
    return rows


_LOGS_STARTED = set()  # the method logs this run has written


def spawn_once(method, name, args, reference_peak, caps):
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child-method", method,
           "--child-model", name, "--caps", caps, "--steps", str(args.steps),
           "--reference-peak", str(reference_peak), "--loss-steps", str(args.loss_steps),
           "--lengths", args.lengths]
    if args.trace_dir:
        cmd += ["--trace-dir", args.trace_dir]
    if args.logs:
        cmd += ["--logs", args.logs]
    if args.alloc_trace_dir:
        cmd += ["--alloc-trace-dir", args.alloc_trace_dir]
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if args.logs:
        pathlib.Path(args.logs).mkdir(parents=True, exist_ok=True)
        log = pathlib.Path(args.logs) / f"{name}-{method.replace('@', '-on-')}.log"
        # A later process of the same method (the caps after an out-of-memory one, or the
        # reference run again) adds to the log this run started.
        with open(log, "a" if log in _LOGS_STARTED else "w") as f:
            f.write(proc.stderr)
        _LOGS_STARTED.add(log)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0:
        print(f"{method} on {name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}",
              file=sys.stderr)
    print(f"  {method}: {len(rows)} rows in {time.time() - started:.0f} s", file=sys.stderr)
    return rows


def write_jsonl(path, rows):
    """Every row so far to `path` (None: nowhere), after each method: a call cut short keeps
    what it measured."""
    if path:
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def methods_of(rows):
    return [m for m in dict.fromkeys(r["method"] for r in rows) if m != "unconstrained"]


def markdown(rows):
    out = []
    refs = {r["model"]: r for r in rows if r["method"] == "unconstrained" and "cap" in r
            and not r.get("again")}
    for name in dict.fromkeys(r["model"] for r in rows):
        ref = refs.get(name)
        if ref is None or ref.get("oom"):
            continue
        again = next((r for r in rows if r["model"] == name and r.get("again") and "cap" in r
                      and not r.get("oom")), None)
        drift = (f"; run again after the methods: {again['step_ms']:.0f} ms "
                 f"({again['step_ms'] / ref['step_ms'] - 1:+.0%})" if again else "")
        turns = (f" (sequence lengths {', '.join(map(str, ref['lengths']))} taking turns; "
                 "tokens/s over all measured steps)" if ref.get("lengths") else "")
        out.append(f"\n**{name}**{turns}: unconstrained {ref['tokens_per_s']:.0f} tokens/s, "
                   f"{ref['step_ms']:.0f} ms per step, peak reserved "
                   f"{ref['peak_reserved'] / GIB:.1f} GiB{drift}\n")
        out.append("| cap | method | tokens/s | vs unconstrained | peak reserved GiB | "
                   "peak allocated GiB | predicted ms / in search (measured median; steps) | "
                   "predicted peak GiB | new stitches / reuses |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for cap in sorted({r["cap"] for r in rows if r["model"] == name and r.get("cap")},
                          reverse=True):
            for method in methods_of(rows):
                r = next((x for x in rows if x["model"] == name and x["method"] == method
                          and x.get("cap") == cap), None)
                if r is None:
                    continue
                # A method that leaves the preference to SmartSwap names the one it chose.
                label = f"{method} ({r['preference']})" if r.get("preference") else method
                if r["oom"]:
                    out.append(f"| {cap:.0%} ({r['limit'] / GIB:.1f} GiB) | {label} | OOM | | "
                               "| | | | |")
                    continue
                # The measured steps' own spread beside their median: a host-paced step (the
                # MoE) moves by a third from one step to the next.
                steps = r.get("step_times_ms") or [r["step_ms"]]
                # Beside the planner's prediction, what the plan kept measured in the search
                # (its trial's median), against the stable steps.
                searched = (f" / {r['searched_step_ms']:.0f}" if r.get("searched_step_ms")
                            else "")
                pred = (f"{r['predicted_step_ms']:.0f}{searched} ({r['step_ms']:.0f}; "
                        f"{min(steps):.0f}-{max(steps):.0f})"
                        if r.get("predicted_step_ms") else "")
                peak = (f"{r['predicted_peak'] / GIB:.1f}" if r.get("predicted_peak") else "")
                # Made in the measured steps: a stitch maps every handle of its pieces again.
                counters = r.get("allocator_counters", {})
                on_glake = method.endswith("@glake") or (
                    method.startswith("glake") and "@" not in method)
                stitches = (f"{counters['glake.stitches']} / {counters['glake.stitch_reuse_hits']}"
                            if on_glake and "glake.stitches" in counters else "")
                out.append(f"| {cap:.0%} ({r['limit'] / GIB:.1f} GiB) | {label} | "
                           f"{r['tokens_per_s']:.0f} | "
                           f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f} | "
                           f"{r['peak_reserved'] / GIB:.1f} | {r['peak_allocated'] / GIB:.1f} | "
                           f"{pred} | {peak} | {stitches} |")
        out += loss_lines([r for r in rows if r["model"] == name])
    return "\n".join(out)


def loss_lines(rows):
    """The loss check of every SmartSwap method that ran one (its planned run against the
    unplanned step on glake's allocator, and against unconstrained on PyTorch's), as lines of
    the report."""
    out = []
    reference = next((r.get("losses") for r in rows
                      if r["method"] == "unconstrained" and "losses" in r), None)
    for row in (r for r in rows if "losses_unplanned" in r):
        unplanned, again = row.get("losses_unplanned"), row.get("losses_unplanned_again")
        method = row["method"]
        if unplanned and again:
            out.append(f"\nThe unplanned step on glake's allocator ({method}'s process), run "
                       "twice: " + ("identical" if unplanned == again else
                                    "DIFFERENT (the model's own kernels do not repeat)"))
        if row.get("nondeterministic"):
            out.append("\nOps without a deterministic kernel: " +
                       "; ".join(row["nondeterministic"]))
        planned = row.get("losses")
        for label, other in (("the unplanned step on glake's allocator", unplanned),
                             ("unconstrained on PyTorch's allocator", reference)):
            if planned and other:
                first = next((i for i, (a, b) in enumerate(zip(planned, other)) if a != b),
                             None)
                verdict = ("identical" if first is None else
                           f"DIFFERENT from step {first} ({planned[first]!r} against "
                           f"{other[first]!r})")
                out.append(f"\nLosses over {len(planned)} steps (math attention) under "
                           f"{method} at 60% against {label}: {verdict}")
    return out


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        ref = next((r for r in rows if r["model"] == name and r["method"] == "unconstrained"
                    and "cap" in r and not r.get("oom") and not r.get("again")), None)
        if ref is None:
            continue
        for method in methods_of(rows):
            pts = sorted((r["cap"], r["tokens_per_s"] / ref["tokens_per_s"]) for r in rows
                         if r["model"] == name and r["method"] == method and r.get("cap")
                         and not r.get("oom"))
            if pts:
                ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker="o",
                        label=method)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_title(name)
        ax.set_xlabel("cap, % of unconstrained peak reserved")
        ax.set_ylabel("throughput vs unconstrained")
        ax.invert_xaxis()
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--caps", default="0.8,0.7,0.6,0.5,0.4")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--lengths", default="1", help="fractions of each model's sequence length "
                   "that take turns step by step (as inputs padded to each batch's longest "
                   "do); throughput is then the measured steps' tokens over their time, and "
                   "--steps is rounded up to a multiple of the lengths")
    p.add_argument("--loss-steps", type=int, default=20)
    p.add_argument("--markdown")
    p.add_argument("--jsonl")
    p.add_argument("--plot")
    p.add_argument("--from-jsonl")
    p.add_argument("--trace-dir", help="write each capped run's last measured step's "
                   "profile (tables by device and host time) here")
    p.add_argument("--alloc-trace-dir", help="record each capped run's allocation events "
                   "(warm-up, search and measured steps, each marked) for glake-replay here; "
                   "the recording slows the run")
    p.add_argument("--logs", help="keep each method's log (SmartSwap's phases, plans and "
                   "trials at INFO) in this folder")
    p.add_argument("--child-method")
    p.add_argument("--child-model")
    p.add_argument("--reference-peak", type=int, default=0)
    args = p.parse_args()
    if args.child_method:
        return child(args)
    if args.from_jsonl:
        rows = [json.loads(line) for line in open(args.from_jsonl)]
    else:
        rows = []
        for name in args.models.split(","):
            print(f"{name}:", file=sys.stderr)
            ref = spawn("unconstrained", name, args)
            rows += ref
            peak = next((r["peak_reserved"] for r in ref if "cap" in r and not r.get("oom")), 0)
            if not peak:
                continue
            for method in args.methods.split(","):
                rows += spawn(method, name, args, peak)
                write_jsonl(args.jsonl, rows)
            # The reference again (no losses this time): how far the machine drifted.
            no_losses = argparse.Namespace(**{**vars(args), "loss_steps": 0})
            rows += [dict(r, again=True) for r in spawn("unconstrained", name, no_losses)]
            write_jsonl(args.jsonl, rows)
    text = markdown(rows)
    print(text)
    if args.markdown:
        pathlib.Path(args.markdown).write_text(text + "\n")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
