import os
from importlib.util import module_from_spec, spec_from_file_location

from setuptools import find_packages, setup

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load_about() -> object:
    spec = spec_from_file_location("__about__", os.path.join(_HERE, "src", "lightning_fsdp", "__about__.py"))
    about = module_from_spec(spec)
    spec.loader.exec_module(about)
    return about


about = _load_about()
lightning_min, lightning_max = about._SUPPORTED_LIGHTNING
torch_min, torch_max = about._SUPPORTED_TORCH

with open(os.path.join(_HERE, "README.md"), encoding="utf-8") as fh:
    long_description = fh.read()

setup(
    name="lightning-fsdp",
    version=about.__version__,
    description=about.__docs__,
    long_description=long_description,
    long_description_content_type="text/markdown",
    author=about.__author__,
    license=about.__license__,
    python_requires=">=3.10",
    package_dir={"": "src"},
    packages=find_packages(where="src"),
    install_requires=[
        f"lightning>={lightning_min},<{lightning_max}",
        f"torch>={torch_min}",
        "safetensors>=0.4",
        "tqdm>=4.66",
        # `fabric run` (the launcher the multi-node guide starts with) imports click, which `lightning` does not install
        "click>=8.1",
        "typing-extensions>=4.4",
    ],
    extras_require={
        "test": [
            "pytest>=8.0",
            "pytest-timeout>=2.3",
            "pytest-xdist>=3.5",  # `make test` runs the suite in two processes
            "ruff>=0.17,<0.18",
            "psutil>=5.9",
            # 5.1 is the first release whose models, created on the meta device, tie their weights as on CPU.
            "transformers>=5.1,<6",
            # A real S3 API on loopback (moto's server) and its client, for the tests of remote checkpoints.
            "moto[server]>=5.0,<6",
            "s3fs>=2024.2",
            # The peft-wrapped model of the guide's example and tests (base model and adapter loaded on top).
            "peft>=0.21,<1",
        ],
        # Checkpoints in object storage: fsspec comes with lightning; s3fs reads `s3://` (gcsfs `gs://`, adlfs `az://`).
        "remote": ["fsspec>=2024.2", "s3fs>=2024.2"],
        "docs": ["sphinx>=7.2", "myst-parser>=2.0"],
    },
    entry_points={"console_scripts": ["lightning-fsdp=lightning_fsdp.cli:main"]},
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
