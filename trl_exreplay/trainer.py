"""`ExReplayGRPOTrainer`: TRL's `GRPOTrainer` with experience replay, as small overrides (listed in the class
docstring) that delegate to `PoolKeeper` (`keeper.py`: the pool's life) and `ReplayController` (`replay.py`: each
step's plan, splice and outcomes), and to the optional parts the arguments ask for (multi-turn games, experience-guided
rollouts), which it knows only as `parts.StepHooks`. The algorithm's pure parts are `planner.py`, `loss.py`,
`pool/rules.py` and `outcomes.py`; one step's state is a `step.GenerationStep`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer

from . import trl_seam
from .config import ReplaySettings, replay_settings
from .custom_rollouts import fresh_rows_rollout
from .distributed import (
    advise_exit_distributed,
    any_rank_active,
    check_multi_turn_vllm,
    generation_is_collective,
    uses_gloo_group,
    warn_launch_shortfall,
)
from .hub import CITATIONS
from .keeper import POOL_DIR, POOL_WORK_DIR, PoolKeeper
from .loss import OffPolicyOptions, off_policy_loss, reduce_as_trl
from .metrics import FaultCounts, log_fresh_completions, log_off_policy, trl_reward_metrics
from .parts import Policy, StepHooks
from .pool import ExperiencePool
from .replay import ReplayController
from .schedule import EpochSeededSampler
from .selection import policy_forward
from .step import GenerationStep, LossForward, attach_replay_tensors, splice_rescued
from .untrusted_text import SpecialTokenFilter

if TYPE_CHECKING:  # the optional parts' settings, named in the signature only
    from .envs.settings import MultiTurnSettings
    from .guidance import ExperienceProvider, GuidanceSettings

logger = logging.getLogger(__name__)

__all__ = ["POOL_DIR", "POOL_WORK_DIR", "ExReplayGRPOTrainer"]


class ExReplayGRPOTrainer(GRPOTrainer):
    r"""
    `GRPOTrainer` with experience replay (ExGRPO / AgentEvolver). Same arguments as [`trl.GRPOTrainer`], plus
    `experience_pool` to start from an existing pool, `text_env_factory` (with `multi_turn`, its
    `MultiTurnSettings`) for multi-turn games, and `guidance` (`GuidanceSettings`, with `experience_provider`) for
    experience-guided rollouts (`trl_exreplay.guidance`; off unless a rollout mode guides). Replay is configured by
    [`ExReplayGRPOConfig`]; a plain `GRPOConfig` replays with the default settings, and
    `enable_experience_replay=False` gives `GRPOTrainer` exactly.

    TRL methods it overrides, each calling `super()` (no TRL method body is copied), and why (what each assumes of TRL
    is written down in `trl_exreplay.trl_seam`):

    * `_get_train_sampler`: to draw each epoch's rows by the epoch's number (`schedule.EpochSeededSampler`), so that a
      resumed run draws the rows of the run that was not stopped (TRL's sampler starts again from the first epoch);
    * `_generate_and_score_completions`: to swap the planned replay tasks into their groups (the plan is drawn on
      global rows, identical on every rank), to tag the batch's replayed rows for the loss and queue its outcomes, and
      to take TRL's reward figures (`reward`, `frac_reward_zero_std`, ...) over the fresh rollouts, as `GRPOTrainer`
      means them (the batch as trained goes to `replay/trained_reward`, `replay/zero_std_trained`);
    * `_generate`: to take TRL's completion figures (lengths, clipped ratio) over the fresh rows too;
    * `_generate_single_turn`: to generate the fresh rows only and splice in the replayed completions, and to give
      the guided rows of `discard` tasks their prompt without the experience in the list TRL trains on;
    * `_tokenize_prompts`: to tokenize the guided copies of experience-guided rows (TRL's own tokenisation, called
      again) and sample them on those;
    * `_tool_call_loop`: so that TRL's tool loop (`tools`, `environment_factory`) skips replayed rows, which are
      finished episodes, keeps their tool results masked, and runs in lockstep over ranks where generation is
      collective (ZeRO-3, FSDP);
    * `_get_tool_suffix_ids`: with `tool_special_tokens='remove'`, to remove the spellings of special tokens from tool
      results where TRL tokenizes them, once each (`reset()` observations of `environment_factory` environments are
      cleaned by wrapping each instance's `reset`: TRL has no method between the call and the prompt);
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
    from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer

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
    _pool_keeper: PoolKeeper | None = None  # the run's pool: made, shared, saved, resumed (`trl_exreplay.keeper`)
    _replay: ReplayController | None = None  # each step's plan, splice and outcomes (`trl_exreplay.replay`)
    _user_rollout_func = None  # a user's `rollout_func`, asked for the fresh rows only while replay runs
    _replay_enabled = False
    _parts: tuple[StepHooks, ...] = ()  # the optional parts the arguments asked for (`_attach_parts`)
    _plans_training = False  # training batches are planned (replay, or a part that needs the plan)
    _reads_outcomes = False  # each step's outcomes are queued and flushed (replay, or a part that reads them)
    _generation: GenerationStep | None = None  # the generation step in progress (see `trl_exreplay.step`)
    _loss_forward: LossForward | None = None  # TRL's loss forward in progress (see `_compute_loss`)
    _tool_text: SpecialTokenFilter | None = None  # TRL's tool results and resets, with tool_special_tokens='remove'
    text_env_factory = None

    def __init__(
        self,
        model,
        reward_funcs=None,
        args=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
        *,
        experience_pool: ExperiencePool | None = None,
        text_env_factory: Callable[[], object] | None = None,
        multi_turn: MultiTurnSettings | None = None,
        guidance: GuidanceSettings | None = None,
        experience_provider: ExperienceProvider | None = None,
    ):
        """`GRPOTrainer`'s parameters (see [`trl.GRPOTrainer`]), then ours."""
        if text_env_factory is not None and reward_funcs is None:
            from .envs.base import env_reward  # the environment's reward, unless the user scores rollouts

            reward_funcs = env_reward
        if getattr(args, "use_vllm", False):  # before TRL starts vLLM or waits for its server
            if text_env_factory is not None:
                check_multi_turn_vllm(args.vllm_mode, args.vllm_tensor_parallel_size)
            if (tools or environment_factory is not None) and getattr(args, "enable_experience_replay", True):
                path = "Experience replay through TRL's tool loop (`tools`, `environment_factory`)"
                check_multi_turn_vllm(args.vllm_mode, args.vllm_tensor_parallel_size, path)
        super().__init__(
            model,
            reward_funcs,
            args,
            train_dataset,
            eval_dataset,
            processing_class,
            reward_processing_classes,
            callbacks,
            optimizers,
            quantization_config,
            peft_config,
            tools,
            rollout_func,
            environment_factory,
        )
        warn_launch_shortfall(self.accelerator.num_processes)  # a launch of N processes that runs fewer says so
        self.settings: ReplaySettings = replay_settings(self.args)  # made and checked once, read as attributes
        if trl_seam.is_vision_language(self) and self.settings.enable_experience_replay:
            # The pool stores token ids, not the images a replayed row would need: the run trains as GRPOTrainer.
            logger.warning(
                "trl_exreplay: experience replay is off for this run: the processing class is a processor, so the "
                "model is a vision-language model, and the pool cannot store the images a replayed row would need. "
                "It trains as GRPOTrainer; `enable_experience_replay=False` silences this warning."
            )
            self.settings = dataclasses.replace(self.settings, enable_experience_replay=False)
        self._replay_enabled = self.settings.enable_experience_replay
        if self.settings.tool_special_tokens == "remove" and (self.tools or self.environment_factories is not None):
            self._tool_text = SpecialTokenFilter(trl_seam.text_tokenizer(self), "remove")
            if self.environment_factories is not None:
                self._clean_environment_resets()
        if self._replay_enabled and self.rollout_func is not None:
            self._user_rollout_func, self.rollout_func = self.rollout_func, self._replaying_rollout
        self.text_env_factory = text_env_factory
        self._faults = FaultCounts()  # faults and mismatches, logged once per kind
        trl_paths = {  # what of TRL this run uses, for the parts to refuse what they cannot take
            "tools or environment_factory (TRL's tool loop)": bool(tools) or environment_factory is not None,
            "a custom rollout_func": rollout_func is not None,
            "vision-language models": trl_seam.is_vision_language(self),
        }
        self._parts = self._attach_parts(text_env_factory, multi_turn, guidance, experience_provider, trl_paths)
        if any(part.generates for part in self._parts):
            self.rollout_func = self._part_rollout
        parts_plan = any(part.plans_training for part in self._parts)
        self._plans_training = self._replay_enabled or parts_plan
        self._reads_outcomes = self._replay_enabled or any(part.reads_outcomes for part in self._parts)
        self._pool_keeper = PoolKeeper(
            self.settings,
            accelerator=self.accelerator,
            num_generations=self.num_generations,
            seed=self.args.seed,
            output_dir=self.args.output_dir,
            processing_class=self.processing_class,
            model=self.model,
            experience_pool=experience_pool,
            reads_pool=any(part.reads_pool for part in self._parts),
        )
        self._replay = ReplayController.for_trainer(
            self,
            self._pool_keeper,
            self._faults,
            policy_forward=self._policy_forward,
            parts_plan=parts_plan,
        )
        if self._replay_enabled or self._parts:
            self.add_callback(_TrainingEvents(self))

    def _attach_parts(self, text_env_factory, multi_turn, guidance, experience_provider, trl_paths):
        """The optional parts the arguments ask for, each made by its own factory (which reads this trainer once) and
        known to the trainer from here on only as a `parts.StepHooks`: the one place that imports them, and only when
        asked. Guidance comes first: the multi-turn games retrieve through it."""
        parts, guided = [], None
        if guidance is not None or experience_provider is not None:
            from .guidance.rollouts import guided_rollouts

            guided = guided_rollouts(
                self, guidance, experience_provider, self._faults, trl_paths, policy_forward=self._policy_forward
            )
        if text_env_factory is not None:
            from .envs.multiturn import MultiTurnRollouts
            from .envs.settings import MultiTurnSettings

            settings = multi_turn or MultiTurnSettings()
            parts.append(MultiTurnRollouts.for_trainer(text_env_factory, self, settings, self.settings, guide=guided))
        if guided is not None:
            parts.append(guided)
        return tuple(parts)

    @property
    def pool(self) -> ExperiencePool:
        """The experience pool: what this run stored (and, once replay starts, replays)."""
        return self._pool_keeper.pool

    # -------------------------------------------------------------------------------------------- generation
    def _get_train_sampler(self, dataset=None):
        sampler = super()._get_train_sampler(dataset)
        # TRL's sampler, its epochs drawn by number: a resumed run draws the rows the run that was not stopped draws
        return EpochSeededSampler(sampler) if self._replay_enabled else sampler

    def _generate_and_score_completions(self, inputs):
        if not self.model.training or not self._plans_training:
            output = self._generate_unplanned(inputs)
        else:
            self._generation = step = self._plan_generation(inputs)
            try:
                output = super()._generate_and_score_completions(step.rows)
                self._finish_generation(output, step)
            finally:
                self._generation = None
        if self._tool_text is not None:
            self._log_tool_text()
        return output

    def _generate(self, prompts: list):
        result = super()._generate(prompts)
        step = self._generation
        if step is not None and step.plan is not None and step.plan.replay_groups:  # the plan is global: every rank
            # TRL's completion figures, over the fresh rows as in GRPOTrainer (replayed rows are stored trajectories)
            completion_ids = trl_seam.returned(result, "_generate", "completion_ids")
            tool_mask = trl_seam.returned(result, "_generate", "tool_mask")
            fresh = [i not in step.replayed_local for i in range(len(completion_ids))]
            eos_and_pad = [*self.eos_token_ids, trl_seam.text_tokenizer(self).pad_token_id]
            metrics = trl_seam.logged_metrics(self, "train")
            log_fresh_completions(metrics, self.accelerator, completion_ids, tool_mask, fresh, eos_and_pad)
        return result

    def _generate_unplanned(self, inputs):
        """Evaluation, or training without a plan: TRL's generation on the rows as they are (a part may rewrite them:
        multi-turn rows get their placeholder prompt); in evaluation, the parts take part (guided evaluation)."""
        self._generation = step = GenerationStep(rows=[self._row(row) for row in inputs])
        evaluating, global_step = not self.model.training, self.state.global_step
        try:
            if evaluating:
                for part in self._parts:
                    part.batch_planned(step, training=False, global_step=global_step)
            output = super()._generate_and_score_completions(step.rows)
            if evaluating:
                for part in self._parts:
                    part.batch_finished(
                        output,
                        step,
                        training=False,
                        records={},
                        success=[],
                        fresh_rows=[],
                        metrics=trl_seam.logged_metrics(self, "eval"),
                        global_step=global_step,
                    )
            return output
        finally:
            self._generation = None

    def _plan_generation(self, inputs) -> GenerationStep:
        """A training generation batch's plan, the same on every rank: which groups replay which stored trajectories
        (`ReplayController.plan`), and what the parts decide on it (which rows are guided)."""
        self._flush_pending()
        for part in self._parts:
            part.step_begins(self.state.global_step, self.pool)
        # Several generation batches share a global step when steps_per_generation < gradient_accumulation_steps;
        # the micro-step index (identical on every rank, 0 at every step boundary, so resume-safe) tells them apart.
        state, metrics = self.state, trl_seam.logged_metrics(self, "train")
        step = self._replay.plan(
            inputs,
            global_step=state.global_step,
            max_steps=state.max_steps,
            micro_step=trl_seam.micro_step(self),
            metrics=metrics,
        )
        step.rows = [self._row(row) for row in step.task_rows]
        # When TRL runs its old-log-probs forward (right after generation), its entropies are the generating policy's.
        step.wants_entropies = trl_seam.computes_old_logps(self)
        for part in self._parts:
            part.batch_planned(step, training=True, global_step=state.global_step)
        return step

    def _finish_generation(self, output: dict, step: GenerationStep) -> None:
        """After TRL's generation and scoring: the replay tensors the loss reads, the parts' off-policy rows (guided
        rows trained without their guidance), the outcomes queued for the pool, the step's metrics."""
        off_policy_parts = [part for part in self._parts if part.trains_off_policy()]  # the same on every rank
        if step.rescued:  # the stored successes TRL's advantages were computed with, in place of the failed rollouts
            splice_rescued(output, step.rescued_local, trl_seam.text_tokenizer(self).pad_token_id)
        replaying = bool(step.plan.replay_groups) or bool(step.rescued) or bool(off_policy_parts)
        attach_replay_tensors(output, {**step.replayed_local, **step.rescued_local}, replaying=replaying)
        if step.rescued:  # TRL's normaliser of the "dapo" loss type, counted again over the spliced rows (collective)
            output["num_items_in_batch"] = trl_seam.count_loss_tokens(self.accelerator, output)
        for part in off_policy_parts:
            part.mark_off_policy_rows(output, step)
        metrics, global_step = trl_seam.logged_metrics(self, "train"), self.state.global_step
        if self._replay_enabled:
            self._log_fresh_rewards(step, metrics)
        success, fresh_rows, records = self._replay.queue_outcomes(
            output, step, reward_weights=self.reward_weights, global_step=global_step, metrics=metrics
        )
        for part in self._parts:
            part.batch_finished(
                output,
                step,
                training=True,
                records=records,
                success=success,
                fresh_rows=fresh_rows,
                metrics=metrics,
                global_step=global_step,
            )
        if self._replay_enabled:
            self._replay.log_generation(step, metrics, global_step=global_step, max_steps=self.state.max_steps)

    def _log_fresh_rewards(self, step: GenerationStep, metrics) -> None:
        """TRL's reward figures of this batch, as `GRPOTrainer` means them: over the fresh rollouts, a rescued row with
        its own (failed) reward. TRL took them over the batch as trained, replayed and rescued rows with their recorded
        rewards: those values go to `replay/trained_reward` and `replay/zero_std_trained`. A batch with neither keeps
        TRL's values as they are."""
        trained = {
            "replay/trained_reward": metrics["reward"][-1],
            "replay/zero_std_trained": metrics["frac_reward_zero_std"][-1],
        }
        if step.plan.replay_groups or step.rescued:  # global: the same on every rank; no collective
            fresh = step.rewards.clone()  # as scored (rescued rows are the failures they were), replayed rows recorded
            fresh[step.plan.replayed_rows()] = torch.nan  # left out, as TRL leaves out a row no function scored
            figures = trl_reward_metrics(
                fresh,
                self.reward_weights,
                self.reward_func_names,
                self.num_generations,
                self.scale_rewards,
                self.multi_objective_aggregation,
            )
            for name, value in figures.items():
                metrics[name][-1] = value
        for name, value in trained.items():
            metrics[name].append(value)

    def _flush_pending(self) -> None:
        """The last step's outcomes into the pool, what the parts attached to them back to the parts. Collective."""
        summaries = self._replay.flush()
        for part in self._parts:
            part.outcomes_flushed(summaries)

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        forward = self._loss_forward
        if forward is not None and forward.logps is None:  # TRL's loss makes one policy forward: the first call
            logps, entropies, aux = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
            forward.logps, forward.entropies = logps, entropies
            inputs, pending = forward.inputs, self._replay.pending
            if pending is not None and self.model.training:  # the pool's records take this forward's values
                pending.capture(inputs["exreplay_row"].tolist(), logps, entropies, trl_seam.loss_mask(inputs))
            return logps, entropies, aux
        step = self._generation
        if step is None or not step.wants_entropies or step.entropies is not None or model is not self.model:
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        # TRL's first policy forward of a generation step is the old-log-probs one (`trl_seam.GENERATION_CALLS`).
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(
            model, *args, **{**kwargs, "compute_entropy": True}
        )
        step.entropies = entropies.detach()
        return logps, (entropies if kwargs.get("compute_entropy") else None), aux

    def _replay_started(self) -> bool:
        return self._replay.started(self.state.global_step, self.state.max_steps)

    def _vllm_equal_shares(self) -> bool:
        """Whether vLLM slices its output by equal per-rank shares (server mode, tensor parallelism)."""
        return self.use_vllm and (self.vllm_mode == "server" or self.vllm_tensor_parallel_size > 1)

    def _part_rollout(self, prompts, trainer) -> dict:
        """TRL's `rollout_func` where a part generates (the multi-turn games): its rollout of the step, played by this
        policy as it is now (`parts.Policy`: the model TRL wrapped, vLLM's engine, the generation settings)."""
        dist = trl_seam.distributed_mode(self)
        policy = Policy(
            model=self.model_wrapped,
            vllm_engine=self.vllm_generation if self.use_vllm else None,
            accelerator=self.accelerator,
            dist=dist,
            ds3_gather=self.args.ds3_gather_for_generation,
            generation_kwargs=self.generation_kwargs,
            gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            pad_token_id=self.processing_class.pad_token_id,
            eos_token_ids=self.eos_token_ids,
            generation_config=self.generation_config,
        )
        part = next(part for part in self._parts if part.generates)
        return part.rollout(
            self._generation,
            policy,
            collective=generation_is_collective(self.accelerator, dist),
            metrics=trl_seam.logged_metrics(self),
            fit_completion=self._replay.fit_completion,
        )

    def _replaying_rollout(self, prompts, trainer) -> dict:
        """TRL's `rollout_func` with replay: the user's, asked for the fresh rows only (`custom_rollouts`)."""
        step = self._generation
        replayed = step.take_replay() if step is not None else None
        if replayed is None:
            return self._user_rollout_func(prompts, trainer)
        padding = self._replay.padding_rows(step, len(prompts) - len(replayed), self._vllm_equal_shares())
        return fresh_rows_rollout(
            self._user_rollout_func, prompts, trainer, replayed, padding, self._replay.fit_completion
        )

    def _policy_forward(self, prompts: list, completions: list, model_masks: list, compute_entropy: bool = False):
        """One no-grad forward of the current policy (`selection.policy_forward`), through TRL's own forward (not this
        class's override, which keeps the loss's and the generation's forwards): the pool's selection by current
        entropy and guided rollouts' discarded rows take it."""
        return policy_forward(
            super()._get_per_token_logps_and_entropies,
            self.model,
            prompts,
            completions,
            model_masks,
            compute_entropy,
            device=self.accelerator.device,
            pad_token_id=getattr(self.processing_class, "pad_token_id", 0),
            batch_size=self.args.per_device_train_batch_size,
        )

    def _row(self, row: dict) -> dict:
        """A dataset row as TRL is to generate from it (each part may rewrite it)."""
        for part in self._parts:
            row = part.row(row)
        return row

    def _tokenize_prompts(self, prompts: list):
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        if self._generation is not None:  # guided rows: sampled on their guided prompt
            for part in self._parts:
                part.prompts_tokenized(self._generation, prompts, prompt_ids, super()._tokenize_prompts)
        return prompt_ids, images, multimodal_fields

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        step = self._generation
        if step is not None and step.tool_loop_lockstep:
            # this rank's vote that it plays one more round of TRL's tool loop (see `_tool_call_loop`)
            any_rank_active(self.accelerator, True)
        result = None
        if step is not None:
            generate = functools.partial(
                super()._generate_single_turn, multimodal_fields=multimodal_fields, has_tool_images=has_tool_images
            )
            multimodal = images is not None or bool(multimodal_fields)
            result = self._replay.generate(
                step,
                prompt_ids,
                generate,
                num_generations,
                multimodal=multimodal,
                use_vllm=self.use_vllm,
                equal_shares=self._vllm_equal_shares(),
            )
        if result is None:
            if step is not None:
                for part in self._parts:  # guided rows: a group's rows hold different prompts
                    num_generations = part.samples_per_prompt(num_generations, self.use_vllm)
            result = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        if step is not None:
            for part in self._parts:
                part.generated(step, prompt_ids)  # in the list TRL keeps: what its loss trains on
        return result

    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        step = self._generation
        collective = generation_is_collective(self.accelerator, trl_seam.distributed_mode(self))
        if step is None or not self._replay_enabled or (step.plan is None and not collective):
            return super()._tool_call_loop(
                prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields
            )
        for i in step.replayed_local:  # a finished episode, tool results included: its tool calls are not run again
            text = self.processing_class.decode(completion_ids[i], skip_special_tokens=True)
            completions[i] = [{"role": "assistant", "content": text}]
        # Ranks take different numbers of tool rounds; where generation is collective, each round is agreed on.
        step.tool_loop_lockstep = collective
        try:
            result = super()._tool_call_loop(
                prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields
            )
            while step.tool_loop_lockstep and any_rank_active(self.accelerator, False):
                super()._generate_single_turn([prompt_ids[0]], None, {}, 1)  # a round another rank still plays
        finally:
            step.tool_loop_lockstep = False
        tool_mask = trl_seam.returned(result, "_tool_call_loop", "tool_mask")
        for i, trajectory in step.replayed_local.items():  # tool results masked out of the loss, as TRL masks them
            tool_mask[i] = list(trajectory.completion_mask[: len(completion_ids[i])])
        return result

    def _get_tool_suffix_ids(self, tool_messages):
        if self._tool_text is not None:
            # In place: the message TRL keeps in the completion (what reward functions and logs read) is then the text
            # the model sees. Each result passes here once, in the round that adds it.
            for message in tool_messages:
                message["content"] = self._tool_text.content(message["content"])
        return super()._get_tool_suffix_ids(tool_messages)

    def _clean_environment_resets(self) -> None:
        """TRL appends an `environment_factory` environment's `reset()` observation to the prompt inside
        `_generate_and_score_completions`, with no method of its own in between: each instance's `reset` is wrapped
        instead (an instance attribute; the class's methods, which TRL lists as tools, stay as they are): the instances
        TRL built already, and those its factories build later (the user's factory mapping itself is left alone)."""
        clean = self._tool_text

        def cleaned(environment):
            environment.reset = functools.partial(_cleaned_reset, environment.reset, clean)
            return environment

        for environment in trl_seam.environment_instances(self):
            cleaned(environment)
        self.environment_factories = {
            name: functools.partial(_cleaned_instance, factory, cleaned)
            for name, factory in self.environment_factories.items()
        }

    def _log_tool_text(self) -> None:
        """`env/special_tokens_removed` of TRL's tool loop: a running total over ranks. Collective: every rank
        generates every batch."""
        local = torch.tensor([float(self._tool_text.removed)], device=self.accelerator.device)
        total = self.accelerator.reduce(local, reduction="sum").item()
        trl_seam.logged_metrics(self)["env/special_tokens_removed"] = [total]

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        infinite = torch.isinf(rewards_per_func)
        if infinite.any():
            # TRL would carry an infinite reward into the advantages (NaN loss, or a group that swamps the others);
            # it becomes a missing reward (NaN), which TRL handles: left out of the sum over reward functions.
            message = "a reward function returned an infinite reward; it is treated as missing"
            self._faults.count("nonfinite_rewards", message, int(infinite.sum()))
            rewards_per_func = rewards_per_func.masked_fill(infinite, float("nan"))
        step = self._generation
        if step is None or step.plan is None:
            return rewards_per_func
        # Replayed rows' tool calls are not run again and their environments are not played: with tools, what the
        # reward functions see of them says nothing to compare the recorded rewards with.
        self._replay.put_recorded_rewards(step, rewards_per_func, compare=not self.tools and self.environments is None)
        step.rewards = rewards_per_func  # as scored: the outcomes count a rescued row as the failure it was
        kept_rows = set().union(*(part.rescue_skips_rows() for part in self._parts))
        return self._replay.rescue(
            step,
            rewards_per_func,
            self.reward_weights,
            global_step=self.state.global_step,
            metrics=trl_seam.logged_metrics(self, "train"),
            skip_rows=kept_rows,
        )

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
        unclipped = self.settings.replay_unclipped_fresh and self._replay_started() and self.model.training
        # ExGRPO's loss_remove_clip: TRL's loss with no clip range, once replay runs
        with trl_seam.clip_range_removed(self) if unclipped else contextlib.nullcontext():
            try:
                loss = super()._compute_loss(model, inputs)
            finally:
                self._loss_forward = None
        if replaying:
            loss = loss + self._off_policy_term(inputs, advantages, forward)
        return loss

    def _off_policy_term(self, inputs: dict, advantages: torch.Tensor, forward: LossForward) -> torch.Tensor:
        if forward.logps is None:
            raise RuntimeError(
                "TRL's _compute_loss made no policy forward through _get_per_token_logps_and_entropies, so the "
                "replayed tokens' term has no log-probs: a subclass that overrides one of them must call super()."
            )
        training, logps = self.model.training, forward.logps
        mask = trl_seam.loss_mask(inputs)
        behaviour = inputs["recorded_per_token_logps"] if self.settings.replay_importance_sampling else logps.detach()
        options = OffPolicyOptions.from_config(
            self.args,
            self.settings,
            loss_type=self.loss_type,
            importance_sampling_level=self.importance_sampling_level,
            epsilon_low=self.epsilon_low,
            off_policy_mask_threshold=self.off_policy_mask_threshold,
        )
        per_token_loss, metrics = off_policy_loss(
            logps,
            behaviour,
            advantages,
            inputs["exp_mask"] * mask,
            options,
            token_mask=forward.entropy_mask,  # TRL's `top_entropy_quantile` selection, fresh and replayed alike
        )
        log_off_policy(trl_seam.logged_metrics(self), self.accelerator, metrics)
        return reduce_as_trl(
            per_token_loss,
            mask,
            loss_type=self.loss_type,
            training=training,
            num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=self.accelerator.num_processes,
            accumulation=self.current_gradient_accumulation_steps,
            steps_per_generation=self.args.steps_per_generation,
            max_completion_length=self.max_completion_length,
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

    # ------------------------------------------------------------------------------------------- checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the model as `GRPOTrainer` does, and the pool beside it in `exreplay_pool/` (and, with guided
        rollouts, the experience store in `exreplay_experience/`; call on every rank).

        Checkpoints get the pool this way too: `Trainer._save_checkpoint` calls this first, with the checkpoint
        folder, before it pushes or rotates checkpoints.
        """
        super().save_model(output_dir, _internal_call)
        if self._reads_outcomes:
            self._flush_pending()
        for part in self._parts:
            part.save(output_dir or self.args.output_dir, self.args.should_save)
        if self._replay_enabled:
            self._pool_keeper.save(output_dir or self.args.output_dir, self.args.should_save)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if self._replay_enabled and checkpoint is not None:
            self._pool_keeper.resume(checkpoint)
            self._replay.pending = None  # outcomes of the steps before the checkpoint's: recorded there already
        if checkpoint is not None:
            for part in self._parts:
                part.resume(checkpoint)


class _TrainingEvents(TrainerCallback):
    """Stop once the last batch of a run whose questions are all retired is trained; at the end of training, flush the
    last step's outcomes (no further generation step would) and close idle environments."""

    def __init__(self, trainer: ExReplayGRPOTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        # Not when the batch is planned: the Trainer would stop after the micro-batch in progress, leaving the rest of
        # the batch's micro-batches (and the optimizer step) undone.
        stops_after = self.trainer._replay.stops_after
        if stops_after is not None and state.global_step >= stops_after:
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.trainer._reads_outcomes:
            self.trainer._flush_pending()
        if state.is_world_process_zero and uses_gloo_group():
            # Said at exit, only if the script did not end with exit_distributed(); the trainer cannot end the process
            # for the script: an `atexit` hook would not know the script's exit status
            # (a `sys.exit(1)` would become 0).
            advise_exit_distributed()
        for part in self.trainer._parts:
            part.train_ended()


def _cleaned_reset(reset, clean: SpecialTokenFilter, *args, **kwargs):
    """`reset(*args, **kwargs)`'s observation (None, a str or content blocks) with its spelled special tokens
    removed."""
    return clean.content(reset(*args, **kwargs))


def _cleaned_instance(factory, cleaned, *args, **kwargs):
    return cleaned(factory(*args, **kwargs))
