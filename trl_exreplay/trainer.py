"""`ExReplayGRPOTrainer`: TRL's `GRPOTrainer` with experience replay. Thin glue over small overrides.

Overrides (each calls `super()` and post-processes; no TRL method body is copied):

* `_generate_and_score_completions`: plan the replay groups on global rows (identical on every rank), swap replay
  tasks into their groups, call `super()`, then attach `exp_mask` and the recorded log-probs to the batch and queue
  the step's outcomes for the pool;
* `_generate_single_turn`: generate the fresh rows only and splice in the replayed completions;
* `_calculate_rewards`: replayed rows keep their recorded rewards (they still count in their group's mean and std);
* `_compute_loss`: TRL's loss (replayed rows at advantage 0 there) plus the replayed tokens' term of `loss.py`;
* `_get_per_token_logps_and_entropies`: keeps TRL's loss forward (for that term and the pool's records, no extra
  forward) and the entropies of its old-log-probs forward (the generating policy's, for the pool);
* `save_model` / `_load_optimizer_and_scheduler`: the pool travels with every checkpoint (an incremental save: the
  checkpoint hard-links the shards it shares with the previous one, so TRL's rotation under `save_total_limit` prunes
  the pool with the checkpoint).
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback
from trl import GRPOTrainer
from trl.trainer.utils import pad

from . import compat  # noqa: F401 - refuses a TRL outside the supported range
from .config import replay_options, validate_replay_options
from .envs import env_reward
from .hub import CITATIONS
from .loss import TOKEN_SUM_LOSS_TYPES, aggregate_loss, off_policy_loss
from .multiturn import MultiTurnRollouts, check_multi_turn_vllm
from .planner import ReplayPlan, plan_replay
from .pool import ExperiencePool, TaskOutcome, Trajectory, task_key, tokenizer_fingerprint
from .step import GenerationStep, LossForward, PendingOutcomes

logger = logging.getLogger(__name__)

POOL_DIR = "exreplay_pool"
# The live pool's shards, under output_dir (same disk as the checkpoints, so saves hard-link instead of copying); the
# leading underscore keeps it out of `Trainer.push_to_hub` uploads.
POOL_WORK_DIR = "_exreplay_pool_work"


class ExReplayGRPOTrainer(MultiTurnRollouts, GRPOTrainer):
    r"""
    `GRPOTrainer` with experience replay (ExGRPO / AgentEvolver). Same arguments as [`trl.GRPOTrainer`], plus
    `experience_pool` to start from an existing pool. Replay is configured by [`ExReplayGRPOConfig`]; a plain
    `GRPOConfig` replays with the default settings, and `enable_experience_replay=False` gives `GRPOTrainer` exactly.

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

    def __init__(
        self,
        *args,
        experience_pool: ExperiencePool | None = None,
        env_factory: Callable[[], object] | None = None,
        **kwargs,
    ):
        if env_factory is not None and len(args) < 2 and kwargs.get("reward_funcs") is None:
            kwargs["reward_funcs"] = env_reward  # the environment's reward, unless the user scores rollouts
        config = args[2] if len(args) > 2 else kwargs.get("args")
        if env_factory is not None and getattr(config, "use_vllm", False):  # before TRL starts vLLM or waits for it
            check_multi_turn_vllm(config.vllm_mode, config.vllm_tensor_parallel_size)
        super().__init__(*args, **kwargs)
        self.replay = replay_options(self.args)
        validate_replay_options(self.replay, self.num_generations, self.args.generation_batch_size)
        self._replay_enabled = bool(self.replay["enable_experience_replay"])
        if self._replay_enabled:
            self._check_supported()
        self.env_factory = env_factory
        self._generation: GenerationStep | None = None  # the generation step in progress (see `trl_exreplay.step`)
        if env_factory is not None:
            self._setup_multi_turn(env_factory)
        rbound = self.replay["experience_rbound"]
        self._pool_settings = {
            "max_trajectories_per_task": self.replay["max_trajectories_per_task"],
            "experience_lbound": self.replay["experience_lbound"],
            "experience_rbound": self.num_generations if rbound is None else rbound,
            "exp_select_mode": self.replay["exp_select_mode"],
            "pool_store_mode": self.replay["pool_store_mode"],
            "max_policy_age": self.replay["max_policy_age"],
            "replay_window": self.replay["replay_window"],
            "seed": self.args.seed,
        }
        self._tokenizer_fingerprint = tokenizer_fingerprint(self.processing_class) if self._replay_enabled else None
        self._vocab_size = _vocab_size(self.model)
        self.pool = ExperiencePool(**self._pool_settings, work_dir=self._pool_work_dir())
        if self._vocab_size is not None:
            self.pool.set_vocab_size(self._vocab_size)
        if self._tokenizer_fingerprint is not None:
            self.pool.bind_tokenizer(self._tokenizer_fingerprint)
        if experience_pool is not None:
            self._adopt_pool(experience_pool, "the given experience_pool")
        if self._replay_enabled or env_factory is not None:
            self.add_callback(_AtTrainEnd(self))
        self._pending: PendingOutcomes | None = None  # the last step's outcomes, recorded in the pool later
        self._loss_forward: LossForward | None = None  # TRL's loss forward in progress (see `_compute_loss`)
        self._replay_counts: Counter = Counter()  # faults and mismatches, logged once per kind
        self._warned: set[str] = set()

    # ------------------------------------------------------------------------------------------------ checks
    def _check_supported(self) -> None:
        """Refuse, before any step, what replay cannot train (docs/support.md gives each reason)."""
        if self._is_vlm:
            raise ValueError(
                "Experience replay with vision-language models is not supported yet; set `enable_experience_replay="
                "False`."
            )
        if self.tools or self.rollout_func is not None or self.environment_factories is not None:
            raise ValueError(
                "Experience replay of TRL tool calls, a custom `rollout_func` or TRL's `environment_factory` is not "
                "supported: use `env_factory` (a `trl_exreplay.envs.TextEnv`) for multi-turn replay, or set "
                "`enable_experience_replay=False`."
            )

    # -------------------------------------------------------------------------------------------- generation
    def _generate_and_score_completions(self, inputs):
        if not self._replay_enabled or not self.model.training:
            self._generation = GenerationStep(rows=[self._with_prompt(row) for row in inputs])
            try:
                return super()._generate_and_score_completions(self._generation.rows)
            finally:
                self._generation = None
        self._flush_pending()
        num_generations = self.num_generations
        rank, local_rows = self.accelerator.process_index, len(inputs)
        offset = rank * local_rows
        column = self.replay["task_id_column"]
        row_keys = gather_object([task_key(x, column) for x in inputs])
        group_keys = row_keys[::num_generations]
        step = self.state.global_step
        # Several generation batches share a global step when steps_per_generation < gradient_accumulation_steps;
        # the micro-step index (identical on every rank, 0 at every step boundary, so resume-safe) tells them apart.
        draw_seed = [self.args.seed, step, self._step % self.args.gradient_accumulation_steps]

        plan = ReplayPlan(num_generations, self.replay["offpolicy_trajectories_per_task"], {})
        if self._replay_started():
            plan = plan_replay(
                group_keys,
                self.pool.replay_buckets(  # drawn from in O(batch), whatever the pool's size
                    plan.num_replayed, step, self.replay["max_policy_age"], self.replay["replay_window"]
                ),
                exp_ratio=self.replay["exp_ratio"],
                num_generations=num_generations,
                num_replayed=plan.num_replayed,
                weighting=self.replay["replay_bucket_weighting"],
                seed=draw_seed,
            )
        selected = self._select_trajectories(plan, step, draw_seed)

        task_rows, replayed_local = [], {}  # the dataset rows as they are (stored with trajectories)
        for i, row in enumerate(inputs):
            global_row = offset + i
            group, position = divmod(global_row, num_generations)
            task_id = plan.replay_groups.get(group)
            if task_id is not None and task_id != group_keys[group]:
                row = self.pool.task_row(task_id)
            if plan.is_replayed(global_row):
                replayed_local[i] = selected[task_id][position - (num_generations - plan.num_replayed)]
            task_rows.append(row)
        new_inputs = [self._with_prompt(row) for row in task_rows]
        row_tasks = [plan.task_of_row(r, group_keys) for r in range(len(row_keys))]
        fresh_per_rank = [
            sum(not plan.is_replayed(r) for r in range(start, start + local_rows))
            for start in range(0, len(row_keys), local_rows)
        ]

        self._generation = GenerationStep(
            rows=new_inputs,
            plan=plan,
            selected=selected,
            replayed_local=replayed_local,
            fresh_per_rank=fresh_per_rank,
            # When TRL runs its old-log-probs forward (right after generation), its entropies are the generating
            # policy's.
            wants_entropies=self._trl_computes_old_logps(),
        )
        try:
            output = super()._generate_and_score_completions(new_inputs)
            self._attach_replay_tensors(output, replayed_local, replaying=bool(plan.replay_groups))
            self._queue_outcomes(output, task_rows, row_tasks, self._generation, offset)
            self._log_generation_metrics(plan, len(row_keys), step)
        finally:
            self._generation = None
        return output

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
            self._capture(inputs, logps, entropies, inputs["completion_mask"] * inputs.get("tool_mask", 1))
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
        max_steps = max(self.state.max_steps, 1)
        return self.state.global_step / max_steps >= self.replay["replay_start_ratio"]

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        replayed = self._generation.take_replay() if self._generation is not None else None
        if replayed is None:
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
            if logprobs is not None:
                logprobs[i] = trajectory.logps[: len(completion_ids[i])]
            if list(prompt_ids[i]) != trajectory.prompt_ids:
                self._count("prompt_mismatch", "a replayed trajectory's prompt tokenizes differently now")
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
        plan, selected = step.plan, step.selected
        k = plan.num_replayed
        for group, task_id in plan.replay_groups.items():
            for j, trajectory in enumerate(selected[task_id]):
                row = group * plan.num_generations + plan.num_generations - k + j
                recorded = torch.tensor(trajectory.rewards, dtype=rewards_per_func.dtype)
                if recorded.numel() != rewards_per_func.size(1):
                    self._count("reward_arity_mismatch", "recorded rewards do not match the reward functions")
                    continue
                recorded = recorded.to(rewards_per_func.device)
                if not torch.allclose(rewards_per_func[row], recorded, equal_nan=True, atol=1e-4):
                    self._replay_counts["reward_mismatch"] += 1
                rewards_per_func[row] = recorded
        step.rewards = rewards_per_func
        return rewards_per_func

    def _select_trajectories(self, plan: ReplayPlan, step: int, seed=None) -> dict[str, list[Trajectory]]:
        k, age, window = plan.num_replayed, self.replay["max_policy_age"], self.replay["replay_window"]
        mode = self.replay["exp_select_mode"]
        rng = np.random.default_rng([*(seed or [self.args.seed, step]), 1])
        if not self.replay["use_current_policy_entropy"] or mode == "random":
            # By saved entropy (or at random): chosen on the pool's index; only the chosen trajectories are read.
            return self.pool.choose(list(plan.replay_groups.values()), k, step, age, window, rng)
        # By entropy under the current policy: every candidate of a task with more than k is scored.
        candidates = {t: self.pool.candidates(t, step, age, window) for t in plan.replay_groups.values()}
        entropies: dict[str, list[float]] = {}
        ranked = [t for t in candidates if len(candidates[t]) > k]
        flat = [trajectory for t in ranked for trajectory in candidates[t]]
        values = self._current_policy_entropies(flat)
        start = 0
        for t in ranked:
            entropies[t] = values[start : start + len(candidates[t])]
            start += len(candidates[t])
        return {t: self.pool.select(c, k, entropies.get(t), rng) for t, c in candidates.items()}

    @torch.no_grad()
    def _current_policy_entropies(self, trajectories: list[Trajectory]) -> list[float]:
        """Mean entropy of each trajectory's model tokens under the current policy.

        Sharded over processes (rank r scores trajectories r, r+W, ...), every rank making the same number of forward
        calls (short shards are padded), then gathered, so all ranks see identical values and ZeRO-3 cannot deadlock.
        """
        total = len(trajectories)
        if total == 0:
            return []
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        per_rank = math.ceil(total / world)
        mine = [trajectories[i] for i in range(rank, total, world)]
        mine += [trajectories[0]] * (per_rank - len(mine))
        device = self.accelerator.device
        pad_id = self.processing_class.pad_token_id if hasattr(self.processing_class, "pad_token_id") else 0
        prompts = [torch.tensor(t.prompt_ids) for t in mine]
        completions = [torch.tensor(t.completion_ids) for t in mine]
        prompt_ids = pad(prompts, padding_value=pad_id, padding_side="left").to(device)
        prompt_mask = pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left").to(device)
        completion_ids = pad(completions, padding_value=pad_id, padding_side="right").to(device)
        completion_mask = pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right")
        model_mask = pad([torch.tensor(t.completion_mask) for t in mine], padding_value=0, padding_side="right")
        model_mask = (model_mask * completion_mask).to(device)
        _, entropies, _ = self._get_per_token_logps_and_entropies(
            self.model,
            torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([prompt_mask, completion_mask.to(device)], dim=1),
            completion_ids.size(1),
            batch_size=self.args.per_device_train_batch_size,
            compute_entropy=True,
        )
        means = (entropies * model_mask).sum(-1) / model_mask.sum(-1).clamp(min=1)
        gathered = self.accelerator.gather(means.float()).view(world, per_rank).cpu()
        return [float(gathered[i % world, i // world]) for i in range(total)]

    # ---------------------------------------------------------------------------------- batch post-processing
    def _attach_replay_tensors(self, output: dict, replayed_local: dict[int, Trajectory], replaying: bool) -> None:
        completion_ids = output["completion_ids"]
        batch, length = completion_ids.shape
        device = completion_ids.device
        # One value for the whole generation batch, on every rank (the plan is global), so that every micro-batch of
        # every rank takes the same loss path: TRL's own when nothing of the batch is replayed.
        output["exreplay_replaying"] = torch.full((batch,), int(replaying), dtype=torch.long, device=device)
        exp_mask = torch.zeros(batch, length, dtype=torch.long, device=device)
        recorded = torch.zeros(batch, length, dtype=torch.float32, device=device)
        for i, trajectory in replayed_local.items():
            n = min(len(trajectory.completion_ids), length)
            exp_mask[i, :n] = torch.tensor(trajectory.completion_mask[:n], device=device)
            recorded[i, :n] = torch.tensor(trajectory.logps[:n], device=device)
        exp_mask = exp_mask * output["completion_mask"]
        output["exp_mask"] = exp_mask
        output["recorded_per_token_logps"] = recorded
        output["exreplay_row"] = torch.arange(batch, device=device)
        if "importance_sampling_ratio" in output and replayed_local:
            # The vLLM sampler correction does not apply to replayed rows: their ratio is taken against the
            # recorded behaviour log-probs in the loss.
            rows = torch.tensor(sorted(replayed_local), device=device)
            output["importance_sampling_ratio"][rows] = 1.0

    def _queue_outcomes(self, output, inputs, row_tasks, step: GenerationStep, offset) -> None:
        """Compute each task's outcome from the gathered rewards; keep this rank's successful fresh rows."""
        plan, rewards_per_func = step.plan, step.rewards
        weights = self.reward_weights.to(rewards_per_func.device)
        totals = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        success = (totals >= self.replay["success_threshold"]).cpu().tolist()
        # One outcome per task, over all its groups in the batch (a dataset may repeat a task), fresh rows only.
        outcomes: dict[str, list] = {}  # task -> [successes, fresh rows, winning rows]
        # A row with no reward at all (every function returned None, NaN or inf) says nothing about its task.
        missing = torch.isnan(rewards_per_func).all(dim=1).cpu().tolist()
        fresh_rows = [r for r in range(len(row_tasks)) if not plan.is_replayed(r) and not missing[r]]
        if self.env_factory is not None:  # an episode the environment failed says nothing about the task
            faulted = self._gather_row_flags(step.faulted_rows, len(inputs))
            fresh_rows = [r for r in fresh_rows if not faulted[r]]
        for row in fresh_rows:
            outcome = outcomes.setdefault(row_tasks[row], [0, 0, []])
            outcome[1] += 1
            if success[row]:
                outcome[0] += 1
                outcome[2].append(row)
        if fresh_rows:
            self._metrics["train"]["replay/fresh_reward"].append(totals[fresh_rows].nanmean().item())

        local_rows = len(inputs)
        wanted = {r - offset for _, _, winners in outcomes.values() for r in winners if 0 <= r - offset < local_rows}
        old = output.get("old_per_token_logps")
        model_mask = output["completion_mask"] * output.get("tool_mask", 1)
        stash = step.entropies
        records = {}
        for i in sorted(wanted):
            n = int(output["completion_mask"][i].sum())
            if int(model_mask[i, :n].sum()) == 0:
                continue  # nothing trainable (e.g. a truncated completion masked by mask_truncated_completions)
            try:
                task_row = json.dumps(inputs[i], sort_keys=True)
            except (TypeError, ValueError):
                task_row = None
                self._count("unserializable_task_rows", "a dataset row is not JSON-serializable, so it cannot replay")
            records[offset + i] = {
                "task_id": row_tasks[offset + i],
                "prompt_ids": output["prompt_ids"][i][output["prompt_mask"][i].bool()].tolist(),
                "completion_ids": output["completion_ids"][i, :n].tolist(),
                "completion_mask": model_mask[i, :n].tolist(),
                "logps": None if old is None else (old[i, :n] * model_mask[i, :n]).tolist(),
                "entropy": None if stash is None else _masked_mean(stash[i, :n], model_mask[i, :n]),
                "rewards": rewards_per_func[offset + i].tolist(),
                "reward": float(totals[offset + i]),
                "policy_version": self.state.global_step,
                "task_row": task_row,
            }
        outcomes = [(task_id, *outcome) for task_id, outcome in outcomes.items()]
        self._pending = PendingOutcomes(outcomes, records, offset)

    def _capture(self, inputs, per_token_logps, entropies, mask) -> None:
        """Fill the pending records with the log-probs and entropies of the loss forward (no extra forward)."""
        if self._pending is None or not self.model.training:
            return
        records, offset = self._pending.records, self._pending.offset
        entropies = entropies.detach()
        for j, local_row in enumerate(inputs["exreplay_row"].tolist()):
            record = records.get(offset + local_row)
            if record is None or record["entropy"] is not None:
                continue
            n = len(record["completion_ids"])
            row_mask = mask[j, :n].float()
            record["entropy"] = _masked_mean(entropies[j, :n], row_mask)
            if record["logps"] is None:
                record["logps"] = (per_token_logps[j, :n].detach().float() * row_mask).tolist()

    def _flush_pending(self) -> None:
        """Insert the queued outcomes into the pool. Collective: every rank calls it at the same points."""
        pending, self._pending = self._pending, None
        local = []
        if pending is not None:
            for row, record in pending.records.items():
                if record["entropy"] is None:
                    self._count("uncaptured_rows", "a successful row was never seen by the loss; not stored")
                    continue
                local.append((row, record))
        merged = dict(gather_object(local)) if self.accelerator.num_processes > 1 else dict(local)
        if pending is None:
            return
        for task_id, successes, num_fresh, winners in pending.outcomes:
            trajectories, task_row = [], None
            for row in winners:
                record = merged.get(row)
                if record is None:
                    continue
                record = dict(record)
                task_row = record.pop("task_row") or task_row
                trajectories.append(Trajectory(**record))
            self.pool.record_outcome(TaskOutcome(task_id, successes, num_fresh, trajectories, task_row))

    # --------------------------------------------------------------------------------------------------- loss
    def _compute_loss(self, model, inputs):
        """TRL's loss. In a generation batch that replays, TRL sees the replayed rows at advantage 0 (nothing in its
        policy term, but in every normaliser, the KL and the entropy terms), and `loss.off_policy_loss` adds their
        term, reduced by the loss type's normaliser (`loss.aggregate_loss`: linear, so the sum is the whole loss)."""
        if not self._replay_enabled or "exreplay_row" not in inputs:
            return super()._compute_loss(model, inputs)
        replaying = self._replays(inputs)
        if replaying:
            advantages = inputs["advantages"]
            replayed_rows = inputs["exp_mask"].bool().any(-1).view(-1, *([1] * (advantages.dim() - 1)))
            inputs = {**inputs, "advantages": advantages.masked_fill(replayed_rows, 0.0)}
        # TRL's loss makes one policy forward; the hook keeps its log-probs and entropies (the pool's records too).
        self._loss_forward = forward = LossForward(inputs)
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._loss_forward = None
        if replaying:
            loss = loss + self._off_policy_term(inputs, advantages, forward)
        return loss

    def _off_policy_term(self, inputs: dict, advantages: torch.Tensor, forward: LossForward) -> torch.Tensor:
        mode = "train" if self.model.training else "eval"
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        logps = forward.logps
        behaviour = inputs["recorded_per_token_logps"] if self.replay["exp_is_correct"] else logps.detach()
        token_mask = None
        if self.top_entropy_quantile < 1.0:  # TRL's selection, the same call as in its loss: fresh and replayed alike
            token_mask = self.get_high_entropy_mask(forward.entropies, mask, 1 - self.top_entropy_quantile)
        args = self.args
        per_token_loss, metrics = off_policy_loss(
            logps,
            behaviour,
            advantages,
            inputs["exp_mask"] * mask,
            loss_type=self.loss_type,
            importance_sampling_level=self.importance_sampling_level,
            epsilon_low=self.epsilon_low,
            delta=args.delta,
            off_cliprange_high=self.replay["off_cliprange_high"],
            off_clip_ratio_c=self.replay["off_clip_ratio_c"],
            off_policy_shaping=self.replay["off_policy_shaping"],
            off_policy_shaping_beta=self.replay["off_policy_shaping_beta"],
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos,
            vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg,
            off_policy_mask_threshold=self.off_policy_mask_threshold,
            token_mask=token_mask,
        )
        # The loss type's normaliser and gradient-accumulation scaling, as TRL's `_compute_loss` applies them.
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        if self.loss_type in TOKEN_SUM_LOSS_TYPES:
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * accumulation / args.steps_per_generation
            term = aggregate_loss(per_token_loss, mask, loss_type=self.loss_type, loss_normalizer=normalizer)
        else:
            term = aggregate_loss(
                per_token_loss, mask, loss_type=self.loss_type, max_completion_length=self.max_completion_length
            )
            term = term / accumulation
        self._log_off_policy_metrics(mode, metrics)
        return term

    @staticmethod
    def _replays(inputs: dict) -> bool:
        """Whether the generation batch of `inputs` holds replayed rows (the same answer on every rank)."""
        flag = inputs.get("exreplay_replaying")
        return flag is not None and bool(flag.numel()) and bool(flag[0])

    def _log_off_policy_metrics(self, mode: str, m: dict) -> None:
        names = ("replayed_tokens", "loss_sum", "clipped_tokens", "ratio_sum", "logp_drift_sum")
        sums = torch.stack([m[name] for name in names]).to(self.accelerator.device)
        sums = dict(zip(names, self.accelerator.reduce(sums, reduction="sum").tolist()))
        extremes = torch.stack([m["ratio_min"], -m["ratio_max"]]).to(self.accelerator.device)
        extremes = self.accelerator.gather(extremes.view(1, 2)).view(-1, 2).min(dim=0).values.tolist()
        tokens = sums["replayed_tokens"]
        if tokens > 0:
            metrics = self._metrics[mode]
            metrics["replay/off_policy_loss"].append(sums["loss_sum"] / tokens)
            metrics["replay/off_clip_fraction"].append(sums["clipped_tokens"] / tokens)
            metrics["replay/importance_ratio_mean"].append(sums["ratio_sum"] / tokens)
            metrics["replay/logp_drift"].append(sums["logp_drift_sum"] / tokens)
            metrics["replay/importance_ratio_min"].append(extremes[0])
            metrics["replay/importance_ratio_max"].append(-extremes[1])

    # ---------------------------------------------------------------------------------------------- metrics
    def _log_generation_metrics(self, plan: ReplayPlan, total_rows: int, step: int) -> None:
        metrics = self._metrics["train"]
        replayed_rows = len(plan.replayed_rows())
        metrics["replay/rows_fraction"].append(replayed_rows / total_rows)
        metrics["replay/tasks"].append(float(plan.num_tasks))
        metrics["replay/generated_rows"].append(float(total_rows - replayed_rows))
        ages = [step - t.policy_version for ts in self._generation.selected.values() for t in ts]
        if ages:
            metrics["replay/policy_age"].append(float(np.mean(ages)))
        for name, value in self.pool.stats().items():
            metrics[f"replay/{name}"].append(value)
        for name, count in self._replay_counts.items():
            metrics[f"replay/{name}"] = [float(count)]  # running totals

    def _count(self, kind: str, message: str, number: int = 1) -> None:
        self._replay_counts[kind] += number
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("trl_exreplay: %s (counted in replay/%s; logged once).", message, kind)

    # ------------------------------------------------------------------------------------------- checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the model as `GRPOTrainer` does, and the pool beside it in `exreplay_pool/` (call on every rank).

        Checkpoints get the pool this way too: `Trainer._save_checkpoint` calls this first, with the checkpoint
        folder, before it pushes or rotates checkpoints.
        """
        super().save_model(output_dir, _internal_call)
        if self._replay_enabled:
            self._flush_pending()
            if self.args.should_save:
                self.pool.save(os.path.join(output_dir or self.args.output_dir, POOL_DIR))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if not self._replay_enabled or checkpoint is None:
            return
        if not os.path.lexists(os.path.join(checkpoint, POOL_DIR)):
            if not self.replay["resume_without_pool"]:
                message = (
                    f"trl_exreplay: the checkpoint {checkpoint} holds no experience pool ({POOL_DIR}/): training "
                    "resumes with an EMPTY pool, so nothing is replayed until it fills again. If the pool was lost, "
                    "stop and restore it; to start empty on purpose, set resume_without_pool=True."
                )
                logger.warning(message)
                warnings.warn(message, stacklevel=2)
            return
        pool = ExperiencePool.load(
            os.path.join(checkpoint, POOL_DIR), vocab_size=self._vocab_size, work_dir=self._pool_work_dir()
        )
        self._adopt_pool(pool, checkpoint)
        self._pending = None

    def _pool_work_dir(self) -> str:
        return os.path.join(self.args.output_dir, POOL_WORK_DIR)

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
            logger.warning("trl_exreplay: pool from %s had other settings for %s; using this run's.", source, changed)
        self.pool = pool


class _AtTrainEnd(TrainerCallback):
    """Flush the last step's outcomes (no further generation step would) and close idle environments."""

    def __init__(self, trainer: ExReplayGRPOTrainer):
        self.trainer = trainer

    def on_train_end(self, args, state, control, **kwargs):
        if self.trainer._replay_enabled:
            self.trainer._flush_pending()
        if self.trainer.env_factory is not None:
            self.trainer._rollout_engine.close()


def _vocab_size(model) -> int | None:
    """The number of token ids the model embeds (its config's, after any resize), None when it does not say."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    size = getattr(config, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    mask = mask.to(values.dtype)
    return float((values * mask).sum() / mask.sum().clamp(min=1))
