"""Enables glake in processes started with GLAKE_ENABLE=1, without code changes.

The installed package adds `glake-autoload.pth` to site-packages, and `python -m glake.run`
puts glake/_boot (a sitecustomize) on PYTHONPATH; both import this module at start-up when
GLAKE_ENABLE is set. It does not import torch itself: it waits for the program to import torch
and enables glake right after, before any CUDA work. Settings come from the environment
(GLAKE_*, GMLake's names, GLAKE_NATIVE).
"""

import importlib.abc
import importlib.util
import os
import sys


def wanted():
    return os.environ.get("GLAKE_ENABLE", "").strip().lower() not in ("", "0", "false", "no", "off")


def _enable():
    import glake.torch

    try:
        glake.torch.enable()
    except Exception as err:  # noqa: BLE001 - a start-up hook must not stop the program
        print(f"glake: GLAKE_ENABLE is set but enabling failed: {err}", file=sys.stderr)


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds `torch` through the other finders and enables glake once its module has run. It
    stays in place until torch actually runs: libraries probe with importlib.util.find_spec
    ("is torch available?") long before they import it."""

    def __init__(self):
        self._finding = False

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch" or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec("torch")
        finally:
            self._finding = False
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module
        finder = self

        def exec_module(module):
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
            run_module(module)
            _enable()

        spec.loader.exec_module = exec_module
        return spec


def install():
    """Arranges for glake to be enabled when torch is imported (now, if it already is)."""
    if not wanted():
        return
    if "torch" in sys.modules:
        _enable()
    elif not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())


install()
