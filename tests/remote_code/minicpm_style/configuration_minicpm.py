"""A tiny MiniCPM-style configuration for tests: a model directory's own code (``auto_map``), as MiniCPM4 ships
it, loaded only with ``trust_remote_code=True``."""

from transformers import PretrainedConfig


class MiniCPMConfig(PretrainedConfig):
    model_type = "minicpm"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                 rope_theta=10000.0, scale_emb=12.0, scale_depth=1.4, dim_model_base=256, initializer_range=0.1,
                 use_cache=True, pad_token_id=0, bos_token_id=1, eos_token_id=5, tie_word_embeddings=False,
                 sparse_config=None, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        # muP scalings (MiniCPM): embeddings x scale_emb, residual branches x scale_depth / sqrt(layers),
        # logits of the last hidden state divided by hidden_size / dim_model_base
        self.scale_emb = scale_emb
        self.scale_depth = scale_depth
        self.dim_model_base = dim_model_base
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.sparse_config = sparse_config  # MiniCPM4's InfLLM v2 sparse attention when set (not implemented here)
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
