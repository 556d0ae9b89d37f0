"""glake as PyTorch's allocator on the GPU: tensors, autograd, streams, caches, limits, CUDA
graphs, statistics, several GPUs and DDP. Run by scripts/gpu-torch.sh."""
import gc
import textwrap

import pytest
import torch
from conftest import run_script

import glake.torch

GIB = 2**30
MIB = 2**20


def test_enabled_with_every_hook():
    assert glake.torch.is_enabled()
    before = glake.torch.stats()["allocation.all.allocated"]
    x = torch.ones(1, device="cuda")
    # The tensor's memory came from glake: its own counters saw the request.
    assert glake.torch.stats()["allocation.all.allocated"] == before + 1
    assert glake.torch.snapshot()["stats"]["allocation.all.current"] >= 1
    del x


def test_tensors_and_autograd_match_the_cpu():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 10))
    data = torch.randn(64, 256)
    cpu_loss = model(data).square().mean()
    cpu_loss.backward()
    cpu_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.cuda()
    gpu_loss = model(data.cuda()).square().mean()
    gpu_loss.backward()
    assert torch.allclose(cpu_loss, gpu_loss.cpu(), rtol=1e-4, atol=1e-5)
    for cpu, p in zip(cpu_grads, model.parameters()):
        assert torch.allclose(cpu, p.grad.cpu(), rtol=1e-3, atol=1e-5)
    # Many shapes, many frees: values survive the allocator's reuse and stitching.
    keep = [torch.full((n * 4096,), float(n), device="cuda") for n in range(1, 200, 7)]
    for n, t in zip(range(1, 200, 7), keep):
        assert t.sum().item() == float(n) * n * 4096
    assert torch.empty(0, device="cuda").numel() == 0


def test_statistics_answer_with_pytorch_names():
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    x = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    assert torch.cuda.memory_allocated() == base + 64 * MIB
    assert torch.cuda.max_memory_allocated() >= base + 64 * MIB
    assert torch.cuda.memory_reserved() >= torch.cuda.memory_allocated()
    assert torch.cuda.max_memory_reserved() >= torch.cuda.memory_reserved()
    stats = torch.cuda.memory_stats()
    for key in ("allocated_bytes.all.current", "reserved_bytes.large_pool.peak",
                "requested_bytes.all.current", "num_alloc_retries", "num_ooms",
                "glake.stitches"):
        assert key in stats, key
    assert torch.cuda.memory_stats_as_nested_dict()["allocated_bytes"]["all"]["current"] == (
        stats["allocated_bytes.all.current"])
    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "memory_allocated"):
        assert torch.accelerator.memory_allocated() == torch.cuda.memory_allocated()
    summary = torch.cuda.memory_summary()
    assert "Allocated memory" in summary and "GPU reserved memory" in summary
    del x
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated() == base
    torch.cuda.reset_accumulated_memory_stats()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == 0


def test_deepspeed_style_memory_report_runs_unmodified():
    # The calls of DeepSpeed's see_memory_usage() and its allocator-flush warning.
    def see_memory_usage():
        gc.collect()
        line = (f"MA {round(torch.cuda.memory_allocated() / GIB, 2)} GB "
                f"Max_MA {round(torch.cuda.max_memory_allocated() / GIB, 2)} GB "
                f"CA {round(torch.cuda.memory_reserved() / GIB, 2)} GB "
                f"Max_CA {round(torch.cuda.max_memory_reserved() / GIB)} GB ")
        torch.cuda.reset_peak_memory_stats()
        return line

    x = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    assert "MA 1." in see_memory_usage()
    # DeepSpeed's flush warning reads this key; nothing here retries.
    assert torch.cuda.memory_stats()["num_alloc_retries"] == 0
    del x
    assert see_memory_usage().startswith("MA ")


def test_snapshot_in_pytorch_shape():
    x = torch.empty(32 * MIB, dtype=torch.uint8, device="cuda")
    snap = torch.cuda.memory_snapshot()
    assert sum(s["total_size"] for s in snap if s["device"] == 0) == torch.cuda.memory_reserved()
    assert any(b["address"] == x.data_ptr() and b["state"] == "active_allocated"
               for s in snap for b in s["blocks"])
    assert glake.torch.snapshot()["memory_cap"] > 0
    assert "glake_stitched" in torch.cuda.memory._snapshot()
    del x


def test_record_stream_keeps_memory_until_the_stream_is_done():
    side = torch.cuda.Stream()
    x = torch.ones(16 * MIB, device="cuda")
    ptr = x.data_ptr()
    torch.cuda.current_stream().synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keeps the side stream busy for a while
        x.mul_(3)
    x.record_stream(side)
    del x
    y = torch.empty(16 * MIB, device="cuda")
    assert y.data_ptr() != ptr, "memory reused while another stream may still use it"
    side.synchronize()
    del y


def test_empty_cache_returns_memory_to_the_driver():
    torch.cuda.synchronize()
    x = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    del x
    reserved = torch.cuda.memory_reserved()
    free_before, _ = torch.cuda.mem_get_info()
    torch.cuda.empty_cache()
    free_after, _ = torch.cuda.mem_get_info()
    released = reserved - torch.cuda.memory_reserved()
    # Some of the 2 GiB may have been stitched from memory cached before; what the cache held
    # and nothing uses goes back, all the way to the driver.
    assert released > 0
    assert all(any(b["state"] != "inactive" for b in s["blocks"])
               for s in torch.cuda.memory_snapshot())
    assert free_after >= free_before + released - 64 * MIB


def test_out_of_memory_raises_and_the_process_goes_on():
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        torch.empty(200 * GIB, dtype=torch.uint8, device="cuda")
    assert torch.cuda.memory_stats()["num_ooms"] >= 2
    y = torch.arange(1000, device="cuda").sum()
    assert y.item() == 999 * 1000 // 2


def test_memory_fraction_caps_the_pool():
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(0.1)
    try:
        with pytest.raises(RuntimeError, match="CUDA out of memory"):
            torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda")
        ok = torch.empty(int(total * 0.02), dtype=torch.uint8, device="cuda")
        ok.fill_(1)
        assert ok[-1].item() == 1
        del ok
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    big = torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda")
    del big


def test_cuda_graph_capture_and_replay():
    static_in = torch.randn(1024, 1024, device="cuda")
    weight = torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as PyTorch recommends
        for _ in range(2):
            (static_in @ weight).relu().sum(0)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        tmp = (static_in @ weight).relu()
        static_out = tmp.sum(0) * 2
        del tmp
    # Eager work between replays must not land in the graph's memory.
    for _ in range(3):
        noise = [torch.randn(4 * MIB, device="cuda") for _ in range(8)]
        static_in.copy_(torch.randn(1024, 1024, device="cuda"))
        graph.replay()
        expected = (static_in @ weight).relu().sum(0) * 2
        assert torch.allclose(static_out, expected, rtol=1e-3, atol=1e-2)
        del noise
    # The graph's pool holds its output (and whatever else the capture keeps, such as a cuBLAS
    # workspace); once the graph is reset (as its destructor does), the pool is released and its
    # memory is shared again. reset() rather than `del`: under compute-sanitizer a Python frame
    # of the capture outlives the with-block and keeps the graph object alive.
    pool = graph.pool()
    assert static_out.data_ptr() in glake.torch._stats.pool_allocations(0, pool)
    graph.reset()
    del graph, static_out
    gc.collect()
    torch.cuda.synchronize()
    assert glake.torch._stats.pool_allocations(0, pool) is None


def test_torch_compile_reduce_overhead():
    def f(x, w):
        return torch.nn.functional.gelu(x @ w).sum(dim=0)

    compiled = torch.compile(f, mode="reduce-overhead")
    w = torch.randn(512, 512, device="cuda")
    for i in range(4):
        x = torch.randn(256, 512, device="cuda")
        assert torch.allclose(compiled(x, w), f(x, w), rtol=1e-2, atol=1e-1), i


def test_enable_after_cuda_starts_is_a_clear_error():
    out = run_script(textwrap.dedent("""
        import torch
        torch.ones(1, device="cuda")
        import glake.torch
        try:
            glake.torch.enable()
        except RuntimeError as err:
            print("refused:", err)
    """))
    assert "refused: glake.torch.enable() must run before CUDA is initialised" in out


def test_gmlake_allocator_class_of_the_tutorial_works_unchanged():
    # The GMlakeAllocator class of GMLake's pluggable-allocator guide, with only the .so path
    # changed.
    out = run_script(textwrap.dedent("""
        import ctypes, pathlib, torch
        import glake._library

        class GMlakeAllocator(torch.cuda.memory.CUDAPluggableAllocator):
            def __init__(self, path_to_so_file, alloc_fn_name, free_fn_name, init_fn_name,
                         reset_fn_name, set_memory_fraction_fn_name, base_alloc_fn_name,
                         record_stream_fn_name):
                super().__init__(path_to_so_file, alloc_fn_name, free_fn_name)
                allocator = ctypes.CDLL(path_to_so_file)
                init_fn = ctypes.cast(getattr(allocator, init_fn_name), ctypes.c_void_p).value
                assert init_fn is not None
                self._allocator.set_init_fn(init_fn)
                reset_fn = ctypes.cast(getattr(allocator, reset_fn_name), ctypes.c_void_p).value
                assert reset_fn is not None
                self._allocator.set_reset_fn(reset_fn)
                fraction_fn = ctypes.cast(getattr(allocator, set_memory_fraction_fn_name),
                                          ctypes.c_void_p).value
                assert fraction_fn is not None
                self._allocator.set_memory_fraction_fn(fraction_fn)
                base_fn = ctypes.cast(getattr(allocator, base_alloc_fn_name), ctypes.c_void_p).value
                assert base_fn is not None
                self._allocator.set_base_alloc_fn(base_fn)
                record_fn = ctypes.cast(getattr(allocator, record_stream_fn_name),
                                        ctypes.c_void_p).value
                assert record_fn is not None
                self._allocator.set_record_stream_fn(record_fn)

        sofile = pathlib.Path(glake._library.path())
        allocator = GMlakeAllocator(str(sofile.absolute()), alloc_fn_name="gmlake_malloc",
                                    free_fn_name="gmlake_free", init_fn_name="gmlake_init",
                                    reset_fn_name="gmlake_reset",
                                    set_memory_fraction_fn_name="gmlake_memory_fraction",
                                    base_alloc_fn_name="gmlake_base_alloc",
                                    record_stream_fn_name="gmlake_record_stream")
        torch.cuda.memory.change_current_allocator(allocator)
        model = torch.nn.Linear(1024, 1024).cuda()
        for n in (64, 512, 128, 1024):
            model(torch.randn(n, 1024, device="cuda")).sum().backward()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        print("tutorial allocator ok")
    """))
    assert "tutorial allocator ok" in out


def test_two_gpus_in_one_process(gpu_count):
    if gpu_count < 2:
        pytest.skip("needs 2 GPUs")
    a = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
    b = a.to("cuda:1")
    c = (b * 2).to("cuda:0")
    assert torch.equal(c, a * 2)
    with torch.cuda.device(1):
        assert torch.cuda.memory_allocated(1) > 0
    assert glake.torch.stats(1)["allocated_bytes.all.current"] > 0


DDP_SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    import glake.torch
    glake.torch.enable()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 1024)).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    for step in range(5):
        x = torch.randn(64 * (1 + step + rank), 1024, device="cuda")
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered), "replicas diverged"
    stats = torch.cuda.memory_stats()
    print(f"rank {rank} ok: allocated peak {stats['allocated_bytes.all.peak']}")
    dist.destroy_process_group()
""")


def test_ddp_two_processes(gpu_count):
    if gpu_count < 2:
        pytest.skip("needs 2 GPUs")
    out = run_script(DDP_SCRIPT, nproc=2)
    assert "rank 0 ok" in out and "rank 1 ok" in out
