"""Write docs/config.md, the reference of `ExReplayGRPOConfig`'s own fields and of the optional parts' settings
(`MultiTurnSettings`, `GuidanceSettings`), from their grouped `Parameters:` docstrings (`trl_exreplay.parameters`).

    python tools/config_reference.py            # rewrite docs/config.md
    python tools/config_reference.py --check    # exit 1 if docs/config.md is not what the config says

`tests/unit/test_config.py` runs the check, so the page cannot drift from the code: every field, in its docstring's
group, with its default, its help text (the docstring's, which is also the field's `help`) and its counterpart in ExGRPO's or AgentEvolver's published code, so that readers of that code find their
way.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, fields
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))

from trl_exreplay.config import OWN_FIELDS, ExReplayGRPOConfig, profile_values  # noqa: E402
from trl_exreplay.envs.multiturn import MultiTurnSettings  # noqa: E402
from trl_exreplay.guidance import GuidanceSettings  # noqa: E402
from trl_exreplay.parameters import parameters  # noqa: E402

OUTPUT = REPOSITORY / "docs" / "config.md"

# Each field's counterpart in the published code, where it has one: ExGRPO (github.com/ElliottYan/LUFFY, folder
# ExGRPO: `verl/mix_src/config/mix_ppo_trainer.yaml`) and AgentEvolver (github.com/modelscope/AgentEvolver:
# `config/agentevolver.yaml`), as each configuration file spells the key.
CODE_NAMES = {
    "enable_experience_replay": "ExGRPO `trainer.experience`",
    "replay_ratio": "ExGRPO `trainer.experience_ratio`",
    "replay_start_ratio": "ExGRPO `trainer.experience_start_sratio`",
    "replay_bucket_weighting": "ExGRPO `trainer.exp_bucket_manager`",
    "replay_store_lbound": "ExGRPO `trainer.experience_lbound`",
    "replay_store_rbound": "ExGRPO `trainer.experience_rbound` (its bound is inclusive: ours less 1)",
    "replay_select_mode": "ExGRPO `trainer.exp_select_mode`",
    "replay_select_by_current_entropy": "ExGRPO ranks by `trainer.exp_metric` (`ent`, `ppl` or `random`)",
    "replay_importance_sampling": "ExGRPO `trainer.exp_is_correct`",
    "replay_clip_high": "AgentEvolver `actor_rollout_ref.actor.off_cliprange_high`",
    "replay_dual_clip_c": "AgentEvolver `actor_rollout_ref.actor.clip_ratio_c` (verl's dual clip)",
    "guidance_train": "AgentEvolver `exp_manager.train_rollout_mode` ('off' is its `woexp`)",
    "guidance_eval": "AgentEvolver `exp_manager.val_rollout_mode` ('off' is its `woexp`)",
    "guidance_ratio": "AgentEvolver `exp_manager.rollout_ratio`",
    "guidance_trained_prompt": "AgentEvolver `exp_manager.train_sample_mode` ('guided', 'plain' are its `allkeep`, "
    "`alldiscard`)",
    "guidance_keep_ratio": "AgentEvolver `exp_manager.train_sample_keepratio`",
    "guidance_template": "AgentEvolver `exp_manager.experience_template`",
    "guidance_top_k": "AgentEvolver `exp_manager.reme.retrieve_top_k`",
    "guidance_update_freq": "AgentEvolver `exp_manager.reme.updated_freq`",
    "guidance_init_from_pool": "AgentEvolver `exp_manager.init_exp_before_training`",
}

# What each documented class is, as the page introduces its groups.
SOURCES = (
    (ExReplayGRPOConfig, "`ExReplayGRPOConfig`"),
    (MultiTurnSettings, "`MultiTurnSettings` (the trainer's `multi_turn`, with `text_env_factory`)"),
    (GuidanceSettings, "`GuidanceSettings` (the trainer's `guidance`, with `experience_provider`)"),
)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def render() -> str:
    lines = [
        "---",
        "hide: [toc]  # the site's page without its table of contents: room for the four columns",
        "---",
        "",
        "# Configuration reference",
        "",
        "<!-- Written by `python tools/config_reference.py` from the `Parameters:` docstrings of `ExReplayGRPOConfig`, "
        "`MultiTurnSettings` and `GuidanceSettings`; tests/unit/test_config.py checks it. Do not edit by hand. -->",
        "",
        f"`ExReplayGRPOConfig` is TRL's `GRPOConfig` (every field of it works as in TRL) plus {len(OWN_FIELDS)} fields "
        "of experience replay. The optional parts have settings of their own, given to the trainer with the part: "
        "`MultiTurnSettings` with `text_env_factory` (as `multi_turn=`), `GuidanceSettings` with "
        "`experience_provider` (as `guidance=`; a ReMe service is `ReMeExperienceProvider(base_url, workspace_id=..., "
        "timeout=...)`). A recipe parses them beside the config: `TrlParser((ExReplayGRPOConfig, MultiTurnSettings, "
        "GuidanceSettings))` reads one YAML file or command line into the three. **The naming rule:** every field of "
        "experience replay is `replay_<what>`, except the one switch `enable_experience_replay`; dataset columns end in "
        "`_column`, as TRL's do; the multi-turn episode fields (and the tool loop's) describe episodes, not replay, and "
        "keep plain names; every field of experience-guided rollouts is `guidance_<what>`. A field that only one mode "
        "reads defaults to None (the value it then takes follows 'None:'), and set under another mode is an error "
        "naming both fields.",
        "",
        "The **in the published code** column gives each field's counterpart in ExGRPO's code "
        "([github.com/ElliottYan/LUFFY](https://github.com/ElliottYan/LUFFY), folder `ExGRPO`; arXiv 2510.02245) or "
        "AgentEvolver's ([github.com/modelscope/AgentEvolver](https://github.com/modelscope/AgentEvolver); arXiv "
        "2511.10395), as their configuration files spell it, where there is one.",
    ]
    for cls, what in SOURCES:
        defaults = {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(cls)}
        group = None
        for p in parameters(cls.__doc__):
            if p.group != group:
                group = p.group
                lines += ["", f"## {group}", "", f"Fields of {what}.", "",
                          "| field | default | in the published code | what it does |", "|---|---|---|---|"]  # fmt: skip
            lines.append(
                f"| `{p.name}` | `{_cell(repr(defaults[p.name]))}` | {CODE_NAMES.get(p.name, '')} | {_cell(p.help)} |"
            )
    return "\n".join(lines + profiles()) + "\n"


# Where ExGRPO's code (github.com/ElliottYan/LUFFY, folder ExGRPO, a verl fork) sets each profile field.
EXGRPO_SOURCES = {
    "replay_start": "`trainer.experience_start_sratio`: mixed mode from the step after `batch/solved` > 0.35",
    "replay_retire_solved": "`set_skip_uid_set` drops skip-set questions at each epoch (`rl_dataset_with_experience.py`)",
    "replay_count_replayed_successes": "`update_bucket(uid, num_success)` over all G rollouts",
    "replay_unclipped_fresh": "`actor.loss_remove_clip: true` (only in mixed mode)",
    "replay_bucket_weighting": "`exp_bucket_manager: normal` (`weighted_bucket_sampler.py`, sigma 1)",
    "replay_shaping": "`off_policy_reshape: p_div_p_0.1` (w / (w + 0.1): our replay_shaping_beta's default)",
    "replay_revisit_ratio": "none: a retired question is never drawn again",
    "replay_rescue": "none",
    "replay_spread_plan": "none: every drawn question gets its group",
}


def profiles() -> list[str]:
    """The profiles' table: each field the profile sets, under the library's defaults and under the profile."""
    lines = [
        "",
        "## Profiles",
        "",
        "`replay_profile` gives the fields below that are left unset (None) a published recipe's values; a field "
        "set by hand, in code, YAML or a flag, keeps its value. Without a profile they take the library's defaults: "
        "fresh rollouts where they teach (the spread plan: before generation, a per-task Beta estimate of fresh "
        "success and a Thompson draw give the batch's groups to the tasks most likely to have a reward spread, as "
        "MoPPS, arXiv 2507.04632, picks prompts) and every all-fail group rescued (by a stored success of its task, "
        "AR3PO's response reuse, arXiv 2509.25808), on top of the AgentEvolver-style pipeline the library was designed "
        'from; `replay_profile="exgrpo"` is ExGRPO\'s code as published (arXiv 2510.02245), whose start threshold '
        "0.35 is `replay_start_solved_fraction`'s default. The defaults before the spread plan (`teach` in the results) "
        "are `replay_spread_plan=False, replay_retire_solved=True` (a solved question leaves the fresh stream but "
        "is revisited at half its draws, returning when it fails, unlike ExGRPO's retired questions, never seen "
        "again); before every group taught (the `exreplay` arm of the earlier tests), `replay_rescue=0, "
        "replay_retire_solved=False, replay_spread_plan=False`. Which one to use: [results](results.md) compares them.",
        "",
        "| field | default | `exgrpo` | in ExGRPO's code |",
        "|---|---|---|---|",
    ]
    exgrpo_values = profile_values("exgrpo", {})
    for name, default in profile_values(None, {}).items():  # as resolved: revisits go with retirement
        exgrpo = exgrpo_values[name]
        lines.append(f"| `{name}` | `{default!r}` | `{exgrpo!r}` | {EXGRPO_SOURCES[name]} |")
    lines += [
        "",
        "Shared by both: a replay ratio of 0.5 of the batch's questions, k = 1 replayed trajectory in a group of G, "
        "the lowest-entropy trajectory under the current policy, recorded log-probs as the behaviour policy. "
        "**Pool bounds:** ExGRPO admits a question when `lbound < s <= rbound` (0 and 7 of G = 8); this library "
        "when `replay_store_lbound < s < replay_store_rbound`, so ExGRPO's `rbound` is "
        "our `replay_store_rbound - 1` and its defaults are ours (`replay_store_rbound=None` is G: s from 1 to G-1).",
        "",
        "Where the profile still differs from ExGRPO's code: a question solved by some but not all rollouts moves to "
        "its new bucket here, while ExGRPO leaves a question with 0 successes in its old bucket; the replay tasks "
        "of a batch are drawn one after another over the buckets' weights, where ExGRPO draws bucket counts from a "
        "multinomial and then tasks within buckets; ExGRPO retires questions at each epoch's start (an epoch draws each "
        "question once, so a solved question is never drawn again), stops retiring once fewer than a batch plus 20 "
        "would remain, and ends its epochs early, where this library retires a question from the next batch on (the "
        "same where each question comes once an epoch, and still so where a dataset repeats its questions), keeps "
        "every batch's size by drawing other rows, and stops the run when every question is retired; ExGRPO's mean entropy of a stored trajectory "
        "averages over padding positions (`experience_helpers.py`), ours over the completion's tokens; and ExGRPO "
        "does not normalise advantages by the group's standard deviation (`grpo_use_std=False`), which is TRL's "
        '`scale_rewards="none"`, not a replay field.',
    ]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with docs/config.md instead of writing it")
    options = parser.parse_args(argv)
    text = render()
    if options.check:
        if OUTPUT.read_text() != text:
            print("docs/config.md differs from ExReplayGRPOConfig: run python tools/config_reference.py")
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(REPOSITORY)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
