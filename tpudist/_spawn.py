"""`tpudist.spawn`: run a function in N local processes joined into one job (like `xmp.spawn`).

Each spawned process is a child subreaper, so whatever `fn` starts stays its descendant even if it
leaves the process group (a daemon); when the process ends or is stopped, so are they all.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import tpudist.contract as contract
# free_port: tests import it from here
from tpudist._proc import (become_subreaper, descendants, free_port, free_ports, send,  # noqa: F401
                           set_parent_death_signal, stop_descendants)

_GRACE_SECONDS = 3.0
_EXIT_GRACE_SECONDS = 30.0  # after returning, time allowed for interpreter teardown


class SpawnError(RuntimeError):
    """A spawned process failed; carries its index, exit code and traceback."""

    def __init__(self, index: int, exitcode: int | None, detail: str):
        self.index = index
        self.exitcode = exitcode
        self.detail = detail
        super().__init__(f"process {index} of tpudist.spawn failed ({_describe_exit(exitcode)}):\n{detail}")


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _stop_group(*_: object) -> None:
    send(descendants(os.getpid()), signal.SIGKILL)  # whatever it started, daemons included
    os.killpg(0, signal.SIGKILL)  # and this process with its group


def _die_with_parent(parent_pid: int) -> None:
    """Stops this process's group (it and whatever it started) when the spawning parent dies.

    Linux's PR_SET_PDEATHSIG delivers SIGTERM, whose handler kills the group; a watchdog thread
    covers a main thread blocked in native code, and other platforms.
    """
    signal.signal(signal.SIGTERM, _stop_group)
    set_parent_death_signal(signal.SIGTERM)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.25)
        _stop_group()

    threading.Thread(target=watch, name="tpudist-parent-watch", daemon=True).start()


@contextlib.contextmanager
def _exec_environ(extra: dict[str, str]) -> Iterator[None]:
    """Adds `extra` to this process's environment for the duration (children started meanwhile
    inherit it), then restores what was there."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _child(index: int, fn: Callable[..., Any], args: Sequence[Any], env: dict[str, str],
           parent_pid: int, init: bool, conn: Connection) -> None:
    os.setpgrp()  # own process group: the parent stops this process and everything it started
    become_subreaper()  # and what leaves the group (a daemon) stays this process's to stop
    _die_with_parent(parent_pid)
    os.environ.update(env)
    try:
        if init:
            from tpudist._runtime import init as join
            join()
        result = fn(index, *args)
        # Plain pickle: torch's multiprocessing pickler would share tensors through file
        # descriptors that vanish when this process exits.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent whatever it is
        detail = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        try:
            conn.send_bytes(pickle.dumps(("error", detail)))
        finally:
            conn.close()
            stop_descendants(os.getpid(), _GRACE_SECONDS)
            sys.stderr.flush()
            os._exit(1)
    conn.close()
    stop_descendants(os.getpid(), _GRACE_SECONDS)  # nothing fn started outlives it


def _stop(procs: list[mp.process.BaseProcess], grace: float = _GRACE_SECONDS) -> None:
    """SIGTERM every process group, wait up to `grace` seconds, then SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        if all(p.exitcode is not None for p in procs):
            return
    # Grandchildren left in a group whose leader already exited.
    for p in procs:
        if p.pid is not None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def spawn(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 1,
          cpu_devices: int | None = None, env: dict[str, str] | None = None,
          timeout: float | None = None, init: bool = True) -> list[Any]:
    """Runs `fn(index, *args)` in `nprocs` local processes joined into one job; returns their results.

    Each process gets the environment contract (rank = index) and, with `cpu_devices=K`, K XLA CPU
    devices; with `init=True` it calls `tpudist.init()` before `fn`. `fn` and `args` must be
    picklable (a module-level function). If one process fails, the others are stopped and
    `SpawnError` carries the failing index and its traceback; nothing is left running. `timeout`
    (seconds) bounds the whole run. Example::

        def work(index, scale):
            return tpudist.all_reduce(np.float32(index * scale))

        assert tpudist.spawn(work, args=(2.0,), nprocs=2) == [2.0, 2.0]
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r} must be a positive integer")
    if cpu_devices is not None and (not isinstance(cpu_devices, int) or cpu_devices < 1):
        raise ValueError(f"cpu_devices={cpu_devices!r} must be a positive integer")
    ctx = mp.get_context("spawn")
    coordinator_port, master_port = free_ports(2, "127.0.0.1")
    coordinator = f"127.0.0.1:{coordinator_port}"
    job_id = uuid.uuid4().hex[:12]
    procs: list[mp.process.BaseProcess] = []
    conns: dict[Connection, int] = {}
    results: dict[int, Any] = {}
    # The caller's timeouts (in `env` or this process's environment) carry over to the job.
    given = {**os.environ, **(env or {})}
    limits = contract.JobEnv.from_environ({k: given[k] for k in (contract.INIT_TIMEOUT, contract.COLLECTIVE_TIMEOUT)
                                           if k in given})
    # Read by the dynamic loader at exec, so it must be in this process's environment while the
    # children start; `env` and the rest of the contract are applied inside each child.
    with _exec_environ(contract.process_defaults(os.environ, env or {})):
        for index in range(nprocs):
            job = contract.JobEnv(
                rank=index, world_size=nprocs, local_rank=index, local_world_size=nprocs,
                coordinator=coordinator, master_addr="127.0.0.1", master_port=master_port,
                host="localhost", cpu_devices=cpu_devices,
                platform="cpu" if cpu_devices is not None else None, job_id=job_id,
                init_timeout=limits.init_timeout, collective_timeout=limits.collective_timeout,
                stop_grace=_GRACE_SECONDS)
            child_env = {**(env or {}), **job.to_environ()}
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, name=f"tpudist-spawn-{index}",
                            args=(index, fn, tuple(args), child_env, os.getpid(), init, writer))
            p.start()
            writer.close()
            procs.append(p)
            conns[reader] = index
    deadline = None if timeout is None else time.monotonic() + timeout
    failure: SpawnError | None = None
    try:
        pending = {p.sentinel: i for i, p in enumerate(procs)}
        all_reported: float | None = None
        while pending or conns:
            if len(results) == nprocs:
                # Every process returned; one stuck in interpreter teardown is not a failure.
                all_reported = all_reported or time.monotonic()
                if time.monotonic() - all_reported > _EXIT_GRACE_SECONDS:
                    break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                running = sorted(set(pending.values()))
                raise TimeoutError(f"tpudist.spawn: processes {running} still running after {timeout:g}s")
            ready = wait(list(pending) + list(conns), timeout=1.0 if left is None else min(left, 1.0))
            for obj in ready:
                if obj in conns:
                    index = conns.pop(obj)
                    try:
                        status, payload = pickle.loads(obj.recv_bytes())
                    except EOFError:
                        continue  # died without reporting; its exit code tells
                    if status == "ok":
                        results[index] = payload
                    elif failure is None:
                        procs[index].join(timeout=10)
                        failure = SpawnError(index, procs[index].exitcode, payload)
                elif obj in pending:
                    index = pending.pop(obj)
                    p = procs[index]
                    p.join(timeout=1)
                    if p.exitcode != 0 and failure is None and index not in results and len(results) < nprocs:
                        # Give its traceback a moment to arrive through the pipe.
                        for c, i in list(conns.items()):
                            if i == index and c.poll(1.0):
                                try:
                                    status, payload = pickle.loads(c.recv_bytes())
                                except EOFError:
                                    payload = None
                                conns.pop(c)
                                if payload:
                                    failure = SpawnError(index, p.exitcode, payload)
                        if failure is None:
                            failure = SpawnError(index, p.exitcode, "(no Python traceback; see the "
                                                 "process's stderr above)")
            if failure is not None:
                break
    finally:
        _stop(procs)
        for c in conns:
            c.close()
    if failure is not None:
        raise failure
    return [results.get(i) for i in range(nprocs)]
