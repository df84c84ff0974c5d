"""Every kernel of hcstudy/kernels/triton_kernels.py compiled for Hopper (sm_90) on this machine, no GPU needed: registers, spills,
stack and shared memory from ptxas's report, and the bytes each must move per token; then each arm with a triton
path, its floor beside its kernels' traffic and their ratio; then the bandwidth floor and the step ratio over the
baseline that the floor and mHC's traffic imply on an H100 and an H200.

    python benchmarks/triton_compile.py                      # width 2048, n 4, bf16 sublayers: docs/benchmarks.md
    python benchmarks/triton_compile.py --width 1024 --expansion 8
    python benchmarks/triton_compile.py --smoke --json out.json    # tests: n 3, width 96
    python benchmarks/triton_compile.py --stream-dtype bf16       # the state stored in bf16 (--stream-dtype)
    python benchmarks/triton_compile.py --expansion 6 --projected-logits 1024  # mhc-lite's 732 logits fused

The kernels are compiled as the JIT compiles them at a real launch: block sizes from triton_ops.block_sizes (and
dot_block_sizes where a kernel projects with tl.dot),
unit strides specialised to 1, pointers and multiples of 16 marked divisible by 16, 4 warps.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"          # compiled, not interpreted: triton_kernels.load keeps an explicit 0
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from hcstudy import arms  # noqa: E402
from hcstudy.config import parse_config  # noqa: E402
from hcstudy.contract import ConfigError  # noqa: E402
from hcstudy.planner import gpus, run_time  # noqa: E402
from hcstudy.kernels import triton_kernels as kernels  # noqa: E402
from hcstudy.kernels import triton_ops as K  # noqa: E402

K.load()                                      # the kernels as triton.jit made them, not their stand-ins

ACTIVATION_TYPES = {"_write_forward": {"y_ptr"}, "_write_backward": {"y_ptr", "gy_ptr"}}     # bf16: y and dy
# the pointers to the state or its gradient in --stream-dtype (the mHC family's column pass writes dx in fp32,
# gxo_ptr, where cuBLAS projects, else in the state's dtype; HC's always in the state's)
STATE_TYPES = {"_write_forward": {"x_ptr", "out_ptr"}, "_write_backward": {"x_ptr", "g_ptr", "gx_ptr"},
               "_mhc_read_forward": {"x_ptr"}, "_mhc_read_backward": {"x_ptr"},
               "_mhc_read_columns": {"x_ptr", "gx_ptr", "gxo_ptr"}, "_hc_read_forward": {"x_ptr"},
               "_hc_read_backward": {"x_ptr"}, "_hc_read_columns": {"x_ptr", "gx_ptr"}}
STREAM_DTYPES = {"fp32": ("*fp32", 4), "bf16": ("*bf16", 2)}        # pointer type, bytes of a state value
UNIT_STRIDES = {"sxc", "syc", "sgc"}
CARDS = {"H100 SXM": "NVIDIA H100 80GB HBM3", "H200": "NVIDIA H200"}
BANDWIDTH = {card: gpus.GPU_BANDWIDTH[name] for card, name in CARDS.items()}       # bytes/s, the datasheets'
PEAK = {card: gpus.GPU_PEAK_BF16_FLOPS[name] for card, name in CARDS.items()}


def variants(n: int, width: int):
    """(kernel, label, constexprs, arm, warps) for every kernel and every constexpr branch the arms take."""
    BT, BC, NP = K.block_sizes(n, width)
    blocks = dict(N=n, NP=NP, BT=BT, BC=BC)
    DT, DC, _ = K.dot_block_sizes(n, width)
    other = {"stored": "recompute", "recompute": "stored"}[K.SINKHORN_BACKWARD]
    mhc_family = [("mhc", 1, K.SINKHORN_BACKWARD == "stored"), (f"mhc {other}", 1, other == "stored"),
                  ("mhc-lite", 2, False), ("identity-hc", 0, False)]
    for label, mix, stored in mhc_family:
        arm = label.split()[0]
        R = arms.res_logit_count(arm, n)
        project, (KP, KT) = K._projects(2 * n + R), K._logit_tiles(2 * n + R)
        forward_blocks = dict(blocks, BT=DT, BC=DC) if project else blocks
        yield kernels._mhc_read_forward, label, {**forward_blocks, "MIX": mix, "R": R, "STORE_SUMS": stored,
                                                 "PROJECT": project, "KP": KP, "KT": KT,
                                                 "BR": K._chunk(R, forward_blocks["BT"], NP, KT > 0)}, arm, 4
        yield kernels._mhc_read_backward, label, {**blocks, "MIX": mix, "R": R, "STORED": stored,
                                                  "BR": K._chunk(R, BT, NP)}, arm, 4
        if label == arm:
            CT, CC, _, warps = K.column_blocks(n)
            columns = dict(N=n, NP=NP, PROJECT=project, KP=KP, KT=KT, BT=CT, BC=CC)
            yield kernels._mhc_read_columns, label, columns, arm, warps
    yield kernels._hc_read_forward, "hc", dict(blocks, BT=DT, BC=DC, KP=K._logit_pad(n + 2)), "hc", 4
    yield kernels._hc_read_backward, "hc", dict(blocks, KP=triton.next_power_of_2(n + 2)), "hc", 4
    HT, HC, _, warps = K.hc_column_blocks(n)
    yield kernels._hc_read_columns, "hc", dict(N=n, NP=NP, KP=K._logit_pad(n + 2), BT=HT, BC=HC), "hc", warps
    yield kernels._write_forward, "every arm", blocks, "mhc", 4
    yield kernels._write_backward, "every arm", blocks, "mhc", 4


def compile_for_hopper(kernel, constexprs: dict, width: int, stream_dtype: str = "fp32", warps: int = 4):
    """triton.compile of one kernel for sm_90 with the signature a real launch gives it (the state in stream_dtype)."""
    name = kernel.fn.__name__
    state = STATE_TYPES[name] - ({"gxo_ptr"} if constexprs.get("PROJECT") is False else set())
    constants = {**constexprs, **{arg: 1 for arg in kernel.arg_names if arg in UNIT_STRIDES}}
    signature, attrs = {}, {}
    for index, arg in enumerate(kernel.arg_names):
        if arg in constants:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = ("*bf16" if arg in ACTIVATION_TYPES.get(name, ()) else "*i32" if arg == "perm_ptr"
                              else STREAM_DTYPES[stream_dtype][0] if arg in state else "*fp32")
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif arg == "eps":
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
            if arg in ("C", "sxt", "sxn", "syt", "sgt", "sgn"):          # multiples of the width, 2048 here
                attrs[(index,)] = [["tt.divisibility", 16]] if width % 16 == 0 else []
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def ptxas_report(ptx: str) -> dict:
    """Registers, spills, stack and shared memory of the PTX's kernel, from ptxas -v (the ptxas triton ships)."""
    arch = re.search(r"\.target\s+(\S+)", ptx).group(1)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as file:
        file.write(ptx)
        file.flush()
        done = subprocess.run([str(ptxas), f"-arch={arch}", "-v", file.name, "-o", os.devnull], capture_output=True,
                              text=True, check=True)
    text = done.stderr
    number = lambda pattern: int(re.search(pattern, text).group(1))         # noqa: E731
    return {"arch": arch, "registers": number(r"Used (\d+) registers"),
            "spill_stores": number(r"(\d+) bytes spill stores"), "spill_loads": number(r"(\d+) bytes spill loads"),
            "stack": number(r"(\d+) bytes stack frame")}


def kernel_rows(n: int, width: int, stream_dtype: str = "fp32") -> list[dict]:
    rows, stream_bytes = [], STREAM_DTYPES[stream_dtype][1]
    for kernel, label, constexprs, arm, warps in variants(n, width):
        compiled = compile_for_hopper(kernel, constexprs, width, stream_dtype, warps)
        name = kernel.fn.__name__
        rows.append({"kernel": name, "variant": label, **ptxas_report(compiled.asm["ptx"]),
                     "shared": compiled.metadata.shared, "cubin_bytes": len(compiled.asm["cubin"]),
                     "bytes_per_token": K.traffic(arm, n, width, stream_bytes=stream_bytes)[name],
                     "blocks": {k: v for k, v in constexprs.items() if k in ("BT", "BC", "BR")}, "warps": warps})
        print(f"  {name:<20} {label:<14} {warps} warps {rows[-1]['registers']:>4} regs  "
              f"spills {rows[-1]['spill_stores']}/"
              f"{rows[-1]['spill_loads']} B  stack {rows[-1]['stack']} B  smem {rows[-1]['shared']:>6} B  "
              f"{rows[-1]['bytes_per_token'] / 1024:6.1f} KiB/token", flush=True)
    return rows


def arm_rows(rows: list[dict], n: int, width: int, stream_dtype: str = "fp32") -> list[dict]:
    """Every arm that registers a triton path (the registry's): its floor (triton_ops.floor) beside its kernels'
    traffic (triton_ops.traffic, cuBLAS and torch included), their ratio, and the spills of its kernels (the
    write's included); an arm that refuses this n says so instead."""
    found, stream_bytes = [], STREAM_DTYPES[stream_dtype][1]
    for arm in (name for name, declared in arms.ARMS.items() if "triton" in declared.kernels):
        try:
            parse_config(["--residual", arm, "--expansion", str(n)])
        except ConfigError as error:
            found.append({"arm": arm, "refused": str(error)})
            print(f"  {arm:<12} refused: {error}", flush=True)
            continue
        floor = sum(K.floor(n, width, stream_bytes=stream_bytes).values())
        traffic = sum(K.traffic(arm, n, width, stream_bytes=stream_bytes).values())
        own = [row for row in rows if row["variant"].split()[0] == arm or row["variant"] == "every arm"]
        spills = [sum(row[key] for row in own) for key in ("spill_stores", "spill_loads")]
        found.append({"arm": arm, "floor": floor, "traffic": traffic, "ratio": traffic / floor,
                      "spill_stores": spills[0], "spill_loads": spills[1]})
        print(f"  {arm:<12} floor {floor / 1024:7.1f} KiB/token  kernels {traffic / 1024:7.1f} KiB/token  "
              f"x {traffic / floor:.3f}  spills {spills[0]}/{spills[1]} B", flush=True)
    return found


def step_ratios(n: int, width: int, depth: int, stream_bytes: int = 4) -> list[dict]:
    """Step time over the baseline's, from the bytes the streams move beyond the baseline's residual (x + y, its
    state of stream_bytes a value as well, read and written both ways) at the card's bandwidth, over its FLOPs at the
    planner's share of the card's bf16 peak for matmuls (run_time.GEMM_SHARE). The 1.7B/2.5B models: width 2048, depth 32/48."""
    non_embedding = 12 * depth * width * width
    flops = 6 * non_embedding + 12 * depth * width * 1024
    s = stream_bytes
    baseline = 2 * (2 * s * width + 2 * width) + (3 * s * width + 2 * 2 * width)     # residual add, both ways
    rows = []
    for what, per_connection in (("floor", sum(K.floor(n, width, stream_bytes=s).values())),
                                 ("triton kernels", sum(K.traffic("mhc", n, width, stream_bytes=s).values()))):
        extra = 2 * depth * (per_connection - baseline)
        for card, bandwidth in BANDWIDTH.items():
            ratios = [1 + extra / bandwidth / (flops / (share * PEAK[card])) for share in run_time.GEMM_SHARE]
            rows.append({"traffic": what, "card": card, "bytes_per_token_per_connection": per_connection,
                         "ratio_at_matmul_share": dict(zip(map(str, run_time.GEMM_SHARE), ratios))})
            print(f"  {what:<15} {card:<9} {per_connection / 1024:6.1f} KiB/token/connection: step x "
                  f"{min(ratios):.2f}-{max(ratios):.2f} of the baseline's matmuls at {run_time.GEMM_SHARE[1]:.0%}-"
                  f"{run_time.GEMM_SHARE[0]:.0%} of the peak", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--expansion", type=int, default=4)
    p.add_argument("--depth", type=int, default=32, help="for the step ratio (the 1.7B model: 32)")
    p.add_argument("--stream-dtype", choices=tuple(STREAM_DTYPES), default="fp32", help="the state's dtype")
    p.add_argument("--smoke", action="store_true", help="n 3, width 96: what the tests compile")
    p.add_argument("--projected-logits", type=int, default=K.PROJECTED_LOGITS,
                   help="the most logits a token the read kernels project themselves (triton_ops.PROJECTED_LOGITS): "
                   "raised, mhc-lite's 732 logits at n = 6 compile into the kernels (128 and 1,024 a tile) instead "
                   "of cuBLAS")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    K.PROJECTED_LOGITS = args.projected_logits
    n, width = (3, 96) if args.smoke else (args.expansion, args.width)
    BT, BC, NP = K.block_sizes(n, width)
    DT, DC, _ = K.dot_block_sizes(n, width)
    CT, CC, _, _ = K.column_blocks(n)
    HT, HC, _, _ = K.hc_column_blocks(n)
    print(f"triton {triton.__version__}, sm_90, n {n}, width {width}, {args.stream_dtype} streams: {BT} tokens x "
          f"{BC} channels per program ({DT} x {DC} where the read projects, {CT} x {CC} in its column pass, {HT} x "
          f"{HC} in HC's)")
    rows = kernel_rows(n, width, args.stream_dtype)
    print(f"each arm's connection, forward and backward (n {n}, width {width}, {args.stream_dtype} streams):")
    per_arm = arm_rows(rows, n, width, args.stream_dtype)
    print(f"bandwidth floor and step ratio (mHC, n {n}, width {width}, depth {args.depth}, {args.stream_dtype} "
          "streams):")
    ratios = step_ratios(n, width, args.depth, STREAM_DTYPES[args.stream_dtype][1])
    if args.json:
        Path(args.json).write_text(json.dumps({"triton": triton.__version__, "n": n, "width": width,
                                               "stream_dtype": args.stream_dtype,
                                               "kernels": rows, "arms": per_arm, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
