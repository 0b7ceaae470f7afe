"""`accelerate launch` from a test, bounded: the launch has a time limit below pytest's, so a hang fails the test with
every rank's Python stack, and leaves no rank or compiler running.

DeepSpeed JIT-builds an op on its first launch and guards the build with a lock file that only the builder removes. A
builder killed midway leaves the lock, and every later DeepSpeed launch sharing that build directory waits on it for
ever (DDP launches are unaffected). The launches here build into a directory of their own, made once per test session,
so a lock left by another run cannot hang them, and one left by a launch killed here is removed with it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from helpers import REPOSITORY

DEFAULT_TIMEOUT = 480  # below pytest-timeout's 600 s, so the launch's own output reaches the report
STACK_DUMP_GRACE = 10  # seconds for the ranks to print their stacks after SIGABRT, and for the kill to land

_extensions_dir: Path | None = None


def extensions_dir() -> Path:
    global _extensions_dir
    if _extensions_dir is None:
        _extensions_dir = Path(tempfile.mkdtemp(prefix="exreplay-tests-torch-extensions-"))
        atexit.register(shutil.rmtree, _extensions_dir, True)
    return _extensions_dir


def launch_environment() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": str(extensions_dir()),
        "PYTHONFAULTHANDLER": "1",  # SIGABRT makes every Python process print its threads' stacks
    }


def finished(proc: psutil.Process) -> bool:
    """Exited: gone, or a zombie (its parent has not reaped it yet)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_finished(procs: list[psutil.Process], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(finished(proc) for proc in procs) and time.monotonic() < deadline:
        time.sleep(0.05)


def _stop(process: subprocess.Popen) -> None:
    """Ask every process under the launcher for its stack, then end them all. torch's launcher starts each rank in a
    session of its own, so the ranks are found as its descendants, not by process group."""
    try:
        launcher = psutil.Process(process.pid)
        launcher.suspend()  # else, once one rank aborts, it stops the others before they print their stacks
        ranks = launcher.children(recursive=True)
    except psutil.NoSuchProcess:
        launcher, ranks = None, []
    for rank in ranks:  # one at a time, so that their stacks do not interleave; compilers, if any, go too
        with contextlib.suppress(psutil.NoSuchProcess):
            rank.send_signal(signal.SIGABRT)
        _wait_finished([rank], STACK_DUMP_GRACE)
    for leftover in ranks:
        with contextlib.suppress(psutil.NoSuchProcess):
            leftover.kill()
    _wait_finished(ranks, STACK_DUMP_GRACE)
    if launcher is not None:
        with contextlib.suppress(psutil.NoSuchProcess):
            launcher.resume()  # it reaps its ranks and reports their failure
    try:
        process.wait(timeout=STACK_DUMP_GRACE)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    for lock in extensions_dir().glob("*/lock"):  # its builder, if any, was among those just ended
        lock.unlink()


def accelerate_launch(
    config: str, script: str | Path, *script_args: str, timeout: int = DEFAULT_TIMEOUT, check: bool = True
) -> subprocess.CompletedProcess:
    """Runs `accelerate launch --config_file config script *script_args` in the repository; fails the test when it
    does not exit within `timeout` seconds or (with `check`) exits non-zero, with the tail of its output."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, str(script)]
    command += [str(arg) for arg in script_args]
    process = subprocess.Popen(
        command,
        cwd=REPOSITORY,
        env=launch_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(process)
        stdout, stderr = process.communicate(timeout=STACK_DUMP_GRACE)
        pytest.fail(f"{config}: no exit within {timeout}s; stacks at the kill:\n{stdout[-3000:]}\n{stderr[-40000:]}")
    finally:
        if process.poll() is None:  # pytest-timeout or Ctrl-C interrupted the wait
            _stop(process)
    if check and process.returncode != 0:
        pytest.fail(f"{config} exited with {process.returncode}:\n{stdout[-3000:]}\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def accelerate_launch_machines(
    config: str, script: str | Path, machines: list[list], timeout: int = DEFAULT_TIMEOUT
) -> list[subprocess.CompletedProcess]:
    """A multi-machine run simulated on this one: one `accelerate launch --num_machines N --machine_rank i` per entry
    of `machines` (its script arguments), one rank each, all at once, meeting on a loopback port. Fails the test when
    any launch does not exit within `timeout` seconds (then every launch is stopped, with its ranks' stacks) or exits
    non-zero, with the tail of its output."""
    from accelerate.utils.other import get_free_port

    port, logs, processes = get_free_port(), [], []
    for rank, script_args in enumerate(machines):
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config,
                   "--num_machines", str(len(machines)), "--num_processes", str(len(machines)),
                   "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
                   str(script), *map(str, script_args)]  # fmt: skip
        log = tempfile.TemporaryFile(mode="w+")  # not a pipe: a full pipe of one launch would stall the other
        logs.append(log)
        processes.append(subprocess.Popen(command, cwd=REPOSITORY, env=launch_environment(), stdout=log, stderr=log))
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        for process in processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for process in processes:
            if process.poll() is None:
                _stop(process)
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    if timed_out:
        pytest.fail(f"machines of {config}: no exit within {timeout}s; stacks at the kill:\n" +
                    "\n".join(f"--- machine {r}:\n{out[-20000:]}" for r, out in enumerate(outputs)))  # fmt: skip
    failed = [r for r, process in enumerate(processes) if process.returncode != 0]
    if failed:
        pytest.fail("\n".join(f"machine {r} exited with {processes[r].returncode}:\n{outputs[r][-6000:]}"
                              for r in failed))  # fmt: skip
    return [subprocess.CompletedProcess(process.args, process.returncode, out, "")
            for process, out in zip(processes, outputs)]  # fmt: skip
