"""`recipes/alfworld.py` end to end on small settings: real generated games, the real engine in worker processes, the
tiny model warm-started by SFTTrainer, ExReplay GRPO, greedy evaluation before and after, saved artifacts, logging
(tensorboard, trackio), the Hub upload (network intercepted), LoRA, and 2-process runs under DDP and ZeRO-2/3."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from helpers import REPOSITORY, load_script
from launching import accelerate_launch

RECIPE = REPOSITORY / "recipes" / "alfworld.py"

# Small but complete: 4 train games, 2 per evaluation split, 2 GRPO steps; the default config's task (a book to put
# somewhere), so its `target_objects` keeps every game of the `data_dir` fixture.
SMALL = [
    "--task_types", "pick_and_place_simple",
    "--tiny_hidden_size", "32", "--tiny_num_layers", "2", "--tiny_num_heads", "2",
    "--warm_start_epochs", "2", "--warm_start_batch_size", "2",
    "--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "2",
    "--max_turns", "6", "--max_completion_length", "256", "--max_tokens_per_turn", "10",
    "--replay_start_ratio", "0.0", "--env_processes", "1", "--logging_steps", "1",
]  # fmt: skip


def load_recipe():
    return load_script("recipes/alfworld.py", "alfworld_recipe")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from trl_exreplay.alfworld import generate_games

    root = tmp_path_factory.mktemp("alfworld_recipe")
    for split, count in (("train", 4), ("valid_seen", 2), ("valid_unseen", 2)):
        report = generate_games(
            str(root), split, count, seed=0, task_types=["pick_and_place_simple"], workers=2, target_objects=["Book"]
        )
        assert report.written == count
    return root


def run_recipe(data_dir, output_dir, *extra):
    recipe = load_recipe()
    args = recipe.parse_args([*SMALL, "--data_dir", str(data_dir), "--output_dir", str(output_dir), *extra])
    return recipe.main(*args)


def scalars(event_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: dict[str, list[float]] = {}
    for event_file in event_dir.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(event_file))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            values.setdefault(tag, []).extend(e.value for e in accumulator.Scalars(tag))
    return values


def logged_steps(event_file: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(event_file))
    accumulator.Reload()
    return [event.step for event in accumulator.Scalars(tag)]


class HubRecorder:
    """Stands in for the Hub's network: records what would be created and uploaded."""

    def __init__(self, monkeypatch):
        import huggingface_hub

        self.repos, self.commits = [], []

        def create_repo(api, repo_id, **kwargs):
            self.repos.append((repo_id, kwargs.get("repo_type")))
            prefix = "datasets/" if kwargs.get("repo_type") == "dataset" else ""
            return huggingface_hub.RepoUrl(f"https://huggingface.co/{prefix}{repo_id}")

        def create_commit(api, repo_id, operations, **kwargs):
            files = {}
            for op in operations:
                source = op.path_or_fileobj
                files[op.path_in_repo] = Path(source).read_bytes() if isinstance(source, (str, Path)) else source
            self.commits.append({"repo_id": repo_id, "repo_type": kwargs.get("repo_type"), "files": files})
            return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/0"})()

        monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
        monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", create_commit)


def test_recipe_end_to_end_with_tensorboard_and_hub_push(data_dir, tmp_path, monkeypatch, capsys):
    hub = HubRecorder(monkeypatch)
    out = tmp_path / "run"
    summary = run_recipe(
        data_dir, out, "--report_to", "tensorboard", "--push_to_hub", "true", "--hub_model_id", "me/alfworld-tiny",
        "--push_pool_to_hub", "true", "--eval_sampled_episodes", "3", "--eval_temperature", "0.7",
        "--rl_train_games", "2", "--eval_train_episodes", "3",
    )  # fmt: skip
    printed = capsys.readouterr().out
    text = " ".join(printed.split())  # the summary's long lines are wrapped

    # evaluation before and after: first the train games RL plays (sampled), then both held-out splits, greedy and
    # sampled, in the summary table and the saved results
    own = "train: 2 RL games (sampled T=0.7 x3)"
    sampled = [f"{split} (sampled T=0.7 x3)" for split in ("valid_seen", "valid_unseen")]
    assert list(summary["results"]) == [own, "valid_seen", sampled[0], "valid_unseen", sampled[1]]
    for rates in summary["results"].values():
        assert set(rates) == {"before", "after"} and all(0.0 <= r <= 1.0 for r in rates.values())
    assert "before RL" in printed and "after RL" in printed and "valid_unseen" in printed
    for when in ("before", "after"):  # 2 games a split: 2 greedy episodes, 6 sampled ones; 2 RL games: 6 sampled
        assert re.search(rf"{when} RL, valid_seen: \d/2 games won", printed)
        assert re.search(rf"{when} RL, valid_unseen \(sampled T=0.7 x3\): \d/6 episodes won", printed)
        assert re.search(rf"{when} RL, train: 2 RL games \(sampled T=0.7 x3\): \d/6 episodes won", printed)
    assert json.loads((out / "alfworld_results.json").read_text())["results"] == summary["results"]

    # RL played 2 of the 4 train games, and only them: the pool heard of no other task (every task RL plays lands
    # in a bucket or the skip set; 2 steps of 2 groups over all 4 games would have played each of them)
    games = summary["games"]
    assert games == {
        "train": 4, "warm_start": True, "rl": 2, "rl_steps": 2, "rl_task_ids": games["rl_task_ids"],
        "train_evaluation": own, "held_out": ["valid_seen", "valid_unseen"],
    }  # fmt: skip
    from trl_exreplay.alfworld import alfworld_tasks
    from trl_exreplay.pool import ExperiencePool

    all_games = set(alfworld_tasks(str(data_dir / "json_2.1.1" / "train"))["task_id"])
    assert len(set(games["rl_task_ids"])) == 2 and set(games["rl_task_ids"]) < all_games
    pool = ExperiencePool.load(str(out / "exreplay_pool"))
    played = set(pool.skip_set) | {task for tasks in pool.buckets().values() for task in tasks}
    assert played == set(games["rl_task_ids"])
    # the table says what was trained on what, and what each row measures
    assert "warm start on 4 train games, then RL (2 steps) on 2 of the 4 train games" in text
    assert "train: the games RL trains on, sampled as RL plays them" in text
    assert "valid_seen, valid_unseen: held-out games RL never plays, greedy" in text
    # each rate with its 95% binomial interval and the episodes behind it; replay's share and the pool over the run
    from trl_exreplay.envs.evaluation import binomial_interval

    for split, rates in summary["results"].items():
        episodes = summary["intervals"][split]["episodes"]
        assert episodes == (6 if "sampled" in split else 2)
        for when in ("before", "after"):
            successes = round(rates[when] * episodes)
            assert summary["intervals"][split][when] == list(binomial_interval(successes, episodes))
            low, high = summary["intervals"][split][when]
            assert f"{100 * rates[when]:.1f}% [{100 * low:.0f}-{100 * high:.0f}]" in printed
    replay = summary["replay"]
    assert replay["steps"] == [1, 2] and len(replay["pool_tasks"]) == 2 == len(replay["pool_trajectories"])
    assert replay["pool_tasks"][-1] == summary["pool"]["pool_tasks"]
    assert 0.0 <= replay["rows_fraction_mean"] <= replay["rows_fraction_max"] <= 1.0
    assert "replayed rows:" in printed and "pool over the run (tasks/trajectories): step 1:" in text
    end = summary["pool"]
    assert (f"pool at the end: {end['pool_tasks']:.0f} tasks, {end['pool_trajectories']:.0f} trajectories; skip set "
            f"{end['skip_set']:.0f} (tasks whose fresh rollouts all won at their last play") in text  # fmt: skip
    # the tiny model's one sentence on held-out success, naming a config that exists
    assert "Held-out success needs a model that generalises" in text
    config = re.search(r"--config (\S+\.yaml)", text).group(1)
    assert (REPOSITORY / config).is_file() and "qwen2.5-1.5b" in config

    # saved: model, tokenizer, pool
    for name in ("config.json", "model.safetensors", "tokenizer.json", "exreplay_pool/state.json"):
        assert (out / name).exists(), name
    assert summary["pool"] == pool.stats()  # the trained pool, saved

    # tensorboard: the replay and environment metrics of every step
    logged = scalars(out)
    for tag in ("train/env/success_rate", "train/env/turns_mean", "train/replay/pool_trajectories",
                "train/replay/rows_fraction", "train/loss"):  # fmt: skip
        assert len(logged.get(tag, [])) == 2, (tag, sorted(logged))

    # the Hub: exactly the model files and the card; the pool as a dataset
    assert set(hub.repos) == {("me/alfworld-tiny", None), ("me/alfworld-tiny-pool", "dataset")}
    model_commit, pool_commit = hub.commits
    assert sorted(model_commit["files"]) == [
        "README.md", "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    assert {"training_args.bin", "alfworld_results.json", "exreplay_pool", "runs"} <= {p.name for p in out.iterdir()}
    card = model_commit["files"]["README.md"].decode()
    from trl_exreplay.alfworld import alfworld_version

    for text in ("trl", "grpo", "exreplay", "alfworld", alfworld_version(), "2510.02245", "2511.10395",
                 "2010.03768", "2402.03300", "replay_ratio", "valid_seen", "valid_unseen"):  # fmt: skip
        assert text in card, text
    for split, rates in summary["results"].items():  # the results table's row of each split, RL's games marked
        label = f"{split}, not held-out" if split == own else split
        assert f"| {label} | {100 * rates['before']:.1f}% | {100 * rates['after']:.1f}% |" in card
    assert pool_commit["repo_type"] == "dataset"
    expected = {str(p.relative_to(out / "exreplay_pool")) for p in (out / "exreplay_pool").rglob("*") if p.is_file()}
    assert set(pool_commit["files"]) == expected | {"README.md"}


def test_recipe_generates_games_then_reuses_them_and_the_warm_start(tmp_path, monkeypatch, capsys):
    """A first run generates the missing splits (train and valid_seen in the chosen rooms) and trains a warm start;
    a second run with the same settings generates nothing and trains no SFT step, and starts from the same policy."""
    from trl import SFTTrainer

    from trl_exreplay.alfworld import generate

    data = tmp_path / "data"
    settings = ["--num_train_games", "3", "--num_eval_games", "1", "--scenes", "309", "310", "--max_steps", "1",
                "--max_turns", "14", "--max_completion_length", "640", "--eval_train_episodes", "0"]  # fmt: skip
    first = run_recipe(data, tmp_path / "a", *settings)
    for split, rooms in (("train", {309, 310}), ("valid_seen", {309, 310}), ("valid_unseen", {10, 219, 308, 424})):
        trajs = list((data / "json_2.1.1" / split).rglob("traj_data.json"))
        assert len(trajs) == (3 if split == "train" else 1)
        assert {json.loads(t.read_text())["scene"]["scene_num"] for t in trajs} <= rooms
    capsys.readouterr()

    def refuse(*args, **kwargs):
        raise AssertionError("a cached run generated games or trained SFT again")

    monkeypatch.setattr(generate, "generate_games", refuse)
    monkeypatch.setattr(SFTTrainer, "train", refuse)
    second = run_recipe(data, tmp_path / "b", *settings)
    assert "warm start: reusing" in capsys.readouterr().out
    for split in ("valid_seen", "valid_unseen"):  # greedy, from the same warm start
        assert second["results"][split]["before"] == first["results"][split]["before"]
    (warm,) = (data / "warmstart").iterdir()  # one warm start, no temporary folders left behind
    assert (warm / "config.json").exists() and (warm / "tokenizer.json").exists()


QWEN_CONFIG = str(REPOSITORY / "recipes" / "configs" / "alfworld_qwen2.5-1.5b.yaml")
# What a CPU needs changed in the GPU config (precision, sizes, steps); everything else is the config's own: ReAct
# prompts, admissible actions shown, no warm start, vLLM when installed, gradient checkpointing, checkpoints with
# save_total_limit 2, tensorboard.
QWEN_ON_CPU = [
    "--bf16", "false", "--dtype", "float32", "--max_steps", "3", "--save_steps", "1",
    "--per_device_train_batch_size", "4", "--num_generations", "2", "--gradient_accumulation_steps", "1",
    "--max_turns", "3", "--max_tokens_per_turn", "8", "--max_completion_length", "256",
    "--num_train_games", "4", "--num_eval_games", "2", "--max_eval_games", "2", "--env_processes", "1",
]  # fmt: skip
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def pretrained_style_model(path: Path) -> Path:
    """A model folder as the Hub serves one, at a size this machine trains: a Qwen2 architecture and a byte-level BPE
    tokenizer (trained here on the ALFWorld vocabulary) with a ChatML chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from trl_exreplay.alfworld.warmstart import alfworld_vocabulary

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = trainers.BpeTrainer(
        vocab_size=800, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator([" ".join(alfworld_vocabulary()), "Think: Action: "], bpe)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_the_gpu_config_runs_a_hub_style_model_and_resumes_from_its_checkpoint(data_dir, tmp_path, capsys):
    """`alfworld_qwen2.5-1.5b.yaml` with `--model_name_or_path` a local model folder: the path a GPU user takes,
    short of the GPU and the download. It keeps the last 2 checkpoints, each with its pool, and
    `--resume_from_checkpoint true` continues from the newest one instead of starting over."""
    import importlib.util

    model = pretrained_style_model(tmp_path / "model")
    out = tmp_path / "run"
    recipe = load_recipe()
    common = ["--config", QWEN_CONFIG, *QWEN_ON_CPU, "--model_name_or_path", str(model), "--data_dir", str(data_dir),
              "--output_dir", str(out)]  # fmt: skip
    script_args, training_args, model_args = recipe.parse_args(common)
    assert script_args.prompt_style == "react" and script_args.show_admissible and not script_args.warm_start
    assert training_args.gradient_checkpointing and training_args.save_total_limit == 2

    summary = recipe.main(script_args, training_args, model_args)
    printed = capsys.readouterr().out
    if importlib.util.find_spec("vllm") is None:
        assert "vllm is not installed: episodes are generated with transformers" in printed
    assert summary["notes"] == [] and "Held-out success needs" not in printed  # the tiny model's note only
    assert summary["base_model"] == str(model) and set(summary["results"]) == {"valid_seen", "valid_unseen"}
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    for checkpoint in ("checkpoint-2", "checkpoint-3"):
        assert (out / checkpoint / "exreplay_pool" / "state.json").exists()
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    (first_events,) = out.rglob("events.out.tfevents.*")
    assert logged_steps(first_events, "train/loss") == [1, 2, 3]

    # Resume: one more step, from checkpoint-3; the new run's tensorboard file logs step 4 only.
    (out / "checkpoint-9").mkdir()  # as a run killed while saving leaves it: no trainer_state.json
    resumed = recipe.parse_args([*common, "--max_steps", "4", "--resume_from_checkpoint", "true"])
    assert resumed[1].resume_from_checkpoint == str(out / "checkpoint-3")  # the newest complete one
    (out / "checkpoint-9").rmdir()
    recipe.main(*resumed)
    (new_events,) = set(out.rglob("events.out.tfevents.*")) - {first_events}
    assert logged_steps(new_events, "train/loss") == [4]
    assert json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4


@pytest.mark.parametrize(
    "value, message",
    [
        (
            "true",
            "holds no complete checkpoint-\\* folder to resume from \\(this config saves none: set --save_strategy",
        ),
        ("nowhere", "allowed values are a checkpoint folder"),
    ],
)
def test_a_bad_resume_from_checkpoint_is_refused_before_any_work(tmp_path, value, message):
    with pytest.raises(ValueError, match=f"resume_from_checkpoint.*{message}"):
        load_recipe().parse_args(["--output_dir", str(tmp_path / "empty"), "--resume_from_checkpoint", value])


@pytest.mark.parametrize(
    "option, value",
    [
        ("--eval_sampled_episodes", "-1"),
        ("--eval_temperature", "0"),
        ("--eval_temperature", "-0.5"),
        ("--eval_train_episodes", "-1"),
        ("--rl_train_games", "0"),
    ],
)
def test_a_bad_sampled_evaluation_setting_is_refused(option, value):
    with pytest.raises(ValueError, match=f"{option[2:]}.*allowed values"):
        load_recipe().parse_args(["--output_dir", "unused", option, value])


def test_an_invalid_action_penalty_needs_a_success_threshold_every_win_reaches(tmp_path):
    recipe = load_recipe()
    penalised = ["--output_dir", "unused", "--invalid_action_penalty", "0.02", "--max_turns", "15"]
    with pytest.raises(
        ValueError, match=r"replay_success_threshold.*stays above 0.7.*allowed values are in \(0, 0.7\]"
    ):
        recipe.parse_args(penalised)  # the default threshold, 1.0, would count a win with a refused action as lost
    script_args, training_args, _ = recipe.parse_args([*penalised, "--replay_success_threshold", "0.5"])
    from trl_exreplay.alfworld.tasks import env_options

    assert env_options(script_args, training_args)["invalid_action_penalty"] == 0.02
    with pytest.raises(ValueError, match="invalid_action_penalty.*allowed values are finite numbers >= 0"):
        recipe.parse_args(["--output_dir", "unused", "--invalid_action_penalty", "-1"])
    with pytest.raises(ValueError, match=r"invalid_action_penalty.*max_turns=50.*allowed values are in \[0, 0.02\)"):
        recipe.parse_args(["--output_dir", "unused", "--invalid_action_penalty", "0.02", "--max_turns", "50"])
    assert (
        recipe.parse_args([*penalised, "--replay_success_threshold", "0.7"])[1].replay_success_threshold == 0.7
    )  # the bound
    with pytest.raises(ValueError, match="replay_success_threshold"):
        recipe.parse_args([*penalised, "--replay_success_threshold", "0"])
    # main() checks too, before any work: without its check it would stop at once on the missing games instead
    no_games = ["--data_dir", str(tmp_path / "no_games"), "--generate_missing_games", "false"]
    script_args, training_args, model_args = recipe.parse_args([*penalised[:2], *no_games])  # no penalty yet
    assert training_args.replay_success_threshold == 1.0
    script_args.invalid_action_penalty = 0.02  # set after parsing
    with pytest.raises(ValueError, match="replay_success_threshold"):
        recipe.main(script_args, training_args, model_args)


def test_rl_plays_at_least_the_games_one_generation_batch_draws():
    """The default's 4 RL games fill a generation batch of one process (16 rows / 4 generations); two processes draw
    8 distinct games a batch, and TRL's sampler yields no batch from 4, so RL would not run: it plays 8 there."""
    from datasets import Dataset
    from trl.trainer.grpo_trainer import RepeatSampler

    recipe = load_recipe()
    _, training_args, _ = recipe.parse_args([])
    games = Dataset.from_dict({"task_id": [f"game-{i:03d}" for i in range(200)]})
    G = training_args.num_generations

    def batches(rows, generation_batch_size):
        return len(RepeatSampler(rows, mini_repeat_count=G, batch_size=generation_batch_size // G, seed=0))

    one = recipe.rl_games(games, 4, training_args)  # one process: the default, unchanged
    assert one["task_id"] == games.shuffle(seed=training_args.seed).select(range(4))["task_id"]
    assert batches(one, training_args.generation_batch_size) > 0
    training_args.generation_batch_size *= 2  # two processes
    assert batches(one, training_args.generation_batch_size) == 0  # the 4 games alone: no batch at all
    two = recipe.rl_games(games, 4, training_args)
    assert len(two) == 8 and two["task_id"][:4] == one["task_id"]  # the same draw, longer
    assert batches(two, training_args.generation_batch_size) > 0
    assert recipe.rl_games(games, None, training_args) is games and recipe.rl_games(games, 500, training_args) is games


def test_default_config_only_without_a_config_or_a_model():
    recipe = load_recipe()
    script_args, training_args, _ = recipe.parse_args(["--max_steps", "3"])
    assert script_args.scenes == [309, 310, 311] and training_args.use_cpu and training_args.max_steps == 3
    assert script_args.target_objects == ["Book"] and script_args.task_types == ["pick_and_place_simple"]
    assert not script_args.verify_train_games  # the expert plays every train game anyway
    # RL plays a few train games, and the summary measures them: where the tiny model's learning shows
    assert script_args.rl_train_games < script_args.num_train_games and script_args.eval_train_episodes > 0
    model = ["--model_name_or_path", "Qwen/Qwen2.5-0.5B-Instruct", "--bf16", "false"]  # bf16: no GPU here
    script_args, training_args, model_args = recipe.parse_args(model)
    assert script_args.scenes is None and not training_args.use_cpu and training_args.max_steps == -1
    assert script_args.target_objects is None
    with pytest.raises(ValueError, match=r"Invalid value \['Bookk'\] for `target_objects`"):  # before any work
        recipe.parse_args(["--target_objects", "book", "Bookk"])
    assert recipe.parse_args(["--target_objects", "book", "cd"])[0].target_objects == ["Book", "CD"]
    assert model_args.model_name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"


def test_recipe_lora_with_trackio_and_a_merged_upload(data_dir, tmp_path, monkeypatch):
    from trackio.sqlite_storage import SQLiteStorage

    hub = HubRecorder(monkeypatch)
    out, project = tmp_path / "lora", f"exreplay-test-{tmp_path.name}"
    summary = run_recipe(
        data_dir, out, "--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8",
        "--lora_target_modules", "q_proj", "v_proj", "--report_to", "trackio", "--project", project,
        "--run_name", "lora", "--eval_splits", "valid_seen", "--eval_train_episodes", "0", "--push_to_hub", "true",
        "--hub_model_id", "me/lora",
    )  # fmt: skip
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    assert not (out / "model.safetensors").exists()  # the adapter only; its base is the warm start
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert Path(adapter["base_model_name_or_path"]).parent.name == "warmstart"
    assert "valid_seen" in summary["results"]

    # The adapter's base is a local folder, so the Hub gets the merged model, which loads alone.
    (commit,) = hub.commits
    assert "model.safetensors" in commit["files"] and not any(p.startswith("adapter") for p in commit["files"])
    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    adapted = AutoPeftModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, atol=1e-5, rtol=1e-5)

    logs = SQLiteStorage.get_logs(project=project, run="lora")  # trackio's local store
    SQLiteStorage.get_project_db_path(project).unlink()
    keys = {key for entry in logs for key in entry}
    assert {"train/env/success_rate", "train/replay/pool_trajectories"} <= keys, sorted(keys)
    assert len([entry for entry in logs if "train/env/success_rate" in entry]) == 2


def launch(config: str, data_dir: Path, output_dir: Path) -> subprocess.CompletedProcess:
    return accelerate_launch(
        config, RECIPE, *SMALL, "--eval_train_episodes", "1", "--data_dir", data_dir, "--output_dir", output_dir
    )


@pytest.mark.slow
# One process: the end-to-end tests above; DDP and ZeRO-2's data and checkpoint paths: tests/distributed. What only the
# recipe does over ranks (its games and evaluations split between them and gathered) runs under the hardest config.
@pytest.mark.parametrize("config", ["zero3_cpu"])
def test_recipe_under_a_multi_process_accelerate_config(data_dir, tmp_path, config):
    out = tmp_path / config
    result = launch(f"recipes/accelerate/{config}.yaml", data_dir, out)
    summary = json.loads((out / "alfworld_results.json").read_text())
    # the games RL plays (one sampled episode each, split between the ranks and gathered), then the held-out splits
    own = summary["games"]["train_evaluation"]
    assert list(summary["results"]) == [own, "valid_seen", "valid_unseen"]
    assert own == f"train: {summary['games']['rl']} RL games (sampled T=0.5 x1)"
    assert summary["intervals"][own]["episodes"] == summary["games"]["rl"]
    assert (out / "model.safetensors").exists() and (out / "exreplay_pool" / "state.json").exists()
    assert result.stdout.count("after RL, valid_seen") == 1  # printed by the main process only


def test_target_objects_filter_loaded_games(tmp_path):
    """Games already in data_dir (official data, or generated earlier) are loaded only for the wanted objects."""
    from trl_exreplay.alfworld import INSTRUCTIONS, alfworld_tasks, generate_games
    from trl_exreplay.alfworld.expert import task_params
    from trl_exreplay.alfworld.tasks import load_tasks

    recipe = load_recipe()
    generate_games(tmp_path, "train", 8, 0, ["pick_and_place_simple"], verify=False, scenes=[309, 310])
    objects = sorted(task_params(f)["object"] for f in alfworld_tasks(tmp_path / "json_2.1.1" / "train")["game_file"])
    wanted = objects[0]
    script_args, _, _ = recipe.parse_args(["--data_dir", str(tmp_path), "--target_objects", wanted])
    tasks = load_tasks(script_args, "train", INSTRUCTIONS)
    assert len(tasks) == objects.count(wanted) < len(objects)
    assert {task_params(f)["object"] for f in tasks["game_file"]} == {wanted}


def test_a_warm_start_the_expert_never_wins_is_refused_clearly(data_dir, tmp_path):
    """No expert episode to learn from: a clear error on every rank (an empty SFT dataset once failed inside
    `datasets`' loader with an IndexError)."""
    recipe = load_recipe()
    argv = [*SMALL, "--max_turns", "1", "--data_dir", str(data_dir), "--output_dir", str(tmp_path / "out")]
    with pytest.raises(ValueError, match="the expert won no train game within max_turns=1"):
        recipe.main(*recipe.parse_args(argv))


def test_recipe_runs_its_environments_on_ray_with_the_same_figures(data_dir, tmp_path, monkeypatch):
    """`--env_backend ray`: the recipe starts a local Ray instance, its episodes are played by Ray actors, and it logs
    the same figures (turns, refused actions, rewards: all but the times) and evaluates the same as with worker
    processes. (This 2-step tiny run wins nothing, so its weights do not move; tests/integration/test_multiturn.py trains through
    both pools where the policy learns, and compares weights.)"""
    ray = pytest.importorskip("ray")
    from trl_exreplay.envs.ray_pool import RayEnvPool

    requests = []
    exchange = RayEnvPool._exchange
    monkeypatch.setattr(RayEnvPool, "_exchange", lambda self, *a: requests.append(a[1][0]) or exchange(self, *a))
    runs = {}
    try:
        for backend in ("processes", "ray"):
            out = tmp_path / backend
            summary = run_recipe(data_dir, out, "--env_backend", backend, "--env_processes", "2",
                                 "--env_ray_cpus_per_worker", "0.5", "--report_to", "tensorboard",
                                 "--eval_train_episodes", "0")  # fmt: skip
            logged = {tag: values for tag, values in scalars(out).items() if "time" not in tag and "second" not in tag}
            runs[backend] = (summary["results"], logged)
            if backend == "processes":
                assert requests == []
        assert ray.is_initialized()  # the recipe started a local instance
    finally:
        ray.shutdown()
    assert requests.count("call") > 50  # every reset and step of training and evaluation went to the actors
    assert runs["ray"][0] == runs["processes"][0]
    assert {"train/env/turns_mean", "train/env/invalid_actions", "train/reward"} <= set(runs["ray"][1])
    assert runs["ray"][1] == runs["processes"][1]
