"""Controls for the recipe's known gap (RL does not improve the tiny default): from one cached warm start, what does an
update of RL's size do to greedy `valid_seen` success when it is not RL, and what does RL do on games the warm start
never saw?

    OMP_NUM_THREADS=2 python benchmarks/alfworld_rl_controls.py --warm-start data/alfworld/warmstart/<digest> \
        --control sft --learning-rate 1e-4 --steps 16 --batch-size 4
    OMP_NUM_THREADS=2 python benchmarks/alfworld_rl_controls.py --warm-start data/alfworld/warmstart/<digest> \
        --control rl-fresh --learning-rate 1e-4 --steps 24
    OMP_NUM_THREADS=2 python benchmarks/alfworld_rl_controls.py --warm-start data/alfworld/warmstart/<digest> \
        --control direction --rl-model outputs/alfworld_tiny
    OMP_NUM_THREADS=1 python benchmarks/alfworld_rl_controls.py --warm-start data/alfworld/warmstart/<digest> \
        --control few-games --games 8 --learning-rate 1e-4 --steps 40

`--warm-start` is the folder the recipe prints ("warm start: reusing ..."); the environment, the rollout limits and
the GRPO settings are the recipe's default YAML, with `--data-dir` holding the recipe's games.

* `sft`: continue the warm start's SFT on the searching expert's episodes of the train games (the warm start's own
  data), constant learning rate, `--steps` steps of `--batch-size` episodes: a supervised update of RL's size.
* `rl-fresh`: generate `--fresh-games` new train games (another `--fresh-seed`; none is a warm-start game), then run
  the recipe's ExReplay GRPO on them, not on the warm start's games.
* `direction`: does an RL update carry the reward's signal, or only its size? With `delta` = `--rl-model` (a model
  the recipe trained from this warm start) minus the warm start, it plays the warm start plus `delta` (the RL model),
  minus `delta` (the update reversed) and plus `delta` with every element's sign drawn at random (the same size, no
  direction). An update that follows the reward does better forward than reversed.
* `few-games`: the recipe's ExReplay GRPO on only `--games` train games drawn at random (`--seed`), many episodes
  each: can RL raise the success of the games it plays when it plays each of them often (and what does that do to
  `valid_seen`)?

`sft` and `rl-fresh` print greedy `valid_seen` success before and after, and the train success of each RL step;
`direction` prints greedy success on `valid_seen` and on as many train games (the games RL plays) for each model;
`few-games` prints the names of its games, the train success of each RL step, greedy and sampled
(`--sampled-episodes` a game, the recipe's temperature) success on its games and greedy `valid_seen` success, before
and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import os
import platform
import shutil
import sys
import time
from importlib.metadata import version

from trl_exreplay.alfworld.tasks import env_options, load_tasks, system_prompt_of
from trl_exreplay.alfworld.warmstart import expert_sft_dataset

RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "alfworld.py")


def load_recipe():
    spec = importlib.util.spec_from_file_location("alfworld_recipe", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe  # its dataclasses resolve their types through it
    spec.loader.exec_module(recipe)
    return recipe


def sft_update(recipe, recipe_args, warm_start: str, tokenizer, env_kwargs: dict, options, work: str):
    """The warm start after `options.steps` more SFT steps on its own expert episodes."""
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    script_args, training_args, _ = recipe_args
    system_prompt = system_prompt_of(script_args.prompt_style)
    train_tasks = load_tasks(script_args, script_args.train_split, system_prompt)
    dataset = expert_sft_dataset(script_args, training_args, tokenizer, train_tasks, env_kwargs)
    dataset = dataset.remove_columns("task_id")
    model = AutoModelForCausalLM.from_pretrained(warm_start)
    args = SFTConfig(
        output_dir=work,
        max_steps=options.steps,
        per_device_train_batch_size=options.batch_size,
        learning_rate=options.learning_rate,
        lr_scheduler_type="constant",
        logging_steps=4,
        save_strategy="no",
        report_to="none",
        max_length=None,
        seed=options.seed,
        use_cpu=True,
        bf16=False,
    )
    SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer).train()
    return model, []


def rl_on_fresh_games(recipe, recipe_args, warm_start: str, tokenizer, env_pool, options, work: str):
    """The warm start after the recipe's ExReplay GRPO on `options.fresh_games` games it never saw."""
    from trl_exreplay.alfworld import alfworld_tasks, generate_games

    script_args, _, _ = recipe_args
    games_dir = os.path.join(work, "games")
    report = generate_games(
        games_dir, "train", options.fresh_games, options.fresh_seed, script_args.task_types, verify=False,
        workers=None, scenes=script_args.scenes, target_objects=script_args.target_objects,
    )  # fmt: skip
    print(report.summary())
    fresh_args = dataclasses.replace(script_args, data_dir=games_dir)
    tasks = load_tasks(fresh_args, "train", system_prompt_of(script_args.prompt_style))
    warm_games = {_game_text(path) for path in alfworld_tasks(_split_dir(script_args, "train"))["game_file"]}
    overlap = sum(_game_text(path) in warm_games for path in tasks["game_file"])
    print(f"rl-fresh control: {len(tasks)} fresh games, {overlap} of them identical to a warm-start game")
    return rl_on(recipe_args, warm_start, tokenizer, env_pool, tasks, options, work)


def rl_on(recipe_args, warm_start: str, tokenizer, env_pool, tasks, options, work: str):
    """The warm start after the recipe's ExReplay GRPO on `tasks`, and the train success of each step."""
    from trl_exreplay import ExReplayGRPOTrainer

    _, training_args, _ = recipe_args
    training_args.learning_rate, training_args.max_steps = options.learning_rate, options.steps
    training_args.output_dir = os.path.join(work, "rl")
    trainer = ExReplayGRPOTrainer(
        model=warm_start,
        args=training_args,
        processing_class=tokenizer,
        train_dataset=tasks,
        text_env_factory=env_pool,
    )
    trainer.train()
    curve = [float(e["env/success_rate"]) for e in trainer.state.log_history if "env/success_rate" in e]
    return trainer.model, curve


def directions(warm_start: str, rl_model: str, seed: int) -> dict:
    """The warm start moved by the RL update `delta`, forward, reversed and with random signs: name -> model."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(warm_start)
    warm = base.state_dict()  # never changed: every model below is a copy of `base`
    trained = AutoModelForCausalLM.from_pretrained(rl_model).state_dict()
    if warm.keys() != trained.keys() or any(warm[k].shape != trained[k].shape for k in warm):
        raise ValueError(
            f"--rl-model {rl_model!r} does not have the warm start's architecture (its parameters' names or shapes "
            "differ): give the output_dir of a recipe run that started from --warm-start (a full model, not an adapter)."
        )
    generator = torch.Generator().manual_seed(seed)
    signs = {
        k: torch.randint(0, 2, v.shape, generator=generator).to(v.dtype) * 2 - 1 if v.is_floating_point() else 1
        for k, v in warm.items()
    }
    moves = {
        "warm start": lambda k: warm[k],
        "+delta (the RL model)": lambda k: trained[k],
        "-delta (reversed)": lambda k: 2 * warm[k] - trained[k],
        "+delta, random signs": lambda k: warm[k] + signs[k] * (trained[k] - warm[k]),
    }
    models = {}
    for name, move in moves.items():
        model = copy.deepcopy(base)
        model.load_state_dict({k: move(k) for k in warm})
        models[name] = model
    size = sum(float((trained[k] - warm[k]).float().norm()) ** 2 for k in warm if warm[k].is_floating_point()) ** 0.5
    print(f"direction control: |delta| = {size:.4f} (L2 over all parameters)")
    return models


def _print_machine() -> None:
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
    )
    print(f"versions: trl {version('trl')}, transformers {version('transformers')}, torch {version('torch')}, "
          f"alfworld {version('alfworld')}")  # fmt: skip


def _split_dir(script_args, split: str) -> str:
    return os.path.join(script_args.data_dir, "json_2.1.1", split)


def _game_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm-start", required=True, help="A warm-start folder the recipe cached.")
    parser.add_argument("--control", required=True, choices=["sft", "rl-fresh", "direction", "few-games"])
    parser.add_argument("--rl-model", help="direction: a model the recipe trained from --warm-start (its output_dir).")
    parser.add_argument("--data-dir", default="data/alfworld", help="The recipe's data_dir (its games).")
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="sft, rl-fresh, few-games: step size.")
    parser.add_argument("--steps", type=int, default=16, help="sft, rl-fresh, few-games: optimizer steps.")
    parser.add_argument("--batch-size", type=int, default=4, help="sft: expert episodes a step.")
    parser.add_argument("--fresh-games", type=int, default=200, help="rl-fresh: games to generate.")
    parser.add_argument("--fresh-seed", type=int, default=1, help="rl-fresh: generator seed (the recipe's is 0).")
    parser.add_argument("--games", type=int, default=8, help="few-games: train games RL plays (drawn by --seed).")
    parser.add_argument("--sampled-episodes", type=int, default=8, help="few-games: sampled episodes a game.")
    parser.add_argument("--seed", type=int, default=0, help="Training seed; few-games: also its games and draws.")
    parser.add_argument("--work", default="outputs/alfworld_rl_controls")
    options = parser.parse_args(argv)
    if (options.control == "direction") != (options.rl_model is not None):
        parser.error("--rl-model is required by --control direction, and used by no other control")
    if options.games < 1 or options.sampled_episodes < 0:
        parser.error("--games must be at least 1 and --sampled-episodes at least 0")

    from transformers import AutoModelForCausalLM

    from trl_exreplay.alfworld import AlfWorldEnv
    from trl_exreplay.alfworld.engine import ENGINE_MODULES
    from trl_exreplay.alfworld.warmstart import alfworld_tokenizer
    from trl_exreplay.envs import EnvProcessPool
    from trl_exreplay.envs.evaluation import evaluate_policy

    started = time.time()
    work = os.path.join(options.work, options.control)
    shutil.rmtree(work, ignore_errors=True)
    recipe = load_recipe()
    recipe_args = recipe.parse_args(
        ["--data_dir", options.data_dir, "--output_dir", work, "--seed", str(options.seed)]
    )
    script_args, training_args, _ = recipe_args
    env_kwargs = env_options(script_args, training_args)
    tokenizer = alfworld_tokenizer(entity_tokens=script_args.tiny_entity_tokens)
    env_pool = EnvProcessPool(
        functools.partial(AlfWorldEnv, **env_kwargs), workers=os.cpu_count() or 1, preload=list(ENGINE_MODULES)
    )
    system_prompt = system_prompt_of(script_args.prompt_style)
    eval_tasks = list(load_tasks(script_args, "valid_seen", system_prompt))

    def successes(model, tasks=eval_tasks, **generate_kwargs) -> int:
        result = evaluate_policy(
            model, tokenizer, tasks, env_pool,
            max_turns=script_args.max_turns, max_completion_length=training_args.max_completion_length,
            max_tokens_per_turn=script_args.max_tokens_per_turn, workers=script_args.env_workers,
            **generate_kwargs,
        )  # fmt: skip
        return result.successes

    def sampled_successes(model, tasks) -> int:
        import torch

        torch.manual_seed(options.seed)  # the same draws before and after RL
        return successes(
            model, tasks * options.sampled_episodes, do_sample=True, temperature=training_args.temperature,
            top_k=training_args.top_k, top_p=training_args.top_p, min_p=training_args.min_p,
        )  # fmt: skip

    if options.control == "few-games":
        train_tasks = load_tasks(script_args, script_args.train_split, system_prompt)
        games = train_tasks.shuffle(seed=options.seed).select(range(min(options.games, len(train_tasks))))
        rows = list(games)
        print("few-games control:", ", ".join(sorted("/".join(r["game_file"].split(os.sep)[-3:-1]) for r in rows)))
        try:
            warm = AutoModelForCausalLM.from_pretrained(options.warm_start)
            before = (successes(warm, rows), sampled_successes(warm, rows), successes(warm))
            model, curve = rl_on(recipe_args, options.warm_start, tokenizer, env_pool, games, options, work)
            after = (successes(model, rows), sampled_successes(model, rows), successes(model))
        finally:
            env_pool.close()
        _print_machine()
        print("train success per RL step:", " ".join(f"{x:.2f}" for x in curve))
        n, k = len(rows), options.sampled_episodes
        print(f"control few-games, lr {options.learning_rate:g}, {options.steps} steps on {n} train games "
              f"({(time.time() - started) / 60:.1f} min), before -> after:")  # fmt: skip
        print(f"  those games, greedy: {before[0]}/{n} -> {after[0]}/{n}")
        print(
            f"  those games, sampled T={training_args.temperature:g} x{k}: {before[1]}/{n * k} -> {after[1]}/{n * k}"
        )
        print(f"  valid_seen, greedy: {before[2]}/{len(eval_tasks)} -> {after[2]}/{len(eval_tasks)}")
        return {"games": n, "before": before, "after": after, "train_success": curve}

    if options.control == "direction":
        train_tasks = load_tasks(script_args, script_args.train_split, system_prompt)
        train_tasks = list(train_tasks)[: len(eval_tasks)]
        try:
            table = {
                name: (successes(model), successes(model, train_tasks))
                for name, model in directions(options.warm_start, options.rl_model, options.seed).items()
            }
        finally:
            env_pool.close()
        _print_machine()
        print(f"{'model':<24}{'valid_seen':>12}{'train':>12}   (greedy; {os.path.basename(options.rl_model)})")
        for name, (seen, train) in table.items():
            print(f"{name:<24}{f'{seen}/{len(eval_tasks)}':>12}{f'{train}/{len(train_tasks)}':>12}")
        print(f"{(time.time() - started) / 60:.1f} min")
        return {"models": table, "games": {"valid_seen": len(eval_tasks), "train": len(train_tasks)}}

    try:
        before = successes(AutoModelForCausalLM.from_pretrained(options.warm_start))
        if options.control == "sft":
            model, curve = sft_update(recipe, recipe_args, options.warm_start, tokenizer, env_kwargs, options, work)
        else:
            model, curve = rl_on_fresh_games(
                recipe, recipe_args, options.warm_start, tokenizer, env_pool, options, work
            )
        after = successes(model)
    finally:
        env_pool.close()
    _print_machine()
    if curve:
        print("train success per RL step:", " ".join(f"{x:.2f}" for x in curve))
    games = len(eval_tasks)
    print(f"control {options.control}, lr {options.learning_rate:g}, {options.steps} steps: greedy valid_seen "
          f"{before}/{games} before, {after}/{games} after; {(time.time() - started) / 60:.1f} min")  # fmt: skip
    return {"before": before, "after": after, "games": games, "train_success": curve}


if __name__ == "__main__":
    main()
