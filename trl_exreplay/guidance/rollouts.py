"""The trainer's experience-guided rollouts (AgentEvolver's Self-Navigating, arXiv 2511.10395; code:
github.com/modelscope/AgentEvolver, `agentevolver/module/exp_manager/`, described in its
`docs/guidelines/exp_manager.md`): `GuidedRollouts`, an object `ExReplayGRPOTrainer`'s hooks call, given what it needs
(settings and functions at construction, the step's figures in each call). The pure parts live in
`trl_exreplay.guidance` (allocation, template, providers, summariser).

In a generation step: the allocation (`guidance.allocation`, drawn on global rows, identical on every process) says
which fresh rows are guided and which tasks keep the guidance; a guided row's task text retrieves records from the
provider, and the filled template goes before its first user message (single-turn: in `_tokenize_prompts`;
multi-turn: after the environment's first observation). A row of a `discard` task then trains on its own prompt,
never modified, so it tokenizes exactly as if nothing had been inserted; its model tokens get `exp_mask = 1` and, as
behaviour log-probs, those of the generating policy under the guided prompt (one no-grad forward after generation):
the loss trains them off-policy, as replayed tokens. A row of a `keep` task trains on its guided prompt, on-policy.
A guided row that retrieved nothing is an ordinary row.

Successful fresh rollouts wait in the summariser's backlog (`guidance.summarizer`); every `guidance_update_freq`
steps they are summarised in a background thread, and the records are added at a later step boundary, on every
process at the same step. The store and the backlog are saved with every checkpoint (`exreplay_experience/`).
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections import Counter
from dataclasses import dataclass, field
from itertools import groupby

import torch
import xxhash
from accelerate.utils import broadcast_object_list

from ..distributed import gather_row_flags
from ..parts import StepHooks, model_context
from ..untrusted_text import added_token_strings, remove_token_strings, token_prefix
from .allocation import GuidanceAllocation, allocate_guidance
from .offline import OfflineExperienceProvider
from .provider import ExperienceProvider, SummaryInput
from .settings import GuidanceSettings
from .summarizer import BackgroundSummarizer
from .template import fit_experience, format_experience, insert_experience, task_text

logger = logging.getLogger(__name__)

EXPERIENCE_DIR = "exreplay_experience"


# Counts every process adds to for the whole run, logged as the sum over processes so far.
_RUNNING_TOTALS = (
    "retrieve_failures",
    "special_tokens_removed",
    "experience_truncated",
    "experience_cut_to_context",
    "unguided_for_context",
)


def guided_rollouts(
    trainer,
    settings: GuidanceSettings | None,
    provider: ExperienceProvider | None,
    faults,
    unsupported: dict[str, bool],
    *,
    policy_forward,
) -> GuidedRollouts | None:
    """The `GuidedRollouts` of `trainer` (a `GRPOTrainer` whose `__init__` ran) under `settings`, or None when neither
    training nor evaluation is guided (`guidance_train`, `guidance_eval`). Without a `provider`, the in-process
    `OfflineExperienceProvider`."""
    if settings is None or not settings.on:
        if provider is not None:
            warnings.warn(
                "An experience_provider was given but guidance_train and guidance_eval are 'off': "
                "no rollout is guided, so it is not used.",
                stacklevel=3,
            )
        return None
    settings.check_groups(trainer.num_generations)
    return GuidedRollouts(
        settings,
        provider,
        accelerator=trainer.accelerator,
        processing_class=trainer.processing_class,
        num_generations=trainer.num_generations,
        num_generations_eval=trainer.num_generations_eval,
        seed=trainer.args.seed,
        multi_turn=trainer.text_env_factory is not None,
        context=model_context(trainer.model, trainer.args if trainer.use_vllm else None),
        max_completion_length=trainer.max_completion_length,
        policy_forward=policy_forward,
        faults=faults,
        unsupported=unsupported,
    )


@dataclass
class GuidedBatch:
    """What guidance decided for one generation batch (this rank's rows are local, the allocation's global)."""

    allocation: GuidanceAllocation  # which rows are guided, which tasks keep the guidance (global rows)
    offset: int  # this rank's first global row
    guided_text: dict[int, str] = field(default_factory=dict)  # local row -> the experience text put in its prompt
    plain_prompt_ids: dict[int, list[int]] = field(default_factory=dict)  # local guided row -> prompt without it
    guided_prompt_ids: dict[int, list[int]] = field(default_factory=dict)  # local guided row -> its sampled prompt
    retrieved: dict[str, tuple] = field(default_factory=dict)  # task text -> (experience text or None, records)
    retrieval_down: bool = False  # the provider failed in this batch: its remaining rows go unguided
    stripped: bool = False  # the discarded rows got their plain prompt back in TRL's list

    def discarded(self, i: int) -> bool:
        """Local row `i` was sampled guided and trains on its prompt without the experience (off-policy)."""
        return i in self.guided_prompt_ids and self.allocation.discarded(self.offset + i)


class GuidedRollouts(StepHooks):
    """Experience-guided rollouts of a run, a part of the trainer's step (`trl_exreplay.parts.StepHooks`): the provider
    (`experience`), the summariser, and per batch (`batch`, a `GuidedBatch`) the allocation, the retrieved texts, the
    discarded rows' behaviour log-probs, the `guide/*` metrics and the summary inputs.

    `unsupported` names the run's features guidance cannot take (a True value refuses); `policy_forward` is a no-grad
    forward of the current policy (`selection.policy_forward`); `faults` the run's `FaultCounts`. A guided prompt
    leaves `max_completion_length` tokens of the model's `context` (`parts.model_context`, as first observations
    are bounded; None: no bound) for the completion (`_fit_prompt`)."""

    def __init__(
        self,
        settings: GuidanceSettings,
        provider: ExperienceProvider | None,
        *,
        accelerator,
        processing_class,
        num_generations: int,
        num_generations_eval: int,
        seed: int,
        multi_turn: bool,
        policy_forward,
        faults,
        unsupported: dict[str, bool],
        context: int | None = None,
        max_completion_length: int = 0,
    ):
        o = self.settings = settings
        self.train = o.guidance_train != "off"
        self.eval = o.guidance_eval != "off"
        self._accelerator = accelerator
        self._processing_class = processing_class
        self._num_generations = num_generations
        self._num_generations_eval = num_generations_eval
        self._seed = seed
        self._multi_turn = multi_turn
        # the tokens a guided row's prompt may have (None: no bound)
        self._room = None if context is None else context - max_completion_length
        self._policy_forward = policy_forward
        self._faults = faults
        for what, present in unsupported.items():
            if present:
                raise NotImplementedError(
                    f"Experience-guided rollouts with {what} are not supported yet; set guidance_train and "
                    "guidance_eval to 'off'."
                )
        self.experience = provider if provider is not None else OfflineExperienceProvider()
        # The main process alone summarises (once, not once per process: a summary may come from a model, and differ
        # between calls); an in-process store then gets its records broadcast to every process at the same step.
        self._summarizes = accelerator.is_main_process
        self.summarizer = BackgroundSummarizer(self.experience)
        can_grow = o.guidance_update_freq > 0 or o.guidance_init_from_pool
        if not can_grow and not self.experience.records() and not getattr(self.experience, "shared", False):
            logger.warning(
                "trl_exreplay: experience-guided rollouts are on, but guidance_update_freq=0 and "
                "guidance_init_from_pool=False leave the experience store empty: no rollout will be guided "
                "unless the provider was given records (or a resumed checkpoint holds some)."
            )
        self._guide_counts: Counter = Counter()
        self._eval_batches = 0  # evaluation batches drawn so far (every rank makes as many)
        self._last_update_step: int | None = None
        self._experience_started = False
        self._token_strings: list[str] | None = None  # what retrieved text may not spell (`_bounded`)
        self.batch: GuidedBatch | None = None  # the generation batch in progress, when guided
        self.plans_training = self.train  # a guided training batch needs the step's plan (global rows, seeds)
        self.reads_outcomes = True  # successes become summary inputs, guided or not
        self.reads_pool = o.guidance_init_from_pool  # the starting pool's trajectories are summarised

    # ------------------------------------------------------------------------------------------- each step
    def step_begins(self, global_step: int, pool) -> None:
        """At a step boundary: the main process collects a finished summarisation (never waiting for one), and every
        process adds its records at this same step; every `guidance_update_freq` steps the main process hands the
        backlog to the background thread. Collective (one broadcast) for an in-process store."""
        init, freq = self.settings.guidance_init_from_pool, self.settings.guidance_update_freq
        if not init and not freq:  # nothing is ever summarised: no collective to make (the config is every rank's)
            return
        step = global_step
        records = []
        if not self._experience_started:
            self._experience_started = True
            if init and step == 0:
                records += self._init_experience(pool)
        if self._summarizes:
            records += self.summarizer.collect()  # [] while the job runs
        if not getattr(self.experience, "shared", False) and self._accelerator.num_processes > 1:
            records = broadcast_object_list([records], from_process=0)[0]
        if records:
            self.experience.add(records)
        last = self._last_update_step
        if freq and (last is None or step - last >= freq):
            self._last_update_step = step
            if self._summarizes:
                self.summarizer.submit()

    def _init_experience(self, pool) -> list:
        """`guidance_init_from_pool`, on the main process: the starting pool's trajectories summarised now
        (before the first step) by an in-process provider, whose records it returns; a service gets them in the
        background (a long request must not hold the other processes at a collective)."""
        if not self._summarizes:
            return []
        inputs = []
        for task_id in pool.stored_tasks():
            row = pool.task_row(task_id) or {}
            for t in pool.trajectories(task_id):
                query = self._pool_task_text(row, t)
                inputs.append(
                    self._summary_input(
                        task_id, query, t.completion_ids, t.completion_mask, t.reward, t.policy_version
                    )
                )
        logger.info("trl_exreplay: experience initialised from %d pool trajectories.", len(inputs))
        if not inputs:
            return []
        if getattr(self.experience, "shared", False):
            self.summarizer.offer(inputs)
            self.summarizer.submit()
            return []
        try:
            return list(self.experience.summarize(inputs))
        except Exception as error:  # noqa: BLE001 - a failing provider is counted; training goes on unguided
            self.summarizer.failures += 1
            self.summarizer.offer(inputs)
            logger.warning("trl_exreplay: summarising the starting pool failed (%r); offered again later.", error)
            return []

    def _pool_task_text(self, row: dict, trajectory) -> str:
        prompt = row.get("prompt")
        if not self._multi_turn and prompt:
            try:
                return task_text(prompt)
            except (ValueError, TypeError, KeyError):
                pass
        # a multi-turn task's text is its first observation, which only the stored prompt's tokens hold
        return self._processing_class.decode(trajectory.prompt_ids, skip_special_tokens=True)

    def batch_planned(self, step, *, training: bool, global_step: int) -> None:
        """Which rows of the batch are guided, and, single-turn, their experience (multi-turn rows retrieve once
        their first observation is known, `guide_observation`). Training: drawn on global rows, never on replayed
        ones. Evaluation: drawn on the global batch (a group may span ranks), seeded by the step and the batch's
        number."""
        self.batch = None
        if training and self.train:
            replayed_rows = [r for r in range(len(step.row_tasks)) if step.plan.is_replayed(r)]  # the plan is global
            allocation = self._allocate(len(step.row_tasks), step.seed, replayed_rows)
        elif not training and self.eval:
            seed = [self._seed, global_step, self._eval_batches, 1]
            self._eval_batches += 1
            step.offset = self._accelerator.process_index * len(step.rows)
            allocation = self._allocate(len(step.rows) * self._accelerator.num_processes, seed, training=False)
        else:
            return
        self.batch = GuidedBatch(allocation, step.offset)
        if not self._multi_turn:
            self._guide_rows(self._row_queries(step.rows))

    def _allocate(self, num_rows: int, seed: list[int], replayed_rows=(), training: bool = True):
        """The allocation of a batch of `num_rows` rows (groups of num_generations consecutive rows)."""
        o = self.settings
        if training:
            generations, mode, sample_mode = self._num_generations, o.guidance_train, o.guidance_trained_prompt
        else:  # evaluation trains nothing: a guided row keeps its guidance
            generations, mode, sample_mode = self._num_generations_eval, o.guidance_eval, "guided"
        if mode == "off":
            return None
        return allocate_guidance(
            generations,
            num_rows // generations,
            mode,
            o.guidance_ratio,
            sample_mode,
            o.guidance_keep_ratio,
            seed,
            replayed_rows,
        )

    def _retrieve_experience(self, query: str) -> tuple[str | None, int]:
        """The filled template for a task text and the number of records in it; (None, 0) when nothing was retrieved
        or the provider failed (counted; the rest of the step then goes unguided: one slow or failing service costs a
        step one timeout at most). One retrieval per task text and step."""
        batch = self.batch
        if query in batch.retrieved:
            return batch.retrieved[query]
        result: tuple[str | None, int] = (None, 0)
        if not batch.retrieval_down:
            k = self.settings.guidance_top_k
            try:
                contents = self.experience.retrieve(query, k)
                if not isinstance(contents, (list, tuple)):
                    raise TypeError(f"retrieve() returned {type(contents).__name__}, not a list of strings")
                contents = [c for c in contents if isinstance(c, str) and c.strip()][:k]
                for text in contents:
                    text.encode("utf-8")  # a lone surrogate cannot be tokenized: the provider failed
                if contents:
                    template = self.settings.guidance_template
                    result = (format_experience(template, [self._bounded(contents)]), len(contents))
            except Exception as error:  # noqa: BLE001 - a failing provider is counted; the rollout goes unguided
                batch.retrieval_down = True
                self._guide_counts["retrieve_failures"] += 1
                message = "trl_exreplay: experience retrieval failed (%r); the step goes unguided (counted in %s)."
                self._faults.warn_once("retrieve", message, error, "guide/retrieve_failures; logged once")
        batch.retrieved[query] = result
        return result

    def _bounded(self, contents: list[str]) -> str:
        """Retrieved records joined as the template receives them, made safe: no spelling of a special or added token
        (it would forge a chat turn or an end of sequence in the trained prompt), at most `guidance_max_tokens`."""
        if self._token_strings is None:  # the tokenizer's added tokens do not change during a run
            self._token_strings = added_token_strings(self._processing_class)
        text, removed = remove_token_strings("\n".join(contents), self._token_strings)
        text, cut = token_prefix(text, self._processing_class, self.settings.guidance_max_tokens)
        self._guide_counts["special_tokens_removed"] += removed
        self._guide_counts["experience_truncated"] += int(cut)
        return text

    def _guide_rows(self, queries: dict[int, str | None]) -> None:
        """Retrieve for this rank's allocated rows (local row -> task text, None: the row cannot be guided) and keep
        the texts in the batch."""
        batch = self.batch
        for i, query in queries.items():
            if not batch.allocation.guided[batch.offset + i]:
                continue
            self._guide_counts["rows_allocated"] += 1
            if query is None:
                continue
            text, count = self._retrieve_experience(query)
            self._guide_counts["records_retrieved"] += count
            if text is not None:
                batch.guided_text[i] = text

    def _row_queries(self, rows: list[dict]) -> dict[int, str | None]:
        """Each row's task text (its first user message), what retrieval matches; None for a row without a text user
        message (it goes unguided, and a warning says so once: an error here, on one process, would hang the
        others)."""
        queries = {}
        for i, row in enumerate(rows):
            try:
                queries[i] = task_text(row["prompt"])
            except (ValueError, TypeError, KeyError):
                queries[i] = None
                message = "trl_exreplay: a prompt without a text user message goes unguided (logged once)."
                self._faults.warn_once("no_user_text", message)
        return queries

    def _fit_prompt(self, i: int, render, ids: list[int] | None = None) -> list[int] | None:
        """The prompt local row `i` is sampled on: `render(text)` (`ids`, when the caller has it) for its experience
        `batch.guided_text[i]`, cut where that prompt would leave less than `max_completion_length` tokens of the
        model's context (`guide/experience_cut_to_context`). None, the row unguided (`guide/unguided_for_context`),
        when not one token of experience fits."""
        guided_text = self.batch.guided_text
        text = guided_text[i]
        if self._room is None:
            return render(text) if ids is None else ids
        template = self.settings.guidance_template
        fitted = fit_experience(text, template, render, self._room, self._processing_class, ids)
        if fitted is None:
            del guided_text[i]
            self._guide_counts["unguided_for_context"] += 1
            return None
        if fitted[0] != text:
            guided_text[i] = fitted[0]
            self._guide_counts["experience_cut_to_context"] += 1
        return fitted[1]

    def take_step_counts(self) -> list[int]:
        """This step's counts (rows allocated to guidance, records retrieved, rows discarded), reset for the next."""
        return [self._guide_counts.pop(kind, 0) for kind in ("rows_allocated", "records_retrieved", "rows_discarded")]

    # ------------------------------------------------------------------------------------- multi-turn
    def guide_observation(self, i: int, observation: str, render) -> list[int] | None:
        """Multi-turn: the prompt local row `i` is sampled on, its experience retrieved by the game's first
        `observation` and rendered by `render(text)` within the model's context; None: the row goes unguided."""
        if self.batch is None:
            return None
        self._guide_rows({i: observation})
        if i not in self.batch.guided_text:
            return None
        return self._fit_prompt(i, render)

    def trained_prompt(self, i: int, sampled_ids: list[int], plain_ids: list[int]) -> list[int]:
        """Multi-turn: the prompt guided row `i` trains on (it was sampled on `sampled_ids`; `plain_ids` has no
        experience): the plain one where its task discards the guidance."""
        batch = self.batch
        batch.guided_prompt_ids[i], batch.plain_prompt_ids[i] = sampled_ids, plain_ids
        return plain_ids if batch.discarded(i) else sampled_ids

    # ------------------------------------------------------------------------------------- single-turn
    def prompts_tokenized(self, step, prompts: list, prompt_ids: list, tokenize) -> None:
        """Single-turn: the guided rows of `prompt_ids` (TRL's tokenisation of `prompts`) take their guided prompt, in
        place, tokenized by `tokenize` (TRL's `_tokenize_prompts`) and kept within the model's context
        (`_fit_prompt`); both prompts are kept in the batch."""
        batch = self.batch
        if batch is None or not batch.guided_text or batch.guided_prompt_ids:
            return
        rows = sorted(batch.guided_text)
        guided_ids, _, _ = tokenize([insert_experience(prompts[i], batch.guided_text[i]) for i in rows])
        for i, ids in zip(rows, guided_ids):
            render = functools.partial(_render, tokenize, prompts[i])
            ids = self._fit_prompt(i, render, list(ids))
            if ids is None:
                continue  # an ordinary row: its prompt is TRL's
            batch.plain_prompt_ids[i] = list(prompt_ids[i])
            batch.guided_prompt_ids[i] = list(ids)
            prompt_ids[i] = list(ids)  # generated under the guided prompt

    def samples_per_prompt(self, num_generations: int, use_vllm: bool) -> int:
        # a group's rows hold different prompts now: one sample per row (vLLM's server mode would sample the whole
        # group from its first prompt); the allocation is global, so every rank decides alike
        guiding = self.batch is not None and any(self.batch.allocation.guided)
        return 1 if use_vllm and guiding else num_generations

    def generated(self, step, prompt_ids: list) -> None:
        """Once, after generation: give the rows of `discard` tasks back their prompt without the experience, in place
        in the list of prompts TRL trains on (the rows of `keep` tasks train on the prompt they were sampled with)."""
        batch = self.batch
        if batch is None or batch.stripped:
            return
        batch.stripped = True
        for i, ids in batch.plain_prompt_ids.items():
            if batch.discarded(i):
                prompt_ids[i] = list(ids)

    def rescue_skips_rows(self) -> set[int]:
        """Guided rows: their groups are guidance's experiment, which a stored success must not change."""
        if self.batch is None:
            return set()
        return {r for r, flag in enumerate(self.batch.allocation.guided) if flag}

    def trains_off_policy(self) -> bool:
        allocation = None if self.batch is None else self.batch.allocation
        return allocation is not None and any(allocation.discarded(r) for r in range(len(allocation.guided)))

    # ---------------------------------------------------------------------------------- after generation
    def mark_off_policy_rows(self, output: dict, step) -> None:
        """Mark this rank's discarded guided rows for the loss: `exp_mask` on their model tokens, their behaviour
        log-probs (the current policy under the guided prompt, which sampled them), advantage 0 in TRL's own term.
        Collective: every rank makes the same forward calls."""
        if not self.trains_off_policy():  # the allocation is global: every rank returns here alike
            return
        batch = self.batch
        discarded = sorted(i for i in batch.guided_prompt_ids if batch.discarded(i))
        most = len(discarded)
        if self._accelerator.num_processes > 1:
            count = torch.tensor([float(most)], device=self._accelerator.device)
            most = int(self._accelerator.reduce(count, reduction="max").item())
        if most == 0:
            return
        completion_mask = output["completion_mask"]
        model_mask = completion_mask * output.get("tool_mask", 1)
        lengths = completion_mask.sum(dim=1).tolist()
        rows = discarded + [discarded[0] if discarded else 0] * (most - len(discarded))  # padding rows: same calls
        # a padding row (this rank has fewer discarded rows, or none) repeats one of them, or row 0 as it is
        prompts = [
            batch.guided_prompt_ids[i] if i in batch.guided_prompt_ids else output["prompt_ids"][i].tolist()
            for i in rows
        ]
        completions = [output["completion_ids"][i, : max(int(lengths[i]), 1)].tolist() for i in rows]
        masks = [model_mask[i, : max(int(lengths[i]), 1)].tolist() for i in rows]
        logps, _, _ = self._policy_forward(prompts, completions, masks)
        for j, i in enumerate(discarded):
            n = int(lengths[i])
            output["exp_mask"][i, :n] = model_mask[i, :n].long()
            output["recorded_per_token_logps"][i, :n] = logps[j, :n].float() * model_mask[i, :n]
            output["exreplay_replayed"][i] = 1
        if "importance_sampling_ratio" in output and discarded:
            # the vLLM sampler correction compares with the stripped prompt's log-probs: not this row's behaviour
            output["importance_sampling_ratio"][torch.tensor(discarded, device=completion_mask.device)] = 1.0
        self._guide_counts["rows_discarded"] += len(discarded)

    def batch_finished(
        self,
        output: dict,
        step,
        *,
        training: bool,
        records: dict[int, dict],
        success: list,
        fresh_rows: list[int],
        metrics,
        global_step: int,
    ) -> None:
        """Training: the records' guided rows and summary inputs (`_add_to_records`), and, where training is guided,
        the `guide/*` metrics (collective). Evaluation: its retrieval counts stay out of the training metrics."""
        if training:
            self._add_to_records(output, records, step, global_step)
            if self.train:
                self._log(step, success, fresh_rows, metrics)
        elif self.batch is not None:
            self.take_step_counts()
        self.batch = None

    def _add_to_records(self, output: dict, records: dict[int, dict], step, global_step: int) -> None:
        """Pool records of guided rows: stored with the prompt they will be replayed on, the one without the
        experience (replay trains them off-policy anyway), and the behaviour log-probs recorded under guidance; and
        every success's summary input for the summariser."""
        batch = self.batch
        plain_prompt_ids = {} if batch is None else batch.plain_prompt_ids
        for row, record in records.items():
            i = row - step.offset
            if i in plain_prompt_ids:
                record["prompt_ids"] = list(plain_prompt_ids[i])
                if batch.discarded(i):
                    n = len(record["completion_ids"])
                    mask = torch.tensor(record["completion_mask"], dtype=torch.float32)
                    record["logps"] = (output["recorded_per_token_logps"][i, :n].cpu().float() * mask).tolist()
            query = self._row_queries([step.rows[i]])[0]  # the row as TRL has it: never the guided copy
            if query is None:
                continue
            summary = self._summary_input(
                record["task_id"],
                query,
                record["completion_ids"],
                record["completion_mask"],
                record["reward"],
                global_step,
            )
            record["summary"] = summary.as_dict()

    def _summary_input(self, task_id, query, completion_ids, completion_mask, reward, step) -> SummaryInput:
        """A successful rollout as text: the model's turns (runs of model tokens) and the environment's between."""
        decode = self._processing_class.decode
        texts = [
            (trained, decode([token for token, _ in run], skip_special_tokens=True).strip())
            for trained, run in groupby(zip(completion_ids, completion_mask), key=lambda pair: bool(pair[1]))
        ]
        digest = xxhash.xxh3_64_hexdigest(repr(list(completion_ids)).encode())
        return SummaryInput(
            source=f"{task_id}:{digest}",
            task_id=str(task_id),
            query=query,
            actions=[text for trained, text in texts if trained and text],
            reward=float(reward),
            step=int(step),
            observations=[text for trained, text in texts if not trained and text],
        )

    def outcomes_flushed(self, summaries: list[dict]) -> None:
        """Every rank's summary inputs of the last step (in row order, `ReplayController.flush`) into the backlog."""
        inputs = [SummaryInput(**summary) for summary in summaries]
        if inputs and self._summarizes and self.settings.guidance_update_freq > 0:  # 0: nothing will take them
            self.summarizer.offer(inputs)

    def _log(self, step, success: list[bool], fresh_rows: list[int], metrics) -> None:
        """`guide/*` metrics of a generation step. Collective."""
        guided_text = {} if self.batch is None else self.batch.guided_text
        guided = gather_row_flags(self._accelerator, set(guided_text), len(step.task_rows))
        counts = self._guide_counts
        local = torch.tensor(
            [*self.take_step_counts(), *(counts[kind] for kind in _RUNNING_TOTALS)],
            dtype=torch.float64,
            device=self._accelerator.device,
        )
        allocated, retrieved, discarded, *totals = self._accelerator.reduce(local, reduction="sum").tolist()
        metrics["guide/guided_fraction"].append(sum(guided) / max(len(guided), 1))
        metrics["guide/discarded_fraction"].append(discarded / max(len(guided), 1))
        if allocated:
            metrics["guide/records_per_rollout"].append(retrieved / allocated)
        for name, flag in (("guided", True), ("unguided", False)):
            rows = [r for r in fresh_rows if guided[r] == flag]
            if rows:
                metrics[f"guide/success_{name}"].append(sum(success[r] for r in rows) / len(rows))
        summarizer = self.summarizer
        metrics["guide/summarizer_backlog"] = [len(summarizer.pending())]
        metrics["guide/summarizer_failures"] = [summarizer.failures]  # running totals: the latest value
        for kind, total in zip(_RUNNING_TOTALS, totals):
            metrics[f"guide/{kind}"] = [total]
        provider = self.experience  # its size, without copying its records where it can say it
        metrics["guide/store_records"] = [len(provider) if hasattr(provider, "__len__") else len(provider.records())]

    # ------------------------------------------------------------------------------------------ checkpoints
    def save(self, output_dir: str, should_save: bool) -> None:
        from .store import save_experience

        if should_save:
            save_experience(
                os.path.join(output_dir, EXPERIENCE_DIR), self.experience.records(), self.summarizer.pending()
            )

    def resume(self, checkpoint: str) -> None:
        from .store import MANIFEST, load_experience

        folder = os.path.join(checkpoint, EXPERIENCE_DIR)
        if not os.path.lexists(os.path.join(folder, MANIFEST)):  # none, or a first save killed before its commit
            message = (
                f"trl_exreplay: the checkpoint {checkpoint} holds no experience store ({EXPERIENCE_DIR}/): guided "
                "rollouts resume with the provider's records only."
            )
            logger.warning(message)
            warnings.warn(message, stacklevel=2)
            return
        loaded = load_experience(folder)
        self.experience.add(loaded.records)
        if self._summarizes:
            self.summarizer.restore(loaded.backlog)
        self._experience_started = True  # the store was initialised by the run that saved it

    def train_ended(self) -> None:
        self.summarizer.close()


def _render(tokenize, prompt, text: str) -> list[int]:
    """`prompt` with `text` inserted, tokenized by `tokenize` (TRL's `_tokenize_prompts`)."""
    return list(tokenize([insert_experience(prompt, text)])[0][0])
