"""hcstudy/kernels/triton_library.py: the Triton kernels as torch.library operators, so that torch.compile (what
--compile does: block.compile()) traces every block of the triton path as one graph, with and without
--activation-checkpointing, and equals eager; checkpointing recomputes the sublayers, not the connections, whose
kernels run once a step. In Triton's interpreter on the CPU, as tests/kernels/test_triton_ops.py runs them; dynamo's
"aot_eager" backend traces forward and backward as Inductor would, without its code generation."""
import collections

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from hcstudy import arms
from hcstudy.model import GPT, STREAM_DTYPES
from helpers import randomize_mixing, tiny_config

pytest.importorskip("triton", reason="triton is not installed (bash setup.sh --dev installs it)")
from hcstudy.kernels import triton_library, triton_ops as kernels  # noqa: E402

ARMS = ("hc", "mhc", "mhc-lite", "identity-hc")
FORWARD_KERNELS = ("_mhc_read_forward", "_hc_read_forward", "_write_forward")


def tiny_gpt(arm, checkpointing, kernels_path="triton"):
    """A depth-2 GPT with randomised mixing (3 Sinkhorn pairs and n = 3 for mHC-lite keep the interpreter short)."""
    torch.manual_seed(0)
    cfg = tiny_config(arm, depth=2, sinkhorn_iters=3, expansion=3 if arm == "mhc-lite" else 4,
                      activation_checkpointing=checkpointing)
    model = GPT(cfg, kernels=kernels_path)
    assert model.kernels == kernels_path
    randomize_mixing(model)
    return model


def train_step(model, steps=1):
    """The loss and every gradient of `steps` identical steps (the last one's)."""
    idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        model.zero_grad()
        _, loss = model(idx, idx)
        loss.backward()
    return {"loss": loss.detach(), **{name: p.grad.clone() for name, p in model.named_parameters()}}


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("arm", ARMS)
def test_every_block_of_the_triton_path_compiles_to_one_graph_that_equals_eager(arm, checkpointing):
    """Before the operators, the kernels sat behind torch.compiler.disable: 3 graphs a block without checkpointing
    (a break at each read and write), none with it (dynamo gave up on the checkpointed connection: attention and
    MLP ran eager). Both blocks share the one graph; a second step runs it again without compiling."""
    eager = train_step(tiny_gpt(arm, checkpointing))
    model = tiny_gpt(arm, checkpointing)
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    for block in model.blocks:
        block.compile(backend=counter)
    compiled = train_step(model, steps=2)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counter.frame_count == 1 and counters["stats"]["unique_graphs"] == 1
    assert counters["frames"]["total"] == counters["frames"]["ok"] > 0          # no frame gave up and ran eager
    for name, value in eager.items():   # the same kernels and the same torch ops: equal to the bit
        assert torch.equal(compiled[name], value), name
    torch._dynamo.reset()


class CountedKernel:
    """A kernel whose launches (kernel[grid](...)) are counted by name."""

    def __init__(self, name, counts):
        self.name, self.counts, self.kernel = name, counts, getattr(kernels, name)

    def __getitem__(self, grid):
        self.counts[self.name] += 1
        return self.kernel[grid]


@pytest.mark.parametrize("arm", ["hc", "mhc"])
def test_checkpointing_recomputes_the_sublayers_not_the_connections(arm, monkeypatch):
    """With checkpointing each connection's forward kernels run once a step (the read and the write: 2 per
    connection, 8 for 2 blocks), as without it; recomputing the connections would run them twice. The gradients
    equal those of the run without checkpointing to the bit, on the triton path and on the fused one (the same
    rule: their connections keep no n x C copy, train_c4.Block)."""
    kernels.load()                      # the real kernels in place first: a later load would replace the counters
    counts = collections.Counter()
    for name in FORWARD_KERNELS:
        monkeypatch.setattr(kernels, name, CountedKernel(name, counts))
    results = {}
    for checkpointing in (False, True):
        counts.clear()
        model = tiny_gpt(arm, checkpointing)
        assert model.blocks[0].checkpointed == ("sublayer" if checkpointing else False)
        results[checkpointing] = train_step(model)
        assert sum(counts.values()) == 2 * 2 * len(model.blocks), dict(counts)
    fused = {checkpointing: train_step(tiny_gpt(arm, checkpointing, "fused")) for checkpointing in (False, True)}
    for found, expected in ((results[True], results[False]), (fused[True], fused[False])):
        for name, value in expected.items():
            assert torch.equal(found[name], value), name


def test_the_formulas_recompute_their_connections_with_the_sublayers():
    """The formulas' autograd keeps n x C copies (the normalised state): under checkpointing their connection is
    recomputed with its sublayer, as before the kernels' paths changed rule."""
    assert tiny_gpt("mhc", True, "reference").blocks[0].checkpointed == "connection"
    assert tiny_gpt("baseline", True, "reference").blocks[0].checkpointed == "connection"


class Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Every call of this library's operators, with its arguments (cloned: a backward adds into one in place)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == triton_library.NAMESPACE:
            self.calls.append((func, [a.clone() if isinstance(a, torch.Tensor) else a for a in args]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arm,stream_dtype,project", [("hc", "bf16", True), ("mhc", "bf16", True),
                                                       ("mhc-lite", "fp32", True), ("mhc", "bf16", False)])
def test_each_operator_passes_torch_library_opcheck(arm, stream_dtype, project, monkeypatch):
    """torch.library.opcheck on every call one connection's step makes (a strided state): the schema (what a call
    mutates is what it declares, no output aliases an input: the column pass adds into the write's dx in place,
    bf16 where the kernel projects (HC's always), an fp32 accumulator where cuBLAS does, project=False), the fake implementation
    against the kernel (shapes, dtypes, strides) and AOTAutograd's dispatch with dynamic shapes."""
    if not project:
        monkeypatch.setattr(kernels, "PROJECTED_LOGITS", 0)
    cfg = tiny_config(arm, width=24, expansion=3, sinkhorn_iters=3, stream_dtype=stream_dtype)
    conn = arms.connection(arm)(cfg, 1, "triton")
    randomize_mixing(torch.nn.ModuleDict({"x_conn": conn}))
    x = torch.randn(2, 5, 3, 48).to(STREAM_DTYPES[stream_dtype])[..., ::2].requires_grad_()
    with Recorder() as recorder:
        out, _ = conn(x, torch.tanh)
        out.float().sum().backward()
    names = {func._opname for func, _ in recorder.calls}
    reads = {"hc": "hc_read"}.get(arm, "mhc_read")
    assert names == {f"{reads}_forward", f"{reads}_backward", f"{reads}_columns", "write_forward", "write_backward"}
    for func, args in recorder.calls:
        torch.library.opcheck(func, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
