"""Fixtures every test file shares. Run the suite from the repository root: python -m pytest -q

Without a GPU the fused kernels run in the Triton interpreter, which must be switched on before
triton is first imported: this file is imported before any test module. With one, they are
compiled, and the tests that need the interpreter (CPU tensors, byte counts) are skipped.
"""
import json
import os
import sys
from pathlib import Path

import torch  # (imports no triton)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's flat modules

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from helpers import VOCAB  # noqa: E402


def pytest_collection_modifyitems(items):
    """Under tests/mutate.py (MUTATE_SLOW_LAST set): the tests marked slow last, so that a mutant's first
    failing test (mutmut runs pytest -x) comes after seconds, not after a training run; the order of the
    rest, and of the suite's own runs, as written."""
    if os.environ.get("MUTATE_SLOW_LAST"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is not None)


@pytest.fixture(autouse=True, scope="session")
def bf16_rounded_to_nearest():
    """Interpreted kernels round fp32 to bf16 as compiled ones do (bench_kernel.rounded_to_nearest)."""
    from scripts import bench_kernel
    with bench_kernel.rounded_to_nearest():
        yield


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run as fast on one thread, and two threads on a busy 2-core machine can stall 30x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """A learnable corpus: a fixed random cycle of 97 tokens, repeated, 10% of tokens replaced by noise."""
    folder = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    cycle = rng.integers(0, VOCAB, 97)
    for split, n in (("train", 40_000), ("val", 4_000)):
        tokens = np.tile(cycle, n // 97 + 1)[:n]
        noise = rng.random(n) < 0.1
        tokens[noise] = rng.integers(0, VOCAB, noise.sum())
        tokens.astype(np.uint16).tofile(folder / f"{split}.bin")
    (folder / "meta.json").write_text(json.dumps({"tokenizer": "none", "vocab_size": VOCAB}))
    return folder


@pytest.fixture(scope="session")
def probe_runs(data, tmp_path_factory):
    """{residual: run folder} of two tiny train.py runs, 30 steps each (probe.py and sample.py read them)."""
    import train
    runs = {}
    for residual in ("mhar", "attnres"):
        out = tmp_path_factory.mktemp(residual)
        train.main(["--preset", "tiny", "--residual", residual, "--data", str(data), "--out_dir", str(out),
                    "--seq_len", "32", "--batch_size", "4", "--grad_accum", "1", "--max_steps", "30",
                    "--warmup_steps", "3", "--eval_interval", "15", "--eval_batches", "2", "--log_interval", "5",
                    "--lr", "1e-2"])
        runs[residual] = out
    return runs
