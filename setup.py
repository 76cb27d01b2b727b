"""megatron-grpo: GRPO for LLMs on megatron-core, with SGLang rollouts."""
from setuptools import find_packages, setup

setup(
    name="megatron-grpo",
    version="0.1.0",
    description="GRPO trainer on megatron-core (TP/PP/CP/DP) with SGLang rollouts",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_grpo", "megatron_grpo.*"]),
    install_requires=[
        # torch is not pinned here: clusters bring their own CUDA build; install it first.
        "torch>=2.6",
        "megatron-core>=0.16.1",
        "transformers>=4.51",
        "safetensors",
        "tokenizers",
        "sentencepiece",
        "pyyaml",
        "pyarrow",
        "psutil",  # megatron's dist_checkpointing writer hangs without it (undeclared upstream)
        "numpy",
        "tqdm",
        "math-verify>=0.7",
    ],
    extras_require={
        "dev": ["pytest>=8", "pytest-timeout", "pytest-xdist", "ruff", "matplotlib"],
        "gpu": ["transformer-engine[pytorch]"],
        "sglang": ["sglang", "sglang-router"],
        "mpi": ["mpi4py"],
        "logging": ["tensorboard", "wandb"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["megatron-grpo=megatron_grpo.cli:main"]},
)
