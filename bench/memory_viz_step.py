"""Records memory history over training steps under glake and writes what memory_viz shows:
the pickled snapshot (drop it on https://pytorch.org/memory_viz), and the timeline and segment
pages rendered by PyTorch's own torch.cuda._memory_viz. Prints what the history holds.

    python3 bench/memory_viz_step.py --out viz/            # glake (native path)
    python3 bench/memory_viz_step.py --out viz/ --native   # PyTorch's allocator, to compare
"""
import argparse
import collections
import pathlib
import pickle
import sys

HERE = pathlib.Path(__file__).resolve().parent


def train_step(model, opt, batch):
    loss = model(batch).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--native", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if not args.native:
        sys.path.insert(0, str(HERE.parent / "python"))
        import glake.torch

        glake.torch.enable()
    import torch
    from torch.cuda import _memory_viz

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(2048, 2048) for _ in range(8)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.GELU())]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, opt, torch.randn(512, 2048, device="cuda"))  # optimizer state exists
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    for step in range(args.steps):
        train_step(model, opt, torch.randn(512 + 256 * step, 2048, device="cuda"))
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._dump_snapshot(str(out / "snapshot.pickle"))
    torch.cuda.memory._record_memory_history(None)
    with open(out / "snapshot.pickle", "rb") as f:
        dumped = pickle.load(f)
    (out / "timeline.html").write_text(_memory_viz.trace_plot(dumped))
    (out / "segments.html").write_text(_memory_viz.segment_plot(dumped))
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    actions = collections.Counter(e["action"] for e in trace)
    in_step = sum(1 for e in trace if e["action"] == "alloc"
                  and any(f["name"] == "train_step" for f in e.get("frames", [])))
    stitched = sum(1 for e in trace if "stitched" in e.get("user_metadata", ""))
    print(f"allocator: {'native' if args.native else 'glake'}")
    print(f"trace events: {dict(actions)}")
    print(f"allocations with train_step on their stack: {in_step}")
    print(f"allocations marked as stitched: {stitched}")
    print(f"segments: {len(snapshot['segments'])}, "
          f"glake stitched ranges: {len(snapshot.get('glake_stitched', []))}")
    print(f"pages: {out / 'timeline.html'} ({(out / 'timeline.html').stat().st_size} bytes), "
          f"{out / 'segments.html'} ({(out / 'segments.html').stat().st_size} bytes)")


if __name__ == "__main__":
    main()
