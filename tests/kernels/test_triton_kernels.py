"""hcstudy/kernels/triton_kernels.py: every kernel compiled for an H100 (sm_90) on this machine without a GPU, its
registers and binary there, and each arm's traffic above its floor. The kernels' numbers against the formulas are
tested through the operators that launch them (tests/kernels/test_triton_ops.py, test_paths.py)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hcstudy import arms

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_kernel_compiles_for_hopper_without_a_gpu(tmp_path):
    """benchmarks/triton_compile.py --smoke: each kernel of a small config through triton.compile for sm_90 and
    ptxas, here on a machine without a GPU."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_compile.py"), "--smoke", "--json",
                           str(tmp_path / "compile.json")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads((tmp_path / "compile.json").read_text())
    assert {row["kernel"] for row in found["kernels"]} == {"_mhc_read_forward", "_mhc_read_backward",
                                                            "_mhc_read_columns", "_hc_read_forward",
                                                            "_hc_read_backward", "_hc_read_columns",
                                                            "_write_forward", "_write_backward"}
    for row in found["kernels"]:
        assert row["registers"] > 0 and row["cubin_bytes"] > 0, row
    # each arm with a triton path, its traffic beside its floor (which no kernel can move less than)
    assert [row["arm"] for row in found["arms"]] == [arm for arm, declared in arms.ARMS.items()
                                                     if "triton" in declared.kernels]
    for row in found["arms"]:
        assert row["traffic"] > row["floor"] > 0 and row["ratio"] == row["traffic"] / row["floor"], row
