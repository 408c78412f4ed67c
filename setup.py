"""Builds atom._C (csrc/, through CMakeLists.txt) where it can run.

The kernels are built only when the installed torch is a GPU build (CUDA or
ROCm) AND the matching compiler (nvcc or hipcc) exists; anywhere else the
install is pure Python and every op uses its torch reference. Everything else
about the package lives in pyproject.toml.

torch is not a build requirement (a bare `torch` would pull a multi-GB CUDA
build into pip's isolated build environment), so the torch that will import
atom is asked in a subprocess run with `-I`, which ignores the PYTHONPATH
through which pip hides the real site-packages during the build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent

_TORCH_PROBE = "import torch; print('hip' if torch.version.hip else 'cuda' if torch.version.cuda else 'cpu')"


def torch_backend() -> str | None:
    """'cuda', 'hip' or 'cpu' for the installed torch; None when there is none."""
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-c", _TORCH_PROBE], capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else None


def find_compiler(backend: str) -> str | None:
    name, home_vars, default_home = {
        "cuda": ("nvcc", ("CUDA_HOME", "CUDA_PATH"), "/usr/local/cuda"),
        "hip": ("hipcc", ("ROCM_PATH", "HIP_PATH"), "/opt/rocm"),
    }[backend]
    found = shutil.which(name)
    if found:
        return found
    for home in [os.environ.get(v) for v in home_vars] + [default_home]:
        if home and (Path(home) / "bin" / name).exists():
            return str(Path(home) / "bin" / name)
    return None


class CMakeBuild(build_ext):
    """Builds atom._C with CMake, or skips it (one line) where it could not run."""

    def run(self) -> None:
        backend = torch_backend()
        compiler = find_compiler(backend) if backend in ("cuda", "hip") else None
        if compiler is None:
            if backend is None:
                why = "torch is not installed"
            elif backend == "cpu":
                why = "torch is a CPU build"
            else:
                why = f"torch is a {backend} build but no {'nvcc' if backend == 'cuda' else 'hipcc'} was found"
            print(f"atom: skipping the atom._C kernels ({why}); ops use their torch references")
            self.extensions = []
            return
        self._backend, self._compiler = backend, compiler
        super().run()

    def build_extension(self, ext: Extension) -> None:
        cmake = shutil.which("cmake")
        if cmake is None:
            raise RuntimeError("building atom._C needs CMake >= 3.21: `pip install cmake` or apt-get install cmake")
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        args = [
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if self._backend == "hip":
            rocm = Path(self._compiler).resolve().parent.parent
            args += ["-DATOM_USE_HIP=ON", f"-DCMAKE_PREFIX_PATH={rocm}"]
            if (rocm / "llvm/bin/clang++").exists():
                args.append(f"-DCMAKE_HIP_COMPILER={rocm / 'llvm/bin/clang++'}")
        else:
            args.append(f"-DCMAKE_CUDA_COMPILER={self._compiler}")
        subprocess.run([cmake, "-S", str(ROOT), "-B", str(build_dir), *args], check=True)
        jobs = str(self.parallel or os.cpu_count() or 1)
        subprocess.run([cmake, "--build", str(build_dir), "-j", jobs], check=True)


setup(
    ext_modules=[Extension("atom._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
)
