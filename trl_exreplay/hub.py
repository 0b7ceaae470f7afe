"""Publishing to the Hugging Face Hub: a model card, the model's files and a saved experience pool.

Uploads go through one `HfApi.create_commit` each, so a repository never holds half an upload, and only an
allow-list of files leaves the output folder: checkpoints, optimizer states, pickles and the pool stay local.
"""

from __future__ import annotations

import fnmatch
import json
import os
import uuid
from collections.abc import Sequence

from trl import GRPOTrainer

from .pool_check import PoolFolder
from .pool_store import (
    FORMAT_VERSION,
    STATE_FILE,
    TASK_ROWS_DIR,
    TRAJECTORIES_DIR,
    TRAJECTORY_FEATURES,
    read_state,
    state_files,
)

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
CITATIONS["GRPO"] = GRPOTrainer._paper["citation"]

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


def _fenced(text: str, language: str = "") -> str:
    return f"```{language}\n{text.rstrip()}\n```"


def _citations() -> str:
    return "\n\n".join(f"{name}:\n\n{_fenced(entry, 'bibtex')}" for name, entry in CITATIONS.items())


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
        _fenced(
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
        _fenced("\n".join(f"{k}: {json.dumps(replay_config[k], default=str)}" for k in sorted(replay_config)), "yaml"),
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


def _write_atomic(path: str, text: str) -> None:
    # A crash mid-write must not leave a truncated README that a later push would publish.
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _commit(api, repo_id, repo_type, operations, *, private, revision, commit_message) -> str:
    api.create_repo(repo_id, private=private, repo_type=repo_type, exist_ok=True)
    if revision is not None:
        # create_commit does not create a missing branch.
        api.create_branch(repo_id, branch=revision, repo_type=repo_type, exist_ok=True)
    info = api.create_commit(
        repo_id, operations, commit_message=commit_message, repo_type=repo_type, revision=revision
    )
    return str(getattr(info, "commit_url", info))


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
    _write_atomic(os.path.join(output_dir, "README.md"), card)
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=os.path.join(output_dir, name)) for name in files
    ]
    return _commit(
        HfApi(token=token),
        repo_id,
        None,
        operations,
        private=private,
        revision=revision,
        commit_message=commit_message,
    )


def _pool_state(pool_dir: str) -> dict:
    """The validated state of the pool saved in `pool_dir`, after checking that every file it names is inside the
    folder and holds the bytes recorded at save (so that nothing else, such as a hard link to a file outside, is
    ever uploaded)."""
    if not os.path.isfile(os.path.join(pool_dir, STATE_FILE)):
        raise FileNotFoundError(
            f"{pool_dir} is not a saved experience pool (no {STATE_FILE}; write one with ExperiencePool.save)."
        )
    state = read_state(pool_dir)
    if state["format_version"] != FORMAT_VERSION:
        raise ValueError(
            f"{pool_dir} holds an experience pool of the older format_version {state['format_version']}, without "
            f"checksums; load it with ExperiencePool.load and save it to another folder (format_version "
            f"{FORMAT_VERSION}) to push it."
        )
    folder = PoolFolder(pool_dir)
    for name in state_files(state)[1:]:
        folder.verify(state, name)
    return state


def _state_bytes(state: dict) -> bytes:
    return json.dumps({k: v for k, v in state.items() if k != "verified"}).encode()


def _pool_card(repo_id: str, state: dict) -> str:
    from huggingface_hub import DatasetCard, DatasetCardData

    extra = {}
    configs = []
    # Lets `datasets.load_dataset(repo_id)` and the Hub viewer read the trajectories as a plain table. The files are
    # named, not globbed: shards of earlier pushes to the repository stay in it (commits only add files).
    for name, kind in (("default", TRAJECTORIES_DIR), (TASK_ROWS_DIR, TASK_ROWS_DIR)):
        if state["shards"][kind]:
            configs.append({"config_name": name, "data_files": [f"{kind}/{e['name']}" for e in state["shards"][kind]]})
    if configs:
        extra["configs"] = configs
    data = DatasetCardData(tags=["trl", "exreplay"], **extra)
    settings = state.get("settings", {})
    body = "\n".join(
        [
            f"# {repo_id.rstrip('/').split('/')[-1]}",
            "",
            "An experience pool saved by trl-exreplay's `ExReplayGRPOTrainer` "
            "(`ExperiencePool.save`): the successful trajectories of partly solved tasks that GRPO with experience "
            "replay (ExGRPO, AgentEvolver) replays, with each task's difficulty bucket and the skip set of fully "
            "solved tasks.",
            "",
            f"- trajectories: {state.get('num_trajectories', 0)}",
            f"- tasks: {state.get('num_tasks', 0)}",
            f"- tokenizer fingerprint: `{state.get('tokenizer_fingerprint')}`",
            *(f"- {k}: {json.dumps(v)}" for k, v in sorted(settings.items())),
            "",
            f"`{STATE_FILE}` holds the pool state and names its files; `{TRAJECTORIES_DIR}/` holds Arrow shards, one "
            "row per trajectory, with columns: " + ", ".join(f"`{c}`" for c in TRAJECTORY_FEATURES) + f"; "
            f"`{TASK_ROWS_DIR}/` the dataset row of each task (JSON), so a replayed task can be rolled out again. "
            f"`{STATE_FILE}` records every file's size and xxh3-64 checksum: `from_hub` verifies them all before it "
            "maps anything.",
            "",
            "## Usage",
            "",
            _fenced(
                "from trl_exreplay import ExperiencePool\n\n"
                f'pool = ExperiencePool.from_hub("{repo_id}", tokenizer=tokenizer)  # refuses another tokenizer\n\n'
                "# or, from a local copy:\n"
                "from huggingface_hub import snapshot_download\n\n"
                f'pool = ExperiencePool.load(snapshot_download("{repo_id}", repo_type="dataset"))\n\n'
                "# the trajectories as a plain table:\n"
                "import datasets\n\n"
                f'trajectories = datasets.load_dataset("{repo_id}", split="train")',
                "python",
            ),
            "",
        ]
    )
    return str(DatasetCard(f"---\n{data.to_yaml()}\n---\n\n{body}"))


def push_pool(
    pool_dir: str,
    repo_id: str,
    *,
    card: str | None = None,
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str = "Upload experience pool from trl-exreplay",
) -> str:
    """Upload the pool saved in folder `pool_dir` (`ExperiencePool.save`) to a dataset repository, in one commit.

    Uploaded: the committed snapshot's files with their layout, so `ExperiencePool.from_hub(repo_id)` (or
    ``ExperiencePool.load(snapshot_download(repo_id, repo_type="dataset"))``) reads the pool back, and a
    ``README.md`` (`card`, or a default dataset card whose configs let ``datasets.load_dataset(repo_id)`` read the
    trajectories). When the snapshot's shards still hold evicted rows, the folder is first compacted in place (a new
    snapshot of the same pool), so that table holds exactly the pool's trajectories. Returns the commit URL. Raises
    when `pool_dir` is not a complete saved pool.
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    pool_dir = os.path.abspath(pool_dir)
    state = _pool_state(pool_dir)
    if any(e["live"] < e["rows"] for es in state["shards"].values() for e in es):
        from .pool import ExperiencePool

        with ExperiencePool.load(pool_dir) as pool:
            pool.compact()
            pool.save(pool_dir, save_total_limit=state.get("save_total_limit", 1))
        state = _pool_state(pool_dir)
    # state.json as the bytes just validated (not re-read: it cannot change between the check and the upload)
    operations = [CommitOperationAdd(path_in_repo=STATE_FILE, path_or_fileobj=_state_bytes(state))]
    operations += [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=os.path.join(pool_dir, name))
        for name in state_files(state)[1:]
    ]
    text = card if card is not None else _pool_card(repo_id, state)
    operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=text.encode("utf-8")))
    return _commit(
        HfApi(token=token),
        repo_id,
        "dataset",
        operations,
        private=private,
        revision=revision,
        commit_message=commit_message,
    )
