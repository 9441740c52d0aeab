"""Configuration of a text encoder exported from Lingua (CrossBERT, BERT, ELECTRA or a contrastive run).

Copied into every export folder by `python -m lingua.export`; it needs `transformers`, not the Lingua repository.
"""

from transformers import PretrainedConfig

POOLINGS = ("attention", "mean")


class LinguaConfig(PretrainedConfig):
    """The encoder's shape, the special token ids and the pooler that makes `pooler_output`."""

    model_type = "lingua"

    def __init__(self, vocab_size=50261, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, head_dim=64,
                 intermediate_size=2048, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
                 scale_embeddings=False, pooling="mean", pooler_num_layers=0, pooler_num_attention_heads=0,
                 pooler_head_dim=0, initializer_range=0.02, bos_token_id=50257, eos_token_id=50258,
                 pad_token_id=50259, mask_token_id=50260, **kwargs):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.head_dim = head_dim
        self.intermediate_size = intermediate_size  # SwiGLU hidden size, shared by the pooler's blocks
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings  # longest input: the RoPE table's length
        self.scale_embeddings = scale_embeddings  # token embeddings enter the residual stream times sqrt(dim)
        self.pooling = pooling  # attention: learned query and cross-attention blocks | mean: mean of real tokens
        self.pooler_num_layers = pooler_num_layers
        self.pooler_num_attention_heads = pooler_num_attention_heads
        self.pooler_head_dim = pooler_head_dim
        self.initializer_range = initializer_range
        self.mask_token_id = mask_token_id
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs)
