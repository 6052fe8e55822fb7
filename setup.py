"""Build lowdiff, fastio and recovery. Switches: LOWDIFF_DEBUG=1 (-O0 -g), LOWDIFF_SANITIZE=address."""
import os

from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup

compile_args = ["-O0", "-g"] if os.environ.get("LOWDIFF_DEBUG") == "1" else ["-O2"]
link_args = []
sanitizer = os.environ.get("LOWDIFF_SANITIZE")
if sanitizer:
    compile_args += [f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer"]
    link_args += [f"-fsanitize={sanitizer}"]

extensions = [
    Extension(
        "fastio._uring",
        sources=["fastio/_uring.pyx", "fastio/uring_core.c"],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    ),
    Extension(
        "fastio._memops",
        sources=["fastio/_memops.pyx", "fastio/crc32c_core.c", "fastio/crc32_core.c"],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    ),
    Extension(
        "lowdiff.distributed._nonzero",
        sources=["lowdiff/distributed/_nonzero.pyx", "lowdiff/distributed/nonzero_core.c"],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    ),
    Extension(
        "lowdiff.format._deltas",
        sources=["lowdiff/format/_deltas.pyx"],
        # -O3 lets gcc vectorize the delta loops, which -O2 leaves scalar.
        extra_compile_args=compile_args + ([] if "-O0" in compile_args else ["-O3"]),
        extra_link_args=link_args,
    ),
]

setup(
    name="lowdiff",
    version="0.1.0",
    description="Per-iteration checkpointing for PyTorch with exact resume",
    packages=find_packages(include=["lowdiff", "lowdiff.*", "fastio", "fastio.*", "recovery", "recovery.*"]),
    ext_modules=cythonize(extensions, language_level=3),
    # PEP 561: the packages carry their own types; the Cython modules' types are in .pyi stubs.
    package_data={"lowdiff": ["py.typed"], "lowdiff.format.schema": ["*.pyi"], "lowdiff.distributed": ["*.pyi"],
                  "recovery": ["py.typed"], "fastio": ["py.typed", "*.pyi"]},
    python_requires=">=3.10",
    # A range that torch 2.13 satisfies and no newer release does: an open range pulls a CUDA build.
    install_requires=["torch>=2.2,<2.14", "numpy", "zstandard>=0.20"],
    # Frameworks for lowdiff.integrations (their tests skip without them); none of them pulls a torch.
    # s3: an object-store shared tier (lowdiff.tiers.bucket); its tests run a moto server process.
    # matplotlib: experiments/plotting.py (its test draws real PNGs).
    extras_require={"test": ["pytest", "pytest-timeout", "hypothesis", "ruff>=0.17,<0.18", "mypy>=2.4,<2.5",
                             "moto[server]>=5.1", "boto3>=1.36", "matplotlib"],
                    "s3": ["boto3>=1.36"],
                    "integrations": ["transformers>=4.40", "accelerate>=0.26", "lightning>=2.2", "torchdata>=0.8"],
                    # torchtitan's models import triton even on a CPU-only torch (its expert-parallel kernels)
                    "titan": ["torchtitan==0.3.0", "triton"]},
)
