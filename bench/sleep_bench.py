"""Sleep and wake of a process's GPU memory: glake's regions against torch_memory_saver, each
method in its own process (each replaces PyTorch's allocator), same workloads, same machine.

    python3 bench/sleep_bench.py [--workloads weights16g,llama7b] [--methods glake,tms]
                                 [--cycles 3] [--markdown FILE] [--jsonl FILE]

Methods: `glake` (pinned host buffers, kept across sleeps), `glake-prepared` (the same, with
the host buffers made by glake.torch.prepare_sleep before the first sleep, timed apart),
`glake-pageable` (GLAKE_SLEEP_HOST=pageable: ordinary host memory through the copy engine),
`glake-1link` (GLAKE_COPY_PEERS=0: no relay through a peer GPU, for machines with one), `tms`
(torch_memory_saver). Workloads: `weights16g`, 64 bf16 tensors of 256 MiB; `llama7b`, the weights of a 7B-shape
decoder (hidden 4096, FFN 11008, 32 layers, vocabulary 32000; 6.7 B bf16 parameters). Both are
random and made on the GPU inside a region with a host copy kept (glake: region(keep=True);
torch_memory_saver 0.0.10 in its in-process "torch" hook mode: region(enable_cpu_backup=True)).
Per cycle: sleep (pause) then wake (resume), each timed from a synchronised device to its
return, GB/s over the region's tensor bytes; memory freed as the driver reports it
(cudaMemGetInfo, what nvidia-smi shows); after wake, the time to a first result (one matmul on
the first weight) and, after the last cycle, a byte-for-byte comparison of every tensor with a
copy kept on the GPU outside the region."""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
GIB = 2**30


def shapes(workload):
    if workload == "weights16g":
        return [(128 * 2**20,)] * 64  # 256 MiB of bf16 each
    hidden, ffn, vocab = 4096, 11008, 32000
    out = [(vocab, hidden)]
    for _ in range(32):
        out += [(hidden, hidden)] * 4 + [(ffn, hidden)] * 2 + [(hidden, ffn)] + [(hidden,)] * 2
    return out + [(hidden,), (vocab, hidden)]


def child(method, workload, cycles):
    sys.path.insert(0, str(ROOT / "python"))
    import torch

    if method.startswith("glake"):
        import glake.torch

        glake.torch.enable()
        saver = glake.torch.torch_memory_saver
        region = lambda: glake.torch.region("weights", keep=True)  # noqa: E731
    else:
        from torch_memory_saver import torch_memory_saver as saver

        saver.hook_mode = "torch"
        region = lambda: saver.region(tag="weights", enable_cpu_backup=True)  # noqa: E731

    def free():
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    torch.manual_seed(0)
    with region():
        weights = [torch.randn(s, dtype=torch.bfloat16, device="cuda") for s in shapes(workload)]
    reference = [w.clone() for w in weights]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    prepare_s = None
    if method == "glake-prepared":
        # Host memory made once the weights are in, before the first sleep (a server would do
        # this in the background while it serves).
        t0 = time.perf_counter()
        glake.torch.prepare_sleep("weights")
        prepare_s = time.perf_counter() - t0
    x = torch.randn(16, weights[1].shape[-1], dtype=torch.bfloat16, device="cuda")
    rows = []
    for cycle in range(cycles):
        before = free()
        t0 = time.perf_counter()
        saver.pause("weights")
        sleep_s = time.perf_counter() - t0
        freed = free() - before
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        saver.resume("weights")
        wake_s = time.perf_counter() - t0
        y = x @ weights[1].T if weights[1].dim() == 2 else x * weights[1]
        y.float().sum().item()
        first_result_s = time.perf_counter() - t0
        rows.append({"method": method, "workload": workload, "cycle": cycle, "bytes": nbytes,
                     "sleep_s": sleep_s, "wake_s": wake_s, "first_result_s": first_result_s,
                     "freed_bytes": freed, "sleep_gbps": nbytes / sleep_s / 1e9,
                     "prepare_s": prepare_s, "gpus": torch.cuda.device_count(),
                     "wake_gbps": nbytes / wake_s / 1e9})
    differ = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum().item())
                 for a, b in zip(weights, reference))
    for row in rows:
        row["elements_differing_at_end"] = differ
        print("ROW " + json.dumps(row), flush=True)


def table(rows):
    lines = ["| workload | method | cycle | GiB | sleep s | sleep GB/s | wake s | wake GB/s | "
             "wake to first result s | freed GiB (share) | elements differing |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['method']} | | | failed: {r['error']} "
                         "| | | | | | |")
            continue
        lines.append(
            f"| {r['workload']} | {r['method']} | {r['cycle']} | {r['bytes'] / GIB:.1f} | "
            f"{r['sleep_s']:.3f} | {r['sleep_gbps']:.1f} | {r['wake_s']:.3f} | "
            f"{r['wake_gbps']:.1f} | {r['first_result_s']:.3f} | "
            f"{r['freed_bytes'] / GIB:.2f} ({r['freed_bytes'] / r['bytes']:.3f}) | "
            f"{r['elements_differing_at_end']} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", default="weights16g,llama7b")
    p.add_argument("--methods", default="glake,glake-prepared,glake-pageable,tms")
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--markdown")
    p.add_argument("--jsonl")
    p.add_argument("--child", nargs=2)
    args = p.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.cycles)
        return
    rows = []
    for workload in args.workloads.split(","):
        for method in args.methods.split(","):
            env = dict(os.environ)
            env.pop("GLAKE_ENABLE", None)
            if method == "glake-pageable":
                env["GLAKE_SLEEP_HOST"] = "pageable"  # host copies through the copy engine
            if method == "glake-1link":
                env["GLAKE_COPY_PEERS"] = "0"  # no relay through a peer GPU's link
            done = subprocess.run([sys.executable, __file__, "--child", method, workload,
                                   "--cycles", str(args.cycles)], env=env, text=True,
                                  capture_output=True, timeout=900)
            got = [json.loads(line[4:]) for line in done.stdout.splitlines()
                   if line.startswith("ROW ")]
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            if os.environ.get("GLAKE_LOG"):  # the child's log lines (sleep and wake phases)
                for line in done.stderr.splitlines():
                    if "glake" in line:
                        print(f"{workload} {method}: {line}", file=sys.stderr)
            if not got:
                print(f"{workload} {method}: failed:\n" + "\n".join(tail), file=sys.stderr)
                got = [{"method": method, "workload": workload,
                        "error": (tail[-1] if tail else "no output")[:120]}]
            elif done.returncode != 0:  # measured, then failed on the way out: say so
                print(f"{workload} {method}: exit status {done.returncode} after its rows: "
                      + (tail[-1] if tail else ""), file=sys.stderr)
                for row in got:
                    row["exit_status"] = done.returncode
            rows += got
            print(f"{workload} {method}: done", flush=True)
    md = table(rows)
    print(md)
    if args.markdown:
        pathlib.Path(args.markdown).write_text(md + "\n")
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
