"""`python -m glake.native`: builds glake's native PyTorch allocator for the installed torch
(into the cache enable() uses) and prints its path, or why it cannot be built."""

import sys

from glake import _library
from glake.native import Unavailable, build

try:
    print(build(_library.path(), quiet=False))
except Unavailable as err:
    print(f"glake: {err}", file=sys.stderr)
    sys.exit(1)
