"""
A routed MHAR checkpoint as a transformers model: this project's GPT (mhar.py, copied into the
directory beside this file) behind PreTrainedModel and GenerationMixin, so that

    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

computes mhar.GPT's logits and generates with the attention keys and values in transformers'
own cache. Nothing of the architecture is written here: the forward is GPT.hidden and its LM
head, the KV cache is transformers' DynamicCache seen through mhar.KVCache's interface.

The tensors keep GPT's names under "model." (model.embed.weight, model.sites.0.query, ...); a
tied LM head is the embedding and is not stored. The model takes no padding mask: an
attention_mask with zeros (left-padded batches) is refused rather than ignored.
"""
import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_mhar import MHARConfig
from .mhar import GPT, Config, rotary_tables

# the output's cache: "cache" from transformers 5.24, "past_key_values" before
CACHE_FIELD = next(name for name in ("cache", "past_key_values")
                   if name in CausalLMOutputWithPast.__dataclass_fields__)


class LayerCache:
    """mhar.KVCache's interface (length, extend) over one attention layer of a transformers
    Cache, which holds the keys and values (B, n_kv_head, T, head_dim) of every layer."""

    def __init__(self, cache, layer):
        self.cache, self.layer = cache, layer

    @property
    def length(self):
        return self.cache.get_seq_length(self.layer)

    def extend(self, k, v):
        return self.cache.update(k, v, self.layer)


class MHARPreTrainedModel(PreTrainedModel):
    config_class = MHARConfig
    base_model_prefix = "model"
    _no_split_modules = ["GPT"]  # a device map keeps it whole: each site reads every sublayer

    def _init_weights(self, module):
        # transformers builds the model on the meta device and loads every stored tensor; the
        # rotary tables are not stored (GPT computes them), so they are computed again here
        if isinstance(module, GPT):
            c = module.config
            cos, sin = rotary_tables(c.seq_len, c.head_width, c.rope_theta)
            with torch.no_grad():
                module.rope_cos.copy_(cos)
                module.rope_sin.copy_(sin)


class MHARForCausalLM(MHARPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}

    def __init__(self, config):
        super().__init__(config)
        fields = {k: v for k, v in config.mhar.items() if k in Config.__dataclass_fields__}
        self.model = GPT(Config(**fields))
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, cache=None, labels=None,
                use_cache=None, logits_to_keep=0, inputs_embeds=None, past_key_values=None,
                **kwargs):
        """input_ids (B, T) -> logits (B, T, vocab) in float32, as GPT.forward; with labels,
        transformers' causal LM loss (labels shifted inside, -100 ignored). cache (before
        transformers 5.24: past_key_values), a transformers Cache of the tokens before input_ids,
        which then take the positions after them (mhar.GPT.hidden)."""
        if inputs_embeds is not None:
            raise ValueError("MHARForCausalLM takes input_ids, not inputs_embeds")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("MHARForCausalLM takes no padding mask (its attention is causal over "
                             "the whole input): give sequences of one length, or one at a time")
        cache = past_key_values if cache is None else cache
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        layers = None  # one per sublayer, as GPT.generate's KVCaches; an MLP's goes unused
        if use_cache:
            layers = [LayerCache(cache, j // 2) for j in range(len(self.model.layers))]
        h = self.model.hidden(input_ids, cache=layers)                         # (B, T, d)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.model.lm_head(h).float()                                  # (B, T, vocab)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits,
                                      **{CACHE_FIELD: cache if use_cache else None})
