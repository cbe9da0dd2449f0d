"""The instrument: a case, how its outcome is classified, and the worker processes that run
cases under a timeout and a memory limit (a hang or a crash costs one case, never the run)."""

from __future__ import annotations

import math
import multiprocessing
import os
import resource
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository

OUTCOMES = ("ok", "clear error", "obscure error", "silent NaN", "silent wrong", "hang", "code executed")

BAD = ("obscure error", "silent NaN", "silent wrong", "hang", "code executed")

CLEAR_TYPES = (
    ValueError,
    TypeError,
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    NotADirectoryError,
    IsADirectoryError,
)

MEMORY_LIMIT = 4 << 30  # bytes of address space a worker may add to what it maps (the machine is shared)

FILE_SIZE_LIMIT = 2 << 30  # bytes per written file


@dataclass
class Case:
    """One input to one entry point and what a correct library does with it.

    ``expect``: "accept" (valid input: must succeed), "refuse" (must raise a clear error)
    or "either" (a clear refusal and a correct result are both right).
    ``names``: a refusal is clear only if its message contains one of these (the
    argument, key, path or allowed values), case-insensitively.
    ``check``: the oracle for an accepted result; returns None, or (outcome, detail).
    ``accepted``: the outcome when a "refuse" case is accepted (silent NaN for non-finite
    input, silent wrong otherwise).
    ``marker``: a file whose existence after the case means a payload ran.
    """

    entry: str
    label: str
    run: Callable[[], object]
    expect: str = "refuse"
    names: tuple[str, ...] = ()
    check: Callable[[object], tuple[str, str] | None] | None = None
    accepted: str = "silent wrong"
    timeout: float = 60.0  # generous: a loaded machine must not turn a slow case into a "hang"
    marker: str | None = None
    finite: bool = True  # also scan the result for non-finite tensors


def nonfinite(value, depth: int = 0) -> str | None:
    """Where a non-finite float hides in ``value`` (tensors, arrays, floats, containers,
    dataclasses and plain objects' attributes), or None."""
    if depth > 4:
        return None
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex:
            if not bool(torch.isfinite(value.detach()).all()):
                return f"tensor {tuple(value.shape)} has non-finite entries"
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"float {value}"
    if hasattr(value, "dtype") and hasattr(value, "shape") and hasattr(value, "__array__"):
        import numpy as np

        array = np.asarray(value)
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            return f"array {array.shape} has non-finite entries"
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    elif hasattr(value, "__dataclass_fields__") or (
        hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module | type)
    ):
        items = [(k, v) for k, v in vars(value).items() if not k.startswith("_")]
    else:
        return None
    for key, item in items:
        found = nonfinite(item, depth + 1)
        if found:
            return f"[{key}] {found}"
    return None


def user_facing(error: BaseException) -> bool:
    """One of the brief's user-facing types, or probformer's ``WriteError`` (an ``OSError``
    for a failed write: disk full, permission: the error a user can act on)."""
    write_error = type(error).__name__ == "WriteError" and type(error).__module__.startswith("probformer.")
    return isinstance(error, CLEAR_TYPES) or write_error


def classify_error(case: Case, error: BaseException) -> tuple[str, str]:
    text = f"{type(error).__name__}: {error}".strip()
    if case.expect == "accept":
        return "obscure error", f"valid input refused: {text}"
    message = str(error).lower()
    if user_facing(error) and any(name.lower() in message for name in case.names if name):
        return "clear error", text
    return "obscure error", text


def classify_result(case: Case, result) -> tuple[str, str]:
    if case.expect == "refuse":
        found = nonfinite(result)
        return case.accepted, f"accepted (returned {type(result).__name__}{'; ' + found if found else ''})"
    if case.finite:
        found = nonfinite(result)
        if found:
            return "silent NaN", f"non-finite output: {found}"
    if case.check is not None:
        verdict = case.check(result)
        if verdict is not None:
            return verdict
    return "ok", ""


def run_case(case: Case) -> tuple[str, str]:
    """Run one case in this process and classify it (the worker calls this)."""
    try:
        result = case.run()
    except BaseException as error:  # noqa: BLE001 - classifying every exception is the point
        if isinstance(error, KeyboardInterrupt):
            raise
        if isinstance(error, Hang):
            return "hang", str(error)
        outcome = classify_error(case, error)
        if outcome[0] == "obscure error" and not isinstance(error, CLEAR_TYPES + (CliTraceback, CliLeftFolder)):
            where = traceback.extract_tb(error.__traceback__)[-1]
            outcome = (outcome[0], f"{outcome[1]} (at {Path(where.filename).name}:{where.lineno})")
    else:
        try:
            outcome = classify_result(case, result)
        except Exception as error:  # an oracle that cannot even read the result
            outcome = ("obscure error", f"result unreadable by the check: {type(error).__name__}: {error}")
    return outcome


def _address_space() -> int:
    """This process's address space in bytes (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[0]) * resource.getpagesize()
    except OSError:
        return 0


def _limit_worker() -> None:
    # on top of what the worker already maps: forked from a large process (the test suite,
    # with torch, JAX and compiled kernels loaded), a fixed cap was already spent
    limit = _address_space() + MEMORY_LIMIT
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # too large a file: an OSError, not a kill
    torch.set_num_threads(1)


def _worker(cases: list[Case], connection) -> None:
    _limit_worker()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the library's prints and warnings stay out of the report
    os.dup2(devnull, 2)
    warnings.simplefilter("ignore")
    while True:
        index = connection.recv()
        if index is None:
            return
        connection.send(run_case(cases[index]))


class Worker:
    def __init__(self, cases: list[Case]):
        # fork, not spawn: the cases hold closures a spawned worker could not unpickle. A
        # parent that has run JAX (the test suite's Gibbs oracle) makes JAX warn that a forked
        # child may deadlock; these children never call JAX, and a worker that hangs anyway is
        # killed at its case's deadline and reported as a hang, so the warning is silenced here.
        context = multiprocessing.get_context("fork")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(cases, child), daemon=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
            self.process.start()
        child.close()
        self.index, self.deadline = None, 0.0

    def start(self, index: int, timeout: float) -> None:
        self.index, self.deadline = index, time.monotonic() + timeout
        self.connection.send(index)

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join()
        self.connection.close()


def run_cases(cases: list[Case], jobs: int, progress: bool = True) -> list[dict]:
    """Every case's outcome, in order; ``jobs`` workers at a time."""
    results: list[dict | None] = [None] * len(cases)
    pending = list(range(len(cases)))[::-1]
    workers: list[Worker] = []
    started, done = time.monotonic(), 0

    def record(index: int, outcome: str, detail: str, seconds: float) -> None:
        nonlocal done
        case = cases[index]
        if case.marker and os.path.exists(case.marker):
            outcome, detail = "code executed", f"payload ran (marker {case.marker} exists); then: {outcome} {detail}"
        results[index] = {
            "entry": case.entry,
            "label": case.label,
            "expect": case.expect,
            "outcome": outcome,
            "detail": detail[:600],
            "seconds": round(seconds, 3),
        }
        done += 1
        if progress and (done % 200 == 0 or done == len(cases)):
            print(f"  {done}/{len(cases)} cases, {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)

    while pending or any(w.index is not None for w in workers):
        while len(workers) < jobs and pending:
            workers.append(Worker(cases))
        for worker in workers:
            if worker.index is None and pending:
                index = pending.pop()
                worker.start(index, cases[index].timeout)
                worker.began = time.monotonic()
        busy = [w for w in workers if w.index is not None]
        if not busy:
            continue
        timeout = max(0.0, min(w.deadline for w in busy) - time.monotonic())
        ready = wait([w.connection for w in busy], timeout=timeout)
        for worker in list(busy):
            seconds = time.monotonic() - worker.began
            if worker.connection in ready:
                try:
                    outcome, detail = worker.connection.recv()
                except (EOFError, OSError):
                    worker.process.join()
                    code = worker.process.exitcode
                    outcome, detail = "obscure error", f"the worker process died (exit code {code})"
                    workers.remove(worker)
                    worker.kill()
                record(worker.index, outcome, detail, seconds)
                worker.index = None
            elif time.monotonic() >= worker.deadline:
                record(worker.index, "hang", f"no answer within {cases[worker.index].timeout:g} s", seconds)
                workers.remove(worker)
                worker.kill()
    for worker in workers:
        worker.connection.send(None)
        worker.process.join(timeout=5)
        worker.kill()
    return results


class Hang(Exception):
    """A case's own subprocess ran past its time limit (and was killed by it)."""


class CliTraceback(Exception):
    """The CLI ended in a Python traceback, not a one-line error."""


class CliLeftFolder(Exception):
    """The CLI failed but left a folder behind."""
