"""Launched by tests/distributed/test_launching.py and tools/stress_launch.sh: the race that aborted about one launch in 100 at exit
(trl_exreplay/distributed.py), made certain or made frequent, under each way a script can end.

Usage: accelerate launch --config_file recipes/accelerate/ddp_cpu.yaml tests/scripts/gloo_exit.py SCENARIO ENDING
  SCENARIO: forced | natural
  ENDING:   plain (the script just ends) | destroy (barrier and destroy_process_group(), what our scripts did before)
            | exit_distributed (trl_exreplay.distributed.exit_distributed())

forced: rank 0 starts an all-reduce of a tensor it drops at once, so that gloo's worker thread holds its last reference.
Rank 1 joins 1 s later; rank 0's worker then finishes the all-reduce and, to free the tensor's Python object, waits for
the GIL, which rank 0's main thread keeps (it computes without pause and, with a switch interval of 1,000 s, is never
asked to yield) until it is finalizing the interpreter, where it yields the GIL at the latest in an object's `__del__`
(which sleeps). The worker then gets the GIL in a finalizing interpreter, CPython ends it with `pthread_exit`, and the
unwind through a noexcept destructor aborts the process: with `plain`, rank 0 aborts ("terminate called without an
active exception") every time (rank 1 leaves with `os._exit`, so that it cannot abort first).

natural: both ranks run 20 all-reduces and all-gathers of tensors they drop at once (as metric gathers do), then end.
Nothing is timed: whether a worker frees its last tensor before finalization is left to the scheduler.

With `exit_distributed` each rank prints, from an exit handler, how many gloo worker threads were still running after
`destroy_process_group()`, and `__del__` (run only if the interpreter finalizes) prints that it ran.
"""

import atexit
import os
import sys
import time

import torch
import torch.distributed as dist

scenario, ending = sys.argv[1:3]
dist.init_process_group("gloo")
rank = dist.get_rank()
# Wrapped once in DDP, as every Trainer run is: the process group then outlives destroy_process_group() (torch 2.13)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))


class SlowFinalization:
    def __del__(self, sleep=time.sleep, write=os.write):  # `time` and `os` may be None by then
        write(1, f"rank {rank}: interpreter finalized\n".encode())
        sleep(5)  # freed with __main__'s globals, after the interpreter has started finalizing


if scenario == "forced":
    if rank == 0:
        slow_finalization = SlowFinalization()
        if ending == "plain":
            atexit._clear()  # noqa: SLF001 - exit handlers that pause for I/O would hand the GIL over before finalizing
        sys.setswitchinterval(1000.0)  # the worker's wait for the GIL never forces this thread to yield it
        dist.all_reduce(torch.ones(4), async_op=True)  # no Python reference kept: the worker thread frees the tensor
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # holds the GIL while rank 1 joins and the worker finishes
            pass
    else:
        time.sleep(1)
        dist.all_reduce(torch.ones(4))
        if ending == "plain":
            os._exit(0)  # no finalization here, so that the abort, if any, is rank 0's
elif scenario == "natural":
    for _ in range(20):
        dist.all_reduce(torch.ones(4))
        dist.all_gather([torch.zeros(4), torch.zeros(4)], torch.ones(4))
else:
    raise ValueError(f"Invalid scenario {scenario!r}: allowed values are 'forced' and 'natural'.")

if ending == "destroy":
    dist.barrier()
    dist.destroy_process_group()
elif ending == "exit_distributed":
    from trl_exreplay.distributed import exit_distributed, gloo_worker_threads

    # exit_distributed runs the exit handlers after destroy_process_group(), then skips finalization
    atexit.register(lambda: print(f"rank {rank}: exit handlers ran, gloo workers alive: {gloo_worker_threads()}"))
    print(f"rank {rank}: buffered line", end="")  # still in stdout's buffer (a pipe) when exit_distributed is called
    exit_distributed()
elif ending != "plain":
    raise ValueError(f"Invalid ending {ending!r}: allowed values are 'plain', 'destroy' and 'exit_distributed'.")
