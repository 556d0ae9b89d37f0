"""bench/swap_bench.py without torch or a GPU: its process plan (after a cap that ran out of
memory, the method's remaining caps run in a fresh process), its logs and its table."""
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


def test_the_table_shows_the_prediction_and_the_search_measurement_beside_the_median():
    gib = 2**30
    base = {"model": "moe", "oom": False, "tokens_per_s": 1000.0, "peak_reserved": 8 * gib,
            "peak_allocated": 7 * gib}
    rows = [dict(base, method="unconstrained", cap=None, step_ms=100.0),
            dict(base, method="glake", cap=0.6, limit=9 * gib, step_ms=200.0,
                 tokens_per_s=500.0, step_times_ms=[190.0, 200.0, 260.0],
                 predicted_step_ms=210.0, searched_step_ms=230.0, predicted_peak=7.5 * gib),
            dict(base, method="checkpoint", cap=0.6, limit=9 * gib, step_ms=250.0,
                 tokens_per_s=400.0, step_times_ms=[250.0])]
    table = swap_bench.markdown(rows)
    glake = next(line for line in table.splitlines() if "| glake |" in line)
    assert "| 210 / 230 (200; 190-260) | 7.5 |" in glake and "| 0.50 |" in glake
    # Without a planner (checkpointing), no prediction cell.
    checkpoint = next(line for line in table.splitlines() if "| checkpoint |" in line)
    assert "| 0.40 |" in checkpoint and "/" not in checkpoint.split("|")[7]


def test_the_table_names_the_preference_smartswaps_default_chose():
    gib = 2**30
    base = {"model": "moe", "oom": False, "tokens_per_s": 1000.0, "peak_reserved": 8 * gib,
            "peak_allocated": 7 * gib, "step_ms": 100.0}
    rows = [dict(base, method="unconstrained", cap=None),
            dict(base, method="glake", cap=0.8, limit=9 * gib, preference="performance"),
            dict(base, method="glake", cap=0.5, limit=5 * gib, preference="memory", oom=True),
            dict(base, method="glake-stepbwd", cap=0.5, limit=5 * gib),
            dict(base, method="glake-enable", cap=0.5, limit=5 * gib, preference="memory")]
    lines = swap_bench.markdown(rows).splitlines()
    assert any("| 80% (9.0 GiB) | glake (performance) | 1000 |" in line for line in lines)
    assert any("| 50% (5.0 GiB) | glake (memory) | OOM |" in line for line in lines)
    assert any("| 50% (5.0 GiB) | glake-enable (memory) | 1000 |" in line for line in lines)
    # A method that sets the preference itself (no preference in its row) is named as given.
    assert any("| 50% (5.0 GiB) | glake-stepbwd | 1000 |" in line for line in lines)


def test_the_reference_run_again_after_the_methods_shows_the_drift_and_stays_out_of_ratios():
    gib = 2**30
    base = {"model": "moe", "oom": False, "peak_reserved": 8 * gib, "peak_allocated": 7 * gib,
            "cap": None, "method": "unconstrained"}
    rows = [dict(base, step_ms=100.0, tokens_per_s=1000.0),
            dict(base, method="glake", cap=0.6, limit=9 * gib, step_ms=200.0,
                 tokens_per_s=500.0),
            dict(base, step_ms=120.0, tokens_per_s=833.0, again=True)]
    table = swap_bench.markdown(rows)
    assert "100 ms per step" in table and "run again after the methods: 120 ms (+20%)" in table
    glake = next(line for line in table.splitlines() if "| glake |" in line)
    assert "| 0.50 |" in glake  # against the first reference run, not the one after


def test_a_later_process_of_the_same_method_adds_to_the_log_this_run_started(
        monkeypatch, tmp_path):
    said = iter(["first process\n", "second process\n"])
    monkeypatch.setattr(swap_bench.subprocess, "run", lambda *a, **k: SimpleNamespace(
        stdout="", stderr=next(said), returncode=0))
    monkeypatch.setattr(swap_bench, "_LOGS_STARTED", set())
    log = tmp_path / "moe-unconstrained.log"
    log.write_text("from an earlier run\n")
    args = SimpleNamespace(caps="0.6", steps=1, loss_steps=0, trace_dir=None, logs=tmp_path,
                           alloc_trace_dir=None, lengths="1")
    for _ in range(2):  # the reference, then the reference again after the methods
        swap_bench.spawn_once("unconstrained", "moe", args, 0, args.caps)
    assert log.read_text() == "first process\nsecond process\n"


def test_every_smartswap_method_that_checked_its_losses_is_reported():
    same, other = [1.0, 0.5], [1.0, 0.25]
    rows = [{"model": "moe", "method": "unconstrained", "losses": same},
            {"model": "moe", "method": "glake", "losses_unplanned": same,
             "losses_unplanned_again": same, "losses": same},
            {"model": "moe", "method": "glake-enable", "losses_unplanned": same,
             "losses_unplanned_again": same, "losses": other}]
    text = "\n".join(swap_bench.loss_lines(rows))
    assert ("under glake at 60% against the unplanned step on glake's allocator: identical"
            in text)
    assert ("under glake-enable at 60% against unconstrained on PyTorch's allocator: "
            "DIFFERENT from step 1 (0.25 against 0.5)") in text
    assert text.count("run twice: identical") == 2


def test_sequence_lengths_take_turns_as_fractions_of_the_models_and_bad_ones_are_refused():
    assert swap_bench.sequence_lengths(2048, "1") == [2048]
    assert swap_bench.sequence_lengths(2048, "1,0.75,0.5") == [2048, 1536, 1024]
    assert swap_bench.sequence_lengths(64, "0.01") == [16]
    for bad in ("0", "1.5", "a", ""):
        try:
            swap_bench.sequence_lengths(2048, bad)
        except SystemExit as e:
            assert "--lengths" in str(e)
        else:
            raise AssertionError(bad)


def test_the_table_says_when_sequence_lengths_take_turns():
    gib = 2**30
    ref = {"model": "moe", "oom": False, "peak_reserved": 8 * gib, "peak_allocated": 7 * gib,
           "cap": None, "method": "unconstrained", "step_ms": 90.0, "tokens_per_s": 1000.0,
           "lengths": [1024, 512]}
    assert "(sequence lengths 1024, 512 taking turns" in swap_bench.markdown([ref])
