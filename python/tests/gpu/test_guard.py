"""Guard-page mode under PyTorch (GLAKE_GUARD=1, in a child process): in-bounds work runs as
usual, and a kernel writing past the end of a tensor fails at once with CUDA's illegal-address
error instead of corrupting its neighbour."""
from conftest import run_script

OVERRUN = """
import sys, torch
x = torch.zeros(1000, dtype=torch.uint8, device="cuda")
y = torch.ones(4096, dtype=torch.float32, device="cuda")
assert int(x.sum()) == 0 and float(y.sum()) == 4096.0  # in bounds: fine
print("in bounds: fine", flush=True)
if sys.argv[1] == "overrun":
    # A view PyTorch cannot bounds-check: the raw address, 4096 bytes long (3096 past the end).
    class Raw:
        __cuda_array_interface__ = {
            "data": (x.data_ptr(), False), "shape": (4096,), "typestr": "|u1", "version": 3
        }
    torch.as_tensor(Raw(), device="cuda").fill_(1)
try:
    torch.cuda.synchronize()
    print("no fault", flush=True)
except RuntimeError as err:
    print("fault:", err, flush=True)
"""


def test_an_overrun_kernel_faults_at_once():
    ok = run_script(OVERRUN, "nothing", launcher=True, env={"GLAKE_GUARD": "1"})
    assert "in bounds: fine" in ok and "no fault" in ok, ok
    # A sticky CUDA error may also end the process on its way out: only its output counts.
    import subprocess

    try:
        out = run_script(OVERRUN, "overrun", launcher=True, env={"GLAKE_GUARD": "1"})
    except AssertionError as failed:  # a nonzero exit: its output is in the message
        out = str(failed)
    except subprocess.TimeoutExpired as failed:
        raise AssertionError("the overrun hung") from failed
    assert "illegal memory access" in out or "illegal address" in out, out
