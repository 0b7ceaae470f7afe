"""Multi-turn rollouts: all episodes of a batch advance together, one batched generation per turn.

A trajectory is one sequence. The prompt is the chat template applied to (optional system prompt +) the first
observation; the completion is the model's turns and the environment's turns in order. `env_mask` is 1 on tokens the
model generated and 0 on environment and template tokens, so only the model's tokens are trained (or, when replayed,
marked in `exp_mask`).

Lockstep: with a `sync` callback (multi-process), every rank runs the same number of turns, the largest any rank
needs, and makes exactly one `generate` call per turn (a dummy one when it has no active episode left), so ranks with
different numbers of episodes or turns (or none at all) make the same collective calls inside generation.

Observations are untrusted text: here, where they are tokenized (whatever ran the environment: this process, an
`EnvProcessPool` worker or a Ray actor; each returns text), their spellings of special tokens are removed, refused or
kept (`special_tokens`), once per observation.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..untrusted_text import SpecialTokenFilter, token_prefix

logger = logging.getLogger(__name__)

# An observation cut for the budget keeps this many tokens more than fit, so the kept ones tokenize as in the whole.
_CUT_MARGIN_TOKENS = 8
# Characters per token past which an observation is cut before it is tokenized; a shorter one costs at most that many
# characters per token it could keep, and is tokenized once, whole.
_CUT_CHARS_PER_TOKEN = 8


class ChatTurns:
    """Token pieces of a chat template, derived once by rendering small conversations and taking differences.

    Requires an incremental template: rendering a longer conversation must extend the shorter one token for token.
    """

    _PROBE_USER, _PROBE_ASSISTANT = "hello", "ok"

    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.kwargs = chat_template_kwargs or {}
        user = [{"role": "user", "content": self._PROBE_USER}]
        assistant = [{"role": "assistant", "content": self._PROBE_ASSISTANT}]
        opened = self._render(user, generation_prompt=True)
        closed = self._render(user + assistant, generation_prompt=False)
        self._check_prefix(opened, closed, "an assistant turn")
        content = tokenizer(self._PROBE_ASSISTANT, add_special_tokens=False)["input_ids"]
        turn = closed[len(opened) :]
        if turn[: len(content)] != content:
            raise ValueError("The chat template does not render an assistant message as its own tokens.")
        self.close_ids = turn[len(content) :]  # what ends an assistant turn (e.g. <|im_end|> and a newline)
        self._closed_probe = closed
        self._probe = user + assistant
        self.env_turn_ids(self._PROBE_USER)  # fail now, not mid-rollout, if the template cannot continue

    def _render(self, messages, generation_prompt: bool) -> list[int]:
        rendered = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=True, **self.kwargs
        )
        return list(rendered["input_ids"])

    @staticmethod
    def _check_prefix(shorter, longer, what):
        if longer[: len(shorter)] != shorter:
            raise ValueError(
                f"The chat template is not incremental around {what}: multi-turn rollouts need a template whose "
                "rendering of a conversation extends the rendering of its first messages."
            )

    def prompt_ids(self, observation: str, system_prompt: str | None = None) -> list[int]:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return self._render(messages + [{"role": "user", "content": observation}], generation_prompt=True)

    def env_turn_ids(self, observation: str) -> list[int]:
        """Tokens that follow a closed assistant turn: the observation as a user message, then the next turn's
        opening."""
        full = self._render(self._probe + [{"role": "user", "content": observation}], generation_prompt=True)
        self._check_prefix(self._closed_probe, full, "a user turn")
        return full[len(self._closed_probe) :]

    def closing_ids(self, action_ids: Sequence[int]) -> list[int]:
        """Template tokens still needed to close a model turn (the model may have generated the first of them)."""
        close = self.close_ids
        if close and list(action_ids[-1:]) == close[:1]:
            return close[1:]
        return close


@dataclass
class Episode:
    task: dict
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    finished: bool = False
    truncated: bool = False
    error: str | None = None
    invalid_actions: int = 0
    step_seconds: list[float] = field(default_factory=list)
    observation: str = ""  # the first observation (the prompt's user message)
    # the prompt without guidance, when `prompt_ids` (what the episode is sampled on) holds retrieved experience
    plain_prompt_ids: list[int] | None = None
    logprobs: list[float | None] = field(default_factory=list)  # sampling log-prob per completion token, if known

    def extend(self, ids: Sequence[int], trained: bool, logprobs: Sequence[float | None] | None = None) -> None:
        self.completion_ids.extend(ids)
        self.env_mask.extend([1 if trained else 0] * len(ids))
        self.logprobs.extend(list(logprobs)[: len(ids)] if logprobs is not None else [None] * len(ids))
        self.logprobs.extend([None] * (len(self.completion_ids) - len(self.logprobs)))


def call_with_timeout(
    fn: Callable, timeout: float | None, on_late: Callable[[], None] | None = None
) -> tuple[Any, BaseException | None, float]:
    """Run `fn` in a daemon thread; (result, error, seconds). A call past `timeout` returns a TimeoutError and is
    abandoned (a daemon thread never blocks the interpreter's exit); `on_late` then runs in that thread once (if
    ever) `fn` returns, e.g. to close the environment it was using."""
    box: dict[str, Any] = {}
    lock = threading.Lock()

    def target():
        try:
            box["result"] = fn()
        except BaseException as error:  # noqa: BLE001 - any fault of the environment ends only its episode
            box["error"] = error
        with lock:
            box["returned"] = True
            late = box.get("abandoned", False)
        if late and on_late is not None:
            on_late()

    start = time.perf_counter()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    seconds = time.perf_counter() - start
    with lock:
        if not box.get("returned"):
            box["abandoned"] = True
            return None, TimeoutError(f"no answer within {timeout}s"), seconds
    return box.get("result"), box.get("error"), seconds


def run_concurrently(
    calls: Sequence[Callable], timeout: float | None, workers: int, on_late: Sequence[Callable] | None = None
) -> list[tuple]:
    """`call_with_timeout` for each call, at most `workers` at a time; results in order."""
    results: list[tuple | None] = [None] * len(calls)
    gate = threading.Semaphore(max(1, workers))

    def run(i):
        with gate:
            results[i] = call_with_timeout(calls[i], timeout, None if on_late is None else on_late[i])

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def observation_text(observation) -> str:
    """An environment's observation as the text it must be: a str that UTF-8 can encode. Anything else (None, bytes,
    a number, a lone surrogate) raises `TypeError` or `ValueError`: the environment's fault, never text to train on."""
    if not isinstance(observation, str):
        raise TypeError(f"an observation must be a str, got {type(observation).__name__}")
    observation.encode("utf-8")  # UnicodeEncodeError (a ValueError) on a lone surrogate
    return observation


class MultiTurnRollout:
    """Runs the episodes of one rank's fresh rows.

    Args:
        text_env_factory: builds a `TextEnv`; instances are pooled and reused, faulted ones (and any whose `alive` is
            False) are discarded. A faulted episode's `env_mask` is all 0: it trains nothing.
        tokenizer: the policy's tokenizer (chat template, eos).
        max_turns: model turns per episode at most.
        max_completion_length: tokens of a whole completion (model and environment turns) at most.
        max_tokens_per_turn: tokens of one model turn at most.
        step_timeout: seconds an environment `reset` or `step` may take.
        workers: environment calls running at once.
        system_prompt_column: dataset column holding an optional system prompt.
        max_prompt_tokens: tokens a first observation may have (the model's context; None: no bound). A longer one
            is the environment's fault (`reset_error`), found without tokenizing all of it.
        special_tokens: what an observation's spellings of the tokenizer's special or added tokens become before it is
            tokenized (the environment's text is untrusted: `<eos>` or a role marker in it would forge a chat turn):
            'remove' them (counted in `special_tokens_removed`), 'refuse' the episode (a `reset_error` or
            `step_error`), or 'keep' them (a trusted environment that needs them).
    """

    def __init__(
        self,
        text_env_factory: Callable[[], Any],
        tokenizer,
        *,
        max_turns: int,
        max_completion_length: int,
        max_tokens_per_turn: int | None = None,
        step_timeout: float | None = 60.0,
        workers: int = 16,
        system_prompt_column: str = "system_prompt",
        chat_template_kwargs: dict | None = None,
        max_prompt_tokens: int | None = None,
        special_tokens: str = "remove",
    ):
        self.text_env_factory = text_env_factory
        self.observation_filter = SpecialTokenFilter(tokenizer, special_tokens)
        self.max_prompt_tokens = max_prompt_tokens
        self.tokenizer = tokenizer
        self.turns = ChatTurns(tokenizer, chat_template_kwargs)
        self.max_turns = max_turns
        self.max_completion_length = max_completion_length
        self.max_tokens_per_turn = max_tokens_per_turn or max_completion_length
        self.step_timeout = step_timeout
        self.workers = workers
        self.system_prompt_column = system_prompt_column
        self.errors: Counter = Counter()
        self._idle_envs: list = []
        self._warned: set[str] = set()

    # ------------------------------------------------------------------------------------------------ envs
    def _take_env(self):
        """An idle instance, or a new one; a factory that fails gives None (the episode then fails)."""
        while self._idle_envs:
            env = self._idle_envs.pop()
            if getattr(env, "alive", True):
                return env, None
            _close_quietly(env)  # e.g. a RemoteEnv whose worker process was replaced meanwhile
        try:
            return self.text_env_factory(), None
        except Exception as error:  # noqa: BLE001 - a broken factory fails its episode, not the run
            return None, error

    def _fault(self, episode: Episode, env, kind: str, error: BaseException) -> None:
        # A fault voids what the episode earned but keeps its penalties: it must never score above an honest loss.
        episode.error, episode.finished, episode.reward = kind, True, min(episode.reward, 0.0)
        self.errors[kind] += 1
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("trl_exreplay: environment %s (%r); episode failed, counted in env/errors.", kind, error)
        if env is not None and kind != "timeout":  # a timed-out env is closed by its own thread, once it returns
            threading.Thread(target=_close_quietly, args=(env,), daemon=True).start()  # never reused

    # ------------------------------------------------------------------------------------------------- run
    def run(
        self,
        tasks: Sequence[dict],
        generate: Callable[[list[list[int]], int], list[list[int]]],
        sync: Callable[[bool], bool] | None = None,
        guide: Callable[[int, str, Callable[[str], list[int]]], list[int] | None] | None = None,
    ) -> list[Episode]:
        """Play one episode per task. `generate(contexts, max_new_tokens)` returns each context's new tokens, or a
        pair (new tokens, their sampling log-probs) that then lands in `Episode.logprobs` (None on tokens the model did
        not generate). `sync(has_active_episodes)` returns whether any rank still has one (collective; None for one
        process). `guide(index, first_observation, render)` returns the prompt episode `index` is sampled on with
        experience: `render(text)` (its prompt with `text` before the first observation) for the text it puts there
        (None: unguided); `plain_prompt_ids` then keeps the prompt without it."""
        episodes = [Episode(task=dict(task)) for task in tasks]
        taken = [self._take_env() for _ in episodes]
        envs = [env for env, _ in taken]
        resets = run_concurrently(
            [(lambda env=env, task=task: env.reset(task)) for env, task in zip(envs, tasks) if env is not None],
            self.step_timeout,
            self.workers,
            [(lambda env=env: _close_quietly(env)) for env in envs if env is not None],
        )
        resets = iter(resets)
        for index, (episode, (env, factory_error)) in enumerate(zip(episodes, taken)):
            system = episode.task.get(self.system_prompt_column)
            observation, error, _ = (None, factory_error, 0.0) if env is None else next(resets)
            if error is None:
                try:
                    observation = self._first_observation(observation)
                except (TypeError, ValueError) as bad:  # a malformed first observation fails its episode only
                    error = bad
            if error is not None:
                kind = "factory_error" if env is None else _fault_kind(error, "reset_error")
                self._fault(episode, env, kind, error)
                observation = ""
            episode.observation = observation
            episode.prompt_ids = self.turns.prompt_ids(episode.observation, system)
            guided = None
            if guide is not None and error is None:
                render = functools.partial(self._guided_prompt_ids, episode.observation, system)
                guided = guide(index, episode.observation, render)
            if guided:
                episode.plain_prompt_ids, episode.prompt_ids = episode.prompt_ids, guided

        for turn in range(self.max_turns):
            active = [i for i, e in enumerate(episodes) if not e.finished]
            if not (sync(bool(active)) if sync is not None else active):
                break
            if not active:  # another rank still plays: keep this rank's generate calls in step with it
                generate([[self.tokenizer.eos_token_id]], 1)
                continue
            budgets = {i: self.max_completion_length - len(episodes[i].completion_ids) for i in active}
            new_tokens = min(self.max_tokens_per_turn, max(budgets.values()))
            outputs = generate([episodes[i].prompt_ids + episodes[i].completion_ids for i in active], new_tokens)
            outputs, sampled_logps = outputs if isinstance(outputs, tuple) else (outputs, [None] * len(active))
            actions = {}
            for i, action_ids, logps in zip(active, outputs, sampled_logps):
                episode = episodes[i]
                actions[i] = list(action_ids)[: budgets[i]]
                episode.extend(actions[i], trained=True, logprobs=logps)
                episode.turns += 1
                if len(action_ids) > budgets[i]:  # cut by the completion budget: not a whole action, not played
                    episode.finished = episode.truncated = True
                    del actions[i]
            stepping = list(actions)
            texts = [self.tokenizer.decode(actions[i], skip_special_tokens=True) for i in stepping]
            results = run_concurrently(
                [(lambda env=envs[i], text=text: env.step(text)) for i, text in zip(stepping, texts)],
                self.step_timeout,
                self.workers,
                [(lambda env=envs[i]: _close_quietly(env)) for i in stepping],
            )
            for i, (result, error, seconds) in zip(stepping, results):
                episode = episodes[i]
                episode.step_seconds.append(seconds)
                if error is None:
                    try:  # everything that depends on what the environment returned
                        observation, reward, done, info = result
                        reward, done, info = float(reward), bool(done), {} if info is None else info
                        if not math.isfinite(reward):
                            raise NonFiniteReward(f"step() returned the reward {reward}")
                        if not isinstance(info, dict):
                            raise TypeError(f"step() info must be a dict, got {type(info).__name__}")
                        invalid = bool(info.get("invalid_action", False))
                        last = done or turn == self.max_turns - 1
                        env_ids = [] if last else self._env_turn_ids(observation, episode)
                    except Exception as bad:  # noqa: BLE001 - a malformed answer fails its episode only
                        error = bad
                if error is not None:
                    self._fault(episode, envs[i], _fault_kind(error, "step_error"), error)
                    continue
                episode.reward += reward
                episode.invalid_actions += int(invalid)
                if last:
                    episode.finished = True
                    continue
                env_ids = self.turns.closing_ids(actions[i]) + env_ids
                room = self.max_completion_length - len(episode.completion_ids)
                if len(env_ids) >= room:  # no room left for another model turn
                    episode.extend(env_ids[:room], trained=False)
                    episode.finished = episode.truncated = True
                    continue
                episode.extend(env_ids, trained=False)

        eos = self.tokenizer.eos_token_id
        terminators = {eos, self.tokenizer.pad_token_id}
        for episode, env in zip(episodes, envs):
            episode.finished = True
            # TRL calls a completion truncated when it does not end on eos or pad: end every completed episode on
            # an (untrained) eos, and no truncated one on either.
            while episode.truncated and len(episode.completion_ids) > 1 and episode.completion_ids[-1] in terminators:
                episode.completion_ids.pop()
                episode.env_mask.pop()
                episode.logprobs.pop()
            ends_on_eos = bool(episode.completion_ids) and episode.completion_ids[-1] == eos
            if not episode.truncated and not ends_on_eos:
                if len(episode.completion_ids) < self.max_completion_length or not episode.completion_ids:
                    episode.extend([eos], trained=False)
            if episode.error is None:
                self._idle_envs.append(env)
            else:  # the environment failed, not the model: none of its tokens are trained
                episode.env_mask = [0] * len(episode.env_mask)
                episode.logprobs = [None] * len(episode.logprobs)
        return episodes

    @property
    def special_tokens_removed(self) -> int:
        """Spellings of special or added tokens removed from observations so far (a running total)."""
        return self.observation_filter.removed

    def _first_observation(self, observation) -> str:
        text = self.observation_filter(observation_text(observation))
        budget = self.max_prompt_tokens
        if budget is not None and token_prefix(text, self.tokenizer, budget)[1]:
            raise ValueError(
                f"the first observation has more than {budget} tokens, the model's context (its config's "
                "max_position_embeddings, or vllm_max_model_length)"
            )
        return text

    def _guided_prompt_ids(self, observation: str, system: str | None, text: str) -> list[int]:
        """The first prompt with `text` (retrieved experience) before the first observation, where experience-guided
        rollouts put it in a single-turn prompt's first user message (`guidance.template.insert_experience`)."""
        return self.turns.prompt_ids(text + observation, system)

    def _env_turn_ids(self, observation, episode: Episode) -> list[int]:
        """An environment turn's tokens, its observation tokenized only as far as the episode's budget can keep (and
        a margin, so the kept tokens are those of the whole text): a huge observation costs what is kept (and one scan
        for spelled special tokens, which tokenizes nothing)."""
        text = self.observation_filter(observation_text(observation))
        keep = self.max_completion_length - len(episode.completion_ids) + _CUT_MARGIN_TOKENS
        if len(text) > keep * _CUT_CHARS_PER_TOKEN:  # only a long one: a usual observation is tokenized once
            text, _ = token_prefix(text, self.tokenizer, keep)
        return self.turns.env_turn_ids(text)

    def close(self) -> None:
        """Close the idle environments (the trainer calls this at the end of training)."""
        for env in self._idle_envs:
            _close_quietly(env)
        self._idle_envs.clear()


def generate_batch(
    model,
    contexts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    pad_token_id: int,
    eos_token_ids,
    **generate_kwargs,
) -> list[list[int]]:
    """One left-padded `model.generate` over `contexts`; each row's new tokens up to and including its first eos (a
    row without one keeps everything). `generate_kwargs` go to `generate` (e.g. `generation_config`, `do_sample`)."""
    import torch

    from ..trl_seam import pad

    if not contexts:
        return []
    device = next(model.parameters()).device
    tensors = [torch.tensor(list(c)) for c in contexts]
    input_ids = pad(tensors, padding_value=pad_token_id, padding_side="left").to(device)
    attention_mask = pad([torch.ones_like(t) for t in tensors], padding_value=0, padding_side="left").to(device)
    generate_kwargs = {"pad_token_id": pad_token_id, **generate_kwargs}
    generated = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, **generate_kwargs
    )[:, input_ids.size(1) :]
    is_eos = torch.isin(generated, torch.tensor(sorted(eos_token_ids), device=generated.device))
    lengths = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, generated.size(1)).tolist()
    return [row[:n] for row, n in zip(generated.tolist(), lengths)]


class NonFiniteReward(ValueError):
    """An environment returned a NaN or infinite reward: its episode is a fault (counted, trains nothing, never
    stored as a success), not a number that would reach the advantages."""


def _fault_kind(error: BaseException, default: str) -> str:
    if isinstance(error, NonFiniteReward):
        return "nonfinite_reward"
    return "timeout" if isinstance(error, TimeoutError) else default


def _close_quietly(env) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001 - closing a faulted environment must not raise
        pass
