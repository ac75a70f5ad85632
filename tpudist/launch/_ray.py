"""Agents placed by Ray (`--ray ADDRESS`): one actor per node starts that node's agent, instead of SSH.

Everything after the agent's start is the SSH path's: the bootstrap line on the agent's stdin,
then the gRPC control plane (registration, the processes' argv and env as data, log lines,
exits, stacks, stop). What differs is how the agent starts and how the launcher is reached:

- the launcher (a Ray driver, `ray.init(address)` in `clusters/ray.py`) creates one actor per
  node, pinned to it (`NodeAffinitySchedulingStrategy`, not soft), needing no CPU of the node's;
  the actor runs the agent as its child (`python -m tpudist.launch.agent`, the interpreter the
  launch chose), with the bootstrap on the agent's stdin, and keeps that pipe open;
- the agent dials the launcher's control server over the network, over TLS with the job's own
  certificate (it came in the bootstrap: `control/_tls.py`), and the job token on every call;
- the agent's parent is the actor: when the actor ends (the launcher closes it, the driver exits,
  the node dies), the agent's stdin closes and Linux sends it SIGTERM, and it stops its processes.

The bootstrap reaches the actor as an argument of a Ray call, so it is as private as the Ray
cluster's own channels (Ray does not authenticate its clients by default: whoever reaches the
cluster can run code on it anyway). The actor's class is defined inside `_actor_class` with only
the standard library, so the Ray worker's interpreter needs neither tpudist nor its packages.

    results = open_ray_agents(cluster, python=sys.executable, make_bootstrap=make, control_port=port)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from tpudist.launch._transport import AGENT_MODULE, AgentHandle
from tpudist.launch.clusters import Cluster, Host
from tpudist.launch.clusters.ray import first_line

START_TIMEOUT_S = 60.0  # for Ray to place an actor on its node and the actor to start the agent
RAY_CALL_S = 10.0  # for a call on a live actor (its stderr, closing)
# Variables Ray sets in an actor's environment to give it none of a device kind (it asks for no
# GPU or TPU): the agent's processes must see the node's devices, as an SSH login does.
_RAY_EMPTY_DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                          "TPU_VISIBLE_CHIPS", "NEURON_RT_VISIBLE_CORES", "ONEAPI_DEVICE_SELECTOR")


def _actor_class():
    """The actor that runs one node's agent (standard library only: pickled by value)."""
    import ray

    @ray.remote(num_cpus=0, max_concurrency=4)
    class TpudistAgent:
        def start(self, argv: list[str], bootstrap: bytes, drop_empty: tuple[str, ...]) -> int:
            import os
            import subprocess
            import threading as _threading

            env = {k: v for k, v in os.environ.items() if not (k in drop_empty and not v)}
            self.tail = b""
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, env=env, start_new_session=True)

            def drain() -> None:
                while chunk := self.proc.stderr.read1(4096):
                    self.tail = (self.tail + chunk)[-8192:]

            _threading.Thread(target=drain, daemon=True).start()
            try:
                self.proc.stdin.write(bootstrap)
                self.proc.stdin.flush()
            except OSError:
                pass  # it ended already (no such interpreter): wait() and stderr() say why
            return self.proc.pid

        def wait(self) -> int:
            return self.proc.wait()

        def stderr(self) -> bytes:
            return self.tail

        def close(self, timeout_s: float) -> int | None:
            """Closes the agent's stdin: it stops its processes and exits."""
            import subprocess
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                return self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                return None

        def kill(self) -> None:
            import os
            import signal
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the group is its pid
            except OSError:
                pass

    return TpudistAgent


class RayAgent(AgentHandle):
    """The agent on a Ray node, the child of an actor pinned there."""

    LOST = "its Ray actor died (the node lost, or the actor killed)"

    def __init__(self, worker: int, host: Host, actor) -> None:
        self.worker, self.host, self.actor = worker, host, actor
        self._exit = actor.wait.remote()  # ready when the agent exits; an error when the actor or node dies
        self._status: int | None = None
        self._said = ""

    def exit_status(self) -> int | None:
        import ray

        if self._status is None:
            ready, _ = ray.wait([self._exit], timeout=0)
            if ready:
                try:
                    self._status = int(ray.get(ready[0]))
                except Exception as e:  # noqa: BLE001 - the actor (or its node) died: the host is lost
                    self._status, self._said = -1, f"{type(e).__name__}: {first_line(e)}"
        return self._status

    def stderr_text(self) -> str:
        import ray

        if self._status == -1:
            return self._said
        try:
            return ray.get(self.actor.stderr.remote(), timeout=RAY_CALL_S).decode(errors="replace").strip()
        except Exception:  # noqa: BLE001 - a dead actor has nothing more to say
            return self._said

    def describe_failure(self, python: str) -> str:
        if self.exit_status() == -1:
            return (f"host {self.host}: its Ray actor (or the node) died before the agent reported: "
                    f"{self._said}").strip()
        return super().describe_failure(python)

    def kill(self, timeout_s: float) -> None:
        import ray
        try:
            ray.get(self.actor.kill.remote(), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - gone already
            pass

    def close(self) -> None:
        import ray
        try:
            ray.get(self.actor.close.remote(5.0), timeout=RAY_CALL_S)
        except Exception:  # noqa: BLE001 - the actor is killed below either way
            pass
        try:
            ray.kill(self.actor)  # the agent's parent: were it still running, PR_SET_PDEATHSIG ends it
        except Exception:  # noqa: BLE001
            pass


def open_ray_agents(cluster: Cluster, *, python: str, make_bootstrap: Callable[[int, Host, bool], Callable],
                    control_port: Callable[[], int], on_connected: Callable[[int], None] = lambda w: None,
                    poll: Callable[[], bool] = lambda: False, workers: Collection[int] | None = None,
                    timeout_s: float = START_TIMEOUT_S) -> dict[int, AgentHandle | Exception]:
    """One agent per host of a `--ray` cluster (only on `workers`, if given): the same contract as
    `_transport.open_agents`, each result an agent or the exception that host raised."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor_class = _actor_class()
    hosts = {w: h for w, h in enumerate(cluster.hosts) if workers is None or w in workers}
    actors = {w: actor_class.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(cluster.ray_nodes[w], soft=False)).remote() for w in hosts}
    port = control_port()
    argv = [python, "-m", AGENT_MODULE]
    # die_with_parent: the agent's parent is the actor, gone with the job (or the node)
    starts = {w: actors[w].start.remote(argv, make_bootstrap(w, h, True)(port), _RAY_EMPTY_DEVICE_VARS)
              for w, h in hosts.items()}
    results: dict[int, AgentHandle | Exception] = {}
    deadline = time.monotonic() + timeout_s
    pending = dict(starts)
    while pending and time.monotonic() < deadline and not poll():
        ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=0.2)
        for w in [w for w, ref in pending.items() if ref in ready]:
            ref = pending.pop(w)
            try:
                ray.get(ref)  # the agent's pid: it started (or the actor's error, raised here)
                results[w] = RayAgent(w, hosts[w], actors[w])
                on_connected(w)
            except Exception as e:  # noqa: BLE001 - per-host failure is data
                results[w] = RuntimeError(f"host {hosts[w]}: Ray could not start the agent's actor on node "
                                          f"{cluster.ray_nodes[w][:12]}: {first_line(e)}")
    for w in pending:
        results[w] = RuntimeError(f"host {hosts[w]}: Ray did not start the agent's actor on node "
                                  f"{cluster.ray_nodes[w][:12]} within {timeout_s:g} s (is the node alive? "
                                  "`ray status`)")
    for w, r in results.items():
        if isinstance(r, Exception):
            try:
                ray.kill(actors[w])
            except Exception:  # noqa: BLE001
                pass
    return results
