"""bench/swap_bench.py's process plan, without torch or a GPU: after a cap that ran out of
memory, the method's remaining caps run in a fresh process."""
import importlib.util
import pathlib
from types import SimpleNamespace

_PATH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "swap_bench.py"
_SPEC = importlib.util.spec_from_file_location("swap_bench", _PATH)
swap_bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(swap_bench)


def run_with(monkeypatch, method, caps, oom_at=(), crash_at=()):
    """The rows spawn() gathers and the caps each child was given, children answering as a
    child does: a row per cap until one runs out of memory (then it stops if caps remain),
    none from the cap where it crashes on."""
    calls = []

    def child(method, name, args, reference_peak, given):
        calls.append(given)
        rows = []
        todo = given.split(",")
        for n, cap in enumerate(todo, 1):
            if cap in crash_at:
                break
            rows.append({"model": name, "method": method, "cap": float(cap),
                         "oom": cap in oom_at})
            if cap in oom_at and n < len(todo):
                break
        return rows + [{"model": name, "method": method, "losses": []}]
    monkeypatch.setattr(swap_bench, "spawn_once", child)
    args = SimpleNamespace(caps=",".join(caps))
    return swap_bench.spawn(method, "moe", args, 1), calls


def test_caps_after_an_out_of_memory_run_in_a_fresh_process(monkeypatch):
    caps = ["0.8", "0.7", "0.6", "0.5", "0.4"]
    rows, calls = run_with(monkeypatch, "glake", caps, oom_at={"0.6", "0.4"})
    assert calls == ["0.8,0.7,0.6,0.5,0.4", "0.5,0.4"]
    assert [r["cap"] for r in rows if "cap" in r] == [0.8, 0.7, 0.6, 0.5, 0.4]
    rows, calls = run_with(monkeypatch, "glake", caps)
    assert calls == [",".join(caps)] and len(rows) == 6


def test_a_child_that_gives_no_cap_row_is_not_started_again(monkeypatch):
    rows, calls = run_with(monkeypatch, "glake", ["0.8", "0.7"], crash_at={"0.8"})
    assert calls == ["0.8,0.7"] and [r for r in rows if "cap" in r] == []
