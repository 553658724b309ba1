"""parallel.py: FSDP2 with 2 gloo ranks on the CPU against one process with the same global batch, the
sharded checkpoint read back into a sharded model and into one process, a two-node launch on localhost."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from common import read_shards
from fsdp_loop import LR, build, train_steps
import mhar
from helpers import ROOT, rel_err, tiny

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(commands):
    """Run torchrun command lines side by side (the nodes of one job); each must succeed."""
    procs = [subprocess.Popen(c, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in commands]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, output[-3000:]


def test_fsdp_matches_one_process_resumes_bitwise_and_launches_as_two_nodes(tmp_path):
    """2 ranks x 2 micro-steps and 1 process x 4 micro-steps see the same 16 sequences per step; the sharded
    run is launched as two torchrun "nodes" of one process each (c10d rendezvous on localhost), and again
    on one node interrupted after step 3, checkpointed, rebuilt and reloaded."""
    loop = [str(ROOT / "tests" / "fsdp_loop.py")]
    port = free_port()
    nodes = [[*TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
              f"127.0.0.1:{port}", "--rdzv_id", "fsdp-test", *loop, str(tmp_path / "straight")] for _ in range(2)]
    resumed = [*TORCHRUN, "--standalone", "--nproc_per_node", "2", *loop, str(tmp_path / "resumed"),
               "--resume_at", "3"]
    launch([*nodes, resumed])  # three agents at once: the two nodes of one job, and the resumed job
    straight = json.loads((tmp_path / "straight" / "log.json").read_text())

    model = build()
    one = train_steps(model, model.configure_optimizers(learning_rate=LR), range(5), grad_accum=4)
    assert [e["step"] for e in straight] == [1, 2, 3, 4, 5]
    for a, b in zip(straight, one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)  # of the sharded gradients
    assert all(e["grad_norm"] > 0.5 for e in one)  # the clip at 0.5 acted on every step

    sharded = read_shards(tmp_path / "straight" / "shards")  # in this one process, as common.load_model does
    assert sharded.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():  # Adam's m / sqrt(v) amplifies float order on tiny gradients
        assert rel_err(sharded[k], v) < 1e-5, k

    assert json.loads((tmp_path / "resumed" / "log.json").read_text()) == straight
    a, b = (read_shards(tmp_path / run / "shards", prefix="") for run in ("straight", "resumed"))
    assert a.keys() == b.keys() and any(k.startswith("optimizer.state.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


@pytest.fixture
def one_rank():
    """A process group of this one process (gloo), for FSDP in-process: no torchrun, no subprocess."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_bf16_compute_keeps_fp32_weights_and_gradients_and_untied_embeddings_get_units(one_rank):
    """--dtype bfloat16 (the GPU default): a sublayer runs on bf16 weights and inputs, while the
    sharded weights Adam updates and their gradients stay fp32. Tied embeddings stay at the root;
    untied ones (large vocabularies) are FSDP units of their own."""
    import parallel
    from torch.distributed.fsdp import FSDPModule
    model, seen = parallel.build_sharded(build, torch.device("cpu"), torch.bfloat16), {}
    model.layers[0].register_forward_pre_hook(
        lambda layer, args: seen.update(weight=layer.q_proj.weight.dtype, input=args[0].dtype))
    x = torch.randint(model.config.vocab_size, (2, 16))
    model(x, x)[1].backward()
    assert seen == {"weight": torch.bfloat16, "input": torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()} == {torch.float32}
    assert model.lm_head.weight is model.embed.weight and not isinstance(model.embed, FSDPModule)

    untied = parallel.build_sharded(lambda: mhar.GPT(tiny(tie_embeddings=False)), torch.device("cpu"),
                                    torch.float32)
    assert isinstance(untied.embed, FSDPModule) and isinstance(untied.lm_head, FSDPModule)
