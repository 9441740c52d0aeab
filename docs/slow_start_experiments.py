"""The controlled experiments of docs/crossbert_slow_start.md: one change at a time to CrossBERT (or BERT), each
patched in for this script only, on the diagnostic's task (apps/diagnose.py). From the repository root:
    python docs/slow_start_experiments.py VARIANT [diagnose key=value ...]
VARIANT: base | mask_std=S | qk_norm | key_bias=S | layerwise | tied | bert_hidden_masks | pred_lr=X | out_std=S |
         pred_rope_theta=T | embedding_keys | centred_context
Prints the held-out accuracy every 50 steps of the last app in apps= (default: CrossBERT, 20% masked, no CMS).
The table's rows ran with unscaled embeddings: add encoder.scale_embeddings=false to reproduce them (the
scale is on by default since).
"""

import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import apps.bert.model as bert  # noqa: E402
import apps.crossbert.model as crossbert  # noqa: E402
import apps.diagnose as diagnose  # noqa: E402
from apps.diagnose import DiagnoseArgs, learning_curve  # noqa: E402
from lingua import optim, transformer  # noqa: E402
from lingua.args import load_config  # noqa: E402
from lingua.masking import gather_tokens  # noqa: E402


def attention_with(self, x, context, q_rope, kv_rope, bias, backend, key_bias=None, qk_norm=False):
    B, Sq, Sk = x.shape[0], x.shape[1], context.shape[1]
    q = self.wq(x).view(B, Sq, self.n_heads, self.head_dim)
    k = (self.wk(context) + (key_bias if key_bias is not None else 0)).view(B, Sk, self.n_heads, self.head_dim)
    v = self.wv(context).view(B, Sk, self.n_heads, self.head_dim)
    if qk_norm:
        q, k = F.rms_norm(q, (self.head_dim,)), F.rms_norm(k, (self.head_dim,))
    out = transformer.attention(transformer.apply_rope(q, q_rope), transformer.apply_rope(k, kv_rope), v, bias, backend)
    return self.wo(out.reshape(B, Sq, -1))


def patch(variant: str) -> None:
    name, _, value = variant.partition("=")
    init_weights = crossbert.CrossBert.init_weights
    if name == "mask_std":  # the mask embedding's init scale (default: init_std, 0.02)
        def init(self):
            init_weights(self)
            torch.nn.init.normal_(self.predictor.mask_embedding, std=float(value))
        crossbert.CrossBert.init_weights = init
    elif name == "qk_norm":  # RMS-normalised queries and keys, in every attention
        transformer.Attention.forward = lambda self, *a: attention_with(self, *a, qk_norm=True)
    elif name == "key_bias":  # a learned constant added to the predictor's keys: a content-free positional kernel
        def init(self):
            init_weights(self)
            for layer in self.predictor.layers:
                layer.attention.key_bias = torch.nn.Parameter(torch.randn(self.args.encoder.dim) * float(value))
        crossbert.CrossBert.init_weights = init
        transformer.Attention.forward = lambda self, *a: attention_with(self, *a, key_bias=getattr(self, "key_bias",
                                                                                                    None))
    elif name == "layerwise":  # predictor block l reads encoder block l's output (needs as many blocks)
        def predict(self, inputs, positions, query_positions):
            states, p = self.encoder(inputs, positions, None, all_layers=True), self.predictor
            h, q_rope, kv_rope = p.mask_embedding.expand(*query_positions.shape, -1), p.rope(query_positions), \
                p.rope(positions)
            for layer, context in zip(p.layers, states):
                h = layer(h, context, q_rope, kv_rope, None)
            return p.norm(h)
        crossbert.CrossBert.predict = predict
    elif name == "tied":  # the queries go through the encoder's own blocks, cross-attending to each block's input
        def predict(self, inputs, positions, query_positions):
            enc = self.encoder
            h, rope, q_rope = enc.tok_embeddings(inputs), enc.rope(positions), enc.rope(query_positions)
            q = self.predictor.mask_embedding.expand(*query_positions.shape, -1)
            for layer in enc.layers:
                q = q + layer.attention(layer.attention_norm(q), layer.attention_norm(h), q_rope, rope, None, "sdpa")
                q = q + layer.feed_forward(layer.ffn_norm(q))
                h = layer(h, rope, None)
            return enc.norm(q)
        crossbert.CrossBert.predict = predict
    elif name == "bert_hidden_masks":  # BERT whose <mask> positions no position attends to (pure readers)
        def forward(self, inputs, mask_idx, targets):
            hidden = torch.zeros_like(inputs).scatter(1, mask_idx, 1)
            mask = transformer.AttnMask(torch.zeros_like(inputs), hidden)
            h = self.encoder(inputs, transformer.default_positions(inputs), mask)
            return self.encoder.lm_loss(gather_tokens(h, mask_idx), targets)
        bert.Bert.forward = forward
    elif name == "pred_lr":  # the predictor's parameters (its mask embedding included) train at value x the lr
        def build_optimizer(model, args):
            predictor = {id(p) for p in getattr(model, "predictor", torch.nn.Module()).parameters()}
            groups = [{**group, "params": [p for p in group["params"] if (id(p) in predictor) == in_predictor],
                       "lr_scale": float(value) if in_predictor else 1.0}
                      for group in optim.param_groups(model, args.weight_decay) for in_predictor in (False, True)]
            return torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps)
        diagnose.build_optimizer = build_optimizer
        diagnose.set_lr = lambda optimizer, lr: [g.update(lr=lr * g["lr_scale"]) for g in optimizer.param_groups]
    elif name == "out_std":  # init std of every residual branch's output projection (wo, w2), encoder and predictor
        def with_out_std(init_weights):
            def init(self):
                init_weights(self)
                for module in self.modules():
                    if isinstance(module, (transformer.Attention, transformer.FeedForward)):
                        out = module.wo if isinstance(module, transformer.Attention) else module.w2
                        std = float(value)
                        torch.nn.init.zeros_(out.weight) if std == 0 else transformer.trunc_normal_(out.weight, std)
            return init
        crossbert.CrossBert.init_weights = with_out_std(crossbert.CrossBert.init_weights)
        bert.Bert.init_weights = with_out_std(bert.Bert.init_weights)
    elif name == "pred_rope_theta":  # RoPE base of the predictor only (the encoder keeps its own)
        predictor_transformer = crossbert.CrossBertArgs.predictor_transformer
        crossbert.CrossBertArgs.predictor_transformer = lambda self: dataclasses.replace(
            predictor_transformer(self), rope_theta=float(value))
    elif name == "embedding_keys":  # the predictor reads the encoder's input embeddings instead of its output
        def predict(self, inputs, positions, query_positions):
            context = self.encoder.norm(self.encoder.tok_embeddings(inputs))
            return self.predictor(context, positions, query_positions, None)
        crossbert.CrossBert.predict = predict
    elif name == "centred_context":  # the predictor reads the encoder output minus its mean over the sequence
        def predict(self, inputs, positions, query_positions):
            h = self.encoder(inputs, positions, None)
            return self.predictor(h - h.mean(1, keepdim=True), positions, query_positions, None)
        crossbert.CrossBert.predict = predict
    elif name != "base":
        raise SystemExit(f"unknown variant {variant}")


if __name__ == "__main__":
    patch(sys.argv[1])
    args = load_config(DiagnoseArgs, sys.argv[2:])
    label = args.apps.split(",")[-1]
    print(sys.argv[1], label, " ".join(sys.argv[2:]), " ".join(f"{a:.3f}" for a in learning_curve(label, args)))
