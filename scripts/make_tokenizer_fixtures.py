#!/usr/bin/env python3
"""Makes the tokenizer fixtures of the tests (tests/fixtures/tokenizers/), once, on a machine with
PyPI tokenizers (and sentencepiece for spm):

    pip install tokenizers sentencepiece
    python3 scripts/make_tokenizer_fixtures.py [bytelevel] [spm] [split]   # default: all three

Each is trained on tests/fixtures/text/train.txt (public-domain prose); expected.json holds the
reference implementation's ids for the held-out lines of tests/fixtures/text/heldout.txt (and, for
split, extra lines that exercise its character classes):
  bytelevel/     tokenizer.json: byte-level BPE as GPT-2 and SmolLM2 (Digits + ByteLevel)
  spm/           tokenizer.model: sentencepiece BPE with byte fallback (Llama-2 style);
                 tokenizer.json: the same vocabulary as HF writes it for Llama-2
                 (Prepend/Replace normalizer, BPE with byte_fallback, merges)
  split_qwen2/   tokenizer.json: byte-level BPE behind Qwen2's Split regex pre-tokenizer
  split_llama3/  the same with Llama 3's regex (digits in runs of up to three)
scripts/make_fixtures.py calls these too.
"""
import json
import os
import shutil
import sys

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
TRAIN = open(os.path.join(ROOT, "text", "train.txt"), encoding="utf-8").read()
HELDOUT = open(os.path.join(ROOT, "text", "heldout.txt"), encoding="utf-8").read().split("\n")
HELDOUT = [line for line in HELDOUT if line] + [" leading space", "\n\ntwo newlines\n", ""]


def write_json(path, value):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")


def fresh_dir(*parts):
    path = os.path.join(ROOT, *parts)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def make_bytelevel_tokenizer():
    out = fresh_dir("tokenizers", "bytelevel")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([TRAIN], trainer=trainer)
    path = os.path.join(out, "tokenizer.json")
    tokenizer.save(path)
    reference = Tokenizer.from_file(path)
    ids = [reference.encode(text, add_special_tokens=False).ids for text in HELDOUT]
    for text, row in zip(HELDOUT, ids):
        assert reference.decode(row, skip_special_tokens=False) == text, text
    write_json(os.path.join(out, "expected.json"), {"texts": HELDOUT, "ids": ids})
    return path


def llama2_tokenizer_json(model_path):
    """tokenizer.json as transformers 4.x's LlamaConverter writes it for Llama-2: merges from the
    vocabulary (pairs whose concatenation is a piece, ordered by that piece's rank)."""
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=model_path)
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    merges = []
    for merged_id, merged in enumerate(pieces):
        if processor.is_control(merged_id) or processor.is_unknown(merged_id) or processor.is_byte(merged_id):
            continue
        local = [(merged[:k], merged[k:]) for k in range(1, len(merged)) if merged[:k] in vocab and merged[k:] in vocab]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((merged_id, pair) for pair in local)
    merges.sort(key=lambda item: item[0])
    special = lambda i, s: {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                            {"type": "Replace", "pattern": {"String": " "},
                                                             "content": "\u2581"}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                    {"Sequence": {"id": "A", "type_id": 0}},
                                    {"SpecialToken": {"id": "<s>", "type_id": 1}},
                                    {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [[left, right] for _, (left, right) in merges]},
    }


def make_spm_tokenizer():
    import sentencepiece as spm

    out = fresh_dir("tokenizers", "spm")
    prefix = os.path.join(out, "tokenizer")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in TRAIN.split("\n") if line]), model_prefix=prefix, vocab_size=480,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, minloglevel=2, num_threads=1)
    os.remove(prefix + ".vocab")
    model_path = prefix + ".model"
    processor = spm.SentencePieceProcessor(model_file=model_path)
    json_path = os.path.join(out, "tokenizer.json")
    write_json(json_path, llama2_tokenizer_json(model_path))
    hf = Tokenizer.from_file(json_path)
    spm_ids, hf_ids = [], []
    for text in HELDOUT:
        ids = processor.encode(text)
        spm_ids.append(ids)
        hf_ids.append(hf.encode(text, add_special_tokens=False).ids)
        assert processor.decode(ids) == text.lstrip(" ") or text.startswith(" "), text
    write_json(os.path.join(out, "expected.json"), {"texts": HELDOUT, "spm_ids": spm_ids, "hf_ids": hf_ids,
                                                    "spm_decoded": [processor.decode(ids) for ids in spm_ids],
                                                    "hf_decoded": [hf.decode(ids) for ids in hf_ids]})
    return model_path, json_path


# The pre-tokenizer regexes of Qwen2 and Llama 3 as their tokenizer.json files hold them.
SPLIT_PATTERNS = {
    "split_qwen2": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    "split_llama3": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
}
# Lines for every branch of those regexes: contractions in any case (and the long s that folds to
# s), a non-letter before letters (tab, punctuation, NBSP), digit runs of 1..7, punctuation runs
# ending in newlines, whitespace runs before text, newlines and the end, letters of other scripts.
SPLIT_EXTRA = [
    "I'LL see; you'Re sure he's DON'T We'VE it'D they'M o'ſ 'x",
    "pay 1234567 dollars, 12 or 3 (no. 42a) x2y 3.14159",
    "\tword\u00a0word -word \"quoted\" !!!...\n\n?!\r\nend",
    "a  b   c\t\t d \n \n  e  ",
    "   leading and trailing   \n",
    "na\u00efve caf\u00e9 \u65e5\u672c\u8a9e\u3067\u3059 \u0645\u0631\u062d\u0628\u0627 \u0416\u0443\u043a 2\u00bd \u2163",
    "\r\n\r\n\n",
    " ",
    "ends in punctuation, then a space: ",
    "a NUL \u0000 between",
]


def make_split_tokenizers():
    for name, pattern in SPLIT_PATTERNS.items():
        out = fresh_dir("tokenizers", name)
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tokenizer.train_from_iterator([TRAIN], trainer=trainer)
        path = os.path.join(out, "tokenizer.json")
        tokenizer.save(path)
        reference = Tokenizer.from_file(path)
        texts = HELDOUT + SPLIT_EXTRA
        ids = [reference.encode(text, add_special_tokens=False).ids for text in texts]
        for text, row in zip(texts, ids):
            assert reference.decode(row, skip_special_tokens=False) == text, text
        write_json(os.path.join(out, "expected.json"), {"texts": texts, "ids": ids})


MAKERS = {"bytelevel": make_bytelevel_tokenizer, "spm": make_spm_tokenizer, "split": make_split_tokenizers}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(MAKERS):
        MAKERS[name]()
