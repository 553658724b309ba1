"""The LM head without the whole logits (head.linear_cross_entropy, GPT.forward(loss_fn=...)):
the loss and every gradient against the full-logits F.cross_entropy, with and without the z-loss,
tied and untied, in fp32 and under CPU bf16 autocast, compiled; chunks forced small, so that every
case runs several of them and a ragged last one. What the chunked path never allocates, and the
last-position logits of generation."""
import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import mhar
from lib import head
from helpers import rel_err, tiny

B, T = 2, 32                                   # 64 positions: chunks of 7, the last of 1
CHUNK = 7
Z_LOSSES = pytest.mark.parametrize("z_loss", [0.0, 1e-2], ids=["ce", "z-loss"])
TIED = pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """A chunk budget of CHUNK positions of the tests' vocabulary (128)."""
    monkeypatch.setitem(head.HEAD_CHUNK_BYTES, "cpu", 4 * 128 * CHUNK)


def routed_model(tied):
    """A tiny MHAR model with nonzero routing queries (zero ones would hide their gradients)."""
    torch.manual_seed(0)
    model = mhar.GPT(tiny(tie_embeddings=tied))
    with torch.no_grad():
        for site in model.sites:
            site.query.normal_(0, 0.3)
    return model


def batch(vocab=128, rows=B, seed=1):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (rows, T + 1), generator=gen)
    return idx[:, :-1], idx[:, 1:]


def loss_and_grads(model, step):
    """step(model) -> (value, objective); the value and every parameter's gradient of the
    objective, by name."""
    model.zero_grad(set_to_none=True)
    value, objective = step(model)
    objective.backward()
    return value.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def reference(z_loss, x, y):
    """The full logits through F.cross_entropy, plus z_loss * head.squared_log_z(logits) to differentiate."""
    def step(model):
        logits, _ = model(x)                                         # (B, T, vocab) fp32
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        return loss, loss + z_loss * head.squared_log_z(logits) if z_loss else loss
    return step


def chunked(z_loss, x, y, model_call=None):
    def step(model):
        loss_fn = functools.partial(head.linear_cross_entropy, z_loss=z_loss)
        _, loss = (model if model_call is None else model_call)(x, y, loss_fn=loss_fn)
        return loss, loss
    return step


def assert_equal_grads(a, b, rel):
    assert a.keys() == b.keys()
    for name in a:
        assert rel_err(a[name], b[name]) < rel, (name, rel_err(a[name], b[name]))


@TIED
@Z_LOSSES
def test_the_loss_and_every_gradient_are_the_full_logits_ones_fp32(tied, z_loss):
    model, (x, y) = routed_model(tied), batch()
    loss, grads = loss_and_grads(model, chunked(z_loss, x, y))
    ref_loss, ref_grads = loss_and_grads(model, reference(z_loss, x, y))
    assert rel_err(loss, ref_loss) < 1e-6
    assert_equal_grads(grads, ref_grads, rel=1e-5)
    assert model.lm_head.weight.grad.abs().sum() > 0 and model.sites[-1].query.grad.abs().sum() > 0
    # the full-logits path of forward (no z-loss there): the same value, and gradient without it
    def full_path(model):
        _, loss = model(x, y)
        return loss, loss
    full_loss, full_grads = loss_and_grads(model, full_path)
    assert full_loss == ref_loss
    if not z_loss:
        assert_equal_grads(full_grads, ref_grads, rel=1e-6)


@TIED
@Z_LOSSES
def test_under_bf16_autocast_the_loss_and_gradients_are_the_full_logits_ones(tied, z_loss):
    """bf16 matmuls, fp32 logits and softmax: rounded where autocast's F.linear rounds, the
    weight's gradient summed over the chunks in fp32 and rounded once."""
    model, (x, y) = routed_model(tied), batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = loss_and_grads(model, chunked(z_loss, x, y))
        ref_loss, ref_grads = loss_and_grads(model, reference(z_loss, x, y))
    assert loss.dtype == torch.float32 and rel_err(loss, ref_loss) < 1e-5
    assert_equal_grads(grads, ref_grads, rel=1e-5)
    _, fp32_grads = loss_and_grads(model, chunked(z_loss, x, y))
    head = next(name for name, p in model.named_parameters() if p is model.lm_head.weight)
    assert rel_err(grads[head], fp32_grads[head]) > 1e-4  # it was computed in bf16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@Z_LOSSES
def test_hidden_and_weight_gradients_scaled_and_accumulated(dtype, z_loss):
    """The function itself on (N, d) hidden states: the gradients of hidden and weight, with the
    loss scaled (1 / grad_accum) and two calls accumulating, as F.cross_entropy's. The gradients
    are computed in forward and scaled in backward, after the rounding to bf16 that the full path
    does after scaling: the same bits for a power of two (grad_accum 4 here), within a bf16
    rounding otherwise (fp32: grad_accum 3)."""
    gen = torch.Generator().manual_seed(0)
    N, d, vocab = 45, 24, 128                                        # 6 chunks of 7, then 3
    hidden = torch.randn(N, d, generator=gen).requires_grad_()
    weight = (0.5 * torch.randn(vocab, d, generator=gen)).requires_grad_()
    targets = torch.randint(0, vocab, (N,), generator=gen)
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
    grad_accum = 3 if dtype == torch.float32 else 4

    def run(loss_of):
        hidden.grad = weight.grad = None
        for rows in (slice(0, 30), slice(30, N)):                    # two micro-batches
            with autocast:
                value, objective = loss_of(hidden[rows], targets[rows])
            (objective / grad_accum).backward()
        return value, hidden.grad.clone(), weight.grad.clone()

    def full(h, t):
        logits = F.linear(h, weight).float()
        loss = F.cross_entropy(logits, t)
        return loss, loss + z_loss * head.squared_log_z(logits)

    def fused(h, t):
        loss = head.linear_cross_entropy(h, weight, t, z_loss)
        return loss, loss

    for got, want in zip(run(fused), run(full)):
        assert rel_err(got, want) < 1e-5


def test_the_training_path_compiles_in_one_graph():
    """torch.compile(fullgraph=True) of forward(loss_fn=...), as train.py --compile calls it."""
    model, (x, y) = routed_model(tied=True), batch()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss, grads = loss_and_grads(model, chunked(1e-2, x, y, model_call=compiled))
    ref_loss, ref_grads = loss_and_grads(model, reference(1e-2, x, y))
    assert rel_err(loss, ref_loss) < 1e-6
    assert_equal_grads(grads, ref_grads, rel=1e-5)


class LargestOutput(TorchDispatchMode):
    """The largest number of elements any operator writes into new memory while active (views
    and in-place results of its inputs aside)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        inputs = {a.untyped_storage().data_ptr() for a in tensors}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("logits, grad", [(True, True), (False, True), (False, False)],
                         ids=["full", "chunked", "chunked-validation"])
def test_no_operator_of_a_chunked_step_returns_the_whole_logits(logits, grad):
    """A vocabulary larger than anything else in the model: its weight (vocab, d) is the largest
    tensor a chunked forward and backward make, and without gradients (validation) not even that
    (no gradient of the head is made); the full path makes (B * T, vocab)."""
    vocab, rows = 4096, 8
    torch.manual_seed(0)
    model = mhar.GPT(mhar.preset("tiny", vocab_size=vocab, seq_len=T, tie_embeddings=False))
    x, y = batch(vocab, rows)
    weight = vocab * model.config.n_embd
    assert weight < rows * T * vocab / 2
    with mhar_budget(4 * vocab * CHUNK), torch.set_grad_enabled(grad), LargestOutput() as seen:
        _, loss = model(x, y, loss_fn=None if logits else head.linear_cross_entropy)
        if grad:
            loss.backward()
    if logits:
        assert seen.numel == rows * T * vocab
    else:
        assert seen.numel == weight if grad else CHUNK * vocab <= seen.numel < weight
    with torch.no_grad():
        assert rel_err(loss, model(x, y)[1]) < 1e-6


@contextlib.contextmanager
def mhar_budget(budget):
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(head.HEAD_CHUNK_BYTES, "cpu", budget)
        yield


@pytest.mark.parametrize("device, vocab, chunk", [
    ("cpu", 50304, 667), ("cpu", 151936, 220), ("cpu", 10**9, 1), ("mps", 50304, 667),
    ("cuda", 50304, 5336), ("cuda", 151936, 1766)],
    ids=["cpu-gpt2", "cpu-qwen3", "cpu-huge", "mps-gpt2", "cuda-gpt2", "cuda-qwen3"])
def test_the_chunk_is_the_budget_over_a_row_of_fp32_logits(device, vocab, chunk, monkeypatch):
    monkeypatch.setattr(head, "HEAD_CHUNK_BYTES", {"cpu": 128 << 20, "cuda": 1 << 30})
    assert head.head_chunk(vocab, torch.device(device)) == chunk


def test_generation_runs_the_head_on_the_last_position_alone():
    model, (x, _) = routed_model(tied=True), batch()
    rows = []
    model.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape))
    model.generate(x[:, :5], 3, temperature=0)
    model.generate(x[:, :5], 3, temperature=0, cache=False)
    assert rows == [torch.Size([B, model.config.n_embd])] * 6


def test_the_training_path_compiles_with_dynamic_shapes():
    """train.py --compile sees other shapes at evaluation, and torch.compile then recompiles with
    symbolic sizes: attention's causal flag must stay a Python bool (SDPA refuses a symbolic one)."""
    model, (x, y) = routed_model(tied=True), batch()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    loss, grads = loss_and_grads(model, chunked(1e-2, x, y, model_call=compiled))
    ref_loss, ref_grads = loss_and_grads(model, reference(1e-2, x, y))
    assert rel_err(loss, ref_loss) < 1e-6
    assert_equal_grads(grads, ref_grads, rel=1e-5)


def test_z_loss_is_the_squared_log_partition():
    logits = torch.randn(2, 3, 7)
    expected = (torch.logsumexp(logits, -1) ** 2).mean().item()
    assert head.squared_log_z(logits).item() == pytest.approx(expected)
    uniform = torch.full((1, 4), -torch.tensor(4.0).log().item())               # Z = 1
    assert head.squared_log_z(uniform).item() == pytest.approx(0.0, abs=1e-12)


@Z_LOSSES
def test_a_trainable_head_over_a_frozen_body(z_loss):
    """Fine-tuning the LM head alone: hidden states without requires_grad, the weight's gradient
    as the full logits give it."""
    torch.manual_seed(0)
    hidden, targets = torch.randn(3 * CHUNK + 2, 16), torch.randint(0, 128, (3 * CHUNK + 2,))
    weight = torch.randn(128, 16, requires_grad=True)
    head.linear_cross_entropy(hidden, weight, targets, z_loss).backward()
    chunked, weight.grad = weight.grad, None
    logits = hidden @ weight.t()
    (F.cross_entropy(logits, targets) + z_loss * head.squared_log_z(logits)).backward()
    assert rel_err(chunked, weight.grad) < 1e-5
