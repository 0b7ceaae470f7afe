"""The trainer's experience pool: made from the config, bound to the tokenizer and the model's vocabulary, adopted
from a user or a checkpoint, and fed after each generation step with the tasks' outcomes and the successful
rollouts. A mixin of `ExReplayGRPOTrainer`; the checkpoint overrides themselves stay in `trainer.py`.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch
from accelerate.utils import gather_object

from .distributed import gather_row_flags
from .outcomes import PendingOutcomes, task_outcomes, trajectory_records
from .pool import ExperiencePool, tokenizer_fingerprint
from .pool.rules import is_solved
from .schedule import starts_replay
from .step import GenerationStep

logger = logging.getLogger(__name__)

POOL_DIR = "exreplay_pool"
# The live pool's shards, under output_dir (same disk as the checkpoints, so saves hard-link instead of copying); the
# leading underscore keeps it out of `Trainer.push_to_hub` uploads.
POOL_WORK_DIR = "_exreplay_pool_work"

# `ExperiencePool`'s settings keep the design documents' names (seeds 000-002); the config field each comes from.
_POOL_SETTING_FIELDS = {
    "max_trajectories_per_task": "replay_max_trajectories_per_task",
    "experience_lbound": "replay_store_lbound",
    "experience_rbound": "replay_store_rbound",
    "exp_select_mode": "replay_select_mode",
    "pool_store_mode": "replay_store_mode",
    "max_policy_age": "replay_max_policy_age",
    "replay_window": "replay_window",
}


class TrainerPool:
    """`self.pool`, and `self._pending`: the last step's outcomes, recorded in the pool at the next step."""

    def _setup_pool(self, experience_pool: ExperiencePool | None) -> None:
        rbound = self.replay["replay_store_rbound"]
        values = {**self.replay, "replay_store_rbound": self.num_generations if rbound is None else rbound}
        self._pool_settings = {name: values[field] for name, field in _POOL_SETTING_FIELDS.items()}
        self._pool_settings["seed"] = self.args.seed
        # The pool's token ids must be this tokenizer's wherever they are read: replay, and the experience of guided
        # rollouts when it starts from the pool.
        reads_pool = self._replay_enabled or self.replay["init_experience_before_training"]
        self._tokenizer_fingerprint = tokenizer_fingerprint(self.processing_class) if reads_pool else None
        self._vocab_size = _vocab_size(self.model)
        self.pool = ExperiencePool(**self._pool_settings, work_dir=self._pool_work_dir())
        if self._vocab_size is not None:
            self.pool.set_vocab_size(self._vocab_size)
        if self._tokenizer_fingerprint is not None:
            self.pool.bind_tokenizer(self._tokenizer_fingerprint)
        if experience_pool is not None:
            self._adopt_pool(experience_pool, "the given experience_pool")
        else:
            self._share_pool_storage()
        self._pending: PendingOutcomes | None = None

    def _pool_work_dir(self) -> str:
        return self.replay["replay_scratch_dir"] or os.path.join(self.args.output_dir, POOL_WORK_DIR)

    def _adopt_pool(self, pool: ExperiencePool, source: str) -> None:
        """Use `pool` under this run's configuration (the config wins over the settings the pool was saved with).

        A pool recorded with another tokenizer is refused: its token ids would mean other tokens here; so is one holding
        trajectories but no tokenizer fingerprint, unless the caller bound it (`pool.bind_tokenizer`). Trajectories
        with token ids outside the model's vocabulary are removed and counted."""
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
            # The pool's own settings keep the design documents' names; the run sets them under the config's names.
            fields = [_POOL_SETTING_FIELDS.get(name, name) for name in changed]
            logger.warning("trl_exreplay: pool from %s had other settings for %s; using this run's.", source, fields)
        self.pool = pool
        self._share_pool_storage()

    def _share_pool_storage(self) -> None:
        """One writer of the pool's shard files per machine (or in all, or none: `replay_scratch_sharing`); the other
        ranks link its files. Collective: every rank calls it when it takes a pool."""
        sharing = self.replay["replay_scratch_sharing"]
        self._pool_shared = self._replay_enabled and self.accelerator.num_processes > 1 and sharing != "none"
        if not self._pool_shared:
            return
        state = self.accelerator.state
        folders = gather_object([self.pool.scratch_folder()])  # by rank
        # torchrun numbers a machine's ranks consecutively: its local main is this rank less its local index
        writer = 0 if sharing == "all" else state.process_index - state.local_process_index
        self.pool.share_storage(None if writer == state.process_index else folders[writer])

    def _resume_pool(self, checkpoint: str) -> None:
        """Take the pool saved in `checkpoint` (or, where there is none, say loudly that the run resumes empty)."""
        if not os.path.lexists(os.path.join(checkpoint, POOL_DIR)):
            if not self.replay["replay_resume_without_pool"]:
                message = (
                    f"trl_exreplay: the checkpoint {checkpoint} holds no experience pool ({POOL_DIR}/): training "
                    "resumes with an EMPTY pool, so nothing is replayed until it fills again. If the pool was lost, "
                    "stop and restore it; to start empty on purpose, set replay_resume_without_pool=True."
                )
                logger.warning(message)
                warnings.warn(message, stacklevel=2)
            return
        pool = ExperiencePool.load(
            os.path.join(checkpoint, POOL_DIR), vocab_size=self._vocab_size, work_dir=self._pool_work_dir()
        )
        self._adopt_pool(pool, checkpoint)
        self._pending = None

    def _queue_outcomes(self, output, inputs, row_tasks, step: GenerationStep, offset) -> None:
        """Compute each task's outcome from the gathered rewards; keep this rank's successful fresh rows."""
        rewards_per_func = step.rewards
        totals = (rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        success = (totals >= self.replay["replay_success_threshold"]).cpu().tolist()
        # A row with no reward at all (every function returned None, NaN or inf) says nothing about its task.
        missing = torch.isnan(rewards_per_func).all(dim=1).cpu().tolist()
        fresh_rows = [r for r in range(len(row_tasks)) if not step.plan.is_replayed(r) and not missing[r]]
        if self.text_env_factory is not None:  # an episode the environment failed says nothing about the task
            faulted = gather_row_flags(self.accelerator, step.faulted_rows, len(inputs))
            fresh_rows = [r for r in fresh_rows if not faulted[r]]
        if fresh_rows:
            self._metrics["train"]["replay/fresh_reward"].append(totals[fresh_rows].nanmean().item())
        replayed_rows = []
        if self.replay["replay_count_replayed_successes"]:  # ExGRPO: a replayed task's bucket is (s + k) of G
            replayed_rows = [r for r in range(len(row_tasks)) if step.plan.is_replayed(r) and not missing[r]]
        outcomes = task_outcomes(row_tasks, fresh_rows, success, replayed_rows)
        local_winners = sorted(
            r - offset for *_, rows in outcomes.values() for r in rows if 0 <= r - offset < len(inputs)
        )
        records = trajectory_records(
            output,
            local_winners,
            task_rows=inputs,
            row_tasks=row_tasks,
            rewards_per_func=rewards_per_func,
            totals=totals,
            entropies=step.entropies,
            offset=offset,
            policy_version=self.state.global_step,
            count=self._count,
        )
        if self._guidance_on:
            self._guided_records(output, records, step, offset)
            if self._guide_train:
                self._log_guidance(step, success, fresh_rows, len(inputs))
        if self._exhausted:  # every question retired: the run's last batch, of retired tasks, leaves them retired
            outcomes = {}
        elif self.replay["replay_start"] == "solved" and self._schedule.started_at is None:
            # ExGRPO before replay starts: solved tasks enter the skip set, nothing enters the pool or a bucket. The
            # first batch that succeeds often enough starts replay (`success` is gathered: every rank decides alike);
            # the next batch is the first one collected, and the one after it the first that can replay.
            outcomes = {task: o for task, o in outcomes.items() if is_solved(o[0], o[1])}
            if starts_replay(success, fresh_rows, self.replay["replay_start_solved_fraction"]):
                self._schedule.started_at = self.state.global_step
        self._pending = PendingOutcomes([(task, *o) for task, o in outcomes.items()], records, offset)

    def _flush_pending(self) -> None:
        """Insert the queued outcomes into the pool. Collective: every rank calls it at the same points."""
        pending, self._pending = self._pending, None
        ready, uncaptured = pending.captured() if pending is not None else ([], 0)
        if uncaptured:
            self._count("uncaptured_rows", "a successful row was never seen by the loss; not stored", uncaptured)
        merged = dict(gather_object(ready)) if self.accelerator.num_processes > 1 else dict(ready)
        if self._guidance_on:
            self._offer_summaries(merged)  # every success's summary input, taken out of the records
        if not self._replay_enabled:  # guided rollouts without replay: the outcomes only feed the summariser
            return
        for outcome in pending.task_outcomes(merged) if pending is not None else []:
            self.pool.record_outcome(outcome)


def _vocab_size(model) -> int | None:
    """The number of token ids the model embeds (its config's, after any resize), None when it does not say."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    size = getattr(config, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None
