"""The real ALFWorld text engine: textworld's PDDL environment wrapped as `AlfredTWEnv.init_env` wraps it.

`make_env()` builds `AlfredInfos(AlfredDemangler(PddlEnv(infos)))` with the infos AlfredTWEnv requests
(`won`, `admissible_commands`, `extras=["gamefile"]`); `acquire_env()` / `release_env()` reuse engines within a
process. `play_walkthrough()` plays a game's stored walkthrough on it and reports whether it wins (and whether the
game was already won after reset).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_ARGV_LOCK = threading.Lock()
_IMPORT_HINT = "the ALFWorld environment needs `pip install alfworld==0.4.2 'textworld[pddl]==1.7.0'`"
# What `make_env` imports: worth preloading in a fork server (`EnvProcessPool(preload=...)`, `map_in_pool`).
ENGINE_MODULES = ("textworld", "fast_downward", "alfworld.agents.environment.alfred_tw_env")
# textworld parses games with one module-level parser that is not thread-safe, so the engines of a process take turns
# (the engine is pure Python: threads would not run it in parallel anyway; `EnvProcessPool` does).
_ENGINE_LOCK = threading.RLock()


def make_env():
    """A fresh engine instance. It loads its own copy of fast-downward's library (~0.3 s), which is never unloaded:
    prefer `acquire_env()` / `release_env()`, which reuse the engines of the process."""
    try:
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
        from textworld.envs import PddlEnv
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise ImportError(_IMPORT_HINT) from e
    install_game_cache(0)  # at least: translations leave sys.argv alone
    install_text_parse_cache()
    infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
    return AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False))


class _TranslationMemo:
    """fast-downward's PDDL->SAS translation, memoized on its inputs (last `max_entries` kept, thread-safe).

    textworld translates the same (domain, problem) pair twice on `load` and twice again on `reset`; the result
    only depends on the two texts and textworld only reads it, so every later `load` or `reset` of a cached game
    skips the translation, most of a reset's time (`benchmarks/alfworld_env_throughput.py` measures both).
    """

    def __init__(self, original, max_entries: int):
        self.original, self.max_entries = original, max_entries
        self.entries: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self.lock = threading.Lock()

    def __call__(self, domain, problem, verbose=False, optimize=False):
        key = (domain, problem, bool(optimize))
        with self.lock:
            if key in self.entries:
                self.entries.move_to_end(key)
                return self.entries[key]
        with _ARGV_LOCK:  # fast-downward's translator overwrites sys.argv: give the caller's back
            argv = list(sys.argv)
            try:
                result = self.original(domain, problem, verbose=verbose, optimize=optimize)
            finally:
                sys.argv[:] = argv
        with self.lock:
            if self.max_entries > 0:
                self.entries[key] = result
            while len(self.entries) > self.max_entries:
                self.entries.popitem(last=False)
        return result


def install_game_cache(max_games: int) -> None:
    """Keep the translations of the last `max_games` games loaded in this process (for good: every engine of the
    process shares them); 0 keeps none. Calling it again only raises the bound. Either way translations no longer
    overwrite `sys.argv`, which fast-downward's translator does (to `['translate.py', 'domain', 'task']`)."""
    import fast_downward

    current = fast_downward.pddl2sas
    if isinstance(current, _TranslationMemo):
        current.max_entries = max(current.max_entries, 2 * max_games)
    else:
        fast_downward.pddl2sas = _TranslationMemo(current, 2 * max(0, max_games))  # two translations per game


class _TextParseMemo:
    """textworld's parser of its text grammar, memoized on what it parses (last `max_entries` texts kept).

    On every step textworld re-parses, with TatSu, the template of every admissible command and the logic queries in
    them (a few distinct strings) to phrase the commands, and on every load the domain and every rule of the grammar
    (the same texts in every ALFWorld game): two thirds of a step's time. The parse tree depends only on the text and
    the arguments, and textworld only reads it (its converters build fresh objects from the tree), so one tree per
    text serves every later call. Callers hold `_ENGINE_LOCK` (textworld's parsers are module-level objects), so the
    memo needs no lock of its own.
    """

    def __init__(self, parser, max_entries: int = 4096):
        self.parser = parser
        self._cached = functools.lru_cache(maxsize=max_entries)(self._parse)

    def _parse(self, text, args, kwargs):
        return self.parser.parse(text, *args, **dict(kwargs))

    @property
    def hits(self) -> int:
        return self._cached.cache_info().hits

    def parse(self, text, *args, **kwargs):
        key = (text, args, tuple(sorted(kwargs.items())))
        try:
            hash(key)
        except TypeError:  # an unhashable argument: nothing to key on
            return self.parser.parse(text, *args, **kwargs)
        if kwargs.get("trace"):  # tracing prints the parse: do it
            return self.parser.parse(text, *args, **kwargs)
        return self._cached(*key)

    def __getattr__(self, name):  # anything else textworld may use the parser for
        return getattr(self.parser, name)


def install_text_parse_cache() -> None:
    """Memoize, in this process, textworld's parses of its text grammar, its logic queries and its PDDL domains
    (idempotent)."""
    import textworld.envs.pddl.logic
    import textworld.logic
    from textworld.envs.pddl import textgen

    for module in (textgen, textworld.logic, textworld.envs.pddl.logic):
        if not isinstance(module._PARSER, _TextParseMemo):
            module._PARSER = _TextParseMemo(module._PARSER)


@dataclass
class PlayResult:
    """Outcome of playing one walkthrough on the engine."""

    game: str  # the game file, or "<in-memory>"
    won: bool  # the walkthrough won the game
    won_at_start: bool  # the game was already won right after reset (a broken game)
    steps: int  # commands played
    error: str | None = None  # why the walkthrough failed, if it did

    @property
    def ok(self) -> bool:
        return self.won and not self.won_at_start and self.error is None


# Engines released by their user, for the next one. textworld's `close()` does not unload the library copy that
# `PddlEnv` loads, so closing an engine and making another would map one more copy (33 MB) per engine, for good.
_FREE_ENGINES: list = []
_FREE_LOCK = threading.Lock()


def acquire_env():
    """An engine of this process no one uses (one released before, else a new one). It may hold the game its
    previous user loaded: always `load` the game to play. Give it back with `release_env`."""
    with _FREE_LOCK:
        if _FREE_ENGINES:
            return _FREE_ENGINES.pop()
    return make_env()


def release_env(env) -> None:
    """Give back an engine from `acquire_env` (not closed: a later `acquire_env` returns it); its user must not
    touch it again."""
    with _FREE_LOCK:
        _FREE_ENGINES.append(env)


def play_walkthrough(
    game: str | os.PathLike | Mapping[str, Any],
    walkthrough: Sequence[str] | None = None,
    *,
    env=None,
    max_steps: int | None = None,
) -> PlayResult:
    """Play `walkthrough` (default: the game's stored one) on the real engine (`env`, default one of the process's).

    `game` is a `game.tw-pddl` path or its parsed JSON. Every command must be admissible when it is played (a
    command outside the admissible list makes the walkthrough fail). At most `max_steps` commands are played (a
    walkthrough cut short ends without winning). Engine exceptions are reported in `error`.
    """
    name = os.fspath(game) if isinstance(game, (str, os.PathLike)) else "<in-memory>"
    data = game
    if walkthrough is None:
        if not isinstance(game, Mapping):
            with open(game) as f:
                data = json.load(f)
        walkthrough = data.get("walkthrough")
        if not walkthrough:
            return PlayResult(name, False, False, 0, "no walkthrough in the game file")
    if max_steps is not None:
        walkthrough = walkthrough[:max_steps]
    pooled = env is None
    env = acquire_env() if pooled else env
    try:
        with _ENGINE_LOCK:
            return _play_walkthrough(env, game, name, walkthrough)
    finally:
        if pooled:
            release_env(env)


def _play_walkthrough(env, game, name: str, walkthrough: Sequence[str]) -> PlayResult:
    steps = 0
    try:
        install_game_cache(1)  # load and reset share the game's translation
        env.load(name if isinstance(game, (str, os.PathLike)) else dict(game))
        state = env.reset()
        won_at_start = bool(state["won"])
        if won_at_start:
            return PlayResult(name, False, True, 0, "game is already won after reset")
        done = False
        for cmd in walkthrough:
            if done:
                return PlayResult(name, False, False, steps, "episode ended before the walkthrough did")
            if cmd not in state["admissible_commands"]:
                return PlayResult(name, False, False, steps, f"command not admissible: {cmd!r}")
            state, _, done = env.step(cmd)
            steps += 1
        won = bool(state["won"])
        return PlayResult(name, won, False, steps, None if won else "walkthrough ended without winning")
    except Exception as e:  # the engine raises assorted errors on malformed games
        return PlayResult(name, False, False, steps, f"engine error: {type(e).__name__}: {e}")


def find_game_files(root: str | os.PathLike) -> list[str]:
    """All `game.tw-pddl` files under `root` (or `root` itself if it is one), sorted."""
    root = os.fspath(root)
    if os.path.isfile(root):
        return [root]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        if "game.tw-pddl" in filenames:
            found.append(os.path.join(dirpath, "game.tw-pddl"))
    return sorted(found)


def _play_file(path: str) -> PlayResult:
    return play_walkthrough(path)


def map_in_pool(fn, items: Sequence, workers: int | None, progress: bool = False, desc: str = "") -> Iterator:
    """`fn` over `items` in order: in this process (workers <= 1) or in a process pool. The pool starts its processes
    as `EnvProcessPool` does (forkserver where available, else spawn; never fork, as the caller may run torch
    threads), so `fn` and the items must be picklable: module-level functions, or `functools.partial`s of them."""
    import multiprocessing as mp
    import pickle

    from ..envs.process import _module_of, _preload_in_forkserver, default_start_method

    workers = min(workers if workers is not None else (os.cpu_count() or 1), len(items))
    if workers > 1:
        try:
            pickle.dumps((fn, items[0]))
        except Exception as error:
            raise TypeError(
                f"with workers > 1, the function and its items go to worker processes and must be picklable "
                f"(a module-level function, not a lambda or a local function), or pass workers=1: {error}"
            ) from error
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(items), desc=desc, unit="game")
    try:
        if workers <= 1:
            for item in items:
                yield fn(item)
                if bar is not None:
                    bar.update(1)
            return
        method = default_start_method()
        context = mp.get_context(method)
        if method == "forkserver":  # workers then start without importing the engine each
            _preload_in_forkserver(context, [m for m in (_module_of(fn), *ENGINE_MODULES) if m])
        with context.Pool(workers) as pool:
            for result in pool.imap(fn, items):
                yield result
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def play_walkthroughs(root: str | os.PathLike, workers: int | None = None, progress: bool = False) -> list[PlayResult]:
    """Play the stored walkthrough of every game under `root` (sorted), `workers` processes in parallel."""
    files = find_game_files(root)
    return list(map_in_pool(_play_file, files, workers, progress=progress, desc="playing walkthroughs"))
