"""ProTrain: automatic memory management for DeepSpeed and Megatron.

Install for development with ``pip install -e ".[deepspeed,megatron,test]"``; the README says
how to get torch's CPU build on a machine without CUDA.
"""
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

# The start-up hook: one line that registers a post-import hook wrapping
# deepspeed.initialize (protrain/_autoload.py). It has to land in site-packages itself.
PTH = "protrain-autoload.pth"


class BuildPyWithPth(build_py):
    """Regular installs: put the .pth at the root of the wheel (site-packages), and the native
    sources (csrc/, compiled on first use by protrain/native.py) into the package."""

    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH))
        self.copy_tree("csrc", os.path.join(self.build_lib, "protrain", "csrc"))


class EditableWheelWithPth(editable_wheel):
    """Editable installs (pip install -e .): the same .pth, added to the editable wheel."""

    def _install_namespaces(self, installation_dir, pth_prefix):
        super()._install_namespaces(installation_dir, pth_prefix)
        shutil.copy(PTH, os.path.join(installation_dir, PTH))


setup(
    name="protrain",
    version="0.1.0",
    description="Automatic memory management (profiler, cost model, search, runtime) for "
    "DeepSpeed and Megatron training",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # The floor the extras share (matplotlib and the test stack need 3.11); CI's floors job
    # runs it (.ci/compat floors, docs/compatibility.md).
    python_requires=">=3.11",
    packages=find_packages(include=["protrain", "protrain.*", "protrain_ds", "protrain_ds.*",
                                    "protrain_megatron", "protrain_megatron.*"]),
    # Every lower bound here is installed and tested by .ci/compat floors; the newest releases
    # by .ci/compat newest (docs/compatibility.md says which versions ran).
    install_requires=[
        # The planner core needs only numpy; torch is needed to profile and to train.
        "numpy>=1.26",
        "torch>=2.13",
        "tqdm>=4.60",
    ],
    extras_require={
        # The adapters override private parts of these (protrain_ds/contract.py checks them at
        # initialize, tests/test_ds_contract.py in CI; tests/test_megatron*.py for Megatron).
        "deepspeed": ["deepspeed>=0.19.8,<0.20"],
        "megatron": ["megatron-core>=0.16.1,<0.20"],
        # peft: the PEFT LoRA case of the Hugging Face matrix (tests/test_hf_matrix.py)
        "test": ["pytest>=8", "transformers>=5.3", "accelerate>=1.3",
                 "matplotlib>=3.8", "peft>=0.21"],
        # the deselected runs (`pytest -m matrix`): TRL's DPOTrainer (tests/test_trl.py)
        "matrix": ["trl==1.16.0"],
        # `protrain explain PLAN.json --plot out.png`: the timeline drawn
        "plot": ["matplotlib>=3.8"],
        "gds": ["kvikio-cu13==26.10.0"],
    },
    entry_points={"console_scripts": ["protrain=protrain.cli:main"]},
    cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth},
)
