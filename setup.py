"""megatron-offload: optimizer-state and master-weight offloading for megatron-core."""

from setuptools import find_packages, setup

setup(
    name="megatron-offload",
    version="0.1.0",
    description=(
        "Offload megatron-core DistributedOptimizer states and fp32 master weights to host "
        "memory between optimizer steps."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_offload", "megatron_offload.*"]),
    # The oldest versions that ran (README, "Tested with"): Python 3.10 with torch 2.6.0 and
    # megatron-core 0.16.1 (the smoke set); torch 2.6.0 is also the oldest megatron-core allows.
    python_requires=">=3.10",
    # torch and megatron-core are the user's: any megatron-core from 0.16.1 on is supported.
    install_requires=["torch>=2.6", "megatron-core>=0.16.1"],
    extras_require={
        # The offloader's own CUDA streams (without it: torch's pooled streams, with a warning).
        "cuda": ["cuda-bindings"],
        "test": ["pytest", "pytest-timeout", "psutil", "coverage"],
    },
    license="Apache-2.0",
)
