#!/usr/bin/env python3
"""Makes the golden fixtures of the model runtime tests (tests/fixtures/), once, on a machine with
torch, transformers, tokenizers, sentencepiece and safetensors:

    pip install torch --index-url https://download.pytorch.org/whl/cpu   # or plain `pip install torch`
    pip install transformers tokenizers sentencepiece safetensors
    python3 scripts/make_fixtures.py
    python3 scripts/make_fixtures.py --sparse-demo DIR   # a medium random ReLU model for benchmarks (not committed)

The tests read only the committed output; CI needs none of these packages.

Tokenizers, trained on tests/fixtures/text/train.txt (public-domain prose), with reference ids for
the held-out lines of tests/fixtures/text/heldout.txt:
  tokenizers/bytelevel/   tokenizer.json: byte-level BPE as GPT-2 and SmolLM2 (Digits + ByteLevel)
  tokenizers/spm/         tokenizer.model: sentencepiece BPE with byte fallback (Llama-2 style);
                          tokenizer.json: the same vocabulary as HF writes it for Llama-2
                          (Prepend/Replace normalizer, BPE with byte_fallback, merges)
Models (tiny, random, exact HF layout), each with golden.json: the prompt, every position's logits
from HF transformers in fp32, and the greedy continuation:
  models/llama       LlamaForCausalLM, SiLU, GQA 4/2, bf16, sharded (index.json), transformers 5 config
  models/qwen2       Qwen2ForCausalLM, q/k/v biases, GQA 4/1, tied embeddings, fp16
  models/sparselm    model_type llama_sparse_relu: config says "silu", FFN is ReLU; tied, bf16,
                     config.json in the transformers 4.x form (rope_theta at the top, no head_dim)
  models/prosparse   ProSparse-style fatrelu with hidden_act_param, fp32, sentencepiece tokenizer
"""
import json
import os
import shutil
import sys

import sentencepiece as spm
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

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


# --------------------------------------------------------------------------------------------
# Tokenizers

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


# --------------------------------------------------------------------------------------------
# Models

class FatRelu(torch.nn.Module):
    """ProSparse's FATReLU: x where x > threshold, else 0."""

    def __init__(self, threshold):
        super().__init__()
        self.threshold = threshold

    def forward(self, x):
        return torch.where(x > self.threshold, x, torch.zeros_like(x))


def golden(model, prompt, new_tokens):
    """Every position's logits for the prompt, and the greedy continuation (full recompute, fp32)."""
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
        tokens = list(prompt)
        margins = []
        for _ in range(new_tokens):
            last = model(torch.tensor([tokens])).logits[0, -1]
            top2 = torch.topk(last, 2).values
            margins.append(float(top2[0] - top2[1]))
            tokens.append(int(torch.argmax(last)))
    return {"prompt": prompt, "logits": [[float(f"{v:.7g}") for v in row] for row in logits.tolist()],
            "greedy": tokens[len(prompt):], "min_greedy_margin": min(margins)}


def make_model(name, model_class, config, dtype, prompt_text, tokenizer_files, act_fn=None, shard=None,
               rewrite_config=None, min_margin=0.05):
    """Finds a seed whose greedy continuation has a margin of at least min_margin at every step
    (so fp32-vs-bf16 rounding cannot flip a token), saves it and its golden logits."""
    out = fresh_dir("models", name)
    for source in tokenizer_files:
        shutil.copy(source, out)
    tokenizer_path = os.path.join(out, "tokenizer.json")
    prompt = Tokenizer.from_file(tokenizer_path).encode(prompt_text, add_special_tokens=False).ids
    for seed in range(100):
        torch.manual_seed(seed)
        model = model_class(config)
        with torch.no_grad():  # round the weights to what the checkpoint will hold (not the RoPE buffers)
            for parameter in model.parameters():
                parameter.copy_(parameter.to(dtype).to(torch.float32))
        if act_fn is not None:
            for layer in model.model.layers:
                layer.mlp.act_fn = act_fn
        result = golden(model, prompt, 12)
        if result["min_greedy_margin"] >= min_margin:
            break
    else:
        sys.exit(f"{name}: no seed gave greedy margins >= {min_margin}")
    result["seed"] = seed
    model.to(dtype).save_pretrained(out, max_shard_size=shard) if shard else model.to(dtype).save_pretrained(out)
    if rewrite_config:
        with open(os.path.join(out, "config.json")) as f:
            written = json.load(f)
        write_json(os.path.join(out, "config.json"), rewrite_config(written))
    # Reload through transformers to be sure the files hold what the golden run used.
    if act_fn is None:
        reloaded = model_class.from_pretrained(out, dtype=torch.float32)
        again = golden(reloaded, prompt, 12)
        assert again["greedy"] == result["greedy"], name
    write_json(os.path.join(out, "golden.json"), result)
    print(f"{name}: seed {seed}, margin {result['min_greedy_margin']:.3f}, greedy {result['greedy']}")


def sizes(**extra):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=None,
                eos_token_id=None, pad_token_id=None)
    base.update(extra)
    return base


def to_transformers4_config(config, **changes):
    """The config.json of transformers 4.x: rope_theta at the top level, no head_dim, no rope_parameters."""
    rope = config.pop("rope_parameters", {}) or {}
    config["rope_theta"] = rope.get("rope_theta", 10000.0)
    config["rope_scaling"] = None
    config.pop("head_dim", None)
    config.pop("dtype", None)
    config["torch_dtype"] = "bfloat16"
    config["transformers_version"] = "4.46.0"
    config.update(changes)
    return config


def make_sparse_demo(out, d_model=1024, d_hidden=2816, layers=4, vocab=4096, threshold=2.2):
    """A medium random ReLU checkpoint whose FFN is ~1% dense, as the standard synthetic workload
    makes it: every embedding row is N(0, 1) with column 0 = 1 (so the normed FFN input keeps
    x[:, 0] near 1), and every gate row has -threshold in column 0. For `twell bench model`."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=d_model, intermediate_size=d_hidden, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, hidden_act="relu", max_position_embeddings=1024,
                         initializer_range=0.02, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight.normal_(0, d_model ** -0.5)
            layer.mlp.gate_proj.weight[:, 0] = -threshold
    model.to(torch.bfloat16).save_pretrained(out)
    shutil.copy(os.path.join(ROOT, "tokenizers", "bytelevel", "tokenizer.json"), out)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--sparse-demo":
        make_sparse_demo(sys.argv[2])
        return
    bytelevel = make_bytelevel_tokenizer()
    spm_model, spm_json = make_spm_tokenizer()
    prompt = "It was the best of times, it was"

    make_model("llama", LlamaForCausalLM,
               LlamaConfig(vocab_size=384, num_key_value_heads=2, rope_theta=5000.0, tie_word_embeddings=False,
                           hidden_act="silu", **sizes()),
               torch.bfloat16, prompt, [bytelevel], shard="100KB")
    make_model("qwen2", Qwen2ForCausalLM,
               Qwen2Config(vocab_size=384, num_key_value_heads=1, rope_theta=1000000.0, tie_word_embeddings=True,
                           hidden_act="silu", use_sliding_window=False, **sizes()),
               torch.float16, prompt, [bytelevel])
    make_model("sparselm", LlamaForCausalLM,
               LlamaConfig(vocab_size=384, num_key_value_heads=4, rope_theta=10000.0, tie_word_embeddings=True,
                           hidden_act="relu", **sizes()),
               torch.bfloat16, prompt, [bytelevel],
               rewrite_config=lambda c: to_transformers4_config(c, model_type="llama_sparse_relu", hidden_act="silu",
                                                                architectures=["SparseLlamaForCausalLM"]))
    threshold = 0.02
    make_model("prosparse", LlamaForCausalLM,
               LlamaConfig(vocab_size=480, num_key_value_heads=4, rope_theta=10000.0, tie_word_embeddings=True,
                           hidden_act="relu", **sizes(num_hidden_layers=1)),
               torch.float32, prompt, [spm_model, spm_json], act_fn=FatRelu(threshold),
               rewrite_config=lambda c: to_transformers4_config(c, hidden_act="fatrelu", hidden_act_param=threshold,
                                                                torch_dtype="float32"))


if __name__ == "__main__":
    main()
