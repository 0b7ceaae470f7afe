"""The trainer's experience-guided rollouts (AgentEvolver's Self-Navigating, seed 003). A mixin of
`ExReplayGRPOTrainer`; the pure parts live in `trl_exreplay.guidance` (allocation, template, providers, summariser).

In a generation step: the allocation (`guidance.allocation`, drawn on global rows, identical on every process) says
which fresh rows are guided and which tasks keep the guidance; a guided row's task text retrieves records from the
provider, and the filled template goes before its first user message (single-turn: in `_tokenize_prompts`;
multi-turn: after the environment's first observation). A row of a `discard` task then trains on its own prompt,
never modified, so it tokenizes exactly as if nothing had been inserted; its model tokens get `exp_mask = 1` and, as
behaviour log-probs, those of the generating policy under the guided prompt (one no-grad forward after generation):
the loss trains them off-policy, as replayed tokens. A row of a `keep` task trains on its guided prompt, on-policy.
A guided row that retrieved nothing is an ordinary row.

Successful fresh rollouts wait in the summariser's backlog (`guidance.summarizer`); every `experience_update_freq`
steps they are summarised in a background thread, and the records are added at a later step boundary, on every
process at the same step. The store and the backlog are saved with every checkpoint (`exreplay_experience/`).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import Counter
from itertools import groupby

import torch
import xxhash
from accelerate.utils import broadcast_object_list

from .distributed import gather_row_flags
from .guidance import ExperienceProvider, SummaryInput
from .guidance.allocation import allocate_guidance
from .guidance.summarizer import BackgroundSummarizer
from .guidance.template import format_experience, insert_experience, task_text
from .untrusted_text import added_token_strings, remove_token_strings, token_prefix

logger = logging.getLogger(__name__)

EXPERIENCE_DIR = "exreplay_experience"


# Counts every process adds to for the whole run, logged as the sum over processes so far.
_RUNNING_TOTALS = ("retrieve_failures", "special_tokens_removed", "experience_truncated")


def make_provider(options: dict) -> ExperienceProvider:
    """The provider a configuration names (`experience_provider`)."""
    if options["experience_provider"] == "reme":
        from .guidance.reme import ReMeExperienceProvider

        return ReMeExperienceProvider(
            options["experience_base_url"], options["experience_workspace_id"], timeout=options["experience_timeout"]
        )
    from .guidance.offline import OfflineExperienceProvider

    return OfflineExperienceProvider()


class ExperienceGuidance:
    """`self._experience` (the provider, None when the feature is off) and `self._summarizer`."""

    def _setup_guidance(self, provider: ExperienceProvider | None, user_rollout_func: bool) -> None:
        o = self.replay
        self._guide_train = o["train_rollout_expmode"] != "woexp"
        self._guide_eval = o["val_rollout_expmode"] != "woexp"
        self._guidance_on = self._guide_train or self._guide_eval
        self._experience: ExperienceProvider | None = None
        self._summarizer: BackgroundSummarizer | None = None
        if not self._guidance_on:
            if provider is not None:
                warnings.warn(
                    "An experience_provider was given but train_rollout_expmode and val_rollout_expmode are 'woexp': "
                    "no rollout is guided, so it is not used.",
                    stacklevel=3,
                )
            return
        unsupported = {
            "tools or environment_factory (TRL's tool loop)": bool(self.tools)
            or self.environment_factories is not None,
            "a custom rollout_func": user_rollout_func,
            "vision-language models": self._is_vlm,
        }
        for what, present in unsupported.items():
            if present:
                raise NotImplementedError(
                    f"Experience-guided rollouts with {what} are not supported yet; set train_rollout_expmode and "
                    "val_rollout_expmode to 'woexp'."
                )
        self._experience = provider if provider is not None else make_provider(o)
        # The main process alone summarises (once, not once per process: a summary may come from a model, and differ
        # between calls); an in-process store then gets its records broadcast to every process at the same step.
        self._summarizes = self.accelerator.is_main_process
        self._summarizer = BackgroundSummarizer(self._experience)
        can_grow = o["experience_update_freq"] > 0 or o["init_experience_before_training"]
        if not can_grow and not self._experience.records() and not getattr(self._experience, "shared", False):
            logger.warning(
                "trl_exreplay: experience-guided rollouts are on, but experience_update_freq=0 and "
                "init_experience_before_training=False leave the experience store empty: no rollout will be guided "
                "unless the provider was given records (or a resumed checkpoint holds some)."
            )
        self._guide_counts: Counter = Counter()
        self._eval_batches = 0  # evaluation batches drawn so far (every rank makes as many)
        self._last_update_step: int | None = None
        self._experience_started = False
        self._experience_template = o["experience_template"]
        self._token_strings: list[str] | None = None  # what retrieved text may not spell (`_bounded`)

    # ------------------------------------------------------------------------------------------- each step
    def _experience_step_begin(self) -> None:
        """At a step boundary: the main process collects a finished summarisation (never waiting for one), and every
        process adds its records at this same step; every `experience_update_freq` steps the main process hands the
        backlog to the background thread. Collective (one broadcast) for an in-process store."""
        init, freq = self.replay["init_experience_before_training"], self.replay["experience_update_freq"]
        if not init and not freq:  # nothing is ever summarised: no collective to make (the config is every rank's)
            return
        step = self.state.global_step
        records = []
        if not self._experience_started:
            self._experience_started = True
            if init and step == 0:
                records += self._init_experience()
        if self._summarizes:
            records += self._summarizer.collect()  # [] while the job runs
        if not getattr(self._experience, "shared", False) and self.accelerator.num_processes > 1:
            records = broadcast_object_list([records], from_process=0)[0]
        if records:
            self._experience.add(records)
        last = self._last_update_step
        if freq and (last is None or step - last >= freq):
            self._last_update_step = step
            if self._summarizes:
                self._summarizer.submit()

    def _init_experience(self) -> list:
        """`init_experience_before_training`, on the main process: the starting pool's trajectories summarised now
        (before the first step) by an in-process provider, whose records it returns; a service gets them in the
        background (a long request must not hold the other processes at a collective)."""
        if not self._summarizes:
            return []
        inputs = []
        for task_id in self.pool.stored_tasks():
            row = self.pool.task_row(task_id) or {}
            for t in self.pool.trajectories(task_id):
                query = self._pool_task_text(row, t)
                inputs.append(
                    self._summary_input(
                        task_id, query, t.completion_ids, t.completion_mask, t.reward, t.policy_version
                    )
                )
        logger.info("trl_exreplay: experience initialised from %d pool trajectories.", len(inputs))
        if not inputs:
            return []
        if getattr(self._experience, "shared", False):
            self._summarizer.offer(inputs)
            self._summarizer.submit()
            return []
        try:
            return list(self._experience.summarize(inputs))
        except Exception as error:  # noqa: BLE001 - a failing provider is counted; training goes on unguided
            self._summarizer.failures += 1
            self._summarizer.offer(inputs)
            logger.warning("trl_exreplay: summarising the starting pool failed (%r); offered again later.", error)
            return []

    def _pool_task_text(self, row: dict, trajectory) -> str:
        prompt = row.get("prompt")
        if self.text_env_factory is None and prompt:
            try:
                return task_text(prompt)
            except (ValueError, TypeError, KeyError):
                pass
        # a multi-turn task's text is its first observation, which only the stored prompt's tokens hold
        return self.processing_class.decode(trajectory.prompt_ids, skip_special_tokens=True)

    def _allocate(self, num_rows: int, seed: list[int], replayed_rows=(), training: bool = True):
        """The allocation of a batch of `num_rows` rows (groups of num_generations consecutive rows)."""
        o = self.replay
        if training:
            generations, mode, sample_mode = (
                self.num_generations,
                o["train_rollout_expmode"],
                o["train_sample_expmode"],
            )
        else:  # evaluation trains nothing: a guided row keeps its guidance
            generations, mode, sample_mode = self.num_generations_eval, o["val_rollout_expmode"], "allkeep"
        if mode == "woexp":
            return None
        return allocate_guidance(
            generations,
            num_rows // generations,
            mode,
            o["rollout_expratio"],
            sample_mode,
            o["train_sample_keepratio"],
            seed,
            replayed_rows,
        )

    def _retrieve_experience(self, step, query: str) -> tuple[str | None, int]:
        """The filled template for a task text and the number of records in it; (None, 0) when nothing was retrieved
        or the provider failed (counted; the rest of the step then goes unguided: one slow or failing service costs a
        step one timeout at most). One retrieval per task text and step."""
        if query in step.retrieved:
            return step.retrieved[query]
        result: tuple[str | None, int] = (None, 0)
        if not step.retrieval_down:
            k = self.replay["retrieve_top_k"]
            try:
                contents = self._experience.retrieve(query, k)
                if not isinstance(contents, (list, tuple)):
                    raise TypeError(f"retrieve() returned {type(contents).__name__}, not a list of strings")
                contents = [c for c in contents if isinstance(c, str) and c.strip()][:k]
                for text in contents:
                    text.encode("utf-8")  # a lone surrogate cannot be tokenized: the provider failed
                if contents:
                    result = (format_experience(self._experience_template, [self._bounded(contents)]), len(contents))
            except Exception as error:  # noqa: BLE001 - a failing provider is counted; the rollout goes unguided
                step.retrieval_down = True
                self._guide_counts["retrieve_failures"] += 1
                if "retrieve" not in self._warned:
                    self._warned.add("retrieve")
                    message = "trl_exreplay: experience retrieval failed (%r); the step goes unguided (counted in %s)."
                    logger.warning(message, error, "guide/retrieve_failures; logged once")
        step.retrieved[query] = result
        return result

    def _bounded(self, contents: list[str]) -> str:
        """Retrieved records joined as the template receives them, made safe: no spelling of a special or added token
        (it would forge a chat turn or an end of sequence in the trained prompt), at most `experience_max_tokens`."""
        if self._token_strings is None:  # the tokenizer's added tokens do not change during a run
            self._token_strings = added_token_strings(self.processing_class)
        text, removed = remove_token_strings("\n".join(contents), self._token_strings)
        text, cut = token_prefix(text, self.processing_class, self.replay["experience_max_tokens"])
        self._guide_counts["special_tokens_removed"] += removed
        self._guide_counts["experience_truncated"] += int(cut)
        return text

    def _guide_rows(self, step, offset: int, queries: dict[int, str | None]) -> None:
        """Retrieve for this rank's allocated rows (local row -> task text, None: the row cannot be guided) and keep
        the texts in `step`."""
        for i, query in queries.items():
            if not step.guidance.guided[offset + i]:
                continue
            self._guide_counts["rows_allocated"] += 1
            if query is None:
                continue
            text, count = self._retrieve_experience(step, query)
            self._guide_counts["records_retrieved"] += count
            if text is not None:
                step.guided_text[i] = text

    def _row_queries(self, rows: list[dict]) -> dict[int, str | None]:
        """Each row's task text (its first user message), what retrieval matches; None for a row without a text user
        message (it goes unguided, and a warning says so once: an error here, on one process, would hang the others)."""
        queries = {}
        for i, row in enumerate(rows):
            try:
                queries[i] = task_text(row["prompt"])
            except (ValueError, TypeError, KeyError):
                queries[i] = None
                if "no_user_text" not in self._warned:
                    self._warned.add("no_user_text")
                    logger.warning("trl_exreplay: a prompt without a text user message goes unguided (logged once).")
        return queries

    def _take_step_counts(self) -> list[int]:
        """This step's counts (rows allocated to guidance, records retrieved, rows discarded), reset for the next."""
        return [self._guide_counts.pop(kind, 0) for kind in ("rows_allocated", "records_retrieved", "rows_discarded")]

    # ------------------------------------------------------------------------------------- single-turn
    def _tokenize_prompts(self, prompts: list):
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        step = self._generation
        if step is None or not step.guided_text or step.guided_prompt_ids:
            return prompt_ids, images, multimodal_fields
        rows = sorted(step.guided_text)
        guided = [insert_experience(prompts[i], step.guided_text[i]) for i in rows]
        guided_ids, _, _ = super()._tokenize_prompts(guided)
        for i, ids in zip(rows, guided_ids):
            step.plain_prompt_ids[i] = list(prompt_ids[i])
            step.guided_prompt_ids[i] = list(ids)
            prompt_ids[i] = list(ids)  # generated under the guided prompt
        return prompt_ids, images, multimodal_fields

    # ---------------------------------------------------------------------------------- after generation
    def _attach_guided_rows(self, output: dict, step, offset: int) -> None:
        """Mark this rank's discarded guided rows for the loss: `exp_mask` on their model tokens, their behaviour
        log-probs (the current policy under the guided prompt, which sampled them), advantage 0 in TRL's own term.
        Collective: every rank makes the same forward calls."""
        discarded = sorted(i for i in step.guided_prompt_ids if step.guidance.discarded(offset + i))
        most = len(discarded)
        if self.accelerator.num_processes > 1:
            count = torch.tensor([float(most)], device=self.accelerator.device)
            most = int(self.accelerator.reduce(count, reduction="max").item())
        if most == 0:
            return
        completion_mask = output["completion_mask"]
        model_mask = completion_mask * output.get("tool_mask", 1)
        lengths = completion_mask.sum(dim=1).tolist()
        rows = discarded + [discarded[0] if discarded else 0] * (most - len(discarded))  # padding rows: same calls
        # a padding row (this rank has fewer discarded rows, or none) repeats one of them, or row 0 as it is
        prompts = [step.guided_prompt_ids[i] if i in step.guided_prompt_ids else output["prompt_ids"][i].tolist()
                   for i in rows]  # fmt: skip
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

    def _guided_records(self, output: dict, records: dict[int, dict], step, offset: int) -> None:
        """Pool records of guided rows: stored with the prompt they will be replayed on, the one without the
        experience (replay trains them off-policy anyway), and the behaviour log-probs recorded under guidance; and
        every success's summary input for the summariser."""
        for row, record in records.items():
            i = row - offset
            if i in step.plain_prompt_ids:
                record["prompt_ids"] = list(step.plain_prompt_ids[i])
                if step.guidance.discarded(row):
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
                self.state.global_step,
            )
            record["summary"] = summary.as_dict()

    def _summary_input(self, task_id, query, completion_ids, completion_mask, reward, step) -> SummaryInput:
        """A successful rollout as text: the model's turns (runs of model tokens) and the environment's between."""
        decode = self.processing_class.decode
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

    def _offer_summaries(self, merged: dict[int, dict]) -> None:
        """Take the summary inputs out of every rank's gathered records (in row order) into the backlog."""
        inputs = [SummaryInput(**merged[row].pop("summary")) for row in sorted(merged) if "summary" in merged[row]]
        if inputs and self._summarizes and self.replay["experience_update_freq"] > 0:  # 0: nothing will take them
            self._summarizer.offer(inputs)

    def _log_guidance(self, step, success: list[bool], fresh_rows: list[int], num_local: int) -> None:
        """`guide/*` metrics of a generation step. Collective."""
        guided = gather_row_flags(self.accelerator, set(step.guided_text), num_local)
        counts = self._guide_counts
        local = torch.tensor(
            [*self._take_step_counts(), *(counts[kind] for kind in _RUNNING_TOTALS)],
            dtype=torch.float64,
            device=self.accelerator.device,
        )
        allocated, retrieved, discarded, *totals = self.accelerator.reduce(local, reduction="sum").tolist()
        metrics = self._metrics["train" if self.model.training else "eval"]
        metrics["guide/guided_fraction"].append(sum(guided) / max(len(guided), 1))
        metrics["guide/discarded_fraction"].append(discarded / max(len(guided), 1))
        if allocated:
            metrics["guide/records_per_rollout"].append(retrieved / allocated)
        for name, flag in (("guided", True), ("unguided", False)):
            rows = [r for r in fresh_rows if guided[r] == flag]
            if rows:
                metrics[f"guide/success_{name}"].append(sum(success[r] for r in rows) / len(rows))
        summarizer = self._summarizer
        metrics["guide/summarizer_backlog"] = [len(summarizer.pending())]
        metrics["guide/summarizer_failures"] = [summarizer.failures]  # running totals: the latest value
        for kind, total in zip(_RUNNING_TOTALS, totals):
            metrics[f"guide/{kind}"] = [total]
        provider = self._experience  # its size, without copying its records where it can say it
        metrics["guide/store_records"] = [len(provider) if hasattr(provider, "__len__") else len(provider.records())]

    # ------------------------------------------------------------------------------------------ checkpoints
    def _save_experience(self, output_dir: str) -> None:
        from .guidance.store import save_experience

        if self.args.should_save:
            save_experience(
                os.path.join(output_dir, EXPERIENCE_DIR), self._experience.records(), self._summarizer.pending()
            )

    def _resume_experience(self, checkpoint: str) -> None:
        from .guidance.store import load_experience

        folder = os.path.join(checkpoint, EXPERIENCE_DIR)
        if not os.path.lexists(folder):
            message = (
                f"trl_exreplay: the checkpoint {checkpoint} holds no experience store ({EXPERIENCE_DIR}/): guided "
                "rollouts resume with the provider's records only."
            )
            logger.warning(message)
            warnings.warn(message, stacklevel=2)
            return
        loaded = load_experience(folder)
        self._experience.add(loaded.records)
        if self._summarizes:
            self._summarizer.restore(loaded.backlog)
        self._experience_started = True  # the store was initialised by the run that saved it
