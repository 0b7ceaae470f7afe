"""TRL's figures over the fresh rollouts (issue 70) under DDP (2 processes, gloo): the same on both ranks, gathered as
TRL gathers them, in a single-turn run with the library's defaults (rescue and retirement from step 1, replay from step
4) and in a multi-turn run where one rank's rows are all replayed once replay starts."""

from __future__ import annotations

import json

import pytest
from helpers import REPOSITORY
from launching import accelerate_launch

SCRIPT = REPOSITORY / "tests" / "scripts" / "replay_multiprocess.py"


@pytest.mark.slow
def test_trls_figures_are_the_fresh_rollouts_and_rank_identical_under_ddp(tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    accelerate_launch("recipes/accelerate/ddp_cpu.yaml", SCRIPT, single, "teach", "then", multi, "multi-turn",
                      timeout=540)  # fmt: skip
    for out, steps in ((single, 12), (multi, 10)):
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        assert ranks[0]["world_size"] == 2
        figures = ranks[0]["trl_figures"]
        assert len(figures) == steps and figures == ranks[1]["trl_figures"], out.name
        replaced = 0
        for entry in figures:
            assert entry["replay/trained_reward"] is not None and entry["replay/zero_std_trained"] is not None
            if out is single:  # single-turn: the pool's fresh rows are TRL's (multi-turn leaves faulted episodes out)
                assert entry["reward"] == entry["replay/fresh_reward"]
            replaced += entry["reward"] != entry["replay/trained_reward"]
        assert replaced >= 1, figures  # rescued or replayed rows changed the batch as trained
