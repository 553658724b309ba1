"""
The LM head's loss without the whole logits: the cross-entropy of hidden @ weight.T, computed and
differentiated a chunk of positions at a time.

At GPT-2's vocabulary (50,304) a step of 4,096 positions holds 0.8 GB of fp32 logits, and
F.cross_entropy keeps several tensors of that size for backward; at Qwen3's (151,936) it is
2.5 GB each. Here the loss of each chunk of positions, its log-sum-exp (for the z-loss) and its
gradients are computed inside the chunk, in one buffer the next chunk overwrites, so nothing of
size positions x vocab survives the forward. train.py passes it to the model as its loss:

    loss_fn = functools.partial(linear_cross_entropy, z_loss=1e-4)
    _, loss = model(idx, targets, loss_fn=loss_fn)       # GPT.forward: (None, loss)

tests/test_head.py checks it against the full logits through F.cross_entropy, gradients
included; bench_head.py measures its speed and memory against them.
"""
import torch

from mhar import compute_dtype

# Bytes of fp32 logits one chunk of positions may hold: one buffer of that size holds each chunk's
# logits, log-softmax and gradient in turn, in place. Fewer, longer chunks cost less: each chunk
# reads and writes the whole gradient of the weight (vocab, d), so chunks of a few dozen positions
# spend more on it than on their logits. On this project's 2-core CPU (loaded, two runs) 128 MiB
# was as fast as any budget from 16 to 512 MiB at GPT-2's vocabulary (4 MiB: 2x slower), and among
# the fastest at Qwen3's, where chunks of 7 to 55 positions (4 to 32 MiB) were slower. On a GPU,
# chunks large enough that their matmuls fill the device (5.3k positions at GPT-2's vocabulary,
# 1.8k at Qwen3's).
HEAD_CHUNK_BYTES = {"cpu": 128 << 20, "cuda": 1 << 30}


def squared_log_z(logits):
    """The mean squared log-partition function of the logits, PaLM's z-loss (arXiv:2204.02311,
    section 5): added to the loss times a small weight, it keeps log Z near 0, the bf16 softmax
    stable."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def head_chunk(vocab, device):
    """Positions per chunk: as many as the device's budget of fp32 logits holds (at least one)."""
    budget = HEAD_CHUNK_BYTES.get(device.type, HEAD_CHUNK_BYTES["cpu"])
    return max(1, budget // (4 * vocab))


class LinearCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of logits hidden @ weight.T, computed and differentiated a chunk of
    positions at a time: each chunk's logits (C, vocab), in fp32, give its loss and, at once, its
    rows of the gradient of hidden and its share of the gradient of weight. One buffer serves
    every chunk, overwritten in place (logits, log-softmax, gradient): on a CPU, fresh memory for
    each would cost a page fault per 4 KiB of it, several times per chunk. The matmuls run in the
    dtype of hidden and weight (the wrapper casts them to autocast's), rounded where autocast's
    F.linear rounds: the logits and the gradient of hidden in that dtype, the gradient of weight,
    a sum over all positions, accumulated in fp32 and rounded once, as one matmul over all
    positions would be. z_loss = w adds the gradient of w * mean (log Z)^2, its log Z the target's
    logit minus its log-probability; the value returned is the cross-entropy alone.

    Saved for backward: the two gradients (hidden's (N, d), weight's (vocab, d)), which backward
    only scales by the gradient of the loss; nothing of size N * vocab survives the forward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, z_loss, chunk, needs_grad):
        N, dtype, device = hidden.size(0), hidden.dtype, hidden.device
        with torch.autocast(device.type, enabled=False):  # the dtypes are already chosen
            buffer = torch.empty(min(chunk, N), weight.size(0), device=device)  # (C, vocab) fp32
            loss = torch.zeros((), device=device)
            grad_hidden = torch.empty_like(hidden) if needs_grad else None
            grad_weight = torch.zeros(weight.shape, device=device) if needs_grad else None
            for start in range(0, N, chunk):
                rows = slice(start, start + chunk)
                h, t = hidden[rows], targets[rows, None]                     # (C, d), (C, 1)
                logits = buffer[:h.size(0)]                                  # (C, vocab) fp32
                if dtype == torch.float32:
                    torch.mm(h, weight.t(), out=logits)
                else:
                    logits.copy_(h @ weight.t())                             # rounded to dtype
                target_logit = logits.gather(1, t)                           # (C, 1)
                logp = torch.log_softmax(logits, dim=-1, out=logits)         # in place
                target_logp = logp.gather(1, t)                              # (C, 1)
                loss = loss - target_logp.sum()
                if not needs_grad:
                    continue
                # d/dlogits of (CE + z_loss * (log Z)^2) / N: (softmax (1 + 2 z_loss log Z) - onehot) / N
                log_z = target_logit - target_logp                           # (C, 1)
                scale = (1 + 2 * z_loss * log_z) / N if z_loss else 1 / N
                grad = logp.exp_().mul_(scale).scatter_add_(1, t, logp.new_full(t.shape, -1 / N))
                grad = grad.to(dtype)
                torch.mm(grad, weight, out=grad_hidden[rows])                # (C, d)
                grad_weight.addmm_(grad.t().float(), h.float())  # exact products: bf16 fits fp32
        if needs_grad:
            ctx.save_for_backward(grad_hidden, grad_weight.to(dtype))
        return loss / N

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None, None, None


def linear_cross_entropy(hidden, weight, targets, z_loss=0.0):
    """F.cross_entropy(hidden @ weight.T, targets) of hidden (..., d) and targets (...), without
    the logits: see LinearCrossEntropy. Under autocast the matmuls run in its dtype, as
    F.linear's would; z_loss = w puts w * mean (log Z)^2 into the gradient, not the value."""
    dtype = compute_dtype(hidden)
    hidden, weight = hidden.reshape(-1, hidden.size(-1)).to(dtype), weight.to(dtype)  # (N, d)
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return LinearCrossEntropy.apply(hidden, weight, targets.reshape(-1), float(z_loss),
                                    head_chunk(weight.size(0), hidden.device), needs_grad)
