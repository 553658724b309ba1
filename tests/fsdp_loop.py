"""A tiny training loop over parallel.py, run by tests/test_parallel.py under torchrun (gloo, CPU ranks):

    torchrun --standalone --nproc_per_node=2 tests/fsdp_loop.py OUT --steps 5 --grad_accum 2 [--resume_at 3]

trains the tiny model on synthetic batches (common.sample_rows: the global batch of a step is the same
for any number of ranks) and writes OUT/log.json (loss and gradient norm per step) and OUT/shards (the
sharded checkpoint). --resume_at K saves at step K, builds a fresh sharded model, loads the checkpoint
into it and trains on. `train_steps` is also the one-process reference (no torchrun).
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's flat modules

from common import sample_rows  # noqa: E402
from helpers import tiny  # noqa: E402

BATCH_SIZE, LR, GRAD_CLIP = 4, 1e-2, 0.5  # a clip below the tiny model's gradient norms (0.6-0.8): it acts


def build():
    torch.manual_seed(0)
    import mhar
    return mhar.GPT(tiny())


def train_steps(model, optimizer, steps, grad_accum, rank=0, world=1):
    """Train `steps` (a range of step numbers); one {step, loss, grad_norm} per step, global means."""
    import torch.distributed as dist
    config, log = model.config, []
    rows_per_rank = BATCH_SIZE * grad_accum
    for step in steps:
        rows = sample_rows(None, ("train", 0, step), rows_per_rank * world, rank * rows_per_rank,
                           (rank + 1) * rows_per_rank, config.seq_len, config.vocab_size)
        rows = rows.view(grad_accum, BATCH_SIZE, -1)                              # (accum, B, T + 1)
        loss_sum = torch.zeros(())
        for micro in range(grad_accum):
            if world > 1:  # reduce-scatter the gradients on the last micro-step only
                model.set_requires_gradient_sync(micro == grad_accum - 1)
            _, loss = model(rows[micro, :, :-1], rows[micro, :, 1:])
            (loss / grad_accum).backward()
            loss_sum += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if world > 1:
            dist.all_reduce(loss_sum)
            norm = norm.full_tensor()  # a DTensor: each rank held the norm of its shards
        log.append(dict(step=step + 1, loss=loss_sum.item() / (grad_accum * world), grad_norm=norm.item()))
    return log


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--resume_at", type=int, default=None)
    args = p.parse_args()
    import torch.distributed as dist

    import parallel
    dist.init_process_group("gloo")
    rank, world, device = dist.get_rank(), dist.get_world_size(), torch.device("cpu")
    out = Path(args.out)
    model = parallel.build_sharded(build, device, torch.float32)
    optimizer = model.configure_optimizers(learning_rate=LR)
    stop = args.resume_at or args.steps
    log = train_steps(model, optimizer, range(stop), args.grad_accum, rank, world)
    parallel.save(out / "shards", model, optimizer)
    if args.resume_at is not None:  # a fresh model and optimizer, then the checkpoint
        model = parallel.build_sharded(build, device, torch.float32)
        optimizer = model.configure_optimizers(learning_rate=LR)
        parallel.load(out / "shards", model, optimizer)
        log += train_steps(model, optimizer, range(stop, args.steps), args.grad_accum, rank, world)
        parallel.save(out / "shards", model, optimizer)
    if rank == 0:
        (out / "log.json").write_text(json.dumps(log))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
