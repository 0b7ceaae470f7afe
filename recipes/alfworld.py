"""ALFWorld with ExReplay GRPO, end to end: games -> tasks -> model -> warm start -> trainer -> evaluation -> save/push.

    accelerate launch recipes/alfworld.py                 # default: recipes/configs/alfworld_tiny_cpu.yaml
    accelerate launch --config_file recipes/accelerate/zero3_gpu.yaml recipes/alfworld.py \
        --config recipes/configs/alfworld_qwen2.5-1.5b.yaml --push_to_hub --hub_model_id you/alfworld-exreplay

Every option is a field of `AlfWorldArguments` (`trl_exreplay/alfworld/arguments.py`), of `ExReplayGRPOConfig` or
of `trl.ModelConfig`; a YAML config sets them and the command line overrides it. Games come from `data_dir` (official
ALFWorld `json_2.1.1` data or games generated offline when missing); with no `model_name_or_path` the model is a tiny
causal LM with a word-level tokenizer over the ALFWorld vocabulary, built locally. The warm start (SFT on the searching expert's episodes) is
cached under `data_dir/warmstart/` and reused by later runs with the same settings. RL plays every train game, or
`rl_train_games` of them; `eval_train_episodes` also measures those games before and after RL (not held-out), beside
the held-out `eval_splits`. `--resume_from_checkpoint true`
continues a stopped run from the newest checkpoint in `output_dir`, its experience pool included.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import os
import sys
import time

# Named like the `alfworld` package, this script would shadow it (Python puts the script's folder first on sys.path):
# importing `trl_exreplay.alfworld` makes `import alfworld` find the installed package.
from trl_exreplay.alfworld.arguments import AlfWorldArguments, check_reward_settings

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "alfworld_tiny_cpu.yaml")
# The tiny model's summary says what it cannot show: its held-out figures do not rise with RL (measured in
# docs/alfworld_tiny_default.md), and a newcomer must not read that as the trainer not working.
TINY_HELD_OUT = (
    "Held-out success needs a model that generalises: this tiny model, trained from scratch in minutes, learns the "
    "games it plays, not new ones. For held-out games, train a pretrained model: --config "
    "recipes/configs/alfworld_qwen2.5-1.5b.yaml, on a GPU."
)


def main(script_args: AlfWorldArguments, training_args, model_args) -> dict:
    from accelerate import PartialState
    from accelerate.utils import gather_object
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import get_peft_config

    from trl_exreplay import ExReplayGRPOTrainer
    from trl_exreplay.alfworld.tasks import ensure_games, env_options, env_workers, load_tasks, system_prompt_of
    from trl_exreplay.alfworld.warmstart import build_tiny, warm_start
    from trl_exreplay.envs.evaluation import binomial_interval, evaluate_policy, print_summary, replay_participation
    from trl_exreplay.recipes.models import load_policy, model_init_kwargs

    check_reward_settings(script_args, training_args)  # also when main() is called without parse_args()
    state = PartialState()
    log = print if state.is_main_process else (lambda *a, **k: None)
    started = time.time()
    if training_args.use_vllm and importlib.util.find_spec("vllm") is None:
        log("vllm is not installed: episodes are generated with transformers (pip install vllm to use it).")
        training_args.use_vllm = False

    # ---- games ------------------------------------------------------------------------------------------------
    splits = [script_args.train_split, *script_args.eval_splits]
    if state.is_main_process:  # the main process generates what is missing; the others then read it
        ensure_games(script_args, splits)
    state.wait_for_everyone()
    system_prompt = system_prompt_of(script_args.prompt_style)
    tasks = {split: load_tasks(script_args, split, system_prompt) for split in splits}
    train_tasks = tasks[script_args.train_split]
    # RL may play only a few of the train games: the warm start learns from all of them, and a model trained from
    # scratch then raises its success on games it plays often, not on new ones (docs/alfworld_tiny_default.md).
    wanted = script_args.rl_train_games
    rl_tasks = rl_games(train_tasks, wanted, training_args)
    if wanted is not None and len(rl_tasks) > wanted:
        log(f"rl_train_games {wanted} raised to {len(rl_tasks)}: a generation batch of {state.num_processes} "
            f"process(es) draws {len(rl_tasks)} distinct games (per_device_train_batch_size x processes x "
            "steps_per_generation / num_generations); with fewer it would draw none.")  # fmt: skip
    games = [f"{split} {len(t)}" for split, t in tasks.items()]
    if len(rl_tasks) < len(train_tasks):
        games[0] += f" (RL plays {len(rl_tasks)} of them)"
    log(f"games: {', '.join(games)} under {script_args.data_dir}")

    env_kwargs = env_options(script_args, training_args)
    env_processes = env_workers(script_args, env_kwargs, state.num_processes)  # worker processes or Ray actors

    # ---- model ------------------------------------------------------------------------------------------------
    base_model = model_args.model_name_or_path
    if base_model is None:  # the embedded default: a tiny model built here, no download
        from trl_exreplay.alfworld.warmstart import alfworld_tokenizer

        tokenizer = alfworld_tokenizer(entity_tokens=script_args.tiny_entity_tokens)
    else:
        tokenizer = AutoTokenizer.from_pretrained(base_model, revision=model_args.model_revision)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token

    # ---- warm start -------------------------------------------------------------------------------------------
    policy = base_model
    if script_args.warm_start:
        policy = warm_start(script_args, training_args, model_args, tokenizer, train_tasks, env_kwargs, state)
    elif base_model is None:
        policy = build_tiny(
            script_args, tokenizer, training_args, os.path.join(training_args.output_dir, "init"), state
        )

    # ---- evaluation before RL ---------------------------------------------------------------------------------
    def first_games(games):
        return games.select(range(min(len(games), script_args.max_eval_games or len(games))))

    sampled = script_args.eval_sampled_episodes
    temperature = training_args.temperature if script_args.eval_temperature is None else script_args.eval_temperature
    sampling = {"do_sample": True, "temperature": temperature, "top_k": training_args.top_k,
                "top_p": training_args.top_p, "min_p": training_args.min_p}  # fmt: skip
    # What is evaluated: (its name in the summary, its games, episodes per game, sampling options or {} for greedy).
    evaluations = []
    if script_args.eval_train_episodes:  # the games RL plays, sampled as RL plays them: what RL did to them
        rows, k = first_games(rl_tasks), script_args.eval_train_episodes
        name = f"{script_args.train_split}: {len(rows)} RL games (sampled T={temperature:g} x{k})"
        evaluations.append((name, rows, k, sampling))
    for split in script_args.eval_splits:  # held-out games: greedy, and sampled when asked
        rows = first_games(tasks[split])
        evaluations.append((split, rows, 1, {}))
        if sampled:
            evaluations.append((f"{split} (sampled T={temperature:g} x{sampled})", rows, sampled, sampling))

    def evaluate(model_path: str, when: str) -> dict:
        """Success rate of each evaluation: greedy, or the mean over its sampled episodes."""
        import torch

        model = load_policy(model_path, model_args, AutoModelForCausalLM).to(state.device)
        out = {}
        for name, rows, episodes_per_game, generate_kwargs in evaluations:
            if generate_kwargs:
                torch.manual_seed(training_args.seed + state.process_index)  # the same draws before and after RL
            with state.split_between_processes(list(rows) * episodes_per_game) as mine:
                result = evaluate_policy(
                    model,
                    tokenizer,
                    mine,
                    env_processes,
                    max_turns=script_args.max_turns,
                    max_completion_length=training_args.max_completion_length,
                    max_tokens_per_turn=script_args.max_tokens_per_turn,
                    step_timeout=script_args.env_step_timeout,
                    workers=script_args.env_workers,
                    chat_template_kwargs=training_args.chat_template_kwargs,
                    success_threshold=training_args.replay_success_threshold,
                    progress=state.is_main_process,
                    desc=f"eval {when} RL: {name}",
                    **generate_kwargs,
                )
            won = gather_object([[result.successes, len(result.episodes)]])
            successes, episodes = sum(w for w, _ in won), sum(n for _, n in won)
            out[name] = successes / episodes if episodes else 0.0
            counts[when, name] = [successes, episodes]
            unit = "episodes" if generate_kwargs else "games"
            log(f"{when} RL, {name}: {successes}/{episodes} {unit} won ({100 * out[name]:.1f}%)")
        del model
        return out

    counts: dict[tuple[str, str], list[int]] = {}  # (when, evaluation's name) -> [successes, episodes]
    before = evaluate(policy, "before") if evaluations else {}

    # ---- ExReplay GRPO ----------------------------------------------------------------------------------------
    training_args.model_init_kwargs = {**(training_args.model_init_kwargs or {}), **model_init_kwargs(model_args)}
    push_to_hub, training_args.push_to_hub = training_args.push_to_hub, False  # pushed once, below, with our card
    trainer = ExReplayGRPOTrainer(
        model=policy,
        args=training_args,
        processing_class=tokenizer,
        train_dataset=rl_tasks,
        text_env_factory=env_processes,  # reward: the environment's (1 on a win, less invalid_action_penalty)
        multi_turn=script_args,  # its episode settings (an `AlfWorldArguments` is a `MultiTurnSettings`)
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)  # with its pool
    trainer.save_model(training_args.output_dir)  # model (or adapter), tokenizer and pool
    pool_stats, rl_steps = trainer.pool.stats(), trainer.state.global_step
    replay_over_run = replay_participation(trainer.state.log_history)
    del trainer  # its model and optimizer, before evaluation loads the trained model
    gc.collect()
    state.wait_for_everyone()

    # ---- evaluation after RL, summary, push -------------------------------------------------------------------
    after = evaluate(training_args.output_dir, "after") if evaluations else {}
    env_processes.close()
    results = {name: {"before": before[name], "after": after[name]} for name in before}
    intervals = {
        name: {when: list(binomial_interval(*counts[when, name])) for when in ("before", "after")}
        | {"episodes": counts["after", name][1]}
        for name in before
    }
    summary = {
        "base_model": base_model or "tiny (built locally)",
        "games": {
            "train": len(train_tasks),
            "warm_start": script_args.warm_start,
            "rl": len(rl_tasks),
            "rl_steps": rl_steps,
            "rl_task_ids": sorted(rl_tasks["task_id"]) if len(rl_tasks) < len(train_tasks) else None,
            "train_evaluation": evaluations[0][0] if script_args.eval_train_episodes else None,  # its results row
            "held_out": list(script_args.eval_splits),
        },
        "results": results,
        "intervals": intervals,  # 95% binomial (Wilson) intervals of the success rates, and the episodes behind them
        "replay": replay_over_run,
        "success_threshold": training_args.replay_success_threshold,
        "invalid_action_penalty": script_args.invalid_action_penalty,
        "pool": pool_stats,
        "minutes": (time.time() - started) / 60,
        "output_dir": training_args.output_dir,
        "notes": [] if base_model else [TINY_HELD_OUT],
    }
    if state.is_main_process:
        print_summary(summary)
        with open(os.path.join(training_args.output_dir, "alfworld_results.json"), "w") as f:
            json.dump(summary, f, indent=2)
        if push_to_hub:
            splits = {split: len(t) for split, t in tasks.items()}
            if len(rl_tasks) < len(train_tasks):  # the card says which of the train games RL played
                splits[f"{script_args.train_split}, played by RL"] = len(rl_tasks)
            own = summary["games"]["train_evaluation"]  # the games RL played: the card says they are not held-out
            rows = {(f"{name}, not held-out" if name == own else name): rates for name, rates in results.items()}
            push(script_args, training_args, model_args, base_model, splits, rows)
    state.wait_for_everyone()
    return summary


def rl_games(train_tasks, wanted: int | None, training_args):
    """The train games RL plays: all of them (`wanted` None), or `wanted` drawn by seed, but never fewer than the
    distinct games one generation batch draws (TRL's sampler yields no batch from fewer, so RL would not run)."""
    if wanted is None:
        return train_tasks
    needed = training_args.generation_batch_size // training_args.num_generations
    count = min(max(wanted, needed), len(train_tasks))
    if count == len(train_tasks):
        return train_tasks
    return train_tasks.shuffle(seed=training_args.seed).select(range(count))


def push(script_args, training_args, model_args, base_model, splits, results) -> None:
    import torch
    import transformers
    import trl
    from huggingface_hub import HfApi

    from trl_exreplay import __version__
    from trl_exreplay.alfworld import alfworld_version
    from trl_exreplay.config import replay_settings
    from trl_exreplay.hub import model_card, push_model
    from trl_exreplay.pool import push_pool
    from trl_exreplay.recipes.models import merge_adapter
    from trl_exreplay.trainer import POOL_DIR

    private, token, revision = training_args.hub_private_repo, training_args.hub_token, training_args.hub_revision
    name = training_args.hub_model_id or os.path.basename(os.path.abspath(training_args.output_dir))
    repo_id = HfApi(token=token).create_repo(name, private=private, exist_ok=True).repo_id  # with its owner
    folder = training_args.output_dir
    adapter_config = os.path.join(folder, "adapter_config.json")
    if os.path.isfile(adapter_config):
        with open(adapter_config) as f:
            adapter_base = json.load(f).get("base_model_name_or_path", "")
        if os.path.isdir(adapter_base):  # the warm start, a local folder: nobody could load the adapter alone
            folder = merge_adapter(folder, model_args, into=os.path.join(folder, "merged"))
    card = model_card(
        repo_id=repo_id,
        base_model=base_model,
        environment=f"ALFWorld (text engine, alfworld {alfworld_version()}), games from {script_args.data_dir}",
        splits=splits,
        replay_config=dataclasses.asdict(replay_settings(training_args)),
        results=results,
        versions={
            "trl_exreplay": __version__,
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "alfworld": alfworld_version(),
        },
        tags=["alfworld"],
    )
    print("pushed model:", push_model(folder, repo_id, card, private=private, token=token, revision=revision))
    if script_args.push_pool_to_hub:
        pool_dir = os.path.join(training_args.output_dir, POOL_DIR)
        pool_id = script_args.hub_pool_id or f"{repo_id}-pool"
        print("pushed pool:", push_pool(pool_dir, pool_id, private=private, token=token, revision=revision))


def parse_args(argv=None):
    from trl import ModelConfig, TrlParser

    from trl_exreplay import ExReplayGRPOConfig
    from trl_exreplay.recipes.checkpoints import checkpoint_to_resume

    argv = list(sys.argv[1:] if argv is None else argv)
    # The tiny CPU default applies when the command names neither a config nor a model: its values (use_cpu, the
    # tiny model's rooms and limits) are wrong for any other model.
    named = {a.split("=")[0] for a in argv}
    if not named & {"--config", "--model_name_or_path"}:
        argv = ["--config", DEFAULT_CONFIG, *argv]
    parser = TrlParser((AlfWorldArguments, ExReplayGRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(argv)
    training_args.resume_from_checkpoint = checkpoint_to_resume(training_args)  # before any work
    check_reward_settings(script_args, training_args)
    return script_args, training_args, model_args


if __name__ == "__main__":
    if "OMP_NUM_THREADS" not in os.environ:  # torch's threads share the CPUs with the other ranks
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", "1"))))
    main(*parse_args())
    from trl_exreplay.distributed import exit_distributed

    exit_distributed()  # a multi-process run: ends each rank safely (a gloo thread may otherwise abort it at exit)
