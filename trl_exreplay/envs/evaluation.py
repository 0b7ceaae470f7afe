"""Success rate of a policy on multi-turn tasks: greedy episodes through the same `MultiTurnRollout` the trainer uses,
so the evaluated prompts, turn layout and limits are exactly those of training.

```python
from trl_exreplay.envs.evaluation import evaluate_policy
from trl_exreplay.alfworld import AlfWorldEnv, alfworld_tasks

result = evaluate_policy(model, tokenizer, alfworld_tasks("data/alfworld/json_2.1.1/valid_seen"), AlfWorldEnv,
                         max_turns=30, max_completion_length=2048, max_tokens_per_turn=24)
print(result.success_rate, result.per_group)  # overall, and {task_type: [successes, episodes]}
```
"""

from __future__ import annotations

import functools
import math
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .base import renamed_env_factory
from .rollout import Episode, MultiTurnRollout, generate_batch


@dataclass
class PolicyEvaluation:
    """Outcome of `evaluate_policy`: one episode per task, in task order."""

    episodes: list[Episode]
    success_threshold: float = 1.0
    group_column: str | None = "task_type"
    per_group: dict[str, list[int]] = field(default_factory=dict, init=False)  # group -> [successes, episodes]

    def __post_init__(self):
        for episode in self.episodes:
            group = str(episode.task.get(self.group_column, "all")) if self.group_column else "all"
            tally = self.per_group.setdefault(group, [0, 0])
            tally[0] += int(self.succeeded(episode))
            tally[1] += 1

    def succeeded(self, episode: Episode) -> bool:
        return episode.error is None and episode.reward >= self.success_threshold

    @property
    def successes(self) -> int:
        return sum(self.succeeded(e) for e in self.episodes)

    @property
    def success_rate(self) -> float:
        return self.successes / len(self.episodes) if self.episodes else 0.0

    @property
    def interval(self) -> tuple[float, float]:
        """95% binomial (Wilson) interval of `success_rate`."""
        return binomial_interval(self.successes, len(self.episodes))

    @property
    def errors(self) -> int:
        """Episodes the environment failed (counted as failures, never dropped)."""
        return sum(e.error is not None for e in self.episodes)

    @property
    def mean_turns(self) -> float:
        return sum(e.turns for e in self.episodes) / len(self.episodes) if self.episodes else 0.0


def binomial_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a success rate: `binomial_interval(14, 40)` is about (0.221, 0.505), i.e. 35% of 40
    games is known to about +-15 points. Unlike the normal approximation it stays in [0, 1] and is not empty at 0 or
    `trials` successes. No trials: (0, 1)."""
    from statistics import NormalDist

    if not 0 <= successes <= trials:
        raise ValueError(
            f"Invalid value {successes!r} for `successes`: allowed values are integers 0 .. trials ({trials})."
        )
    if trials == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == trials else min(1.0, centre + half)
    return low, high


def evaluate_policy(
    model,
    tokenizer,
    tasks: Iterable[dict[str, Any]],
    text_env_factory: Callable[[], Any] | None = None,
    *,
    max_turns: int,
    max_completion_length: int,
    max_tokens_per_turn: int | None = None,
    batch_size: int = 64,
    success_threshold: float = 1.0,
    group_column: str | None = "task_type",
    step_timeout: float | None = 60.0,
    workers: int = 16,
    system_prompt_column: str = "system_prompt",
    chat_template_kwargs: dict | None = None,
    progress: bool = False,
    desc: str = "evaluating",
    **generate_kwargs,
) -> PolicyEvaluation:
    """Play one episode per task (greedy unless `generate_kwargs` say otherwise), `batch_size` episodes at a time.

    An episode succeeds when its total reward reaches `success_threshold`; an environment fault counts as a failure
    (and in `errors`). The model is put in eval mode and gradients are off; its training mode is restored after.
    """
    import torch

    text_env_factory = renamed_env_factory(
        text_env_factory, generate_kwargs.pop("env_factory", None), "evaluate_policy"
    )
    rows = [dict(task) for task in tasks]
    rollout = MultiTurnRollout(
        text_env_factory,
        tokenizer,
        max_turns=max_turns,
        max_completion_length=max_completion_length,
        max_tokens_per_turn=max_tokens_per_turn,
        step_timeout=step_timeout,
        workers=workers,
        system_prompt_column=system_prompt_column,
        chat_template_kwargs=chat_template_kwargs,
    )
    eos = model.generation_config.eos_token_id
    eos_token_ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos] if eos is not None else [])}
    generate_kwargs = {"do_sample": False, **generate_kwargs}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(rows), desc=desc, unit="episode")

    def generate(contexts, max_new_tokens):
        return generate_batch(
            model,
            contexts,
            max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_ids=eos_token_ids,
            eos_token_id=sorted(eos_token_ids),
            **generate_kwargs,
        )

    was_training = model.training
    model.eval()
    episodes: list[Episode] = []
    try:
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                chunk = rows[start : start + batch_size]
                episodes += rollout.run(chunk, generate)
                if bar is not None:
                    bar.update(len(chunk))
    finally:
        rollout.close()
        model.train(was_training)
        if bar is not None:
            bar.close()
    return PolicyEvaluation(episodes, success_threshold=success_threshold, group_column=group_column)


def replay_participation(log_history: list[dict], points: int = 4) -> dict:
    """How much replay took part over a run, from the trainer's logs: the replayed-row fraction (mean over the logged
    steps from replay's start, and max) and the pool's size at `points` evenly spaced logged steps (the last
    included)."""
    logged = [entry for entry in log_history if "replay/rows_fraction" in entry]
    if not logged:
        return {}
    fractions = [entry["replay/rows_fraction"] for entry in logged]
    started = next((i for i, f in enumerate(fractions) if f > 0), len(fractions))
    at = sorted({max(0, round(len(logged) * (i + 1) / points) - 1) for i in range(points)})
    return {
        "rows_fraction_mean": sum(fractions[started:]) / max(1, len(fractions) - started),
        "rows_fraction_max": max(fractions),
        "steps": [logged[i].get("step") for i in at],
        "pool_tasks": [logged[i].get("replay/pool_tasks", 0.0) for i in at],
        "pool_trajectories": [logged[i].get("replay/pool_trajectories", 0.0) for i in at],
    }


def print_summary(summary: dict) -> None:
    """The results table of a run's summary, as `recipes/alfworld.py` prints it: what was trained on what, success
    before and after RL with 95% intervals (the games RL plays first, then the held-out splits), what each row
    measures, replay's share, the pool over the run and at its end, the summary's notes."""
    games, results = summary["games"], summary["results"]
    width = max([16, *(len(name) + 2 for name in results)])
    rule = "=" * max(76, width + 60)
    # Paths and option names stay whole (`alfworld_qwen2.5-1.5b.yaml` has hyphens): a reader copies them.
    wrap = functools.partial(textwrap.fill, width=len(rule), subsequent_indent="  ", break_on_hyphens=False)
    print("\n" + rule)
    train, rl = games["train"], games["rl"]
    played = f"{rl} of the {train} train games" if rl < train else f"the {train} train games"
    warm = f"warm start on {train} train games, then " if games["warm_start"] else ""
    print(wrap(f"ALFWorld, model: {summary['base_model']}: {warm}RL ({games['rl_steps']} steps) on {played}"))
    print(f"{'success rate':<{width}}{'before RL [95% CI]':>22}{'after RL [95% CI]':>22}{'change':>10}{'n':>6}")
    for name, r in results.items():
        ci = summary["intervals"][name]
        cells = [f"{100 * r[w]:.1f}% [{100 * ci[w][0]:.0f}-{100 * ci[w][1]:.0f}]" for w in ("before", "after")]
        change = 100 * (r["after"] - r["before"])
        print(f"{name:<{width}}{cells[0]:>22}{cells[1]:>22}{change:>+8.1f}pt{ci['episodes']:>6}")
    # What each row measures: a reader must not take the RL games' rise for held-out success, nor the reverse.
    own, held_out = games["train_evaluation"], games["held_out"]
    if own in results:
        print(
            wrap(
                f"{own.split(':')[0]}: the games RL trains on, sampled as RL plays them (the same draws before "
                "and after RL); not held-out."
            )
        )
    if held_out:
        print(wrap(f"{', '.join(held_out)}: held-out games RL never plays, greedy (one episode a game)."))
    if results:
        print(
            wrap(
                "n: the episodes behind a rate; [95% CI]: its Wilson interval (a change within the intervals "
                "may be chance)."
            )
        )
    replay = summary.get("replay")
    if replay:
        print(
            f"replayed rows: {100 * replay['rows_fraction_mean']:.1f}% of each step's rows from replay's start "
            f"(max {100 * replay['rows_fraction_max']:.1f}%)"
        )
        sizes = ", ".join(
            f"step {s}: {t:.0f}/{n:.0f}"
            for s, t, n in zip(replay["steps"], replay["pool_tasks"], replay["pool_trajectories"])
        )
        print(wrap(f"pool over the run (tasks/trajectories): {sizes}"))
    pool = summary["pool"]
    if pool:
        tasks, skipped = pool.get("pool_tasks", 0), pool.get("skip_set", 0)
        line = (
            f"pool at the end: {tasks:.0f} tasks, {pool.get('pool_trajectories', 0):.0f} trajectories; skip set "
            f"{skipped:.0f} (tasks whose fresh rollouts all won at their last play: they leave the pool and are "
            "not replayed"
        )
        # During training the only way out of the pool is the skip set (`ExperiencePool.record_outcome`; bad rows
        # are removed at setup, before the logged steps): an empty pool that held tasks lost each of them that way.
        emptied = not tasks and replay and max(replay.get("pool_tasks", [0])) > 0
        print(wrap(line + ("; every task this pool held left it that way)" if emptied else ")")))
    for note in summary.get("notes", []):
        print(wrap(note))
    print(f"total time: {summary['minutes']:.1f} min; saved to {summary['output_dir']}")
    print(rule)
