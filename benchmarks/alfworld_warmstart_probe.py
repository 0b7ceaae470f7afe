"""What a tiny model learns from the warm start: teacher-forced accuracy of each kind of expert action on held-out games.

A greedy episode wins only if every turn is right, so closed-loop evaluation (minutes per variant on CPU) says little
about *why* a warm start fails. This probe trains the tiny model of `recipes/alfworld.py` on the searching expert's
won episodes (the same SFT rows as the recipe: `warmstart.sft_dataset`) and reports, on held-out expert episodes, the
fraction of turns whose every token the model predicts right, per kind of action:

* `go_first` / `go_search` / `go_back`: the first move, a move while searching, a move after taking the object
  (to the lamp or the destination: needs memory of where it was seen);
* `take`: spot the goal's object in what is seen and copy its name, its number and the receptacle; `take_tokK` is
  the accuracy of the K-th token of those turns;
* `open`, `use`, `put`; `episodes_all_turns`: held-out episodes with every turn right (an upper bound on greedy
  success when the model follows the expert's path).

Games are generated (unverified: the expert plays each one on the real engine) and episodes cached under `--work`.
Each `--variant` is `name:key=value,...` over: rows (first N train rows used), steps, lr, hidden, layers, heads, batch,
seed, entity (1: the recipe's `tiny_entity_tokens`, one token per object name such as "book 2"; the `take_tokK`
figures then count those tokens). The training loop is plain PyTorch (AdamW, 10 warm-up steps, cosine decay: the
recipe's SFT schedule) so a sweep runs on a GPU as well as on CPU.

    OMP_NUM_THREADS=2 python benchmarks/alfworld_warmstart_probe.py --train-games 300 --heldout-games 60 \
        --variant base:steps=300 --variant long:steps=450
    python benchmarks/alfworld_warmstart_probe.py --target-objects AlarmClock Book CD --variant base:steps=300
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import platform
import random
import time
from dataclasses import asdict
from importlib.metadata import version

import torch

TASK_TYPES = ["pick_and_place_simple", "look_at_obj_in_light"]
DEFAULTS = {
    "rows": 10**9,
    "steps": 300,
    "lr": 3e-3,
    "hidden": 128,
    "layers": 4,
    "heads": 4,
    "batch": 8,
    "seed": 0,
    "entity": 0,
}


def expert_rows(work: str, split: str, num_games: int, seed: int, args, tokenizer) -> list[dict]:
    """SFT rows of the expert's won episodes of `num_games` generated games, each with the kind of every turn."""
    from trl_exreplay.alfworld import INSTRUCTIONS, alfworld_tasks, generate_games
    from trl_exreplay.alfworld.expert import ExpertEpisode
    from trl_exreplay.alfworld.warmstart import expert_episodes, sft_dataset
    from trl_exreplay.pool.store import write_atomic

    what = "_".join([*(args.target_objects or ["any"]), *args.task_types])
    cache = os.path.join(work, f"{split}-{num_games}-{seed}-{what}.json")
    if not os.path.exists(cache):
        root = os.path.join(work, os.path.basename(cache)[:-5])
        generate_games(root, split, num_games, seed, args.task_types, verify=False, workers=args.workers,
                       scenes=args.scenes, target_objects=args.target_objects)  # fmt: skip
        tasks = alfworld_tasks(os.path.join(root, "json_2.1.1", split), system_prompt=INSTRUCTIONS)
        episodes = expert_episodes(tasks, workers=args.workers, progress=True, max_steps=args.max_turns,
                                   show_admissible=False, restate_goal=True)  # fmt: skip

        def write(tmp: str) -> None:
            with open(tmp, "w") as f:
                json.dump([asdict(e) for e in episodes], f)

        write_atomic(cache, write)
    with open(cache) as f:
        episodes = [ExpertEpisode(**e) for e in json.load(f)]
    rows = []
    for episode in episodes:
        for row in sft_dataset([episode], tokenizer, max_completion_length=1024, max_turns=args.max_turns,
                               max_tokens_per_turn=12):  # fmt: skip
            kinds, took = [], False
            for turn, action in enumerate(episode.actions):
                kind = action.split(" ", 1)[0]
                if kind == "go":
                    kind = "go_first" if turn == 0 else "go_back" if took else "go_search"
                took = took or kind == "take"
                kinds.append(kind)
            rows.append({"input_ids": row["input_ids"], "assistant_masks": row["assistant_masks"], "kinds": kinds})
    return rows


def turn_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


@torch.no_grad()
def probe(model, rows: list[dict], device) -> dict[str, float]:
    model.eval()
    right, total, episodes_right = collections.Counter(), collections.Counter(), 0
    for row in rows:
        ids = torch.tensor([row["input_ids"]], device=device)
        predicted = model(ids).logits[0].argmax(-1)
        every_turn = True
        for (start, end), kind in zip(turn_spans(row["assistant_masks"]), row["kinds"]):
            hits = (predicted[start - 1 : end - 1] == ids[0, start:end]).tolist()
            total[kind] += 1
            right[kind] += all(hits)
            every_turn &= all(hits)
            if kind == "take":
                for k, hit in enumerate(hits):
                    total[f"take_tok{k}"] += 1
                    right[f"take_tok{k}"] += hit
        episodes_right += every_turn
    model.train()
    result = {kind: round(right[kind] / total[kind], 3) for kind in sorted(total)}
    result["episodes_all_turns"] = round(episodes_right / max(1, len(rows)), 3)
    return result


def train(variant: dict, rows: list[dict], heldout: list[dict], tokenizer, device) -> dict:
    from trl_exreplay.demo.tiny import build_tiny_model

    rows = rows[: variant["rows"]]
    model = build_tiny_model(tokenizer, hidden_size=variant["hidden"], num_layers=variant["layers"],
                             num_heads=variant["heads"], seed=variant["seed"],
                             max_position_embeddings=1280).to(device)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=variant["lr"], weight_decay=0.0)
    steps = int(variant["steps"])
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    rng, pad, step, started = random.Random(variant["seed"]), tokenizer.pad_token_id, 0, time.time()
    while step < steps:
        order = list(range(len(rows)))
        rng.shuffle(order)
        for i in range(0, len(order), variant["batch"]):
            if step == steps:
                break
            batch = [rows[j] for j in order[i : i + variant["batch"]]]
            width = max(len(r["input_ids"]) for r in batch)
            ids = torch.full((len(batch), width), pad)
            labels = torch.full((len(batch), width), -100)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for k, r in enumerate(batch):
                x, n = torch.tensor(r["input_ids"]), len(r["input_ids"])
                ids[k, :n], attention[k, :n] = x, 1
                labels[k, :n] = torch.where(torch.tensor(r["assistant_masks"]).bool(), x, -100)
            loss = model(input_ids=ids.to(device), attention_mask=attention.to(device), labels=labels.to(device)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            step += 1
    return {"variant": variant, "train_rows": len(rows), "seconds": round(time.time() - started, 1),
            "final_loss": round(loss.item(), 4), "heldout": probe(model, heldout, device),
            "train": probe(model, rows[:60], device), "model": model}  # fmt: skip


def parse_variant(text: str) -> dict:
    name, _, settings = text.partition(":")
    variant = {**DEFAULTS, "name": name}
    for item in filter(None, settings.split(",")):
        key, _, value = item.partition("=")
        if key not in DEFAULTS:
            raise ValueError(f"Invalid key {key!r} in --variant {text!r}: allowed keys are {', '.join(DEFAULTS)}.")
        variant[key] = type(DEFAULTS[key])(float(value)) if key != "lr" else float(value)
    return variant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="data/warmstart_probe", help="cache of games and expert episodes")
    parser.add_argument("--train-games", type=int, default=300)
    parser.add_argument("--heldout-games", type=int, default=60, help="valid_seen games (other objects' places)")
    parser.add_argument("--scenes", type=int, nargs="+", default=[309, 310, 311])
    parser.add_argument("--target-objects", nargs="+", default=None)
    parser.add_argument("--task-types", nargs="+", default=TASK_TYPES)
    parser.add_argument("--save-model", default=None, help="save the last variant's model here (for greedy play)")
    parser.add_argument("--max-turns", type=int, default=15)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--variant", action="append", default=None, help="name:key=value,... (repeatable)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    from trl_exreplay.alfworld.warmstart import alfworld_tokenizer

    os.makedirs(args.work, exist_ok=True)
    variants = [parse_variant(text) for text in args.variant or ["base:"]]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = {}  # entity -> (tokenizer, train rows, held-out rows), from the same cached expert episodes
    for entity in sorted({variant["entity"] for variant in variants}):
        tokenizer = alfworld_tokenizer(entity_tokens=bool(entity))
        rows = expert_rows(args.work, "train", args.train_games, 0, args, tokenizer)
        heldout = expert_rows(args.work, "valid_seen", args.heldout_games, 1, args, tokenizer)
        data[entity] = tokenizer, rows, heldout
        kinds = collections.Counter(k for r in heldout for k in r["kinds"])
        print(f"train rows {len(rows)}, held-out rows {len(heldout)} (turns: {dict(kinds)}), entity tokens "
              f"{bool(entity)}, device {device}")  # fmt: skip
    results = []
    for variant in variants:
        tokenizer, rows, heldout = data[variant["entity"]]
        result = train(variant, rows, heldout, tokenizer, device)
        model = result.pop("model")
        if args.save_model:
            model.save_pretrained(args.save_model)
            tokenizer.save_pretrained(args.save_model)
        results.append(result)
        shown = {k: v for k, v in result["heldout"].items() if not k.startswith("take_tok")}
        print(f"{variant['name']}: {result['train_rows']} rows, {variant['steps']} steps, {result['seconds']} s; "
              f"held-out {shown}; take tokens {[v for k, v in result['heldout'].items() if k.startswith('take_tok')]};"
              f" train all-turns {result['train']['episodes_all_turns']}", flush=True)  # fmt: skip
    if args.json:
        machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "device": str(device),
                   "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None}  # fmt: skip
        versions = {p: version(p) for p in ("torch", "transformers", "trl", "alfworld")}
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "versions": versions, "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
