"""Adding an app is local: a new app, a span-masking MLM written into a temporary folder (a model file, an entry
point as short as BERT's, a config), trains, resumes, benchmarks, plans a scaling run, is probed on GLUE and is
exported with the masked-LM head it declares (a network of its own name), with no file outside its folder changed (the
commands that open its checkpoints name it, app=spanmlm: a checkpoint builds no app but this code's unless the user
names it)."""

import json
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from conftest import read_metrics, write_corpus

from lingua.app import load_app, load_model
from lingua.export import hf_folder as export
from lingua.model.transformer import default_positions
from lingua.train import main
from tools import benchmark, scaling
from tools.eval import glue as glue_command

GLUE = Path(__file__).parent / "fixtures" / "glue"
MODEL = '''
    """Span masking: `spans` runs of `span` consecutive tokens per row become <mask>; the encoder predicts them, and
    so does a one-block drafter over the encoder's token embeddings (the masked-LM head the export carries)."""

    from dataclasses import dataclass, field

    import torch
    from torch import nn

    from lingua.app import AppModel, MaskedLMHead
    from lingua.model.flops import encoder_flops_per_token, output_head_flops
    from lingua.model.masking import gather_tokens
    from lingua.model.transformer import (Encoder, RMSNorm, RotaryEmbedding, SelfAttentionBlock, TransformerArgs,
                                          default_positions, head_dim_of, sub_network)


    @dataclass
    class SpanArgs:
        encoder: TransformerArgs = field(default_factory=TransformerArgs)
        span: int = 3
        spans: int = 2


    class Drafter(nn.Module):
        def __init__(self, args: TransformerArgs):
            super().__init__()
            self.args = args
            self.rope = RotaryEmbedding(head_dim_of(args), args.max_seqlen, args.rope_theta)
            self.layers = nn.ModuleList(SelfAttentionBlock(args) for _ in range(args.n_layers))
            self.norm = RMSNorm(args.dim, args.norm_eps)

        def forward(self, h, positions):
            rope = self.rope(positions)
            for layer in self.layers:
                h = layer(h, rope, None)
            return self.norm(h)


    class SpanMlm(AppModel):
        masked_lm = MaskedLMHead("self_attention", "the span model's drafter", network="drafter")

        def __init__(self, args: SpanArgs, vocab_size: int, mask_id: int):
            super().__init__()
            self.args, self.mask_id = args, mask_id
            self.encoder = Encoder(args.encoder, vocab_size)
            self.drafter = Drafter(sub_network(args.encoder, 1))

        def make_batch(self, tokens, generator):
            rows, length = tokens.shape
            starts = torch.randint(0, length - self.args.span + 1, (rows, self.args.spans), generator=generator,
                                   device=tokens.device)
            mask_idx = (starts[..., None] + torch.arange(self.args.span, device=tokens.device)).flatten(1)
            return {"inputs": tokens.scatter(1, mask_idx, self.mask_id), "mask_idx": mask_idx,
                    "targets": tokens.gather(1, mask_idx)}

        def forward(self, inputs, mask_idx, targets):
            positions = default_positions(inputs)
            loss, stats = self.encoder.lm_loss(gather_tokens(self.encoder(inputs, positions), mask_idx), targets)
            drafted = self.drafter(self.encoder.embed(inputs), positions)
            draft_loss, _ = self.encoder.lm_loss(gather_tokens(drafted, mask_idx), targets)
            return loss + draft_loss, {**stats, "draft_loss": draft_loss.detach()}

        def flops_per_token_view(self, seq_len):
            return encoder_flops_per_token(self.args.encoder, seq_len) + encoder_flops_per_token(self.drafter.args,
                                                                                                 seq_len)

        def head_flops_per_token_view(self, seq_len):
            predicted = 2 * self.args.span * self.args.spans / seq_len  # the encoder's and the drafter's
            return output_head_flops(self.args.encoder.dim, self.encoder.tok_embeddings.num_embeddings) * predicted


    def build_span_mlm(args, tokenizer):
        return SpanMlm(args, tokenizer.vocab_size, tokenizer.mask_id)
'''

ENTRY_POINT = '''
    """Train the span-masking MLM: python -m spanmlm.train config=spanmlm/configs/debug.yaml [key=value ...]"""

    from dataclasses import dataclass, field, replace

    from lingua.model.scaling import BERT_LAWS
    from lingua.train import App, TrainArgs, main
    from spanmlm.model import SpanArgs, build_span_mlm


    @dataclass
    class SpanTrainArgs(TrainArgs):
        model: SpanArgs = field(default_factory=SpanArgs)


    APP = App(name="spanmlm.train", args_cls=SpanTrainArgs, build_model=build_span_mlm,
              scaling=replace(BERT_LAWS, shapes_of="bert"))  # BERT's laws, on BERT's backbones

    if __name__ == "__main__":
        main(APP)
'''

CONFIG = '''
    name: spanmlm_debug
    steps: 10
    data: {sources: {tiny: 1.0}, seq_len: 32, batch_size: 8, tokenizer: {name: bytes}}
    model:
      encoder: {dim: 32, n_layers: 2, n_heads: 2, max_seqlen: 32}
      span: 3
      spans: 2
    optim: {lr: 3.0e-3, warmup: 2}
    logging: {freq: 1}
    validation: {every: 5, n_sequences: 8}
    checkpoint: {every: 5}
'''


@pytest.fixture
def spanmlm(tmp_path, monkeypatch):
    """The app's folder, importable as `spanmlm` (the tools find it by that name)."""
    package = tmp_path / "apps_elsewhere" / "spanmlm"
    (package / "configs").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(textwrap.dedent(MODEL).lstrip())
    (package / "train.py").write_text(textwrap.dedent(ENTRY_POINT).lstrip())
    (package / "configs" / "debug.yaml").write_text(textwrap.dedent(CONFIG).lstrip())
    monkeypatch.syspath_prepend(str(package.parent))
    return package


def test_an_app_outside_the_tree_trains_resumes_benchmarks_plans_probes_and_exports(spanmlm, tmp_path, capsys):
    app, dump, corpus = load_app("spanmlm"), tmp_path / "run", write_corpus(tmp_path / "data")
    config = [f"config={spanmlm / 'configs' / 'debug.yaml'}", f"dump_dir={dump}", f"data.root_dir={corpus}"]
    main(app, config)  # trains: 10 steps, checkpoints at 5 and 10
    main(app, config + ["steps=20"])  # resumes from step 10
    metrics = read_metrics(dump)
    assert sorted(metrics) == list(range(1, 21)) and metrics[20]["loss"] < metrics[1]["loss"]
    assert "resumed from" in (dump / "train.log").read_text()

    benchmark.main(["preset=debug", "apps=spanmlm,bert", "warmup=1", "steps=1", "rounds=1"])
    assert "spanmlm" in capsys.readouterr().out

    scaling.main(["plan", "app=spanmlm", "compute=1e19", "gpus=8"])
    assert "spanmlm at C = 1e+19 FLOPs" in capsys.readouterr().out

    glue_command.main([f"ckpt={dump}", f"data={GLUE}", "tasks=sst2", "probes=linear", "app=spanmlm"])
    results = json.loads(next((dump / "glue_eval").glob("*/results.json")).read_text())
    assert "sst2" in results["summary"]["last"]["linear"]

    out = tmp_path / "hf"
    export.main([f"ckpt={dump}", f"out={out}", "app=spanmlm"])  # an app not of this code is named to be trusted
    model, _, tokenizer = load_model(dump, app="spanmlm")
    hf_model = transformers.AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    tokens = torch.tensor([tokenizer.encode("the cat sat")])
    with torch.no_grad():
        expected, got = model.encode(tokens), hf_model(input_ids=tokens).last_hidden_state
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)

    # its masked-LM head, declared under a name the core does not know, is exported and described in the card
    config = json.loads((out / "config.json").read_text())
    assert config["masked_lm"] == "self_attention" and config["mlm_num_layers"] == 1
    assert "masked LM: the span model's drafter: 1 self-attention block(s)" in (out / "README.md").read_text()
    masked_lm, loading = transformers.AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True,
                                                                           output_loading_info=True)
    assert not any(loading.values()), loading
    with torch.no_grad():
        drafted = model.encoder.logits(model.drafter(model.encoder.embed(tokens), default_positions(tokens)))
        torch.testing.assert_close(masked_lm.eval()(input_ids=tokens).logits, drafted, atol=1e-5, rtol=0)
