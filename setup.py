"""ProTrain: automatic memory management for DeepSpeed and Megatron.

Install for development with ``pip install -e ".[test]"`` (pin ``torch==2.13.0`` on CPU-only
machines so pip takes the CPU wheel instead of the CUDA build).
"""
from setuptools import find_packages, setup

setup(
    name="protrain",
    version="0.1.0",
    description="Automatic memory management (profiler, cost model, search, runtime) for "
    "DeepSpeed and Megatron training",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["protrain", "protrain.*", "protrain_ds", "protrain_ds.*",
                                    "protrain_megatron", "protrain_megatron.*"]),
    install_requires=[
        # The planner core needs only numpy; torch is needed to profile and to train.
        "numpy>=1.24",
        "torch>=2.4",
        "tqdm>=4.60",
        # Pinned: the adapters override private methods of these exact versions
        # (tests/test_contract_*.py fail loudly when they move).
        "deepspeed==0.19.8",
        "megatron-core==0.16.1",
    ],
    extras_require={
        "test": ["pytest>=7", "transformers>=4.40", "accelerate>=0.30"],
        "gds": ["kvikio-cu13==26.10.0"],
    },
    entry_points={"console_scripts": ["protrain=protrain.cli:main"]},
)
