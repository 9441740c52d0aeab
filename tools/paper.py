"""The paper's published numbers (tools/paper.yaml, where their order is described), which the tables print beside
ours: GLUE rows in lingua.eval.glue_data.TASKS order then the average, MTEB rows in lingua.eval.mteb.CATEGORIES order
then Avg. and Overall."""

from pathlib import Path

from lingua.files import untrusted

_NUMBERS = untrusted.read_yaml(Path(__file__).parent / "paper.yaml", "paper numbers")

NAMES: dict[str, str] = _NUMBERS["names"]  # app -> the paper's name of its model (bert -> BERT)
SINGLE_SCALE: dict[str, list[str]] = _NUMBERS["single_scale"]  # Table 3: parameters, FLOPs, tokens/s
SINGLE_SCALE_FLOPS: dict[str, str] = _NUMBERS["single_scale_flops"]  # app -> eq_7_8 | all_heads
GLUE_FINETUNE: dict[str, list[float]] = _NUMBERS["glue_finetune"]
GLUE_LINEAR: dict[str, list[float]] = _NUMBERS["glue_linear"]
MTEB: dict[tuple[str, str], dict[str, list[float]]] = {  # (benchmark, "full" | "frozen"): {app: scores}
    (benchmark, protocol): rows for benchmark, protocols in _NUMBERS["mteb"].items()
    for protocol, rows in protocols.items()}
LITERATURE: dict = _NUMBERS["literature"]  # Table 3's other models: shape, and rows per block (paper.yaml)
CROSSBERT_MASK_RATIO: dict[str, float] = _NUMBERS["crossbert_mask_ratio"]  # Table 2
CMS: dict[str, list[float]] = _NUMBERS["cms"]  # Table 5
BERT_MASK_RATIO: dict[str, list[float]] = _NUMBERS["bert_mask_ratio"]  # Table 6
WARM_START: dict[str, list[float]] = _NUMBERS["warm_start"]  # Table 7
PROSE: dict = _NUMBERS["prose"]  # numbers of the paper's text: speedup, warm_start_gain, adaptation_gap, cms_data_ratio
NOTES: dict[str, dict[str, str]] = _NUMBERS["notes"]  # the paper's inconsistencies: {block: {row: note}}
