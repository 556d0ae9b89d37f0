"""Enabling glake without code changes, and the native allocator's build step, without PyTorch
or a GPU. The children run a copy of the glake package whose glake.torch is a stand-in that
reports when enable() runs, next to a stand-in `torch` package."""
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

PYTHON_DIR = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PYTHON_DIR))

from glake import native  # noqa: E402

FAKE_TORCH = "LOADED = True\nprint('torch imported', flush=True)\n"
FAKE_GLAKE_TORCH = textwrap.dedent("""
    import sys
    def enable():
        torch = sys.modules.get("torch")
        print("enable called; torch loaded:", getattr(torch, "LOADED", False), flush=True)
""")


@pytest.fixture
def sandbox(tmp_path):
    """A folder with a stand-in torch, a copy of glake with a stand-in glake.torch, and a
    training script that imports torch and prints its arguments."""
    (tmp_path / "site" / "torch").mkdir(parents=True)
    (tmp_path / "site" / "torch" / "__init__.py").write_text(FAKE_TORCH)
    shutil.copytree(PYTHON_DIR / "glake", tmp_path / "site" / "glake",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    (tmp_path / "site" / "glake" / "torch.py").write_text(FAKE_GLAKE_TORCH)
    (tmp_path / "train.py").write_text(
        "import sys\nimport torch\nprint('args', sys.argv[1:], flush=True)\n")
    return tmp_path


def run(sandbox, argv, env_extra=None, boot=False):
    env = {k: v for k, v in os.environ.items() if k != "GLAKE_ENABLE"}
    env.update(env_extra or {})
    site = sandbox / "site"
    env["PYTHONPATH"] = os.pathsep.join(
        ([str(site / "glake" / "_boot")] if boot else []) + [str(site)])
    argv = [str(sandbox / "train.py") if a == "SCRIPT" else a for a in argv]
    done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True,
                          timeout=60, cwd=sandbox)
    return done.returncode, done.stdout + done.stderr


def test_launcher_enables_once_right_after_torch_imports(sandbox):
    code, out = run(sandbox, ["-m", "glake.run", "SCRIPT", "--lr", "3"])
    assert code == 0, out
    lines = out.splitlines()
    assert lines.index("torch imported") < lines.index("enable called; torch loaded: True")
    assert out.count("enable called") == 1
    assert "args ['--lr', '3']" in out


def test_launcher_runs_modules_and_children_inherit_glake(sandbox):
    # A module that starts a child Python, as torchrun starts its workers.
    (sandbox / "site" / "spawner.py").write_text(textwrap.dedent("""
        import subprocess, sys
        subprocess.run([sys.executable, sys.argv[1]], check=True)
    """))
    code, out = run(sandbox, ["-m", "glake.run", "-m", "spawner", "SCRIPT"])
    assert code == 0, out
    assert "enable called; torch loaded: True" in out


def test_glake_enable_with_the_boot_hook(sandbox):
    code, out = run(sandbox, ["SCRIPT"], {"GLAKE_ENABLE": "1"}, boot=True)
    assert code == 0, out
    assert "enable called; torch loaded: True" in out


def test_a_probe_for_torch_before_the_import_does_not_lose_the_hook(sandbox):
    # Libraries ask "is torch installed?" with find_spec long before they import it.
    (sandbox / "train.py").write_text(
        "import importlib.util\nassert importlib.util.find_spec('torch')\n"
        "print('probed', flush=True)\nimport torch\n")
    code, out = run(sandbox, ["SCRIPT"], {"GLAKE_ENABLE": "1"}, boot=True)
    assert code == 0, out
    assert out.count("enable called; torch loaded: True") == 1


def test_nothing_happens_without_glake_enable(sandbox):
    code, out = run(sandbox, ["SCRIPT"], boot=True)
    assert code == 0, out
    assert "torch imported" in out and "enable called" not in out


def test_launcher_without_a_program_prints_usage(sandbox):
    code, out = run(sandbox, ["-m", "glake.run"])
    assert code == 2 and "usage: python -m glake.run" in out


class FakeTorch:
    __version__ = "2.99.0+test"
    __file__ = "/nonexistent/torch/__init__.py"

    class version:
        cuda = "13.0"

    class _C:
        _GLIBCXX_USE_CXX11_ABI = True


def test_native_build_command_links_torch_and_libgmlake(tmp_path, monkeypatch):
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "glake.h").write_text("")
    lib = tmp_path / "lib" / "libgmlake.so"
    lib.parent.mkdir()
    lib.write_text("")
    monkeypatch.setenv("GLAKE_INCLUDE", str(tmp_path / "include"))
    monkeypatch.setattr(native, "_cuda_includes", lambda torch: ["/cuda/include"])
    cmd = native.build_command(FakeTorch, str(lib), tmp_path / "out.so")
    assert "-D_GLIBCXX_USE_CXX11_ABI=1" in cmd and "-ltorch_cuda" in cmd
    assert str(native.SOURCE) in cmd and str(lib.resolve()) in cmd
    assert f"-I{tmp_path / 'include'}" in cmd and "-I/cuda/include" in cmd
    assert f"-Wl,-rpath,{lib.parent.resolve()}" in cmd


def test_native_cache_key_follows_the_library(tmp_path, monkeypatch):
    (tmp_path / "glake.h").write_text("struct a;")
    monkeypatch.setenv("GLAKE_INCLUDE", str(tmp_path))
    lib = tmp_path / "libgmlake.so"
    lib.write_text("one")
    first = native._key(FakeTorch, ["c++"], str(lib))
    lib.write_text("rebuilt")
    assert native._key(FakeTorch, ["c++"], str(lib)) != first
    (tmp_path / "glake.h").write_text("struct b;")
    assert len({first, native._key(FakeTorch, ["c++"], str(lib))}) == 2


def test_a_cache_that_cannot_be_written_is_a_reason_not_a_crash(tmp_path, monkeypatch):
    (tmp_path / "glake.h").write_text("")
    monkeypatch.setenv("GLAKE_INCLUDE", str(tmp_path))
    lib = tmp_path / "libgmlake.so"
    lib.write_text("")
    blocker = tmp_path / "cache-is-a-file"
    blocker.write_text("")
    monkeypatch.setenv("GLAKE_CACHE", str(blocker))
    monkeypatch.setattr(native, "_cuda_includes", lambda torch: [])
    monkeypatch.setitem(sys.modules, "torch", FakeTorch)
    with pytest.raises(native.Unavailable, match="building the native allocator failed"):
        native.build(str(lib))


def test_native_cache_key_follows_torch_and_the_command():
    a = native._key(FakeTorch, ["c++", "-O2", "/lib/a/libgmlake.so"])
    b = native._key(FakeTorch, ["c++", "-O2", "/lib/b/libgmlake.so"])
    assert a != b and a.startswith("torch-2.99.0_test-")
    assert native._key(FakeTorch, ["c++", "-O2", "/lib/a/libgmlake.so"]) == a
