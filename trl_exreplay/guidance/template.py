"""Experience in a prompt: `insert_experience` puts the template, filled with the retrieved text, before the first
user message's content (as AgentEvolver's `ExperienceWorker.manage_rollout_context` prepends it); `strip_experience`
takes it out again (its `manage_training_context`, anchored where the insertion put it); `fit_experience` cuts the
experience so that the prompt it makes keeps within a number of tokens (the model's context less the completion's).

The trainer never trains on a stripped string: a discarded row's training prompt is the row's own prompt, which the
guided copy was made from, so it tokenizes exactly as if the experience had never been inserted (tests check that
`strip_experience(insert_experience(p))` is `p`, ids for ids).

Example:

```python
from trl_exreplay.guidance.template import format_experience, insert_experience, strip_experience

template = "Experience:<EXP>{}</EXP>\\n"
prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Put a mug in the sink."}]
guided = insert_experience(prompt, format_experience(template, ["go to sink 1", "put mug 1 in sink 1"]))
assert guided[1]["content"] == "Experience:<EXP>go to sink 1\\nput mug 1 in sink 1</EXP>\\nPut a mug in the sink."
assert strip_experience(guided, template) == prompt and prompt[1]["content"] == "Put a mug in the sink."
```
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

from ..untrusted_text import token_prefix


def format_experience(template: str, contents: list[str]) -> str:
    """The template with the retrieved records (joined by newlines) in its one `{}`; not `str.format`, so a template
    may hold other braces literally."""
    before, after = template.split("{}", 1)
    return before + "\n".join(contents) + after


def fit_experience(
    text: str, template: str, render: Callable[[str], list[int]], room: int, tokenizer, ids: list[int] | None = None
) -> tuple[str, list[int]] | None:
    """`text` (`template` filled by `format_experience`) and the prompt `render(text)` it makes, with at most `room`
    tokens: `text` as it is when its prompt fits (`ids`: that prompt, when the caller has it), else its experience cut
    by `token_prefix`, by as many tokens as the prompt has too many, until it fits. None when not one token of
    experience fits (nor, then, the prompt without it)."""
    ids = render(text) if ids is None else ids
    if len(ids) <= room:
        return text, ids
    before, after = template.split("{}", 1)
    experience = text[len(before) : len(text) - len(after)]
    keep = len(tokenizer(experience, add_special_tokens=False)["input_ids"])
    while True:
        keep -= len(ids) - room  # at least 1: the prompt has too many
        if keep <= 0:
            return None
        experience, _ = token_prefix(experience, tokenizer, keep)
        text = before + experience + after
        ids = render(text)
        if len(ids) <= room:  # a cut piece may tokenize otherwise in the prompt: then cut again
            return text, ids


def _first_user(messages: list[dict]) -> int:
    for i, message in enumerate(messages):
        if message.get("role") == "user":
            if not isinstance(message.get("content"), str):
                raise ValueError("Experience-guided rollouts need text user messages (content as a string).")
            return i
    raise ValueError("Experience-guided rollouts need a user message in the prompt to put the experience in.")


def insert_experience(prompt, text: str):
    """A copy of `prompt` (a list of chat messages, or a plain string) with `text` before its first user message's
    content (before the whole string, for a plain prompt). The original is not modified."""
    if isinstance(prompt, str):
        return text + prompt
    guided = copy.deepcopy(list(prompt))
    i = _first_user(guided)
    guided[i]["content"] = text + guided[i]["content"]
    return guided


def strip_experience(prompt, template: str):
    """`prompt` without the experience `insert_experience` put at the start of its first user message (unchanged when
    it holds none). The template's `{}` matches any text, shortest first, as the regular expression of AgentEvolver's
    `ExperienceWorker.manage_training_context` (`agentevolver/module/exp_manager/exp_manager.py`) does."""
    pattern = re.compile(r"\A" + re.escape(template).replace(r"\{\}", "(.*?)"), flags=re.DOTALL)
    if isinstance(prompt, str):
        return pattern.sub("", prompt, count=1)
    stripped = copy.deepcopy(list(prompt))
    i = _first_user(stripped)
    stripped[i]["content"] = pattern.sub("", stripped[i]["content"], count=1)
    return stripped


def task_text(prompt) -> str:
    """The text retrieval matches for a prompt: its first user message's content (the whole string, if plain)."""
    if isinstance(prompt, str):
        return prompt
    return prompt[_first_user(prompt)]["content"]
