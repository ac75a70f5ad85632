"""tpudist's torch path used for the first time where a user may first reach it."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import torch
import tpudist
torch.manual_seed(0)
layer = torch.nn.Linear(3, 2)
x = torch.randn(4, 3)
with torch.no_grad():  # the first use of tpudist.compile, inside no_grad (an inference script)
    got = tpudist.compile(layer)(x)
    want = layer(x)
assert torch.allclose(got, want, atol=1e-6), (got, want)
print("ok")
"""


def test_compile_first_used_inside_no_grad():
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
