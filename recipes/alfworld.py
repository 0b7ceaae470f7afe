"""ALFWorld with ExReplay GRPO, end to end: games -> tasks -> model -> warm start -> trainer -> evaluation -> save/push.

    accelerate launch recipes/alfworld.py                 # default: recipes/configs/alfworld_tiny_cpu.yaml
    accelerate launch --config_file recipes/accelerate/zero3_gpu.yaml recipes/alfworld.py \
        --config recipes/configs/alfworld_qwen2.5-1.5b.yaml --push_to_hub --hub_model_id you/alfworld-exreplay

Every option is a field of `AlfWorldArguments` below, of `ExReplayGRPOConfig` or of `trl.ModelConfig`; a YAML config
sets them and the command line overrides it. Games come from `data_dir` (official ALFWorld `json_2.1.1` data or
games generated offline when missing); with no `model_name_or_path` the model is a tiny causal LM with a word-level
tokenizer over the ALFWorld vocabulary, built locally. The warm start (SFT on the searching expert's episodes) is
cached under `data_dir/warmstart/` and reused by later runs with the same settings. `--resume_from_checkpoint true`
continues a stopped run from the newest checkpoint in `output_dir`, its experience pool included.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "configs", "alfworld_tiny_cpu.yaml")
# Python puts this script's folder first on sys.path, where this file would shadow the `alfworld` package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]


@dataclass
class AlfWorldArguments:
    """Recipe options that are not training or model options."""

    data_dir: str = field(
        default="data/alfworld",
        metadata={
            "help": "Folder holding json_2.1.1/<split>/ (official ALFWorld data, or where games are generated)."
        },
    )
    generate_missing_games: bool = field(
        default=True,
        metadata={"help": "Generate a split offline (verified on the engine) when data_dir has no games for it."},
    )
    num_train_games: int = field(default=60, metadata={"help": "Train games to generate when generating."})
    num_eval_games: int = field(default=20, metadata={"help": "Games per evaluation split to generate."})
    game_seed: int = field(default=0, metadata={"help": "Seed of the game generator."})
    task_types: list[str] | None = field(
        default=None,
        metadata={"help": "ALFWorld task types (names or ids 1-6) to generate and train on; all if None."},
    )
    scenes: list[int] | None = field(
        default=None,
        metadata={"help": "Floor plans of generated train and valid_seen games (a subset of ALFWorld's train floor "
                          "plans); None: all. valid_unseen always uses its own unseen floor plans."},
    )  # fmt: skip
    target_objects: list[str] | None = field(
        default=None,
        metadata={"help": "Objects the tasks ask for (ALFRED types such as Book, CD); games of other objects are "
                          "neither generated nor loaded. None: any."},
    )  # fmt: skip
    verify_train_games: bool = field(
        default=True,
        metadata={"help": "Play each generated train game's walkthrough on the engine before use (evaluation games "
                          "are always verified; the warm start's expert plays every train game anyway)."},
    )  # fmt: skip
    train_split: str = field(default="train", metadata={"help": "Split whose games are the training tasks."})
    eval_splits: list[str] = field(
        default_factory=lambda: ["valid_seen", "valid_unseen"],
        metadata={"help": "Splits evaluated before and after RL (greedy, one episode per game)."},
    )
    max_eval_games: int | None = field(
        default=None, metadata={"help": "Evaluate on at most this many games of each split (None: all)."}
    )
    eval_sampled_episodes: int = field(
        default=0,
        metadata={"help": "Also evaluate by sampling, as RL plays: this many episodes per game at eval_temperature "
                          "(with the training top_k/top_p/min_p); 0: greedy only."},
    )  # fmt: skip
    eval_temperature: float | None = field(
        default=None, metadata={"help": "Sampling temperature of the sampled evaluation; None: `temperature`."}
    )
    show_admissible: bool = field(
        default=False, metadata={"help": "Append the admissible actions to every observation."}
    )
    restate_goal: bool = field(
        default=False, metadata={"help": "Start every observation after the first with the task (helps small models)."}
    )
    invalid_action_penalty: float = field(
        default=0.0,
        metadata={
            "help": "Subtracted from the reward for each action the engine refuses ('Nothing happens.'); a won "
            "episode must still reach `replay_success_threshold`, so set that to at most 1 - max_turns * penalty."
        },
    )
    prompt_style: str = field(
        default="plain",
        metadata={"help": "System prompt: 'plain' (answer with an action), 'react' (Think:/Action:) or 'none'."},
    )
    env_processes: int | None = field(
        default=None,
        metadata={"help": "Environment worker processes per rank (the engine is CPU-bound); None: CPUs / ranks."},
    )
    tiny_hidden_size: int = field(default=128, metadata={"help": "Tiny model (no model_name_or_path): hidden size."})
    tiny_num_layers: int = field(default=4, metadata={"help": "Tiny model: transformer layers."})
    tiny_num_heads: int = field(default=4, metadata={"help": "Tiny model: attention heads."})
    tiny_entity_tokens: bool = field(
        default=False,
        metadata={"help": "Tiny model: one token per object or receptacle name ('book 2'), not one per word."},
    )
    warm_start: bool = field(
        default=True, metadata={"help": "SFT on the searching expert's episodes of the train games before RL."}
    )
    warm_start_epochs: float = field(default=3.0, metadata={"help": "Warm start: SFT epochs."})
    warm_start_learning_rate: float = field(default=3e-3, metadata={"help": "Warm start: SFT learning rate."})
    warm_start_batch_size: int = field(default=8, metadata={"help": "Warm start: SFT batch size per device."})
    warm_start_max_episodes: int | None = field(
        default=None, metadata={"help": "Warm start: use at most this many expert episodes (None: all)."}
    )
    push_pool_to_hub: bool = field(
        default=False, metadata={"help": "Also upload the final experience pool as a dataset (with --push_to_hub)."}
    )
    hub_pool_id: str | None = field(
        default=None, metadata={"help": "Dataset repo for the pool; default '<hub_model_id>-pool'."}
    )

    def __post_init__(self):
        if self.target_objects:  # a misspelt object fails here, not after minutes of game generation
            from trl_exreplay.envs.alfworld.generate import normalize_target_objects

            self.target_objects = list(normalize_target_objects(self.target_objects))
        if self.eval_sampled_episodes < 0:
            raise ValueError(f"Invalid value {self.eval_sampled_episodes} for `eval_sampled_episodes`: allowed "
                             "values are 0 (greedy only) or a positive number of episodes per game.")  # fmt: skip
        if self.eval_temperature is not None and not self.eval_temperature > 0:
            raise ValueError(f"Invalid value {self.eval_temperature} for `eval_temperature`: allowed values are "
                             "positive numbers, or None for the training `temperature`.")  # fmt: skip
        from trl_exreplay.envs.alfworld.textenv import check_invalid_action_penalty

        check_invalid_action_penalty(self.invalid_action_penalty)  # here, not first in the env's worker processes
        if self.prompt_style not in PROMPT_STYLES:
            raise ValueError(f"Invalid value {self.prompt_style!r} for `prompt_style`: allowed values are "
                             f"{', '.join(map(repr, PROMPT_STYLES))}.")  # fmt: skip


PROMPT_STYLES = ("plain", "react", "none")


def main(script_args: AlfWorldArguments, training_args, model_args) -> dict:
    from accelerate import PartialState
    from accelerate.utils import gather_object
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import get_peft_config

    from trl_exreplay import ExReplayGRPOTrainer
    from trl_exreplay.envs import EnvProcessPool
    from trl_exreplay.envs.alfworld import AlfWorldEnv, alfworld_tasks
    from trl_exreplay.envs.alfworld.engine import ENGINE_MODULES  # imported once by the fork server
    from trl_exreplay.evaluation import binomial_interval, evaluate_policy

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
    tasks = {split: load_tasks(script_args, split, system_prompt, alfworld_tasks) for split in splits}
    train_tasks = tasks[script_args.train_split]
    log(f"games: {', '.join(f'{split} {len(t)}' for split, t in tasks.items())} under {script_args.data_dir}")

    env_kwargs = env_options(script_args, training_args)
    processes = script_args.env_processes or max(1, (os.cpu_count() or 1) // state.num_processes)
    env_pool = EnvProcessPool(
        functools.partial(AlfWorldEnv, **env_kwargs), workers=processes, preload=list(ENGINE_MODULES)
    )

    # ---- model ------------------------------------------------------------------------------------------------
    base_model = model_args.model_name_or_path
    if base_model is None:  # the embedded default: a tiny model built here, no download
        from trl_exreplay.envs.alfworld.warmstart import alfworld_tokenizer

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
    eval_rows = {
        split: tasks[split].select(range(min(len(tasks[split]), script_args.max_eval_games or len(tasks[split]))))
        for split in script_args.eval_splits
    }

    sampled = script_args.eval_sampled_episodes
    temperature = training_args.temperature if script_args.eval_temperature is None else script_args.eval_temperature
    sampling = {"do_sample": True, "temperature": temperature, "top_k": training_args.top_k,
                "top_p": training_args.top_p, "min_p": training_args.min_p}  # fmt: skip
    modes = [("greedy", 1, {})] + ([(f"sampled T={temperature:g} x{sampled}", sampled, sampling)] if sampled else [])

    def evaluate(model_path: str, when: str) -> dict:
        """Success rate per split (greedy) and per split and sampling mode (the mean over its episodes)."""
        import torch

        model = load_policy(model_path, model_args, AutoModelForCausalLM).to(state.device)
        out = {}
        for split, rows in eval_rows.items():
            for mode, episodes_per_game, generate_kwargs in modes:
                name = split if mode == "greedy" else f"{split} ({mode})"
                if generate_kwargs:
                    torch.manual_seed(training_args.seed + state.process_index)  # the same draws before and after RL
                with state.split_between_processes(list(rows) * episodes_per_game) as mine:
                    result = evaluate_policy(
                        model,
                        tokenizer,
                        mine,
                        env_pool,
                        max_turns=training_args.max_turns,
                        max_completion_length=training_args.max_completion_length,
                        max_tokens_per_turn=training_args.max_tokens_per_turn,
                        step_timeout=training_args.env_step_timeout,
                        workers=training_args.env_workers,
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
                unit = "games" if mode == "greedy" else "episodes"
                log(f"{when} RL, {name}: {successes}/{episodes} {unit} won ({100 * out[name]:.1f}%)")
        del model
        return out

    counts: dict[tuple[str, str], list[int]] = {}  # (when, split) -> [successes, episodes]
    before = evaluate(policy, "before") if eval_rows else {}

    # ---- ExReplay GRPO ----------------------------------------------------------------------------------------
    training_args.model_init_kwargs = {**(training_args.model_init_kwargs or {}), **model_init_kwargs(model_args)}
    push_to_hub, training_args.push_to_hub = training_args.push_to_hub, False  # pushed once, below, with our card
    trainer = ExReplayGRPOTrainer(
        model=policy,
        args=training_args,
        processing_class=tokenizer,
        train_dataset=train_tasks,
        text_env_factory=env_pool,  # reward: the environment's (1 on a win, less invalid_action_penalty)
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)  # with its pool
    trainer.save_model(training_args.output_dir)  # model (or adapter), tokenizer and pool
    pool_stats = trainer.pool.stats()
    replay_over_run = replay_participation(trainer.state.log_history)
    del trainer  # its model and optimizer, before evaluation loads the trained model
    gc.collect()
    state.wait_for_everyone()

    # ---- evaluation after RL, summary, push -------------------------------------------------------------------
    after = evaluate(training_args.output_dir, "after") if eval_rows else {}
    env_pool.close()
    results = {name: {"before": before[name], "after": after[name]} for name in before}
    intervals = {
        name: {when: list(binomial_interval(*counts[when, name])) for when in ("before", "after")}
        | {"episodes": counts["after", name][1]}
        for name in before
    }
    summary = {
        "base_model": base_model or "tiny (built locally)",
        "results": results,
        "intervals": intervals,  # 95% binomial (Wilson) intervals of the success rates, and the episodes behind them
        "replay": replay_over_run,
        "success_threshold": training_args.replay_success_threshold,
        "invalid_action_penalty": script_args.invalid_action_penalty,
        "pool": pool_stats,
        "minutes": (time.time() - started) / 60,
        "output_dir": training_args.output_dir,
    }
    if state.is_main_process:
        print_summary(summary, len(train_tasks))
        with open(os.path.join(training_args.output_dir, "alfworld_results.json"), "w") as f:
            json.dump(summary, f, indent=2)
        if push_to_hub:
            push(script_args, training_args, model_args, base_model, tasks, results)
    state.wait_for_everyone()
    return summary


# ---------------------------------------------------------------------------------------------------- steps
def ensure_games(script_args: AlfWorldArguments, splits: list[str]) -> None:
    """Generate the splits that have no games yet (cached: later runs find them)."""
    from trl_exreplay.envs.alfworld import generate_games
    from trl_exreplay.envs.alfworld.engine import find_game_files

    for split in dict.fromkeys(splits):
        folder = os.path.join(script_args.data_dir, "json_2.1.1", split)
        if os.path.isdir(folder) and find_game_files(folder):
            continue
        if not script_args.generate_missing_games:
            raise FileNotFoundError(f"No ALFWorld games in {folder} and generate_missing_games is False.")
        count = script_args.num_train_games if split == script_args.train_split else script_args.num_eval_games
        scenes = None if split == "valid_unseen" else script_args.scenes
        report = generate_games(
            script_args.data_dir, split, count, script_args.game_seed, script_args.task_types, workers=None,
            progress=True, verify=script_args.verify_train_games or split != script_args.train_split, scenes=scenes,
            target_objects=script_args.target_objects,
        )  # fmt: skip
        print(report.summary())


def system_prompt_of(prompt_style: str) -> str | None:
    from trl_exreplay.envs.alfworld import INSTRUCTIONS, REACT_INSTRUCTIONS

    return {"plain": INSTRUCTIONS, "react": REACT_INSTRUCTIONS, "none": None}[prompt_style]


def env_options(script_args: AlfWorldArguments, training_args) -> dict:
    """`AlfWorldEnv` options: the same for training, evaluation and the expert's episodes."""
    return {
        "max_steps": training_args.max_turns,
        "show_admissible": script_args.show_admissible,
        "restate_goal": script_args.restate_goal,
        "invalid_action_penalty": script_args.invalid_action_penalty,
    }


def expert_sft_dataset(script_args: AlfWorldArguments, training_args, tokenizer, train_tasks, env_kwargs: dict):
    """The warm start's data: the searching expert plays every train game; its won episodes, laid out as rollouts."""
    from trl_exreplay.envs.alfworld.warmstart import expert_episodes, sft_dataset

    episodes = expert_episodes(train_tasks, workers=None, progress=True, **env_kwargs)
    dataset = sft_dataset(
        episodes[: script_args.warm_start_max_episodes],
        tokenizer,
        max_completion_length=training_args.max_completion_length,
        max_turns=training_args.max_turns,
        max_tokens_per_turn=training_args.max_tokens_per_turn,
        chat_template_kwargs=training_args.chat_template_kwargs,
    )
    print(f"warm start: {len(dataset)} expert episodes won of {len(episodes)} games")
    return dataset


def load_tasks(script_args: AlfWorldArguments, split: str, system_prompt, alfworld_tasks):
    tasks = alfworld_tasks(os.path.join(script_args.data_dir, "json_2.1.1", split), system_prompt=system_prompt)
    if script_args.task_types:
        from trl_exreplay.envs.alfworld.splits import normalize_task_types

        wanted = set(normalize_task_types(script_args.task_types))
        tasks = tasks.filter(lambda row: row["task_type"] in wanted)
    if script_args.target_objects:
        from trl_exreplay.envs.alfworld.expert import task_params
        from trl_exreplay.envs.alfworld.generate import normalize_target_objects

        objects = {name.lower() for name in normalize_target_objects(script_args.target_objects)}
        tasks = tasks.filter(lambda row: task_params(row["game_file"])["object"] in objects)
    return tasks


def model_init_kwargs(model_args) -> dict:
    import torch

    kwargs = {"revision": model_args.model_revision, "attn_implementation": model_args.attn_implementation}
    if model_args.dtype not in (None, "auto"):
        kwargs["dtype"] = getattr(torch, model_args.dtype)
    return {k: v for k, v in kwargs.items() if v is not None}


def build_tiny(script_args, tokenizer, training_args, path: str, state) -> str:
    """The embedded default model, saved to `path` so every rank and every later step loads the same weights."""
    from trl_exreplay.tiny import build_tiny_model

    if state.is_main_process and not os.path.isfile(os.path.join(path, "config.json")):
        model = build_tiny_model(
            tokenizer,
            hidden_size=script_args.tiny_hidden_size,
            num_layers=script_args.tiny_num_layers,
            num_heads=script_args.tiny_num_heads,
            seed=training_args.seed,
            max_position_embeddings=max(512, training_args.max_completion_length + 256),
        )
        save_atomically(path, model, tokenizer)
    state.wait_for_everyone()
    return path


def warm_start(script_args, training_args, model_args, tokenizer, train_tasks, env_kwargs, state) -> str:
    """SFT with TRL's `SFTTrainer` on the searching expert's won episodes of the train games, laid out token for
    token as the RL rollouts; returns the folder of the warm-started model (cached by its settings)."""
    import datasets
    from accelerate.utils import broadcast_object_list
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer, get_peft_config

    key = {
        "model": asdict(model_args),  # base, revision, dtype, LoRA settings
        "tiny": [script_args.tiny_hidden_size, script_args.tiny_num_layers, script_args.tiny_num_heads],
        "tokenizer": [sorted(tokenizer.get_vocab().items()), tokenizer.chat_template],
        "games": sorted(train_tasks["game_file"]),
        "system_prompt": train_tasks[0]["system_prompt"] if len(train_tasks) else None,
        "env": {k: v for k, v in env_kwargs.items() if k != "invalid_action_penalty"},  # rewards only: not SFT's
        "limits": [training_args.max_turns, training_args.max_completion_length, training_args.max_tokens_per_turn],
        "sft": [
            script_args.warm_start_epochs,
            script_args.warm_start_learning_rate,
            script_args.warm_start_batch_size,
            script_args.warm_start_max_episodes,
            training_args.seed,
            state.num_processes,
        ],
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]
    path = os.path.abspath(os.path.join(script_args.data_dir, "warmstart", digest))
    # The main process decides for all ranks (a job finishing the same warm start meanwhile must not split them),
    # and names this run's own temporary folders.
    decision = [os.path.isfile(os.path.join(path, "config.json")), f"{path}.tmp-{os.getpid()}"]
    cached, tmp = broadcast_object_list(decision) if state.num_processes > 1 else decision
    if cached:
        if state.is_main_process:
            print(f"warm start: reusing {path}")
        return path

    if state.is_main_process:
        dataset = expert_sft_dataset(script_args, training_args, tokenizer, train_tasks, env_kwargs)
        dataset.save_to_disk(tmp + ".sft-data")
    state.wait_for_everyone()
    dataset = datasets.load_from_disk(tmp + ".sft-data").remove_columns("task_id")
    if len(dataset) == 0:  # every rank reads the same data, so every rank stops here
        raise ValueError(
            f"Warm start: the expert won no train game within max_turns={training_args.max_turns} and "
            f"max_completion_length={training_args.max_completion_length}; raise them, or set warm_start false."
        )
    if model_args.model_name_or_path is None:
        model = AutoModelForCausalLM.from_pretrained(build_tiny(script_args, tokenizer, training_args,
                                                                tmp + ".init", state))  # fmt: skip
    else:
        model = model_args.model_name_or_path
    sft_args = SFTConfig(
        output_dir=tmp + ".sft",
        num_train_epochs=script_args.warm_start_epochs,
        per_device_train_batch_size=script_args.warm_start_batch_size,
        learning_rate=script_args.warm_start_learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=10,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        max_length=None,
        seed=training_args.seed,
        use_cpu=training_args.use_cpu,
        bf16=training_args.bf16,
        gradient_checkpointing=training_args.gradient_checkpointing,
        model_init_kwargs=model_init_kwargs(model_args) if isinstance(model, str) else None,
    )
    sft = SFTTrainer(
        model=model, args=sft_args, train_dataset=dataset, processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )  # fmt: skip
    sft.train()
    sft.save_model(tmp)  # every rank: under ZeRO-3 saving gathers the shards; the tokenizer is saved with it
    del sft
    gc.collect()
    if state.is_main_process:
        if model_args.use_peft:  # RL trains a fresh adapter on top of the merged warm start
            merge_adapter(tmp, model_args)
        for leftover in (".sft-data", ".init", ".sft"):
            shutil.rmtree(tmp + leftover, ignore_errors=True)
        try:
            os.replace(tmp, path)  # atomic: a crash never leaves a half-written warm start behind
        except OSError:  # another job finished the same warm start first: use theirs
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    state.wait_for_everyone()
    # Under DeepSpeed, accelerate refuses a second Accelerator (the RL trainer's) while the first one's state lives.
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    return path


def save_atomically(path: str, model, tokenizer) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, path)


@contextlib.contextmanager
def whole_model_loading():
    """Load models whole on this rank. A ZeRO-3 trainer registers its config globally, and transformers would then
    partition every model it loads with collective calls, which hang when one rank loads alone."""
    from transformers.integrations import deepspeed as hf_deepspeed

    registered = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = registered


def merge_adapter(path: str, model_args, into: str | None = None) -> str:
    """Merge the PEFT adapter saved in `path` into its base model; write the whole model (and the tokenizer) to
    `into` (default: replace `path`). Returns the folder written."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    into = into or path
    with whole_model_loading():
        merged = AutoPeftModelForCausalLM.from_pretrained(path, **model_init_kwargs(model_args)).merge_and_unload()
    tokenizer = AutoTokenizer.from_pretrained(path)
    staging = f"{into}.merging-{os.getpid()}"
    merged.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if os.path.isdir(into):
        shutil.rmtree(into)
    os.replace(staging, into)
    return into


def load_policy(path: str, model_args, auto_model):
    """The model in `path` (full weights, or a PEFT adapter on its base model), whole on this rank: evaluation runs
    each rank's share of the games with plain `generate`, whatever the training's distribution."""
    with whole_model_loading():
        if os.path.isfile(os.path.join(path, "adapter_config.json")):
            from peft import AutoPeftModelForCausalLM

            return AutoPeftModelForCausalLM.from_pretrained(path, **model_init_kwargs(model_args))
        return auto_model.from_pretrained(path, **model_init_kwargs(model_args))


def replay_participation(log_history: list[dict], points: int = 4) -> dict:
    """How much replay took part over a run, from the trainer's logs: the replayed-row fraction (mean over the logged
    steps from replay's start, and max) and the pool's size at `points` evenly spaced logged steps (the last included)."""
    logged = [entry for entry in log_history if "replay/rows_fraction" in entry]
    if not logged:
        return {}
    fractions = [entry["replay/rows_fraction"] for entry in logged]
    started = next((i for i, f in enumerate(fractions) if f > 0), len(fractions))
    at = sorted({max(0, round(len(logged) * (i + 1) / points) - 1) for i in range(points)})
    return {
        "rows_fraction_mean": sum(fractions[started:]) / max(1, len(fractions) - started),
        "rows_fraction_max": max(fractions),
        "steps": [logged[i].get("step") for i in at],
        "pool_tasks": [logged[i].get("replay/pool_tasks", 0.0) for i in at],
        "pool_trajectories": [logged[i].get("replay/pool_trajectories", 0.0) for i in at],
    }


def print_summary(summary: dict, num_train_games: int) -> None:
    print("\n" + "=" * 76)
    print(f"ALFWorld, {num_train_games} train games, model: {summary['base_model']}")
    width = max([16, *(len(split) + 2 for split in summary["results"])])
    print(f"{'split':<{width}}{'before RL [95% CI]':>22}{'after RL [95% CI]':>22}{'change':>10}{'n':>6}")
    for split, r in summary["results"].items():
        ci = summary["intervals"][split]
        cells = [f"{100 * r[w]:.1f}% [{100 * ci[w][0]:.0f}-{100 * ci[w][1]:.0f}]" for w in ("before", "after")]
        change = 100 * (r["after"] - r["before"])
        print(f"{split:<{width}}{cells[0]:>22}{cells[1]:>22}{change:>+8.1f}pt{ci['episodes']:>6}")
    replay = summary.get("replay")
    if replay:
        print(f"replayed rows: {100 * replay['rows_fraction_mean']:.1f}% of each step's rows from replay's start "
              f"(max {100 * replay['rows_fraction_max']:.1f}%)")  # fmt: skip
        sizes = ", ".join(f"step {s}: {t:.0f}/{n:.0f}" for s, t, n in
                          zip(replay["steps"], replay["pool_tasks"], replay["pool_trajectories"]))  # fmt: skip
        print(f"pool over the run (tasks/trajectories): {sizes}")
    pool = summary["pool"]
    if pool:
        print(f"pool: {pool.get('pool_tasks', 0):.0f} tasks, {pool.get('pool_trajectories', 0):.0f} trajectories, "
              f"skip set {pool.get('skip_set', 0):.0f}")  # fmt: skip
    print(f"total time: {summary['minutes']:.1f} min; saved to {summary['output_dir']}")
    print("=" * 76)


def push(script_args, training_args, model_args, base_model, tasks, results) -> None:
    import torch
    import transformers
    import trl
    from huggingface_hub import HfApi

    from trl_exreplay import __version__
    from trl_exreplay.config import replay_options
    from trl_exreplay.envs.alfworld import alfworld_version
    from trl_exreplay.hub import model_card, push_model
    from trl_exreplay.pool import push_pool
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
        splits={split: len(t) for split, t in tasks.items()},
        replay_config=replay_options(training_args),
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

    argv = list(sys.argv[1:] if argv is None else argv)
    # The tiny CPU default applies when the command names neither a config nor a model: its values (use_cpu, the
    # tiny model's rooms and limits) are wrong for any other model.
    named = {a.split("=")[0] for a in argv}
    if not named & {"--config", "--model_name_or_path"}:
        argv = ["--config", DEFAULT_CONFIG, *argv]
    parser = TrlParser((AlfWorldArguments, ExReplayGRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(argv)
    training_args.resume_from_checkpoint = checkpoint_to_resume(training_args)
    check_reward_settings(script_args, training_args)
    return script_args, training_args, model_args


def check_reward_settings(script_args: AlfWorldArguments, training_args) -> None:
    """With `invalid_action_penalty` P a won episode's reward stays above 1 - max_turns * P and a lost one's is at most
    0: `replay_success_threshold`, what counts as a win for the pool, the metrics and the evaluation, must lie between."""
    penalty, max_turns = script_args.invalid_action_penalty, training_args.max_turns
    if not penalty:
        return
    if penalty * max_turns >= 1:
        raise ValueError(f"Invalid value {penalty} for `invalid_action_penalty` with max_turns={max_turns}: a won "
                         f"episode's reward could fall to 0 or below; allowed values are in "
                         f"[0, {1 / max_turns:g}).")  # fmt: skip
    lowest_win = 1.0 - max_turns * penalty
    if not 0.0 < training_args.replay_success_threshold <= lowest_win:
        raise ValueError(f"Invalid value {training_args.replay_success_threshold} for `replay_success_threshold` with "
                         f"invalid_action_penalty={penalty} and max_turns={max_turns}: a won episode's reward stays "
                         f"above {lowest_win:g} and a lost one's is at most 0, so allowed values are in (0, "
                         f"{lowest_win:g}].")  # fmt: skip


def checkpoint_to_resume(training_args) -> str | None:
    """`--resume_from_checkpoint`: a checkpoint folder, or `true` for the newest complete `checkpoint-*` in
    `output_dir`. Resolved before any work, so that a wrong value fails at once, not after the games and the warm
    start. A run killed while saving leaves a folder without `trainer_state.json` (written last): it is skipped."""
    value = training_args.resume_from_checkpoint
    if value is None or str(value).lower() in ("", "false"):
        return None
    if str(value).lower() != "true":
        if not os.path.isfile(os.path.join(value, "trainer_state.json")):
            raise ValueError(f"Invalid value {value!r} for `resume_from_checkpoint`: allowed values are a checkpoint "
                             "folder (one holding trainer_state.json), true (the newest checkpoint in `output_dir`) "
                             "or false.")  # fmt: skip
        return value
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    output_dir, prefix = training_args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-"
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    steps = [int(name[len(prefix) :]) for name in names if name.startswith(prefix) and name[len(prefix) :].isdigit()]
    for step in sorted(steps, reverse=True):
        path = os.path.join(output_dir, f"{prefix}{step}")
        if os.path.isfile(os.path.join(path, "trainer_state.json")):
            return path
        print(f"resume_from_checkpoint: skipping {path}, an incomplete checkpoint (no trainer_state.json)")
    hint = " (this config saves none: set --save_strategy steps)" if training_args.save_strategy == "no" else ""
    raise ValueError(f"Invalid value {value!r} for `resume_from_checkpoint`: `output_dir` {output_dir!r} holds no "
                     f"complete checkpoint-* folder to resume from{hint}.")  # fmt: skip


if __name__ == "__main__":
    if "OMP_NUM_THREADS" not in os.environ:  # torch's threads share the CPUs with the other ranks
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", "1"))))
    main(*parse_args())
    from trl_exreplay.distributed import exit_distributed

    exit_distributed()  # a multi-process run: ends each rank safely (a gloo thread may otherwise abort it at exit)
