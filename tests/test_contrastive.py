import json
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import WORDS, kill_after_first_checkpoint_then_restart, read_metrics, tiny_argv, write_corpus

from apps.contrastive import train as contrastive
from apps.contrastive.data import TripletDataArgs, TripletLoader, encode_texts
from apps.contrastive.model import eq5_loss, info_nce
from lingua.app import load_model
from lingua.args import load_config
from lingua.data.tokenizer import TokenizerArgs, build_tokenizer
from lingua.errors import UserError
from lingua.export.embedder import load_embedder
from lingua.run_folder import RunFolder
from lingua.train import train
from lingua.training.resume import open_start


def test_info_nce_matches_a_hand_computed_value():
    queries = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    passages = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])
    loss, accuracy = info_nce(queries, passages, torch.tensor([0, 2]), temperature=0.5)
    by_hand = [-math.log(math.exp(2.0) / (math.exp(2.0) + math.exp(1.2) + 1.0)),
               -math.log(math.exp(2.0) / (1.0 + math.exp(1.6) + math.exp(2.0)))]
    assert loss.item() == pytest.approx(sum(by_hand) / 2, rel=1e-6)
    assert accuracy.item() == 1.0


def test_a_hard_negative_enters_the_denominator():
    query, positive = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.8, 0.6]])
    hard = F.normalize(torch.tensor([[0.9, 0.5]]), dim=-1)
    alone, _ = info_nce(query, positive, torch.tensor([0]), 1.0)
    with_hard, accuracy = info_nce(query, torch.cat([hard, positive]), torch.tensor([1]), 1.0)
    assert alone.item() == pytest.approx(0.0, abs=1e-7)
    assert with_hard.item() == pytest.approx(math.log(1 + math.exp(hard[0, 0].item() - 0.8)), rel=1e-6)
    assert accuracy.item() == 0.0  # the hard negative scores higher than the positive


# ------------------------------------------------------------------------------------------------- a tiny setup


def write_triplets(path: Path, n: int, seed: int = 0, n_negatives: int = 3) -> Path:
    """Queries of two words whose positive repeats them; negatives are other words."""
    rng = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(n):
        words = [WORDS[i] for i in torch.randint(len(WORDS), (2 + 2 * n_negatives,), generator=rng).tolist()]
        query, others = words[:2], words[2:]
        negatives = [f"the {a} and the {b}" for a, b in zip(others[::2], others[1::2])]
        lines.append(json.dumps({"query": " ".join(query), "positive": f"the {query[0]} and the {query[1]}",
                                 "negatives": negatives}))
    path.write_text("\n".join(lines) + "\n")
    return path


def contrastive_argv(triplets: Path, dump_dir: Path, init_from: Path, steps: int, *extra: str) -> list[str]:
    return [f"dump_dir={dump_dir}", f"steps={steps}", f"init_from={init_from}", f"data.path={triplets}",
            "data.n_negatives=3", "data.seq_len=32", "data.batch_size=8", "optim.lr=3e-3", "optim.warmup=2",
            "optim.weight_decay=0", "logging.freq=1", "validation.every=0", "checkpoint.every=5", *extra]


def run_contrastive(argv: list[str]):
    """The config the run trained with (its config.yaml: with the shapes it took from init_from) and its summary."""
    args = load_config(contrastive.APP.args_cls, argv)
    summary = train(contrastive.APP, args)
    return load_config(contrastive.APP.args_cls, [f"config={Path(args.dump_dir) / 'config.yaml'}"]), summary


def test_frozen_training_moves_only_the_pooler_and_warm_starts_it_from_the_predictor(tiny_crossbert, tmp_path):
    triplets = write_triplets(tmp_path / "train.jsonl", 64)
    dump = tmp_path / "probe"
    source, _, _ = load_model(tiny_crossbert)
    tiny_step = ("optim.lr=1e-9", "optim.lr_min=0", "optim.warmup=0")
    args, _ = run_contrastive(contrastive_argv(triplets, dump, tiny_crossbert, 1, *tiny_step))
    assert args.model.encoder.dim == 32 and args.data.tokenizer.name == "bytes"  # taken from init_from
    at_start, _, _ = load_model(dump)
    for name, value in source.predictor.state_dict().items():  # one step at lr 1e-9: still the predictor's values
        pooled = at_start.pooler.state_dict()["query" if name == "mask_embedding" else name]
        assert torch.allclose(pooled, value, atol=1e-6), name

    dump_long = tmp_path / "probe_long"
    run_contrastive(contrastive_argv(triplets, dump_long, tiny_crossbert, 10))
    trained, _, _ = load_model(dump_long)
    backbone = source.backbone.state_dict()
    assert all(torch.equal(value, backbone[name]) for name, value in trained.encoder.state_dict().items())
    assert not torch.allclose(trained.pooler.query, at_start.pooler.query)
    assert all(not p.requires_grad for p in trained.encoder.parameters())


def test_a_bert_backbone_trains_a_fresh_pooler_and_embeds(tmp_path):
    """BERT has no predictor to warm-start the pooler from: the pooler starts fresh, trains, and the embedder uses
    it."""
    from apps.bert.train import APP as BERT

    bert = tmp_path / "bert"
    train(BERT, load_config(BERT.args_cls, tiny_argv(write_corpus(tmp_path / "data"), bert, 2)))
    dump = tmp_path / "probe"
    run_contrastive(contrastive_argv(write_triplets(tmp_path / "t.jsonl", 64), dump, bert, 2))
    trained, _, _ = load_model(dump)
    assert all(not p.requires_grad for p in trained.encoder.parameters()) and trained.pooler.query.requires_grad
    vectors = load_embedder(str(dump)).encode(["the cat sat", "a dog"])
    assert vectors.shape == (2, 32) and torch.isfinite(vectors).all()


def test_no_gradient_reaches_a_frozen_backbone(tiny_crossbert, tmp_path):
    argv = contrastive_argv(tmp_path / "x.jsonl", tmp_path / "d", tiny_crossbert, 1)
    args = load_config(contrastive.APP.args_cls, argv)
    args = contrastive.APP.configure(args, open_start(contrastive.APP, args, RunFolder(Path(args.dump_dir)), 1))
    tokenizer = build_tokenizer(args.data.tokenizer)
    model = contrastive.APP.build_model(args.model, tokenizer)
    model = model.to_empty(device="cpu")
    model.init_weights()
    for p in model.encoder.parameters():
        p.requires_grad_(True)  # even if a parameter asked for one, the frozen forward gives it none
    rows = torch.tensor([encode_texts(tokenizer, ["a b", "the a and the b", "c", "d", "e"], 32)] * 2)
    loss, _ = model(rows)
    loss.backward()
    assert all(p.grad is None for p in model.encoder.parameters())
    assert model.pooler.query.grad is not None


def test_contrastive_loss_falls_and_a_killed_run_resumes_exactly(tiny_crossbert, tmp_path):
    triplets = write_triplets(tmp_path / "train.jsonl", 200)
    straight = tmp_path / "straight"
    run_contrastive(contrastive_argv(triplets, straight, tiny_crossbert, 30, "model.frozen=false"))
    losses = read_metrics(straight)
    assert sum(losses[s]["loss"] for s in range(26, 31)) < sum(losses[s]["loss"] for s in range(1, 6))

    resumed = tmp_path / "resumed"
    argv = contrastive_argv(triplets, resumed, tiny_crossbert, 30, "model.frozen=false")
    kill_after_first_checkpoint_then_restart("apps.contrastive.train", argv, resumed)
    again = read_metrics(resumed)
    assert [again[s]["loss"] for s in range(1, 31)] == [losses[s]["loss"] for s in range(1, 31)]


def test_the_loader_resumes_on_another_number_of_ranks(tmp_path):
    path = write_triplets(tmp_path / "t.jsonl", 40)
    args = TripletDataArgs(path=str(path), n_negatives=3, seq_len=16, batch_size=4,
                           tokenizer=TokenizerArgs(name="bytes"))
    tokenizer = build_tokenizer(args.tokenizer)
    one = TripletLoader(args, tokenizer, 0, 1)
    batches = [next(one) for _ in range(12)]  # 10 steps of 4 lines per epoch, then the next epoch
    two = [TripletLoader(args, tokenizer, r, 2, {"epoch": 0, "position": 8}) for r in range(2)]
    assert torch.equal(torch.cat([next(loader) for loader in two]), torch.cat(batches[2:4]))
    assert one.state_dict() == {"epoch": 1, "position": 8}


def test_bad_triplet_lines_are_counted_and_left_out(tmp_path, caplog):
    path = write_triplets(tmp_path / "t.jsonl", 10)
    with open(path, "a") as f:
        f.write('{"query": "q", "positive": "p", "negatives": ["only one"]}\nnot json\n["a list"]\n')
        f.write('{"query": "q", "positive": "p", "negatives": ["a", "b", "c"], "id": ' + "9" * 5000 + "}\n")
        f.write("[" * 100_000 + "\n")
    args = TripletDataArgs(path=str(path), n_negatives=3, batch_size=2, tokenizer=TokenizerArgs(name="bytes"))
    with caplog.at_level(logging.WARNING):
        loader = TripletLoader(args, build_tokenizer(args.tokenizer), 0, 1)
        assert [next(loader).shape for _ in range(6)] == [(2, 5, 128)] * 6  # the good lines, into the next epoch
    assert loader.malformed_lines == 5 and len(loader.offsets) == 10
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: skipped 5 lines that are not triplets with 3 negatives (the first at line 11)"]
    loader.close()
    with pytest.raises(UserError, match="no usable triplet") as error:
        TripletLoader(TripletDataArgs(path=str(path), n_negatives=9), build_tokenizer(args.tokenizer), 0, 1)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_embedder_uses_the_trained_pooler_and_batching_does_not_change_vectors(tiny_crossbert, tmp_path):
    dump = tmp_path / "probe"
    run_contrastive(contrastive_argv(write_triplets(tmp_path / "t.jsonl", 64), dump, tiny_crossbert, 2))
    texts = ["the cat sat", "a dog", "the big red house by the river", "bird"]
    for path in (dump, tiny_crossbert):
        embedder = load_embedder(str(path))
        one_batch, one_by_one = embedder.encode(texts, batch_size=4), embedder.encode(texts, batch_size=1)
        assert one_batch.shape == (4, 32)
        assert torch.allclose(one_batch.norm(dim=1), torch.ones(4), atol=1e-5)
        assert torch.allclose(one_batch, one_by_one, atol=1e-5)
    pooled, mean = load_embedder(str(dump)).encode(texts), load_embedder(str(dump), pooling="mean").encode(texts)
    assert not torch.allclose(pooled, mean, atol=1e-3)
    backbone = load_embedder(str(tiny_crossbert)).encode(texts)
    assert torch.allclose(mean, backbone, atol=1e-6)  # frozen: the same backbone
    with pytest.raises(UserError, match="pooling"):
        load_embedder(str(dump), pooling="max")


def test_the_embedding_evaluation_command_scores_retrieval_and_sts(tiny_crossbert, tmp_path, capsys):
    from tools.eval import embeddings

    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    docs = {"d1": "the cat sat on the mat", "d2": "a dog ran to the park", "d3": "the bird sang under the tree"}
    (beir / "corpus.jsonl").write_text("".join(json.dumps({"_id": k, "title": "", "text": v}) + "\n"
                                               for k, v in docs.items()))
    (beir / "queries.jsonl").write_text(json.dumps({"_id": "q1", "text": "cat on mat"}) + "\n")
    (beir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")
    sts = tmp_path / "sts"
    sts.mkdir()
    pairs = [("a cat", "a cat", 5.0), ("a cat", "the dog", 1.0), ("red house", "a red house", 4.0)]
    (sts / "mine.jsonl").write_text("".join(json.dumps({"sentence1": a, "sentence2": b, "score": s}) + "\n"
                                            for a, b, s in pairs))
    out = tmp_path / "results.json"
    embeddings.main([f"ckpt={tiny_crossbert}", f"retrieval={beir}", f"sts={sts}", f"out={out}"])
    results = json.loads(out.read_text())
    assert 0 <= results["retrieval"]["beir"]["ndcg@10"] <= 100 and results["retrieval"]["beir"]["n_docs"] == 3
    assert results["sts"]["mine"]["n_pairs"] == 3
    assert "nDCG@10" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        embeddings.main([f"ckpt={tiny_crossbert}"])
    assert exit_info.value.code == 2 and "nothing to evaluate" in capsys.readouterr().err


@pytest.mark.parametrize("frozen", ["true", "false"])
def test_two_ranks_gather_negatives_like_one_rank_with_the_whole_batch(tiny_crossbert, tmp_path, frozen):
    from tests.test_distributed import torchrun

    triplets = write_triplets(tmp_path / "train.jsonl", 64)
    one, two = tmp_path / "one", tmp_path / "two"
    run_contrastive(contrastive_argv(triplets, one, tiny_crossbert, 3, "data.batch_size=8", f"model.frozen={frozen}"))
    torchrun("-m", "apps.contrastive.train",
             *contrastive_argv(triplets, two, tiny_crossbert, 3, "data.batch_size=4", f"model.frozen={frozen}"))
    single, double = read_metrics(one), read_metrics(two)
    for step in (1, 2, 3):  # each query sees the same 8 x 4 passages, the gradient is the same mean
        assert double[step]["loss"] == pytest.approx(single[step]["loss"], rel=1e-4)


def test_the_shipped_configs_load_and_msmarco_is_the_papers_setting():
    configs = Path(__file__).resolve().parents[1] / "apps" / "contrastive" / "configs"
    debug = load_config(contrastive.APP.args_cls, [f"config={configs / 'debug.yaml'}"])
    assert debug.model.frozen and debug.model.pooler.kind == "attention"
    paper = load_config(contrastive.APP.args_cls, [f"config={configs / 'msmarco.yaml'}"])
    assert paper.data.batch_size * 8 == 512 and (paper.optim.lr, paper.optim.lr_min) == (5e-5, 5e-7)
    assert paper.steps == 502_939 // 512  # one epoch of MS MARCO's queries


def test_a_run_trains_with_eq5_as_written(tiny_crossbert, tmp_path):
    triplets = write_triplets(tmp_path / "train.jsonl", 32)
    _, summary = run_contrastive(contrastive_argv(triplets, tmp_path / "eq5", tiny_crossbert, 3, "model.loss=eq5"))
    assert summary["steps"] == 3 and math.isfinite(summary["final_loss"])


def test_eq5_refuses_a_temperature_it_would_ignore():
    with pytest.raises(UserError, match="temperature") as error:
        load_config(contrastive.APP.args_cls, ["dump_dir=x", "model.loss=eq5", "model.temperature=0.1"])
    assert "\n" not in str(error.value) and "not used by loss=eq5" in str(error.value)
    simclr = load_config(contrastive.APP.args_cls, ["dump_dir=x", "model.loss=simclr", "model.temperature=0.1"])
    assert simclr.model.temperature == 0.1


def test_eq5_raw_cosine_logits_bound_its_loss_above_ln_1_plus_7_over_e2():
    """The best eq5 can do with 1 positive and 7 negatives (the positive at cosine 1, the negatives at -1): the
    floor the docs state, 0.67, with the positive's probability 0.51."""
    query = F.normalize(torch.randn(1, 16), dim=-1)
    vectors = torch.cat([query, query, -query.expand(7, -1)]).unsqueeze(0)  # [1, 1 + 1 + 7, D]
    loss, accuracy = eq5_loss(vectors)
    assert loss.item() == pytest.approx(math.log(1 + 7 * math.exp(-2)), abs=1e-5) and round(loss.item(), 2) == 0.67
    assert math.exp(-loss.item()) == pytest.approx(0.514, abs=1e-3) and accuracy.item() == 1.0
