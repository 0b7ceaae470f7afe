"""Experience-guided rollouts (AgentEvolver's "Self-Navigating", arXiv 2511.10395; code:
github.com/modelscope/AgentEvolver, `agentevolver/module/exp_manager/`, described in its
`docs/guidelines/exp_manager.md`): summaries of past successes, retrieved for a task and inserted into the first user
message of some fresh rollouts; the training sample keeps that context or has it stripped (then it is trained
off-policy, through the replayed tokens' `exp_mask` path, as AgentEvolver's `het_compute_token_on_off_policy_loss` in
`het_core_algos.py` trains the `exp_mask` tokens of its discarded rows).

One module, one job: `allocation` (which rows are guided, which tasks keep the guidance: pure functions), `template`
(insert and strip, token-exact), `provider` (the provider interface and the record type), `store` (the offline store:
BM25 retrieval, Arrow persistence), `offline` and `reme` (the two providers), `summarizer` (the background thread).
"""

from .offline import OfflineExperienceProvider
from .provider import ExperienceProvider, ExperienceRecord, PartialSummaryError, SummaryInput
from .reme import ReMeError, ReMeExperienceProvider
from .settings import GuidanceSettings
from .store import ExperienceFormatError, ExperienceStore, load_experience, save_experience

__all__ = [
    "ExperienceFormatError",
    "ExperienceProvider",
    "ExperienceRecord",
    "ExperienceStore",
    "GuidanceSettings",
    "OfflineExperienceProvider",
    "PartialSummaryError",
    "ReMeError",
    "ReMeExperienceProvider",
    "SummaryInput",
    "load_experience",
    "save_experience",
]
