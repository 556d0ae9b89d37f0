"""Put on PYTHONPATH by `python -m glake.run` so that every Python process it starts (torchrun
workers included) enables glake; then runs any other sitecustomize the environment has."""

import importlib.util
import os
import sys

try:
    import glake.autoload  # noqa: F401 - enables glake when torch is imported
except Exception as err:  # noqa: BLE001 - start-up must go on
    print(f"glake: start-up hook failed: {err}", file=sys.stderr)

_here = os.path.realpath(os.path.dirname(__file__))
for _entry in sys.path:
    if os.path.realpath(_entry or ".") == _here:
        continue
    _path = os.path.join(_entry or ".", "sitecustomize.py")
    if os.path.isfile(_path):
        _spec = importlib.util.spec_from_file_location("_glake_next_sitecustomize", _path)
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
