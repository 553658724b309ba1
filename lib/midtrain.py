"""
The mid-training recipe: train.py --init_from DIR continues a pretrained Qwen3 as delta MHAR.

The paper (Luo, Cai, Hu, 2026, "Multi-Head Attention Residuals", section Mid-training and
appendix Training and reproducibility details) converts Marin-8B, a Llama-3.1-8B model at its
pre-decay plateau, and trains it 9,500 steps on an anneal corpus against a schedule-matched plain
continued-pretraining control. Its from-scratch recipe (train.py's defaults) differs in several
places; RECIPE says where each value comes from, and "ours" marks a choice the paper leaves open.
The recipe also implies, for train.py: the step count and the schedule start at 0 (a new run);
AdamW starts cold ("we cold-start AdamW": the checkpoint has no moments), with betas
(0.9, 0.95) and eps 1e-8 as from scratch ("the settings below are common to every method and
scale unless noted"); weight decay on the matrices alone (param_groups).

    RECIPE                                every value, with its source
    RUN, FLAGS, ROUTING                   the recipe as train.py's run sizes and flag defaults
    param_groups(model, lr)               AdamW groups: weight decay on the matrices alone
    take_flags(args, given, directory, shape)    DIR's shape and the recipe as train.py's flags
    check_tokenizer(tokens, directory, vocab_size)   the token files are DIR's tokenizer's
"""
import hashlib

from lib.common import UserError, largest_id

RECIPE = {  # train.py flag: (default, where it comes from)
    "residual": ("mhar", "'We convert with the delta (additive-stream) form of attention "
                         "residuals'"),
    "delta": (True, "'adds the routed term to the intact residual stream ... closing the gate "
                    "therefore leaves the pretrained computation untouched'"),
    "route_block": (8, "'one delta per block of four consecutive layers': 4 layers = 8 sublayers"),
    "route_heads": (8, "'each routing site attends over at most nine sources with H=8 heads'"),
    "lr": (4e-4, "'cools from peak 4e-4 to 4e-6 over 9,500 steps'"),
    "min_lr_ratio": (0.01, "the same line: 4e-6 / 4e-4"),
    "max_steps": (9500, "the same line"),
    "warmup_steps": (100, "'a short linear re-warmup (0 -> peak) to rebuild the second moment "
                          "before decaying'; no length given. Ours: 5 time constants of "
                          "beta2 = 0.95 (1 / (1 - 0.95) = 20 steps), about 1% of the run"),
    "schedule": ("cosine", "the decay shape is not named ('the same peak rate, decay shape, "
                           "batch'). Ours: train.py's cosine, which ends at min_lr_ratio x peak"),
    "weight_decay": (0.05, "'weight decay 0.05 (excluding embeddings, norms, biases)'; from "
                           "scratch it is 0.1 on all parameters"),
    "grad_clip": (1.0, "'Gradients are clipped to global norm 1.0' (common to every run)"),
    "seq_len": (4096, "'sequence length 4096'"),
    "global_batch": (256, "'a global batch of about 1.05M tokens': 256 x 4096 = 1,048,576"),
    "dtype": ("bfloat16", "'Training uses FSDP full-shard, bfloat16, and activation "
                          "checkpointing'"),
    "ema": (0.999, "'weight-EMA (beta = 0.999, evaluated)': the EMA weights are evaluated and "
                   "released"),
    "z_loss": (1e-4, "'a logit z-loss (1e-4)'"),
    "eval_interval": (500, "not given. Ours: as from scratch"),
    "eval_batches": (20, "not given. Ours: as from scratch"),
}

# The run sizes: the recipe's, with the machine's micro-batch (raise --batch_size as memory
# allows: fewer, larger micro-steps).
RUN = dict(batch_size=1, **{k: RECIPE[k][0] for k in ("global_batch", "max_steps", "lr",
                                                      "warmup_steps", "eval_interval",
                                                      "eval_batches")})
# The recipe's other values that are flags. Its dtype, bfloat16, is --dtype auto's on GPUs (bf16
# autocast over float32 weights), and its decay shape is train.py's only one.
FLAGS = dict({k: RECIPE[k][0] for k in ("residual", "min_lr_ratio", "weight_decay", "grad_clip",
                                        "seq_len", "ema", "z_loss")},
             decay_on="matrices")
ROUTING = ("delta", "route_block", "route_heads")  # for a routed --residual alone


def param_groups(model, lr, weight_decay=RECIPE["weight_decay"][0]):
    """AdamW parameter groups of the recipe: weight decay on the matrices alone.

    The paper excludes embeddings, norms and biases (this decoder has no biases). The parameters
    routing adds (queries, gates, null source, key norms) are vectors and scalars like those; the
    paper does not name them, and decay would pull the zero-initialized gates back shut, so they
    are not decayed either. An untied LM head is a matrix (GPT.param_groups) and is decayed.
    """
    return [{"name": name, "params": params, "lr": lr,
             "weight_decay": weight_decay if name == "matrices" else 0.0}
            for name, params in model.param_groups().items() if params]


def take_flags(args, given, directory, shape):
    """train.py's flags for --init_from DIR: the model's shape (mhar.Config fields read from
    DIR/config.json; a flag that contradicts it is a UserError), the recipe for every flag left
    out."""
    if shape["residual"] != "baseline":
        raise UserError(f"{directory} is this project's {shape['residual']} export, not a Qwen3 "
                        f"checkpoint: --init_from DIR converts a Qwen3 checkpoint (continue a run "
                        f"of ours with --resume)")
    shape = {k: v for k, v in shape.items() if k not in ("residual", "seq_len")}  # ours to choose
    for name, value in shape.items():
        if name in given and getattr(args, name) != value:
            raise UserError(f"{directory}/config.json fixes --{name} at {value}, not "
                            f"{getattr(args, name)}: drop the flag")
        setattr(args, name, value)
    for name, value in FLAGS.items():
        if name not in given:
            setattr(args, name, value)
    # a routed residual converts as delta routing, which starts as the model; --residual baseline
    # is the paper's control (the same recipe, no routing): its routing flags are the preset's
    routed = args.residual in ("attnres", "mhar")
    for name in ROUTING:
        if name not in given:
            setattr(args, name, RECIPE[name][0] if routed else None)


def check_tokenizer(tokens, directory, vocab_size):
    """--init_from DIR reads token ids of DIR's own tokenizer. prepare.py --tokenizer records the
    SHA-256 of the tokenizer.json it used: when the data names a tokenizer and DIR has a
    tokenizer.json, they must be the same file (GPT-2 ids in a Qwen3 model would train it on
    nonsense without a complaint). Token files of another tool (no tokenizer recorded) or a DIR
    without tokenizer.json are checked by their ids alone: every id one the model has, and the
    vocabulary prepare.py saw in the tokenizer's config.json, if any, the model's. UserError
    otherwise."""
    if tokens is None:
        return
    meta, tokenizer = tokens.meta, directory / "tokenizer.json"
    name = meta.get("tokenizer")
    redo = f"prepare the corpus with python prepare.py --tokenizer {directory}"
    if tokenizer.is_file() and name not in (None, "none"):
        if meta.get("tokenizer_sha256") != hashlib.sha256(tokenizer.read_bytes()).hexdigest():
            raise UserError(f"{tokens.folder} was tokenized with {name}, not with the "
                            f"tokenizer.json of {directory}: {redo}")
    vocab = meta.get("vocab_size") or 1 + max(largest_id(tokens.train), largest_id(tokens.val))
    recorded = meta.get("model_vocab_size")  # the vocabulary of the tokenizer's own model
    if vocab > vocab_size or recorded not in (None, vocab_size):
        raise UserError(f"{tokens.folder} holds ids of a vocabulary of {vocab} "
                        + (f"(its tokenizer's model: {recorded}) " if recorded else "")
                        + f"and {directory} has {vocab_size}: {redo}")
