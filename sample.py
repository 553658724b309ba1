"""
Generate text from a train.py checkpoint.

    python sample.py --ckpt out/ckpt.pt                                  # 3 samples from a new document
    python sample.py --ckpt out/ckpt.pt --prompt "def main(" --max_new_tokens 100 --temperature 0.8 --top_k 50
    python sample.py --ckpt out/ckpt.pt --prompt "import os" --seed 1 --num_samples 1 --device cuda

The prompt is encoded with GPT-2's BPE (prepare.get_encoding(), offline too); the empty prompt starts
a new document (end-of-text). Each sample prints the prompt and its continuation. Sampling is a pure
function of (checkpoint, prompt, flags, --seed): the same command prints the same text.

A model whose vocabulary is smaller than GPT-2's (trained on a tokenizer-less token file) has no text:
its prompt is a list of token ids ("--prompt '3 1 4'", empty = token 0) and it prints ids. A model
trained on --data synthetic (random tokens over GPT-2's padded vocabulary) is decoded anyway: its
text is noise, and ids past GPT-2's 50,257 (the padding) print as <|id|>.
"""
import argparse
import sys

import torch

from common import UserError, load_model, pick_device

GPT2_VOCAB = 50257  # ids 0..50256; the padded ids above cannot be decoded


class Codec:
    """Text <-> token ids: GPT-2's BPE when the model's vocabulary holds it, plain id lists otherwise."""

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size
        self.enc = None
        if vocab_size >= GPT2_VOCAB:
            import prepare
            try:
                self.enc = prepare.get_encoding()
            except prepare.PrepareError as e:
                raise ValueError(f"GPT-2's tokenizer is not available: {e}") from None

    def encode(self, prompt):
        if self.enc is None:
            try:
                ids = [int(t) for t in prompt.replace(",", " ").split()] or [0]
            except ValueError:
                raise ValueError(f"this model's vocabulary ({self.vocab_size} ids) is not GPT-2's: give the "
                                 f"prompt as token ids, e.g. --prompt '3 1 4'") from None
            if not all(0 <= i < self.vocab_size for i in ids):
                raise ValueError(f"prompt ids must lie in [0, {self.vocab_size})")
            return ids
        return self.enc.encode(prompt, allowed_special={"<|endoftext|>"}) or [self.enc.eot_token]

    def decode(self, ids):
        if self.enc is None:
            return " ".join(map(str, ids))
        text, run = [], []
        for i in ids + [None]:  # decode runs of GPT-2 ids; a padding id prints as <|id|>
            if i is not None and i < GPT2_VOCAB:
                run.append(i)
                continue
            if run:
                text.append(self.enc.decode(run))
                run = []
            if i is not None:
                text.append(f"<|{i}|>")
        return "".join(text)


def sample(model, codec, prompt="", num_samples=1, max_new_tokens=200, temperature=0.8, top_k=200, seed=0):
    """The prompt and its continuation, as text (or ids), for each sample; deterministic for a seed on a device."""
    device = next(model.parameters()).device
    ids = codec.encode(prompt)
    shown = 1 if codec.enc is not None and not prompt else 0  # a new document: do not print its end-of-text
    torch.manual_seed(seed)
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)
    idx = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)       # (samples, prompt + new)
    return [codec.decode(row[shown:].tolist()) for row in idx]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="sample.py", description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default="out/ckpt.pt", help="checkpoint written by train.py (default out/ckpt.pt)")
    p.add_argument("--prompt", default="", help="text to continue (default: a new document); token ids "
                                                "for a model without GPT-2's vocabulary")
    p.add_argument("--num_samples", type=int, default=3, help="samples to draw (default 3)")
    p.add_argument("--max_new_tokens", type=int, default=200, help="tokens per sample (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k likeliest tokens; 0 = all (default 200)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:1, mps (default auto)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        model, _ = load_model(args.ckpt, pick_device(args.device))
        samples = sample(model, Codec(model.config.vocab_size), args.prompt, args.num_samples, args.max_new_tokens,
                         args.temperature, args.top_k or None, args.seed)
    except (UserError, ValueError) as e:
        print(f"sample.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    for i, text in enumerate(samples):
        if i:
            print("-" * 40)
        print(text, flush=True)


if __name__ == "__main__":
    main()
