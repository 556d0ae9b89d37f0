"""GLake: GPU memory pooling with virtual-memory stitching.

PyTorch users need one line, before the first CUDA tensor:

    import glake.torch
    glake.torch.enable()

See glake.torch for configuration, statistics and snapshots.
"""

__version__ = "0.1.0"


def __getattr__(name):
    # `import glake; glake.torch.enable()` works without importing PyTorch at `import glake`.
    if name == "torch":
        import importlib

        return importlib.import_module("glake.torch")
    raise AttributeError(f"module 'glake' has no attribute {name!r}")
