"""`EnvProcessPool`: run CPU-bound Python environments in worker processes behind thread-safe proxies.

Multi-turn rollouts call `reset`/`step` from up to `env_workers` threads, which is enough for environments that wait
(on I/O, a server, a subprocess) but not for ones that compute in Python (ALFWorld's textworld engine): those hold
the GIL and use one core however many threads call them. Pass an `EnvProcessPool` as the trainer's `text_env_factory`
and each environment lives in one of `workers` processes instead; the trainer gets `RemoteEnv` proxies with the
same `reset`/`step`/`close` methods.

```python
import functools

from trl_exreplay.alfworld import AlfWorldEnv

env_processes = EnvProcessPool(functools.partial(AlfWorldEnv, max_steps=50), workers=16)
trainer = ExReplayGRPOTrainer(..., text_env_factory=env_processes)
trainer.train()
env_processes.close()
```

The environments' arguments and results travel between processes by pickling; the messages are our own and never
come from a file.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import multiprocessing
import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

from .base import renamed_env_factory

__all__ = ["EnvProcessPool", "RemoteEnv", "RemoteEnvError", "default_start_method"]

# Messages parent -> worker: (op, env_id, method, payload). Answers: (True, result) or (False, remote error).
_CREATE, _CALL, _CLOSE, _STOP = "create", "call", "close", "stop"
_READY, _START_ERROR = "ready", "start_error"  # a worker's first message


class RemoteEnvError(RuntimeError):
    """An environment call that failed in (or with) its worker process. For an exception raised by the environment,
    `remote_type` and `remote_message` name it, `remote_traceback` is the worker's traceback (also chained as the
    cause); they are None when the worker itself was lost."""

    def __init__(self, message: str, remote_type=None, remote_message=None, remote_traceback=None):
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback


class _RemoteTraceback(Exception):
    """The worker's traceback, chained as the cause of a `RemoteEnvError` so it is printed with it."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def default_start_method() -> str:
    """How worker processes start: "forkserver" where available, else "spawn". Never "fork": the trainer's process
    has threads (torch, CUDA) that a forked child cannot rely on."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


# ------------------------------------------------------------------------------------------------------- worker
def _describe(error: BaseException) -> tuple[str, str, str]:
    kind = type(error)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return name, str(error), "".join(traceback.format_exception(kind, error, error.__traceback__))


def _public_methods(env) -> frozenset[str]:
    """The names of `env`'s public methods, as `dir()` lists them. Looked up statically: properties are not run."""
    names = set()
    for name in dir(env):
        if not name.startswith("_"):
            value = inspect.getattr_static(env, name, None)
            if callable(value) or isinstance(value, (staticmethod, classmethod)):
                names.add(name)
    return frozenset(names)


def _exit_when_orphaned(lifeline) -> None:
    # Nothing is ever sent on the lifeline: reading it ends (EOF) when the pool closes it or its process dies. The
    # command pipe says the same, but a worker stuck in a hung step never reads it. (The parent pid is no help: with
    # forkserver it is the fork server's, which lives as long as any worker does.)
    try:
        lifeline.recv_bytes()
    except (EOFError, OSError):
        pass
    time.sleep(1.0)  # an idle worker sees its command pipe close too and exits cleanly (closing its envs) meanwhile
    os._exit(1)


def serve_request(envs: dict[int, Any], factory, op: str, env_id: int, method: str | None, payload) -> bytes:
    """One request of the pool on the worker's side (a process here, a Ray actor in `RayEnvPool`): build, call or close
    an environment of `envs`; returns the pickled answer, `(True, result)` or `(False, remote error)`. An exception of
    the environment, or a result that cannot be pickled, is an answer like any other: it ends nothing."""
    try:
        if op == _CREATE:
            envs[env_id] = factory()
            result = _public_methods(envs[env_id])  # what the proxy forwards
        elif op == _CALL:
            if method.startswith("_"):
                raise AttributeError(f"{method!r} is private: RemoteEnv forwards public methods only")
            args, kwargs = payload
            result = getattr(envs[env_id], method)(*args, **kwargs)
        elif op == _CLOSE:
            env = envs.pop(env_id, None)  # removed even if its close() raises
            result = None if env is None else env.close()
        else:
            raise ValueError(f"unknown operation {op!r}")
        answer = (True, result)
    except Exception as error:
        answer = (False, _describe(error))
    try:
        return pickle.dumps(answer)
    except Exception as error:  # e.g. a result holding a lock or an open file
        what = f"the result of {method}()" if op == _CALL else "the answer"
        return pickle.dumps((False, _describe(TypeError(f"{what} cannot be pickled: {error}"))))


def close_all(envs: dict[int, Any]) -> None:
    """Close every environment of a worker that stops; an error of one does not stop closing the others."""
    for env in envs.values():
        try:
            env.close()
        except Exception:  # noqa: BLE001 - closing on the way out must not stop closing the others
            pass


def _worker_main(conn, lifeline, factory_bytes: bytes) -> None:
    """Worker process: builds environments with the factory and serves calls on them until told to stop or until its
    parent is gone. An exception of one environment is sent back and ends nothing."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it then closes the pool
    threading.Thread(target=_exit_when_orphaned, args=(lifeline,), daemon=True).start()
    envs: dict[int, Any] = {}
    try:
        try:
            factory = pickle.loads(factory_bytes)  # here, not as a Process argument, so a failure is reported
            first = (_READY, os.getpid())
        except Exception as error:
            factory, first = None, (_START_ERROR, _describe(error))
        try:
            conn.send_bytes(pickle.dumps(first))
        except OSError:
            return
        if factory is None:
            return
        while True:
            try:
                op, env_id, method, payload = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return  # the parent is gone
            if op == _STOP:
                return
            data = serve_request(envs, factory, op, env_id, method, payload)
            try:
                conn.send_bytes(data)
            except OSError:
                return
    finally:
        close_all(envs)


# ------------------------------------------------------------------------------------------------------- parent
class _Worker:
    """One worker process as the parent sees it. Its lock serialises the request/answer exchanges on its pipe."""

    def __init__(self, context, lifeline, factory_bytes: bytes, slot: int):
        self.slot = slot
        self.conn, self._child_conn = context.Pipe(duplex=True)
        self.process = context.Process(
            target=_worker_main,
            args=(self._child_conn, lifeline, factory_bytes),
            name=f"EnvProcessPool-worker-{slot}",
            daemon=True,  # never outlives the parent's normal exit
        )
        self.pid: int | None = None  # set by start()
        self.lock = threading.Lock()
        self.ready = False
        self.lost: str | None = None  # why this worker was given up (then its environments are gone)
        self.env_ids: set[int] = set()

    def start(self) -> None:
        """Start the process (the caller holds `lock`)."""
        try:
            self.process.start()
        finally:
            self._child_conn.close()  # only the worker holds its end now, so the worker's death reads as EOF here
        self.pid = self.process.pid

    def kill(self) -> int | None:
        """Caller holds `lock` (or the worker is unused): nothing else reads the pipe that is closed here. Returns the
        exit code."""
        try:
            self.process.kill()
            self.process.join(5.0)
        except Exception:  # noqa: BLE001 - the process may be gone already
            pass
        self.conn.close()
        return self.process.exitcode


def _shutdown(slots: list, lifeline: tuple, timeout: float = 2.0) -> None:
    """Stop the workers in `slots` (a stop message, then terminate and kill what is still running) and close the
    lifeline pipe. Also the pool's finalizer, so it must not refer to the pool."""
    workers = [worker for worker in slots if worker is not None]
    slots[:] = [None] * len(slots)
    idle = []
    for worker in workers:
        if worker.lost is None:
            worker.lost = "the pool was closed"
        # A worker busy with a call is not told to stop (its pipe is in use): it is terminated below.
        if worker.lock.acquire(blocking=False):
            idle.append(worker)
            try:
                worker.conn.send_bytes(pickle.dumps((_STOP, None, None, None)))
            except Exception:  # noqa: BLE001 - a dead worker needs no stop message
                pass
    deadline = time.monotonic() + timeout
    for worker in workers:
        process = worker.process
        if process.pid is None:  # not started yet: `EnvProcessPool.__call__` stops it once started
            continue
        process.join(max(0.0, deadline - time.monotonic()) if worker in idle else 0.0)
        for end in (process.terminate, process.kill):
            if process.exitcode is None:
                end()
                process.join(1.0)
    for worker in idle:
        worker.conn.close()
        worker.lock.release()
    for end in lifeline:
        end.close()


def _module_of(factory) -> str | None:
    while isinstance(factory, functools.partial):
        factory = factory.func
    module = getattr(factory, "__module__", None) or type(factory).__module__
    return None if module in (None, "__main__", "builtins") else module


def _preload_in_forkserver(context, modules: Sequence[str]) -> None:
    # The fork server imports these once; workers forked from it start in milliseconds and share those modules'
    # memory instead of each importing them again. The package imports its heavy parts (trl, torch) lazily, so this
    # is cheap by default; modules an environment imports only when built (textworld for ALFWorld) are worth adding.
    # The list is process-wide and only read when the fork server starts: keep what is there (default ["__main__"]).
    from multiprocessing import forkserver

    current = getattr(getattr(forkserver, "_forkserver", None), "_preload_modules", None)
    names = list(current) if current else ["__main__"]
    names += [name for name in modules if name not in names]
    context.set_forkserver_preload(names)


class _WorkerPool:
    """What `EnvProcessPool` and `RayEnvPool` share: environments placed on workers (processes or Ray actors), proxies,
    fault counting and closing. A subclass sets the attributes of `_init_slots` and defines `_new_worker(slot)` (an
    object with `slot`, `pid`, `lock`, `ready`, `lost`, `env_ids`, `start()` and `kill() -> exit code`),
    `_exchange(worker, message, what)` (one request and its answer) and `_finalizer` (stops every worker)."""

    @staticmethod
    def _checked(factory, workers, call_timeout, start_timeout, hosts: str) -> bytes:
        """The pickled factory, once the settings every pool takes are checked (`hosts`: where it must go)."""
        if not callable(factory):
            raise TypeError(f"text_env_factory must be callable, got {type(factory).__name__}")
        try:
            factory_bytes = pickle.dumps(factory)
        except Exception as error:
            raise TypeError(
                f"text_env_factory must be picklable to reach the {hosts} (use a class, a module-level function or a "
                f"functools.partial of one, not a lambda or a local function); got {factory!r}: {error}"
            ) from error
        if workers is not None and (not isinstance(workers, int) or workers < 1):
            raise ValueError(f"workers must be an integer >= 1 or None, got {workers!r}")
        for name, value in (("call_timeout", call_timeout), ("start_timeout", start_timeout)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value!r}")
        return factory_bytes

    @staticmethod
    def _request(message: tuple, what: str, hosts: str) -> bytes:
        """The pickled request; an argument that cannot be pickled fails this call only (nothing was sent)."""
        try:
            return pickle.dumps(message)
        except Exception as error:
            raise TypeError(f"the arguments of {what} cannot be pickled to reach the {hosts}: {error}") from error

    def _init_slots(self, workers: int) -> None:
        self._lock = threading.Lock()  # guards the slots, counters and env id sets; taken after a worker's lock
        self._slots: list = [None] * workers
        self._ids = itertools.count()
        self._restarts = 0
        self._calls = 0
        self._closed = False

    # ------------------------------------------------------------------------------------------------ public
    def __call__(self) -> RemoteEnv:
        """A new environment (built in its worker on the proxy's first call)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{type(self).__name__} is closed")
            free = [slot for slot, worker in enumerate(self._slots) if worker is None]
            new = None
            if free:
                new = self._slots[free[0]] = self._new_worker(free[0])
                # Held until the process runs: calls on it wait, and `_shutdown` treats it as busy. The lock is
                # new, so taking it here cannot deadlock with a caller holding a worker lock and waiting for ours.
                new.lock.acquire()
                worker = new
            else:
                worker = min(self._slots, key=lambda w: len(w.env_ids))
            env_id = next(self._ids)
            worker.env_ids.add(env_id)
        if new is not None:
            # Started outside the pool lock: with forkserver the first start also starts the fork server, which
            # imports the preloaded modules (seconds), and stats() or other workers' faults must not wait for that.
            try:
                new.start()
                if self._closed:  # `_shutdown` ran meanwhile and skipped this process, which had not started yet
                    raise RuntimeError(f"{type(self).__name__} is closed")
            except BaseException as error:
                self._lose(new, f"its process did not start: {error!r}")
                if self._closed:  # the cause, whatever failed (closing closes the lifeline a start needs)
                    raise RuntimeError(f"{type(self).__name__} is closed") from None
                raise
            finally:
                new.lock.release()
        return RemoteEnv(self, worker, env_id)

    @property
    def restarts(self) -> int:
        """Workers killed after a timeout or found dead."""
        return self._restarts

    def stats(self) -> dict[str, Any]:
        """`workers` running, `envs_per_worker` (live environments of each running worker), their `pids` (None
        for one still starting), `restarts`, and `calls` (environment method calls sent)."""
        with self._lock:
            running = [worker for worker in self._slots if worker is not None]
            return {
                "workers": len(running),
                "envs_per_worker": [len(worker.env_ids) for worker in running],
                "pids": [worker.pid for worker in running],
                "restarts": self._restarts,
                "calls": self._calls,
            }

    def close(self) -> None:
        """Stop all workers (an idle one closes its environments, a busy one is terminated); idempotent. Proxies
        then raise `RemoteEnvError`."""
        with self._lock:
            self._closed = True
        self._finalizer()  # runs `_shutdown` once; later calls do nothing

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ calls
    def _call(self, proxy: RemoteEnv, method: str, args: tuple, kwargs: dict) -> Any:
        worker = proxy._worker
        with worker.lock:
            self._create(proxy)
            with self._lock:
                self._calls += 1
            return self._exchange(worker, (_CALL, proxy._env_id, method, (args, kwargs)), f"{method}()")

    def _methods_of(self, proxy: RemoteEnv) -> frozenset[str]:
        """The public methods of the proxy's environment (built now if it is not yet)."""
        if proxy._methods is None:
            with proxy._worker.lock:
                self._create(proxy)
        return proxy._methods

    def _create(self, proxy: RemoteEnv) -> None:
        """Build the proxy's environment in its worker unless done; the caller holds the worker's lock."""
        self._check_alive(proxy._worker)
        if proxy._methods is None:
            proxy._methods = self._exchange(proxy._worker, (_CREATE, proxy._env_id, None, None), "text_env_factory()")

    def _close_env(self, proxy: RemoteEnv) -> None:
        worker = proxy._worker
        with self._lock:
            worker.env_ids.discard(proxy._env_id)
        with worker.lock:
            if worker.lost is None and proxy._methods is not None:
                self._exchange(worker, (_CLOSE, proxy._env_id, None, None), "close()")

    @staticmethod
    def _check_alive(worker: _Worker) -> None:
        if worker.lost is not None:
            raise RemoteEnvError(f"environment lost: its worker process was restarted or stopped ({worker.lost})")

    def _lose(self, worker: _Worker, reason: str) -> int | None:
        """Give up a faulted worker (the caller holds its lock): kill it and free its slot. Returns its exit code."""
        with self._lock:
            if worker.lost is None:  # counted once; a worker stopped by close() is no restart
                worker.lost = reason
                self._restarts += 1
            if self._slots[worker.slot] is worker:
                self._slots[worker.slot] = None  # the next new environment starts a fresh worker here
        return worker.kill()


class EnvProcessPool(_WorkerPool):
    """An environment factory whose environments live in worker processes: pass it as `text_env_factory`.

    Calling the pool returns a `RemoteEnv`, a proxy whose `reset`, `step`, `close` and other public methods run on
    an environment built by `text_env_factory()` inside one of `workers` processes. Each worker hosts many environments
    and serves one call at a time, so calls on environments of different workers run in parallel (no GIL shared)
    and calls on environments of the same worker wait for each other. Workers start when first needed: a new proxy
    goes to a worker not started yet while fewer than `workers` run, else to the one with the fewest environments.
    The environment itself is built on the proxy's first call, so creating proxies never waits for a worker to
    start (an error of `text_env_factory` is raised by that first call).

    Faults: a call taking longer than `call_timeout` seconds raises `TimeoutError`, a worker that dies makes its
    call raise `RemoteEnvError`; either way the worker is killed (counted in `restarts`) and a fresh one starts for
    later environments. The other environments of that worker are gone: their next call raises `RemoteEnvError`
    ("environment lost"). An exception raised by an environment is re-raised as `RemoteEnvError` naming its type and
    message, and that environment and its worker go on working. Keep `call_timeout` below the trainer's
    `env_step_timeout`, so a hung worker is replaced before the rollout gives up on the call, and `env_workers` (the
    threads making calls) at least `workers`, or some workers sit idle.

    Args:
        text_env_factory: builds one environment; it is pickled to the workers, so it must be picklable (a class, a
            module-level function, or a `functools.partial` of one), and importable in a fresh interpreter.
        workers: worker processes at most (None: `os.cpu_count()`). With several ranks, each rank has its own pool.
        call_timeout: seconds one call may take (None: no limit); the default stays below the trainer's default
            `env_step_timeout` (60).
        start_method: "forkserver" (default where available) or "spawn". Never "fork": the trainer's process has
            threads (torch, CUDA) that a forked child cannot rely on.
        start_timeout: seconds a new worker may take to start (import modules and load `text_env_factory`).
        preload: with "forkserver", have the fork server import this module and `text_env_factory`'s module once
            (`multiprocessing.set_forkserver_preload`, process-wide; effective only if the fork server is not
            running yet), plus the module names given if a sequence: those the environment imports only when it
            is built, e.g. `trl_exreplay.alfworld.engine.ENGINE_MODULES` for `AlfWorldEnv`.

    Example:

    ```python
    from trl_exreplay.demo import KeyDoorEnv
    from trl_exreplay.envs import EnvProcessPool

    if __name__ == "__main__":  # required by spawn and forkserver in a script
        with EnvProcessPool(KeyDoorEnv, workers=2) as env_processes:
            env = env_processes()
            print(env.reset({"door": "red"}))  # you see a red door and a key
            print(env.step("take the key"))  # ('you have the key', 0.0, False, {})
            print(env.admissible_actions())  # ['open the red door']
            env.close()
    ```

    Close the pool when done (`close()` or a `with` block); otherwise its workers stop when it is garbage collected
    or the interpreter exits.
    """

    def __init__(
        self,
        text_env_factory: Callable[[], Any] | None = None,
        workers: int | None = None,
        call_timeout: float | None = 50.0,
        start_method: str | None = None,
        *,
        start_timeout: float | None = 300.0,
        preload: bool | Sequence[str] = True,
        env_factory: Callable[[], Any] | None = None,
    ):
        text_env_factory = renamed_env_factory(text_env_factory, env_factory, "EnvProcessPool")
        self._factory_bytes = self._checked(text_env_factory, workers, call_timeout, start_timeout, "worker processes")
        workers = (os.cpu_count() or 1) if workers is None else workers
        methods = multiprocessing.get_all_start_methods()
        if start_method is None:
            start_method = default_start_method()
        if start_method == "fork":
            raise ValueError(
                "start_method='fork' is not supported: the trainer's process has threads (torch, CUDA) that a forked "
                "worker cannot rely on. Use 'forkserver' or 'spawn'."
            )
        if start_method not in methods:
            raise ValueError(
                f"start_method must be one of {[m for m in methods if m != 'fork']}, got {start_method!r}"
            )
        self.text_env_factory = text_env_factory
        self.workers = workers
        self.call_timeout = call_timeout
        self.start_timeout = start_timeout
        self.start_method = start_method
        self._context = multiprocessing.get_context(start_method)
        if start_method == "forkserver" and preload:
            modules = [__name__, _module_of(text_env_factory)]
            modules += [] if preload is True else list(preload)
            _preload_in_forkserver(self._context, [name for name in modules if name])
        self._init_slots(workers)
        # Each worker holds the read end; this process alone holds the write end, so the workers see it close when
        # this process dies, however it dies.
        self._lifeline = self._context.Pipe(duplex=False)
        # Shares the slot list, not the pool: workers are stopped when the pool is collected or at exit.
        self._finalizer = weakref.finalize(self, _shutdown, self._slots, self._lifeline)

    def _new_worker(self, slot: int) -> _Worker:
        return _Worker(self._context, self._lifeline[0], self._factory_bytes, slot)

    def __repr__(self) -> str:
        return (
            f"EnvProcessPool({self.text_env_factory!r}, workers={self.workers}, call_timeout={self.call_timeout}, "
            f"start_method={self.start_method!r})"
        )

    def _exchange(self, worker: _Worker, message: tuple, what: str) -> Any:
        """Send one request and wait for its answer; the caller holds `worker.lock`."""
        data = self._request(message, what, "worker process")
        try:
            if not worker.ready:
                kind, value = pickle.loads(self._receive(worker, self.start_timeout, "start-up"))
                if kind == _START_ERROR:
                    name, text, trace = value
                    self._lose(worker, f"start-up failed: {name}: {text}")
                    raise RemoteEnvError(
                        f"the worker process could not load text_env_factory: {name}: {text}", name, text, trace
                    ) from _RemoteTraceback(trace)
                worker.ready = True
            worker.conn.send_bytes(data)
            answer = self._receive(worker, self.call_timeout, what)
        except (TimeoutError, RemoteEnvError):
            raise  # the worker was given up already
        except (EOFError, OSError) as error:  # the worker died (BrokenPipeError and the like are OSErrors)
            stopped = worker.lost  # set if the pool was closed meanwhile
            code = self._lose(worker, f"worker process {worker.pid} died during {what}")
            if stopped is not None:
                raise RemoteEnvError(f"environment lost: {stopped}") from error
            raise RemoteEnvError(
                f"the worker process {worker.pid} died during {what} (exit code {code}); its environments are lost"
            ) from error
        except BaseException:
            # Interrupted mid-exchange (e.g. KeyboardInterrupt): its answer may still come and would be read as the
            # next call's. Give the worker up rather than risk that.
            self._lose(worker, f"a call to {what} was interrupted")
            raise
        return open_answer(answer, what, f"worker process {worker.pid}")

    def _receive(self, worker: _Worker, timeout: float | None, what: str) -> bytes:
        # Waiting on the process sentinel too notices a dead worker even if its pipe end had leaked elsewhere.
        ready = wait([worker.conn, worker.process.sentinel], timeout)
        if not ready:
            self._lose(worker, f"worker process {worker.pid} gave no answer to {what} within {timeout}s")
            raise TimeoutError(
                f"{what} took longer than {timeout}s in worker process {worker.pid}: the worker was killed and its "
                "environments are lost"
            )
        if worker.conn not in ready:
            raise EOFError("worker process exited")
        return worker.conn.recv_bytes()


def open_answer(answer: bytes, what: str, where: str) -> Any:
    """The result of a request made by `what` (e.g. "step()"), from the pickled answer `serve_request` returned in
    `where` (e.g. "worker process 123"); an error of the environment raises `RemoteEnvError`."""
    try:
        ok, value = pickle.loads(answer)
    except Exception as error:  # e.g. a result of a class this process cannot import; the worker is fine
        raise RemoteEnvError(f"the answer of {what} cannot be unpickled here: {error!r}") from error
    if ok:
        return value
    name, text, trace = value
    raise RemoteEnvError(f"{name}: {text} (raised by {what} in {where})", name, text, trace) from _RemoteTraceback(
        trace
    )


class RemoteEnv:
    """Proxy of an environment living in an `EnvProcessPool` worker; thread-safe. `reset`, `step`, `close` and the
    environment's other public methods (e.g. `admissible_actions()`) run remotely; arguments and results are
    pickled. Other attributes stay in the worker: looking one up raises AttributeError (so `hasattr` and
    `getattr(env, name, default)` answer as for an object without it). Looking up a method builds the environment
    first if no call did yet (its worker reports its methods then), with the errors that first call would raise."""

    def __init__(self, pool: EnvProcessPool, worker: _Worker, env_id: int):
        self._pool = pool
        self._worker = worker
        self._env_id = env_id
        self._methods: frozenset[str] | None = None  # the environment's public methods, once it is built
        self._closed = False

    @property
    def worker_pid(self) -> int:
        """Process id of the worker hosting this environment."""
        return self._worker.pid

    @property
    def alive(self) -> bool:
        """False once the environment is closed or lost with its worker (the rollout then drops it)."""
        return not self._closed and self._worker.lost is None

    def reset(self, task: dict[str, Any]) -> str:
        return self._forward("reset", task)

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        return self._forward("step", action)

    def close(self) -> None:
        """Close the remote environment and forget it; never raises, idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._pool._close_env(self)
        except Exception:  # noqa: BLE001 - closing a faulted or lost environment must not raise
            pass

    def __getattr__(self, name: str):
        # Only called for names not found normally: forward the environment's public methods, refuse private and
        # dunder names (copy, pickle and hasattr probes must not reach the worker) and anything else.
        if name.startswith("_"):
            raise AttributeError(name)
        if self._methods is None and self._closed:
            raise AttributeError(f"{name!r}: the environment was closed before it was built")
        if name not in self._pool._methods_of(self):
            raise AttributeError(f"the remote environment has no public method {name!r}")
        return functools.partial(self._forward, name)

    def _forward(self, method: str, *args, **kwargs) -> Any:
        if self._closed:
            raise RemoteEnvError(f"{method}() on a closed environment")
        return self._pool._call(self, method, args, kwargs)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"worker pid {self._worker.pid}"
        return f"RemoteEnv(id={self._env_id}, {state})"
