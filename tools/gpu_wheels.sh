#!/usr/bin/env bash
# Fill .whl/ (ignored: `echo /.whl/ >> .git/info/exclude`) with what a lent GPU machine lacks for tools/gpu_check.sh.
#
# The device image has Python 3.12, PyTorch (CUDA), accelerate 1.15, tokenizers, pyarrow, xxhash and pytest, and no
# network. This script fetches, here, the wheels of the versions this project is tested with (pyproject.toml) for
# CPython 3.12 on x86-64 Linux, and packs the three packages that PyPI serves only as source (deepspeed, and ALFWorld's
# fast-downward and jericho, whose compiled parts are ctypes libraries, not Python extensions) from this machine's
# installed copies. The list is the closure of `pip install .[deepspeed,alfworld]` minus the image's packages, less
# spaCy's stack (jericho imports it only for Z-machine games, which ALFWorld does not play). Total about 45 MiB: the
# device tool carries 64 MiB with the working tree.
#
#     bash tools/gpu_wheels.sh            # then: device run, carry [".whl"], command "bash tools/gpu_check.sh"
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PLATFORMS=(manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64)
WHEELS=(
    trl==1.16.0 transformers==5.23.0 huggingface_hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
    datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 peft==0.21.2 tokenizers==0.23.3 tzdata==2026.6
    hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    alfworld==0.4.2 textworld==1.7.0 tatsu==5.8.3 termcolor==3.3.0 mementos==1.3.1 prompt-toolkit==3.0.53
    wcwidth==0.9.4 more-itertools==11.2.1 hashids==1.3.1
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d .whl "${WHEELS[@]}"
# Source-only packages: this machine's installed copies (pure Python, or ctypes libraries for x86-64 Linux).
SITE=$(python -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('jericho').origin), end='')")
SITE=$(dirname "$SITE")
tar czf .whl/compiled_site.tgz -C "$SITE" --exclude=__pycache__ \
    deepspeed deepspeed-0.19.8.dist-info fast_downward fast_downward_textworld-20.6.4.dist-info \
    jericho jericho-3.3.1.dist-info
du -sh .whl
