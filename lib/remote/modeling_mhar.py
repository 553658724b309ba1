"""
A routed MHAR checkpoint as a transformers model: this project's GPT (mhar.py, copied into the
directory beside this file) behind PreTrainedModel and GenerationMixin, so that

    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

computes mhar.GPT's logits and generates with the attention keys and values in transformers'
own cache. Nothing of the architecture is written here: the forward is GPT.hidden and its LM
head, the KV cache is transformers' DynamicCache seen through mhar.KVCache's interface. Only
the positions that transformers' arguments ask for (an attention_mask's padding, position_ids)
are built here, as its own models prepare their masks, and reach GPT.hidden ready.

The tensors keep GPT's names under "model." (model.embed.weight, model.sites.0.query, ...); a
tied LM head is the embedding and is not stored. What it takes, beyond input_ids: an
attention_mask with padding (left or right; no token attends to padding, and routing is per
position), position_ids (the rotary positions; default: each row's count of tokens before, as
transformers numbers a padded batch), a dynamic cache followed by one token or several. What it
refuses, with one ValueError each: inputs_embeds, output_attentions, a static cache, an
attn_implementation other than "sdpa", any other keyword. hidden_states are the input of each
block's attention sublayer (for a routed model, its routed read) and the final normed state:
L + 1 tensors, as Qwen3's.
"""
import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_mhar import MHARConfig
from .mhar import GPT, Config, Positions, token_positions

# the output's cache: "cache" from transformers 5.24, "past_key_values" before
CACHE_FIELD = next(name for name in ("cache", "past_key_values")
                   if name in CausalLMOutputWithPast.__dataclass_fields__)
LOSS_KWARGS = ("num_items_in_batch",)  # what Trainer passes on to the loss


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


def padded_positions(model, start, T, attention_mask=None, position_ids=None):
    """The mhar.Positions of T tokens after `start` cached ones, or None for GPT.hidden's own
    (causal, unpadded). attention_mask (B, start + T): 0 for padding, which no token reads (routing
    is per position), a padding query its own key alone (not a softmax over nothing); position_ids
    (B, T): by default each token's count of tokens before it in its row."""
    if attention_mask is None and position_ids is None:
        return None
    causal = token_positions(model.rope_cos, model.rope_sin, start, T)  # checks the window too
    if position_ids is None:
        counts = attention_mask.long().cumsum(-1) - 1                          # (B, start + T)
        position_ids = counts.masked_fill(attention_mask == 0, 0)[:, start:]   # (B, T)
    cos, sin = (table[position_ids].unsqueeze(1) for table in (model.rope_cos, model.rope_sin))
    if attention_mask is None:                                              # (B, 1, T, hd/2) each
        return Positions(cos, sin, causal.allowed)
    reads = torch.ones(T, start + T, dtype=torch.bool, device=cos.device).tril(start)  # (T, S + T)
    own = reads.triu(start)                            # (T, S + T): query i's own key, start + i
    keys = attention_mask.bool()[:, None, None]                             # (B, 1, 1, S + T)
    return Positions(cos, sin, reads & keys | own)                          # (B, 1, T, S + T)


class MHARPreTrainedModel(PreTrainedModel):
    config_class = MHARConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _supports_sdpa = True  # GPT's attention is torch's scaled_dot_product_attention
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}  # when config ties them
    _no_split_modules = ["GPT"]  # a device map keeps it whole: each site reads every sublayer

    def __init__(self, config):
        super().__init__(config)
        if config._attn_implementation not in (None, "sdpa"):
            raise ValueError(f"{type(self).__name__}'s attention is torch's SDPA: attn_implementation"
                             f"={config._attn_implementation!r} is not supported; use \"sdpa\" "
                             f"(the default)")
        fields = {k: v for k, v in config.mhar.items() if k in Config.__dataclass_fields__}
        self.model = GPT(Config(**fields))
        self.post_init()

    def _init_weights(self, module):
        """transformers builds the model on the meta device, loads what the directory holds, then
        calls this for the modules it did not fill: a tensor the directory lacks starts as mhar.GPT
        starts it, one it holds is kept; the rotary tables (never stored) are computed again."""
        held = {name: t.detach().clone() for name, t in module.named_parameters(recurse=False)
                if getattr(t, "_is_hf_initialized", False)}
        self.model.init_weights([module])
        with torch.no_grad():
            for name, t in held.items():
                getattr(module, name).copy_(t)

    def _set_gradient_checkpointing(self, enable=True, gradient_checkpointing_func=None,
                                    every_n_layers=1):
        """gradient_checkpointing_enable(), Trainer(gradient_checkpointing=True): mhar.Config's
        checkpointing, which recomputes every sublayer in backward (torch's non-reentrant
        checkpoint; every_n_layers and the checkpoint function's options are not used)."""
        self.model.config.checkpointing = self.gradient_checkpointing = enable

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def resize_token_embeddings(self, *args, **kwargs):
        """transformers' resize; mhar.Config's vocab_size (and the directory's "mhar" section when
        saved) follows it."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        self.model.config.vocab_size = self.config.mhar["vocab_size"] = embeddings.num_embeddings
        return embeddings

    def run(self, input_ids, attention_mask, position_ids, cache, use_cache, inputs_embeds,
            output_hidden_states, output_attentions, past_key_values, kwargs):
        """(final hidden states (B, T, d), the cache or None, hidden_states or None): GPT.hidden
        with transformers' arguments, each one used or refused."""
        unknown = set(kwargs) - set(LOSS_KWARGS)
        if unknown:
            raise ValueError(f"{type(self).__name__} does not take {', '.join(sorted(unknown))}")
        if inputs_embeds is not None:
            raise ValueError(f"{type(self).__name__} takes input_ids, not inputs_embeds")
        if output_attentions:
            raise ValueError(f"{type(self).__name__} has no attention weights to output (its "
                             f"attention is torch's SDPA); the routing weights over depth: "
                             f"mhar.GPT.routing_weights")
        cache = past_key_values if cache is None else cache
        if getattr(cache, "is_compileable", False):
            raise ValueError(f"{type(self).__name__} takes a dynamic cache (the default), not a "
                             f"static one: drop cache_implementation=\"static\"")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.model.config.checkpointing and torch.is_grad_enabled():
            use_cache = False  # as transformers' own models: recomputing would extend a cache twice
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        layers = None  # one per sublayer, as GPT.generate's KVCaches; an MLP's goes unused
        if cache is not None:  # read and extended, as transformers' models do, use_cache=False too
            layers = [LayerCache(cache, j // 2) for j in range(len(self.model.layers))]
        start, T = 0 if cache is None else cache.get_seq_length(), input_ids.size(1)
        if attention_mask is not None and attention_mask.shape != (input_ids.size(0), start + T):
            raise ValueError(f"attention_mask must be (B, {start + T}): 1 for each token of the "
                             f"cache and the input, 0 for padding")
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None                       # no padding: the unmasked path, exactly
        # past the window, mhar.token_positions' error says so: the positions that generate derives
        # and passes, out of range then too, are checked only where the sequence fits
        window = self.model.config.seq_len
        if position_ids is not None and start + T <= window and (position_ids.size(-1) != T or not (
                0 <= int(position_ids.min()) <= int(position_ids.max()) < window)):
            raise ValueError(f"position_ids must be (B, {T}) in [0, {window})")
        at = padded_positions(self.model, start, T, attention_mask, position_ids)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        states = []  # output_hidden_states: each attention sublayer's input, seen by a hook
        hooks = [layer.register_forward_pre_hook(lambda module, args: states.append(args[0]))
                 for layer in self.model.layers[::2]] if output_hidden_states else []
        try:
            h = self.model.hidden(input_ids, cache=layers, at=at)                   # (B, T, d)
        finally:
            for hook in hooks:
                hook.remove()
        return h, cache if use_cache else None, (*states, h) if output_hidden_states else None

    def finish(self, output, return_dict):
        return output if return_dict or return_dict is None and self.config.return_dict \
            else output.to_tuple()


class MHARModel(MHARPreTrainedModel):
    """The base model (AutoModel): the final normed hidden states, no LM head."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                use_cache=None, inputs_embeds=None, output_hidden_states=None,
                output_attentions=None, return_dict=None, past_key_values=None, **kwargs):
        h, cache, states = self.run(input_ids, attention_mask, position_ids, cache, use_cache,
                                    inputs_embeds, output_hidden_states, output_attentions,
                                    past_key_values, kwargs)
        return self.finish(BaseModelOutputWithPast(last_hidden_state=h, hidden_states=states,
                                                   **{CACHE_FIELD: cache}), return_dict)


class MHARForCausalLM(MHARPreTrainedModel, GenerationMixin):
    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                labels=None, use_cache=None, logits_to_keep=0, inputs_embeds=None,
                output_hidden_states=None, output_attentions=None, return_dict=None,
                past_key_values=None, **kwargs):
        """input_ids (B, T) -> logits (B, T, vocab) in float32, as GPT.forward; with labels,
        transformers' causal LM loss (labels shifted inside, -100 ignored). cache (before
        transformers 5.24: past_key_values), a transformers Cache of the tokens before input_ids,
        which then take the positions after them (mhar.GPT.hidden). logits_to_keep: the last n
        positions' logits (0: all), or a tensor of the positions to keep."""
        h, cache, states = self.run(input_ids, attention_mask, position_ids, cache, use_cache,
                                    inputs_embeds, output_hidden_states, output_attentions,
                                    past_key_values, kwargs)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.model.lm_head(h[:, keep]).float()                         # (B, T, vocab)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        return self.finish(CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=states,
                                                  **{CACHE_FIELD: cache}), return_dict)
