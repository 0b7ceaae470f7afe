"""`GuidanceSettings`: the settings of experience-guided rollouts, given to the trainer with the part
(`ExReplayGRPOTrainer(..., guidance=GuidanceSettings(...), experience_provider=...)`), not fields of the config."""

from __future__ import annotations

from dataclasses import dataclass

from ..parameters import check as _check
from ..parameters import document_fields
from ..parameters import is_int as _is_int
from ..parameters import is_number as _is_number
from ..parameters import names as _names
from .allocation import ROLLOUT_MODES, SAMPLE_MODES

DEFAULT_TEMPLATE = "\n\nSome Related Experience to help you to complete the task:<EXP>{}</EXP>\n\n"


@dataclass(frozen=True)
class GuidanceSettings:
    r"""
    Experience-guided rollouts (AgentEvolver's Self-Navigating, arXiv 2511.10395; modelscope/AgentEvolver,
    docs/guidelines/exp_manager.md): off unless a rollout mode guides. The provider (where experience is summarised
    and retrieved) is the trainer's `experience_provider`: an `OfflineExperienceProvider` when none is given, or a
    `ReMeExperienceProvider(base_url, workspace_id=..., timeout=...)` for a ReMe service.

    `DEFAULT_TEMPLATE`, the default `guidance_template`, is
    `'\n\nSome Related Experience to help you to complete the task:<EXP>{}</EXP>\n\n'`.

    Parameters:
        > Experience-guided rollouts (AgentEvolver's Self-Navigating; off by default)

        guidance_train (`str`, *optional*, defaults to `'off'`):
            Experience in training rollouts: 'off' (none: the feature is off), 'mixed' (round(num_generations *
            guidance_ratio) of each task's rollouts get retrieved experience in their first user message) or 'all'
            (every fresh rollout). Replayed rows are never guided.
        guidance_eval (`str`, *optional*, defaults to `'off'`):
            Experience in evaluation rollouts: 'off', 'mixed' or 'all', as guidance_train.
        guidance_ratio (`float`, *optional*, defaults to `0.0`):
            Read under a 'mixed' mode only (set otherwise, an error): fraction of a task's rollouts guided,
            round(num_generations * guidance_ratio) of them. In [0, 1]; it must guide at least one rollout.
        guidance_trained_prompt (`str`, *optional*, defaults to `'plain'`):
            What a guided rollout trains on: 'guided' (its guided prompt, on-policy), 'plain' (the prompt without the
            experience, token-exact; its tokens are trained off-policy against the log-probs recorded under guidance,
            as replayed tokens are) or 'hybrid' (int(tasks * guidance_keep_ratio) of a batch's tasks keep, the others
            discard).
        guidance_keep_ratio (`float`, *optional*, defaults to `1.0`):
            Read under guidance_trained_prompt='hybrid' only (set otherwise, an error): fraction of a batch's tasks
            that keep their guidance. In [0, 1].
        guidance_template (`str`, *optional*, defaults to `DEFAULT_TEMPLATE`):
            Text put before the first user message of a guided rollout; its one `{}` receives the retrieved experience
            (records joined by newlines). Must contain `{}` exactly once.
        guidance_top_k (`int`, *optional*, defaults to `3`):
            Experience records retrieved per guided rollout at most. >= 1.
        guidance_max_tokens (`int`, *optional*, defaults to `512`):
            Tokens of retrieved experience put in one prompt at most (the records joined, before the template); the
            rest is cut (counted in guide/experience_truncated). It is cut further where the guided prompt would leave
            less than max_completion_length tokens of the model's context (guide/experience_cut_to_context; a row with
            no room for any is left unguided, guide/unguided_for_context). Retrieved text is untrusted: any spelling of
            a special or added token in it is removed (counted in guide/special_tokens_removed). >= 1.
        guidance_update_freq (`int`, *optional*, defaults to `0`):
            Every this many optimizer steps, the successful fresh rollouts gathered since the last update are
            summarised into experience in a background thread (never blocking a step). 0: never (the store holds what
            guidance_init_from_pool or a resumed checkpoint gave it). >= 0.
        guidance_init_from_pool (`bool`, *optional*, defaults to `False`):
            Before the first step, summarise the successful trajectories of the experience pool the trainer starts with
            (a given `experience_pool`), so that the first guided rollouts have experience to retrieve.
    """

    guidance_train: str = "off"
    guidance_eval: str = "off"
    guidance_ratio: float = 0.0
    guidance_trained_prompt: str = "plain"
    guidance_keep_ratio: float = 1.0
    guidance_template: str = DEFAULT_TEMPLATE
    guidance_top_k: int = 3
    guidance_max_tokens: int = 512
    guidance_update_freq: int = 0
    guidance_init_from_pool: bool = False

    @property
    def on(self) -> bool:
        """Whether any rollout is guided."""
        return self.guidance_train != "off" or self.guidance_eval != "off"

    def __post_init__(self):
        for name in ("guidance_train", "guidance_eval"):
            _check(getattr(self, name) in ROLLOUT_MODES, name, getattr(self, name), _names(ROLLOUT_MODES))
        mode = self.guidance_trained_prompt
        _check(mode in SAMPLE_MODES, "guidance_trained_prompt", mode, _names(SAMPLE_MODES))
        for name in ("guidance_ratio", "guidance_keep_ratio"):
            value = getattr(self, name)
            _check(_is_number(value) and 0.0 <= value <= 1.0, name, value, "numbers in [0, 1]")
        if self.guidance_ratio != 0.0 and "mixed" not in (self.guidance_train, self.guidance_eval):
            raise ValueError(
                f"`guidance_ratio`={self.guidance_ratio!r} is not read with guidance_train={self.guidance_train!r} "
                f"and guidance_eval={self.guidance_eval!r} (only with 'mixed'): leave it unset, or "
                f"set a mode to 'mixed'."
            )
        if self.guidance_keep_ratio != 1.0 and self.guidance_trained_prompt != "hybrid":
            raise ValueError(
                f"`guidance_keep_ratio`={self.guidance_keep_ratio!r} is not read with guidance_trained_prompt="
                f"{self.guidance_trained_prompt!r} (only with 'hybrid'): leave it unset, or set "
                "guidance_trained_prompt='hybrid'."
            )
        template = self.guidance_template
        _check(
            isinstance(template, str) and template.count("{}") == 1,
            "guidance_template",
            template,
            "strings that contain `{}` exactly once (where the retrieved experience goes)",
        )
        k = self.guidance_top_k
        _check(_is_int(k) and k >= 1, "guidance_top_k", k, "integers >= 1")
        budget = self.guidance_max_tokens
        _check(_is_int(budget) and budget >= 1, "guidance_max_tokens", budget, "integers >= 1")
        freq = self.guidance_update_freq
        _check(_is_int(freq) and freq >= 0, "guidance_update_freq", freq, "integers >= 0 (0: no updates)")
        init = self.guidance_init_from_pool
        _check(isinstance(init, bool), "guidance_init_from_pool", init, "True or False (a bool, not a string)")

    def check_groups(self, num_generations: int) -> None:
        """What only the trainer knows: a 'mixed' mode must guide at least one of a group's rollouts."""
        mixed = [name for name in ("guidance_train", "guidance_eval") if getattr(self, name) == "mixed"]
        if mixed and num_generations and round(num_generations * self.guidance_ratio) == 0:
            raise ValueError(
                f"Invalid value {self.guidance_ratio!r} for `guidance_ratio`: with {mixed[0]}='mixed', "
                f"round(num_generations * guidance_ratio) = round({num_generations} * {self.guidance_ratio}) = 0 "
                "rollouts would be guided; allowed values guide at least one (guidance_ratio > "
                f"{0.5 / num_generations:g}, since round() halves to even), or set {mixed[0]}='off'."
            )


document_fields(GuidanceSettings)
