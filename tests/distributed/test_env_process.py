"""`EnvProcessPool`: environments in worker processes behind `RemoteEnv` proxies (same answers, real processes,
parallel calls, remote errors, timeouts, dead workers, closing) and a multi-turn rollout through it.

The first pool of the session starts multiprocessing's fork server, which imports the preloaded modules once (the
package's process module and the factory's, light; more if a pool or `map_in_pool` of an earlier test file started it
with the ALFWorld engine's); later workers fork from it in milliseconds.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from dataclasses import asdict

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
from trl_exreplay.envs import EnvProcessPool, RemoteEnv, RemoteEnvError
from trl_exreplay.envs.rollout import MultiTurnRollout, run_concurrently

pytestmark = pytest.mark.skipif(os.name != "posix", reason="checks worker processes by pid with POSIX signals")


# --------------------------------------------------------------------------------------------- same answers
def test_remote_key_door_env_answers_exactly_like_a_local_one():
    actions = ["look around", "open red door", "take the key", "take the key", "open red door"]
    local = KeyDoorEnv()
    with EnvProcessPool(KeyDoorEnv, workers=1) as pool:
        remote = pool()
        assert isinstance(remote, RemoteEnv)
        for task in ({"task_id": "a", "door": "red"}, {"task_id": "b", "door": "blue"}):  # reused across episodes
            assert remote.reset(task) == local.reset(task)
            assert remote.admissible_actions() == local.admissible_actions()
            for action in actions:
                assert remote.step(action) == local.step(action)
                assert remote.admissible_actions() == local.admissible_actions()
        # the red episode ended on "open red door" with reward 1; the blue one never opens its door
        assert remote.step("open blue door") == ("the blue door opens", 1.0, True, {})
        assert pool.stats() == {
            "workers": 1,
            "envs_per_worker": [1],
            "pids": [remote.worker_pid],
            "restarts": 0,
            "calls": 2 * (2 + 2 * len(actions)) + 1,
        }
        remote.close()
        assert pool.stats()["envs_per_worker"] == [0]


def test_arguments_keywords_and_private_names():
    with EnvProcessPool(ProbeEnv, workers=1) as pool:
        env = pool()
        env.reset({"name": "door"})
        assert env.task_name("-1", upper=True) == "DOOR-1"
        with pytest.raises(AttributeError):
            env._secret()  # private names never reach the worker
        with pytest.raises(AttributeError, match="no public method 'missing'"):
            env.missing()
        env.close()


def test_proxy_forwards_only_the_environments_public_methods():
    with EnvProcessPool(ProbeEnv, workers=1) as pool:
        env = pool()
        assert not hasattr(env, "no_such_method")  # builds the environment, whose worker lists its methods
        assert hasattr(env, "task_name") and not hasattr(env, "admissible_actions")
        assert getattr(env, "max_steps", None) is None  # an attribute stays in the worker; no callable stand-in
        assert env.reset({"name": "x"}) == "ready x" and env.task_name("!") == "x!"
        assert pool.stats()["calls"] == 2  # looking names up sent no calls
        env.close()
        unbuilt = pool()
        unbuilt.close()
        assert not hasattr(unbuilt, "task_name")  # closed before anything built it: nothing to forward


# ----------------------------------------------------------------------------------------- real processes
def test_environments_run_in_worker_processes_one_per_worker_first():
    with EnvProcessPool(ProbeEnv, workers=2) as pool:
        assert pool.stats()["workers"] == 0  # workers start lazily
        first, second = pool(), pool()
        pids = {first.pid(), second.pid()}
        assert len(pids) == 2 and os.getpid() not in pids
        assert {first.worker_pid, second.worker_pid} == pids
        # both workers run: the next environments go to the one with fewest, the first on a tie
        third, fourth, fifth = pool(), pool(), pool()
        assert [third.worker_pid, fourth.worker_pid, fifth.worker_pid] == [
            first.worker_pid,
            second.worker_pid,
            first.worker_pid,
        ]
        stats = pool.stats()
        assert stats["workers"] == 2 and stats["envs_per_worker"] == [3, 2]
        assert sorted(stats["pids"]) == sorted(pids)
        for env in (first, third):
            env.close()
        assert pool.stats()["envs_per_worker"] == [1, 2]
        assert pool().worker_pid == first.worker_pid  # now the emptier one


def test_cpu_bound_steps_of_two_workers_run_at_the_same_time(tmp_path):
    # Each step spins (pure Python, holding its process's GIL) until it has run 0.5 s and the other step has
    # started too: the steps meet and their wall-clock intervals overlap only if the two calls, made from two
    # threads as the rollout makes them, really run at once.
    with EnvProcessPool(ProbeEnv, workers=2) as pool:
        envs = [pool(), pool()]
        for env in envs:
            env.reset({"name": "spin"})  # workers started and ready before the timed steps
        calls = [lambda env=env: env.step(f"spin {tmp_path} 0.5") for env in envs]
        results = run_concurrently(calls, timeout=60, workers=2)
    infos = []
    for result, error, _ in results:
        assert error is None
        infos.append(result[3])
    assert all(info["met"] for info in infos)
    assert infos[0]["pid"] != infos[1]["pid"]
    assert max(info["start"] for info in infos) < min(info["end"] for info in infos)
    assert all(info["end"] - info["start"] >= 0.5 for info in infos)


# ------------------------------------------------------------------------------------------------- faults
def test_remote_exception_is_reraised_and_the_env_keeps_working():
    with EnvProcessPool(ProbeEnv, workers=1) as pool:
        env = pool()
        env.reset({"name": "x"})
        with pytest.raises(RemoteEnvError) as caught:
            env.step("fail to open the door")
        error = caught.value
        assert str(error).startswith("ValueError: cannot to open the door (raised by step() in worker process")
        assert (error.remote_type, error.remote_message) == ("ValueError", "cannot to open the door")
        assert "raise ValueError" in error.remote_traceback
        assert error.__cause__ is not None and "Traceback" in str(error.__cause__)
        # same environment, same worker, state kept: the failed step counted, this is its second
        assert env.step("look") == ("did look", 1.0, False, {"pid": env.worker_pid, "steps": 2})
        assert pool.restarts == 0


def test_unpicklable_argument_or_result_fails_that_call_only():
    with EnvProcessPool(ProbeEnv, workers=1) as pool:
        env = pool()
        env.reset({"name": "x"})
        with pytest.raises(TypeError, match="arguments of step\\(\\) cannot be pickled"):
            env.step(threading.Lock())
        with pytest.raises(RemoteEnvError, match="TypeError: the result of a_lock\\(\\) cannot be pickled"):
            env.a_lock()
        assert env.step("look")[0] == "did look"
        assert pool.restarts == 0


def test_a_hung_step_times_out_and_its_worker_is_replaced():
    with EnvProcessPool(ProbeEnv, workers=1, call_timeout=1.0) as pool:
        hung, neighbour = pool(), pool()
        hung.reset({"name": "hung"})
        neighbour.reset({"name": "neighbour"})
        old_pid = hung.worker_pid
        assert neighbour.worker_pid == old_pid
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="step\\(\\) took longer than 1.0s"):
            hung.step("hang")
        assert time.monotonic() - started < 10
        assert pool.restarts == 1
        assert gone(old_pid)
        with pytest.raises(RemoteEnvError, match="environment lost: its worker process was restarted"):
            neighbour.step("look")
        with pytest.raises(RemoteEnvError, match="environment lost"):
            hung.reset({"name": "again"})
        hung.close()  # never raises
        neighbour.close()
        fresh = pool()
        assert fresh.reset({"name": "fresh"}) == "ready fresh"
        assert fresh.worker_pid != old_pid
        assert pool.stats()["workers"] == 1 and pool.stats()["restarts"] == 1


def test_a_worker_killed_from_outside_is_replaced():
    with EnvProcessPool(ProbeEnv, workers=1) as pool:
        victim, neighbour = pool(), pool()
        victim.reset({"name": "victim"})
        old_pid = victim.worker_pid
        os.kill(old_pid, signal.SIGKILL)
        with pytest.raises(RemoteEnvError, match=f"worker process {old_pid} died during step\\(\\)"):
            victim.step("look")
        assert pool.restarts == 1
        with pytest.raises(RemoteEnvError, match="environment lost"):
            neighbour.reset({"name": "neighbour"})
        fresh = pool()
        assert fresh.reset({"name": "fresh"}) == "ready fresh"
        assert fresh.worker_pid != old_pid
        assert pool.restarts == 1


def test_workers_exit_when_the_pool_process_is_gone():
    # The parent's death closes the write end of the lifeline pipe that only it holds; closing it here shows what
    # the workers then do, without killing the test process. Even a worker stuck in a hung step exits.
    with EnvProcessPool(ProbeEnv, workers=2) as pool:
        idle, hung = pool(), pool()
        idle.reset({"name": "idle"})
        hung.reset({"name": "hung"})
        errors = []

        def hang():
            try:
                hung.step("hang")
            except Exception as error:
                errors.append(error)

        thread = threading.Thread(target=hang)
        thread.start()
        time.sleep(0.2)
        pool._lifeline[1].close()
        assert gone(idle.worker_pid, timeout=10) and gone(hung.worker_pid, timeout=10)
        thread.join(10)
        assert len(errors) == 1 and isinstance(errors[0], RemoteEnvError) and "died during step()" in str(errors[0])


def test_factory_errors_surface_on_the_first_call():
    with EnvProcessPool(broken_factory, workers=1) as pool:
        env = pool()  # built on first use: creating the proxy does not wait for the worker
        with pytest.raises(RemoteEnvError, match="OSError: no game files \\(raised by text_env_factory\\(\\)"):
            env.reset({"name": "x"})
        assert pool.restarts == 0
    with EnvProcessPool(UnloadableFactory(), workers=1) as pool:
        with pytest.raises(RemoteEnvError, match="could not load text_env_factory: ImportError: textworld is not"):
            pool().reset({"name": "x"})
        assert pool.restarts == 1  # that worker exited; the next environment gets a new one


@pytest.mark.parametrize("factory", [lambda: KeyDoorEnv(), type("LocalEnv", (KeyDoorEnv,), {})])
def test_unpicklable_factory_is_refused(factory):
    with pytest.raises(TypeError, match="text_env_factory must be picklable"):
        EnvProcessPool(factory, workers=1)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="start_method='fork' is not supported"):
        EnvProcessPool(KeyDoorEnv, start_method="fork")
    with pytest.raises(ValueError, match="workers"):
        EnvProcessPool(KeyDoorEnv, workers=0)
    with pytest.raises(ValueError, match="call_timeout"):
        EnvProcessPool(KeyDoorEnv, call_timeout=0)


# -------------------------------------------------------------------------------------------------- close
def test_close_stops_every_worker_and_is_idempotent():
    pool = EnvProcessPool(ProbeEnv, workers=2)
    envs = [pool(), pool(), pool()]
    for env in envs:
        env.reset({"name": "x"})
    pids = pool.stats()["pids"]
    assert len(pids) == 2
    pool.close()
    assert all(gone(pid) for pid in pids)
    assert pool.stats()["workers"] == 0
    pool.close()
    with pytest.raises(RemoteEnvError, match="environment lost: its worker process was restarted or stopped"):
        envs[0].step("look")
    for env in envs:
        env.close()
        env.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool()
    assert pool.restarts == 0


def test_closed_proxy_refuses_calls():
    with EnvProcessPool(ProbeEnv, workers=1) as pool:
        env = pool()
        env.reset({"name": "x"})
        env.close()
        with pytest.raises(RemoteEnvError, match="closed environment"):
            env.step("look")


# ---------------------------------------------------------------------------------------------- rollouts
def test_multi_turn_rollout_through_the_pool_matches_in_process_envs():
    tokenizer = build_tiny_tokenizer(KEY_DOOR_VOCABULARY)
    doors = ["red", "green", "blue", "white", "red", "gold"]
    tasks = [{"task_id": f"door-{i}", "door": door} for i, door in enumerate(doors)]
    # red doors open on turn 3, green and blue on turn 4; white and gold never (an invalid action each)
    script = ["open the door <eos>", "take the key <eos>", "open red door <eos>", "open green blue door <eos>"]

    def episodes(factory):
        engine = MultiTurnRollout(factory, tokenizer, max_turns=4, max_completion_length=64, workers=4)
        runs = [[asdict(e) for e in engine.run(tasks, ScriptedGenerate(tokenizer, script))] for _ in range(2)]
        for run in runs:
            for episode in run:
                del episode["step_seconds"]
        assert engine.errors == Counter()
        return engine, runs

    _, expected = episodes(KeyDoorEnv)
    assert [e["reward"] for e in expected[0]] == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    with EnvProcessPool(KeyDoorEnv, workers=2) as pool:
        engine, got = episodes(pool)  # the second run reuses the remote environments
        assert got == expected
        assert pool.stats()["envs_per_worker"] == [3, 3]
        engine.close()
        assert pool.stats()["envs_per_worker"] == [0, 0]
        assert pool.restarts == 0


def test_rollout_drops_idle_environments_lost_with_their_worker():
    tokenizer = build_tiny_tokenizer(KEY_DOOR_VOCABULARY)
    tasks = [{"task_id": f"door-{i}", "door": "red"} for i in range(2)]
    script = ["take the key <eos>", "open red door <eos>"]
    with EnvProcessPool(KeyDoorEnv, workers=1) as pool:
        engine = MultiTurnRollout(pool, tokenizer, max_turns=2, max_completion_length=64, workers=2)
        assert [e.reward for e in engine.run(tasks, ScriptedGenerate(tokenizer, script))] == [1.0, 1.0]
        idle = list(engine._idle_envs)
        assert len(idle) == 2 and all(env.alive for env in idle)
        os.kill(idle[0].worker_pid, signal.SIGKILL)
        with pytest.raises(RemoteEnvError):  # the pool notices the death on the next call
            idle[0].step("look")
        assert not any(env.alive for env in idle)
        # the next run builds fresh environments instead of failing two episodes on the lost ones
        assert [e.reward for e in engine.run(tasks, ScriptedGenerate(tokenizer, script))] == [1.0, 1.0]
        assert engine.errors == Counter() and pool.restarts == 1
        engine.close()


def test_observations_spelling_special_tokens_are_cleaned_on_the_trainer_side_of_the_pool():
    """The worker processes return the environment's text as it is; the engine, which tokenizes it, removes the spellings:
    the episodes are token for token those of the same game without them, played in this process, and counted."""
    expected, removed = spelling_episodes(PlainEnv)
    assert removed == 0 and [reward for *_, reward in expected] == [1.0] * 4
    with EnvProcessPool(SpellingEnv, workers=2) as pool:
        assert spelling_episodes(pool) == (expected, 4 * SPELLINGS_PER_EPISODE)
        assert pool.restarts == 0
