"""megalite: a Megatron-style pretraining monorepo that runs every layout on a CPU."""

from setuptools import find_packages, setup

setup(
    name="megalite",
    version="0.1.0",
    description="Megatron-Core's parallelism (TP/SP, PP, CP, EP, distributed optimizer) in "
                "readable PyTorch, tested on CPU",
    packages=find_packages(include=["megalite", "megalite.*"]),
    python_requires=">=3.10",
    install_requires=[
        # Pinned: any other version (or an unpinned range) pulls a multi-GB CUDA build.
        "torch==2.13.0",
        "numpy>=1.24",
        "sentencepiece>=0.2",
        "tokenizers>=0.20",
        "tiktoken>=0.7",  # TikTokenizer; reads local rank files only
        "safetensors>=0.4",
        "pyyaml>=6.0",
        "tqdm>=4.66",
        "xxhash>=3.0",  # the default checkpoint checksum (zlib's crc32 is the fallback)
    ],
    extras_require={
        "dev": [
            "pytest>=8",
            "pytest-xdist>=3.5",
            "transformers==5.23.0",  # the parity reference; pinned so the tests are stable
            "wandb>=0.18",
            "tensorboard>=2.16",
            "ruff>=0.6",
            "matplotlib>=3.7",  # tools/plot_run.py (make pretrain ends with its plot)
        ],
        "plot": ["matplotlib>=3.7"],
        # Never installed on the CPU machines; imported lazily when present.
        "gpu": ["flash-attn", "apex"],
    },
)
