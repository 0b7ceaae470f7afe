"""Calls from `trainer.py` into our other modules per training generation batch (single-turn, 4 steps of the tests' say-the-word task): the defaults, and with guided rollouts. Run: `OMP_NUM_THREADS=1 python tools/generation_walk.py`."""

import collections
import os
import sys
import tempfile

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests"))
from helpers import make_trainer  # noqa
from trl_exreplay.trainer import ExReplayGRPOTrainer

GUIDED = dict(guidance_train="mixed", guidance_ratio=0.5, guidance_trained_prompt="hybrid", guidance_keep_ratio=0.5)
PKG = os.path.dirname(sys.modules["trl_exreplay"].__file__)
TRAINER = os.path.join(PKG, "trainer.py")


def walk(kwargs):
    counts, batches = collections.Counter(), [0]

    class Walking(ExReplayGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            if not self.model.training:
                return super()._generate_and_score_completions(inputs)
            batches[0] += 1

            def profile(frame, event, arg):
                if event != "call":
                    return
                callee, caller = frame.f_code.co_filename, frame.f_back.f_code.co_filename if frame.f_back else ""
                if caller == TRAINER and callee.startswith(PKG) and callee != TRAINER:
                    counts[os.path.relpath(callee, PKG)] += 1

            sys.setprofile(profile)
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                sys.setprofile(None)

    with tempfile.TemporaryDirectory() as tmp:
        trainer = make_trainer(__import__("pathlib").Path(tmp), trainer_cls=Walking, max_steps=4, **kwargs)
        trainer.train()
    return {k: round(v / batches[0], 1) for k, v in sorted(counts.items())}, batches[0]


print("defaults:", walk({}))
print("guided:", walk(GUIDED))
