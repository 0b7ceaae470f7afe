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
(join non-daemon threads, run the `atexit` handlers, collect garbage, flush the standard streams) and ends the process with
`os._exit`, skipping only the finalization in which a late gloo thread would be killed. A process whose gloo threads did
stop returns and exits normally. Call it last, on every rank:

```python
trainer.train()
...
from trl_exreplay.distributed import exit_distributed

exit_distributed()  # ends the process when a gloo process group was used
```
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

GLOO_WORKER_THREAD = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads


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

    if not (dist.is_available() and dist.is_initialized()):
        return
    used_gloo = "gloo" in str(dist.get_backend()).lower()
    dist.barrier()
    dist.destroy_process_group()
    workers = gloo_worker_threads()
    if workers == 0 or (workers is None and not used_gloo):
        return
    _finish_and_exit(status)


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


# ---------------------------------------------------------------------------------------------- the trainer's collectives
# Every rank must make each of these calls, as often as the others: they are how ranks that hold different rows agree.


def from_main_process(accelerator, read: Callable[[], T]) -> T:
    """`read()` on the main process (rank 0), its result sent to every rank. An error there is raised on every rank
    (on the others as a `RuntimeError` naming it), so that no rank waits for a result that will not come. Collective."""
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
