"""The JAX coordinator is the job's alone: strangers and a second job cannot reach or harm it.

A one-host job's coordinator is a Unix socket only its user can open. A multi-host job's is too, on
worker 0; the other hosts reach it through worker 0's agent at the advertised address (127.0.0.2
here, the sshd fixture's first host), which lets in only a connection that proves it knows the job's
secret. The stranger below, from another address of this machine (127.0.0.5), tries to register as
process 1 with JAX's own client, which before killed the running job (SIGABRT in every process).
"""

from __future__ import annotations

import os
import pathlib
import socket
import stat
import subprocess
import sys
import textwrap
import time

import pytest
from launchutil import launch, start_launcher, wait_lines

pytestmark = pytest.mark.slow

# Prints its coordinator, waits until the test has let the stranger try, then runs a collective.
JOB = textwrap.dedent("""
    import os, pathlib, sys, time
    import numpy as np
    import tpudist
    tpudist.init()
    print("coordinator", os.environ.get("TPUDIST_COORDINATOR_GATE") or os.environ["TPUDIST_COORDINATOR"],
          flush=True)
    go = pathlib.Path(sys.argv[1])
    end = time.monotonic() + 60
    while not go.exists() and time.monotonic() < end:
        time.sleep(0.05)
    time.sleep(1.5)  # long enough for an error the stranger caused to reach every process
    total = tpudist.all_reduce(np.array([tpudist.process_index() + 1.0]))
    print("sum", float(total[0]), flush=True)
""")

# A stranger at `argv[1]`, its connections from source address `argv[2]` (when given): if a TCP
# connection gets through, JAX's own client registers as process 1 of 2 (which aborts the stranger
# too, whatever the service answers). JAX's client cannot choose its source address, so it talks to
# a relay here that connects from `argv[2]`.
STRANGER = textwrap.dedent("""
    import socket, sys, threading
    host, port = sys.argv[1].rsplit(":", 1)
    source = (sys.argv[2], 0) if len(sys.argv) > 2 else None
    try:
        socket.create_connection((host, int(port)), timeout=3, source_address=source).close()
    except OSError as e:
        print("refused", type(e).__name__, flush=True)
        sys.exit(0)
    print("connected", flush=True)
    target = sys.argv[1]
    if source:
        relay = socket.create_server((sys.argv[2], 0))
        target = "%s:%d" % relay.getsockname()

        def pipe(a, b):
            try:
                while data := a.recv(65536):
                    b.sendall(data)
            except OSError:
                pass
            finally:
                a.close(); b.close()

        def serve():
            while True:
                conn, _ = relay.accept()
                out = socket.create_connection((host, int(port)), timeout=3, source_address=source)
                out.settimeout(None)
                threading.Thread(target=pipe, args=(conn, out), daemon=True).start()
                threading.Thread(target=pipe, args=(out, conn), daemon=True).start()

        threading.Thread(target=serve, daemon=True).start()
    from jax._src.lib import _jax
    client = _jax.get_distributed_runtime_client(target, 1, init_timeout=3, heartbeat_timeout=5,
                                                 shutdown_on_destruction=False)
    try:
        client.connect()
    except Exception as e:
        print("not registered", type(e).__name__, flush=True)
        sys.exit(0)
    print("registered", flush=True)
""")


def _stranger(address: str, source: str | None = None) -> str:
    r = subprocess.run([sys.executable, "-c", STRANGER, address, *([source] if source else [])],
                       capture_output=True, timeout=30)
    return r.stdout.decode().strip() or f"exit {r.returncode}"


def _run_job_with_stranger(launcher_flags: list[str], tmp_path: pathlib.Path, try_stranger) -> tuple:
    go = tmp_path / "go"
    proc = start_launcher(*launcher_flags, "--cpu-devices", "1",
                          "--", "python", "-c", JOB, str(go))
    try:
        lines = wait_lines(proc, 2, b"coordinator", timeout=60)
        coordinator = next(x for x in lines if b"coordinator" in x).split()[-1].decode()
        attempts = try_stranger(coordinator)
        go.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return coordinator, attempts, proc.returncode, b"".join(lines) + out, err


def _as_another_user_connect(path: str) -> str:
    """Opens the Unix socket at `path` as user nobody (needs root to become them)."""
    pid = os.fork()
    if pid == 0:  # the child: become nobody, try, report by exit status
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(5)
            s.connect(path)
            code = 0
        except PermissionError:
            code = 1
        except OSError:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return {0: "connected", 1: "permission denied", 2: "other error"}.get(os.waitstatus_to_exitcode(status), "?")


def test_a_one_host_job_cannot_be_joined_by_a_stranger(tmp_path):
    def stranger(coordinator: str) -> dict:
        tried = {}
        if coordinator.startswith("unix:"):
            path = coordinator[len("unix:"):]
            mode = os.stat(path).st_mode & 0o777
            tried["socket mode"] = oct(mode)
            assert mode & 0o022 == 0, f"{path} is writable by others: {oct(mode)}"
            folder = os.lstat(os.path.dirname(path))  # a directory no other user can enter or create in
            assert stat.S_ISDIR(folder.st_mode) and folder.st_uid == os.getuid(), path
            assert stat.S_IMODE(folder.st_mode) == 0o700, (path, oct(folder.st_mode))
            if os.geteuid() == 0:
                tried["as nobody"] = _as_another_user_connect(path)
        else:  # a TCP coordinator: reach it at this machine's other address, as from another host
            port = coordinator.rsplit(":", 1)[1]
            tried["127.0.0.5"] = _stranger(f"127.0.0.5:{port}")
        return tried

    coordinator, tried, rc, out, err = _run_job_with_stranger(
        ["--local", "--nproc-per-host", "2"], tmp_path, stranger)
    assert rc == 0, (coordinator, tried, err.decode()[-3000:])
    assert out.count(b"sum 3.0") == 2, out
    assert coordinator.startswith("unix:"), coordinator
    assert tried.get("as nobody", "permission denied") == "permission denied", tried


def test_a_stranger_from_another_address_cannot_join_a_multi_host_job(sshd, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]

    def stranger(gate: str) -> dict:
        assert gate == f"127.0.0.2:{port}", gate
        return {"from 127.0.0.5": _stranger(gate, source="127.0.0.5"),  # as from another machine
                "to 127.0.0.5": _stranger(f"127.0.0.5:{port}")}  # not listening on every interface

    start = time.monotonic()
    _, tried, rc, out, err = _run_job_with_stranger(
        [*sshd.launcher_flags(2), "--coordinator-port", str(port)], tmp_path, stranger)
    took = time.monotonic() - start
    assert "registered" not in tried["from 127.0.0.5"].split("\n"), tried  # it got no further than the gate
    assert tried["to 127.0.0.5"].startswith("refused"), tried
    assert rc == 0, (tried, err.decode()[-3000:])
    assert out.count(b"sum 3.0") == 2, out  # the job ran on unharmed
    said = (out + err).decode()
    assert "refused a connection to this job's JAX coordinator from 127.0.0.5:" in said, said[-3000:]
    assert took < 45, took


def test_a_second_job_on_a_pinned_port_is_refused_and_the_first_runs_on(sshd, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
    flags = [*sshd.launcher_flags(2), "--coordinator-port", str(port)]

    def second_job(coordinator: str) -> dict:
        assert coordinator == f"127.0.0.2:{port}"
        start = time.monotonic()
        r = launch(*flags, "--", "python", "-c", "print('second job ran')", timeout=60)
        return {"rc": r.returncode, "s": time.monotonic() - start, "out": r.stdout, "err": r.stderr.decode()}

    _, second, rc, out, err = _run_job_with_stranger(flags, tmp_path, second_job)
    assert second["rc"] == 2 and b"second job ran" not in second["out"], second
    assert f"--coordinator-port {port} is in use on 127.0.0.2" in second["err"], second["err"]
    assert second["s"] < 15, second
    assert rc == 0, err.decode()[-3000:]  # the first job ran on unharmed
    assert out.count(b"sum 3.0") == 2, out


@pytest.mark.parametrize("hosts", [1, 2])
def test_plain_jax_initialize_joins_through_the_sockets(hosts, request):
    # JAX_COORDINATOR_BIND_ADDRESS names the socket: JAX's own default would be "[::]:" + a path.
    flags = ["--local", "--nproc-per-host", "2"] if hosts == 1 else request.getfixturevalue("sshd").launcher_flags(2)
    code = textwrap.dedent("""
        import os, jax
        jax.distributed.initialize()
        print("joined", jax.process_index(), jax.process_count(), os.environ["JAX_COORDINATOR_ADDRESS"][:5],
              flush=True)
    """)
    r = launch(*flags, "--cpu-devices", "1", "--", "python", "-c", code, timeout=90)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    assert b"joined 0 2 unix:" in r.stdout and b"joined 1 2 unix:" in r.stdout


def test_the_gate_relays_only_a_connection_that_proves_the_job_secret(tmp_path):
    from tpudist.launch.agent._gate import MAGIC, NONCE_BYTES, Gate, job_key, proof
    from tpudist.launch.control import control_pb2 as pb

    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        gate_at = "127.0.0.2:%d" % s.getsockname()[1]
    rank0 = socket.socket(socket.AF_UNIX)  # stands for rank 0's coordinator socket on worker 0
    rank0.bind(str(tmp_path / "w0.sock"))
    rank0.listen()
    rank0.settimeout(5)

    def start(rank: int, path: str):
        env = [pb.EnvVar(name=b"TPUDIST_COORDINATOR", value=f"unix:{path}".encode()),
               pb.EnvVar(name=b"TPUDIST_COORDINATOR_GATE", value=gate_at.encode())]
        return pb.Start(attempt=0, processes=[pb.ProcessSpec(rank=rank, env=env)])

    said = []
    worker0, worker1 = Gate("token", host="127.0.0.2", say=said.append), Gate("token", host="127.0.0.3", say=print)
    try:
        worker0.configure(start(0, str(tmp_path / "w0.sock")))
        relay = str(tmp_path / "w1.sock")
        worker1.configure(start(1, relay))
        assert os.stat(relay).st_mode & 0o777 == 0o600
        with socket.socket(socket.AF_UNIX) as client:  # a process on worker 1
            client.settimeout(5)
            client.connect(relay)
            client.sendall(b"ping")
            served, _ = rank0.accept()
            with served:
                served.settimeout(5)
                assert served.recv(4) == b"ping"
                served.sendall(b"pong")
                assert client.recv(4) == b"pong"
        host, port = gate_at.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5, source_address=("127.0.0.5", 0)) as c:
            nonce = c.recv(len(MAGIC) + NONCE_BYTES)[len(MAGIC):]
            c.sendall(proof(job_key("another job's token"), nonce))
            assert c.recv(1) == b""  # closed, never relayed
        rank0.settimeout(1)
        with pytest.raises(TimeoutError):
            rank0.accept()
        assert len(said) == 1 and "from 127.0.0.5:" in said[0] and "a wrong job secret" in said[0], said
    finally:
        worker0.close()
        worker1.close()
        rank0.close()
    assert not os.path.exists(relay)


@pytest.mark.parametrize("planted", ["open to others", "a link"])
def test_a_planted_socket_directory_is_refused_not_used(tmp_path, marker, planted):
    # The user's private directory for the coordinator's socket ($XDG_RUNTIME_DIR/tpudist here) was
    # created first by someone else: a directory open to all, or a link to one. The job must not
    # start in it, and must say which path is wrong and why.
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    if planted == "a link":
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        (runtime / "tpudist").symlink_to(elsewhere)
    else:
        (runtime / "tpudist").mkdir()
        os.chmod(runtime / "tpudist", 0o777)
    r = launch("--local", "--nproc-per-host", "1", "--", "python", "-c", "print('job ran')", marker,
               env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)}, timeout=60)
    err = r.stderr.decode()
    assert r.returncode != 0 and b"job ran" not in r.stdout, (r.returncode, err)
    why = "mode 777, open to others" if planted == "open to others" else "a symbolic link"
    assert f"{runtime / 'tpudist'} is not a private directory of this user ({why})" in err, err
    assert not any(p.name.endswith(".sock") for p in (runtime / "tpudist").iterdir())


def test_the_coordinator_socket_is_in_the_users_own_runtime_directory(tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    code = "import os; print('coordinator', os.environ['TPUDIST_COORDINATOR'])"
    r = launch("--local", "--nproc-per-host", "1", "--", "python", "-c", code,
               env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)}, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    assert f"coordinator unix:{runtime / 'tpudist'}/tpudist-".encode() in r.stdout, r.stdout
    assert stat.S_IMODE(os.lstat(runtime / "tpudist").st_mode) == 0o700


def test_a_socket_directory_owned_by_another_user_is_refused(tmp_path):
    from tpudist import _coordinator
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    assert _coordinator.private_dir(env) == str(runtime / "tpudist")  # made here, 0700
    assert stat.S_IMODE(os.lstat(runtime / "tpudist").st_mode) == 0o700
    if os.geteuid() != 0:
        pytest.skip("making a directory another user's needs root")
    os.chown(runtime / "tpudist", 65534, 65534)  # as if user nobody had created it first
    with pytest.raises(RuntimeError, match=rf"{runtime / 'tpudist'} is not a private directory of this user "
                                           rf"\(owned by uid 65534, not {os.getuid()}\)"):
        _coordinator.private_dir(env)
    # XDG_RUNTIME_DIR itself open to others: not used; /tmp/tpudist-<uid> instead
    os.chmod(runtime, 0o777)
    assert _coordinator.private_dir(env) == f"/tmp/tpudist-{os.getuid()}"
