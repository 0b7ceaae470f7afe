"""The run's experience pool over its whole life: `PoolKeeper` makes it (from the config, or adopts a given one,
bound to the tokenizer and the model's vocabulary), shares it between ranks (rank 0 holds the rows, the others the
index), saves it with every checkpoint and resumes it, with ExGRPO's start step (`ReplaySchedule`).

What changes each step (the plan, the splice, the outcomes) is `trl_exreplay.replay.ReplayController`, which reads
the pool through the keeper. The methods marked collective must be called by every rank at the same point.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import warnings
from collections.abc import Callable

from .distributed import from_main_process
from .pool import ExperiencePool, tokenizer_fingerprint
from .pool.check import SETTINGS as POOL_SETTINGS
from .pool.store import Scratch
from .schedule import ReplaySchedule
from .spread import ESTIMATES_FILE, SuccessEstimates

logger = logging.getLogger(__name__)

POOL_DIR = "exreplay_pool"
# The live pool's shards, under output_dir (same disk as the checkpoints, so saves hard-link instead of copying); the
# leading underscore keeps it out of `Trainer.push_to_hub` uploads.
POOL_WORK_DIR = "_exreplay_pool_work"


class PoolKeeper:
    """The run's pool (`pool`) and ExGRPO's start step (`schedule`), from construction to the last checkpoint.

    `settings`: the config's `ReplaySettings`; `reads_pool`: whether anything reads the pool's token ids (replay,
    or an optional part such as guided rollouts that start from the pool), so that it must be bound to this
    tokenizer. Collective: rank 0 makes the pool."""

    def __init__(
        self,
        settings,
        *,
        accelerator,
        num_generations: int,
        seed: int,
        output_dir: str,
        processing_class,
        model,
        experience_pool: ExperiencePool | None,
        reads_pool: bool,
    ):
        self.settings = settings
        self._accelerator = accelerator
        self._output_dir = output_dir
        self.schedule = ReplaySchedule()  # ExGRPO's start step, saved with checkpoints
        # replay_spread_plan's per-task estimates of fresh success, saved with checkpoints (the same on every rank)
        spreading = settings.enable_experience_replay and settings.replay_spread_plan
        self.estimates = SuccessEstimates(settings.replay_spread_half_life) if spreading else None
        # The pool's settings are the config's fields of the same names (replay_store_rbound=None: G), and the seed
        self._pool_settings = {name: getattr(settings, name) for name in POOL_SETTINGS if name != "seed"}
        if settings.replay_store_rbound is None:
            self._pool_settings["replay_store_rbound"] = num_generations
        self._pool_settings["seed"] = seed
        # The pool's token ids must be this tokenizer's wherever they are read: replay, and the experience of guided
        # rollouts when it starts from the pool.
        reads_pool = settings.enable_experience_replay or reads_pool
        self._tokenizer_fingerprint = tokenizer_fingerprint(processing_class) if reads_pool else None
        self._vocab_size = _vocab_size(model)

        def make() -> ExperiencePool:
            _remove_left_scratch(self._pool_work_dir(), keep=experience_pool)
            if experience_pool is not None:
                return self._adopt_pool(experience_pool, "the given experience_pool")
            pool = ExperiencePool(**self._pool_settings, work_dir=self._pool_work_dir())
            if self._vocab_size is not None:
                pool.set_vocab_size(self._vocab_size)
            if self._tokenizer_fingerprint is not None:
                pool.bind_tokenizer(self._tokenizer_fingerprint)
            return pool

        self._take_pool(make)

    def _take_pool(self, make: Callable[[], ExperiencePool]) -> None:
        """Rank 0 takes the pool `make()` returns and alone holds its rows, which it reads for every rank
        (`on_main`); the other ranks hold its index (`ExperiencePool.from_index_snapshot`), so that their plans and
        pools' decisions stay the same as rank 0's. One copy of the pool's files per run. Collective."""

        def take() -> dict | None:
            self.pool = make()
            return self.pool.index_snapshot() if self._accelerator.num_processes > 1 else None

        snapshot = self.on_main(take)
        if not self._accelerator.is_main_process:
            self.pool = ExperiencePool.from_index_snapshot(snapshot)

    def on_main(self, read: Callable):
        """`read()` on rank 0, its result sent to every rank. Collective."""
        return from_main_process(self._accelerator, read)

    def _pool_work_dir(self) -> str:
        """This run's folder for the live pool's files: only runs of this `output_dir` write there."""
        if self.settings.replay_scratch_dir is None:
            return os.path.join(self._output_dir, POOL_WORK_DIR)
        run = hashlib.sha1(os.path.abspath(self._output_dir).encode()).hexdigest()[:12]
        return os.path.join(self.settings.replay_scratch_dir, f"exreplay-run-{run}")

    def _adopt_pool(self, pool: ExperiencePool, source: str) -> ExperiencePool:
        """Use `pool` under this run's configuration (the config wins over the settings the pool was saved with).

        A pool recorded with another tokenizer is refused: its token ids would mean other tokens here; so is one
        holding trajectories but no tokenizer fingerprint, unless the caller bound it (`pool.bind_tokenizer`).
        Trajectories with token ids outside the model's vocabulary are removed and counted."""
        if self._tokenizer_fingerprint is not None:
            if pool.tokenizer_fingerprint is None and pool.num_trajectories:
                raise ValueError(
                    f"The experience pool from {source} holds {pool.num_trajectories} trajectories but records no "
                    "tokenizer fingerprint, so nothing says its token ids are this tokenizer's. If they are, bind it "
                    "first: pool.bind_tokenizer(trl_exreplay.pool.tokenizer_fingerprint(tokenizer))."
                )
            pool.bind_tokenizer(self._tokenizer_fingerprint, source)
        if self._vocab_size is not None and pool.vocab_size != self._vocab_size:
            pool.set_vocab_size(self._vocab_size)
        changed = pool.configure(**self._pool_settings)
        if changed:
            logger.warning("trl_exreplay: pool from %s had other settings for %s; using this run's.", source, changed)
        return pool

    def save(self, output_dir: str, should_save: bool) -> None:
        """Save the pool (and ExGRPO's start step) in `output_dir`. Call on every rank, the saving one with
        `should_save`."""
        if should_save:
            if self.pool.holds_rows:  # rank 0: with `save_on_each_node`, another machine's checkpoint has no pool
                self.pool.save(os.path.join(output_dir, POOL_DIR))
            if self.schedule != ReplaySchedule():
                self.schedule.save(output_dir)
            if self.estimates is not None:
                self.estimates.save(output_dir)

    def resume(self, checkpoint: str) -> None:
        """Take the pool saved in `checkpoint` (or, where there is none, say loudly that the run resumes empty) and
        ExGRPO's start step. Collective: rank 0 loads the pool (`_take_pool`)."""
        self.schedule = ReplaySchedule.load(checkpoint)  # the step replay started at, if it did
        if self.estimates is not None:  # rank 0 reads them, every rank takes the same (a checkpoint may be rank 0's)

            def read() -> dict:
                if not self.estimates.load(checkpoint):
                    logger.warning(
                        "trl_exreplay: the checkpoint %s holds no replay_spread_plan estimates (%s): the plan starts "
                        "again from the prior, as a new run's.",
                        checkpoint,
                        ESTIMATES_FILE,
                    )
                return self.estimates.columns()

            self.estimates.restore(self.on_main(read))
        path = os.path.join(checkpoint, POOL_DIR)

        def load() -> ExperiencePool:
            if os.path.lexists(path):
                pool = ExperiencePool.load(path, vocab_size=self._vocab_size, work_dir=self._pool_work_dir())
                return self._adopt_pool(pool, checkpoint)
            if not self.settings.replay_resume_without_pool:
                message = (
                    f"trl_exreplay: the checkpoint {checkpoint} holds no experience pool ({POOL_DIR}/): training "
                    "resumes with an EMPTY pool, so nothing is replayed until it fills again. If the pool was lost, "
                    "stop and restore it; to start empty on purpose, set replay_resume_without_pool=True."
                )
                logger.warning(message)
                warnings.warn(message, stacklevel=4)
            return self.pool

        self._take_pool(load)


def _remove_left_scratch(work_dir: str, keep: ExperiencePool | None) -> None:
    """Remove the live-pool folders an earlier run of this output_dir left in `work_dir` (a killed run leaves its
    shards, on whichever machine it ran), but for the one of `keep`, a pool given to this run."""
    if not os.path.isdir(work_dir):
        return
    kept = keep.scratch_folder() if keep is not None and keep.holds_rows else None
    for name in os.listdir(work_dir):
        path = os.path.join(work_dir, name)
        if name.startswith(Scratch.PREFIX) and path != kept and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            logger.info("trl_exreplay: removed %s, the live pool of an earlier run of this output_dir.", path)


def _vocab_size(model) -> int | None:
    """The number of token ids the model embeds (its config's, after any resize), None when it does not say."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    size = getattr(config, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None
