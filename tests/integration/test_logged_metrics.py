"""What a run logs under `replay/`, `env/` and `guide/` is on docs/metrics.md: a multi-turn run with replay, retired
questions and experience-guided rollouts (every family at once)."""

from __future__ import annotations

from metrics_page import FAMILIES, documented_metrics, page_name
from test_multiturn import make_multi_turn_trainer

from trl_exreplay import ExReplayGRPOTrainer
from trl_exreplay.guidance.offline import OfflineExperienceProvider


def test_every_metric_a_run_logs_is_on_the_metrics_page(tmp_path):
    trainer = make_multi_turn_trainer(
        tmp_path, trainer_cls=ExReplayGRPOTrainer, trainer_kwargs={"experience_provider": OfflineExperienceProvider()},
        max_steps=8, replay_start_ratio=0.25, replay_retire_solved=True, guidance_train="mixed", guidance_ratio=0.5,
        guidance_update_freq=1,
    )  # fmt: skip
    trainer.train()
    logged = {key for entry in trainer.state.log_history for key in entry if key.split("/")[0] in FAMILIES}
    assert {page_name(key) for key in logged} - documented_metrics() == set()
    for family in FAMILIES:  # the run did log each family
        assert any(key.startswith(f"{family}/") for key in logged), family
    assert {"replay/rows_fraction", "replay/off_policy_loss", "env/success_rate", "guide/guided_fraction"} <= logged
