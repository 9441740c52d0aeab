"""The export's tokenizer files: tokenizer.json, a `tokenizers.Tokenizer` that gives our ids (GPT-2's BPE from
tiktoken's ranks, the bytes one, or the run's own Hugging Face tokenizer, with `<s> text </s>` added), and
tokenizer_config.json. The only part of the export
that needs `tokenizers` and transformers' tiktoken converter.
"""

from tiktoken_ext.openai_public import r50k_pat_str

from lingua.export.embedder import Embedder


def hf_tokenizer(embedder: Embedder, name: str):
    """A `tokenizers.Tokenizer` giving our ids: `<s> text </s>` (`<s> a </s></s> b </s>` for pairs, each with the
    tokenizer's own spellings), the special tokens treated as text when they appear in it (tokenizer_config's
    split_special_tokens), as ours does."""
    from tokenizers import Tokenizer, processors

    ours = embedder.tokenizer
    tokenizer = Tokenizer.from_str(ours.tokenizer.to_str()) if name == "hf" else lingua_tokenizer(ours, name)
    tokenizer.encode_special_tokens = False  # the config's split_special_tokens decides, as transformers reads it
    bos, eos = ours.special_tokens[:2]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, ours.bos_id), (eos, ours.eos_id)])
    return tokenizer


def lingua_tokenizer(ours, name: str):
    """GPT-2's BPE (tiktoken's ranks) or the bytes one, as a `tokenizers.Tokenizer` with our four special ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab, merges = gpt2_vocab_and_merges(ours.encoding) if name == "gpt2" else byte_vocab()
    tokenizer = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    split = pre_tokenizers.Split(Regex(r50k_pat_str), behavior="isolated")  # tiktoken's pre-split of r50k_base
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level]) if name == "gpt2" else byte_level
    tokenizer.decoder = decoders.ByteLevel()
    # a GPT-2 word carries its leading space: in "the <mask>" the mask stands for " mat" (RoBERTa's <mask> does too)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False,
                                             lstrip=name == "gpt2" and token == "<mask>")
                                  for token in ours.special_tokens])
    ids = [tokenizer.token_to_id(token) for token in ours.special_tokens]
    if ids != [ours.bos_id, ours.eos_id, ours.pad_id, ours.mask_id]:
        raise RuntimeError(f"the exported special tokens got ids {ids}, ours are {ours.bos_id}..{ours.mask_id}")
    return tokenizer


def gpt2_vocab_and_merges(encoding) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """r50k_base's ranks as a byte-level BPE (transformers' tiktoken converter). <|endoftext|> keeps its id as an
    ordinary vocabulary entry: no text produces it, as `encode_ordinary` never does."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converter = TikTokenConverter(pattern=r50k_pat_str)
    converter.load_tiktoken_bpe = lambda ranks: ranks  # it reads a file; we hand it the ranks already loaded
    vocab, merges = converter.extract_vocab_merges_from_model(encoding._mergeable_ranks)  # tiktoken's BPE ranks
    return {**vocab, "<|endoftext|>": encoding.eot_token}, merges


def byte_vocab() -> tuple[dict[str, int], list]:
    """One id per byte, as the ByteLevel pre-tokenizer spells bytes; no merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}, []


def tokenizer_config(embedder: Embedder, parse_special_tokens: bool) -> dict:
    """parse_special_tokens (an export with a masked-LM head): `<mask>` written in a text is the mask token, as the
    fill-mask pipeline needs, and so are the other special tokens; else they are text, as in Lingua."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **dict(zip(("bos_token", "eos_token", "pad_token", "mask_token"), embedder.tokenizer.special_tokens)),
        "model_max_length": embedder.max_len,
        "split_special_tokens": not parse_special_tokens,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "padding_side": "right",
    }
