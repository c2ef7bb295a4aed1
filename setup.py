"""Builds the yatt._C extension (csrc/) with CMake + Ninja + pybind11; metadata: pyproject.toml.

    pip install --no-build-isolation -e .      # editable: yatt/_C*.so lands in the source tree

Environment: YATT_WITH_CUDA=0|1 overrides CUDA detection (default: on iff the installed torch
has CUDA); YATT_CUDA_ARCHS (e.g. "90") the CUDA targets (default: CMakeLists.txt's, 80 and 90);
YATT_BUILD_TYPE (default Release); CMAKE_BUILD_PARALLEL_LEVEL caps build jobs.
CMake keeps its build tree in build/cmake-<python tag>/, so rebuilds are incremental.
"""
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pybind11
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def find_tool(name: str) -> str:
    """`name` from this interpreter's scripts dir (the venv) first, then PATH."""
    search = os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
    exe = shutil.which(name, path=search)
    if exe is None:
        sys.exit(f"yatt build: `{name}` not found; pip install {name}")
    return exe


def with_cuda() -> bool:
    flag = os.environ.get("YATT_WITH_CUDA")
    if flag is not None:
        return flag.lower() in ("1", "on", "true", "yes")
    try:
        import torch
    except ImportError:
        return False
    return torch.version.cuda is not None


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = ROOT / "build" / f"cmake-{sys.implementation.cache_tag}"
        cmake = find_tool("cmake")
        subprocess.run([
            cmake, "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={find_tool('ninja')}",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('YATT_BUILD_TYPE', 'Release')}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DYATT_WITH_CUDA={'ON' if with_cuda() else 'OFF'}",
            *([f"-DCMAKE_CUDA_ARCHITECTURES={archs}"] if (archs := os.environ.get("YATT_CUDA_ARCHS")) else []),
        ], check=True)
        jobs = ["-j", str(self.parallel)] if self.parallel else []
        subprocess.run([cmake, "--build", str(build_dir), *jobs], check=True)


setup(ext_modules=[Extension("yatt._C", sources=[])], cmdclass={"build_ext": CMakeBuild})
