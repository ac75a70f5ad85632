"""The agent's deferred imports (tpudist/launch/agent/_deferred.py), each case in a fresh interpreter so
that this pytest process's modules are untouched."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_python(code: str, tmp_path=None) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_agents_grpc_traffic_leaves_the_deferred_modules_unloaded():
    # What the agent does with grpc and protobuf (messages built, serialized, parsed; a real
    # channel and server with the generated stubs) must not need them, or deferring gains nothing.
    out = run_python(f"""
        from tpudist.launch.agent import _deferred
        assert _deferred.defer(_deferred.AGENT_MODULES) == sorted(_deferred.AGENT_MODULES)
        from concurrent import futures
        import grpc
        from tpudist.launch.control import control_pb2 as pb, control_pb2_grpc as pb_grpc

        class Control(pb_grpc.ControlServicer):
            def Register(self, request, context):
                return pb.RegisterReply(job_id=request.host + request.versions["python"])

            def Session(self, messages, context):
                for _ in messages:
                    yield pb.LauncherMessage()

        server = grpc.server(futures.ThreadPoolExecutor(2))
        pb_grpc.add_ControlServicer_to_server(Control(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        with grpc.insecure_channel(f"127.0.0.1:{{port}}") as channel:
            stub = pb_grpc.ControlStub(channel)
            reply = stub.Register(pb.RegisterRequest(host="h\\u00e9", versions={{"python": "3"}}), timeout=30)
            assert reply.job_id == "h\\u00e93", reply
            assert len(list(stub.Session(iter([pb.AgentMessage()] * 3), timeout=30))) == 3
        server.stop(None)
        request = pb.RegisterRequest.FromString(pb.RegisterRequest(host="x", worker=3).SerializeToString())
        assert (request.host, request.worker) == ("x", 3)
        print([_deferred.is_loaded(n) for n in _deferred.AGENT_MODULES])
    """)
    assert out.strip() == "[False, False, False]"


def test_a_deferred_module_is_whole_on_first_use():
    out = run_python("""
        import sys
        from tpudist.launch.agent import _deferred
        _deferred.defer(_deferred.AGENT_MODULES)
        import asyncio                      # binds the placeholder
        import grpc
        assert not _deferred.is_loaded("asyncio") and not _deferred.is_loaded("grpc.aio")

        async def answer():
            channel = grpc.aio.insecure_channel("127.0.0.1:1")
            await channel.close()
            await asyncio.sleep(0)
            return type(channel).__name__, 42
        print(*asyncio.run(answer()))       # the first attribute read loads it
        from asyncio import events          # submodules and from-imports as usual
        print(events is sys.modules["asyncio.events"], type(asyncio.Queue()).__name__)
        from google.protobuf.internal import python_message
        print(callable(python_message.GeneratedProtocolMessageType))
        import google.protobuf.internal as package  # bound on its package, as any import is
        print(package.python_message is python_message is sys.modules[python_message.__name__])
    """)
    assert out.split() == ["Channel", "42", "True", "Queue", "True", "True"]


def test_already_imported_modules_are_left_alone_and_missing_ones_fail_as_usual():
    out = run_python("""
        import json, sys
        from tpudist.launch.agent import _deferred
        print(_deferred.defer(["json", "no_such_module_tpudist", "csv"]))
        import csv
        print(type(sys.modules["json"]).__name__, _deferred.is_loaded("csv"), csv.QUOTE_ALL == 1)
        try:
            import no_such_module_tpudist
        except ModuleNotFoundError as e:
            print(e.name)
    """)
    assert out.splitlines() == ["['csv', 'no_such_module_tpudist']", "module False True",
                                "no_such_module_tpudist"]


def test_a_module_that_fails_to_load_raises_its_error_and_is_retried(tmp_path):
    (tmp_path / "flaky_tpudist.py").write_text(textwrap.dedent("""
        import os
        if not os.path.exists("ok"):
            raise RuntimeError("flaky_tpudist cannot load yet")
        VALUE = 7
    """))
    out = run_python("""
        import sys
        sys.path.insert(0, ".")
        from tpudist.launch.agent import _deferred
        _deferred.defer(["flaky_tpudist"])
        import flaky_tpudist
        try:
            flaky_tpudist.VALUE
        except RuntimeError as e:
            print("raised:", e)
        print("flaky_tpudist" in sys.modules)
        open("ok", "w").close()
        import flaky_tpudist
        print(flaky_tpudist.VALUE)
    """, tmp_path)
    assert out.splitlines() == ["raised: flaky_tpudist cannot load yet", "False", "7"]


def test_the_agents_start_up_and_the_launch_package_import_no_framework():
    # What every host's agent imports before it registers (its __main__ minus running it), and what
    # importing the launch package and its config costs: never jax, torch or grpc's asyncio half.
    # (dataclasses, ~1-3 ms, it may: the agent reads the environment contract for the coordinator gate.)
    out = run_python("""
        import sys
        from tpudist.launch.agent import _deferred
        _deferred.defer(_deferred.AGENT_MODULES)
        import tpudist.launch.agent._agent
        print(sorted(m for m in ("jax", "torch", "numpy", "paramiko")
                     if m in sys.modules), [_deferred.is_loaded(m) for m in _deferred.AGENT_MODULES])
    """)
    assert out.splitlines() == ["[] [False, False, False]"]
    out = run_python("""
        import sys
        import tpudist.launch
        from tpudist.launch import LaunchConfig, parse_args
        parse_args(["--hosts", "a,b", "--", "python", "train.py"])
        print(sorted(m for m in ("jax", "torch", "grpc", "paramiko") if m in sys.modules))
    """)
    assert out.strip() == "[]"
