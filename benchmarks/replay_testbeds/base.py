"""What every testbed of `benchmarks/replay_vs_grpo.py` provides, and the helpers they share."""

from __future__ import annotations

from typing import Any


class Testbed:
    """A learning problem on which replay and plain GRPO are compared.

    A testbed builds the initial model of a seed (random init of the tiny model, then its warm start), the training
    data, the reward functions or the environment, and measures success on held-out problems that training never sees,
    with the same sampling draws whatever the model (`seed` of the draws fixed per call).
    """

    name: str = ""
    summary: str = ""
    vocabulary: list[str] = []
    model_kwargs: dict[str, Any] = {}
    training: dict[str, Any] = {}  # ExReplayGRPOConfig fields shared by every method of the testbed
    eval_every: int = 10  # optimizer steps between held-out measurements
    measure: str = "held-out success (sampled)"  # what `heldout_success` measures, as plots and tables say it
    # Whether TRL's own GRPOTrainer can train it (single-turn reward functions); `text_env_factory` is this library's API.
    trl_comparable: bool = True
    # Fixed held-out success levels the report counts the fresh rollouts to, per seed (besides the same seed's
    # baseline final); none where no level is meaningful.
    target_levels: tuple[float, ...] = ()
    # What the replay methods run over, where the testbed's own training fields set replay settings (e.g. a recipe's
    # YAML): tables and plots name those methods by it. None: the library's defaults, under each method's preset.
    replay_settings: str | None = None

    def build(self, seed: int):
        """The initial (model, tokenizer) of `seed`: identical for every method."""
        from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer(self.vocabulary)
        model = build_tiny_model(tokenizer, seed=seed, **self.model_kwargs)
        if self.training.get("use_cpu") is False:  # `--set use_cpu=false`: the warm start on the GPU too
            model.to("cuda")
        self.warm_start(model, tokenizer, seed)
        return model, tokenizer

    def warm_start(self, model, tokenizer, seed: int) -> None:
        """Supervised warm start in place (none by default)."""

    def train_dataset(self, repeats: int):
        raise NotImplementedError

    def reward_funcs(self):
        return None

    def text_env_factory(self):
        return None

    def trainer_kwargs(self) -> dict[str, Any]:
        """Extra `ExReplayGRPOConfig` fields for this testbed (multi-turn limits, ...)."""
        return {}

    # Experience-guided presets that take their experience from the testbed (`experience_from_testbed`): the config
    # fields they add (e.g. a template the tiny model's vocabulary can spell) and the provider (e.g. with the
    # environment's own summariser hook). The defaults: the library's.
    experience_settings: dict[str, Any] = {}

    def experience_provider(self):
        return None

    def heldout_success(self, model, tokenizer, seed: int = 0) -> float:
        """Success on the held-out problems; a testbed may also fill `last_detail` ({part: rate}, e.g. per split)."""
        raise NotImplementedError

    last_detail: dict[str, float] = {}

    def close(self) -> None:
        """Release what the testbed holds (environment processes)."""


def chat_prompt(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _encode_prompt(tokenizer, prompt) -> list[int]:
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)


def sampled_answers(model, tokenizer, prompts, max_new_tokens: int, seed: int = 0, batch_size: int = 128) -> list[str]:
    """One answer per prompt, sampled at temperature 1 with draws fixed by `seed`; the caller's RNG is untouched."""
    import torch

    from trl_exreplay.envs.rollout import generate_batch

    was_training = model.training
    model.eval()
    answers = []
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            for start in range(0, len(prompts), batch_size):
                contexts = [_encode_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
                completions = generate_batch(
                    model, contexts, max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                    eos_token_ids={tokenizer.eos_token_id}, eos_token_id=tokenizer.eos_token_id,
                    do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                )  # fmt: skip
                answers += tokenizer.batch_decode(completions, skip_special_tokens=True)
    finally:
        model.train(was_training)
    return answers


def supervised_warm_start(model, tokenizer, pairs, steps: int, seed: int, lr: float = 3e-3, batch_size: int = 32):
    """A few steps of teacher-forced cross-entropy on `(prompt, answer)` pairs (loss on the answer and its eos only)."""
    import torch

    rows = []
    for prompt, answer in pairs:
        context = _encode_prompt(tokenizer, prompt)
        target = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((context + target, [-100] * len(context) + target))
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        batch = [rows[i] for i in torch.randint(len(rows), (batch_size,), generator=generator).tolist()]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        attention_mask = (torch.arange(width)[None, :] < torch.tensor([len(ids) for ids, _ in batch])[:, None]).long()
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        loss = model(**{name: tensor.to(model.device) for name, tensor in inputs.items()}).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)
