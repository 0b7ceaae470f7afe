"""Publishing a trained model to the Hugging Face Hub: its model card and its files (pools: `trl_exreplay.pool.hub`).

Uploads go through one `HfApi.create_commit` each, so a repository never holds half an upload, and only an
allow-list of files leaves the output folder: checkpoints, optimizer states, pickles and the pool stay local.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Sequence
from pathlib import Path

from .pool.hub import create_commit, fenced
from .pool.store import write_atomic
from .trl_seam import GRPO_CITATION

CITATIONS: dict[str, str] = {
    "ExGRPO": """@misc{zhan2025exgrpo,
  title         = {{ExGRPO: Learning to Reason from Experience}},
  author        = {Runzhe Zhan and Yafu Li and Zhi Wang and Xiaoye Qu and Dongrui Liu and Jing Shao and
                   Derek F. Wong and Yu Cheng},
  year          = {2025},
  eprint        = {2510.02245},
  archivePrefix = {arXiv},
  url           = {https://arxiv.org/abs/2510.02245}
}""",
    "AgentEvolver": """@misc{zhai2025agentevolver,
  title         = {{AgentEvolver: Towards Efficient Self-Evolving Agent System}},
  author        = {Yunpeng Zhai and Shuchang Tao and Cheng Chen and Anni Zou and Ziqian Chen and Qingxu Fu and
                   Shinji Mai and Li Yu and Jiaji Deng and Zouying Cao and Zhaoyang Liu and Bolin Ding and
                   Jingren Zhou},
  year          = {2025},
  eprint        = {2511.10395},
  archivePrefix = {arXiv},
  url           = {https://arxiv.org/abs/2511.10395}
}""",
    "ALFWorld": """@inproceedings{shridhar2021alfworld,
  title         = {{ALFWorld: Aligning Text and Embodied Environments for Interactive Learning}},
  author        = {Mohit Shridhar and Xingdi Yuan and Marc-Alexandre C{\\^o}t{\\'e} and Yonatan Bisk and
                   Adam Trischler and Matthew Hausknecht},
  booktitle     = {International Conference on Learning Representations (ICLR)},
  year          = {2021},
  eprint        = {2010.03768},
  archivePrefix = {arXiv},
  url           = {https://arxiv.org/abs/2010.03768}
}""",
}
# GRPO's citation as TRL writes it in its own model cards.
CITATIONS["GRPO"] = GRPO_CITATION

# An allow-list, not a deny-list: whatever else a run leaves in its output folder (checkpoints, the pool, logs,
# `training_args.bin` and other pickles) is never published by accident.
MODEL_FILE_PATTERNS: tuple[str, ...] = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "tokenizer.model",
    "adapter_config.json",  # a PEFT adapter's weights are `adapter_model.safetensors`
    "README.md",
)

_BASE_TAGS = ("trl", "grpo", "exreplay")


def _cell(value) -> str:
    return str(value).replace("|", "\\|")


def _percent(value) -> str:
    return "n/a" if value is None else f"{100 * float(value):.1f}%"


def _citations() -> str:
    return "\n\n".join(f"{name}:\n\n{fenced(entry, 'bibtex')}" for name, entry in CITATIONS.items())


def model_card(
    *,
    repo_id: str,
    base_model: str | None,
    environment: str,
    splits: dict[str, int],
    replay_config: dict,
    results: dict[str, dict[str, float]],
    versions: dict[str, str],
    tags: Sequence[str] = (),
) -> str:
    """The Markdown model card (YAML front matter and body) of a model trained with `ExReplayGRPOTrainer`.

    Args:
        repo_id: the Hub repository, ``"owner/name"``; its name is the card's title.
        base_model: the model training started from (front matter ``base_model``), or None.
        environment: what the model was trained on, e.g. ``"ALFWorld (text)"``.
        splits: split name -> number of tasks / games.
        replay_config: the experience-replay settings, printed sorted by key.
        results: split -> ``{"before": rate, "after": rate}``, success rates in [0, 1].
        versions: package -> version (trl, transformers, torch, ...).
        tags: extra Hub tags, added after ``trl``, ``grpo`` and ``exreplay`` (duplicates dropped).
    """
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(
        library_name="transformers",
        base_model=base_model,
        pipeline_tag="text-generation",
        tags=list(dict.fromkeys([*_BASE_TAGS, *tags])),
    )
    name = repo_id.rstrip("/").split("/")[-1]
    base = f" from [{base_model}](https://huggingface.co/{base_model})" if base_model else ""
    lines = [
        f"# {name}",
        "",
        f"This model was trained{base} with trl-exreplay's "
        "`ExReplayGRPOTrainer`: GRPO with experience replay (successful trajectories of partly solved tasks are "
        f"stored in a pool and replayed, following ExGRPO and AgentEvolver), on {environment}.",
        "",
        "## Usage",
        "",
        fenced(
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")',
            "python",
        ),
        "",
        "## Data",
        "",
        "| Split | Tasks |",
        "|---|---:|",
        *(f"| {_cell(split)} | {count} |" for split, count in splits.items()),
        "",
        "## Results",
        "",
        f"Success rate on {environment}, before and after training.",
        "",
        "| Split | before | after |",
        "|---|---:|---:|",
        *(
            f"| {_cell(split)} | {_percent(rates.get('before'))} | {_percent(rates.get('after'))} |"
            for split, rates in results.items()
        ),
        "",
        "## Replay configuration",
        "",
        # JSON scalars and lists are valid YAML, and unlike a YAML dumper json copes with tuples and None.
        fenced("\n".join(f"{k}: {json.dumps(replay_config[k], default=str)}" for k in sorted(replay_config)), "yaml"),
        "",
        "## Framework versions",
        "",
        *(f"- {package}: {version}" for package, version in versions.items()),
        "",
        "## Citations",
        "",
        _citations(),
        "",
    ]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))


def model_files(output_dir: str) -> list[str]:
    """The files of `output_dir` that belong on the Hub (top level only, matching `MODEL_FILE_PATTERNS`), sorted."""
    return sorted(
        name
        for name in os.listdir(output_dir)
        if not name.startswith(".")
        and os.path.isfile(os.path.join(output_dir, name))
        and any(fnmatch.fnmatchcase(name, pattern) for pattern in MODEL_FILE_PATTERNS)
    )


def push_model(
    output_dir: str,
    repo_id: str,
    card: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str = "Upload model trained with trl-exreplay",
) -> str:
    """Write `card` to ``output_dir/README.md`` and upload `model_files(output_dir)` in one commit.

    Creates the model repository if needed (``private`` applies only then) and, when `revision` is given, that
    branch. Returns the commit URL. Raises `FileNotFoundError` when `output_dir` holds no ``*.safetensors`` weights.
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    output_dir = os.path.abspath(output_dir)
    if not os.path.isdir(output_dir):
        raise FileNotFoundError(f"No model folder at {output_dir}.")
    files = sorted({*model_files(output_dir), "README.md"})
    if not any(name.endswith(".safetensors") for name in files):
        raise FileNotFoundError(
            f"No model weights in {output_dir}: expected *.safetensors at its top level (save_pretrained with "
            "safetensors; pickled *.bin weights are not uploaded)."
        )
    # A crash mid-write must not leave a truncated README that a later push would publish.
    write_atomic(os.path.join(output_dir, "README.md"), lambda tmp: Path(tmp).write_text(card, encoding="utf-8"))
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=os.path.join(output_dir, name)) for name in files
    ]
    return create_commit(
        HfApi(token=token),
        repo_id,
        None,
        operations,
        private=private,
        revision=revision,
        commit_message=commit_message,
    )
