"""glake's native PyTorch allocator: glake_allocator.cpp compiled against the installed torch.

PyTorch's C++ allocator interface changes between releases, so the allocator is built for the
torch in use: on first enable (or `python -m glake.native`), with the C++ compiler and the CUDA
headers of this machine, and cached under $GLAKE_CACHE (default ~/.cache/glake) keyed by the
torch build, the sources and the libgmlake.so it links to. Several processes starting at once
(torchrun) build it once: the build holds a file lock and publishes the result atomically.
"""

import ctypes
import fcntl
import glob
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
SOURCE = HERE / "glake_allocator.cpp"
ABI_HEADER = HERE / "gmlake_native.h"
# Headers of the allocator's own parts, included by SOURCE.
PARTS = (HERE / "own_allocator_pools.h",)
LIBRARY_NAME = "libglake_torch.so"


class Unavailable(RuntimeError):
    """The native allocator cannot be built or installed here; the message says why."""


def cache_dir():
    base = os.environ.get("GLAKE_CACHE")
    if not base:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                            "glake")
    return pathlib.Path(base) / "native"


def _glake_include(library):
    """The directory holding glake.h: next to this file in an installed package, else the
    include/ folder beside the library's build tree or bundle."""
    lib_dir = pathlib.Path(library).resolve().parent
    tries = [os.environ.get("GLAKE_INCLUDE"), HERE, lib_dir.parent / "include",
             lib_dir.parent.parent / "include", HERE.parent.parent.parent / "include"]
    for d in tries:
        if d and (pathlib.Path(d) / "glake.h").is_file():
            return pathlib.Path(d)
    raise Unavailable("glake.h not found (set GLAKE_INCLUDE to the folder holding it)")


def _cuda_includes(torch):
    """Include folders with the CUDA runtime's headers: the toolkit PyTorch's extension
    builder finds (CUDA_HOME, nvcc), else NVIDIA's pip packages."""
    found = []
    try:
        from torch.utils import cpp_extension

        home = cpp_extension.CUDA_HOME
        if home and os.path.isfile(os.path.join(home, "include", "cuda_runtime_api.h")):
            found.append(os.path.join(home, "include"))
    except Exception:  # noqa: BLE001 - any failure here only means "look elsewhere"
        pass
    site = sysconfig.get_paths()["purelib"]
    for d in sorted(glob.glob(os.path.join(site, "nvidia", "*", "include"))):
        if os.path.isfile(os.path.join(d, "cuda_runtime_api.h")) or os.path.isdir(
                os.path.join(d, "crt")):
            found.append(d)
    if not any(os.path.isfile(os.path.join(d, "cuda_runtime_api.h")) for d in found):
        raise Unavailable("the CUDA runtime headers were not found (install the CUDA toolkit "
                          "or set CUDA_HOME)")
    return found


def _loaded_libstdcxx():
    """The real path of the libstdc++ this process has loaded, or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libstdc++.so" in path:
                    return os.path.realpath(path)
    except OSError:
        pass
    return None


def _runtime_of(cxx):
    """The real path of the libstdc++ compiler `cxx` links against, or None."""
    try:
        out = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return os.path.realpath(out) if out and os.path.isabs(out) else None


def _compiler():
    """The C++ compiler: of $CXX, c++ and g++, the first whose libstdc++ is the one this
    process runs with (code built with another compiler's library headers can crash against
    it), else the first that exists."""
    candidates = []
    for name in (os.environ.get("CXX"), "c++", "g++"):
        path = shutil.which(name) if name else None
        if path and path not in candidates:
            candidates.append(path)
    if not candidates:
        raise Unavailable("no C++ compiler found (set CXX)")
    loaded = _loaded_libstdcxx()
    if loaded:
        for cxx in candidates:
            if _runtime_of(cxx) == loaded:
                return cxx
    return candidates[0]


def build_command(torch, library, output):
    """The compiler command that builds the allocator for `torch`, linked to `library`."""
    torch_dir = pathlib.Path(torch.__file__).resolve().parent
    includes = [torch_dir / "include", torch_dir / "include" / "torch" / "csrc" / "api" / "include",
                HERE, _glake_include(library)] + _cuda_includes(torch)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib_dir = torch_dir / "lib"
    library = str(pathlib.Path(library).resolve())
    # Default symbol visibility, as PyTorch's own extensions: with hidden visibility, library
    # templates (iostreams) get private copies built from this compiler's headers, which crash
    # against an older libstdc++ loaded by the process.
    cmd = [_compiler(), "-std=c++17", "-O2", "-fPIC", "-shared",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    cmd += [f"-I{d}" for d in includes]
    cmd += [str(SOURCE), "-o", str(output), f"-L{lib_dir}", "-lc10", "-lc10_cuda",
            "-ltorch_cuda", "-ltorch_cpu", library,
            f"-Wl,-rpath,{lib_dir}", f"-Wl,-rpath,{os.path.dirname(library)}"]
    return cmd


def _key(torch, command, library=None):
    """The cache key of a build: the torch build, the sources, the compiler command, and the
    libgmlake.so linked (glake.h's structs and the library itself: a rebuilt library with other
    struct layouts must not meet an allocator built for the old ones)."""
    h = hashlib.sha256()
    for part in (torch.__version__, str(torch.version.cuda), sys.platform, *command):
        h.update(part.encode())
    for f in (SOURCE, ABI_HEADER, *PARTS):
        h.update(f.read_bytes())
    if library is not None:
        h.update((_glake_include(library) / "glake.h").read_bytes())
        info = os.stat(library)
        h.update(f"{info.st_size}:{info.st_mtime_ns}".encode())
    return f"torch-{torch.__version__.replace('+', '_')}-{h.hexdigest()[:16]}"


def build(library, quiet=True):
    """Path of the allocator built for the installed torch and `library` (libgmlake.so),
    building it when the cache has none. Raises Unavailable with the reason."""
    import torch

    # No CUDA call here: the build needs no GPU, and initialising the driver this early would
    # break programs that fork later.
    if torch.version.cuda is None:
        raise Unavailable("this torch is built without CUDA")
    command = build_command(torch, library, "OUTPUT")
    folder = cache_dir() / _key(torch, command, library)
    target = folder / LIBRARY_NAME
    if target.is_file():
        return target
    try:
        return _build_into(folder, target, command, quiet)
    except OSError as err:  # a read-only cache, a compiler that cannot start
        raise Unavailable(f"building the native allocator failed: {err}") from err


def _build_into(folder, target, command, quiet):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():  # another process built it meanwhile
            return target
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so")
        os.close(fd)
        try:
            cmd = [tmp if part == "OUTPUT" else part for part in command]
            if not quiet:
                print(" ".join(cmd), file=sys.stderr)
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                (folder / "build.log").write_text(" ".join(cmd) + "\n" + done.stdout + done.stderr)
                tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
                raise Unavailable("building the native allocator failed (log: "
                                  f"{folder / 'build.log'}): " + " | ".join(tail))
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


_installed = {"path": None}


def install(library):
    """Builds (or takes from the cache) and installs the native allocator as PyTorch's CUDA
    allocator. Returns the path of the built library. Raises Unavailable."""
    path = build(library)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as err:  # built for another torch or library than the one loaded now
        raise Unavailable(f"loading the native allocator failed: {err}") from err
    lib.glake_native_install.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.glake_native_install.restype = ctypes.c_int
    error = ctypes.create_string_buffer(1024)
    if lib.glake_native_install(error, len(error)) != 0:
        raise Unavailable("installing the native allocator failed: "
                          + error.value.decode(errors="replace"))
    _installed["path"] = str(path)
    return str(path)


def installed_path():
    """The native allocator library in use, or None."""
    return _installed["path"]
