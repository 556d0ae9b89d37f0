"""Cross-process dedup of read-only weights: N processes serving the same model on one GPU,
with and without glake.torch.share_weights(), all with glake as the allocator.

    python3 bench/dedup_bench.py [--processes 1,2,4,8] [--finetunes] [--tokens 2048]
                                 [--iters 20] [--markdown FILE] [--jsonl FILE]

The model: a Llama-7B shape (hidden 4096, FFN 11008, 32 layers, 32 heads, vocabulary 32000;
6.7 B bf16 parameters) with random weights from one seed, built on the GPU in every process.
Per configuration the processes start together and build their model; then, one process at a
time, each calls share_weights() (timed: the first offers its weights, each later one joins);
then the GPU's memory in use is read with nvidia-smi, less what it showed before the processes
started. Forward latency: each process in turn times forward passes of one sequence of
`--tokens` tokens (median of `--iters`, after 3 warm-up passes) while the others wait; with
dedup, every process does so before and after the sharing (same process, same model, a minute
apart), and the ratio is taken per process. `--finetunes` adds two
processes serving fine-tunes of one base that differ in a third of their layers (the second's
layers 0-10 re-drawn from another seed).

`--latency K`: forward latency in lock step: K processes that share their weights and K that
do not, all alive at once, take turns (A1 B1 A2 B2 ..., order flipped every round) for
`--rounds` rounds of `--iters` passes each; the ratio of the pooled medians.

`--pairs`: forward latency in one process holding the model twice: once mapped from another
process's memory through share_weights(), once as a private copy (deepcopy before sharing);
the two forward in turn (order flipped every round) for `--rounds` rounds of `--iters` passes.
This takes process-to-process and time-to-time drift out of the comparison.

`--kernels`: in one process, matrix products over weights moved into shared read-only memory
against the same products over an equal set of private weights, alternating in lock step
(memory-bound: 16 rows; compute-bound: 2048 rows), to tell the memory's own speed from drift.

Target: with dedup, memory in use at most one copy of the weights plus N times each process's
own non-weight memory (from the single process without dedup) within 5%; joining takes at most
2 s per process; forward latency within 1% of the same processes without dedup."""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
GIB = 2**30


def child(variant, tokens, iters):
    sys.path.insert(0, str(ROOT / "python"))
    import torch
    import glake.torch

    glake.torch.enable()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                         max_position_embeddings=4096)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    if variant == "tuned":
        gen = torch.Generator(device="cuda").manual_seed(1)
        with torch.no_grad():
            for layer in model.model.layers[:11]:
                for p in layer.parameters():
                    p.normal_(0.0, 0.02, generator=gen)
    model.eval()
    private = None
    if variant == "pair":
        import copy

        private = copy.deepcopy(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.cuda.synchronize()
    say("READY", {"weights": weights})
    tokens_in = torch.randint(0, config.vocab_size, (1, tokens), device="cuda",
                              generator=torch.Generator(device="cuda").manual_seed(7))
    for line in sys.stdin:
        command, _, count = line.strip().partition(" ")
        if command == "share":
            torch.cuda.synchronize()
            started = time.perf_counter()
            report = glake.torch.share_weights(model)
            say("SHARED", dict(report, seconds=time.perf_counter() - started))
        elif command == "forward":
            times = []
            n = int(count) if count else iters
            with torch.inference_mode():
                for i in range(n + 3):
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    logits = model(tokens_in).logits
                    torch.cuda.synchronize()
                    if i >= 3:
                        times.append(time.perf_counter() - started)
            say("FORWARD", {"ms": statistics.median(times) * 1e3,
                            "checksum": float(logits.float().abs().sum())})
        elif command == "pairs":
            times = {"shared": [], "private": []}
            rounds = int(count)
            with torch.inference_mode():
                for r in range(rounds):
                    pair = [("shared", model), ("private", private)]
                    for name, m in (pair if r % 2 == 0 else pair[::-1]):
                        for i in range(iters + 1):
                            torch.cuda.synchronize()
                            started = time.perf_counter()
                            m(tokens_in)
                            torch.cuda.synchronize()
                            if i >= 1:
                                times[name].append((time.perf_counter() - started) * 1e3)
            say("PAIRS", times)
        elif command == "quit":
            break


def kernels(iters):
    """Lock-step timing of products over shared and private weights of the same shapes."""
    sys.path.insert(0, str(ROOT / "python"))
    import torch
    import glake.torch

    glake.torch.enable()
    torch.manual_seed(0)
    shapes = [(4096, 11008), (11008, 4096), (4096, 4096)] * 8
    shared = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
    private = [w.clone() for w in shared]
    report = glake.torch.share_weights(shared)
    rows = []
    for tokens in (16, 2048):
        x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
        xs = {4096: x, 11008: torch.randn(tokens, 11008, device="cuda", dtype=torch.bfloat16)}
        times = {"shared": [], "private": []}
        for i in range(iters + 3):
            for name, ws in (("shared", shared), ("private", private)) if i % 2 else (
                    ("private", private), ("shared", shared)):
                torch.cuda.synchronize()
                started = time.perf_counter()
                for w in ws:
                    xs[w.shape[0]] @ w
                torch.cuda.synchronize()
                if i >= 3:
                    times[name].append(time.perf_counter() - started)
        s, p = statistics.median(times["shared"]), statistics.median(times["private"])
        rows.append({"rows": tokens, "shared_ms": s * 1e3, "private_ms": p * 1e3,
                     "ratio": s / p})
    print(json.dumps({"kernels": rows, "share": report}), flush=True)
    out = ["| rows | shared weights ms | private weights ms | ratio |", "|---|---|---|---|"]
    out += [f"| {r['rows']} | {r['shared_ms']:.3f} | {r['private_ms']:.3f} | {r['ratio']:.3f} |"
            for r in rows]
    return "\n".join(out)


def say(tag, value):
    print(f"{tag} {json.dumps(value)}", flush=True)


class Process:
    def __init__(self, variant, args, env):
        self.proc = subprocess.Popen(
            [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", variant, "--tokens", str(args.tokens),
             "--iters", str(args.iters)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def expect(self, tag):
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
        raise RuntimeError(f"a serving process ended before {tag} (exit {self.proc.wait()})")

    def ask(self, command, tag):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.expect(tag)

    def quit(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.proc.wait()


def gpu_used():
    """Bytes in use on GPU 0 as nvidia-smi reports them."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                          "-i", "0"], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) * 2**20


def run(name, variants, dedup, args, dedup_dir):
    idle = gpu_used()
    env = dict(os.environ, GLAKE_DEDUP_DIR=dedup_dir, CUDA_VISIBLE_DEVICES="0")
    procs = [Process(v, args, env) for v in variants]
    try:
        ready = [p.expect("READY") for p in procs]
        before = [p.ask("forward", "FORWARD") for p in procs] if dedup else []
        shares = [p.ask("share", "SHARED") for p in procs] if dedup else []
        used = gpu_used() - idle
        forwards = [p.ask("forward", "FORWARD") for p in procs]
        used_after = gpu_used() - idle
    finally:
        for p in procs:
            p.quit()
    row = {"config": name, "processes": len(procs), "dedup": dedup,
           "weights_bytes": ready[0]["weights"], "used_bytes": used,
           "used_after_forward_bytes": used_after,
           "forward_ms": [f["ms"] for f in forwards],
           "forward_before_share_ms": [f["ms"] for f in before],
           "checksums": [f["checksum"] for f in forwards],
           "share": shares}
    print(json.dumps(row), flush=True)
    return row


def latency(k, args, dedup_dir):
    """Forward latency of K sharing and K private processes, alive together, in lock step."""
    env = dict(os.environ, GLAKE_DEDUP_DIR=dedup_dir, CUDA_VISIBLE_DEVICES="0")
    shared = [Process("base", args, env) for _ in range(k)]
    private = [Process("base", args, env) for _ in range(k)]
    times = {"shared": [], "private": []}
    try:
        for p in shared + private:
            p.expect("READY")
        joins = [p.ask("share", "SHARED")["seconds"] for p in shared]
        for r in range(args.rounds):
            for i in range(k):
                pair = [("shared", shared[i]), ("private", private[i])]
                for name, p in (pair if (r + i) % 2 == 0 else pair[::-1]):
                    times[name].append(p.ask(f"forward {args.iters}", "FORWARD")["ms"])
    finally:
        for p in shared + private:
            p.quit()
    s, p = statistics.median(times["shared"]), statistics.median(times["private"])
    row = {"config": f"latency-{k}+{k}", "shared_ms": times["shared"],
           "private_ms": times["private"], "join_s": joins, "ratio": s / p}
    print(json.dumps(row), flush=True)
    text = ("| processes | forward ms, sharing | forward ms, private | ratio |\n|---|---|---|---|\n"
            f"| {k} + {k} | {s:.2f} | {p:.2f} | {s / p:.3f} |")
    return row, text


def pairs(args, dedup_dir):
    """Shared against private weights of one model in one process, in lock step."""
    env = dict(os.environ, GLAKE_DEDUP_DIR=dedup_dir, CUDA_VISIBLE_DEVICES="0")
    owner = Process("base", args, env)
    measured = Process("pair", args, env)
    try:
        owner.expect("READY")
        measured.expect("READY")
        owner.ask("share", "SHARED")
        report = measured.ask("share", "SHARED")
        times = measured.ask(f"pairs {args.rounds}", "PAIRS")
    finally:
        owner.quit()
        measured.quit()
    s, p = statistics.median(times["shared"]), statistics.median(times["private"])
    row = {"config": "pairs", "share": report, "shared_ms": times["shared"],
           "private_ms": times["private"], "ratio": s / p}
    print(json.dumps(row), flush=True)
    text = ("| forward passes | weights mapped from another process, ms | private copy, ms "
            "| ratio |\n|---|---|---|---|\n"
            f"| {len(times['shared'])} each | {s:.2f} | {p:.2f} | {s / p:.3f} |")
    return row, text


def table(rows):
    base = {r["config"]: r for r in rows if not r["dedup"]}
    single = next((r for r in rows if r["config"] == "replicas-1" and not r["dedup"]), None)
    out = ["| configuration | processes | weights GiB | in use, no dedup GiB | in use, dedup GiB "
           "| target GiB | first offer s | join s (max) | forward ms before sharing "
           "| forward ms shared | ratio (median per process) | same outputs |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["dedup"]:
            continue
        b = base.get(r["config"])
        w = r["weights_bytes"]
        target = "-"
        if single is not None and r["config"].startswith("replicas"):
            own = single["used_after_forward_bytes"] - w
            target = f"{(w + r['processes'] * own) / GIB:.2f}"
        joins = [s["seconds"] for s in r["share"][1:]]
        fwd = statistics.median(r["forward_ms"])
        fwd_b = statistics.median(r["forward_before_share_ms"])
        ratio = statistics.median(a / b_ for a, b_ in zip(r["forward_ms"],
                                                           r["forward_before_share_ms"]))
        out.append(
            f"| {r['config']} | {r['processes']} | {w / GIB:.2f} "
            f"| {b['used_after_forward_bytes'] / GIB if b else float('nan'):.2f} "
            f"| {r['used_after_forward_bytes'] / GIB:.2f} | {target} "
            f"| {r['share'][0]['seconds']:.2f} | {max(joins) if joins else float('nan'):.2f} "
            f"| {fwd_b:.2f} | {fwd:.2f} | {ratio:.3f} "
            f"| {'yes' if b and b['checksums'] == r['checksums'] else 'NO'} |")
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child")
    parser.add_argument("--processes", default="1,2,4,8")
    parser.add_argument("--finetunes", action="store_true")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--kernels", action="store_true")
    parser.add_argument("--latency", type=int, default=0)
    parser.add_argument("--pairs", action="store_true")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--markdown")
    parser.add_argument("--jsonl")
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.tokens, args.iters)
    if args.kernels:
        text = kernels(args.iters)
        print(text)
        if args.markdown:
            pathlib.Path(args.markdown).write_text(text + "\n")
        return
    dedup_dir = f"/tmp/glake-dedup-bench-{os.getpid()}"
    if args.latency or args.pairs:
        row, text = (pairs(args, dedup_dir) if args.pairs
                     else latency(args.latency, args, dedup_dir))
        print(text)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
        if args.markdown:
            pathlib.Path(args.markdown).write_text(text + "\n")
        return
    configs = [(f"replicas-{n}", ["base"] * n) for n in map(int, args.processes.split(","))]
    if args.finetunes:
        configs.append(("finetunes-2", ["base", "tuned"]))
    rows = []
    for name, variants in configs:
        for dedup in (False, True):
            rows.append(run(name, variants, dedup, args, dedup_dir))
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
    text = table(rows)
    print(text)
    if args.markdown:
        pathlib.Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
