"""Loading and saving the models of a run outside the trainer: whole on one rank (also under ZeRO-3), from full
weights or a PEFT adapter, a merged adapter, and atomic saves."""

from __future__ import annotations

import contextlib
import os
import shutil


def model_init_kwargs(model_args) -> dict:
    import torch

    kwargs = {"revision": model_args.model_revision, "attn_implementation": model_args.attn_implementation}
    if model_args.dtype not in (None, "auto"):
        kwargs["dtype"] = getattr(torch, model_args.dtype)
    return {k: v for k, v in kwargs.items() if v is not None}


def save_atomically(path: str, model, tokenizer) -> None:
    """`model` and `tokenizer` saved to the folder `path`, whole or not at all (`write_atomic`)."""
    from ..pool.store import write_atomic  # imported here: loading this module stays free of `datasets`

    def save(tmp: str) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    write_atomic(path, save)


# transformers keeps only a weak reference to the DeepSpeed config it registers: the one re-registered after a whole
# load lives here (one at a time).
_REREGISTERED: list = []


@contextlib.contextmanager
def whole_model_loading():
    """Load models whole on this rank. A ZeRO-3 trainer registers its DeepSpeed config globally, and transformers would
    then partition every model it loads with collective calls, which hang when one rank loads alone. The registration
    is lifted for the block and made again after it, through transformers' public functions."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, deepspeed_config, unset_hf_deepspeed_config

    config = deepspeed_config()  # the registered config (its "auto" values filled), or None
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if config is not None:
            _REREGISTERED[:] = [HfDeepSpeedConfig(config)]  # registers itself


def merge_adapter(path: str, model_args, into: str | None = None) -> str:
    """Merge the PEFT adapter saved in `path` into its base model; write the whole model (and the tokenizer) to
    `into` (default: replace `path`). Returns the folder written."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    into = into or path
    with whole_model_loading():
        merged = AutoPeftModelForCausalLM.from_pretrained(path, **model_init_kwargs(model_args)).merge_and_unload()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not os.path.isdir(into):
        save_atomically(into, merged, tokenizer)
        return into
    # `into` is a folder already (the adapter's own): the merged model is saved whole beside it, then takes its place
    staging = f"{into}.merging-{os.getpid()}"
    save_atomically(staging, merged, tokenizer)
    shutil.rmtree(into)
    os.replace(staging, into)
    return into


def load_policy(path: str, model_args, auto_model=None):
    """The model in `path` (full weights, or a PEFT adapter on its base model), whole on this rank: evaluation runs
    each rank's share of the games with plain `generate`, whatever the training's distribution."""
    with whole_model_loading():
        if os.path.isfile(os.path.join(path, "adapter_config.json")):
            from peft import AutoPeftModelForCausalLM

            return AutoPeftModelForCausalLM.from_pretrained(path, **model_init_kwargs(model_args))
        if auto_model is None:
            from transformers import AutoModelForCausalLM as auto_model
        return auto_model.from_pretrained(path, **model_init_kwargs(model_args))
