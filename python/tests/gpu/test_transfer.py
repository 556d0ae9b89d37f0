"""glake's copy engine from PyTorch: CPU tensors to the GPU and back, state dicts, with glake as
the allocator (this session) and without it (a fresh process)."""
import textwrap

import pytest
import torch
from conftest import run_script

import glake.torch

MIB = 2**20


def test_tensors_move_both_ways_like_tensor_to():
    torch.manual_seed(0)
    cases = [
        torch.randn(64 * MIB // 4),  # pageable, large: the engine's lanes
        torch.randn(1000, 3).t(),  # not contiguous
        torch.arange(10, dtype=torch.int64),  # small: the driver's own call
        torch.empty(0),
        torch.randn(8 * MIB // 2, dtype=torch.float16).pin_memory(),  # pinned
        torch.randint(0, 255, (33 * MIB + 5,), dtype=torch.uint8),
    ]
    for cpu in cases:
        for non_blocking in (False, True):
            gpu = glake.torch.to_device(cpu, non_blocking=non_blocking)
            assert gpu.is_cuda and gpu.shape == cpu.shape and gpu.dtype == cpu.dtype
            assert torch.equal(gpu.cpu(), cpu)
            back = glake.torch.to_host(gpu, pin_memory=non_blocking)
            assert torch.equal(back, cpu)
    stats = glake.torch.transfer_stats()
    assert stats["engine_bytes"] > 0 and stats["driver_copies"] > 0


def test_copies_are_ordered_on_the_current_stream():
    side = torch.cuda.Stream()
    cpu = torch.randn(32 * MIB // 4)
    with torch.cuda.stream(side):
        gpu = glake.torch.to_device(cpu, non_blocking=True)
        doubled = gpu * 2  # queued on the same stream: sees the copied data
    side.synchronize()
    assert torch.equal(doubled.cpu(), cpu * 2)


def test_state_dicts_load_with_shared_tensors_kept_shared():
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 256), torch.nn.Linear(256, 1000))
    model[1].weight = model[0].weight  # tied, as in language models
    state = model.state_dict(keep_vars=False)
    state["step"] = 7
    loaded = glake.torch.load_state_dict(state)
    assert loaded["step"] == 7
    assert loaded["0.weight"].data_ptr() == loaded["1.weight"].data_ptr()
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].is_cuda and torch.equal(loaded[key].cpu(), value)


def test_the_engine_works_without_glake_as_the_allocator():
    out = run_script(textwrap.dedent("""
        import torch
        import glake.torch
        assert not glake.torch.is_enabled()
        cpu = torch.randn(48 * 2**20 // 4)
        gpu = glake.torch.to_device(cpu)
        assert torch.equal(gpu.cpu(), cpu)
        assert torch.equal(glake.torch.to_host(gpu), cpu)
        state = glake.torch.load_state_dict({"w": cpu, "b": torch.ones(3)})
        assert torch.equal(state["w"].cpu(), cpu)
        print("engine bytes", glake.torch.transfer_stats()["engine_bytes"])
    """))
    assert "engine bytes" in out and "engine bytes 0" not in out


def test_swaps_relay_through_a_peer_gpu_and_keep_their_bytes(gpu_count, monkeypatch):
    if gpu_count < 2:
        pytest.skip("one GPU: swaps are the driver's copies")
    from glake import transfer
    from glake.swap.executor import Swapper

    assert Swapper("cuda:0").relay is None, "off unless asked for"
    monkeypatch.setenv("GLAKE_SWAP_RELAY", "1")
    swapper = Swapper("cuda:0")
    assert swapper.relay == 0, "the engine of GPU 0 relays through GPU 1"
    before = transfer.stats(0)["engine_bytes"]
    data = torch.randint(0, 255, (96 * MIB + 7,), dtype=torch.uint8, device="cuda:0")
    host = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=True)
    swapper.d2h.wait_stream(torch.cuda.current_stream())
    swapper.copy([(host, data)], swapper.d2h)
    back = torch.empty_like(data)
    swapper.h2d.wait_stream(swapper.d2h)
    swapper.copy([(back, host)], swapper.h2d)
    swapper.h2d.synchronize()
    assert torch.equal(back, data)
    assert transfer.stats(0)["engine_bytes"] - before >= 2 * data.numel()
