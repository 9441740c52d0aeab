"""Configuration of a text encoder exported from Lingua (CrossBERT, BERT, ELECTRA, a contrastive or fine-tuning run).

Copied into every export folder by `python -m lingua.export`; it needs `transformers`, not the Lingua repository.
"""

from transformers import PretrainedConfig

POOLINGS = ("attention", "mean")
CLASSIFIER_POOLINGS = ("mean", "first", "attention")
MASKED_LMS = ("none", "encoder", "cross_attention", "self_attention")


class LinguaConfig(PretrainedConfig):
    """The encoder's shape, the special token ids, the pooler that makes `pooler_output`, the vector the sequence
    classifier reads, and the network that predicts `<mask>`ed tokens (its shape in the `mlm_` fields)."""

    model_type = "lingua"

    def __init__(self, vocab_size=50261, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, head_dim=64,
                 intermediate_size=2048, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
                 scale_embeddings=False, pooling="mean", pooler_num_layers=0, pooler_num_attention_heads=0,
                 pooler_head_dim=0, classifier_pooling="mean", masked_lm="none", mlm_output_bias=False,
                 mlm_num_layers=0, mlm_hidden_size=0, mlm_num_attention_heads=0, mlm_head_dim=0,
                 mlm_intermediate_size=0, mlm_rope_theta=10000.0, initializer_range=0.02, bos_token_id=50257,
                 eos_token_id=50258, pad_token_id=50259, mask_token_id=50260, **kwargs):
        for name, value, allowed in [("pooling", pooling, POOLINGS),
                                     ("classifier_pooling", classifier_pooling, CLASSIFIER_POOLINGS),
                                     ("masked_lm", masked_lm, MASKED_LMS)]:
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
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
        self.classifier_pooling = classifier_pooling  # mean of the real tokens | first token | attention pooler,
        # none of them L2-normalised
        self.masked_lm = masked_lm  # what the tied head reads: none (no head) | encoder: the encoder's states |
        # cross_attention: a network's mask queries reading the encoder's states of the tokens other than <mask> |
        # self_attention: a network's self-attention blocks over the input's token embeddings
        self.mlm_output_bias = mlm_output_bias  # the tied head adds a learned per-token bias
        self.mlm_num_layers = mlm_num_layers  # the blocks of the network that masked_lm names
        self.mlm_hidden_size = mlm_hidden_size
        self.mlm_num_attention_heads = mlm_num_attention_heads
        self.mlm_head_dim = mlm_head_dim
        self.mlm_intermediate_size = mlm_intermediate_size
        self.mlm_rope_theta = mlm_rope_theta
        self.initializer_range = initializer_range
        self.mask_token_id = mask_token_id
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs)
