"""glake through PyTorch's own allocator interface (the native path): typed out-of-memory
errors and observers, memory history and memory_viz, memory fraction, MemPool, CUDA graph
pools, raw allocations, and enabling without code changes. Run by scripts/gpu-torch.sh; the
session enables glake in conftest.py."""
import contextlib
import os
import pickle
import sys
import textwrap
import threading

import pytest
import torch
from conftest import PYTHON_DIR, run_script

import glake.torch

GIB = 2**30
MIB = 2**20

native = pytest.mark.skipif(glake.torch.info()["path"] != "native",
                            reason="the native allocator is not active: "
                            + str(glake.torch.info()["reason"]))


def test_info_names_the_active_path():
    info = glake.torch.info()
    assert info["enabled"] and info["path"] in ("native", "pluggable")
    if os.environ.get("GLAKE_NATIVE", "auto") not in ("0", "off"):
        assert info["path"] == "native", info["reason"]
        assert os.path.isfile(info["native_library"])


@native
def test_out_of_memory_is_typed_with_pytorchs_message_and_the_process_goes_on():
    torch.ones(1, device="cuda")  # CUDA started: memory_stats() is empty before
    ooms = torch.cuda.memory_stats()["num_ooms"]
    with pytest.raises(torch.cuda.OutOfMemoryError, match="Tried to allocate more than 1EB"):
        torch.empty(1 << 61, dtype=torch.uint8, device="cuda")
    with pytest.raises(torch.cuda.OutOfMemoryError) as caught:
        torch.empty(200 * GIB, dtype=torch.uint8, device="cuda")
    text = str(caught.value)
    assert "CUDA out of memory. Tried to allocate 200.00 GiB. GPU 0 has a total capacity of" in text
    assert "glake" in text
    assert torch.cuda.memory_stats()["num_ooms"] == ooms + 1
    assert torch.arange(10, device="cuda").sum().item() == 45


@native
def test_out_of_memory_observers_see_the_device():
    seen = []
    torch._C._cuda_attach_out_of_memory_observer(
        lambda device, allocated, total, free: seen.append((device, allocated, total, free)))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch.empty(300 * GIB, dtype=torch.uint8, device="cuda")
    assert len(seen) == 1
    # As PyTorch's allocator reports it: the request, the memory allowed, the memory free.
    device, requested, allowed, free = seen[0]
    assert device == 0 and requested == 300 * GIB
    assert allowed == torch.cuda.mem_get_info()[1] and 0 < free <= allowed


@native
def test_memory_fraction_reads_back():
    torch.cuda.set_per_process_memory_fraction(0.5)
    try:
        assert torch.cuda.get_per_process_memory_fraction() == 0.5
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert torch.cuda.get_per_process_memory_fraction() == 1.0


def _alloc_here(n):
    return torch.empty(n, dtype=torch.uint8, device="cuda")


@contextlib.contextmanager
def _room_for(extra):
    """The process's memory fraction set to what is reserved now plus `extra` bytes; the cache
    emptied and the fraction restored afterwards."""
    total = torch.cuda.mem_get_info()[1]
    before = torch.cuda.get_per_process_memory_fraction()
    torch.cuda.set_per_process_memory_fraction((extra + torch.cuda.memory_reserved()) / total)
    try:
        yield
    finally:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(before)


@native
def test_memory_history_records_stacks_segments_and_loads_in_memory_viz(tmp_path):
    from torch.cuda import _memory_viz

    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    try:
        x = _alloc_here(3 * MIB + 5)
        big = _alloc_here(256 * MIB)
        del big
        torch.cuda.empty_cache()
        snap = torch.cuda.memory._snapshot()
        path = tmp_path / "snapshot.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(None)
    trace = snap["device_traces"][0]
    actions = [e["action"] for e in trace]
    for action in ("segment_alloc", "alloc", "free_requested", "free_completed", "segment_free"):
        assert action in actions, actions
    mine = [e for e in trace if e["action"] == "alloc" and e["addr"] == x.data_ptr()]
    assert mine and mine[0]["size"] == 3 * MIB + 5
    assert any("_alloc_here" == f["name"] and "test_native.py" in f["filename"]
               for f in mine[0]["frames"])
    # The live block carries the stack it was allocated with.
    blocks = [b for s in snap["segments"] for b in s["blocks"]
              if b["state"] == "active_allocated" and b["requested_size"] == 3 * MIB + 5]
    assert blocks and any("test_native.py" in f["filename"] for f in blocks[0]["frames"])
    # What memory_viz reads: the dumped pickle turns into both of its pages.
    with open(path, "rb") as f:
        dumped = pickle.load(f)
    assert "<html" in _memory_viz.trace_plot(dumped).lower()
    assert "<html" in _memory_viz.segment_plot(dumped).lower()
    del x


@native
def test_stitched_allocations_are_named_in_the_history():
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        before = glake.torch.stats()["glake.stitches"]
        blocks = [_alloc_here(64 * MIB) for _ in range(8)]
        del blocks[::2]
        torch.cuda.set_per_process_memory_fraction(
            (torch.cuda.memory_reserved() + 8 * MIB) / torch.cuda.mem_get_info()[1])
        try:
            joined = _alloc_here(192 * MIB)  # only stitched free pieces can serve it
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(None)
    assert glake.torch.stats()["glake.stitches"] > before
    entry = [e for e in snap["device_traces"][0]
             if e["action"] == "alloc" and e["addr"] == joined.data_ptr()]
    assert entry and "stitched from" in entry[-1].get("user_metadata", "")
    assert glake.torch.torch_snapshot()["glake_stitched"]
    del joined, blocks


@native
def test_mempool_routes_counts_and_snapshots():
    pool = torch.cuda.MemPool()
    assert pool.use_count() == 1
    outside = _alloc_here(4 * MIB)
    with torch.cuda.use_mem_pool(pool):
        assert pool.use_count() == 2
        inside = _alloc_here(24 * MIB)
    assert pool.use_count() == 1
    segments = pool.snapshot()
    assert segments and all(tuple(s["segment_pool_id"]) == tuple(pool.id) for s in segments)
    starts = [(s["address"], s["address"] + s["total_size"]) for s in segments]
    assert any(a <= inside.data_ptr() < b for a, b in starts)
    assert not any(a <= outside.data_ptr() < b for a, b in starts)
    del inside, outside
    del pool
    torch.cuda.empty_cache()


# A MemPool's own allocator, as users bring one (cudaMallocManaged, NCCL buffers): plain
# driver memory, counting what it makes and frees.
OWN_ALLOCATOR_C = r"""
#include <dlfcn.h>
#include <stddef.h>
typedef int (*alloc_fn)(unsigned long long *, size_t);
typedef int (*free_fn)(unsigned long long);
static alloc_fn cu_alloc;
static free_fn cu_free;
int made = 0, freed = 0;
static void load(void) {
  if (!cu_alloc) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    cu_alloc = (alloc_fn)dlsym(h, "cuMemAlloc_v2");
    cu_free = (free_fn)dlsym(h, "cuMemFree_v2");
  }
}
void *own_alloc(size_t size, int device, void *stream) {
  unsigned long long p = 0;
  load();
  if (cu_alloc(&p, size) != 0) return 0;
  made++;
  return (void *)p;
}
void own_free(void *ptr, size_t size, int device, void *stream) {
  load();
  cu_free((unsigned long long)ptr);
  freed++;
}
"""


@native
def test_mempools_with_their_own_allocator_cache_and_share_the_memory_fraction(tmp_path):
    import ctypes
    import subprocess

    source = tmp_path / "own_allocator.c"
    source.write_text(OWN_ALLOCATOR_C)
    library = tmp_path / "libown_allocator.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source), "-ldl"],
                   check=True)
    counts = ctypes.CDLL(str(library))
    made = lambda: ctypes.c_int.in_dll(counts, "made").value  # noqa: E731
    freed = lambda: ctypes.c_int.in_dll(counts, "freed").value  # noqa: E731
    allocator = torch.cuda.memory.CUDAPluggableAllocator(str(library), "own_alloc", "own_free")
    kept = torch.cuda.MemPool(allocator.allocator())
    lender = torch.cuda.MemPool(allocator.allocator(), use_on_oom=True)
    torch.cuda.empty_cache()
    with _room_for(80 * MIB):
        try:
            with torch.cuda.use_mem_pool(kept):
                a = _alloc_here(40 * MIB)
            with torch.cuda.use_mem_pool(lender):
                b = _alloc_here(40 * MIB)
            b_ptr = b.data_ptr()
            assert made() == 2
            # Reserved memory holds the pools' segments, as PyTorch counts them.
            assert torch.cuda.memory_reserved() >= 80 * MIB
            # The pools' memory counts against the fraction with glake's own.
            with pytest.raises(torch.cuda.OutOfMemoryError):
                _alloc_here(40 * MIB)
            del a, b
            assert freed() == 0, "freed blocks stay cached in their pools"
            # The shared pool is full; the pool lent on out-of-memory serves from its cache.
            c = _alloc_here(30 * MIB)
            assert c.data_ptr() == b_ptr
            with pytest.raises(torch.cuda.OutOfMemoryError):
                _alloc_here(30 * MIB)  # the other pool's cache is its own
            del c
            # Segments split: two halves of the 40 MiB one, and no new memory.
            with torch.cuda.use_mem_pool(lender):
                e = _alloc_here(20 * MIB)
                f = _alloc_here(20 * MIB)
            assert e.data_ptr() == b_ptr and f.data_ptr() == b_ptr + 20 * MIB and made() == 2
            del e, f
        finally:
            del kept, lender
    assert freed() == 2, "a released pool hands its blocks back to their allocator"
    # Their bytes are off the books: the whole budget is glake's again.
    with _room_for(80 * MIB):
        x = _alloc_here(70 * MIB)
        del x


@native
def test_a_request_routed_to_a_pool_does_not_borrow_from_a_pool_lent_on_out_of_memory():
    # PyTorch's rule: a request already routed to a pool (a MemPool in use, a graph being
    # captured) runs out of memory instead; memory of the lender would end up in that pool or
    # graph without either knowing it.
    lender = torch.cuda.MemPool(use_on_oom=True)
    routed = torch.cuda.MemPool()
    torch.cuda.empty_cache()
    with _room_for(64 * MIB):
        try:
            with torch.cuda.use_mem_pool(lender):
                b = _alloc_here(40 * MIB)
            b_ptr = b.data_ptr()
            del b
            with torch.cuda.use_mem_pool(routed):
                with pytest.raises(torch.cuda.OutOfMemoryError):
                    _alloc_here(30 * MIB)
            # Outside any pool the lender's cached block serves the same request.
            c = _alloc_here(30 * MIB)
            assert c.data_ptr() == b_ptr
            del c
        finally:
            del lender, routed


@native
def test_the_profiler_is_told_the_same_bytes_when_memory_is_handed_out_and_back():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 profile_memory=True) as prof:
        for _ in range(8):
            x = torch.empty(250, dtype=torch.float32, device="cuda")  # 1000 bytes asked for
            del x
    # Each allocation's bytes come back at its free: the memory the profiler saw on the device
    # nets to zero over all events (PyTorch reports the block's size on both sides; the
    # allocation is the op's own, the free a "[memory]" event outside any op).
    usage = [getattr(e, "self_device_memory_usage", None) for e in prof.events()]
    if all(u is None for u in usage):
        usage = [getattr(e, "self_cuda_memory_usage", 0) for e in prof.events()]
    usage = [u for u in usage if u]
    assert usage, "the profiler recorded no device memory"
    assert sum(usage) == 0
    assert {abs(u) for u in usage} == {1024}


@native
def test_mempools_used_from_several_threads_stay_apart():
    pools = [torch.cuda.MemPool() for _ in range(3)]
    made, errors = {}, []

    def work(i):
        try:
            with torch.cuda.use_mem_pool(pools[i]):
                made[i] = _alloc_here((i + 1) * 8 * MIB)
        except Exception as err:  # noqa: BLE001 - reported by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, pool in enumerate(pools):
        ranges = [(s["address"], s["address"] + s["total_size"]) for s in pool.snapshot()]
        assert any(a <= made[i].data_ptr() < b for a, b in ranges), i
    made.clear()
    del pools
    torch.cuda.empty_cache()


@native
def test_graph_pool_segments_carry_the_graph_pool_id():
    x = torch.randn(1 << 20, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x * 2  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        y = x * 2 + 1
    pool = tuple(graph.pool())
    assert pool != (0, 0)
    owned = [s for s in torch.cuda.memory._snapshot()["segments"]
             if tuple(s["segment_pool_id"]) == pool]
    assert any(s["address"] <= y.data_ptr() < s["address"] + s["total_size"] for s in owned)
    x.fill_(1.0)
    graph.replay()
    assert torch.allclose(y, torch.full_like(y, 3.0))
    del graph, y


@native
def test_graph_tree_checkpoint_brings_freed_allocations_back():
    # What CUDA graph trees (torch.compile mode="reduce-overhead") do when they switch paths.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.ones(256, device="cuda").mul_(2)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        small = torch.ones(256, device="cuda") * 2
        large = torch.ones(8 * MIB, device="cuda") * 3
    pool = graph.pool()
    state = torch._C._cuda_getCheckpointState(0, pool)
    ptrs = [small.data_ptr(), large.data_ptr()]
    sizes = [small.untyped_storage().nbytes(), large.untyped_storage().nbytes()]
    assert torch._C._cuda_checkPoolLiveAllocations(0, pool, set(ptrs))
    del small, large
    assert torch._C._cuda_checkPoolLiveAllocations(0, pool, set())
    storages = [torch._C._construct_storage_from_data_pointer(p, torch.device("cuda", 0), n)
                for p, n in zip(ptrs, sizes)]
    torch._C._cuda_setCheckpointPoolState(0, state, [], [s._cdata for s in storages])
    assert torch._C._cuda_checkPoolLiveAllocations(0, pool, set(ptrs))
    graph.replay()
    restored = torch.empty(0, device="cuda").set_(storages[1])
    assert restored[:8 * MIB].eq(3).all()
    del restored, storages  # their deleters now free through glake
    assert torch._C._cuda_checkPoolLiveAllocations(0, pool, set())
    del graph


@native
def test_raw_alloc_and_delete_are_counted():
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    ptr = torch.cuda.caching_allocator_alloc(8 * MIB)
    assert torch.cuda.memory_allocated() >= before + 8 * MIB
    torch.cuda.caching_allocator_delete(ptr)
    assert torch.cuda.memory_allocated() == before


@native
def test_memory_stats_keep_glakes_counters():
    stats = torch.cuda.memory_stats()
    assert "glake.stitches" in stats and "allocated_bytes.all.current" in stats


SHOW_PATH = textwrap.dedent("""
    import torch
    x = torch.ones(1 << 20, device="cuda")
    import glake.torch
    print("glake path:", glake.torch.info()["path"], flush=True)
""")


def test_launcher_enables_glake_without_code_changes():
    out = run_script(SHOW_PATH, launcher=True)
    expected = "native" if glake.torch.info()["path"] == "native" else "pluggable"
    assert f"glake path: {expected}" in out


def test_torchrun_under_the_launcher_enables_every_worker(gpu_count):
    if gpu_count < 2:
        pytest.skip("needs two GPUs")
    out = run_script(SHOW_PATH, launcher=True, nproc=2)
    assert out.count("glake path: ") == 2 and "glake path: None" not in out


TRAIN = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 512)).cuda()
    if sys.argv[1] == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        model = FSDP(model)
    else:
        model = DDP(model, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(5):
        data = torch.randn(64, 512, generator=gen).cuda()
        loss = model(data).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step} loss {total.item():.8f}", flush=True)
    import glake.torch
    stats = torch.cuda.memory_stats()
    print(f"rank {rank} path {glake.torch.info()['path']} peak "
          f"{stats['allocated_bytes.all.peak']}", flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_ddp_and_fsdp_under_the_launcher_match_native(gpu_count, kind):
    if gpu_count < 2:
        pytest.skip("needs two GPUs")
    native_out = run_script(TRAIN, kind, nproc=2, glake_off=True)
    glake_out = run_script(TRAIN, kind, nproc=2, launcher=True)
    losses = lambda out: [l for l in out.splitlines() if l.startswith("step ")]  # noqa: E731
    assert len(losses(native_out)) == 5
    assert losses(glake_out) == losses(native_out)
    assert glake_out.count(" path native ") + glake_out.count(" path pluggable ") == 2
    assert " path None " in native_out or "path None" in native_out

