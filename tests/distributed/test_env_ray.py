"""`RayEnvPool` on a real local Ray instance: the same answers, proxies, timeouts, fault counting and rollouts as
`EnvProcessPool` (tests/distributed/test_env_process.py), with environments in Ray actors. Ray starts once for this module."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pytest
from helpers import ScriptedGenerate, gone, spelling_episodes
from process_envs import (
    SPELLINGS_PER_EPISODE,
    PlainEnv,
    ProbeEnv,
    SpellingEnv,
    UnloadableFactory,
    broken_factory,
)

from trl_exreplay.demo import KeyDoorEnv
from trl_exreplay.demo.tiny import build_tiny_tokenizer
from trl_exreplay.demo.toy import KEY_DOOR_VOCABULARY
from trl_exreplay.envs import RemoteEnv, RemoteEnvError
from trl_exreplay.envs.rollout import MultiTurnRollout

ray = pytest.importorskip("ray")
from trl_exreplay.envs.ray_pool import RayEnvPool  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """A local Ray instance whose workers import the test environments (tests/process_envs.py) like the pool's
    worker processes do."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path,
             "OMP_NUM_THREADS": "1"}})  # fmt: skip
    yield
    ray.shutdown()


def test_remote_key_door_env_answers_exactly_like_a_local_one():
    actions = ["look around", "open red door", "take the key", "take the key", "open red door"]
    local = KeyDoorEnv()
    with RayEnvPool(KeyDoorEnv, workers=1, cpus_per_worker=0.5) as pool:
        remote = pool()
        assert isinstance(remote, RemoteEnv)
        for task in ({"task_id": "a", "door": "red"}, {"task_id": "b", "door": "blue"}):
            assert remote.reset(task) == local.reset(task)
            assert remote.admissible_actions() == local.admissible_actions()
            for action in actions:
                assert remote.step(action) == local.step(action)
        assert remote.worker_pid != os.getpid()
        assert pool.stats() == {"workers": 1, "envs_per_worker": [1], "pids": [remote.worker_pid], "restarts": 0,
                                "calls": 2 * (2 + len(actions))}  # fmt: skip
        with pytest.raises(AttributeError):
            remote._secret()
        remote.close()
        assert pool.stats()["envs_per_worker"] == [0]


def test_environments_go_to_actors_one_per_actor_first():
    with RayEnvPool(ProbeEnv, workers=2, cpus_per_worker=0.5) as pool:
        first, second = pool(), pool()
        assert len({first.pid(), second.pid()}) == 2 and os.getpid() not in {first.pid(), second.pid()}
        third = pool()
        assert third.pid() == first.pid()
        assert pool.stats()["envs_per_worker"] == [2, 1]


def test_remote_exception_is_reraised_and_the_env_keeps_working():
    with RayEnvPool(ProbeEnv, workers=1, cpus_per_worker=0.5) as pool:
        env = pool()
        env.reset({"name": "x"})
        with pytest.raises(RemoteEnvError) as caught:
            env.step("fail to open the door")
        assert str(caught.value).startswith("ValueError: cannot to open the door (raised by step() in Ray actor")
        assert "raise ValueError" in caught.value.remote_traceback
        assert env.step("look") == ("did look", 1.0, False, {"pid": env.worker_pid, "steps": 2})
        with pytest.raises(RemoteEnvError, match="TypeError: the result of a_lock\\(\\) cannot be pickled"):
            env.a_lock()
        assert pool.restarts == 0


def test_a_hung_step_times_out_and_its_actor_is_replaced():
    with RayEnvPool(ProbeEnv, workers=1, call_timeout=1.0, cpus_per_worker=0.5) as pool:
        hung, neighbour = pool(), pool()
        hung.reset({"name": "hung"})
        neighbour.reset({"name": "neighbour"})
        old_pid = hung.worker_pid
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="step\\(\\) took longer than 1.0s in Ray actor"):
            hung.step("hang")
        assert time.monotonic() - started < 10 and pool.restarts == 1
        assert gone(old_pid, timeout=10)
        with pytest.raises(RemoteEnvError, match="environment lost: its worker process was restarted"):
            neighbour.step("look")
        fresh = pool()
        assert fresh.reset({"name": "fresh"}) == "ready fresh" and fresh.worker_pid != old_pid
        assert pool.stats()["restarts"] == 1


@pytest.mark.parametrize("how", ["crash", "killed"])
def test_an_actor_that_dies_mid_episode_is_counted_and_replaced(how):
    """`crash`: the environment ends its actor's process during a step; `killed`: SIGKILL from outside between
    steps, the next step finds the actor dead."""
    with RayEnvPool(ProbeEnv, workers=1, cpus_per_worker=0.5) as pool:
        victim, neighbour = pool(), pool()
        victim.reset({"name": "victim"})
        victim.step("look")
        old_pid = victim.worker_pid
        if how == "killed":
            os.kill(old_pid, signal.SIGKILL)
        with pytest.raises(RemoteEnvError, match=f"the Ray actor \\(pid {old_pid}\\) died during step\\(\\)"):
            victim.step("crash" if how == "crash" else "look")
        assert pool.restarts == 1 and not victim.alive
        with pytest.raises(RemoteEnvError, match="environment lost"):
            neighbour.reset({"name": "neighbour"})
        fresh = pool()
        assert fresh.reset({"name": "fresh"}) == "ready fresh" and fresh.worker_pid != old_pid
        assert pool.restarts == 1


def test_factory_errors_surface_on_the_first_call():
    with RayEnvPool(broken_factory, workers=1, cpus_per_worker=0.5) as pool:
        with pytest.raises(RemoteEnvError, match="OSError: no game files \\(raised by text_env_factory\\(\\)"):
            pool().reset({"name": "x"})
        assert pool.restarts == 0
    with RayEnvPool(UnloadableFactory(), workers=1, cpus_per_worker=0.5) as pool:
        with pytest.raises(RemoteEnvError, match="Ray actor could not load text_env_factory: ImportError: textworld"):
            pool().reset({"name": "x"})
        assert pool.restarts == 1


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="text_env_factory must be picklable"):
        RayEnvPool(lambda: KeyDoorEnv(), workers=1)
    for kwargs, field in (({"workers": 0}, "workers"), ({"call_timeout": 0}, "call_timeout"),
                          ({"cpus_per_worker": 0}, "cpus_per_worker")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            RayEnvPool(KeyDoorEnv, **kwargs)


def test_close_kills_every_actor_and_is_idempotent():
    pool = RayEnvPool(ProbeEnv, workers=2, cpus_per_worker=0.5)
    envs = [pool(), pool()]
    for env in envs:
        env.reset({"name": "x"})
    pids = pool.stats()["pids"]
    pool.close()
    assert all(gone(pid, timeout=10) for pid in pids)
    pool.close()
    with pytest.raises(RemoteEnvError, match="environment lost"):
        envs[0].step("look")
    with pytest.raises(RuntimeError, match="RayEnvPool is closed"):
        pool()
    assert pool.restarts == 0


def test_multi_turn_rollout_through_actors_matches_in_process_envs():
    tokenizer = build_tiny_tokenizer(KEY_DOOR_VOCABULARY)
    tasks = [{"task_id": f"door-{i}", "door": door} for i, door in enumerate(["red", "green", "blue", "white"])]
    script = ["open the door <eos>", "take the key <eos>", "open red door <eos>", "open green blue door <eos>"]

    def episodes(factory):
        engine = MultiTurnRollout(factory, tokenizer, max_turns=4, max_completion_length=64, workers=4)
        run = [asdict(e) for e in engine.run(tasks, ScriptedGenerate(tokenizer, script))]
        for episode in run:
            del episode["step_seconds"]
        assert engine.errors == Counter()
        engine.close()
        return run

    expected = episodes(KeyDoorEnv)
    assert [e["reward"] for e in expected] == [1.0, 1.0, 1.0, 0.0]
    with RayEnvPool(KeyDoorEnv, workers=2, cpus_per_worker=0.5) as pool:
        assert episodes(pool) == expected
        assert pool.stats()["envs_per_worker"] == [0, 0] and pool.restarts == 0


def test_a_rollout_goes_on_when_an_actor_dies_mid_episode():
    """One episode's actor crashes during a step: that episode is a counted environment error, the other
    environments of that actor are lost (their episodes counted too), the rest finish; the next run starts fresh
    actors and every episode succeeds."""
    tokenizer = build_tiny_tokenizer(["did", "look", "crash", "ready", "a", "b", "c", "d"])
    tasks = [{"task_id": name, "name": name} for name in "abcd"]
    with RayEnvPool(ProbeEnv, workers=2, cpus_per_worker=0.5) as pool:
        engine = MultiTurnRollout(pool, tokenizer, max_turns=2, max_completion_length=32, workers=4)
        a_crashes = lambda ids: "crash <eos>" if "ready a" in tokenizer.decode(ids) else "look <eos>"  # noqa: E731
        first = engine.run(tasks, ScriptedGenerate(tokenizer, ["look <eos>", a_crashes]))
        failed = {e.task["name"] for e in first if e.error is not None}
        assert "a" in failed and failed <= {"a", "c"}  # a and c share the first actor; b and d the second
        assert sum(engine.errors.values()) == len(failed) and pool.restarts == 1
        second = engine.run(tasks, ScriptedGenerate(tokenizer, ["look <eos>", "look <eos>"]))
        assert all(e.error is None for e in second)
        engine.close()


def test_observations_spelling_special_tokens_are_cleaned_on_the_trainer_side_of_the_pool():
    """The Ray actors return the environment's text as it is; the engine, which tokenizes it, removes the spellings:
    the episodes are token for token those of the same game without them, played in this process, and counted."""
    expected, removed = spelling_episodes(PlainEnv)
    assert removed == 0 and [reward for *_, reward in expected] == [1.0] * 4
    with RayEnvPool(SpellingEnv, workers=2, cpus_per_worker=0.5) as pool:
        assert spelling_episodes(pool) == (expected, 4 * SPELLINGS_PER_EPISODE)
        assert pool.restarts == 0
