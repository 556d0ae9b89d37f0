"""Runs a program with glake as PyTorch's CUDA allocator, without changing its code:

    python -m glake.run train.py --lr 3e-4
    python -m glake.run -m torch.distributed.run --nproc-per-node 2 train.py

Every Python process the program starts (torchrun's workers, DataLoader workers) gets glake
too: GLAKE_ENABLE=1 and glake's start-up hook travel in the environment. Settings come from
the environment (GLAKE_*, GMLake's names, GLAKE_NATIVE).
"""

import os
import runpy
import site
import sys

USAGE = "usage: python -m glake.run (SCRIPT | -m MODULE) [ARGS...]"


def _prepare_environment():
    here = os.path.dirname(os.path.abspath(__file__))
    entries = [os.path.join(here, "_boot")]
    # A source checkout must be findable by the children too; an installed package already is
    # (its site-packages must not go before the standard library on PYTHONPATH).
    package_root = os.path.dirname(here)
    installed = {os.path.realpath(p) for p in site.getsitepackages() + [site.getusersitepackages()]}
    if os.path.realpath(package_root) not in installed:
        entries.append(package_root)
    os.environ["GLAKE_ENABLE"] = "1"
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for entry in reversed(entries):
        if entry not in parts:
            parts.insert(0, entry)
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 2
    _prepare_environment()
    from glake import autoload

    autoload.install()
    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        sys.argv = [argv[1]] + argv[2:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        # As `python script.py`: the script's folder, not the current one, is first on the path.
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
