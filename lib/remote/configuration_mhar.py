"""
The transformers configuration of a routed MHAR checkpoint, written into the directory beside
modeling_mhar.py and mhar.py (hf.save; docs/conversion.md, Grafting MHAR onto Qwen3).

Its "mhar" entry holds the fields of mhar.Config, from which modeling_mhar builds the model; the
Qwen3 names beside it (hidden_size, num_hidden_layers, max_position_embeddings, ...) are written
from the same Config, for the tools that read them: lm-eval's context length, generation, PEFT.
"""
from transformers import PretrainedConfig


class MHARConfig(PretrainedConfig):
    model_type = "mhar"

    def __init__(self, mhar=None, use_cache=True, **kwargs):
        self.mhar = dict(mhar or {})   # mhar.Config's fields
        self.use_cache = use_cache     # generation keeps the attention keys and values by default
        super().__init__(**kwargs)
