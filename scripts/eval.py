"""
Benchmarks with lm-evaluation-harness (lm-eval) for any checkpoint of this project, or for a
Hugging Face Qwen3 directory.

    python -m scripts.eval --ckpt out/ckpt.pt --tasks hellaswag,lambada_openai,wikitext  # network
    python -m scripts.eval --ckpt runs/compare/mhar-s0 --tasks hellaswag --limit 500 --device cuda
    python -m scripts.eval --ckpt models/Qwen3-8B --tasks gsm8k,gpqa_main_zeroshot --batch_size 16
    python -m scripts.eval --ckpt out/ckpt.pt --tasks pyval_text,pyval_line --include_path data/pyval

--ckpt is a train.py checkpoint, a run folder holding one (ckpt.pt), or a Hugging Face directory
(config.json, weights, tokenizer.json), read by hf.load. --tasks names lm-eval's tasks
(`lm-eval ls tasks`) or tasks that YAML files in --include_path define over local files. Prints
lm-eval's table and writes its results to --output (default: eval.json beside the checkpoint).

The model answers lm-eval's three kinds of request, batch_size at a time, longest first:
    loglikelihood(context, continuation)  log p(continuation | context), and whether greedy
                                          decoding would write it; a pair longer than the model's
                                          seq_len loses the start of its context, never the
                                          continuation
    loglikelihood_rolling(text)           log p(text) over windows of seq_len tokens, each token
                                          predicted once (perplexity tasks such as wikitext)
    generate_until(context, until)        greedy decoding (sampling if the task asks for it) until
                                          end-of-text, a stop string or max_gen_toks, with
                                          GPT.generate and its KV cache

Text becomes token ids with the tokenizer the model was trained with: the one its training data's
meta.json records (GPT-2's BPE, offline too, or a model's tokenizer.json), the tokenizer.json of a
Hugging Face directory, or --tokenizer DIR. The ids past the tokenizer's vocabulary (GPT-2's
50,257 ids are padded to 50,304) are never generated. A model trained on token ids without a
tokenizer has no text to be asked about: one line says so.
"""
import argparse
import dataclasses
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# Before torch starts OpenMP, as in train.py: on a CPU that another busy process shares, threads
# spinning at a barrier starve their siblings (train.py's CPU demo measured 4x slower steps).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import prepare  # noqa: E402
from lib.common import (FlagParser, MachineError, UserError, exit_error, load_model, one_line,  # noqa: E402
                        output_folder, pick_device, training_data, write_atomically)

try:  # lm-eval is optional: only this file imports it, and main() says how to install it
    from lm_eval.api.model import TemplateLM
except ImportError:
    TemplateLM = None

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default when a generation task sets no max_gen_toks
FIRST_ROUND = 16            # tokens generated before the first look for a stop string; doubles


def require_lm_eval():
    if TemplateLM is None:
        raise UserError("lm-eval is not installed: pip install lm-eval (it holds the benchmarks "
                        "and their metrics)")


def tokenizer_of_checkpoint(ckpt, path):
    """The prepare.Tokenizer a train.py checkpoint was trained with (its data's meta.json); GPT-2's
    for synthetic data or a data folder that is gone, when the vocabulary holds GPT-2's ids."""
    vocab_size = ckpt["config"]["vocab_size"]
    data, meta = training_data(ckpt)
    tokenizer = prepare.tokenizer_of(meta) if meta else None
    if tokenizer is None and not meta and vocab_size >= prepare.VOCAB_SIZE:
        return prepare.gpt2_tokenizer()
    if tokenizer is None:
        why = (f"{data}/meta.json records tokenizer {meta.get('tokenizer')!r}" if meta else
               f"{vocab_size} ids, too few for GPT-2's")
        raise UserError(f"{path} was trained on token ids without a text tokenizer ({why}): "
                        f"lm-eval's tasks are text; train on a prepare.py corpus, or name the "
                        f"tokenizer with --tokenizer DIR")
    return tokenizer


# -----------------------------------------------------------------------------
# Models: a train.py checkpoint, a run folder, or a Hugging Face directory.

def load(path, device, tokenizer=None):
    """(model in eval mode, prepare.Tokenizer, info for the results) from any of the three;
    UserError if it cannot be used. `tokenizer` (a folder with tokenizer.json) overrides."""
    from lib import hf
    path = Path(path)
    if path.is_dir() and (path / "ckpt.pt").is_file():  # a run folder
        path = path / "ckpt.pt"
    if path.is_dir() and (path / "config.json").is_file():  # a Hugging Face directory
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as autocast computes
        try:
            model = hf.load(str(path), dtype=dtype).to(device).eval()
        except ValueError as e:  # hf.py raises CheckpointError (a UserError) for foreign files
            raise UserError(f"cannot load {path}: {one_line(e)}") from None
        info = {"checkpoint": str(path)}
        tok = prepare.hf_tokenizer(tokenizer or path)
    elif path.is_dir():
        raise UserError(f"{path} holds neither ckpt.pt (a train.py run) nor config.json (a Hugging "
                        f"Face model)")
    else:
        model, ckpt = load_model(path, device)
        info = {"checkpoint": str(path), "step": ckpt.get("step")}
        tok = prepare.hf_tokenizer(tokenizer) if tokenizer else tokenizer_of_checkpoint(ckpt, path)
    if tok.vocab_size > model.config.vocab_size:
        raise UserError(f"the tokenizer {tok.name} has {tok.vocab_size:,} ids, more than the "
                        f"model's {model.config.vocab_size:,}: it is not this model's tokenizer")
    info.update(tokenizer=f"{tok.name} ({tok.source})", parameters=model.num_params(),
                model_config=dataclasses.asdict(model.config))
    return model, tok, info


# -----------------------------------------------------------------------------
# The model lm-eval talks to. TemplateLM turns each (context, continuation) text pair into a pair
# of id lists (an empty context becomes end-of-text) and hands them to _loglikelihood_tokens.

class MHARLM(TemplateLM or object):
    """lm-eval's model interface over a GPT of mhar.py and a Tokenizer."""

    def __init__(self, model, tokenizer, batch_size=8, max_length=None, info=None):
        require_lm_eval()
        super().__init__()
        self.model, self.tok, self.batch_size, self.info = model, tokenizer, batch_size, info or {}
        self.seq_len = min(max_length or model.config.seq_len, model.config.seq_len)  # the window
        self._device = next(model.parameters()).device

    @property
    def eot_token_id(self):
        return self.tok.eot

    @property
    def max_length(self):
        return self.seq_len

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        # as prepare.py encodes documents: special-token text is text; lm-eval adds end-of-text
        return self.tok.encode_batch([string])[0] if string else []

    def get_model_info(self):
        return self.info  # lm-eval puts it into the results' "config"

    def autocast(self):
        """bf16 on CUDA, as train.py computes there; fp32 elsewhere."""
        return torch.autocast(self._device.type, dtype=torch.bfloat16,
                              enabled=self._device.type == "cuda")

    def _loglikelihood_tokens(self, requests, disable_tqdm=False):
        return self.score([(context, continuation) for _, context, continuation in requests],
                          disable_tqdm)

    @torch.no_grad()
    def score(self, pairs, disable_tqdm=True):
        """(log p(continuation | context), is_greedy) for each pair of id lists.

        A pair keeps its last seq_len + 1 ids: a long context loses its start, the continuation
        stays whole. Inputs go longest first, batch_size at a time, right-padded: the model is
        causal, so the padding after an input changes none of the input's logits. Only the
        positions that predict a continuation go through the LM head, a chunk of them at a time
        (head.head_chunk): a batch never holds its B * T * vocab logits.
        """
        from tqdm import tqdm  # a dependency of lm-eval

        from lib import head
        inputs = []
        for context, continuation in pairs:
            if len(continuation) > self.seq_len:
                raise UserError(f"a continuation of {len(continuation)} tokens does not fit in the "
                                f"model's window of {self.seq_len}")
            inputs.append((context + continuation)[-(self.seq_len + 1):-1])  # the last is no input
        order = sorted(range(len(pairs)), key=lambda i: -len(inputs[i]))
        answers = [None] * len(pairs)
        batches = range(0, len(order), self.batch_size)
        chunk = head.head_chunk(self.model.config.vocab_size, self._device)
        for start in tqdm(batches, disable=disable_tqdm, desc="loglikelihood"):
            batch = order[start:start + self.batch_size]
            idx = torch.zeros(len(batch), len(inputs[batch[0]]), dtype=torch.long)  # (B, T)
            for row, i in enumerate(batch):
                idx[row, :len(inputs[i])] = torch.tensor(inputs[i])
            owners, positions, targets = [], [], []  # of every scored position of the batch
            for row, i in enumerate(batch):
                n, end = len(pairs[i][1]), len(inputs[i])
                owners += [row] * n
                positions += [row * idx.size(1) + p for p in range(end - n, end)]  # predicts it
                targets += pairs[i][1]
            owners, positions, targets = (torch.tensor(v, device=self._device)
                                          for v in (owners, positions, targets))
            logprob = torch.zeros(len(batch), dtype=torch.float64, device=self._device)
            misses = torch.zeros(len(batch), dtype=torch.long, device=self._device)
            with self.autocast():
                hidden = self.model.hidden(idx.to(self._device)).flatten(0, 1)       # (B * T, d)
                for s in range(0, len(positions), chunk):
                    at, target = positions[s:s + chunk], targets[s:s + chunk, None]  # (n,), (n, 1)
                    logits = self.model.lm_head(hidden[at]).float()                  # (n, vocab)
                    scored = F.log_softmax(logits, dim=-1).gather(1, target)[:, 0]
                    greedy = logits[:, :self.tok.vocab_size].argmax(-1)  # what decoding writes
                    logprob.index_add_(0, owners[s:s + chunk], scored.double())
                    misses.index_add_(0, owners[s:s + chunk], (greedy != target[:, 0]).long())
            for row, i in enumerate(batch):
                answers[i] = (logprob[row].item(), misses[row].item() == 0)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """log p(text) of each text in lm-eval's rolling windows: every token predicted once, the
        first after end-of-text, each window with as much context as fits; all batched together."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
        windows, owners = [], []
        for i, (text,) in enumerate(request.args for request in requests):
            for window in get_rolling_token_windows(self.tok_encode(text), self.eot_token_id,
                                                    max_seq_len=self.seq_len, context_len=1):
                windows.append(make_disjoint_window(window))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self.score(windows, disable_tqdm)):
            totals[i] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm=False):
        """The continuation of each context, up to its first stop string. Prompts of one length
        and one generation setting share a batch (GPT.generate runs its rows unpadded)."""
        groups = {}  # (prompt length, settings) -> the requests' indices
        prompts = []
        for i, (context, gen_kwargs) in enumerate(request.args for request in requests):
            settings = generation_settings(gen_kwargs)
            if settings.max_new >= self.seq_len:
                raise UserError(f"a task asks for up to {settings.max_new} new tokens, but the "
                                f"model's window is {self.seq_len} tokens: ask for fewer, e.g. "
                                f"--gen_kwargs max_gen_toks={self.seq_len // 2}")
            # the prompt keeps its last seq_len - max_new ids: with its continuation, it fits
            ids = self.tok_encode(context)[-(self.seq_len - settings.max_new):]
            prompts.append(ids or [self.tok.eot])
            groups.setdefault((len(prompts[i]), settings), []).append(i)
        texts = [None] * len(requests)
        for (_, settings), members in groups.items():
            for start in range(0, len(members), self.batch_size):
                batch = members[start:start + self.batch_size]
                for i, text in zip(batch, self.complete([prompts[i] for i in batch], settings)):
                    texts[i] = text
        return texts

    @torch.no_grad()
    def complete(self, prompts, settings):
        """The continuations of prompts of one length, each up to its end-of-text or first stop
        string.

        GPT.generate (with its KV cache, never a padding id) runs in rounds of 16, 32, 64, ...
        tokens; after each round the rows that are done leave the batch. A round reads its prompt
        again (one forward), so doubling keeps those reads to a few.
        """
        idx = torch.tensor(prompts, device=self._device)                                # (B, T)
        length, rows, texts = idx.size(1), list(range(len(prompts))), [""] * len(prompts)
        new, step = 0, FIRST_ROUND
        while rows and new < settings.max_new:
            n = min(step, settings.max_new - new)
            with self.autocast():
                idx = self.model.generate(idx, n, temperature=settings.temperature,  # (B, T + new)
                                          top_k=settings.top_k, vocab_limit=self.tok.vocab_size)
            new, step = new + n, 2 * step
            going = []
            for row, i in enumerate(rows):
                ids = idx[row, length:].tolist()
                ended = self.tok.eot in ids
                texts[i] = self.tok.decode(ids[:ids.index(self.tok.eot)] if ended else ids)
                if not ended and not any(stop in texts[i] for stop in settings.until):
                    going.append(row)
            idx, rows = idx[going], [rows[row] for row in going]
        return [cut(text, settings.until) for text in texts]


@dataclass(frozen=True)
class Generation:
    until: tuple            # stop strings (end-of-text stops too)
    max_new: int            # tokens to generate at most
    temperature: float      # 0: greedy
    top_k: int = None       # sample among the k likeliest ids; None: among all


def generation_settings(gen_kwargs):
    """A task's generation_kwargs as Generation, by lm-eval's conventions: greedy unless do_sample
    (or, with no do_sample, a temperature above 0); 256 new tokens at most unless set."""
    kwargs = dict(gen_kwargs)
    until = kwargs.pop("until", None) or []
    until = [until] if isinstance(until, str) else list(until)
    do_sample = kwargs.pop("do_sample", None)
    try:
        max_new = int(kwargs.pop("max_gen_toks", kwargs.pop("max_new_tokens", DEFAULT_MAX_GEN_TOKS)))
        temperature = float(kwargs.pop("temperature", 1.0 if do_sample else 0.0))
        top_k = int(kwargs.pop("top_k", None) or 0) or None
    except (TypeError, ValueError) as e:
        raise UserError(f"generation settings {dict(gen_kwargs)}: {one_line(e)}; max_gen_toks and "
                        f"top_k are integers, temperature a number") from None
    if do_sample is False or temperature <= 0:  # greedy: nothing to sample, nothing to truncate
        temperature, top_k = 0.0, None
        kwargs.pop("top_p", None)
    neutral = {"top_p": 1.0, "num_beams": 1}  # settings that leave decoding as it is
    unsupported = sorted(k for k, v in kwargs.items() if k not in neutral or v != neutral[k])
    if unsupported:
        raise UserError(f"generation settings {unsupported} are not supported: eval.py decodes "
                        f"greedily, or samples (do_sample, temperature, top_k), until a stop "
                        f"string or max_gen_toks")
    return Generation(tuple(until), max_new, temperature, top_k)


def cut(text, stops):
    """text up to its first stop string."""
    return text[:min([text.find(s) for s in stops if s in text], default=len(text))]


# -----------------------------------------------------------------------------
# Running the tasks; the results.

def task_manager(tasks, include_path=None):
    """lm-eval's TaskManager that knows every task named. Indexing lm-eval's own tasks (~15,000
    YAML files) costs 20 s of CPU, so tasks all defined in include_path are found without it."""
    from lm_eval.tasks import TaskManager

    def unknown(manager):
        return [t for t in tasks if not manager.match_tasks([t])]

    if include_path:
        if not Path(include_path).is_dir():
            raise UserError(f"--include_path {include_path} is not a folder (of task YAML files)")
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if not unknown(local):
            return local
    manager = TaskManager(include_path=str(include_path) if include_path else None)
    if unknown(manager):
        raise UserError(f"unknown task {', '.join(unknown(manager))}: `lm-eval ls tasks` lists "
                        f"them; a task of your own is a YAML file in the --include_path folder")
    return manager


def local_files(data_files):
    """The files here that a task's dataset_kwargs.data_files names: a path, a list of them, or
    {split: either}; URLs and glob patterns are datasets' to resolve."""
    named = []
    for value in data_files.values() if isinstance(data_files, dict) else [data_files]:
        named += value if isinstance(value, (list, tuple)) else [value]
    return [Path(p) for p in named if isinstance(p, (str, os.PathLike)) and Path(p).is_file()]


def holds_nothing(path, chunk=1 << 20):
    """Whether a file holds nothing but whitespace, read a chunk at a time (data may be large)."""
    with open(path, "rb") as f:
        while block := f.read(chunk):
            if block.strip():
                return False
    return True


@contextmanager
def empty_data_refused():
    """While lm-eval builds its tasks, a local data file that holds nothing is one UserError
    naming it: datasets, looking for its first row, raises a bare StopIteration (an empty file) or
    a ValueError about the split (blank lines). lm-eval's tasks call datasets.load_dataset with
    keywords, through the module: that call is checked."""
    import datasets
    load_dataset = datasets.load_dataset

    def checked(*args, **kwargs):
        for path in local_files(kwargs.get("data_files")):
            if holds_nothing(path):
                raise UserError(f"a task's data file {path} is empty: give it the task's "
                                f"documents, or leave the task out")
        return load_dataset(*args, **kwargs)
    datasets.load_dataset = checked
    try:
        yield
    finally:
        datasets.load_dataset = load_dataset


def evaluate(ckpt, tasks, output=None, device="auto", batch_size=8, max_length=None,
             tokenizer=None, include_path=None, num_fewshot=None, limit=None, gen_kwargs=None,
             log_samples=False, manager=None):
    """lm-eval's results (simple_evaluate) of a checkpoint on tasks, with the task names as asked
    ("tasks"), also written to `output` (default: eval.json beside the checkpoint). `manager`: a
    task_manager() for these tasks, to index them once for many checkpoints. UserError for bad
    input, a missing lm-eval or data that cannot be loaded."""
    require_lm_eval()
    from lm_eval import evaluator
    from lm_eval.utils import handle_non_serializable, simple_parse_args_string
    if not Path(ckpt).exists():  # before indexing the tasks, which takes a while
        raise UserError(f"no checkpoint at {ckpt}: give a train.py ckpt.pt, a run folder or a "
                        f"Hugging Face directory")
    tasks = [t for t in tasks.split(",") if t] if isinstance(tasks, str) else list(tasks)
    if not tasks:
        raise UserError("no tasks given: e.g. --tasks hellaswag,lambada_openai")
    if gen_kwargs:  # checked before anything runs
        generation_settings(simple_parse_args_string(gen_kwargs))
    folder = Path(ckpt) if Path(ckpt).is_dir() else Path(ckpt).parent
    output = Path(output) if output else folder / "eval.json"
    if output.is_dir():
        raise UserError(f"--output {output} is a folder: give the results file's name, e.g. "
                        f"{output / 'eval.json'}")
    output_folder(output.parent, "--output")
    manager = manager or task_manager(tasks, include_path)
    model, tok, info = load(ckpt, pick_device(device), tokenizer)
    lm = MHARLM(model, tok, batch_size, max_length, info)
    try:
        with empty_data_refused():
            results = evaluator.simple_evaluate(
                model=lm, tasks=tasks, task_manager=manager, num_fewshot=num_fewshot,
                limit=limit, gen_kwargs=gen_kwargs, log_samples=log_samples,
                batch_size=batch_size, device=str(lm.device))  # these two only for the record
    except OSError as e:  # a built-in task's data, offline (ConnectionError is an OSError)
        raise UserError(f"a task's data could not be loaded ({one_line(e)}): lm-eval's built-in "
                        f"tasks download theirs from the Hugging Face Hub; go online, or define "
                        f"the task over local files (--include_path)") from None
    results["tasks"] = tasks  # a name can stand for several tasks (a group, a tag)
    text = json.dumps(results, indent=2, default=handle_non_serializable) + "\n"
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(output, lambda f: f.write(text.encode()))
    except OSError as e:
        raise MachineError(f"cannot write {output} ({e.strerror or one_line(e)}): free some space "
                           f"or give another --output; the evaluation itself finished") from None
    results["output"] = str(output)
    return results


def metrics(results):
    """{task/metric: value} of lm-eval's results, one entry per metric of each task; a group that
    reports its own aggregate (mmlu) stands for its subtasks. A filter other than lm-eval's "none"
    stays in the name (gsm8k/exact_match,strict-match); standard errors are left out."""
    def scores(task):
        return {key: value for key, value in results["results"].get(task, {}).items()
                if "," in key and "_stderr," not in key and isinstance(value, (int, float))}

    covered = {subtask for group, subtasks in results.get("group_subtasks", {}).items()
               if scores(group) for subtask in subtasks}
    flat = {}
    for task in results["results"]:
        if task in covered:
            continue
        for key, value in scores(task).items():
            metric, _, filter_name = key.partition(",")
            name = f"{task}/{metric}" + ("" if filter_name == "none" else f",{filter_name}")
            flat[name] = float(value)
    return flat


def evaluate_run(run_dir, tasks, **options):
    """{task/metric: value} of a finished train.py run folder (its ckpt.pt) on lm-eval tasks: the
    columns compare.py adds to its table. Writes run_dir/eval.json; options as for evaluate()."""
    return metrics(evaluate(Path(run_dir), tasks, **options))


# -----------------------------------------------------------------------------

def parse_args(argv=None):
    p = FlagParser(prog="eval.py", description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--ckpt", default="out/ckpt.pt",
      help="train.py checkpoint, run folder or Hugging Face directory (default out/ckpt.pt)")
    a("--tasks", required=True, help="comma-separated lm-eval tasks, e.g. hellaswag,wikitext")
    a("--include_path", help="a folder of task YAML files (tasks over local files, offline)")
    a("--num_fewshot", type=int, help="examples in each prompt (default: each task's own)")
    a("--limit", type=float, help="at most this many documents per task (< 1: this fraction)")
    a("--batch_size", type=int, default=8, help="sequences per forward (default 8)")
    a("--max_length", type=int, help="context window (default and at most: the model's seq_len)")
    a("--gen_kwargs", help="generation settings for every generation task, e.g. max_gen_toks=64")
    a("--tokenizer", metavar="DIR", help="a folder with tokenizer.json, instead of the model's own")
    a("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:1, mps")
    a("--output", help="results JSON (default: eval.json beside the checkpoint)")
    a("--log_samples", action="store_true", help="also write every request and answer to it")
    args = p.parse_args(argv)
    for flag, smallest in (("batch_size", 1), ("max_length", 2), ("num_fewshot", 0)):
        value = getattr(args, flag)
        if value is not None and value < smallest:
            exit_error("eval.py", f"--{flag} must be at least {smallest}, got {value}")
    if args.limit is not None and not 0 < args.limit < float("inf"):
        exit_error("eval.py", f"--limit must be a positive number (below 1: a fraction of each "
                              f"task), got {args.limit}")
    if args.limit is not None and args.limit >= 1:
        args.limit = int(args.limit)  # a count; below 1, a fraction (lm-eval's convention)
    return args


def main(argv=None):
    args = parse_args(argv)
    start = time.time()
    try:
        results = evaluate(**vars(args))  # every flag is an argument of evaluate()
    except UserError as e:
        exit_error("eval.py", e)
    except MachineError as e:
        exit_error("eval.py", e, status=1)
    from lm_eval.utils import make_table
    info = results["config"]
    print(f"{info['checkpoint']}: {info['parameters']:,} parameters, tokenizer "
          f"{info['tokenizer']}, {info['device']}, {time.time() - start:.0f} s")
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    print(f"results: {results['output']}")
    return results


if __name__ == "__main__":
    main()
