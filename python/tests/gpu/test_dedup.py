"""Dedup of read-only weights between processes under glake as PyTorch's allocator: this test
process offers a model's weights, a second process with the same weights maps them instead of
its own (the driver gets its memory back) and computes the same outputs; one with other
weights shares nothing."""
import json

import torch

import glake.torch

from conftest import run_script

MODEL = """
import json, sys, torch
import glake.torch
glake.torch.enable()
def model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False)
                                 for _ in range(8)]).to("cuda", torch.bfloat16).eval()
x = torch.ones(16, 4096, device="cuda", dtype=torch.bfloat16)
"""

CHILD = MODEL + """
m = model(int(sys.argv[1]))
torch.cuda.synchronize()
free_before = torch.cuda.mem_get_info()[0]
report = glake.torch.share_weights(m)
torch.cuda.synchronize()
report["freed"] = torch.cuda.mem_get_info()[0] - free_before
report["stats_shared"] = torch.cuda.memory_stats()["glake.shared_bytes"]
with torch.no_grad():
    report["out"] = float(m(x).float().abs().sum())
print("REPORT " + json.dumps(report))
"""


def child(seed):
    out = run_script(CHILD, str(seed))
    line = next(ln for ln in out.splitlines() if ln.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


def test_a_second_process_maps_the_first_ones_weights():
    scope = {}
    exec(MODEL, scope)
    m = scope["model"](1234)
    weights = sum(p.numel() * p.element_size() for p in m.parameters())
    with torch.no_grad():
        expected = float(m(scope["x"]).float().abs().sum())
    mine = glake.torch.share_weights(m)
    assert mine["offered_bytes"] + mine["shared_bytes"] >= 0.9 * weights, mine
    assert glake.torch.stats()["glake.offered_bytes"] + glake.torch.stats()[
        "glake.shared_bytes"] >= 0.9 * weights
    with torch.no_grad():
        assert float(m(scope["x"]).float().abs().sum()) == expected

    same = child(1234)
    assert same["shared_bytes"] >= 0.9 * weights, same
    assert same["stats_shared"] == same["shared_bytes"]
    # The driver has the second process's copy back.
    assert same["freed"] >= 0.9 * same["shared_bytes"], same
    assert same["out"] == expected

    other = child(99)
    assert other["shared_bytes"] == 0, other
    del m
    torch.cuda.empty_cache()
