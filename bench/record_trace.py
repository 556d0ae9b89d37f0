#!/usr/bin/env python3
"""Records a PyTorch allocation trace in glake-replay's text format.

Runs one workload on the GPU with PyTorch's own allocator while
torch.cuda.memory._record_memory_history() records every event, then writes
`action addr size stream` lines, oldest first (gzip when the name ends in .gz):

    python3 bench/record_trace.py --workload moe --out traces/trace_moe_train.txt.gz

Workloads use models of public shapes with random weights (nothing is downloaded):
  moe       Mixtral-shaped mixture of experts, training, variable sequence lengths
  generate  Llama-shaped model, generate() with a KV cache, variable prompts and batches
  mix       OPT-350M-shaped full fine-tune, large batch, long and short sequences
To record any other PyTorch program, call start() before it and write() after it.
"""
import argparse
import gzip
import random
import time

import torch

ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free")


def start():
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python")


def write(path, device=0):
    """Writes the events recorded since start() for `device`; returns their count."""
    traces = torch.cuda.memory._snapshot()["device_traces"]
    events = [e for e in traces[device] if e["action"] in ACTIONS]
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt") as out:
        out.write("# action addr size stream\n")
        for e in events:
            out.write(f"{e['action']} {e['addr']} {e['size']} {e['stream']}\n")
    torch.cuda.memory._record_memory_history(enabled=None)
    return len(events)


def build(cls, config):
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = cls(config)
    torch.set_default_dtype(torch.float32)
    return model


def train(model, vocab, steps, batch, lengths, rng):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    model.train()
    for _ in range(steps):
        seq = rng.randint(*lengths)
        ids = torch.randint(0, vocab, (batch, seq), device="cuda")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def moe(rng, steps):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                           num_attention_heads=16, num_key_value_heads=4, num_local_experts=8,
                           num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=4096)
    model = build(MixtralForCausalLM, config)
    start()
    train(model, config.vocab_size, steps, 8, (128, 1024), rng)


def generate(rng, steps):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                         max_position_embeddings=4096)
    model = build(LlamaForCausalLM, config).eval()
    start()
    with torch.no_grad():
        for _ in range(steps):
            batch = rng.choice([4, 8, 16, 32])
            prompt = rng.randint(64, 768)
            new = rng.randint(32, 256)
            ids = torch.randint(0, config.vocab_size, (batch, prompt), device="cuda")
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                           max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0)
    torch.cuda.synchronize()


def mix(rng, steps):
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(hidden_size=1024, ffn_dim=4096, num_hidden_layers=24, num_attention_heads=16,
                       word_embed_proj_dim=1024, vocab_size=50272, max_position_embeddings=2048)
    model = build(OPTForCausalLM, config)
    start()
    train(model, config.vocab_size, steps, 24, (32, 2048), rng)


WORKLOADS = {"moe": moe, "generate": generate, "mix": mix}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    began = time.time()
    WORKLOADS[args.workload](rng, args.steps)
    count = write(args.out)
    print(f"{args.workload}: {count} events in {time.time() - began:.1f} s -> {args.out}; "
          f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
          f"peak reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
