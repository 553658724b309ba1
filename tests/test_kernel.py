"""kernel.py: the fused kernels in the Triton interpreter on the CPU (compiled for sm_90, not run, in one
test). The interpreter is slow: shapes are tiny."""
import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import kernel
import mhar
from helpers import rel_err, route_inputs
from kernel import FusedHistory, fused_route


DEVICE = "cuda" if torch.cuda.is_available() and not kernel.INTERPRETED else "cpu"


@pytest.fixture
def nan_outputs(monkeypatch):
    """Every torch.empty returns NaNs, so an element a kernel never writes cannot pass."""
    def nan_empty(*size, **kwargs):
        shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
        return torch.full(shape, math.nan, **kwargs)
    monkeypatch.setattr(torch, "empty", nan_empty)


def route_and_grads(route, V, q, g, dout, heads):
    """Output and (dV, dq, dg) of one route call."""
    V, q, g = (x.clone().requires_grad_() for x in (V, q, g))
    out = route(V, q, g, heads)
    out.backward(dout.to(out.dtype))
    return out, V.grad, q.grad, g.grad


@pytest.mark.parametrize("N", [1, 2, 9], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("heads", [1, 2, 4, 8], ids=lambda h: f"H{h}")
def test_fused_route_matches_reference_fp32(nan_outputs, heads, N):
    # d = 40: not a power of two, and neither are the head widths 40, 20, 10, 5; B·T = 15 is odd.
    V, q, g, dout = route_inputs(N, 3, 5, 40, dtype=torch.float32, device=DEVICE)
    fused = route_and_grads(fused_route, V, q, g, dout, heads)
    reference = route_and_grads(mhar.route, V, q, g, dout, heads)
    for name, a, b in zip(("out", "dV", "dq", "dg"), fused, reference):
        assert a.dtype == b.dtype, name
        assert rel_err(a, b) < 1e-5, f"{name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("heads,N", [(4, 9), (8, 2)], ids=["H4-N9", "H8-N2"])
def test_fused_route_bf16_within_rounding(nan_outputs, heads, N):
    V, q, g, dout = route_inputs(N, 1, 7, 24, dtype=torch.bfloat16, device=DEVICE)
    out, dV, dq, dg = route_and_grads(fused_route, V, q, g, dout, heads)
    assert out.dtype == dV.dtype == torch.bfloat16 and dq.dtype == dg.dtype == torch.float32
    # the float32 reference on the same bf16-rounded sources and output gradient
    reference = route_and_grads(mhar.route, V.float(), q, g, dout.float(), heads)
    for name, a, b, tolerance in zip(("out", "dV", "dq", "dg"), (out, dV, dq, dg), reference,
                                     (1e-2, 1e-2, 1e-5, 1e-5)):     # out, dV are rounded to bf16's 8 bits
        assert rel_err(a, b) < tolerance, f"{name}: {rel_err(a, b):.2e}"


def test_fused_route_bitwise_deterministic():
    V, q, g, dout = route_inputs(9, 3, 5, 40, dtype=torch.float32, device=DEVICE)
    first = route_and_grads(fused_route, V, q, g, dout, 4)
    second = route_and_grads(fused_route, V, q, g, dout, 4)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_fused_route_rejects_what_it_cannot_run():
    V, q, g, _ = route_inputs(2, 1, 1, 24, dtype=torch.float32, device=DEVICE)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        fused_route(V.double(), q, g, 4)
    with pytest.raises(ValueError, match="divisible"):
        fused_route(V, q, g, 5)
    wide = torch.zeros(1, 1, 1, 2 * kernel.MAX_TILE, device=DEVICE)
    ones = torch.ones(2 * kernel.MAX_TILE, device=DEVICE)
    with pytest.raises(ValueError, match="fused=False"):
        fused_route(wide, ones, ones, 1)


def chain(s0, qs, gs, layers, route_site):
    """A network of len(qs) sites with linear sublayers; route_site(site, source, q, g) -> output."""
    h = route_site(0, s0, qs[0], gs[0])
    for j, layer in enumerate(layers):
        h = route_site(j + 1, layer(h), qs[j + 1], gs[j + 1])
    return h


def stacked_route_site(heads):
    """The readable path: keep the sources in a list and stack them for every site."""
    sources = []

    def route_site(site, source, q, g):
        sources.append(source)
        return mhar.route(torch.stack(sources), q, g, heads)
    return route_site


def fused_route_site(history):
    return lambda site, source, q, g: history.route(source, q, g)


def chain_parameters(sites, d, heads, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(3, 5, d, device=DEVICE)
    embed = torch.nn.Linear(d, d, bias=False, device=DEVICE)
    layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(d, d, bias=False), torch.nn.Tanh())
                                  for _ in range(sites - 1)]).to(DEVICE)
    qs = [torch.nn.Parameter(0.3 * torch.randn(d, device=DEVICE)) for _ in range(sites)]
    gs = [torch.nn.Parameter(1 + 0.1 * torch.randn(d, device=DEVICE)) for _ in range(sites)]
    return x, embed, layers, qs, gs


@pytest.mark.parametrize("heads", [1, 4], ids=lambda h: f"H{h}")
def test_fused_history_matches_stacked_chain(nan_outputs, heads):
    sites, d = 5, 40
    x, embed, layers, qs, gs = chain_parameters(sites, d, heads)
    x.requires_grad_()
    parameters = [x, *embed.parameters(), *layers.parameters(), *qs, *gs]
    dout = torch.randn(3, 5, d, device=DEVICE)
    results = []
    for route_site in (fused_route_site(FusedHistory(sites, heads)), stacked_route_site(heads)):
        out = chain(embed(x), qs, gs, layers, route_site)
        grads = torch.autograd.grad(out, parameters, dout)
        results.append((out, *grads))
    for i, (a, b) in enumerate(zip(*results)):
        # site 0 reads one source: its dq, dg are exactly zero on both paths
        assert rel_err(a, b) < 1e-5, f"tensor {i}: {rel_err(a, b):.2e}"


def test_fused_history_without_grad():
    sites, d, heads = 3, 24, 2
    x, embed, layers, qs, gs = chain_parameters(sites, d, heads)
    with torch.no_grad():
        history = FusedHistory(sites, heads)
        fused = chain(embed(x), qs, gs, layers, fused_route_site(history))
        reference = chain(embed(x), qs, gs, layers, stacked_route_site(heads))
    assert history.grads is None
    assert rel_err(fused, reference) < 1e-5


def test_fused_history_bitwise_deterministic():
    sites, d, heads = 3, 24, 2
    x, embed, layers, qs, gs = chain_parameters(sites, d, heads)
    runs = []
    for _ in range(2):
        out = chain(embed(x), qs, gs, layers, fused_route_site(FusedHistory(sites, heads)))
        runs.append((out, *torch.autograd.grad(out.square().sum(), [*layers.parameters(), *qs, *gs])))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_fused_history_rejects_checkpointing():
    sites, d, heads = 3, 24, 2
    x, embed, layers, qs, gs = chain_parameters(sites, d, heads)
    history = FusedHistory(sites, heads)
    route = fused_route_site(history)

    def checkpointed(site, source, q, g):
        return checkpoint(route, site, source, q, g, use_reentrant=False)
    out = chain(embed(x), qs, gs, layers, checkpointed)
    with pytest.raises(RuntimeError, match="checkpointing"):
        out.sum().backward()


def test_fused_history_rejects_second_backward():
    sites, d, heads = 3, 24, 2
    x, embed, layers, qs, gs = chain_parameters(sites, d, heads)
    out = chain(embed(x), qs, gs, layers, fused_route_site(FusedHistory(sites, heads)))
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        out.sum().backward()


def test_fused_history_rejects_more_sources_than_rows():
    history = FusedHistory(1, heads=2)
    source, q, g, _ = route_inputs(1, 1, 3, 24, dtype=torch.float32, device=DEVICE)
    history.route(source[0], q, g)
    with pytest.raises(RuntimeError, match="n_sources=1"):
        history.route(source[0], q, g)


@pytest.mark.parametrize("overrides", [
    dict(residual="mhar"), dict(residual="attnres"), dict(residual="mhar", route_block=2),
    dict(residual="mhar", delta=True, route_block=2),
], ids=["full-FusedHistory", "attnres-FusedHistory", "block-fused_route", "delta-fused_route"])
def test_gpt_fused_matches_readable(overrides):
    """The model with fused=True: same loss and parameter gradients as the readable routing (fp32)."""
    torch.manual_seed(0)
    readable = mhar.GPT(mhar.preset("tiny", **overrides)).to(DEVICE)
    with torch.no_grad():
        for site in readable.sites:
            site.query.normal_(0, 0.3)                        # zero queries would hide the logit path
            if site.gate is not None:
                site.gate.fill_(0.5)                          # a closed gate would hide the route
    fused = mhar.GPT(mhar.preset("tiny", fused=True, **overrides)).to(DEVICE)
    fused.load_state_dict(readable.state_dict())
    idx = torch.randint(0, 50257, (1, 7), device=DEVICE)
    losses, grads = [], []
    for model in (fused, readable):
        loss = model(idx, idx)[1]
        loss.backward()
        losses.append(loss)
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert rel_err(*losses) < 1e-6
    errors = {name: rel_err(grads[0][name], grads[1][name]) for name in grads[1]}
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def test_check_available_without_gpu_or_interpreter(monkeypatch):
    monkeypatch.setattr(kernel, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in (None, "cpu", "cuda"):
        with pytest.raises(RuntimeError, match="CUDA GPU, or TRITON_INTERPRET=1"):
            kernel.check_available(device)
    V, q, g, _ = route_inputs(1, 1, 1, 24, dtype=torch.float32, device=DEVICE)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        fused_route(V, q, g, 2)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        FusedHistory(1, 2).route(V[0], q, g)


def test_import_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)        # `import triton` now raises ImportError
    spec = importlib.util.spec_from_file_location("kernel_without_triton", kernel.__file__)
    with pytest.raises(RuntimeError, match="triton is not installed"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))



COMPILE_FOR_GPU = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernel
assert not kernel.INTERPRETED
for dtype in ("bf16", "fp32"):
    storage = {"sources_ptr": "*" + dtype, "out_ptr": "*" + dtype, "dout_ptr": "*" + dtype}
    # the 1B shape; B*T = 1 and one source (an int equal to 1 becomes a constexpr unless marked); H = 3
    for d, heads, N, M in [(1280, 8, 73, 1024), (40, 8, 1, 1), (24, 3, 2, 5)]:
        config = kernel._launch_config(torch.empty(N, 1, M, d), torch.empty(d), torch.empty(d), heads)
        num_warps = config.pop("num_warps")
        for fn, constexprs in ((kernel._route_forward_kernel, {**config, "N_PAD": triton.next_power_of_2(N)}),
                               (kernel._route_backward_kernel, dict(config))):
            constexprs.update({p.name: 1 for p in fn.params
                               if p.name in ("N", "M") and {"N": N, "M": M}[p.name] == 1 and not p.do_not_specialize})
            signature = {name: "constexpr" if name in constexprs else storage.get(name, "*fp32")
                         if name.endswith("_ptr") else "fp32" if name == "eps" else "i32" for name in fn.arg_names}
            aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name.endswith("_ptr")}
            triton.compile(ASTSource(fn, signature, constexprs, aligned), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": num_warps})
"""


def test_kernels_compile_for_gpu():
    """The interpreter accepts code that compiled Triton rejects: compile both kernels for sm_90
    (H100/H200) without a GPU, as the launchers would call them. A fresh process, because this
    one imported triton in interpreter mode."""
    import triton
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", COMPILE_FOR_GPU], env=env, capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(kernel.__file__)))
    assert result.returncode == 0, result.stderr[-3000:]


