"""Sharing a pool on the Hugging Face Hub: one way to push (`push_pool`) and one to load (`pool_from_hub`).

A pool goes to a dataset repository as the files of its committed snapshot, in one commit, with a dataset card whose
configs let ``datasets.load_dataset(repo_id)`` read the trajectories as a plain table. Loading downloads the
repository and loads it as an untrusted folder (`ExperiencePool.load`, every checksum verified).
"""

from __future__ import annotations

import json
import os
import tempfile

from .check import PoolFolder
from .experience_pool import ExperiencePool
from .persistence import STATE_FILE, read_state, state_files
from .store import TRAJECTORY_FEATURES

__all__ = ["create_commit", "fenced", "pool_from_hub", "push_pool"]


def fenced(text: str, language: str = "") -> str:
    """`text` as a Markdown code block (the cards' usage and settings)."""
    return f"```{language}\n{text.rstrip()}\n```"


def create_commit(api, repo_id, repo_type, operations, *, private, revision, commit_message) -> str:
    """Create `repo_id` if needed (and the branch `revision`), then make `operations` its one new commit; returns the
    commit URL. One commit per upload: a repository never holds half of one."""
    api.create_repo(repo_id, private=private, repo_type=repo_type, exist_ok=True)
    if revision is not None:
        # create_commit does not create a missing branch.
        api.create_branch(repo_id, branch=revision, repo_type=repo_type, exist_ok=True)
    info = api.create_commit(
        repo_id, operations, commit_message=commit_message, repo_type=repo_type, revision=revision
    )
    return str(getattr(info, "commit_url", info))


def _pool_state(pool_dir: str) -> dict:
    """The validated state of the pool saved in `pool_dir`, after checking that every file it names is inside the
    folder and holds the bytes recorded at save (so that nothing else, such as a hard link to a file outside, is
    ever uploaded)."""
    if not os.path.isfile(os.path.join(pool_dir, STATE_FILE)):
        raise FileNotFoundError(
            f"{pool_dir} is not a saved experience pool (no {STATE_FILE}; write one with ExperiencePool.save)."
        )
    state = read_state(pool_dir)
    folder = PoolFolder(pool_dir)
    for entry in [state["tasks"], *state["shards"]]:
        folder.verify(entry)
    return state


def _pool_card(repo_id: str, state: dict) -> str:
    from huggingface_hub import DatasetCard, DatasetCardData

    # Lets `datasets.load_dataset(repo_id)` and the Hub viewer read the trajectories as a plain table. The files are
    # named, not globbed: shards of earlier pushes to the repository stay in it (commits only add files).
    files = [entry["name"] for entry in state["shards"]]
    configs = {"configs": [{"config_name": "default", "data_files": files}]} if files else {}
    data = DatasetCardData(tags=["trl", "exreplay"], **configs)
    usage = (
        "from trl_exreplay.pool import pool_from_hub\n\n"
        f'pool = pool_from_hub("{repo_id}", tokenizer=tokenizer)  # verifies every file; refuses another tokenizer\n\n'
        "import datasets  # or the trajectories as a plain table\n\n"
        f'trajectories = datasets.load_dataset("{repo_id}", split="train")'
    )
    body = [
        f"# {repo_id.rstrip('/').split('/')[-1]}",
        "",
        "An experience pool of trl-exreplay's `ExReplayGRPOTrainer`: successful trajectories of partly solved tasks "
        "that GRPO with experience replay (ExGRPO, AgentEvolver) replays, one row per trajectory (columns: "
        + ", ".join(f"`{c}`" for c in TRAJECTORY_FEATURES)
        + f"). `{STATE_FILE}` holds the pool's settings and counters and names its files with their xxh3-64 "
        "checksums; the `tasks-*.arrow` file holds each task's bucket and dataset row.",
        "",
        f"- trajectories: {sum(entry['live'] for entry in state['shards'])}",
        f"- tokenizer fingerprint: `{state['tokenizer_fingerprint']}`",
        *(f"- {k}: {json.dumps(v)}" for k, v in sorted(state["settings"].items())),
        "",
        "## Usage",
        "",
        fenced(usage, "python"),
        "",
    ]
    return str(DatasetCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body)))


def push_pool(
    pool: ExperiencePool | str,
    repo_id: str,
    *,
    card: str | None = None,
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str = "Upload experience pool from trl-exreplay",
) -> str:
    """Upload a pool to a dataset repository, in one commit; returns the commit URL. `pool` is an `ExperiencePool`
    (compacted and saved to a temporary folder on its own disk first: hard links, no trajectory copied), or the folder
    of one saved with `ExperiencePool.save` (a checkpoint's ``exreplay_pool``), refused unless complete and intact.

    Uploaded: the saved files, which `pool_from_hub(repo_id)` reads back, and a ``README.md`` (`card`, or a dataset
    card whose configs let ``datasets.load_dataset(repo_id)`` read the trajectories). A folder whose shards still hold
    evicted rows is first compacted in place (a new save of the same pool), so that table holds exactly the pool's.
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    if isinstance(pool, ExperiencePool):
        pool.compact()
        with tempfile.TemporaryDirectory(
            prefix="export-", dir=pool._scratch.folder(), ignore_cleanup_errors=True
        ) as export:
            pool.save(export)  # on the pool's own disk: hard links
            return push_pool(
                export,
                repo_id,
                card=card,
                private=private,
                token=token,
                revision=revision,
                commit_message=commit_message,
            )
    pool_dir = os.path.abspath(pool)
    state = _pool_state(pool_dir)
    if any(entry["live"] < entry["rows"] for entry in state["shards"]):
        with ExperiencePool.load(pool_dir) as loaded:
            loaded.compact()
            loaded.save(pool_dir)
        state = _pool_state(pool_dir)
    # state.json as the bytes just validated (not re-read: it cannot change between the check and the upload)
    operations = [CommitOperationAdd(path_in_repo=STATE_FILE, path_or_fileobj=json.dumps(state).encode())]
    operations += [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=os.path.join(pool_dir, name))
        for name in state_files(state)[1:]
    ]
    text = card if card is not None else _pool_card(repo_id, state)
    operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=text.encode("utf-8")))
    return create_commit(
        HfApi(token=token),
        repo_id,
        "dataset",
        operations,
        private=private,
        revision=revision,
        commit_message=commit_message,
    )


def pool_from_hub(
    repo_id: str,
    *,
    revision: str | None = None,
    token: str | None = None,
    tokenizer=None,
    vocab_size: int | None = None,
    allow_missing_fingerprint: bool = False,
    cache_dir: str | None = None,
    work_dir: str | None = None,
) -> ExperiencePool:
    """Download a pool pushed by `push_pool` and load it (`ExperiencePool.load`), always verifying every file's
    checksum.

    Given a `tokenizer`, a pool recorded with another one (or with none, unless `allow_missing_fingerprint`) is
    refused with a `ValueError`.
    """
    from huggingface_hub import HfApi

    folder = HfApi(token=token).snapshot_download(repo_id, repo_type="dataset", revision=revision, cache_dir=cache_dir)
    return ExperiencePool.load(
        folder,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        verify=True,
        allow_missing_fingerprint=allow_missing_fingerprint,
        work_dir=work_dir,
    )
