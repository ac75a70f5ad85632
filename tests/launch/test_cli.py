"""The launcher's command line, hostfiles and --dry-run plan: everything decided before a host is touched."""

from __future__ import annotations

import json
import os
import sys

import pytest
from launchutil import launch

from tpudist import contract
from tpudist.launch.args import parse_args
from tpudist.launch.clusters import resolve_cluster, verdicts
from tpudist.launch.clusters.hostfile import parse_hostfile
from tpudist.launch.clusters.hosts import parse_host, parse_hosts

SEED = ("--tpu=my-tpu --conda-env=torch-xla-1.6 --env ANY_ENV_VAR=VALUE -- "
        "python /path/to/your/code.py --train_arg1 --train_arg2").split()


def test_seed_command_line_parses_verbatim():
    config = parse_args(SEED)
    assert config.cluster.tpu == "my-tpu" and config.procs.conda_env == "torch-xla-1.6"
    assert config.procs.env == {"ANY_ENV_VAR": "VALUE"}
    assert config.procs.command == ("python", "/path/to/your/code.py", "--train_arg1", "--train_arg2")


def test_command_after_double_dash_is_kept_verbatim_even_if_it_looks_like_flags():
    config = parse_args(["--local", "--", "python", "--local", "--", "-x", "--env", "A=1"])
    assert config.procs.command == ("python", "--local", "--", "-x", "--env", "A=1")
    assert config.procs.env == {}


@pytest.mark.parametrize("value, fragment", [
    ("TPUDIST_TEST_UNSET_NAME", "TPUDIST_TEST_UNSET_NAME is not set in the launcher's environment"),
    ("MY_TOKEN hunter2", "'MY_TOKEN ...' is not a valid variable name"),
    ("1ABC=hunter2", "'1ABC' is not a valid variable name"),
    ("A-B=hunter2", "'A-B' is not a valid variable name"),
    ("=hunter2", "'' is not a valid variable name"),
    ("RANK=hunter2", "RANK is set by the launcher"),
])
def test_bad_env_values_are_refused_naming_the_variable_never_its_value(value, fragment):
    with pytest.raises(ValueError) as e:
        parse_args(["--env", value, "--", "true"])
    assert fragment in str(e.value) and "hunter2" not in str(e.value)


def test_env_name_alone_passes_the_launchers_own_value(monkeypatch):
    monkeypatch.setenv("TPUDIST_TEST_TOKEN", "s3cr3t=x y")
    assert parse_args(["--env", "TPUDIST_TEST_TOKEN", "--", "true"]).procs.env == {"TPUDIST_TEST_TOKEN": "s3cr3t=x y"}


def test_env_file_lines_comments_quotes_and_errors_with_line_numbers(tmp_path, monkeypatch):
    monkeypatch.setenv("FROM_LAUNCHER", "mine")
    path = tmp_path / "job.env"
    path.write_text("# a comment\n\nA=1\nexport B = two words \nC=\"quoted # not a comment\"\n"
                    "D='x'\nE=a=b\nFROM_LAUNCHER\nA=again\n")
    env = parse_args(["--env-file", str(path), "--env", "E=cli", "--", "true"]).procs.env
    assert env == {"A": "again", "B": "two words", "C": "quoted # not a comment", "D": "x", "E": "cli",
                   "FROM_LAUNCHER": "mine"}
    path.write_text("OK=1\n# fine\nMY_API_KEY hunter2\n")
    with pytest.raises(ValueError) as e:
        parse_args(["--env-file", str(path), "--", "true"])
    assert f"--env-file {path} line 3: 'MY_API_KEY ...' is not a valid variable name" in str(e.value)
    assert "hunter2" not in str(e.value)
    path.write_text("RANK=1\n")
    with pytest.raises(ValueError, match="line 1: RANK is set by the launcher"):
        parse_args(["--env-file", str(path), "--", "true"])
    with pytest.raises(ValueError, match="--env-file .*missing.env: cannot read it"):
        parse_args(["--env-file", str(tmp_path / "missing.env"), "--", "true"])


def test_dry_run_masks_secret_looking_values_and_warns_about_secrets_in_argv(tmp_path):
    (tmp_path / "job.env").write_text("HF_TOKEN=hf_abc123\nDB_Password=pw456\nPLAIN=visible\n")
    env = {**os.environ, "WANDB_API_KEY": "wandb789"}
    r = launch("--env-file", str(tmp_path / "job.env"), "--env", "WANDB_API_KEY", "--env", "MY_SECRET=argv000",
               "--dry-run", "--", "python", "t.py", env=env)
    assert r.returncode == 0, r.stderr.decode()
    for secret in (b"hf_abc123", b"pw456", b"wandb789", b"argv000"):
        assert secret not in r.stdout and secret not in r.stderr
    shown = json.loads(r.stdout)["processes"][0]["env"]
    assert [shown[k] for k in ("HF_TOKEN", "DB_Password", "WANDB_API_KEY", "MY_SECRET", "PLAIN")] == [
        "<hidden>", "<hidden>", "<hidden>", "<hidden>", "visible"]
    assert b"warning: the value of --env MY_SECRET=... is in this command line" in r.stderr
    assert b"WANDB_API_KEY=" not in r.stderr  # given by name: nothing to warn about


def test_env_values_keep_every_character():
    hostile = "a=b c'\"$(x)`y`;\n\tü"
    assert parse_args(["--env", f"K={hostile}", "--", "true"]).procs.env == {"K": hostile}


def test_bad_env_exits_2_with_the_value_on_stderr():
    r = launch("--env", "BAD-NAME=1", "--", "true")
    assert r.returncode == 2
    assert b"BAD-NAME" in r.stderr and b"not a valid variable name" in r.stderr


def test_hostfile_mpi_format(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# workers\n\n10.0.0.2 slots=4\n  ubuntu@10.0.0.3:2222   slots=2  # second\n"
                    "10.0.0.4\n[fe80::1]:22 max_slots=8\n")
    hosts = parse_hostfile(str(path))
    assert [(h.address, h.user, h.port, h.slots) for h in hosts] == [
        ("10.0.0.2", None, None, 4), ("10.0.0.3", "ubuntu", 2222, 2), ("10.0.0.4", None, None, None),
        ("fe80::1", None, 22, None)]


@pytest.mark.parametrize("line, fragment", [
    ("host1 slots=four", "slots='four' must be a positive integer"),
    ("host1 slots=0", "slots='0' must be a positive integer"),
    ("host1 gpus=2", "unknown option 'gpus=2'"),
    ("host1 slots", "unknown option 'slots'"),
    ("user@@host", "is not of the form"),
    ("host1:99999", "port 99999"),
])
def test_bad_hostfile_line_names_file_and_line(tmp_path, line, fragment):
    path = tmp_path / "hosts"
    path.write_text(f"# header\ngood-host slots=1\n{line}\n")
    with pytest.raises(ValueError) as e:
        parse_hostfile(str(path))
    assert str(e.value).startswith(f"{path}:3: ") and fragment in str(e.value)


def test_hostfile_errors_reach_the_user(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a slots=2\na slots=1\n")
    r = launch("--hostfile", str(path), "--", "true")
    assert r.returncode == 2 and b"listed twice" in r.stderr
    r = launch("--hostfile", str(tmp_path / "missing"), "--", "true")
    assert r.returncode == 2 and b"cannot read --hostfile" in r.stderr


def test_hosts_flag():
    hosts = parse_hosts("a, root@b:2200 ,[::1]:22")
    assert [(h.address, h.user, h.port) for h in hosts] == [("a", None, None), ("b", "root", 2200), ("::1", None, 22)]
    with pytest.raises(ValueError, match="empty host name"):
        parse_hosts("a,,b")
    assert parse_host("x").port is None


def test_local_is_the_default_and_explicit_flags_win():
    found = dict(verdicts(parse_args(["--", "true"]).cluster))
    assert found["local"].applies and not found["hosts"].applies
    found = dict(verdicts(parse_args(["--hosts", "a,b", "--", "true"]).cluster))
    assert found["hosts"].applies and not found["local"].applies
    assert resolve_cluster(parse_args(["--hosts", "a,b", "--", "true"]).cluster).source == "hosts"


def test_doctor_prints_every_sources_verdict():
    import subprocess

    r = subprocess.run([sys.executable, "-m", "tpudist", "doctor", "--hosts", "a,b"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    names = [name for name, _ in verdicts(parse_args(["--", "true"]).cluster)]
    for name in names:
        assert any(line.split()[0] == name for line in r.stdout.splitlines() if line.strip()), (name, r.stdout)
    assert "chosen: hosts: 2 host(s): a, b" in r.stdout


def _plan(*flags: str) -> list[dict]:
    r = launch(*flags, "--dry-run", "--", "python", "train.py", "--lr", "0.1")
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)["processes"]


def test_dry_run_plan_for_hosts_has_every_variable_the_launcher_sets(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.2 slots=2\n127.0.0.3 slots=1\n")
    procs = _plan("--hostfile", str(hostfile), "--cpu-devices", "2", "--env", "A=x y", "--workdir", str(tmp_path))
    assert [(p["host"], p["worker"], p["rank"], p["local_rank"]) for p in procs] == [
        ("127.0.0.2", 0, 0, 0), ("127.0.0.2", 0, 1, 1), ("127.0.0.3", 1, 2, 0)]
    coordinators = set()
    for p in procs:
        env = p["env"]
        assert p["argv"] == ["python", "train.py", "--lr", "0.1"]
        assert p["cwd"] == str(tmp_path)
        assert p["path_prepend"] == [os.path.dirname(sys.executable)]
        job = contract.JobEnv.from_environ(env)  # the runtime's own reader accepts the plan
        assert (job.rank, job.world_size, job.local_rank, job.worker, job.num_workers) == (
            p["rank"], 3, p["local_rank"], p["worker"], 2)
        assert job.local_world_size == (2 if p["worker"] == 0 else 1)
        assert job.master_addr == "127.0.0.2" and job.cpu_devices == 2 and job.platform == "cpu"
        assert job.host == p["host"]
        # each host's processes reach the JAX coordinator through their own agent's private socket,
        # relayed to the gate worker 0's agent keeps on its address (tpudist/launch/agent/_gate.py)
        assert job.coordinator.startswith("unix:") and f"-w{p['worker']}" in job.coordinator
        host, port = env[contract.COORDINATOR_GATE].rsplit(":", 1)
        assert host == "127.0.0.2" and int(port) != job.master_port
        coordinators.add((env[contract.COORDINATOR_GATE], job.master_port))
        assert env["A"] == "x y" and env["PYTHONUNBUFFERED"] == "1"
    assert len(coordinators) == 1


def test_dry_run_asks_glibc_for_huge_pages_unless_the_user_decides():
    base = {k: v for k, v in os.environ.items() if k not in (contract.GLIBC_TUNABLES, contract.HUGEPAGES)}

    def tunables(*flags: str, **env: str) -> set:
        r = launch("--nproc-per-host", "2", *flags, "--dry-run", "--", "python", "t.py", env={**base, **env})
        assert r.returncode == 0, r.stderr.decode()
        return {p["env"].get(contract.GLIBC_TUNABLES) for p in json.loads(r.stdout)["processes"]}

    assert tunables() == {"glibc.malloc.hugetlb=1"}
    assert tunables("--env", "GLIBC_TUNABLES=glibc.malloc.arena_max=2") == {"glibc.malloc.arena_max=2"}
    assert tunables("--env", "TPUDIST_HUGEPAGES=0") == {None}
    assert tunables(GLIBC_TUNABLES="glibc.malloc.arena_max=2") == {None}  # the hosts' own setting stands
    assert tunables(TPUDIST_HUGEPAGES="0") == {None}


def test_dry_run_local_uses_loopback_and_a_private_coordinator_socket():
    procs = _plan("--nproc-per-host", "2")
    env = procs[0]["env"]
    assert env[contract.MASTER_ADDR] == "127.0.0.1"
    # one host: the JAX coordinator is a Unix socket (only the job's user can open it), no TCP port
    assert env[contract.COORDINATOR] == "unix:${TPUDIST_PRIVATE_DIR}/tpudist-dry-run-0.sock"
    assert env[contract.JAX_COORDINATOR_ADDRESS] == env[contract.JAX_COORDINATOR_BIND_ADDRESS]
    assert env[contract.JAX_COORDINATOR_ADDRESS] == env[contract.COORDINATOR]
    assert [p["rank"] for p in procs] == [0, 1]
    r = launch("--coordinator-port", "5555", "--dry-run", "--", "true")
    assert r.returncode == 0 and b"--coordinator-port 5555 is not used: a one-host job's JAX coordinator" in r.stderr


def test_dry_run_venv_and_conda_choices(tmp_path):
    venv = tmp_path / "venv"
    procs = _plan("--venv", str(venv))
    assert procs[0]["path_prepend"] == [str(venv / "bin")] and procs[0]["env"]["VIRTUAL_ENV"] == str(venv)
    procs = _plan("--conda-env", "torch-xla-1.6")
    assert procs[0]["conda_env"] == "torch-xla-1.6" and procs[0]["path_prepend"] == []


def test_ranks_filter_must_name_existing_ranks():
    r = launch("--nproc-per-host", "2", "--ranks-filter", "0,5", "--", "true")
    assert r.returncode == 2 and b"ranks 0..1" in r.stderr
    r = launch("--ranks-filter", "zero", "--", "true")
    assert r.returncode == 2 and b"'zero'" in r.stderr


def test_log_prefix_fields_are_checked():
    with pytest.raises(ValueError, match=r"\['gpu'\]"):
        parse_args(["--log-prefix", "{gpu}: ", "--", "true"])
