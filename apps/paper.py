"""The paper's published numbers, which the tables print beside ours. GLUE scores are in lingua.eval.glue.TASKS
order (MNLI, QNLI, QQP, RTE, SST-2, MRPC, CoLA, STS-B), then the average; MTEB scores in lingua.eval.mteb.CATEGORIES
order (Class., Clust., PairClass., Rerank., Retriev., STS, Summ.), then Avg. and Overall (None: not published)."""

# Table 3: parameters, training FLOPs and throughput (tokens/s on H100s)
SINGLE_SCALE = {"bert": ("239M", "6.8e19", "123k"), "crossbert": ("279M", "4.1e19", "207k"),
                "electra": ("258M", "7.5e19", "116k")}

GLUE_FINETUNE = {  # Table 3, GLUE full fine-tuning (dev)
    "bert": (86.5, 90.0, 88.5, 85.3, 95.1, 91.9, 63.0, 91.2, 86.4),
    "crossbert": (86.4, 90.3, 88.4, 85.1, 94.8, 91.4, 65.5, 91.5, 86.6),
    "electra": (88.7, 93.3, 89.1, 83.4, 94.6, 92.0, 71.0, 90.0, 87.8),
}
GLUE_LINEAR = {  # Table 3, GLUE linear probe on frozen features
    "bert": (58.6, 74.8, 77.7, 59.9, 84.9, 76.7, 27.4, 79.5, 67.4),
    "crossbert": (61.6, 81.8, 81.4, 64.3, 90.6, 77.9, 47.9, 84.8, 73.8),
    "electra": (69.2, 83.6, 82.7, 66.8, 86.9, 79.6, 58.8, 87.5, 76.9),
}
MTEB = {  # Table 3 (v1) and Appendix E (v2): contrastive fine-tuning on MS MARCO, whole model or frozen backbone
    ("MTEB(eng, v1)", "full"): {
        "bert": (62.7, 35.1, 80.7, 51.5, 43.0, 75.8, 29.8, 54.1, 53.9),
        "crossbert": (67.6, 31.5, 80.5, 52.2, 42.5, 75.3, 31.6, 54.5, 54.1),
        "electra": (62.1, 27.7, 77.9, 48.8, 34.3, 72.4, 29.1, 50.3, 49.0)},
    ("MTEB(eng, v1)", "frozen"): {
        "bert": (60.1, 29.7, 64.6, 43.7, 19.2, 62.7, 30.5, 44.3, 42.1),
        "crossbert": (65.7, 37.1, 78.0, 51.4, 40.7, 72.3, 30.7, 53.7, 53.6),
        "electra": (41.3, 12.8, 35.4, 32.4, 0.0, 32.8, 26.9, 26.2, 22.4)},
    ("MTEB(eng, v2)", "full"): {
        "bert": (67.7, 39.3, 80.8, 43.9, 45.7, 75.3, 28.7, 54.5, 57.3),
        "crossbert": (72.2, 35.5, 80.5, 44.8, 44.2, 74.6, 32.0, 54.8, 57.0),
        "electra": (62.1, 27.7, 77.9, 48.8, 34.4, 72.4, 29.1, 50.3, 49.0)},
    ("MTEB(eng, v2)", "frozen"): {
        "bert": (64.9, 37.3, 64.5, 39.4, 20.5, 61.6, 31.8, 45.7, 45.9),
        "crossbert": (70.4, 40.8, 77.9, 44.1, 43.9, 71.7, 26.7, 53.6, 56.7),
        "electra": (43.9, 29.5, 35.4, 33.0, 0.3, 31.9, 19.4, 27.6, 26.1)},
}

# Table 2: CrossBERT's average frozen GLUE score (linear probe) by masking ratio (%), at an equal data budget
CROSSBERT_MASK_RATIO = {"20": 73.8, "40": 73.7, "50": 73.1, "65": 72.4}
# Table 5: CrossBERT 279M, GLUE linear probe, without and with CMS
CMS = {"off": (61.4, 81.4, 81.3, 62.8, 88.9, 74.2, 48.7, 85.8, 73.1),
       "on": (61.6, 81.8, 81.4, 64.2, 90.6, 77.9, 47.8, 84.8, 73.8)}
# Table 6: BERT, GLUE (linear probe) by masking ratio (%)
BERT_MASK_RATIO = {"20": (58.6, 74.8, 77.7, 59.9, 84.9, 76.7, 27.4, 79.5, 67.4),
                   "30": (57.0, 74.1, 77.9, 54.2, 80.7, 73.0, 18.8, 77.1, 64.1),
                   "40": (53.6, 73.5, 75.0, 57.0, 75.1, 69.1, 11.0, 73.4, 61.0),
                   "65": (50.0, 70.0, 73.4, 55.2, 75.1, 67.2, 22.6, 65.7, 59.9)}
# Table 7: CrossBERT 279M, MTEB(eng, v2) after contrastive fine-tuning over frozen features, pooler cold or warm
WARM_START = {"cold": (68.7, 38.3, 76.4, 43.4, 37.8, 68.9, 28.7, 51.8, 53.7),
              "warm": (70.5, 40.8, 77.9, 44.1, 43.9, 71.7, 26.7, 53.7, 56.7)}
# Table 4 (predictor shape and size): its numbers are not in the paper's text; only its prose (8M to 85M) is
