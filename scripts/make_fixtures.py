#!/usr/bin/env python3
"""Makes the golden fixtures of the model runtime tests (tests/fixtures/), once, on a machine with
torch, transformers, tokenizers, sentencepiece and safetensors:

    pip install torch --index-url https://download.pytorch.org/whl/cpu   # or plain `pip install torch`
    pip install transformers tokenizers sentencepiece safetensors
    python3 scripts/make_fixtures.py
    python3 scripts/make_fixtures.py --sparse-demo DIR   # a medium random ReLU model for benchmarks (not committed)

The tests read only the committed output; CI needs none of these packages.

Tokenizers: scripts/make_tokenizer_fixtures.py (which needs only tokenizers and sentencepiece).
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

import torch
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from make_tokenizer_fixtures import ROOT, fresh_dir, make_bytelevel_tokenizer, make_split_tokenizers, \
    make_spm_tokenizer, write_json


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
    make_split_tokenizers()
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
