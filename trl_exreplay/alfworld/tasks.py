"""The tasks of an ALFWorld run: games generated where a split has none, loaded and filtered, with the prompts and the
environment options that training, evaluation and the warm start share."""

from __future__ import annotations

import os

from .arguments import AlfWorldArguments


def ensure_games(script_args: AlfWorldArguments, splits: list[str]) -> None:
    """Generate the splits that have no games yet (cached: later runs find them)."""
    from . import generate
    from .engine import find_game_files

    for split in dict.fromkeys(splits):
        folder = os.path.join(script_args.data_dir, "json_2.1.1", split)
        if os.path.isdir(folder) and find_game_files(folder):
            continue
        if not script_args.generate_missing_games:
            raise FileNotFoundError(f"No ALFWorld games in {folder} and generate_missing_games is False.")
        count = script_args.num_train_games if split == script_args.train_split else script_args.num_eval_games
        scenes = None if split == "valid_unseen" else script_args.scenes
        report = generate.generate_games(
            script_args.data_dir,
            split,
            count,
            script_args.game_seed,
            script_args.task_types,
            workers=None,
            progress=True,
            verify=script_args.verify_train_games or split != script_args.train_split,
            scenes=scenes,
            target_objects=script_args.target_objects,
        )
        print(report.summary())


def system_prompt_of(prompt_style: str) -> str | None:
    """The system prompt of a `prompt_style`."""
    from .textenv import INSTRUCTIONS, REACT_INSTRUCTIONS

    return {"plain": INSTRUCTIONS, "react": REACT_INSTRUCTIONS, "none": None}[prompt_style]


def env_options(script_args: AlfWorldArguments, training_args) -> dict:
    """`AlfWorldEnv` options: the same for training, evaluation and the expert's episodes."""
    return {
        "max_steps": script_args.max_turns,
        "show_admissible": script_args.show_admissible,
        "restate_goal": script_args.restate_goal,
        "invalid_action_penalty": script_args.invalid_action_penalty,
    }


def env_workers(script_args: AlfWorldArguments, env_kwargs: dict, ranks: int):
    """The environment factory of each rank: `AlfWorldEnv`s in worker processes (`EnvProcessPool`) or in Ray actors
    (`RayEnvPool`), `env_processes` of them per rank (default: the CPUs, of this machine or of the Ray cluster,
    divided among the ranks)."""
    import functools

    from .engine import ENGINE_MODULES  # imported once by the fork server
    from .textenv import AlfWorldEnv

    factory = functools.partial(AlfWorldEnv, **env_kwargs)
    if script_args.env_backend == "ray":
        from ..envs.ray_pool import RayEnvPool, ray_cpus

        cpus = script_args.env_ray_cpus_per_worker  # RAY_ADDRESS: the cluster; else a local instance
        workers = script_args.env_processes or max(1, int(ray_cpus() / cpus) // ranks)
        return RayEnvPool(factory, workers=workers, cpus_per_worker=cpus)
    from ..envs.process import EnvProcessPool

    workers = script_args.env_processes or max(1, (os.cpu_count() or 1) // ranks)
    return EnvProcessPool(factory, workers=workers, preload=list(ENGINE_MODULES))


def load_tasks(script_args: AlfWorldArguments, split: str, system_prompt: str | None):
    """The tasks of `split` under `data_dir`, filtered to the wanted task types and target objects."""
    from .textenv import alfworld_tasks

    tasks = alfworld_tasks(os.path.join(script_args.data_dir, "json_2.1.1", split), system_prompt=system_prompt)
    if script_args.task_types:
        from .splits import normalize_task_types

        wanted = set(normalize_task_types(script_args.task_types))
        tasks = tasks.filter(lambda row: row["task_type"] in wanted)
    if script_args.target_objects:
        from .expert import task_params
        from .generate import normalize_target_objects

        objects = {name.lower() for name in normalize_target_objects(script_args.target_objects)}
        tasks = tasks.filter(lambda row: task_params(row["game_file"])["object"] in objects)
    return tasks
