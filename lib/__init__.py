"""What the scripts import: one-line errors, devices, token files and checkpoints (common), a training
run's reports, timer and weight average (run), the learning-rate schedule (schedule), the first handler
for Ctrl-C (interrupts), DDP and FSDP2 (parallel), the LM head's loss without the logits (head), Qwen3
checkpoints in and out (hf; its remote-code files in remote/), the mid-training recipe (midtrain).
Importing the package imports none of them."""
