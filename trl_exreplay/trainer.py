"""`ExReplayGRPOTrainer`: TRL's `GRPOTrainer` with experience replay, as glue over small overrides (listed in
the class docstring). What is not glue lives in the module whose job it is: the replay plan (`planner.py`), the
replayed tokens' loss (`loss.py`), the pool (the `pool` package; the trainer's side of it in `trainer_pool.py`, the outcomes
it records in `outcomes.py`), the choice of trajectories (`selection.py`), multi-turn rollouts (`multiturn.py`), one
step's state (`step.py`) and the `replay/*` metrics (`metrics.py`).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback
from trl import GRPOTrainer

from . import compat  # noqa: F401 - refuses a TRL outside the supported range
from .config import replay_options, validate_replay_options
from .custom_rollouts import replaying_rollout
from .distributed import any_rank_active, generation_is_collective
from .envs import env_reward
from .guidance import ExperienceProvider
from .hub import CITATIONS
from .loss import TOKEN_SUM_LOSS_TYPES, OffPolicyOptions, aggregate_loss, off_policy_loss
from .metrics import log_generation, log_off_policy
from .multiturn import MultiTurnRollouts, check_multi_turn_vllm
from .planner import ReplayPlan, plan_replay, replay_groups_due
from .pool import ExperiencePool, task_key
from .schedule import EpochSeededSampler, ReplaySchedule, redirect_retired_groups
from .selection import ReplaySelection
from .step import GenerationStep, LossForward, attach_replay_tensors
from .trainer_guidance import EXPERIENCE_DIR, ExperienceGuidance
from .trainer_pool import POOL_DIR, POOL_WORK_DIR, TrainerPool

logger = logging.getLogger(__name__)

__all__ = ["EXPERIENCE_DIR", "POOL_DIR", "POOL_WORK_DIR", "ExReplayGRPOTrainer"]


# The fields of `loss.OffPolicyOptions` read from TRL's config as they are, and from ours.
_TRL_LOSS_FIELDS = ("delta", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos",
                    "vespo_k_neg", "vespo_lambda_neg")  # fmt: skip
_REPLAY_LOSS_FIELDS = ("replay_clip_high", "replay_dual_clip_c", "replay_shaping", "replay_shaping_beta")


class ExReplayGRPOTrainer(TrainerPool, ReplaySelection, MultiTurnRollouts, ExperienceGuidance, GRPOTrainer):
    r"""
    `GRPOTrainer` with experience replay (ExGRPO / AgentEvolver). Same arguments as [`trl.GRPOTrainer`], plus
    `experience_pool` to start from an existing pool, `text_env_factory` for multi-turn games and
    `experience_provider` for experience-guided rollouts (`trl_exreplay.guidance`; off unless the config's
    `train_rollout_expmode` or `val_rollout_expmode` guides). Replay is configured by [`ExReplayGRPOConfig`]; a plain
    `GRPOConfig` replays with the default settings, and `enable_experience_replay=False` gives `GRPOTrainer` exactly.

    TRL methods it overrides, each calling `super()` (no TRL method body is copied), and why:

    * `_get_train_sampler`: to draw each epoch's rows by the epoch's number (`schedule.EpochSeededSampler`), so that a
      resumed run draws the rows of the run that was not stopped (TRL's sampler starts again from the first epoch);
    * `_generate_and_score_completions`: to swap the planned replay tasks into their groups (the plan is drawn on
      global rows, identical on every rank) and to tag the batch's replayed rows for the loss and queue its outcomes;
    * `_generate_single_turn`: to generate the fresh rows only and splice in the replayed completions, and to give
      the guided rows of `discard` tasks their prompt without the experience in the list TRL trains on;
    * `_tokenize_prompts` (in `ExperienceGuidance`): to tokenize the guided copies of experience-guided rows (TRL's
      own tokenisation, called again) and sample them on those;
    * `_tool_call_loop`: so that TRL's tool loop (`tools`, `environment_factory`) skips replayed rows, which are
      finished episodes, keeps their tool results masked, and runs in lockstep over ranks where generation is
      collective (ZeRO-3, FSDP);
    * `_calculate_rewards`: so that replayed rows keep their recorded rewards (they count in their group's advantage);
    * `_compute_loss`: to add the replayed tokens' term (`loss.off_policy_loss`) to TRL's loss, given the replayed
      rows at advantage 0 (and, with `replay_unclipped_fresh`, TRL's loss with no clip range once replay runs);
    * `_get_per_token_logps_and_entropies`: to keep TRL's loss forward (for that term and the pool's records: no extra
      forward) and the entropies of its old-log-probs forward (the generating policy's);
    * `get_high_entropy_mask`: to keep the tokens TRL's loss selects (`top_entropy_quantile`) for the replayed term,
      instead of gathering every rank's entropies a second time;
    * `save_model` / `_load_optimizer_and_scheduler`: so that the pool travels with every checkpoint (saved
      incrementally, hard-linking the shards it shares with the previous one), and the experience store of guided
      rollouts with it, and both are restored on resume.

    Example:

    ```python
    from datasets import Dataset
    from trl_exreplay import ExReplayGRPOConfig, ExReplayGRPOTrainer
    from trl_exreplay.tiny import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(["say", "yes", "no", "maybe"])
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "say yes"}]] * 8, "task_id": list("ab") * 4})


    def said_yes(completions, **kwargs):
        return [float("yes" in c[0]["content"]) for c in completions]


    trainer = ExReplayGRPOTrainer(
        model=build_tiny_model(tokenizer),
        reward_funcs=said_yes,
        args=ExReplayGRPOConfig(output_dir="out", num_generations=4, per_device_train_batch_size=8, max_steps=4,
                                max_completion_length=4, replay_start_ratio=0.5, use_cpu=True, report_to="none"),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    print(trainer.pool.stats())
    ```
    """

    # What TRL's own model card (written with every checkpoint) names, tags and cites.
    _tag_names = ["trl", "grpo", "exreplay"]
    _name = "ExReplay GRPO"
    _paper = {
        "title": "ExGRPO: Learning to Reason from Experience",
        "id": "2510.02245",
        "citation": CITATIONS["ExGRPO"],
    }

    # Our state, as it is before `__init__` sets it: an override called on a trainer that never ran our `__init__`
    # (TRL's tests build `GRPOTrainer`s with `object.__new__`) reads these and does what TRL's method does.
    _replay_enabled = False
    _guide_train = _guide_eval = _guidance_on = False
    _generation: GenerationStep | None = None  # the generation step in progress (see `trl_exreplay.step`)
    _loss_forward: LossForward | None = None  # TRL's loss forward in progress (see `_compute_loss`)
    _pending = None  # the last generation step's outcomes, not yet in the pool (`trainer_pool.PendingOutcomes`)
    _retiring = False
    _exhausted = False  # every training question is retired (`_redirect_retired`)
    text_env_factory = None

    def __init__(
        self,
        model,
        reward_funcs=None,
        args=None,
        train_dataset=None,
        *trl_args,
        experience_pool: ExperiencePool | None = None,
        text_env_factory: Callable[[], object] | None = None,
        experience_provider: ExperienceProvider | None = None,
        **trl_kwargs,
    ):
        """TRL's `GRPOTrainer` parameters (the first four named, the rest passed on as given), plus ours."""
        if text_env_factory is not None and reward_funcs is None:
            reward_funcs = env_reward  # the environment's reward, unless the user scores rollouts
        if getattr(args, "use_vllm", False):  # before TRL starts vLLM or waits for its server
            if text_env_factory is not None:
                check_multi_turn_vllm(args.vllm_mode, args.vllm_tensor_parallel_size)
            tool_loop = trl_kwargs.get("tools") or trl_kwargs.get("environment_factory") is not None
            if tool_loop and getattr(args, "enable_experience_replay", True):
                path = "Experience replay through TRL's tool loop (`tools`, `environment_factory`)"
                check_multi_turn_vllm(args.vllm_mode, args.vllm_tensor_parallel_size, path)
        super().__init__(model, reward_funcs, args, train_dataset, *trl_args, **trl_kwargs)
        self.replay = replay_options(self.args)
        validate_replay_options(self.replay, self.num_generations)
        self._replay_enabled = bool(self.replay["enable_experience_replay"])
        groups = self.args.generation_batch_size // self.num_generations
        if self._replay_enabled and 0 < self.replay["replay_ratio"] * groups < 1:
            logger.warning(
                "trl_exreplay: a generation batch holds %d task group(s), so replay_ratio=%g replays a group in only "
                "about one generation batch of %.3g (replay/tasks is 0 in the others). To replay in every batch, give "
                "it more groups (steps_per_generation, per_device_train_batch_size, processes).",
                groups, self.replay["replay_ratio"], 1 / (self.replay["replay_ratio"] * groups),
            )  # fmt: skip
        user_rollout_func = self.rollout_func is not None
        if self._replay_enabled:
            self._check_supported()
        self._schedule = ReplaySchedule()  # ExGRPO's start step, saved with checkpoints
        self._retiring = self._replay_enabled and self.replay["replay_retire_solved"]
        if self._retiring and not hasattr(self.train_dataset, "__getitem__"):
            self._retiring = False
            logger.warning(
                "trl_exreplay: replay_retire_solved needs a dataset whose rows can be read by index (a map-style "
                "`datasets.Dataset`); with this %s, solved questions stay in the fresh stream.",
                type(self.train_dataset).__name__,
            )
        self._retired: set[str] | None = None  # the retired tasks, as of the last generation batch
        self._dataset_keys: list[str] | None = None  # the task of each training dataset row
        self.text_env_factory = text_env_factory
        if text_env_factory is not None:
            self._setup_multi_turn(text_env_factory)
        self._setup_pool(experience_pool)
        self._replay_counts: Counter = Counter()  # faults and mismatches, logged once per kind
        self._warned: set[str] = set()
        self._setup_guidance(experience_provider, user_rollout_func)
        if self._replay_enabled or text_env_factory is not None or self._guidance_on:
            self.add_callback(_AtTrainEnd(self))

    # ------------------------------------------------------------------------------------------------ checks
    def _check_supported(self) -> None:
        """Refuse, before any step, what replay cannot train (docs/support.md gives each reason)."""
        if self._is_vlm:
            raise ValueError(
                "Experience replay with vision-language models is not supported yet; set `enable_experience_replay="
                "False`."
            )
        if self.rollout_func is not None:
            self.rollout_func = replaying_rollout(self.rollout_func, self)

    # -------------------------------------------------------------------------------------------- generation
    def _get_train_sampler(self, dataset=None):
        sampler = super()._get_train_sampler(dataset)
        # TRL's sampler, its epochs drawn by number: a resumed run draws the rows the run that was not stopped draws
        return EpochSeededSampler(sampler) if self._replay_enabled else sampler

    def _generate_and_score_completions(self, inputs):
        if not self.model.training or not (self._replay_enabled or self._guide_train):
            return self._generate_unplanned(inputs)
        self._generation = step = self._plan_generation(inputs)
        try:
            output = super()._generate_and_score_completions(step.rows)
            self._finish_generation(output, step)
        finally:
            self._generation = None
        return output

    def _generate_unplanned(self, inputs):
        """Evaluation, or training without replay and guidance: TRL's generation on the rows as they are (multi-turn
        rows get their placeholder prompt), guided when evaluation is."""
        self._generation = step = GenerationStep(rows=[self._with_prompt(row) for row in inputs])
        if self._guide_eval and not self.model.training:
            # drawn on the global evaluation batch (a group may span ranks), from the step and the batch's number
            seed = [self.args.seed, self.state.global_step, self._eval_batches, 1]
            self._eval_batches += 1
            step.offset = self.accelerator.process_index * len(inputs)
            step.guidance = self._allocate(len(inputs) * self.accelerator.num_processes, seed, training=False)
            if self.text_env_factory is None:  # multi-turn rows retrieve once their first observation is known
                self._guide_rows(step, step.offset, self._row_queries(step.rows))
        try:
            output = super()._generate_and_score_completions(step.rows)
            if step.guidance is not None:
                self._take_step_counts()  # evaluation's retrievals stay out of the training metrics
            return output
        finally:
            self._generation = None

    def _plan_generation(self, inputs) -> GenerationStep:
        """A training generation batch's plan, the same on every rank: which groups replay which stored trajectories
        (retired questions redirected first), and which rows are guided."""
        self._flush_pending()
        if self._guidance_on:
            self._experience_step_begin()
        num_generations = self.num_generations
        rank, local_rows = self.accelerator.process_index, len(inputs)
        offset = rank * local_rows
        column = self.replay["task_id_column"]
        row_keys = gather_object([task_key(x, column) for x in inputs])
        step = self.state.global_step
        # Several generation batches share a global step when steps_per_generation < gradient_accumulation_steps;
        # the micro-step index (identical on every rank, 0 at every step boundary, so resume-safe) tells them apart.
        micro_step = self._step % self.args.gradient_accumulation_steps
        draw_seed = [self.args.seed, step, micro_step]
        if self._retiring:
            inputs, row_keys = self._redirect_retired(inputs, row_keys, offset, draw_seed)
        group_keys = row_keys[::num_generations]

        plan = ReplayPlan(num_generations, self.replay["replay_trajectories_per_group"], {})
        if self._replay_enabled and self._replay_started():
            # replay_ratio is a long-run share: a batch of fewer than 1 / replay_ratio groups replays on some batches
            batch_index = (step * self.args.gradient_accumulation_steps + micro_step) // (
                self.args.steps_per_generation * self.num_iterations
            )
            plan = plan_replay(
                group_keys,
                self.pool.replay_buckets(  # drawn from in O(batch), whatever the pool's size
                    plan.num_replayed, step, self.replay["replay_max_policy_age"], self.replay["replay_window"]
                ),
                num_tasks=replay_groups_due(self.replay["replay_ratio"], len(group_keys), batch_index),
                num_generations=num_generations,
                num_replayed=plan.num_replayed,
                weighting=self.replay["replay_bucket_weighting"],
                seed=draw_seed,
            )
        selected = self._select_trajectories(plan, step, draw_seed)

        swapped, replayed_local = plan.rank_rows(offset, local_rows, group_keys, selected)
        # The dataset rows as they are (stored with trajectories): a replayed group's task row from the pool.
        task_rows = [self.pool.task_row(swapped[i]) if i in swapped else row for i, row in enumerate(inputs)]
        generation = GenerationStep(
            rows=[self._with_prompt(row) for row in task_rows],
            plan=plan,
            selected=selected,
            replayed_local=replayed_local,
            fresh_per_rank=plan.fresh_rows_per_rank(len(row_keys), local_rows),
            # When TRL runs its old-log-probs forward (right after generation), its entropies are the generating
            # policy's.
            wants_entropies=self._trl_computes_old_logps(),
            offset=offset,
            task_rows=task_rows,
            row_tasks=[plan.task_of_row(r, group_keys) for r in range(len(row_keys))],
        )
        if self._guide_train:
            replayed_rows = [r for r in range(len(row_keys)) if plan.is_replayed(r)]  # the plan is global
            generation.guidance = self._allocate(len(row_keys), draw_seed, replayed_rows)
            if self.text_env_factory is None:  # multi-turn rows retrieve once their first observation is known
                self._guide_rows(generation, offset, self._row_queries(generation.rows))
        return generation

    def _finish_generation(self, output: dict, generation: GenerationStep) -> None:
        """After TRL's generation and scoring: the replay tensors the loss reads, the discarded guided rows' behaviour
        log-probs, the outcomes queued for the pool, the step's metrics."""
        plan, num_rows = generation.plan, len(generation.row_tasks)
        guidance = generation.guidance
        discarding = guidance is not None and any(guidance.discarded(r) for r in range(num_rows))
        attach_replay_tensors(output, generation.replayed_local, replaying=bool(plan.replay_groups) or discarding)
        if discarding:
            self._attach_guided_rows(output, generation, generation.offset)
        self._queue_outcomes(output, generation.task_rows, generation.row_tasks, generation, generation.offset)
        if self._replay_enabled:
            metrics = self._metrics["train"]
            metrics["replay/started"].append(float(self._replay_started()))
            step = self.state.global_step
            ages = [step - t.policy_version for ts in generation.selected.values() for t in ts]
            log_generation(metrics, plan, num_rows, ages, self.pool.stats(), self._replay_counts)

    def _trl_computes_old_logps(self) -> bool:
        """TRL's own condition for computing `old_per_token_logps` in `_generate_and_score_completions`."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        misaligned = self.args.gradient_accumulation_steps % generate_every != 0
        return misaligned or (self.use_vllm and self.vllm_importance_sampling_correction)

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        forward = self._loss_forward
        if forward is not None and forward.logps is None:  # TRL's loss makes one policy forward: the first call
            logps, entropies, aux = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
            forward.logps, forward.entropies = logps, entropies
            inputs = forward.inputs
            if self._pending is not None and self.model.training:  # the pool's records take this forward's values
                mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
                self._pending.capture(inputs["exreplay_row"].tolist(), logps, entropies, mask)
            return logps, entropies, aux
        step = self._generation
        if step is None or not step.wants_entropies or step.entropies is not None or model is not self.model:
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        # TRL's first policy forward of a generation step is the old-log-probs one (the reference forward follows).
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(
            model, *args, **{**kwargs, "compute_entropy": True}
        )
        step.entropies = entropies.detach()
        return logps, (entropies if kwargs.get("compute_entropy") else None), aux

    def _replay_started(self) -> bool:
        if self.replay["replay_start"] == "solved":  # ExGRPO: from the step after the one that succeeded often enough
            started = self._schedule.started_at
            return started is not None and self.state.global_step > started
        max_steps = max(self.state.max_steps, 1)
        return self.state.global_step / max_steps >= self.replay["replay_start_ratio"]

    def _redirect_retired(self, inputs: list, row_keys: list[str], offset: int, seed: list) -> tuple[list, list]:
        """ExGRPO's retired questions (`trl_exreplay.schedule`): the groups whose task is in the pool's skip set take
        other dataset rows, the same on every rank (the batch's keys are gathered, the pool is rank-identical)."""
        G = self.num_generations
        # Read after the pool took the previous batch's outcomes: a question every fresh rollout solved is not drawn
        # again (ExGRPO drops it from the data at the next epoch, in which it would be drawn once: the same thing, but
        # also where a dataset repeats its questions within an epoch). It is not replayed either, so it stays retired.
        retired = set(self.pool.skip_set)
        if retired != self._retired:
            self._retired = retired
            if self._dataset_keys is None:
                column = self.replay["task_id_column"]
                self._dataset_keys = [task_key(row, column) for row in self.train_dataset]
            active = [i for i, key in enumerate(self._dataset_keys) if key not in self._retired]
            self._active_rows = (active, [self._dataset_keys[i] for i in active])
            if not active:
                self._exhausted = True  # this last batch is of retired tasks: its outcomes stay out of the pool
                self.control.should_training_stop = True
                logger.warning(
                    "trl_exreplay: every training question is retired (solved by all its fresh rollouts: %d tasks, "
                    "replay_retire_solved=True), so no fresh rollout is left to make; training stops after step %d.",
                    len(self._retired), self.state.global_step + 1,
                )  # fmt: skip
        redirect = redirect_retired_groups(row_keys[::G], self._retired, *self._active_rows, seed=[*seed, 2])
        metrics = self._metrics["train"]
        metrics["replay/retired_tasks"].append(float(len(self._retired)))
        metrics["replay/redirected_groups"].append(float(len(redirect)))
        if not redirect:
            return inputs, row_keys
        inputs = [
            self.train_dataset[redirect[(offset + i) // G]] if (offset + i) // G in redirect else row
            for i, row in enumerate(inputs)
        ]
        row_keys = [self._dataset_keys[redirect[r // G]] if r // G in redirect else k for r, k in enumerate(row_keys)]
        return inputs, row_keys

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self._generation is not None and self._generation.tool_loop_lockstep:
            # this rank's vote that it plays one more round of TRL's tool loop (see `_tool_call_loop`)
            any_rank_active(self.accelerator, True)
        result = self._generate_with_replay(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if self._generation is not None:
            self._generation.strip_discarded(prompt_ids)  # in the list TRL keeps: what its loss trains on
        return result

    def _generate_with_replay(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images):
        """Generate the fresh rows only (all of them, when the step replays nothing) and splice in the replayed ones."""
        step = self._generation
        replayed = step.take_replay() if step is not None else None
        if replayed is None:
            if step is not None and step.guidance is not None and any(step.guidance.guided):
                # a group's rows hold different prompts now: one sample per row (vLLM's server mode would sample the
                # whole group from its first prompt); the allocation is global, so every rank decides alike
                num_generations = 1 if self.use_vllm else num_generations
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        if images is not None or multimodal_fields:
            raise NotImplementedError("Experience replay with multimodal prompts is not supported yet.")
        fresh = [i for i in range(len(prompt_ids)) if i not in replayed]
        num_padding = self._padding_rows(len(fresh))
        to_generate = [prompt_ids[i] for i in fresh] + [prompt_ids[0]] * num_padding
        generated, generated_logps = [], None
        if to_generate:
            generated, generated_logps = super()._generate_single_turn(
                to_generate, None, multimodal_fields, 1 if self.use_vllm else num_generations, has_tool_images
            )
        self._replay_counts["padding_rows"] += num_padding
        completion_ids = [None] * len(prompt_ids)
        logprobs = None if generated_logps is None else [None] * len(prompt_ids)
        for j, i in enumerate(fresh):
            completion_ids[i] = generated[j]
            if logprobs is not None:
                logprobs[i] = generated_logps[j]
        for i, trajectory in replayed.items():
            completion_ids[i] = self._fit_completion(trajectory.completion_ids)
            if logprobs is not None:  # not sampled now: no sampler log-probs (TRL reads None as NaN, and skips it)
                logprobs[i] = [None] * len(completion_ids[i])
            if list(prompt_ids[i]) != trajectory.prompt_ids:
                self._count("prompt_mismatch", "a replayed trajectory's prompt tokenizes differently now")
                # The completion is trained after the prompt it was sampled with (TRL keeps this list of prompts), or its
                # recorded log-probs would be those of another context.
                prompt_ids[i] = list(trajectory.prompt_ids)
        return completion_ids, logprobs

    def _padding_rows(self, num_fresh: int) -> int:
        """Rows to generate and discard so every rank makes the same generation calls (vLLM server / TP, ZeRO-3)."""
        most = max(self._generation.fresh_per_rank)
        if self.use_vllm and (self.vllm_mode == "server" or self.vllm_tensor_parallel_size > 1):
            return most - num_fresh  # vLLM slices its output by equal per-rank shares
        # Sharded models (ZeRO-3, FSDP) gather parameters collectively inside generation: a rank whose rows are all
        # replayed still generates one row. Cheap, so done for every multi-process run.
        return 1 if (self.accelerator.num_processes > 1 and num_fresh == 0 and most > 0) else 0

    def _fit_completion(self, completion_ids: list[int]) -> list[int]:
        limit = self.max_completion_length
        if limit is not None and len(completion_ids) > limit:
            self._count("truncated_replays", "a replayed completion is longer than max_completion_length")
            return completion_ids[:limit]
        return completion_ids

    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        step = self._generation
        if step is None or not self._replay_enabled or (step.plan is None and not generation_is_collective(self.accelerator, self._dist)):
            return super()._tool_call_loop(
                prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields
            )
        for i in step.replayed_local:  # a finished episode, tool results included: its tool calls are not run again
            text = self.processing_class.decode(completion_ids[i], skip_special_tokens=True)
            completions[i] = [{"role": "assistant", "content": text}]
        # Ranks take different numbers of tool rounds; where generation is collective, each round is agreed on.
        step.tool_loop_lockstep = generation_is_collective(self.accelerator, self._dist)
        try:
            result = super()._tool_call_loop(
                prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields
            )
            while step.tool_loop_lockstep and any_rank_active(self.accelerator, False):
                super()._generate_single_turn([prompt_ids[0]], None, {}, 1)  # a round another rank still plays
        finally:
            step.tool_loop_lockstep = False
        tool_mask = result[0]
        for i, trajectory in step.replayed_local.items():  # tool results masked out of the loss, as TRL masks them
            tool_mask[i] = list(trajectory.completion_mask[: len(completion_ids[i])])
        return result

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        infinite = torch.isinf(rewards_per_func)
        if infinite.any():
            # TRL would carry an infinite reward into the advantages (NaN loss, or a group that swamps the others);
            # it becomes a missing reward (NaN), which TRL handles: left out of the sum over reward functions.
            message = "a reward function returned an infinite reward; it is treated as missing"
            self._count("nonfinite_rewards", message, int(infinite.sum()))
            rewards_per_func = rewards_per_func.masked_fill(infinite, float("nan"))
        step = self._generation
        if step is None or step.plan is None:
            return rewards_per_func
        # Replayed rows' tool calls are not run again and their environments are not played: with tools, what the
        # reward functions see of them says nothing to compare the recorded rewards with.
        counts = step.put_recorded_rewards(rewards_per_func, compare=not self.tools and self.environments is None)
        if counts["reward_mismatch"]:
            self._replay_counts["reward_mismatch"] += counts["reward_mismatch"]
        if counts["reward_arity_mismatch"]:
            message = "recorded rewards do not match the reward functions"
            self._count("reward_arity_mismatch", message, counts["reward_arity_mismatch"])
        step.rewards = rewards_per_func
        return rewards_per_func

    # ---------------------------------------------------------------------------------- batch post-processing
    # --------------------------------------------------------------------------------------------------- loss
    def _compute_loss(self, model, inputs):
        """TRL's loss. In a generation batch that replays, TRL sees the replayed rows at advantage 0 (nothing in its
        policy term, but in every normaliser, the KL and the entropy terms), and `loss.off_policy_loss` adds their
        term, reduced by the loss type's normaliser (`loss.aggregate_loss`: linear, so the sum is the whole loss)."""
        if "exreplay_row" not in inputs:  # neither replay nor guided rollouts made this batch
            return super()._compute_loss(model, inputs)
        replaying = self._replays(inputs)
        if replaying:
            advantages = inputs["advantages"]
            replayed_rows = inputs["exreplay_replayed"].bool().view(-1, *([1] * (advantages.dim() - 1)))
            inputs = {**inputs, "advantages": advantages.masked_fill(replayed_rows, 0.0)}
        # TRL's loss makes one policy forward; the hook keeps its log-probs and entropies (the pool's records too).
        self._loss_forward = forward = LossForward(inputs)
        clip = self.epsilon_low, self.epsilon_high
        if self.replay["replay_unclipped_fresh"] and self._replay_started() and self.model.training:
            # ExGRPO's loss_remove_clip: TRL's loss reads its clip range when it runs; an infinite one clips nothing
            self.epsilon_low = self.epsilon_high = float("inf")
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._loss_forward = None
            self.epsilon_low, self.epsilon_high = clip
        if replaying:
            loss = loss + self._off_policy_term(inputs, advantages, forward)
        return loss

    def _off_policy_term(self, inputs: dict, advantages: torch.Tensor, forward: LossForward) -> torch.Tensor:
        mode = "train" if self.model.training else "eval"
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        logps = forward.logps
        if logps is None:
            raise RuntimeError(
                "TRL's _compute_loss made no policy forward through _get_per_token_logps_and_entropies, so the replayed "
                "tokens' term has no log-probs: a subclass that overrides one of them must call super()."
            )
        behaviour = inputs["recorded_per_token_logps"] if self.replay["replay_importance_sampling"] else logps.detach()
        per_token_loss, metrics = off_policy_loss(
            logps, behaviour, advantages, inputs["exp_mask"] * mask, self._off_policy_options(),
            token_mask=forward.entropy_mask,  # TRL's `top_entropy_quantile` selection, fresh and replayed alike
        )  # fmt: skip
        # The loss type's normaliser and gradient-accumulation scaling, as TRL's `_compute_loss` applies them.
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        if self.loss_type in TOKEN_SUM_LOSS_TYPES:
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * accumulation / self.args.steps_per_generation
            term = aggregate_loss(per_token_loss, mask, loss_type=self.loss_type, loss_normalizer=normalizer)
        else:
            term = aggregate_loss(
                per_token_loss, mask, loss_type=self.loss_type, max_completion_length=self.max_completion_length
            )
            term = term / accumulation
        log_off_policy(self._metrics[mode], self.accelerator, metrics)
        return term

    def _off_policy_options(self) -> OffPolicyOptions:
        """`loss.off_policy_loss`'s options under this run's configuration (TRL's fields and ours)."""
        args = self.args
        trl = {name: getattr(args, name) for name in _TRL_LOSS_FIELDS}
        ours = {name: self.replay[name] for name in _REPLAY_LOSS_FIELDS}
        return OffPolicyOptions(
            loss_type=self.loss_type,
            importance_sampling_level=self.importance_sampling_level,
            epsilon_low=self.epsilon_low,
            off_policy_mask_threshold=self.off_policy_mask_threshold,
            **trl,
            **ours,
        )

    def get_high_entropy_mask(self, entropies, mask, threshold):
        selected = super().get_high_entropy_mask(entropies, mask, threshold)
        # TRL's loss selecting its tokens: the replayed term takes the same. Called outside our loss forward (or, as
        # TRL's own tests do, on a stand-in trainer that never ran our __init__), it is TRL's method alone.
        forward = getattr(self, "_loss_forward", None)
        if isinstance(forward, LossForward):
            forward.entropy_mask = selected
        return selected

    @staticmethod
    def _replays(inputs: dict) -> bool:
        """Whether the generation batch of `inputs` holds replayed rows (the same answer on every rank)."""
        flag = inputs.get("exreplay_replaying")
        return flag is not None and bool(flag.numel()) and bool(flag[0])

    # ---------------------------------------------------------------------------------------------- metrics
    def _count(self, kind: str, message: str, number: int = 1) -> None:
        self._replay_counts[kind] += number
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("trl_exreplay: %s (counted in replay/%s; logged once).", message, kind)

    # ------------------------------------------------------------------------------------------- checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the model as `GRPOTrainer` does, and the pool beside it in `exreplay_pool/` (and, with guided
        rollouts, the experience store in `exreplay_experience/`; call on every rank).

        Checkpoints get the pool this way too: `Trainer._save_checkpoint` calls this first, with the checkpoint
        folder, before it pushes or rotates checkpoints.
        """
        super().save_model(output_dir, _internal_call)
        if self._replay_enabled or self._guidance_on:
            self._flush_pending()
        if self._guidance_on:
            self._save_experience(output_dir or self.args.output_dir)
        if self._replay_enabled:
            if self.args.should_save:
                self.pool.save(os.path.join(output_dir or self.args.output_dir, POOL_DIR))
                if self._schedule != ReplaySchedule():
                    self._schedule.save(output_dir or self.args.output_dir)
            elif self._pool_shared:
                # A save seals the open shard; the ranks that do not save seal theirs too, so that their shard files
                # stay the saving rank's, byte for byte, and can be linked rather than written (`share_storage`).
                self.pool.flush(wait=True)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if self._replay_enabled and checkpoint is not None:
            self._resume_pool(checkpoint)
            self._schedule = ReplaySchedule.load(checkpoint)
        if self._guidance_on and checkpoint is not None:
            self._resume_experience(checkpoint)


class _AtTrainEnd(TrainerCallback):
    """Flush the last step's outcomes (no further generation step would) and close idle environments."""

    def __init__(self, trainer: ExReplayGRPOTrainer):
        self.trainer = trainer

    def on_train_end(self, args, state, control, **kwargs):
        if self.trainer._replay_enabled or self.trainer._guidance_on:
            self.trainer._flush_pending()
        if self.trainer._guidance_on:
            self.trainer._summarizer.close()
        if self.trainer.text_env_factory is not None:
            self.trainer._rollout_engine.close()
