"""Launched by tests/test_launching.py: the race that aborted about one rank in 100 at exit (trl_exreplay/distributed.py),
made certain.

Usage: accelerate launch --config_file recipes/accelerate/ddp_cpu.yaml tests/scripts/gloo_exit.py {plain,exit_distributed}

Rank 0 starts an all-reduce of a tensor it drops at once, so that gloo's worker thread holds its last reference. Rank 1
joins 1 s later; rank 0's worker then finishes the all-reduce and, to free the tensor's Python object, waits for the GIL,
which rank 0's main thread keeps (it computes without pause and, with a switch interval of 1,000 s, is never asked to
yield) until it reaches interpreter finalization and sleeps in an object's `__del__`. The worker then gets the GIL in a
finalizing interpreter, CPython ends it with `pthread_exit`, and the unwind through a noexcept destructor aborts the
process. `plain` ends as a script normally does: rank 0 aborts ("terminate called without an active exception").
`exit_distributed` ends with `trl_exreplay.distributed.exit_distributed()`: both ranks run their exit handlers, flush
stdout and exit with status 0.
"""

import atexit
import sys
import time

import torch
import torch.distributed as dist

ending = sys.argv[1]
dist.init_process_group("gloo")
# Wrapped once in DDP, as every Trainer run is: the process group then outlives destroy_process_group() (torch 2.13)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
if dist.get_rank() == 0:

    class SlowFinalization:
        def __del__(self, sleep=time.sleep):  # `time` itself may be None by then
            sleep(5)  # freed with __main__'s globals, after the interpreter has started finalizing

    slow_finalization = SlowFinalization()
    if ending == "plain":
        atexit._clear()  # noqa: SLF001 - exit handlers that pause for I/O would hand the GIL over before finalization
    sys.setswitchinterval(1000.0)  # the worker's wait for the GIL never forces this thread to yield it
    dist.all_reduce(torch.ones(4), async_op=True)  # no Python reference kept: the worker thread frees the tensor
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:  # holds the GIL while rank 1 joins and the worker finishes
        pass
else:
    time.sleep(1)
    kept = torch.ones(4)  # kept by Python until the end: rank 1's worker never frees a Python object
    dist.all_reduce(kept)
if ending == "exit_distributed":
    from trl_exreplay.distributed import exit_distributed

    rank = dist.get_rank()
    atexit.register(print, f"rank {rank}: exit handlers ran")  # exit_distributed runs them, then skips finalization
    print(f"rank {rank}: buffered line", end="")  # still in stdout's buffer (a pipe) when exit_distributed is called
    exit_distributed()
