"""The Python package without PyTorch or a GPU: options, the nested statistics form, and the
library's statistics calls on the host backend (GLAKE_BACKEND=host)."""
import ctypes
import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
os.environ.setdefault("GLAKE_BACKEND", "host")
os.environ.setdefault("GLAKE_HOST_DEVICES", "4")
os.environ.setdefault("GLAKE_HOST_MEMORY", "1G")
os.environ.setdefault("GLAKE_TIME_CALLS", "1")

from glake import _library, options, stats  # noqa: E402

MIB = 1 << 20


def test_options_map_keywords_and_gmlake_spellings():
    env = options.environment(stitch=False, fragLimit="64M", reuseLimit=4, autoGC=100)
    assert env == {
        "GLAKE_STITCH": "0",
        "GLAKE_FRAG_LIMIT": "64M",
        "GLAKE_REUSE_LIMIT": "4",
        "GLAKE_AUTO_GC": "100",
    }
    assert options.environment(grow_stitched=False, gather=True) == {
        "GLAKE_GROW_STITCHED": "0",
        "GLAKE_GATHER": "1",
    }
    with pytest.raises(TypeError, match="unknown glake option 'fraglimit'"):
        options.environment(fraglimit=1)


def test_nested_is_the_inverse_of_pytorch_flattening():
    flat = {"allocated_bytes.all.current": 5, "num_ooms": 1, "glake.stitches": 2}
    assert stats.nested(flat) == {
        "allocated_bytes": {"all": {"current": 5}},
        "num_ooms": 1,
        "glake": {"stitches": 2},
    }


def test_missing_library_names_every_place_looked(monkeypatch, tmp_path):
    monkeypatch.setenv("GLAKE_LIBRARY", str(tmp_path / "nope.so"))
    monkeypatch.setattr(_library, "candidates", lambda: [tmp_path / "nope.so"])
    with pytest.raises(FileNotFoundError, match="nope.so"):
        _library.path()


@pytest.fixture(scope="module")
def lib():
    try:
        loaded = _library.load()
    except FileNotFoundError as err:
        pytest.fail(f"build libgmlake.so first (cargo build --release -p gmlake): {err}")
    loaded.gmlake_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    loaded.gmlake_malloc.restype = ctypes.c_void_p
    loaded.gmlake_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    loaded.gmlake_free.restype = None
    return loaded


def test_statistics_follow_allocations(lib):
    # Device 3 of the host backend: untouched by any other test in this process.
    assert stats.flat(3)["allocated_bytes.all.current"] == 0
    assert stats.snapshot(3) is None
    assert stats.pool_allocations(3, (1, 2)) is None
    before = stats.call_times()
    assert before["enabled"]
    ptr = lib.gmlake_malloc(5 * MIB, 3, None)
    assert ptr
    flat = stats.flat(3)
    # 512-byte units: nothing rounded up to the 2 MiB granule; the segment is whole granules.
    assert flat["allocated_bytes.all.current"] == 5 * MIB
    assert flat["requested_bytes.all.current"] == 5 * MIB
    assert flat["reserved_bytes.all.current"] >= 6 * MIB
    lib.gmlake_free(ptr, 5 * MIB, 3, None)
    after = stats.call_times()
    assert after["malloc_calls"] == before["malloc_calls"] + 1
    assert after["free_calls"] == before["free_calls"] + 1
    assert after["malloc_ns"] > before["malloc_ns"] and after["free_ns"] > before["free_ns"]
    flat = stats.flat(3)
    assert flat["allocated_bytes.all.current"] == 0
    assert flat["allocated_bytes.all.peak"] == 5 * MIB
    stats.reset_peak(3)
    assert stats.flat(3)["allocated_bytes.all.peak"] == 0
    stats.reset_accumulated(3)
    assert stats.flat(3)["allocation.all.allocated"] == 0
    snap = stats.snapshot(3)
    assert sum(s["total_size"] for s in snap["segments"]) == flat["reserved_bytes.all.current"]
    for segment in snap["segments"]:
        assert sum(segment["chunk_sizes"]) == segment["total_size"]


def test_memory_limit_in_bytes_and_as_a_fraction(lib):
    # Device 2 of the host backend (1 GiB): untouched by any other test in this process.
    device, total = 2, 1 << 30
    stats.set_memory_limit(device, 16 * MIB)
    assert stats.memory_limit(device) == (16 * MIB, 16 * MIB / total)
    first = lib.gmlake_malloc(12 * MIB, device, None)
    assert first
    assert stats.snapshot(device)["memory_cap"] == 16 * MIB
    with pytest.raises(ValueError):
        stats.set_memory_limit(device, 0)
    # A fraction made from a byte budget gives the budget back, to the byte.
    budget = 1_000_000_007
    lib.gmlake_memory_fraction(ctypes.c_double(budget / total), device)
    assert stats.memory_limit(device) == (budget, budget / total)
    assert stats.snapshot(device)["memory_cap"] == budget
    lib.gmlake_free(first, 12 * MIB, device, None)
    assert stats.flat(device)["num_ooms"] == 0


def test_copy_engine_moves_bytes_both_ways(lib):
    from glake import transfer

    # Device 1 of the host backend: its pool's memory is reachable by its copy engine.
    n = 18 * MIB + 7
    dst = lib.gmlake_malloc(n, 1, None)
    assert dst
    src = (ctypes.c_ubyte * n).from_buffer_copy(bytes(i * 7 % 251 for i in range(n)))
    back = (ctypes.c_ubyte * n)()
    transfer.to_device(1, dst, ctypes.addressof(src), n)
    transfer.to_host(1, ctypes.addressof(back), dst, n, non_blocking=True)
    assert bytes(back) == bytes(src)
    counters = transfer.stats(1)
    assert counters["copies"] == 2 and counters["engine_bytes"] == 2 * n
    with pytest.raises(RuntimeError, match="NULL"):
        transfer.to_device(1, dst, None, 16)
    lib.gmlake_free(dst, n, 1, None)


def test_copy_engine_batches(lib):
    from glake import transfer

    sizes = [5, 3 * MIB + 1, 0, 2 * MIB]
    dsts = [lib.gmlake_malloc(max(n, 1), 1, None) for n in sizes]
    srcs = [(ctypes.c_ubyte * max(n, 1)).from_buffer_copy(bytes((i + k) % 256 for k in range(max(n, 1))))
            for i, n in enumerate(sizes)]
    backs = [(ctypes.c_ubyte * max(n, 1))() for n in sizes]
    transfer.batch(1, [(ctypes.addressof(s), d, n) for s, d, n in zip(srcs, dsts, sizes)])
    transfer.batch(1, [(ctypes.addressof(b), d, n) for b, d, n in zip(backs, dsts, sizes)],
                   to_device=False)
    for s, b, n in zip(srcs, backs, sizes):
        assert bytes(b)[:n] == bytes(s)[:n]
    for d, n in zip(dsts, sizes):
        lib.gmlake_free(d, max(n, 1), 1, None)
