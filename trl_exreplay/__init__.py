"""trl-exreplay: experience replay (ExGRPO / AgentEvolver) for TRL's GRPOTrainer."""

from .config import ExReplayGRPOConfig
from .loss import compute_exreplay_loss
from .pool import ExperiencePool, TaskOutcome, Trajectory
from .trainer import ExReplayGRPOTrainer

__version__ = "0.1.0.dev0"

__all__ = [
    "ExReplayGRPOConfig",
    "ExReplayGRPOTrainer",
    "ExperiencePool",
    "TaskOutcome",
    "Trajectory",
    "compute_exreplay_loss",
]
