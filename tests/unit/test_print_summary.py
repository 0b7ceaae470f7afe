"""`print_summary`, the recipe's closing table: what was trained on what, one row per evaluation, what each row
measures, and what the pool did (an empty pool at the end is explained, not left to look like a fault)."""

from __future__ import annotations

import pytest

from trl_exreplay.envs.evaluation import print_summary

OWN = "train: 8 RL games (sampled T=0.5 x8)"


def summary(pool_tasks_over_run, pool_at_end, *, rl=8, notes=()):
    return {
        "base_model": "tiny (built locally)",
        "games": {
            "train": 200,
            "warm_start": True,
            "rl": rl,
            "rl_steps": 16,
            "rl_task_ids": None,
            "train_evaluation": OWN,
            "held_out": ["valid_seen", "valid_unseen"],
        },
        "results": {
            OWN: {"before": 19 / 64, "after": 36 / 64},
            "valid_seen": {"before": 0.35, "after": 0.325},
            "valid_unseen": {"before": 0.15, "after": 0.0},
        },
        "intervals": {
            OWN: {"before": [0.198, 0.42], "after": [0.44, 0.68], "episodes": 64},
            "valid_seen": {"before": [0.221, 0.505], "after": [0.2, 0.48], "episodes": 40},
            "valid_unseen": {"before": [0.07, 0.29], "after": [0.0, 0.088], "episodes": 40},
        },
        "replay": {
            "rows_fraction_mean": 0.115,
            "rows_fraction_max": 0.125,
            "steps": [4, 8, 12, 16],
            "pool_tasks": list(pool_tasks_over_run),
            "pool_trajectories": [3 * t for t in pool_tasks_over_run],
        },
        "pool": {"pool_tasks": float(pool_at_end), "pool_trajectories": 3.0 * pool_at_end, "skip_set": 25.0},
        "minutes": 5.1,
        "output_dir": "outputs/alfworld_tiny",
        "notes": list(notes),
    }


def printed(capsys, **kwargs) -> str:
    print_summary(summary(**kwargs))
    return " ".join(capsys.readouterr().out.split())  # wrapped lines joined


def test_rows_in_order_with_intervals_and_what_each_measures(capsys):
    text = printed(capsys, pool_tasks_over_run=[4, 3, 5, 2], pool_at_end=2)
    assert (
        "tiny (built locally): warm start on 200 train games, then RL (16 steps) on 8 of the 200 train games" in text
    )
    row = text.index(f"{OWN} 29.7% [20-42] 56.2% [44-68] +26.6pt 64")
    assert row < text.index("valid_seen 35.0% [22-50] 32.5% [20-48] -2.5pt 40")
    assert text.index("valid_seen 35.0%") < text.index("valid_unseen 15.0% [7-29] 0.0% [0-9] -15.0pt 40")
    assert "train: the games RL trains on, sampled as RL plays them" in text and "not held-out" in text
    assert "valid_seen, valid_unseen: held-out games RL never plays, greedy" in text
    assert "pool over the run (tasks/trajectories): step 4: 4/12, step 8: 3/9, step 12: 5/15, step 16: 2/6" in text


def test_an_empty_pool_at_the_end_is_explained_only_when_it_held_tasks(capsys):
    emptied = printed(capsys, pool_tasks_over_run=[4, 3, 5, 0], pool_at_end=0)
    assert "pool at the end: 0 tasks, 0 trajectories; skip set 25 (tasks whose fresh rollouts all won" in emptied
    assert "every task this pool held left it that way" in emptied
    kept = printed(capsys, pool_tasks_over_run=[4, 3, 5, 2], pool_at_end=2)
    assert "pool at the end: 2 tasks, 6 trajectories; skip set 25" in kept and "left it that way" not in kept
    never = printed(capsys, pool_tasks_over_run=[0, 0, 0, 0], pool_at_end=0)
    assert "left it that way" not in never  # nothing to explain: the pool never held a task


@pytest.mark.parametrize("rl, played", [(8, "on 8 of the 200 train games"), (200, "on the 200 train games")])
def test_the_header_names_the_games_rl_played(capsys, rl, played):
    assert played in printed(capsys, pool_tasks_over_run=[1, 1, 1, 1], pool_at_end=1, rl=rl)


def test_notes_print_whole_and_paths_stay_unbroken(capsys):
    note = (
        "For held-out games, train a pretrained model: --config recipes/configs/alfworld_qwen2.5-1.5b.yaml, on a GPU."
    )
    print_summary(summary([1, 1, 1, 1], 1, notes=[note]))
    out = capsys.readouterr().out
    assert "recipes/configs/alfworld_qwen2.5-1.5b.yaml" in out  # not split at a hyphen by the wrapping
    assert note in " ".join(out.split())
    assert max(len(line) for line in out.splitlines()) <= len(out.splitlines()[1])  # no line past the rule
