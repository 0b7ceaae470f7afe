"""The end of a launched rank: `exit_distributed()` tears the process group down and ends the process so that torch's
gloo worker threads cannot abort it during interpreter shutdown.

Why (torch 2.13, CPython 3.11; diagnosed from a core dump, see `tools/stress_launch.sh`): a gloo collective runs on one
of `ProcessGroupGloo`'s worker threads ("pt_gloo_runloop"), which keeps the collective's tensors until just *after* the
caller has been told it finished. A tensor made in Python and dropped by Python meanwhile is then released by that
thread, which needs the GIL to free its Python object. If the main thread has begun finalizing the interpreter by then,
CPython (before 3.14) ends any thread that asks for the GIL with `pthread_exit`; the forced unwind crosses a `noexcept`
destructor (`ProcessGroupGloo::AsyncWork::~AsyncWork`) and libstdc++ calls `std::terminate`: "terminate called without
an active exception", SIGABRT, after a run whose work was all done. `torch.distributed.destroy_process_group()` does
not prevent it once a model was wrapped in `DistributedDataParallel` (as Accelerate, DeepSpeed and the Trainer do): the
process group stays referenced, its worker threads keep running, and the race stays open until the process ends.

`exit_distributed()` therefore, after a barrier and `destroy_process_group()`, finishes what a normal exit would do
(join non-daemon threads, run the `atexit` handlers, collect garbage, flush the standard streams) and ends the process
with `os._exit`, skipping only the finalization in which a late gloo thread would be killed. A process whose gloo
threads did stop returns and exits normally. Call it last, on every rank:

```python
trainer.train()
...
from trl_exreplay.distributed import exit_distributed

exit_distributed()  # ends the process when a gloo process group was used
```

A run whose script does not end so is told at its exit (`advise_exit_distributed`, from the trainer's end of training),
and a launch that starts fewer processes than it was asked for is told at the start (`warn_launch_shortfall`).
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

GLOO_WORKER_THREAD = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads

logger = logging.getLogger(__name__)
_exit_distributed_called = False  # the script ends as it should: no advice at exit
_advice_registered = False


def gloo_worker_threads() -> int | None:
    """How many of this process's threads are gloo workers, or None where the threads' names cannot be read."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == GLOO_WORKER_THREAD
        except OSError:  # the thread ended meanwhile
            pass
    return count


def uses_gloo_group() -> bool:
    """Whether this process is in an initialised gloo process group of several ranks (the case `exit_distributed` is
    for)."""
    import torch.distributed as dist

    return (
        dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
        and "gloo" in str(dist.get_backend()).lower()
    )


def exit_distributed(status: int = 0) -> None:
    """Ends a rank of a multi-process run: a barrier, `destroy_process_group()`, then, if gloo worker threads are still
    running (or cannot be counted on this platform while a gloo group was used), the rest of a normal exit and
    `os._exit(status)`. Without a process group it does nothing and returns."""
    import torch.distributed as dist

    global _exit_distributed_called
    _exit_distributed_called = True
    if not (dist.is_available() and dist.is_initialized()):
        return
    used_gloo = "gloo" in str(dist.get_backend()).lower()
    dist.barrier()
    dist.destroy_process_group()
    workers = gloo_worker_threads()
    if workers == 0 or (workers is None and not used_gloo):
        return
    _finish_and_exit(status)


def advise_exit_distributed() -> None:
    """At this process's exit, unless `exit_distributed()` was called by then, log how to end a gloo run safely: the
    trainer calls it at the end of training on the main process of a multi-process gloo run. Said at exit, not at the
    end of training, because only then is it known whether the script ended as it should (an `atexit` handler runs
    before the finalization in which the abort would come). Registered once."""
    global _advice_registered
    if not _advice_registered:
        _advice_registered = True
        atexit.register(_advise_at_exit)


def _advise_at_exit() -> None:
    if not _exit_distributed_called:
        logger.warning(
            "trl_exreplay: this multi-process (gloo) run is ending without "
            "trl_exreplay.distributed.exit_distributed(). Its training is done; if the process aborts now with "
            "'terminate called without an active exception', that is a gloo worker thread at interpreter exit, not a "
            "failure of the run. To end without that risk, make `exit_distributed()` the last line of the script, on "
            "every rank (after save_model() or push_to_hub())."
        )


def launch_shortfall(environ: dict, num_processes: int, parent_environ: dict | None) -> str | None:
    """What says that the launch asked for more processes than this run has (`num_processes`, accelerate's), or None.
    `environ` is this process's environment, `parent_environ` its parent's (None where it cannot be read).

    - `accelerate launch` sets WORLD_SIZE for the processes it starts with torch's launcher; a process that runs with
      fewer (accelerate's state came up without a process group: on a CPU machine, `--multi_gpu` with a config that
      leaves the trainer's `use_cpu` out) trains alone, as do the others.
    - `accelerate launch --num_processes N` without `--multi_gpu`, or a config with `distributed_type: MULTI_CPU`, on a
      machine without GPUs starts ONE process (its simple launcher; several only through MPI). It sets no WORLD_SIZE,
      but it sets MASTER_ADDR only when asked for more than one process: a MASTER_ADDR in this process's environment
      that its parent (the launcher) does not have, beside the ACCELERATE_* variables the launcher sets.
    """
    world = environ.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) > num_processes:
        return f"this process was launched as one of WORLD_SIZE={world} processes but runs as {num_processes}"
    launched = "ACCELERATE_DYNAMO_BACKEND" in environ and "MASTER_ADDR" in environ and not world
    if launched and parent_environ is not None and "MASTER_ADDR" not in parent_environ and num_processes == 1:
        return "`accelerate launch` was asked for more than one process (it set MASTER_ADDR) but started only this one"
    return None


def parent_environment() -> dict | None:
    """The parent process's environment variables (Linux's /proc), or None where they cannot be read."""
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return None
    return dict(entry.decode(errors="replace").split("=", 1) for entry in entries if b"=" in entry)


def warn_launch_shortfall(num_processes: int) -> None:
    """Warn when the launch asked for more processes than this run has (`launch_shortfall`), naming a command that runs
    them on a CPU machine."""
    reason = launch_shortfall(dict(os.environ), num_processes, parent_environment())
    if reason is not None:
        logger.warning(
            "trl_exreplay: %s, so it trains alone. On a machine without GPUs, accelerate starts one process for "
            "`--num_processes N` without `--multi_gpu` and for `distributed_type: MULTI_CPU` (without MPI). To run "
            "2 processes on CPU (gloo DDP): `accelerate launch --config_file recipes/accelerate/ddp_cpu.yaml "
            "script.py` (its `distributed_type: MULTI_GPU`, `use_cpu: false` resolve to gloo on a CPU machine), or "
            "`accelerate launch --multi_gpu --num_processes 2 script.py`, with `use_cpu=True` in the trainer's "
            "config.",
            reason,
        )


def _finish_and_exit(status: int) -> None:
    """What the interpreter's own exit does, in the order of `Py_FinalizeEx`, up to destroying the modules; then
    `os._exit`."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # noqa: SLF001 - the public way to run them is to exit, which is what must not happen
    gc.collect()  # finalizers of unreachable objects (files they close, folders they remove) run now
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # replaced, closed or detached by the script
            pass
    os._exit(status)


# ------------------------------------------------------------------------------------------- the trainer's collectives
# Every rank must make each of these calls, as often as the others: they are how ranks that hold different rows agree.


def from_main_process(accelerator, read: Callable[[], T]) -> T:
    """`read()` on the main process (rank 0), its result sent to every rank. An error there is raised on every rank (on
    the others as a `RuntimeError` naming it), so that no rank waits for a result that will not come. Collective."""
    if accelerator.num_processes == 1:
        return read()
    from accelerate.utils import broadcast_object_list

    result, failure = None, None
    if accelerator.is_main_process:
        try:
            result = read()
        except Exception as error:  # noqa: BLE001 - raised again below, after the other ranks are told
            failure = error
    message = None if failure is None else f"{type(failure).__name__}: {failure}"
    result, message = broadcast_object_list([result, message], from_process=0)
    if failure is not None:
        raise failure
    if message is not None:
        raise RuntimeError(f"trl_exreplay: the main process failed ({message}).")
    return result


def any_rank_active(accelerator, active: bool) -> bool:
    """Each rank says whether it still has work (an episode, a tool round); True when any rank has. Collective."""
    import torch

    flag = torch.tensor([1.0 if active else 0.0], device=accelerator.device)
    return accelerator.reduce(flag, reduction="sum").item() > 0


def gather_row_flags(accelerator, local_rows: set[int], num_local: int) -> list[bool]:
    """This rank's flagged row indices -> a flag per row of the whole (gathered) batch. Collective."""
    import torch

    flags = torch.zeros(num_local, device=accelerator.device)
    flags[sorted(local_rows)] = 1.0
    return accelerator.gather(flags).bool().tolist()


def generation_is_collective(accelerator, dist) -> bool:
    """Whether a generation call needs every rank: a sharded model (ZeRO-3, FSDP; `dist` is TRL's `_dist`) gathers its
    parameters collectively in every forward, so ranks must make their generation calls in lockstep."""
    return accelerator.num_processes > 1 and (dist.is_zero3 or dist.is_fsdp)


def check_multi_turn_vllm(
    vllm_mode: str, tensor_parallel_size: int, path: str = "Multi-turn rollouts (`text_env_factory`)"
) -> None:
    """Multi-turn rollouts generate through vLLM one call per turn, and ranks play different numbers of turns (a rank
    whose rows are all replayed plays none). Server mode and tensor parallelism gather equal-sized prompt lists across
    ranks on every call. `path` names the rollouts in the error: ours, or TRL's tool loop with replay."""
    if vllm_mode != "colocate" or tensor_parallel_size != 1:
        raise NotImplementedError(
            f"{path} with vLLM need vllm_mode='colocate' and vllm_tensor_parallel_size=1 "
            f"(got vllm_mode={vllm_mode!r}, vllm_tensor_parallel_size={tensor_parallel_size}); or set use_vllm=False."
        )
