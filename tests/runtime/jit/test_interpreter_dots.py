"""A user's process under ``TRITON_INTERPRET=1`` (no test-suite set-up) gets the uniform interpreter dots at its first
launch, not at import: identical keys tie, so a row selects the same groups in a 5-row call as alone."""

import json
import os
import subprocess
import sys

_CHILD = r"""
import json, torch
import qsa_aiter
from qsa_aiter.runtime.jit import triton_compat
from triton.runtime import interpreter

installed = lambda: bool(getattr(interpreter.InterpreterBuilder.create_dot, "uniform_sums", False))
after_import = installed()
pages, page, dim, rows = 8, 64, 128, 5
cache = torch.ones(pages, page, 1, dim, dtype=torch.bfloat16)  # every key equal
table = torch.arange(pages, dtype=torch.int32)[None]
q = torch.randn(rows, 4, dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
lens = torch.tensor([pages * page * 4], dtype=torch.int32)
pos = torch.arange(rows, dtype=torch.int32) + pages * page * 4 - rows
req = torch.zeros(rows, dtype=torch.int32)
batch = qsa_aiter.qsa_select_paged_tokens(q, cache, table, req, pos, lens, 16, phase="prefill")
alone = qsa_aiter.qsa_select_paged_tokens(q[-1:], cache, table, req[-1:], pos[-1:], lens, 16, phase="prefill")
print(json.dumps(dict(after_import=after_import, after_call=installed(), batch=batch[-1, :16].tolist(),
                      alone=alone[0, :16].tolist())))
"""


def test_first_interpreted_launch_installs_the_uniform_dots():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QSA_AITER", "ATOM_QSA"))}
    env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert not got["after_import"], "importing qsa_aiter must not patch the interpreter"
    assert got["after_call"]
    assert got["batch"] == got["alone"] == list(range(16)), got
