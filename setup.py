"""Install eagle-llm; builds the native CPU kernels (``eagle._kernels``) from ``eagle/csrc`` when it can.

The kernels are a torch C++ extension compiled with the system compiler against the installed torch, so install
with ``pip install --no-build-isolation ...`` (torch must be importable while building). When they cannot be built
(no compiler, no torch at build time, a build error), the install still succeeds with a warning and eagle runs its
float32 path instead (``eagle.kernels.unavailable_reason()`` says why).

``EAGLE_SANITIZE=1`` builds the kernels with AddressSanitizer and UBSan (``-fsanitize=address,undefined -g``); a
Python process then needs ``LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so.6)"
ASAN_OPTIONS=detect_leaks=0`` (libstdc++ preloaded too: without it ASan's interceptor of C++ exceptions finds no
``__cxa_throw`` and aborts at the first exception torch raises).
"""

import glob
import os
import sys

from setuptools import find_packages, setup


def _requirements(path: str) -> list[str]:
    with open(path) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


requirements = _requirements("requirements.txt")

KERNEL_SOURCES = sorted(glob.glob(os.path.join("eagle", "csrc", "*.cpp")))


def _warn(message: str) -> None:
    print(f"WARNING: {message}", file=sys.stderr)


def _kernel_extensions() -> tuple[list, dict]:
    """The extension and its build_ext command, or none where torch cannot be imported at build time."""
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as err:  # noqa: BLE001 - any failure to import torch means: no kernels, plain install
        _warn(f"torch is not importable while building ({err}); eagle's native CPU kernels are not built "
              "(install torch first and use pip install --no-build-isolation to build them)")
        return [], {}
    compile_args = ["-O3", "-std=c++17", "-ffp-contract=off", "-fopenmp", "-fno-math-errno"]
    link_args = ["-fopenmp"]
    if os.environ.get("EAGLE_SANITIZE") == "1":  # -O1: sanitizer builds of the unrolled kernels compile for ages at -O3
        compile_args += ["-O1", "-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"]
        link_args += ["-fsanitize=address,undefined"]
    extension = CppExtension("eagle._kernels", KERNEL_SOURCES, extra_compile_args=compile_args,
                             extra_link_args=link_args)

    class OptionalBuildExt(BuildExtension):
        """Builds the kernels, or warns and goes on when they cannot be built."""

        def run(self):
            try:
                super().run()
            except Exception as err:  # noqa: BLE001 - a failed kernel build must not fail the install
                _warn(f"eagle's native CPU kernels were not built ({err}); eagle runs its float32 path instead")

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as err:  # noqa: BLE001
                _warn(f"building {ext.name} failed ({err}); eagle runs its float32 path instead")

    return [extension], {"build_ext": OptionalBuildExt}


ext_modules, cmdclass = _kernel_extensions() if KERNEL_SOURCES else ([], {})

setup(
    name="eagle-llm",
    version="3.0.0",
    description="Lossless speculative decoding with EAGLE draft heads (EAGLE-1, EAGLE-2, EAGLE-3)",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["eagle", "eagle.*"]),
    package_data={"eagle": ["default_head/*.json", "default_head/*.safetensors", "traineagle3/*.json",
                            "evaluation/data/*.jsonl"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=requirements,
    extras_require={"scale": _requirements("requirements-scale.txt")},  # the scale benchmark's conversion step
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["eagle=eagle.__main__:main"]},
)
