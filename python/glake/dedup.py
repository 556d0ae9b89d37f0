"""Share read-only GPU memory between processes: replicas of a model on one GPU hold its
weights once.

    import glake.torch
    glake.torch.enable()
    model = load_model().cuda().eval()
    glake.torch.share_weights(model)     # after loading, before serving

Every process of the same user that calls share_weights() on the same GPU with the same bytes
ends up mapping one copy: the first offers its weights, later ones find equal memory by hash,
check it byte by byte and map it in place of their own, at the same addresses (tensors stay
valid). The memory becomes read-only: writing to a shared tensor afterwards is an illegal
memory access on the GPU. Only whole physical handles inside each tensor's storage are
shared (small tensors, and the ends of large ones, stay private). Needs glake as PyTorch's
allocator."""

import ctypes

from . import _library

_declared = False


def _lib():
    global _declared
    lib = _library.load()
    if not _declared:
        u64p = ctypes.POINTER(ctypes.c_uint64)
        lib.gmlake_share_read_only.argtypes = [u64p, u64p, ctypes.c_size_t, ctypes.c_int, u64p]
        lib.gmlake_share_read_only.restype = ctypes.c_int
        _declared = True
    return lib


def _storages(tensors):
    """Each distinct CUDA storage among `tensors` once, as (device, data_ptr, nbytes)."""
    seen = set()
    for t in tensors:
        if t is None or not t.is_cuda:
            continue
        storage = t.untyped_storage()
        key = (t.device.index, storage.data_ptr())
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        yield t.device.index, storage.data_ptr(), storage.nbytes()


def share_weights(module_or_tensors, synchronize=True, buffers=False):
    """Declares the CUDA parameters of `module_or_tensors` (a torch.nn.Module, or an iterable
    of tensors) read-only and shares them with other processes holding the same bytes on the
    same GPU. A module's buffers are left out unless `buffers` (they are often written: KV
    caches, running statistics; a write to shared memory is an illegal memory access). Returns a dict: shared_bytes (now mapped from another process,
    this process's own memory released), offered_bytes (offered to later processes),
    kept_bytes (left private). Waits for the GPU; call it when no kernel uses the weights."""
    import torch

    from . import torch as _glake_torch

    if not _glake_torch.is_enabled():
        raise RuntimeError("glake is not PyTorch's allocator: call glake.torch.enable() first "
                           "(or run with GLAKE_ENABLE=1)")
    if isinstance(module_or_tensors, torch.nn.Module):
        tensors = list(module_or_tensors.parameters())
        if buffers:
            tensors += list(module_or_tensors.buffers())
    else:
        tensors = list(module_or_tensors)
    if synchronize:
        torch.cuda.synchronize()
    by_device = {}
    for device, ptr, nbytes in _storages(tensors):
        by_device.setdefault(device, []).append((ptr, nbytes))
    total = {"shared_bytes": 0, "offered_bytes": 0, "kept_bytes": 0}
    out = (ctypes.c_uint64 * 3)()
    for device, ranges in by_device.items():
        ptrs = (ctypes.c_uint64 * len(ranges))(*(p for p, _ in ranges))
        sizes = (ctypes.c_uint64 * len(ranges))(*(n for _, n in ranges))
        _library.check(_lib().gmlake_share_read_only(ptrs, sizes, len(ranges), device, out),
                       f"share_weights on cuda:{device}")
        for key, value in zip(total, out):
            total[key] += value
    return total
