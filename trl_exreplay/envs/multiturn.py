"""Multi-turn rollouts of `ExReplayGRPOTrainer`: its `text_env_factory` games played as TRL's `rollout_func`.

`MultiTurnRollouts`, a part of the trainer's step (`trl_exreplay.parts.StepHooks`), plays a generation step's rows:
fresh rows are played by `rollout.MultiTurnRollout` in lockstep over ranks (so sharded models' collective forwards
stay aligned), replayed rows return their stored trajectories, and the environment's metrics are logged under
``env/``. Its model is TRL's: each call is given the `parts.Policy` the trainer reads when the call runs (the model
TRL wrapped, vLLM's engine, the generation settings), whether generation is collective, and the metrics to log to;
what replay adds (the step, the stored completions' cut) is given too. Nothing keeps the trainer."""

from __future__ import annotations

import functools
import logging

import torch

from ..distributed import any_rank_active, check_multi_turn_vllm
from ..parts import Policy, StepHooks, model_context
from ..pool import task_key
from ..trl_seam import distributed_mode, unwrap_model_for_generation
from .base import env_reward
from .rollout import MultiTurnRollout, generate_batch
from .settings import MultiTurnSettings

logger = logging.getLogger(__name__)


class MultiTurnRollouts(StepHooks):
    """The `text_env_factory` games of a run, a part of the trainer's step that generates its batches
    (`trl_exreplay.parts.StepHooks`; `settings`: its `MultiTurnSettings`; `task_id_column` and `success_threshold`:
    the config's `task_id_column`, `replay_success_threshold`), played by the `Policy` of each call. `guide` (an
    experience-guided rollouts part, `trl_exreplay.guidance.rollouts.GuidedRollouts`, or None) retrieves for the
    guided rows by their first observation. Build it with `for_trainer`, after TRL's `__init__`: it reads the trainer
    once, and keeps none of it but its accelerator."""

    generates = True

    def __init__(
        self,
        engine: MultiTurnRollout,
        settings: MultiTurnSettings,
        reward_funcs: list,
        *,
        accelerator,
        task_id_column: str,
        success_threshold: float,
        guide=None,
    ):
        self.engine = engine
        self._guide = guide
        self._accelerator = accelerator
        self.settings = settings
        self._task_id_column = task_id_column
        self._success_threshold = success_threshold
        self._env_index = next((j for j, f in enumerate(reward_funcs) if f is env_reward), None)

    @classmethod
    def for_trainer(
        cls, text_env_factory, trainer, settings: MultiTurnSettings, replay, guide=None
    ) -> MultiTurnRollouts:
        """The games of `trainer` (a `GRPOTrainer` whose `__init__` ran; `replay`: its `ReplaySettings`), checked
        against its settings."""
        column, args = replay.task_id_column, trainer.args
        names = getattr(trainer.train_dataset, "column_names", None)
        if names is not None and column not in names:
            raise ValueError(
                f"Multi-turn rollouts need a task id column: the train dataset has no `{column}` column "
                f"(`task_id_column`; columns: {names}). Tasks without prompts cannot be told apart otherwise."
            )
        if trainer.use_vllm:
            check_multi_turn_vllm(trainer.vllm_mode, args.vllm_tensor_parallel_size)
            if args.vllm_enable_sleep_mode:
                logger.warning(
                    "trl_exreplay: vllm_enable_sleep_mode with multi-turn rollouts reloads vLLM's weights before "
                    "every turn (TRL's engine sleeps after each generate call); it is correct but slow."
                )
        if distributed_mode(trainer).is_zero3 and not args.ds3_gather_for_generation:
            # Not ours to fix: GRPOTrainer alone fails its first backward this way (TRL 1.16, DeepSpeed 0.19.8, CPU).
            raise ValueError("Multi-turn rollouts under ZeRO-3 need `ds3_gather_for_generation=True`.")
        engine = MultiTurnRollout(
            text_env_factory,
            trainer.processing_class,
            max_turns=settings.max_turns,
            max_completion_length=trainer.max_completion_length,
            max_tokens_per_turn=settings.max_tokens_per_turn,
            step_timeout=settings.env_step_timeout,
            workers=settings.env_workers,
            system_prompt_column=settings.system_prompt_column,
            chat_template_kwargs=trainer.chat_template_kwargs,
            max_prompt_tokens=model_context(trainer.model, args if trainer.use_vllm else None),
            special_tokens=settings.env_special_tokens,
        )
        return cls(
            engine,
            settings,
            trainer.reward_funcs,
            accelerator=trainer.accelerator,
            task_id_column=column,
            success_threshold=replay.replay_success_threshold,
            guide=guide,
        )

    def row(self, row: dict) -> dict:
        """A copy of the row with a placeholder prompt (TRL requires one); the rollout replaces it in place with the
        real one, the environment's first observation, which is what reward functions and logs then see."""
        return {
            **row,
            "prompt": [{"role": "user", "content": f"task {task_key(row, self._task_id_column)}"}],
        }

    def train_ended(self) -> None:
        self.engine.close()

    def rollout(self, step, policy: Policy, *, collective: bool, metrics, fit_completion) -> dict:
        """TRL `rollout_func`'s output for `step` (a `GenerationStep`): episodes for the fresh rows, played by
        `policy` (`policy_episodes`), stored trajectories (cut by `fit_completion`) for the replayed ones; the `env/*`
        figures go to `metrics`. Collective: ranks play in lockstep where generation is (`collective`)."""
        rows, guidance = step.rows, self._guide
        replayed = step.take_replay() or {}
        fresh = [i for i in range(len(rows)) if i not in replayed]
        # One gather context for all turns (entered and left once by every rank). Inside it, a forward of a sharded
        # model is still collective (ZeRO-3's start-of-forward hook; FSDP), so ranks agree on the number of turns
        # (`sync`) and a rank with nothing left to play generates a dummy row: every rank calls generate as often.
        accelerator = self._accelerator
        sync = functools.partial(any_rank_active, accelerator) if collective else None
        tasks = [rows[i] for i in fresh]
        guiding = {}
        if guidance is not None:  # experience-guided rollouts: retrieved by the first observation

            def guide(j: int, observation: str, render) -> list[int] | None:
                return guidance.guide_observation(fresh[j], observation, render)  # within the model's context

            guiding = {"guide": guide}
        episodes, sampled_logprobs = policy_episodes(self.engine.run, tasks, sync, guiding, policy)
        by_row = dict(zip(fresh, episodes))
        step.faulted_rows = {i for i, episode in by_row.items() if episode.error is not None}
        column = self._task_id_column
        real_prompts = {}
        for i, episode in by_row.items():
            system = episode.task.get(self.settings.system_prompt_column)
            messages = [{"role": "system", "content": system}] if system else []
            real_prompts[i] = messages + [{"role": "user", "content": episode.observation}]
            real_prompts.setdefault(task_key(rows[i], column), real_prompts[i])
        for i, row in enumerate(rows):  # in place: the very lists TRL hands to reward functions and logs
            row["prompt"][:] = real_prompts.get(i, real_prompts.get(task_key(row, column), row["prompt"]))
        # vLLM's sampling log-probs feed TRL's importance-sampling correction; tokens without one (environment
        # tokens, replayed rows: their correction is our off-policy loss) get None, i.e. no correction.
        output = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "env_reward": []}
        for i in range(len(rows)):
            if i in replayed:
                trajectory = replayed[i]
                completion = fit_completion(trajectory.completion_ids)
                output["prompt_ids"].append(trajectory.prompt_ids)
                output["completion_ids"].append(completion)
                output["env_mask"].append(trajectory.completion_mask[: len(completion)])
                output["logprobs"].append([None] * len(completion))
                recorded = trajectory.rewards
                env_index = self._env_index
                has_env_reward = env_index is not None and env_index < len(recorded)
                output["env_reward"].append(recorded[env_index] if has_env_reward else trajectory.reward)
            else:
                episode = by_row[i]
                prompt_ids = episode.prompt_ids
                if episode.plain_prompt_ids is not None:  # guided: a discarded row trains without the experience
                    prompt_ids = guidance.trained_prompt(i, episode.prompt_ids, episode.plain_prompt_ids)
                output["prompt_ids"].append(prompt_ids)
                output["completion_ids"].append(episode.completion_ids)
                output["env_mask"].append(episode.env_mask)
                output["logprobs"].append(episode.logprobs)
                output["env_reward"].append(episode.reward)
        if not sampled_logprobs:
            output["logprobs"] = None  # TRL computes the behaviour log-probs itself
        self._log_env_metrics(episodes, accelerator, metrics)
        return output

    def _log_env_metrics(self, episodes, accelerator, metrics) -> None:
        threshold = self._success_threshold
        steps = [s for e in episodes for s in e.step_seconds]
        local = torch.tensor(
            [
                len(episodes),
                sum(e.turns for e in episodes),
                sum(e.reward >= threshold for e in episodes),
                sum(e.truncated for e in episodes),
                sum(e.invalid_actions for e in episodes),
                sum(steps),
                len(steps),
                sum(self.engine.errors.values()),
                self.engine.errors["nonfinite_reward"],
                self.engine.special_tokens_removed,
            ],
            dtype=torch.float64,
            device=accelerator.device,
        )
        totals = accelerator.gather(local.view(1, -1)).view(-1, local.numel()).sum(dim=0).tolist()
        count, turns, wins, truncated, invalid, seconds, num_steps, errors, nonfinite, spelled = totals
        if count > 0:
            metrics["env/turns_mean"].append(turns / count)
            metrics["env/success_rate"].append(wins / count)
            metrics["env/truncated_fraction"].append(truncated / count)
            metrics["env/invalid_actions"].append(invalid / count)
        if num_steps > 0:
            metrics["env/step_seconds"].append(seconds / num_steps)
        metrics["env/errors"] = [errors]  # a running total: the latest value, not a mean over the logging window
        metrics["env/nonfinite_rewards"] = [nonfinite]  # among the errors, also a running total
        metrics["env/special_tokens_removed"] = [spelled]  # from observations, before tokenizing: a running total


def policy_episodes(run, tasks: list[dict], sync, guiding: dict, policy: Policy) -> tuple[list, bool]:
    """The episodes of `tasks` played by `policy` through `run` (`MultiTurnRollout.run`), and whether they carry
    sampling log-probs: through TRL's colocated vLLM engine (whose weights TRL synced for this step before calling
    the rollout), or by the training model itself (TRL's wrapped model, transformers `generate`, parameters gathered as
    TRL gathers them: `ds3_gather`, `dist`)."""
    if policy.vllm_engine is not None:
        return run(tasks, functools.partial(_generate_turn_vllm, policy.vllm_engine), sync, **guiding), True
    with (
        unwrap_model_for_generation(
            policy.model,
            policy.accelerator,
            gather_deepspeed3_params=policy.ds3_gather,
            generation_kwargs=policy.generation_kwargs,
            gradient_checkpointing_kwargs=policy.gradient_checkpointing_kwargs,
        ) as unwrapped_model,
        torch.no_grad(),
        policy.dist.summon_full_params(policy.model, recurse=False),
    ):
        generate = functools.partial(
            generate_batch,
            unwrapped_model,
            pad_token_id=policy.pad_token_id,
            eos_token_ids=policy.eos_token_ids,
            generation_config=policy.generation_config,
        )  # one batched generation over the active episodes; each result stops after its first eos
        return run(tasks, generate, sync, **guiding), False


def _generate_turn_vllm(engine, contexts: list[list[int]], max_new_tokens: int) -> tuple[list, list]:
    """One turn through TRL's colocated vLLM engine (its weights were synced for this step by TRL)."""
    if not contexts:
        return [], []
    # TRL's engine reads its token limit on every call; a turn has its own.
    limit, engine.max_completion_length = engine.max_completion_length, max_new_tokens
    try:
        _, completion_ids, logprobs, _ = engine.generate([list(c) for c in contexts], None, num_generations=1)
    finally:
        engine.max_completion_length = limit
    # one log-prob per token: TRL asks vLLM for the sampled token's only (`logprobs=0`), first in each list
    logprobs = [[lp[0] if lp else None for lp in row] for row in logprobs]
    return [list(ids)[:max_new_tokens] for ids in completion_ids], [row[:max_new_tokens] for row in logprobs]
