"""Launched by tests/integration/test_guidance.py and killed: trains with experience-guided rollouts whose provider's summarise
never returns in time (the background job stays in flight), saving a checkpoint every step.

Usage: python tests/scripts/guided_kill.py OUT_DIR
The provider writes OUT_DIR/in_flight.json (the sources of the job it received) before it blocks.
"""

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import make_trainer  # noqa: E402

from trl_exreplay.guidance.offline import OfflineExperienceProvider  # noqa: E402

out_dir = Path(sys.argv[1])


class BlockingProvider(OfflineExperienceProvider):
    def summarize(self, inputs):
        (out_dir / "in_flight.json").write_text(json.dumps([x.source for x in inputs]))
        time.sleep(3600)  # killed meanwhile


trainer = make_trainer(
    out_dir,
    max_steps=50,
    save_strategy="steps",
    save_steps=1,
    guidance_update_freq=1,
    guidance_train="mixed",
    guidance_ratio=0.5,
    trainer_kwargs={"experience_provider": BlockingProvider()},
)
trainer.train()
