"""GPU tests of glake.torch: glake becomes PyTorch's allocator once, before CUDA starts, for
the whole session (as in a real program). Tests that need a fresh process run a script."""
import os
import pathlib
import subprocess
import sys

import pytest

PYTHON_DIR = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(PYTHON_DIR))

import glake.torch  # noqa: E402

glake.torch.enable()

import torch  # noqa: E402


def run_script(code, *args, nproc=None, timeout=300, launcher=False, glake_off=False, env=None):
    """Runs `code` in a new interpreter (with this package importable); returns its output,
    failing the test on a nonzero exit. `nproc`: under torchrun with that many workers;
    `launcher`: through `python -m glake.run`; `glake_off`: with no GLAKE_ENABLE; `env`:
    variables set for it."""
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PYTHON_DIR), env.get("PYTHONPATH")]))
    if glake_off:
        env.pop("GLAKE_ENABLE", None)
    script = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"glake_test_{os.getpid()}.py"
    script.write_text(code)
    command = [sys.executable] + (["-m", "glake.run"] if launcher else [])
    if nproc:
        command += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                    "--master_port=29533"]
    command += [str(script), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


@pytest.fixture
def gpu_count():
    return torch.cuda.device_count()
