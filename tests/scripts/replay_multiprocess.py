"""Launched by tests/distributed/test_multiprocess.py with `accelerate launch`: train with replay active, dump what each rank saw.

Usage: accelerate launch --config_file CONFIG tests/scripts/replay_multiprocess.py OUT_DIR [multi-turn] [resume=CKPT]
       [trl-options] [scratch=DIR] [small-shards] [guided] [then OUT_DIR2 OPTIONS2 ...]
Each `then` starts another run in the same launch, after the one before it ended (a launch's startup, imports and
DeepSpeed's initialisation, costs more than these runs' training; a resumed run is always a launch of its own).
Each rank writes OUT_DIR/rank{r}.json with its pool's index hash (and rank 0, which holds the rows, its content hash), the replay plans it made, losses and generated rows (and,
multi-turn, the episodes it played per step). With `resume=CKPT` the run resumes from that checkpoint (pool, model,
optimizer, RNG) of an earlier run with the same settings. `trl-options` trains with TRL options whose replayed term
makes collective calls of its own (TRL's entropy selection gathers every rank's entropies) or is not the default
clip: `loss_type="cispo"`, `top_entropy_quantile=0.5`, `entropy_coef`, `off_policy_mask_threshold`. `scratch=DIR`: the
live pool's shards go to DIR (`replay_scratch_dir`), a machine's local disk when OUT_DIR is shared. `small-shards`: the
trainer gets a pool whose shards hold 2 rows, so that files are written during training. `ratio=R`: `replay_ratio` (default 1). `exgrpo` (that `replay_profile`), `defaults` (the library's: rescue and the
spread plan) or `teach` (rescue, retired questions revisited) for 12 steps on a dataset of 6 rows (an epoch of 2 steps,
so questions retire during the run), with `spread` the plan's exploration floor at 0 (`defaults spread`); without any,
replay alone (no rescue, no retirement, no plan), which the other tests' figures assume. `guided`: experience-guided rollouts too (mixed, half
the tasks keep, the offline provider updated every step; evaluation guided every 3 steps, one group spanning both
ranks); each rank records every allocation it draws.

single-turn: 12 rows per step over 2 ranks, G=4, so group 1 spans both ranks.
multi-turn: 4 rows per step, one group of G=4 over both ranks, k=2: once replay starts, rank 1's rows are both
replayed and it plays no episode at all while rank 0 plays two, with turns of their own length.
"""

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import trl_exreplay.guidance.rollouts as guidance_module  # noqa: E402
import trl_exreplay.replay as replay_module  # noqa: E402
from trl_exreplay import ExReplayGRPOConfig, ExReplayGRPOTrainer, GuidanceSettings, MultiTurnSettings  # noqa: E402
from trl_exreplay.demo import KeyDoorEnv  # noqa: E402
from trl_exreplay.demo.examples import VOCABULARY, said_target, say_word_dataset  # noqa: E402
from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from trl_exreplay.demo.toy import KEY_DOOR_VOCABULARY, key_door_dataset  # noqa: E402
from trl_exreplay.distributed import exit_distributed  # noqa: E402
from trl_exreplay.envs.multiturn import MultiTurnRollouts  # noqa: E402
from trl_exreplay.guidance.rollouts import GuidedRollouts  # noqa: E402


def part_of(trainer, kind):
    """The trainer's optional part of class `kind`, or None."""
    return next((part for part in trainer._parts if isinstance(part, kind)), None)


# What each run records, emptied at the start of each run: the replay plans (with the step each was drawn for and the
# groups replay_ratio asked of it), the guidance allocations, the rows reaching `generate`, the episodes played.
recorded = {"plans": [], "plan_steps": [], "plan_due": [], "allocations": [], "generated_rows": [], "episodes": []}
original_plan_replay = replay_module.plan_replay


def recording_plan_replay(*args, **kwargs):
    plan = original_plan_replay(*args, **kwargs)
    recorded["plans"].append({str(group): task for group, task in plan.replay_groups.items()})
    recorded["plan_steps"].append(kwargs["seed"][1])  # the global step it was drawn for: [seed, step, micro-step]
    recorded["plan_due"].append(kwargs["num_tasks"])  # the groups replay_ratio asked of this batch
    return plan


replay_module.plan_replay = recording_plan_replay
original_allocate = guidance_module.allocate_guidance


def recording_allocate(*args, **kwargs):
    allocation = original_allocate(*args, **kwargs)
    recorded["allocations"].append({"guided": list(allocation.guided), "keep": list(allocation.keep)})
    return allocation


guidance_module.allocate_guidance = recording_allocate
GUIDED = dict(
    guidance_train="mixed",
    guidance_ratio=0.5,
    guidance_trained_prompt="hybrid",
    guidance_keep_ratio=0.5,
    guidance_update_freq=1,
    guidance_template="please {} ok ",
    # evaluation guided too, on a group of 4 that spans both ranks (2 rows each)
    guidance_eval="all",
    eval_strategy="steps",
    eval_steps=3,
    per_device_eval_batch_size=2,
    num_generations_eval=4,
)


class CountingTrainer(ExReplayGRPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        model = self.accelerator.unwrap_model(self.model)
        generate = model.generate

        def counting_generate(*a, **kw):
            recorded["generated_rows"].append(int(kw["input_ids"].size(0)))
            return generate(*a, **kw)

        model.generate = counting_generate
        rollouts = part_of(self, MultiTurnRollouts)
        if rollouts is not None:
            run = rollouts.engine.run

            def recording_run(tasks, generate, sync=None):
                episodes_played = run(tasks, generate, sync)
                recorded["episodes"].append([len(e.completion_ids) for e in episodes_played])
                return episodes_played

            rollouts.engine.run = recording_run


PROFILE_SETTINGS = {
    "exgrpo": {"replay_profile": "exgrpo"},
    "defaults": {},  # rescue and the spread plan
    "teach": {"replay_retire_solved": True, "replay_spread_plan": False},  # rescue and retired questions with revisits
    None: {"replay_rescue": 0, "replay_retire_solved": False, "replay_spread_plan": False},  # replay alone
}
TRL_FIGURES = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio",
               "replay/fresh_reward", "replay/trained_reward", "replay/zero_std_trained")  # fmt: skip
TRL_OPTIONS = dict(loss_type="cispo", top_entropy_quantile=0.5, entropy_coef=0.01, off_policy_mask_threshold=0.5)
EPISODES = MultiTurnSettings(max_tokens_per_turn=4, max_turns=5)


def train(out_dir: str, options: list[str]) -> None:
    """One run: train with these options, then write OUT_DIR/rank{r}.json."""
    for values in recorded.values():
        values.clear()
    multi_turn = "multi-turn" in options
    resume_from = next((option.split("=", 1)[1] for option in options if option.startswith("resume=")), None)
    profile = next((o for o in options if o in ("exgrpo", "defaults", "teach")), None)  # 12 steps on 6 rows
    tokenizer = build_tiny_tokenizer(KEY_DOOR_VOCABULARY if multi_turn else VOCABULARY)
    single_turn_settings = dict(
        per_device_train_batch_size=6, replay_trajectories_per_group=1, max_steps=12 if profile else 6,
        max_completion_length=4,
    )  # fmt: skip
    multi_turn_settings = dict(
        per_device_train_batch_size=2, replay_trajectories_per_group=2, max_steps=10, max_completion_length=48
    )
    config = ExReplayGRPOConfig(
        output_dir=os.path.join(out_dir, "run"),
        use_cpu=True,
        bf16=False,
        seed=0,
        learning_rate=5e-2,
        num_generations=4,
        beta=0.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=3,
        report_to="none",
        disable_tqdm=True,
        replay_ratio=float(next((o.split("=", 1)[1] for o in options if o.startswith("ratio=")), 1.0)),
        **({} if profile == "exgrpo" else {"replay_start_ratio": 0.3}),  # ExGRPO's profile starts by capability
        ds3_gather_for_generation=os.environ.get("EXREPLAY_TEST_DS3_GATHER", "1") == "1",
        replay_scratch_dir=next(
            (option.split("=", 1)[1] for option in options if option.startswith("scratch=")), None
        ),
        **(multi_turn_settings if multi_turn else single_turn_settings),
        **(TRL_OPTIONS if "trl-options" in options else {}),
        **({k: v for k, v in GUIDED.items() if not k.startswith("guidance_")} if "guided" in options else {}),
        **PROFILE_SETTINGS[profile],
        **({"replay_spread_explore": 0.0} if "spread" in options else {}),
    )
    guidance = {}
    if "guided" in options:
        guidance["guidance"] = GuidanceSettings(**{k: v for k, v in GUIDED.items() if k.startswith("guidance_")})
    if multi_turn:
        task_setup = dict(
            text_env_factory=KeyDoorEnv, multi_turn=EPISODES, train_dataset=key_door_dataset(num_tasks=1, repeats=40)
        )
    else:
        task_setup = dict(
            reward_funcs=said_target, train_dataset=say_word_dataset(num_tasks=3, repeats=2 if profile else 20)
        )
        if "guided" in options:
            task_setup["eval_dataset"] = say_word_dataset(num_tasks=2, repeats=4)
    if "small-shards" in options:
        from trl_exreplay.pool import ExperiencePool

        task_setup["experience_pool"] = ExperiencePool(shard_rows=2, work_dir=config.replay_scratch_dir)
    trainer = CountingTrainer(
        model=build_tiny_model(tokenizer, seed=0), args=config, processing_class=tokenizer, **task_setup, **guidance
    )
    trainer.train(resume_from_checkpoint=resume_from)

    rank = trainer.accelerator.process_index
    history = trainer.state.log_history

    def logged(name: str) -> list:
        return [e[name] for e in history if name in e]

    guided = part_of(trainer, GuidedRollouts)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "rank": rank,
                "world_size": trainer.accelerator.num_processes,
                "pool_hash": trainer.pool.index_hash(),
                "pool_content_hash": trainer.pool.content_hash() if trainer.pool.holds_rows else None,
                "pool_trajectories": trainer.pool.num_trajectories,
                "pool_scratch": trainer.pool.scratch_folder(),  # where this rank's live pool writes its shards (or None)
                "pool_storage": trainer.pool.storage_stats(),
                **{
                    name: recorded[name]
                    for name in ("plans", "plan_steps", "plan_due", "allocations", "generated_rows")
                },
                "episode_lengths": recorded["episodes"],
                "losses": logged("loss"),
                "replay_tasks": logged("replay/tasks"),
                "env_errors": logged("env/errors"),
                "schedule": [trainer._replay.schedule.started_at],
                "skip_set": trainer.pool.skip_set,
                **{
                    name: logged(f"replay/{name}")
                    for name in (
                        "redirected_groups",
                        "retired_tasks",
                        "rescued_groups",
                        "revisited_groups",
                        "returned_tasks",
                        "spread_replanned_groups",
                        "spread_observed_fresh",
                    )
                },
                "spread_estimates": (
                    trainer._pool_keeper.estimates.columns() if trainer._pool_keeper.estimates is not None else None
                ),
                # TRL's figures, the fresh rollouts' (issue 70), and the batch's as trained: the same on every rank
                "trl_figures": [{k: e.get(k) for k in TRL_FIGURES} for e in history if "loss" in e],
                "experience": [r.as_dict() for r in guided.experience.records()] if guided else [],
                "guided_fraction": logged("guide/guided_fraction"),
                "discarded_fraction": logged("guide/discarded_fraction"),
            },
            f,
        )
    if (
        profile == "teach"
    ):  # written after training, before the script's last line: exit_distributed() must not lose it
        trainer.save_model(os.path.join(out_dir, "final"))


runs, current = [], []
for argument in sys.argv[1:]:
    if argument == "then":
        runs.append(current)
        current = []
    else:
        current.append(argument)
for out_dir, *options in [*runs, current]:
    train(out_dir, options)
# The end of every launched rank: without it a gloo worker thread may free a tensor during interpreter finalization and
# abort the process after its work is done (about 1 launch in 100; see trl_exreplay/distributed.py)
exit_distributed()
