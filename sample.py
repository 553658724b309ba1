"""
Generate text from a train.py checkpoint.

    python sample.py --ckpt out/ckpt.pt                                  # 3 samples from a new document
    python sample.py --ckpt out/ckpt.pt --prompt "def main(" --max_new_tokens 100 --temperature 0.8 --top_k 50
    python sample.py --ckpt out/ckpt.pt --prompt "import os" --seed 1 --num_samples 1 --device cuda

The tokenizer is the one the model was trained with: the checkpoint names its --data folder, whose
meta.json (written by prepare.py) says GPT-2's BPE (prepare.get_encoding(), offline too) or a model's
own tokenizer.json (prepare.py --tokenizer DIR; it needs `pip install tokenizers`). --tokenizer DIR
overrides it, e.g. when the data folder has moved. The empty prompt starts a new document
(end-of-text); the text <|endoftext|> (the tokenizer's end-of-text) in a prompt is that token. Each
sample prints the prompt and its continuation, each token as soon as it is drawn (the samples one
after another). Sampling is a pure function of (checkpoint, prompt, flags, --seed): the same command
prints the same text on the same device.

Only ids the tokenizer can decode are sampled: the model's vocabulary is padded (GPT-2's 50,257 ids
to 50,304), and a padding id has no text. A model trained on token files without a tokenizer has no
text: its prompt is a list of token ids ("--prompt '3 1 4'", empty = token 0) and it prints ids. A
model trained on --data synthetic (random tokens) is decoded with GPT-2's BPE: its text is noise.

Bad input (a flag out of range, a missing or foreign checkpoint, an absent device) ends with one
line on stderr and exit status 2; Ctrl-C with one line and exit status 130, whenever it comes until the last
sample is out (from then on it is too late, and ignored: the run ends as finished, with status 0).
"""
import os
import sys

INTERRUPTED = b"sample.py: error: interrupted (Ctrl-C)\n"
try:  # the script's first instruction: a Ctrl-C until sampling begins is this line at once (interrupts.py)
    from lib import interrupts
    interrupts.guard(__name__, INTERRUPTED)
except KeyboardInterrupt:  # one in the microseconds before
    os.write(2, INTERRUPTED)
    os._exit(130)

import argparse  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402

from lib.common import (FlagParser, UserError, exit_error, ignore_stop_signals, load_model,  # noqa: E402
                        pick_device, training_data)
from lib.common import seed as SEED  # noqa: E402


class Codec:
    """Text <-> token ids with a prepare.Tokenizer, or plain id lists when there is none (tokenizer=None)."""

    def __init__(self, tokenizer, vocab_size):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        # the ids generation may sample: those the tokenizer decodes, or the data's ids (None: all the model's)
        self.vocab_limit = tokenizer.vocab_size if tokenizer is not None else None
        if tokenizer is not None and tokenizer.vocab_size > vocab_size:
            raise UserError(f"the tokenizer ({tokenizer.name}) has {tokenizer.vocab_size:,} ids, more than the "
                            f"model's {vocab_size:,}: pass the tokenizer it was trained with (--tokenizer)")

    def encode(self, prompt):
        if self.tokenizer is None:
            try:
                ids = [int(t) for t in prompt.replace(",", " ").split()] or [0]
            except ValueError:
                raise UserError(f"this model was trained without a tokenizer ({self.vocab_size} ids): give the "
                                f"prompt as token ids, e.g. --prompt '3 1 4'") from None
            if not all(0 <= i < self.vocab_size for i in ids):
                raise UserError(f"prompt ids must lie in [0, {self.vocab_size})")
            return ids
        eot, eot_text = self.tokenizer.eot, self.tokenizer.decode([self.tokenizer.eot])
        ids = []
        for i, part in enumerate(prompt.split(eot_text) if eot_text else [prompt]):  # its text is the token
            ids += ([eot] if i else []) + (self.tokenizer.encode_batch([part])[0] if part else [])
        return ids or [eot]

    def decode(self, ids):
        return " ".join(map(str, ids)) if self.tokenizer is None else self.tokenizer.decode(ids)


def codec_for(model, ckpt, tokenizer_dir=None):
    """The Codec of a checkpoint: --tokenizer DIR, else the tokenizer in its training data's meta.json; without
    one, GPT-2's for synthetic data (or a data folder that is gone, with a note) and plain ids for token files
    without a tokenizer or a vocabulary too small for GPT-2's."""
    import prepare
    vocab_size = model.config.vocab_size
    if tokenizer_dir:
        return Codec(prepare.hf_tokenizer(tokenizer_dir), vocab_size)
    data, meta = training_data(ckpt)
    if not meta:
        if vocab_size < prepare.VOCAB_SIZE:  # too small for GPT-2's ids: token ids in, token ids out
            return Codec(None, vocab_size)
        if data != "synthetic":
            print(f"sample.py: note: the model's training data {data} has no meta.json here: decoding with "
                  f"GPT-2's BPE (pass --tokenizer DIR if it was trained with another)", file=sys.stderr)
        return Codec(prepare.gpt2_tokenizer(), vocab_size)
    tokenizer = prepare.tokenizer_of(meta)
    codec = Codec(tokenizer, vocab_size)
    if tokenizer is None and meta.get("vocab_size"):
        codec.vocab_limit = meta["vocab_size"]  # ids past the data's were never seen: the model's padding
    return codec


def sample(model, codec, prompt="", num_samples=1, max_new_tokens=200, temperature=0.8, top_k=200, seed=0,
           show=None):
    """The prompt and its continuation, as text (or ids), for each sample; deterministic for a seed on a device.
    The samples are drawn one after another, so that show(i, text), when given, can be handed sample i's text
    piece by piece as its tokens come: first the prompt, then what each new token adds."""
    device = next(model.parameters()).device
    ids = codec.encode(prompt)
    shown = 1 if codec.tokenizer is not None and not prompt else 0  # a new document: not its end-of-text
    torch.manual_seed(seed)
    texts = []
    for i in range(num_samples):
        row, printed = list(ids[shown:]), codec.decode(ids[shown:])
        if show is not None:
            show(i, printed)

        def add(next_id):  # (1, 1)
            nonlocal printed
            row.append(int(next_id))
            text = codec.decode(row)
            if not text.endswith("\ufffd"):  # not in the middle of a character's bytes
                show(i, text[len(printed):])
                printed = text
        idx = model.generate(torch.tensor([ids], dtype=torch.long, device=device), max_new_tokens,
                             temperature=temperature, top_k=top_k, vocab_limit=codec.vocab_limit, cache=True,
                             on_token=add if show is not None else None)                # (1, prompt + new)
        texts.append(codec.decode(idx[0, shown:].tolist()))
        if show is not None and texts[-1] != printed:
            show(i, texts[-1][len(printed):])  # a character left incomplete at the end
    return texts


def what_is_drawn(args, model, ckpt, device):
    """The line said before the first token (on stderr: the samples alone on stdout): "3 samples of 200
    tokens from out/ckpt.pt (mhar, step 200) on cpu, temperature 0.8, top-k 200, seed 0"."""
    n, k = args.num_samples, args.top_k
    return (f"{n} sample{'s' if n > 1 else ''} of {args.max_new_tokens} tokens from {args.ckpt} "
            f"({model.config.residual}, step {ckpt.get('step', '?')}) on {device}, "
            + ("greedy" if args.temperature == 0 else f"temperature {args.temperature:g}, "
               f"top-k {k if k else 'all'}") + f", seed {args.seed}")


def parse_args(argv=None):
    p = FlagParser(prog="sample.py", description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default="out/ckpt.pt", help="checkpoint written by train.py (default out/ckpt.pt)")
    p.add_argument("--prompt", default="", help="text to continue (default: a new document); token ids "
                                                "for a model trained without a tokenizer")
    p.add_argument("--num_samples", type=int, default=3, help="samples to draw, at least 1 (default 3)")
    p.add_argument("--max_new_tokens", type=int, default=200, help="tokens per sample, at least 1 (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature, >= 0; 0 = greedy, the "
                                                                  "likeliest token every time (default 0.8)")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k likeliest tokens, >= 0; 0 = all "
                                                          "(default 200)")
    p.add_argument("--seed", type=SEED, default=0, help="random seed, in [0, 2**63 - 1] (default 0)")
    p.add_argument("--tokenizer", metavar="DIR", help="a model folder with tokenizer.json (default: the one "
                                                      "the training data's meta.json names, or GPT-2's)")
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:1, mps (default auto)")
    args = p.parse_args(argv)
    for flag, smallest in (("num_samples", 1), ("max_new_tokens", 1), ("top_k", 0)):
        if getattr(args, flag) < smallest:
            exit_error("sample.py", f"--{flag} must be at least {smallest}, got {getattr(args, flag)}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):  # < 0 favours the unlikeliest
        exit_error("sample.py", f"--temperature must be a finite number >= 0 (0 = greedy), "
                                f"got {args.temperature}")
    return args


class Unwritable(Exception):
    """Standard output refused the samples: its reader closed it (| head) or its disk is full."""


def write(text):
    """text on standard output at once; Unwritable when it cannot take it."""
    try:
        print(text, end="", flush=True)
    except OSError as e:
        raise Unwritable(e) from None


def close_stdout():
    """Standard output onto /dev/null: nothing more reaches the closed or full one, Python's last flush at
    exit included (which would print its own error)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv=None):
    args = parse_args(argv)
    current = -1  # the sample being printed

    def show(i, text):  # each piece as its tokens come; a line of dashes between two samples
        nonlocal current
        if current < 0:  # the prompt is read: say what comes
            print(f"sample.py: {what_is_drawn(args, model, ckpt, device)}", file=sys.stderr, flush=True)
        if i != current:
            write("\n" + "-" * 40 + "\n" if i else "")
            current = i
        write(text)
    try:
        device = pick_device(args.device)
        model, ckpt = load_model(args.ckpt, device)
        codec = codec_for(model, ckpt, args.tokenizer)  # (imports prepare.py, tiktoken: the first handler's)
        interrupts.begin()  # printing begins: a Ctrl-C ends the sample's line first
        samples = sample(model, codec, args.prompt, args.num_samples, args.max_new_tokens, args.temperature,
                         args.top_k or None, args.seed, show)
    except UserError as e:
        exit_error("sample.py", str(e))
    except KeyboardInterrupt:
        print("" if current < 0 else "\n", end="", flush=True)  # the interrupted sample's line ends
        exit_error("sample.py", "interrupted (Ctrl-C)", status=130)
    except Unwritable as e:
        close_stdout()
        if isinstance(e.args[0], BrokenPipeError):
            return None  # the reader has what it wanted (| head -1): a quiet end
        exit_error("sample.py", f"cannot write the samples to standard output ({e.args[0].strerror})", status=1)
    # every sample is out: a Ctrl-C from here on, the process's teardown included, is too late and ignored
    ignore_stop_signals("sample.py")
    try:
        write("\n")
    except Unwritable:  # every sample is out but its last line's end: the run has finished
        close_stdout()
    return samples


if __name__ == "__main__":
    try:
        main()
    finally:  # however main ended (--help: argparse exits by itself), a signal is too late: ignored
        ignore_stop_signals("sample.py")
