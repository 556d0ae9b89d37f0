"""Loading a state dict that sits in ordinary (pageable) CPU memory onto a GPU: glake's copy
engine against what users do today, in one process, in rotating order over several rounds.

    python3 bench/load_state_dict.py --gib 10 --rounds 3 [--markdown FILE] [--jsonl FILE]

Methods: `tensor.to("cuda")` per tensor; `pin_memory()` then `.to("cuda", non_blocking=True)`
(pinning counted, as it is part of the load); glake.torch.load_state_dict. The state dict has
the tensor shapes of a decoder-only transformer (bf16). PyTorch's own allocator serves the GPU
memory in all three."""
import argparse
import json
import statistics
import sys
import time
import pathlib

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))
import glake.torch  # noqa: E402


def make_state_dict(gib, hidden=4096, ffn=11008, vocab=32000):
    """Random bf16 tensors shaped like a Llama-7B layer stack, about `gib` GiB in all."""
    state, total, layer = {}, 0, 0
    state["embed"] = torch.randn(vocab, hidden, dtype=torch.bfloat16)
    total += state["embed"].numel() * 2
    while total < gib * 2**30:
        for name, shape in [("q", (hidden, hidden)), ("k", (hidden, hidden)), ("v", (hidden, hidden)),
                            ("o", (hidden, hidden)), ("gate", (ffn, hidden)), ("up", (ffn, hidden)),
                            ("down", (hidden, ffn)), ("norm", (hidden,))]:
            t = torch.empty(shape, dtype=torch.bfloat16)
            t.normal_()
            state[f"layers.{layer}.{name}"] = t
            total += t.numel() * 2
        layer += 1
    return state, total


def plain_to(state):
    out = {k: v.to("cuda") for k, v in state.items()}
    torch.cuda.synchronize()
    return out


def pinned_to(state):
    out = {k: v.pin_memory().to("cuda", non_blocking=True) for k, v in state.items()}
    torch.cuda.synchronize()
    return out


def glake_load(state):
    out = glake.torch.load_state_dict(state)
    torch.cuda.synchronize()
    return out


METHODS = {"tensor.to(cuda)": plain_to, "pin_memory + to(non_blocking)": pinned_to,
           "glake.torch.load_state_dict": glake_load}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown")
    parser.add_argument("--jsonl")
    args = parser.parse_args()
    torch.cuda.init()
    state, total = make_state_dict(args.gib)
    print(f"state dict: {len(state)} tensors, {total / 1e9:.2f} GB, GPU {torch.cuda.get_device_name()}",
          flush=True)
    # Warm-up: start the engine and the CUDA context outside the timed rounds.
    glake.torch.load_state_dict({"w": torch.ones(2**20)})
    names = list(METHODS)
    times = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            torch.cuda.empty_cache()
            start = time.perf_counter()
            out = METHODS[name](state)
            elapsed = time.perf_counter() - start
            if r == 0:
                # Every tensor whole, checked outside the timed region.
                for key, value in state.items():
                    assert torch.equal(out[key].cpu(), value), f"{name}: {key} differs"
            del out
            times[name].append(elapsed)
            print(f"round {r} {name}: {elapsed:.2f} s ({total / elapsed / 1e9:.1f} GB/s)", flush=True)
    lines = ["| method | median s | GB/s | rounds (s) |", "|---|---|---|---|"]
    for name in names:
        med = statistics.median(times[name])
        lines.append(f"| {name} | {med:.2f} | {total / med / 1e9:.1f} | "
                     + ", ".join(f"{t:.2f}" for t in times[name]) + " |")
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        pathlib.Path(args.markdown).write_text(table + "\n")
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            for name in names:
                f.write(json.dumps({"method": name, "bytes": total, "seconds": times[name]}) + "\n")


if __name__ == "__main__":
    main()
