"""Builds libgmlake.so with cargo and ships it inside the glake package, with the sources of
the native PyTorch allocator (built on the user's machine, see glake/native) and the start-up
hook that GLAKE_ENABLE=1 uses.

The library is a plain C ABI shared object, not a Python extension: the wheel is tagged
py3-none-<platform> and serves every Python 3 version. CARGO_TARGET_DIR is honoured.
"""
import os
import pathlib
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70
    from wheel.bdist_wheel import bdist_wheel

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
LIBRARY = "libgmlake.so"
AUTOLOAD = "glake-autoload.pth"


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        subprocess.run(
            ["cargo", "build", "--release", "--locked", "-p", "gmlake"],
            cwd=REPO,
            check=True,
        )
        target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
        build_lib = pathlib.Path(self.build_lib)
        destination = build_lib / "glake" / LIBRARY
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(target / "release" / LIBRARY, destination)
        # glake.h for building the native PyTorch allocator on the user's machine.
        (build_lib / "glake" / "native").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / "include" / "glake.h", build_lib / "glake" / "native" / "glake.h")
        # Enables glake at start-up in processes run with GLAKE_ENABLE=1 (see glake.autoload).
        (build_lib / AUTOLOAD).write_text(
            'import os; os.environ.get("GLAKE_ENABLE", "") not in ("", "0") '
            'and __import__("glake.autoload")\n'
        )


class PlatformWheel(bdist_wheel):
    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


setup(
    cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": PlatformWheel},
    distclass=BinaryDistribution,
    zip_safe=False,
)
