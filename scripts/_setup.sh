# Sourced by scripts/demo and scripts/test: creates or reuses the project virtualenv and installs
# what is missing. Idempotent; a no-op (under a second) when everything is already there.
#   TPUDIST_VENV   virtualenv path (default: .venv in the repository)
#   PYTHON         interpreter that creates it (default: python3)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TPUDIST_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"

_say() { printf '[setup] %s\n' "$*" >&2; }

if [ ! -x "$PY" ]; then
  _say "creating virtualenv $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi

_stamp="$VENV/.tpudist-installed"
_want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/_setup.sh" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$_stamp" 2>/dev/null)" != "$_want" ] || ! "$PY" -c 'import tpudist, jax, torch' 2>/dev/null; then
  if ! "$PY" -c 'import torch' 2>/dev/null; then
    # The CPU build of torch, never the multi-GB CUDA one: a CPU wheel that pip can see locally
    # (pip's find-links), else PyTorch's CPU index.
    _say "installing the CPU build of torch"
    "$PY" -m pip install -q --no-index --no-deps torch 2>/dev/null \
      || "$PY" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu \
           --extra-index-url https://pypi.org/simple
  fi
  _say "installing tpudist and its test dependencies"
  # compat: a plain path entry in site-packages; the default editable finder costs every Python
  # start in the venv ~30 ms of imports (pathlib, re, urllib), the launcher's agents included.
  "$PY" -m pip install -q -e "$ROOT[test]" --config-settings editable_mode=compat
  echo "$_want" > "$_stamp"
fi

# The launcher's tests and benchmarks run a real OpenSSH server on loopback.
if [ ! -x /usr/sbin/sshd ] || ! command -v ssh >/dev/null || ! command -v pdsh >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    _say "installing openssh-server, openssh-client and pdsh"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client pdsh >/dev/null
  else
    _say "warning: OpenSSH server/client or pdsh missing; install openssh-server, openssh-client and pdsh"
  fi
fi
