"""`RayEnvPool`: environments on Ray actors, on this machine or on a Ray cluster, behind the same `RemoteEnv` proxies
as `EnvProcessPool`.

Why: an ALFWorld game load takes 0.5-2.2 s of CPU, so agent RL at scale needs more CPUs for its environments than the
GPU nodes have (verl-agent and RLinf run their environment workers on Ray for that reason). With `RayEnvPool` as the
trainer's `text_env_factory`, each environment lives in one of `workers` Ray actors, wherever the Ray cluster places
them: on this machine (`ray.init()` starts a local Ray instance) or on a cluster's CPU nodes (`RAY_ADDRESS` set, e.g.
`ray://head:10001` or `auto`). The interface, time limits, fault counting and proxies are `EnvProcessPool`'s: a call
that takes longer than `call_timeout` raises `TimeoutError`, an actor that dies makes its call raise `RemoteEnvError`;
either way the actor is killed, counted in `restarts`, and a fresh one hosts later environments.

```python
import functools

from trl_exreplay.alfworld import AlfWorldEnv
from trl_exreplay.envs.ray_pool import RayEnvPool

env_actors = RayEnvPool(functools.partial(AlfWorldEnv, max_steps=50), workers=64)  # RAY_ADDRESS: the cluster
trainer = ExReplayGRPOTrainer(..., text_env_factory=env_actors)
trainer.train()
env_actors.close()
```

Needs `pip install trl-exreplay[ray]`, and on a cluster the same `trl_exreplay` and environment packages on every
node (the actors import the factory's module). Requests and answers are pickled by this module, as `EnvProcessPool`
pickles them; Ray only carries the bytes.
"""

from __future__ import annotations

import os
import pickle
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .base import renamed_env_factory
from .process import (
    _READY,
    _START_ERROR,
    RemoteEnvError,
    _describe,
    _RemoteTraceback,
    _WorkerPool,
    close_all,
    open_answer,
    serve_request,
)

__all__ = ["RayEnvPool", "ray_cpus"]


def ray_cpus(address: str | None = None) -> float:
    """The CPUs of the Ray cluster this process uses, joining it first if Ray is not initialized yet: the cluster at
    `address`, else at `RAY_ADDRESS`, else a new local instance."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, configure_logging=False, log_to_driver=True)
    return float(ray.cluster_resources().get("CPU", 1))


class EnvActor:
    """The Ray actor that hosts environments (one request at a time, as a worker process serves them)."""

    def __init__(self, factory_bytes: bytes):
        self.factory_bytes, self.factory, self.envs = factory_bytes, None, {}

    def ready(self) -> bytes:
        """The first request: load the factory here, so that a failure is an answer, not a dead actor."""
        try:
            self.factory = pickle.loads(self.factory_bytes)
            return pickle.dumps((_READY, os.getpid()))
        except Exception as error:
            return pickle.dumps((_START_ERROR, _describe(error)))

    def serve(self, request: bytes) -> bytes:
        op, env_id, method, payload = pickle.loads(request)  # our own message, made by `RayEnvPool._exchange`
        return serve_request(self.envs, self.factory, op, env_id, method, payload)

    def stop(self) -> None:
        close_all(self.envs)
        self.envs.clear()


class _ActorWorker:
    """One actor as the pool sees it. Its lock serialises the requests, so a time limit measures one call only."""

    def __init__(self, actor_class, factory_bytes: bytes, slot: int):
        self.actor_class, self.factory_bytes, self.slot = actor_class, factory_bytes, slot
        self.actor = None
        self.pid: int | None = None  # of the actor's process, on whichever node runs it; set by the first request
        self.lock = threading.Lock()
        self.ready = False
        self.lost: str | None = None
        self.env_ids: set[int] = set()

    def start(self) -> None:
        self.actor = self.actor_class.remote(self.factory_bytes)  # returns at once; Ray places and starts it

    def kill(self) -> None:
        import ray

        if self.actor is not None:
            try:
                ray.kill(self.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - the actor may be gone already
                pass
        return None  # a Ray actor has no exit code to report


def _stop_actors(slots: list) -> None:
    """Close the environments of the idle actors and kill every actor. Also the pool's finalizer, so it must not refer
    to the pool."""
    import ray

    workers = [worker for worker in slots if worker is not None]
    slots[:] = [None] * len(slots)
    if not ray.is_initialized():  # Ray was shut down first: its actors are gone with it
        return
    for worker in workers:
        if worker.lost is None:
            worker.lost = "the pool was closed"
        if worker.actor is not None and worker.lock.acquire(blocking=False):  # a busy actor is just killed
            try:
                ray.get(worker.actor.stop.remote(), timeout=2.0)
            except Exception:  # noqa: BLE001 - a dead or hung actor needs no stop request
                pass
            finally:
                worker.lock.release()
        worker.kill()


class RayEnvPool(_WorkerPool):
    """An environment factory whose environments live in Ray actors: pass it as `text_env_factory`.

    Everything `EnvProcessPool` says of its workers holds of the actors here: calling the pool returns a `RemoteEnv`;
    the environment is built on the proxy's first call; an actor serves one call at a time and hosts many
    environments; a new environment goes to an actor not started yet while fewer than `workers` run, else to the one
    with the fewest environments; timeouts and dead actors are counted in `restarts`, the other environments of a lost
    actor raise `RemoteEnvError` ("environment lost"), and an environment's own exception is re-raised as
    `RemoteEnvError` with the actor and environment going on. `stats()` has the same keys.

    Args:
        text_env_factory: builds one environment; pickled to the actors (a class, a module-level function or a
            `functools.partial` of one, importable on every node).
        workers: actors at most (None: the CPUs of the Ray cluster, divided by `cpus_per_worker`).
        call_timeout: seconds one call may take (None: no limit); keep it below the trainer's `env_step_timeout`.
        start_timeout: seconds a new actor may take to be placed and to load `text_env_factory`.
        cpus_per_worker: CPUs Ray reserves for each actor (its `num_cpus`); fractions share a CPU between actors.
        address: the Ray cluster to join when Ray is not initialized yet (None: `RAY_ADDRESS` if set, else a new
            local instance). With Ray initialized already (`ray.init(...)` by the caller), that instance is used.
    """

    def __init__(
        self,
        text_env_factory: Callable[[], Any] | None = None,
        workers: int | None = None,
        call_timeout: float | None = 50.0,
        *,
        start_timeout: float | None = 300.0,
        cpus_per_worker: float = 1.0,
        address: str | None = None,
        env_factory: Callable[[], Any] | None = None,
    ):
        try:
            import ray
        except ImportError as error:  # pragma: no cover - depends on the installation
            raise ImportError("RayEnvPool needs Ray: pip install 'trl-exreplay[ray]'") from error
        text_env_factory = renamed_env_factory(text_env_factory, env_factory, "RayEnvPool")
        self._factory_bytes = self._checked(text_env_factory, workers, call_timeout, start_timeout, "Ray actors")
        if not cpus_per_worker > 0:
            raise ValueError(f"cpus_per_worker must be > 0, got {cpus_per_worker!r}")
        cluster_cpus = ray_cpus(address)
        if workers is None:
            workers = max(1, int(cluster_cpus // cpus_per_worker))
        self.text_env_factory = text_env_factory
        self.workers = workers
        self.call_timeout = call_timeout
        self.start_timeout = start_timeout
        self.cpus_per_worker = cpus_per_worker
        self._actor_class = ray.remote(EnvActor).options(num_cpus=cpus_per_worker, max_restarts=0, max_concurrency=1)
        self._init_slots(workers)
        self._finalizer = weakref.finalize(self, _stop_actors, self._slots)

    def _new_worker(self, slot: int) -> _ActorWorker:
        return _ActorWorker(self._actor_class, self._factory_bytes, slot)

    def __repr__(self) -> str:
        return (
            f"RayEnvPool({self.text_env_factory!r}, workers={self.workers}, call_timeout={self.call_timeout}, "
            f"cpus_per_worker={self.cpus_per_worker})"
        )

    def _exchange(self, worker: _ActorWorker, message: tuple, what: str) -> Any:
        """Send one request and wait for its answer; the caller holds `worker.lock`."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        data = self._request(message, what, "Ray actor")
        stage, timeout = "start-up", self.start_timeout
        try:
            if not worker.ready:
                kind, value = pickle.loads(ray.get(worker.actor.ready.remote(), timeout=timeout))
                if kind == _START_ERROR:
                    name, text, trace = value
                    self._lose(worker, f"start-up failed: {name}: {text}")
                    raise RemoteEnvError(
                        f"the Ray actor could not load text_env_factory: {name}: {text}", name, text, trace
                    ) from _RemoteTraceback(trace)
                worker.pid, worker.ready = value, True
            stage, timeout = what, self.call_timeout
            answer = ray.get(worker.actor.serve.remote(data), timeout=timeout)
        except RemoteEnvError:
            raise
        except GetTimeoutError:
            self._lose(worker, f"Ray actor (pid {worker.pid}) gave no answer to {stage} within {timeout}s")
            raise TimeoutError(
                f"{stage} took longer than {timeout}s in Ray actor (pid {worker.pid}): the actor was killed and its "
                "environments are lost"
            ) from None
        except RayActorError as error:
            stopped = worker.lost  # set if the pool was closed meanwhile
            self._lose(worker, f"Ray actor (pid {worker.pid}) died during {stage}")
            if stopped is not None:
                raise RemoteEnvError(f"environment lost: {stopped}") from error
            raise RemoteEnvError(
                f"the Ray actor (pid {worker.pid}) died during {stage}; its environments are lost"
            ) from error
        except BaseException:
            self._lose(worker, f"a call to {what} was interrupted")  # its answer would be read as the next call's
            raise
        return open_answer(answer, what, f"Ray actor (pid {worker.pid})")
