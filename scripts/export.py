"""
Export a train.py checkpoint as a Hugging Face directory.

    python -m scripts.export out/ckpt.pt out/hf                          # tensors as trained (float32)
    python -m scripts.export runs/qwen3-mhar/ckpt.pt out/qwen3-mhar --dtype bfloat16 \\
        --tokenizer models/Qwen3-0.6B

A baseline becomes a Qwen3 checkpoint (config.json, model.safetensors) that transformers loads
with the same logits; a routed model (attnres, mhar, hyper) becomes a checkpoint with its code,
which transformers runs with AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
and hf.load reads back, both exactly (hf.py says how). Tensors past
--max_shard_size (default 5GB) are split into shards and an index, as transformers writes them.
The directory is new, empty or an earlier export, which is replaced: a folder that holds another
model (its config.json without the "mhar" section every export writes), a train.py run or any
file an export does not write is refused, and left as it was.
--tokenizer copies the tokenizer files and special token ids of a Hugging Face model directory;
by default those of the directory the run was initialized from, when there is one. A run that
kept a weight average (train.py --ema) is exported with the averaged weights, which the paper
evaluates and releases; --raw writes the trained weights instead.
"""
import shutil
from pathlib import Path

from lib import hf
from lib.common import FlagParser, MachineError, UserError, exit_error, load_model, one_line, output_folder


def parse_args(argv=None):
    p = FlagParser(prog="export.py", description=__doc__.split("\n\n")[0].strip())
    p.add_argument("ckpt", help="a train.py checkpoint (ckpt.pt)")
    p.add_argument("out_dir", help="the directory to write: new (created), empty, or an earlier "
                                   "export, which is replaced; one that holds anything else is "
                                   "refused")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="the tensors' dtype in the files (default: as trained)")
    p.add_argument("--tokenizer", help="a Hugging Face model directory whose tokenizer files to copy "
                                       "(default: the run's --init_from directory, if any)")
    p.add_argument("--max_shard_size", default="5GB",
                   help="the largest weights file; past it, shards and an index (default 5GB)")
    p.add_argument("--raw", action="store_true",
                   help="the trained weights, not their average (default: the average when the "
                        "run kept one, train.py --ema)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    created, out = [], Path(args.out_dir)
    try:
        if args.tokenizer and not Path(args.tokenizer).is_dir():
            raise UserError(f"--tokenizer {args.tokenizer} is not a directory: give a Hugging Face "
                            f"model directory")
        # out_dir before the checkpoint, which may take long to read: another model or a run
        # folder there is refused first, and left as it was
        out = hf.export_folder(output_folder(args.out_dir, "out_dir"))
        model, ckpt = load_model(args.ckpt, average=not args.raw)
        averaged = bool(ckpt.get("ema")) and not args.raw
        init_from = (ckpt.get("args") or {}).get("init_from")
        from_dir = init_from and Path(init_from, "config.json").is_file()
        source = args.tokenizer or (init_from if from_dir else None)
        created = [d for d in (out, *out.parents) if not d.exists()]  # deepest first
        hf.save(model, out, source=source, dtype=args.dtype, max_shard_size=args.max_shard_size)
    except Exception as e:
        if created:  # the folders this export made hold nothing worth keeping
            shutil.rmtree(created[-1], ignore_errors=True)
        # ours are one line already, whole (a long folder's path must not cut off what to do); another
        # library's ValueError may not be: its first line, shortened
        if isinstance(e, (UserError, ValueError)):
            exit_error("export.py", e if isinstance(e, UserError) else one_line(e))
        if isinstance(e, MachineError):  # hf.save's: a full disk, a read-only folder
            exit_error("export.py", e, status=1)
        if isinstance(e, OSError):
            reason = e.strerror or one_line(e)
            exit_error("export.py", f"cannot write {out} ({reason}): free some space or export "
                                    f"elsewhere", status=1)
        raise
    if model.config.residual == "baseline":
        how = "a Qwen3 checkpoint: transformers.AutoModelForCausalLM.from_pretrained"
    else:
        how = (f"{model.config.residual} routing with its code: transformers.AutoModelForCausalLM"
               f".from_pretrained(..., trust_remote_code=True), or hf.load")
    tokenizer = f"tokenizer from {source}" if source else "no tokenizer files (pass --tokenizer DIR)"
    weights = "the weight average (--raw: the trained weights)" if averaged else "the weights"
    print(f"wrote {out}: {how}({str(out)!r}); {model.num_params():,} parameters, {weights}; "
          f"{tokenizer}")


if __name__ == "__main__":
    main()
