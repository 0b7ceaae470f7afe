"""The replay side of a training step, as one object the trainer's hooks call: `ReplayController`.

Per step it draws the plan (`planner.plan_replay`, ExGRPO's start rule and retired questions) and the replayed
trajectories (`selection`), splices them into generation (and rescued successes into scoring), and queues the fresh
rollouts' outcomes until the pool records them at the next step. The pool itself, made once, shared, saved and
resumed, is `trl_exreplay.keeper.PoolKeeper`'s; the controller reads it through the keeper.

What it needs from the trainer is given to it: settings, values and functions at construction (`for_trainer` reads
them off the trainer once), the step's figures in each call; it keeps no trainer. The methods marked collective must
be called by every rank at the same point of the step (they gather or reduce).
"""

from __future__ import annotations

import copy
import logging
import math
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch
from accelerate.utils import gather_object

from .distributed import gather_row_flags
from .keeper import PoolKeeper
from .metrics import FaultCounts, log_generation
from .outcomes import PendingOutcomes, task_outcomes, trajectory_records, zero_spread_share
from .planner import ReplayPlan, plan_replay, plan_rescue, replay_groups_due
from .pool import task_key
from .pool.rules import is_solved
from .schedule import redirect_retired_groups, revisited_groups, starts_replay
from .selection import select_trajectories
from .spread import plan_groups
from .step import GenerationStep

logger = logging.getLogger(__name__)


class ReplayController:
    """The plan, the splice and the outcomes of `ExReplayGRPOTrainer`'s steps (`settings`: the config's
    `ReplaySettings`), over the pool `keeper` holds. With replay off it still runs: the plan replays nothing, and the
    outcomes only feed an optional part that plans training batches (`parts_plan`: guided rollouts' summariser)."""

    def __init__(
        self,
        settings,
        keeper: PoolKeeper,
        *,
        args,
        accelerator,
        num_generations: int,
        train_dataset,
        policy_forward: Callable,
        faults: FaultCounts,
        multi_turn: bool = False,
        max_completion_length: int | None = None,
        parts_plan: bool = False,
    ):
        self.settings = settings
        self.keeper = keeper
        self.enabled = settings.enable_experience_replay
        self.num_generations = num_generations
        self._args = args
        self._accelerator = accelerator
        self._policy_forward = policy_forward  # a no-grad forward of the current policy (`selection`)
        self._faults = faults
        self._multi_turn = multi_turn
        self._max_completion_length = max_completion_length
        self._train_dataset = train_dataset
        self.retiring = self._reads_rows_by_index(
            self.enabled and settings.replay_retire_solved,
            "replay_retire_solved",
            "solved questions stay in the fresh stream",
        )
        self.rescue_rows = settings.replay_rescue if self.enabled else 0
        if self.rescue_rows and args.beta != 0.0:
            self.rescue_rows = 0
            logger.warning(
                "trl_exreplay: replay_rescue=%d is off: with beta=%g TRL's KL term would compare a rescued row's "
                "tokens with the reference log-probs of the failed rollout it replaces (computed before scoring). "
                "Rescue needs beta=0 (TRL's default).",
                settings.replay_rescue,
                args.beta,
            )
        self._retired: set[str] | None = None  # the retired tasks, as of the last generation batch
        self._dataset_keys: list[str] | None = None  # the task of each training dataset row
        self._rows_per_task: Counter[str] = Counter()  # the dataset's rows of each task
        self._active_count = 0  # the dataset's rows whose task is not retired
        self.exhausted = False  # every training question is retired
        self.stops_after: int | None = None  # then, the step that trains the last batch: the trainer stops after it
        self.pending: PendingOutcomes | None = None  # the last step's outcomes, not yet in the pool
        self._said_task_ids = not (self.enabled or parts_plan)  # said once, where ids matter
        self._said_all_solved = False
        self._said_changes = not self.enabled
        self.spreading = self._reads_rows_by_index(
            self.enabled and settings.replay_spread_plan,
            "replay_spread_plan",
            "the sampler's groups are trained as drawn",
        )
        self._spread_predicted: dict[int, float] = {}  # the planned groups' predicted spread, until their outcomes

    def _reads_rows_by_index(self, wanted: bool, field: str, otherwise: str) -> bool:
        """Whether an option that takes dataset rows by index (`field`) can act: a map-style dataset; else one warning
        saying what happens instead."""
        dataset = self._train_dataset
        # `datasets.IterableDataset` has a `__getitem__` too (a column by name), but no rows by index
        map_style = hasattr(dataset, "__len__") and not isinstance(dataset, torch.utils.data.IterableDataset)
        if wanted and not map_style:
            logger.warning(
                "trl_exreplay: %s needs a dataset whose rows can be read by index (a map-style `datasets.Dataset`); "
                "with this %s, %s.",
                field,
                type(dataset).__name__,
                otherwise,
            )
            return False
        return wanted

    @classmethod
    def for_trainer(
        cls, trainer, keeper: PoolKeeper, faults: FaultCounts, *, policy_forward: Callable, parts_plan: bool
    ) -> ReplayController:
        """The replay side of `trainer` (a `GRPOTrainer` whose `__init__` ran; `trainer.settings`: its
        `ReplaySettings`), read off it once. Warns where replay can do little (docs/support.md says why)."""
        settings, args = trainer.settings, trainer.args
        if settings.enable_experience_replay:
            groups = args.generation_batch_size // trainer.num_generations
            if 0 < settings.replay_ratio * groups < 1:
                logger.warning(
                    "trl_exreplay: a generation batch holds %d task group(s), so replay_ratio=%g replays a group in "
                    "only about one generation batch of %.3g (replay/tasks is 0 in the others). To replay in every "
                    "batch, give it more groups, on-policy: gradient_accumulation_steps=N (TRL's "
                    "steps_per_generation follows it), a larger per_device_train_batch_size, or more processes. "
                    "steps_per_generation above gradient_accumulation_steps gives more groups too, but then all "
                    "but one of the optimizer steps of a generation batch train on rollouts of an older policy, "
                    "in GRPO itself.",
                    groups,
                    settings.replay_ratio,
                    1 / (settings.replay_ratio * groups),
                )
        return cls(
            settings,
            keeper,
            args=args,
            accelerator=trainer.accelerator,
            num_generations=trainer.num_generations,
            train_dataset=trainer.train_dataset,
            policy_forward=policy_forward,
            faults=faults,
            multi_turn=trainer.text_env_factory is not None,
            max_completion_length=trainer.max_completion_length,
            parts_plan=parts_plan,
        )

    @property
    def pool(self):
        """The run's `ExperiencePool` (the keeper's: it is replaced on resume)."""
        return self.keeper.pool

    @property
    def schedule(self):
        """ExGRPO's start step (the keeper's: saved and resumed with the pool)."""
        return self.keeper.schedule

    def _on_main(self, read: Callable):
        """`read()` on rank 0, its result sent to every rank. Collective."""
        return self.keeper.on_main(read)

    # ------------------------------------------------------------------------------------------- the plan
    def started(self, global_step: int, max_steps: int) -> bool:
        """Whether replay runs at this step: from `replay_start_ratio` of `max_steps`, or (ExGRPO's rule) from the step
        after the one whose batch succeeded often enough."""
        if self.settings.replay_start == "solved":
            started = self.schedule.started_at
            return started is not None and global_step > started
        return global_step / max(max_steps, 1) >= self.settings.replay_start_ratio

    def first_replay_step(self, max_steps: int) -> int | None:
        """With replay_start='steps': the first optimizer step (counted from 1, as logged) that replays, or None when
        none of the run's `max_steps` does. The same test as `started`, from the step replay_start_ratio points at."""
        step = max(0, math.ceil(self.settings.replay_start_ratio * max_steps) - 1)  # a step early: rounding
        while step < max_steps and not self.started(step, max_steps):
            step += 1
        return step + 1 if step < max_steps else None

    def what_replay_changes(self, max_steps: int) -> str:
        """One line: what replay changes in this run against `GRPOTrainer`, with these settings, and how to train as
        `GRPOTrainer` does (exactly, or until replay starts)."""
        s, G = self.settings, self.num_generations
        from_start = []
        if self.rescue_rows:
            from_start.append(
                f"an all-fail group gets {_successes(self.rescue_rows)} of its task in place of its last failed "
                f"rollout{'s' if self.rescue_rows > 1 else ''} (replay_rescue={self.rescue_rows})"
            )
        if self.retiring:
            returns = (
                f"{s.replay_revisit_ratio:.0%} of its draws coming back as revisits"
                if s.replay_revisit_ratio
                else "for good"
            )
            from_start.append(
                f"a question every fresh rollout solved leaves the fresh stream, {returns} "
                f"(replay_retire_solved=True, replay_revisit_ratio={s.replay_revisit_ratio:g})"
            )
        if self.spreading:
            from_start.append(
                "the batch's groups go to the tasks most likely to have a reward spread, by estimates learnt from "
                f"every fresh group (replay_spread_plan=True, {s.replay_spread_explore:.0%} of the groups "
                "kept as drawn)"
            )
        replay = (
            f"{s.replay_ratio:.0%} of the groups train on {_successes(s.replay_trajectories_per_group)} among "
            f"their {G} rows (replay_ratio={s.replay_ratio:g})"
        )
        if s.replay_unclipped_fresh:
            replay += ", fresh tokens without TRL's clip (replay_unclipped_fresh)"
        if not s.replay_ratio:
            later = " Nothing is replayed (replay_ratio=0)."
        elif s.replay_start == "solved":
            later = (
                f" From the step after the first generation batch whose fresh rollouts succeed more than "
                f"{s.replay_start_solved_fraction:.0%} of the time (replay_start='solved'): {replay}."
            )
        else:
            first = self.first_replay_step(max_steps)
            ratio = f"replay_start_ratio={s.replay_start_ratio:g}"
            later = (
                f" From step {first} of {max_steps} ({ratio}): {replay}."
                if first is not None
                else f" Nothing is replayed within max_steps={max_steps} ({ratio})."
            )
        if from_start:
            changes = f" From step 1: {'; '.join(from_start)}.{later}"
            on = {
                "replay_rescue=0": self.rescue_rows,
                "replay_retire_solved=False": self.retiring,
                "replay_spread_plan=False": self.spreading,
            }
            exact = (
                "GRPOTrainer exactly: enable_experience_replay=False; GRPOTrainer until replay starts: "
                f"{', '.join(field for field, changes in on.items() if changes)}."
            )
        else:
            changes = f"{later} Until then it trains as GRPOTrainer while the pool fills."
            exact = "GRPOTrainer exactly: enable_experience_replay=False."
        return (
            f"trl_exreplay: experience replay changes training from GRPOTrainer's.{changes} TRL's reward and "
            f"completion metrics stay the fresh rollouts'; what the loss trained on is under replay/*. {exact}"
        )

    def plan(
        self, inputs: list[dict], *, global_step: int, max_steps: int, micro_step: int, metrics
    ) -> GenerationStep:
        """A training generation batch's plan, the same on every rank: which groups replay which stored trajectories
        (retired questions redirected first). `micro_step` tells apart the generation batches that share a global
        step (it is 0 at every step boundary, so resume-safe). Collective."""
        G, args = self.num_generations, self._args
        rank, local_rows = self._accelerator.process_index, len(inputs)
        offset = rank * local_rows
        if not self._said_task_ids:
            self._said_task_ids = True
            say_task_id_source(inputs, self.settings.task_id_column)
        if not self._said_changes:
            self._said_changes = True
            if self._accelerator.is_main_process:  # said once a run, at its first batch, when max_steps is known
                logger.warning(self.what_replay_changes(max_steps))
        row_keys = gather_object([task_key(x, self.settings.task_id_column) for x in inputs])
        draw_seed = [args.seed, global_step, micro_step]
        revisits = []
        if self.retiring:
            inputs, row_keys, revisits = self._redirect_retired(
                inputs, row_keys, offset, draw_seed, metrics, global_step, max_steps
            )
        if self.spreading:
            inputs, row_keys = self._plan_spread(inputs, row_keys, offset, draw_seed, metrics, global_step)
        group_keys = row_keys[::G]

        plan = ReplayPlan(G, self.settings.replay_trajectories_per_group, {})
        if self.enabled and self.started(global_step, max_steps):
            # replay_ratio is a long-run share: a batch of fewer than 1 / replay_ratio groups replays on some batches
            batch_index = (global_step * args.gradient_accumulation_steps + micro_step) // (
                args.steps_per_generation * args.num_iterations
            )
            plan = plan_replay(
                group_keys,
                self.pool.replay_buckets(  # drawn from in O(batch), whatever the pool's size
                    plan.num_replayed, global_step, self.settings.replay_max_policy_age
                ),
                num_tasks=replay_groups_due(self.settings.replay_ratio, len(group_keys), batch_index),
                num_generations=G,
                num_replayed=plan.num_replayed,
                weighting=self.settings.replay_bucket_weighting,
                seed=draw_seed,
            )
        selected = select_trajectories(
            self.pool,
            plan,
            self.settings,
            global_step,
            draw_seed,
            self._accelerator,
            self._policy_forward,
            self._on_main,
        )
        swapped, replayed_local = plan.rank_rows(offset, local_rows, group_keys, selected)
        # The dataset rows as they are (stored with trajectories): a replayed group's task row from the pool.
        replayed = sorted(set(plan.replay_groups.values()))
        stored = self._on_main(lambda: {t: self.pool.task_row(t) for t in replayed}) if replayed else {}
        task_rows = [copy.deepcopy(stored[swapped[i]]) if i in swapped else row for i, row in enumerate(inputs)]
        step = GenerationStep(
            rows=task_rows,
            plan=plan,
            selected=selected,
            replayed_local=replayed_local,
            fresh_per_rank=plan.fresh_rows_per_rank(len(row_keys), local_rows),
            offset=offset,
            task_rows=task_rows,
            row_tasks=[plan.task_of_row(r, group_keys) for r in range(len(row_keys))],
            seed=draw_seed,
            revisited=set(revisits) - set(plan.replay_groups),
        )
        if self.retiring and self.settings.replay_revisit_ratio:
            metrics["replay/revisited_groups"].append(float(len(step.revisited)))
        return step

    def _redirect_retired(
        self, inputs: list, row_keys: list, offset: int, seed: list, metrics, global_step: int, max_steps: int
    ):
        """ExGRPO's retired questions (`trl_exreplay.schedule`): the groups whose task is in the pool's skip set take
        other dataset rows, the same on every rank (the batch's keys are gathered, the pool is rank-identical)."""
        G = self.num_generations
        # Read after the pool took the previous batch's outcomes: a question every fresh rollout solved is not drawn
        # again (ExGRPO drops it from the data at the next epoch, in which it would be drawn once: the same thing, but
        # also where a dataset repeats its questions within an epoch). It is not replayed either, so it stays retired.
        retired = set(self.pool.skip_set)
        if retired != self._retired:
            self._retired = retired
            self._keys_of_dataset()
            # rows left to the fresh stream, counted over the retired tasks (not the dataset's rows: O(retired))
            self._active_count = len(self._dataset_keys) - sum(self._rows_per_task[key] for key in retired)
            if not self._active_count and not self.settings.replay_revisit_ratio:
                self.exhausted = True  # this last batch is of retired tasks: its outcomes stay out of the pool
                self.stops_after = self._last_step_of_batch(global_step, micro_step=seed[2])
                logger.warning(
                    "trl_exreplay: every training question is retired (solved by all its fresh rollouts: %d tasks, "
                    "replay_retire_solved=True, replay_revisit_ratio=0), so no fresh rollout is left to make; "
                    "training stops after step %d of max_steps=%d, once this batch is trained. To go on training "
                    "solved questions, set replay_revisit_ratio above 0 (they come back as revisits) or "
                    "replay_retire_solved=False; if they are not really solved (a reward every rollout gets, such as "
                    "a format reward, lifts every total to the threshold), set replay_success_threshold to the total "
                    "a solved rollout gets.",
                    len(retired),
                    self.stops_after,
                    max_steps,
                )
        group_keys = row_keys[::G]
        revisits = revisited_groups(group_keys, self._retired, self.settings.replay_revisit_ratio, [*seed, 3])
        if not self._active_count:  # every question retired (with revisits on): each retired group is a revisit
            revisits = [g for g, key in enumerate(group_keys) if key in self._retired]
        if revisits:  # a revisited group keeps its retired task (a key no task has is never redirected)
            group_keys = [None if g in revisits else key for g, key in enumerate(group_keys)]
        redirect = redirect_retired_groups(group_keys, self._retired, self._dataset_keys, seed=[*seed, 2])
        # a current count (not the batch's new retirements): it falls when a failed revisit brings a question back
        metrics["replay/retired_tasks"].append(float(len(self._retired)))
        metrics["replay/redirected_groups"].append(float(len(redirect)))
        inputs, row_keys = self._take_rows(inputs, row_keys, redirect, offset)
        return inputs, row_keys, revisits

    def _take_rows(self, inputs: list, row_keys: list, redirect: dict[int, int], offset: int) -> tuple[list, list]:
        """The batch with each group of `redirect` (group -> dataset row) taking that row: this rank's rows, and the
        global row keys."""
        if not redirect:
            return inputs, row_keys
        G = self.num_generations
        inputs = [
            self._train_dataset[redirect[(offset + i) // G]] if (offset + i) // G in redirect else row
            for i, row in enumerate(inputs)
        ]
        row_keys = [self._dataset_keys[redirect[r // G]] if r // G in redirect else k for r, k in enumerate(row_keys)]
        return inputs, row_keys

    def _keys_of_dataset(self) -> list[str]:
        if self._dataset_keys is None:
            self._dataset_keys = dataset_task_keys(self._train_dataset, self.settings.task_id_column)
            self._rows_per_task = Counter(self._dataset_keys)
        return self._dataset_keys

    def _plan_spread(self, inputs: list, row_keys: list, offset: int, seed: list, metrics, global_step: int):
        """Fresh rollouts where they teach (`trl_exreplay.spread`): the batch's groups go to the candidates (the
        sampler's groups, and more dataset rows drawn with the step's seed; retired tasks left out) whose groups are
        most likely to have a reward spread under the run's estimates. The same on every rank: the keys are gathered,
        the estimates are updated from gathered outcomes, the draws are seeded by the step."""
        s, G = self.settings, self.num_generations
        group_keys = row_keys[::G]
        dataset_keys = self._keys_of_dataset()
        rng = np.random.default_rng([*seed, 5])
        drawn = rng.integers(len(dataset_keys), size=(s.replay_spread_candidates - 1) * len(group_keys)).tolist()
        retired = self._retired if self.retiring and self._retired else set()
        extra = [row for row in drawn if dataset_keys[row] not in retired]
        keys = group_keys + [dataset_keys[row] for row in extra]
        alpha, beta = self.keeper.estimates.posterior(keys, global_step)
        k, age = self.rescue_rows, s.replay_max_policy_age
        rescuable = np.array([bool(k) and self.pool.num_selectable(key, global_step, age) >= k for key in keys])
        plan = plan_groups(
            keys,
            alpha,
            beta,
            rescuable,
            num_groups=len(group_keys),
            group_size=G,
            explore=s.replay_spread_explore,
            max_groups_per_task=s.replay_spread_max_groups,
            seed=[*seed, 6],
        )
        redirect = {g: extra[c - len(group_keys)] for g, c in plan.replaced().items()}
        self._spread_predicted = dict(enumerate(plan.predicted))
        metrics["replay/spread_replanned_groups"].append(float(len(redirect)))
        return self._take_rows(inputs, row_keys, redirect, offset)

    def _last_step_of_batch(self, global_step: int, micro_step: int) -> int:
        """The optimizer step (counted from 1, as logged) that trains the last micro-batch of the generation batch
        planned at `global_step`'s `micro_step`: TRL trains a generation batch over steps_per_generation *
        num_iterations micro-batches, gradient_accumulation_steps of them a step."""
        args = self._args
        micro_batches = args.steps_per_generation * args.num_iterations
        return global_step + (micro_step + micro_batches - 1) // args.gradient_accumulation_steps + 1

    # ----------------------------------------------------------------------------------------- generation
    def generate(
        self,
        step: GenerationStep,
        prompt_ids: list,
        generate: Callable,
        num_generations: int,
        *,
        multimodal: bool,
        use_vllm: bool,
        equal_shares: bool,
    ):
        """Single-turn generation of a replaying step: `generate(prompt_ids, images, num_generations=n)` (TRL's) makes
        the fresh rows only (one sample per row through vLLM), and the replayed rows get their stored completions.
        None when the step replays nothing (or its replayed rows were taken by an earlier generation call).
        `equal_shares`: see `padding_rows`."""
        replayed = step.take_replay()
        if replayed is None:
            return None
        if multimodal:
            raise NotImplementedError("Experience replay with multimodal prompts is not supported yet.")
        fresh = [i for i in range(len(prompt_ids)) if i not in replayed]
        num_padding = self.padding_rows(step, len(fresh), equal_shares)
        to_generate = [prompt_ids[i] for i in fresh] + [prompt_ids[0]] * num_padding
        generated, generated_logps = [], None
        if to_generate:
            generated, generated_logps = generate(
                to_generate, None, num_generations=1 if use_vllm else num_generations
            )
        self._faults.totals["padding_rows"] += num_padding
        completion_ids = [None] * len(prompt_ids)
        logprobs = None if generated_logps is None else [None] * len(prompt_ids)
        for j, i in enumerate(fresh):
            completion_ids[i] = generated[j]
            if logprobs is not None:
                logprobs[i] = generated_logps[j]
        for i, trajectory in replayed.items():
            completion_ids[i] = self.fit_completion(trajectory.completion_ids)
            if logprobs is not None:  # not sampled now: no sampler log-probs (TRL reads None as NaN, and skips it)
                logprobs[i] = [None] * len(completion_ids[i])
            if list(prompt_ids[i]) != trajectory.prompt_ids:
                self._faults.count("prompt_mismatch", "a replayed trajectory's prompt tokenizes differently now")
                # The completion is trained after the prompt it was sampled with (TRL keeps this list of prompts), or
                # its recorded log-probs would be those of another context.
                prompt_ids[i] = list(trajectory.prompt_ids)
        return completion_ids, logprobs

    def padding_rows(self, step: GenerationStep, num_fresh: int, equal_shares: bool) -> int:
        """Rows to generate and discard so every rank makes the same generation calls: as many as the rank with the
        most fresh rows where the generator slices its output by equal per-rank shares (`equal_shares`: vLLM's server
        mode or tensor parallelism), else one on a rank with none (ZeRO-3)."""
        most = max(step.fresh_per_rank)
        if equal_shares:
            return most - num_fresh
        # Sharded models (ZeRO-3, FSDP) gather parameters collectively inside generation: a rank whose rows are all
        # replayed still generates one row. Cheap, so done for every multi-process run.
        return 1 if (self._accelerator.num_processes > 1 and num_fresh == 0 and most > 0) else 0

    def fit_completion(self, completion_ids: list[int]) -> list[int]:
        """A stored completion cut to `max_completion_length` (counted)."""
        limit = self._max_completion_length
        if limit is not None and len(completion_ids) > limit:
            self._faults.count("truncated_replays", "a replayed completion is longer than max_completion_length")
            return completion_ids[:limit]
        return completion_ids

    def put_recorded_rewards(self, step: GenerationStep, rewards_per_func: torch.Tensor, compare: bool) -> None:
        """The replayed rows keep their recorded rewards (in place; mismatches counted)."""
        counts = step.put_recorded_rewards(rewards_per_func, compare=compare)
        if counts["reward_mismatch"]:
            self._faults.totals["reward_mismatch"] += counts["reward_mismatch"]
        if counts["reward_arity_mismatch"]:
            message = "recorded rewards do not match the reward functions"
            self._faults.count("reward_arity_mismatch", message, counts["reward_arity_mismatch"])

    def rescue(
        self,
        step: GenerationStep,
        rewards_per_func: torch.Tensor,
        reward_weights,
        *,
        global_step: int,
        metrics,
        skip_rows: set[int] = frozenset(),
    ) -> torch.Tensor:
        """AR3PO's response reuse, after scoring: each fresh group whose rows all failed, of a task the pool holds
        `replay_rescue` successes of, gets its last rows replaced by them (`planner.plan_rescue`; chosen by
        `replay_select_mode` on their saved entropies). Returns the rewards TRL computes advantages from, the rescued
        rows' being their recorded ones; `rewards_per_func` itself is left as scored (the outcomes count those rows
        as the failures they were). The rows' tokens are put into TRL's output after it
        (`trl_exreplay.step.splice_rescued`). The groups of `skip_rows` (global rows: guided ones) are left alone.
        Rescue needs only a stored success, so it acts from the first step the pool holds one, whatever
        `replay_start`. Collective: the decision is global, the trajectories are read on rank 0."""
        G, k = self.num_generations, self.rescue_rows
        if not k:
            return rewards_per_func
        totals, success, missing = self._scored(rewards_per_func, reward_weights)
        if self._multi_turn:  # an episode the environment failed is no failure of the policy: it is not rescued
            step.faulted_global = gather_row_flags(self._accelerator, step.faulted_rows, len(step.task_rows))
            missing = [m or f for m, f in zip(missing, step.faulted_global)]
        row_success = [None if missing[r] or step.plan.is_replayed(r) else success[r] for r in range(len(success))]
        group_keys = step.row_tasks[::G]
        kept = {r // G for r in skip_rows}  # groups that are another part's experiment (guided rows)
        age = self.settings.replay_max_policy_age
        has = [self.pool.num_selectable(task, global_step, age) >= k for task in group_keys]
        groups = plan_rescue(row_success, group_keys, G, k, has, skip_groups=[*step.plan.replay_groups, *kept])
        counted = [r for r, flag in enumerate(row_success) if flag is not None]
        rescued = rewards_per_func
        if groups:
            tasks = sorted(set(groups.values()))
            rng = np.random.default_rng([*step.seed, 4])  # replay_select_mode="random": a draw of this step's
            chosen = self._on_main(lambda: self.pool.select(tasks, k, global_step, age, rng=rng))
            rescued = rewards_per_func.clone()
            limit = self._max_completion_length
            for group, task in groups.items():
                trajectories = chosen[task]
                if any(len(t.rewards) != rescued.size(1) for t in trajectories):
                    self._faults.count("reward_arity_mismatch", "recorded rewards do not match the reward functions")
                    continue
                if limit is not None and any(len(t.completion_ids) > limit for t in trajectories):
                    # a success cut short is no success: the group stays as it was
                    self._faults.count("rescues_too_long", "a stored success is longer than max_completion_length")
                    continue
                for j, trajectory in enumerate(trajectories):
                    row = (group + 1) * G - k + j
                    rescued[row] = torch.tensor(trajectory.rewards, dtype=rescued.dtype, device=rescued.device)
                    step.rescued[row] = trajectory
        metrics["replay/rescued_groups"].append(float(len({row // G for row in step.rescued})))
        if counted:
            metrics["replay/zero_std_rescued"].append(
                zero_spread_share(self._scored(rescued, reward_weights)[0], counted, G)
            )
        local = range(step.offset, step.offset + len(step.task_rows))
        step.rescued_local = {row - step.offset: t for row, t in step.rescued.items() if row in local}
        return rescued

    def _scored(self, rewards_per_func: torch.Tensor, reward_weights) -> tuple[torch.Tensor, list, list]:
        """Per global row: the total reward (the weighted sum over reward functions), whether it is a success, and
        whether it has no reward at all (every function returned None, NaN or inf: it says nothing about its task)."""
        totals = (rewards_per_func * reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        success = (totals >= self.settings.replay_success_threshold).cpu().tolist()
        return totals, success, torch.isnan(rewards_per_func).all(dim=1).cpu().tolist()

    # ------------------------------------------------------------------------------------------- outcomes
    def queue_outcomes(self, output: dict, step: GenerationStep, *, reward_weights, global_step: int, metrics):
        """Each task's outcome from the gathered rewards, and this rank's successful fresh rows as pool records, kept
        in `self.pending` until the loss forward gives them log-probs. Returns (success per global row, the fresh rows
        that count, the records by global row) for guided rollouts. Collective in multi-turn runs."""
        rewards_per_func, row_tasks, offset = step.rewards, step.row_tasks, step.offset
        num_local = len(step.task_rows)
        totals, success, missing = self._scored(rewards_per_func, reward_weights)
        fresh_rows = [r for r in range(len(row_tasks)) if not step.plan.is_replayed(r) and not missing[r]]
        if self._multi_turn:  # an episode the environment failed says nothing about the task
            faulted = step.faulted_global  # gathered by `rescue` when it ran, else now
            if faulted is None:
                faulted = gather_row_flags(self._accelerator, step.faulted_rows, num_local)
            fresh_rows = [r for r in fresh_rows if not faulted[r]]
        if self.enabled and fresh_rows and not self._said_all_solved and all(success[r] for r in fresh_rows):
            fresh_totals = totals[fresh_rows]
            if fresh_totals.min() < fresh_totals.max():  # the rewards tell rollouts apart; the threshold does not
                self._said_all_solved = True
                logger.warning(
                    "trl_exreplay: every fresh rollout of this generation batch counted as a success (total reward "
                    ">= replay_success_threshold=%g, the total being the weighted sum over the %d reward function(s); "
                    "here it ranged %g-%g), so every task counts as solved: it goes to the skip set, nothing of it is "
                    "stored or replayed%s%s. If a reward function gives every rollout something (a format reward), "
                    "set replay_success_threshold to the total a solved rollout gets.",
                    self.settings.replay_success_threshold,
                    rewards_per_func.size(1),
                    fresh_totals.min().item(),
                    fresh_totals.max().item(),
                    self._kept_for_rescue(),
                    self._retirement_then(),
                )
        if fresh_rows:  # TRL's `reward` less the episodes the environment failed (multi-turn): what the pool counts
            metrics["replay/fresh_reward"].append(totals[fresh_rows].nanmean().item())
        replayed_rows = []
        if self.settings.replay_count_replayed_successes:  # ExGRPO: a replayed task's bucket is (s + k) of G
            replayed_rows = [r for r in range(len(row_tasks)) if step.plan.is_replayed(r) and not missing[r]]
        fresh = task_outcomes(row_tasks, fresh_rows, success, self.num_generations)  # one per group, fresh rows only
        if self.enabled and fresh:  # the groups that teach nothing, by cause (every rollout failed, or won)
            metrics["replay/all_fail_fresh"].append(sum(s == 0 for _, s, _, _ in fresh) / len(fresh))
            metrics["replay/all_win_fresh"].append(sum(s == n for _, s, n, _ in fresh) / len(fresh))
        if self.spreading:
            self.keeper.estimates.update([(task, s, n) for task, s, n, _ in fresh], global_step)
            self._log_calibration(step, fresh_rows, success, metrics)
        outcomes = task_outcomes(row_tasks, fresh_rows, success, self.num_generations, replayed_rows)
        local_winners = sorted(r - offset for *_, rows in outcomes for r in rows if 0 <= r - offset < num_local)
        records = trajectory_records(
            output,
            local_winners,
            task_rows=step.task_rows,
            row_tasks=row_tasks,
            rewards_per_func=rewards_per_func,
            totals=totals,
            entropies=step.entropies,
            offset=offset,
            policy_version=global_step,
            count=self._faults.count,
        )
        if self.exhausted:  # every question retired: the run's last batch, of retired tasks, leaves them retired
            outcomes = []
        elif self.settings.replay_start == "solved" and self.schedule.started_at is None:
            # ExGRPO before replay starts: solved tasks enter the skip set, nothing enters a bucket, and the pool only
            # the successes a solved task keeps for rescue (replay_rescue; none in ExGRPO's profile). The
            # first batch that succeeds often enough starts replay (`success` is gathered: every rank decides alike);
            # the next batch is the first one collected, and the one after it the first that can replay.
            # A retired task failed on a revisit leaves the skip set all the same, with nothing stored.
            retired = self._retired or set()
            outcomes = [
                o if is_solved(o[1], o[2]) else (*o[:3], [])
                for o in outcomes
                if is_solved(o[1], o[2]) or o[0] in retired
            ]
            if starts_replay(success, fresh_rows, self.settings.replay_start_solved_fraction):
                self.schedule.started_at = global_step
        if step.revisited:  # retired tasks revisited: those a fresh rollout failed return to the fresh stream
            G = self.num_generations
            last = {o[0]: is_solved(o[1], o[2]) for o in outcomes}  # a task's last group in the batch decides
            returned = {row_tasks[g * G] for g in step.revisited if last.get(row_tasks[g * G]) is False}
            metrics["replay/returned_tasks"].append(float(len(returned)))
        self.pending = PendingOutcomes(outcomes, records, offset)
        return success, fresh_rows, records

    def _log_calibration(self, step: GenerationStep, fresh_rows: list[int], success: list, metrics) -> None:
        """The plan's predicted spread against the one observed, over the groups it planned that stayed fresh
        (not replay groups): whether their fresh rollouts both won and failed."""
        G, predicted = self.num_generations, self._spread_predicted
        rows_of: dict[int, list[bool]] = {}
        for r in fresh_rows:
            if r // G in predicted and r // G not in step.plan.replay_groups:
                rows_of.setdefault(r // G, []).append(bool(success[r]))
        if rows_of:
            metrics["replay/spread_predicted_fresh"].append(float(np.mean([predicted[g] for g in rows_of])))
            metrics["replay/spread_observed_fresh"].append(
                float(np.mean([any(v) and not all(v) for v in rows_of.values()]))
            )
        self._spread_predicted = {}

    def _kept_for_rescue(self) -> str:
        """What a solved task keeps, said in the warning that every rollout succeeded."""
        n = self.rescue_rows
        return (
            f" (but the {n} success{'es' if n > 1 else ''} a solved task keeps for rescue, replay_rescue={n})"
            if n
            else ""
        )

    def _retirement_then(self) -> str:
        """What retirement then does, said in the warning that every rollout succeeded."""
        if not self.retiring:
            return ""
        ratio = self.settings.replay_revisit_ratio
        if ratio:
            return (
                f"; and, with replay_retire_solved=True, it is retired: it comes back only as a revisit "
                f"(replay_revisit_ratio={ratio:g} of its draws)"
            )
        return (
            "; and, with replay_retire_solved=True and replay_revisit_ratio=0, it is retired for good: training "
            "stops once every question is"
        )

    def flush(self) -> list[dict]:
        """Record the queued outcomes in the pool. Returns the summary inputs guided rollouts attached to the records
        (every rank's, in row order). Collective: every rank calls it at the same points."""
        pending, self.pending = self.pending, None
        ready, uncaptured = pending.captured() if pending is not None else ([], 0)
        if uncaptured:
            # Records get their log-probs from the loss forward of their micro-batch. A row it never reached: training
            # was stopped inside an optimizer step (a callback's should_training_stop between micro-batches), or an
            # override of `_compute_loss` / `_get_per_token_logps_and_entropies` skipped ours.
            message = (
                "a successful row was not stored: the loss never trained it, so it has no log-probs (training "
                "stopped between the micro-batches of a step, or an override of _compute_loss or "
                "_get_per_token_logps_and_entropies did not call super())"
            )
            self._faults.count("uncaptured_rows", message, uncaptured)
        merged = dict(gather_object(ready)) if self._accelerator.num_processes > 1 else dict(ready)
        summaries = [merged[row].pop("summary") for row in sorted(merged) if "summary" in merged[row]]
        if self.enabled and pending is not None:
            for outcome in pending.task_outcomes(merged):
                self.pool.record_outcome(outcome, keep_solved=self.rescue_rows)
        return summaries

    def log_generation(self, step: GenerationStep, metrics, *, global_step: int, max_steps: int) -> None:
        """The step's `replay/*` figures."""
        metrics["replay/started"].append(float(self.started(global_step, max_steps)))
        ages = [global_step - t.policy_version for ts in step.selected.values() for t in ts]
        log_generation(metrics, step.plan, len(step.row_tasks), ages, self.pool.stats(), self._faults.totals)


def _successes(n: int) -> str:
    return f"{n} stored success{'es' if n > 1 else ''}"


def dataset_task_keys(dataset, column: str) -> list[str]:
    """Each dataset row's task (`task_key`), read as one column where every row has the id (an Arrow read, not a walk
    of the rows, which takes seconds a hundred thousand rows)."""
    if column in (getattr(dataset, "column_names", None) or ()):
        ids = dataset[column]
        if all(value is not None for value in ids):
            return [str(value) for value in ids]
    return [task_key(row, column) for row in dataset]


def say_task_id_source(rows: list[dict], column: str) -> None:
    """Log once where the task ids come from: the `column` of the dataset rows, or a hash of each prompt (then a
    warning when only some rows miss it, and the rows' columns, in which a misspelled name shows)."""
    missing = sum(row.get(column) is None for row in rows)
    if not missing:
        # said at warning level, as the fallbacks are: the one line that says which rows count as one task
        logger.warning("trl_exreplay: task ids from the dataset's %r column (task_id_column).", column)
    elif missing == len(rows):
        logger.warning(
            "trl_exreplay: the dataset rows have no %r column (task_id_column; their columns: %s), so a task's id is "
            "a hash of its prompt: rows with the same prompt are one task. To name tasks, add that column or set "
            "task_id_column.",
            column,
            sorted(rows[0]) if rows else [],
        )
    else:
        logger.warning(
            "trl_exreplay: %d of the first batch's %d rows have no %r value (None or absent): their task id is a hash "
            "of their prompt, the others' their %r value.",
            missing,
            len(rows),
            column,
            column,
        )
