#!/usr/bin/env python3
"""A small ReLU Llama trained on real English text with an L1 penalty on its FFN activations: the
real-model study of the decode predictor (issue 4, docs/perf-notes.md "Decode FFN").

Two steps, because the text and the tokenizer come from this machine and the GPU comes from another:

  corpus  (CPU, here)   English prose shipped in Debian packages -> train/held-out text, a byte-level
                        BPE tokenizer.json (PyPI `tokenizers`), and the token ids as uint16 files.
      apt-get install -y fortunes perl-doc
      python3 scripts/train_relu_l1.py corpus --out .models/relu-l1-data
  train   (GPU)         LlamaForCausalLM with hidden_act "relu" on those ids; the loss adds
                        coeff · mean(relu(x·Wg^T)) over every layer's FFN. The coefficient is steered
                        each step towards a target fraction of active neurons (the fraction that an
                        L1 coefficient gives is not known before training), then held fixed for the
                        last part of the run. Saves the HF layout (bf16 safetensors shards, config.json)
                        and training.json (losses, coefficient, per-layer active fractions on held-out text).
      python3 scripts/train_relu_l1.py train --data .models/relu-l1-data --out $OUT/model --seconds 90

The text: the `fortunes` quotation files (literature, wisdom, humour, science, ...; the offensive set
and the ASCII-art files left out) and Perl's manual pages from `perl-doc` with the POD markup and the
code blocks stripped. Both are free software documentation/data; the corpus and the checkpoint stay
out of git (.models/ is ignored).
"""
import argparse
import glob
import json
import math
import os
import random
import re
import shutil
import sys
import time

FORTUNE_DIR = "/usr/share/games/fortunes"
FORTUNE_SKIP = {"art", "ascii-art", "translate-me"}
POD_GLOB = "/usr/share/perl/5.36/pod/*.pod"
END_OF_TEXT = "<|endoftext|>"


def fortune_documents():
    for path in sorted(glob.glob(os.path.join(FORTUNE_DIR, "*"))):
        name = os.path.basename(path)
        if "." in name or name in FORTUNE_SKIP or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for quote in f.read().split("\n%\n"):
                quote = quote.strip()
                if len(quote) >= 40:
                    yield quote


POD_CODE = re.compile(r"[A-Z]<+\s*(.*?)\s*>+", re.S)


def pod_documents():
    """Each POD section's prose paragraphs: commands (=head1 ...) become headings, verbatim
    (indented) paragraphs, which hold code, are dropped, and B<>, C<>, L<>, ... keep their text."""
    for path in sorted(glob.glob(POD_GLOB)):
        with open(path, encoding="utf-8", errors="replace") as f:
            paragraphs = f.read().split("\n\n")
        section = []
        for paragraph in paragraphs:
            if not paragraph.strip() or paragraph[0] in " \t":
                continue
            if paragraph.startswith("="):
                command, _, rest = paragraph.partition(" ")
                if command.startswith("=head") and section:
                    yield "\n\n".join(section)
                    section = []
                if command.startswith("=head") or command == "=item":
                    paragraph = rest
                else:
                    continue
            text = POD_CODE.sub(lambda m: m.group(1).split("|")[0], paragraph)
            text = " ".join(text.split())
            if text:
                section.append(text)
        if section:
            yield "\n\n".join(section)


def make_corpus(args):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import numpy as np

    documents = [d for d in list(fortune_documents()) + list(pod_documents()) if d.strip()]
    random.Random(args.seed).shuffle(documents)
    held = max(1, int(len(documents) * args.heldout_fraction))
    splits = {"heldout": documents[:held], "train": documents[held:]}
    os.makedirs(args.out, exist_ok=True)
    for name, docs in splits.items():
        with open(os.path.join(args.out, f"{name}.txt"), "w", encoding="utf-8") as f:
            f.write("\n\n".join(docs) + "\n")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train([os.path.join(args.out, "train.txt")], trainer)
    tokenizer.save(os.path.join(args.out, "tokenizer.json"))
    eot = tokenizer.token_to_id(END_OF_TEXT)
    sizes = {}
    for name, docs in splits.items():
        ids = []
        for encoding in tokenizer.encode_batch(docs, add_special_tokens=False):
            ids.extend(encoding.ids)
            ids.append(eot)
        np.asarray(ids, dtype=np.uint16).tofile(os.path.join(args.out, f"{name}.bin"))
        sizes[name] = {"documents": len(docs), "tokens": len(ids),
                       "bytes": os.path.getsize(os.path.join(args.out, f"{name}.txt"))}
    with open(os.path.join(args.out, "corpus.json"), "w") as f:
        json.dump({"vocab_size": tokenizer.get_vocab_size(), "end_of_text": eot, "splits": sizes}, f, indent=2)
    print(json.dumps(sizes))


def train(args):
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with open(os.path.join(args.data, "corpus.json")) as f:
        corpus = json.load(f)
    splits = {name: torch.from_numpy(np.fromfile(os.path.join(args.data, f"{name}.bin"), dtype=np.uint16).astype(np.int64))
              for name in ("train", "heldout")}
    config = LlamaConfig(vocab_size=corpus["vocab_size"], hidden_size=args.d_model, intermediate_size=args.d_hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.d_model // 64,
                         num_key_value_heads=args.d_model // 64, hidden_act="relu",
                         max_position_embeddings=args.context * 2, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=corpus["end_of_text"], pad_token_id=None,
                         initializer_range=0.02)
    model = LlamaForCausalLM(config).to(device)

    activations = []  # relu(x·Wg^T) of each layer in the current forward pass

    def keep_activation(_module, _inputs, output):
        activations.append(output)

    for layer in model.model.layers:
        layer.mlp.act_fn.register_forward_hook(keep_activation)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), fused=device == "cuda")

    def batch(split, size):
        data = splits[split]
        starts = torch.randint(0, len(data) - args.context - 1, (size,))
        rows = torch.stack([data[s:s + args.context + 1] for s in starts]).to(device, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]

    def forward(inputs, targets):
        activations.clear()
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(input_ids=inputs).logits
        ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return ce, [a.float() for a in activations]

    log_coeff = math.log(args.l1_start)
    history = []
    start = time.time()
    step = 0
    while True:
        elapsed = time.time() - start
        if elapsed >= args.seconds:
            break
        progress = elapsed / args.seconds
        warm = min(1.0, step / args.warmup_steps)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = batch("train", args.batch)
        ce, acts = forward(inputs, targets)
        l1 = torch.stack([a.mean() for a in acts]).mean()
        coeff = math.exp(log_coeff)
        loss = ce + coeff * l1
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        with torch.no_grad():
            active = torch.stack([(a > 0).float().mean() for a in acts]).mean().item()
        # Steer the coefficient towards the target active fraction until the hold phase.
        if step >= args.warmup_steps and progress < 1 - args.hold_fraction:
            error = math.log(max(active, 1e-6) / args.target_active)
            log_coeff += args.steer_rate * max(-1.0, min(1.0, error))
        if step % 50 == 0:
            entry = {"step": step, "seconds": round(elapsed, 1), "lr": lr, "ce": ce.item(), "l1": l1.item(),
                     "coeff": coeff, "active": active}
            history.append(entry)
            print(json.dumps(entry), flush=True)
        step += 1

    model.eval()
    with torch.no_grad():
        ce_sum, fractions, count = 0.0, torch.zeros(args.layers), 0
        generator_state = torch.get_rng_state()
        torch.manual_seed(args.seed + 1)
        for _ in range(args.eval_batches):
            inputs, targets = batch("heldout", args.batch)
            ce, acts = forward(inputs, targets)
            ce_sum += ce.item()
            fractions += torch.tensor([(a > 0).float().mean().item() for a in acts])
            count += 1
        torch.set_rng_state(generator_state)
    result = {"steps": step, "seconds": round(time.time() - start, 1), "tokens_seen": step * args.batch * args.context,
              "final_coeff": math.exp(log_coeff), "heldout_ce": ce_sum / count,
              "heldout_perplexity": math.exp(ce_sum / count),
              "heldout_active_fraction_per_layer": (fractions / count).tolist(),
              "args": {k: v for k, v in vars(args).items() if k != "run"},
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "history": history}
    print(json.dumps({k: v for k, v in result.items() if k != "history"}), flush=True)

    os.makedirs(args.out, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out, max_shard_size=args.shard)
    generation_config = os.path.join(args.out, "generation_config.json")
    if os.path.exists(generation_config):  # the study needs none, and $OUT brings back 8 files at most
        os.remove(generation_config)
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(result, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    corpus = commands.add_parser("corpus", help="build text, tokenizer and token ids (CPU)")
    corpus.add_argument("--out", required=True)
    corpus.add_argument("--vocab", type=int, default=4096)
    corpus.add_argument("--heldout-fraction", type=float, default=0.03)
    corpus.add_argument("--seed", type=int, default=1)
    corpus.set_defaults(run=make_corpus)
    trainer = commands.add_parser("train", help="train the model (GPU)")
    trainer.add_argument("--data", required=True)
    trainer.add_argument("--out", required=True)
    trainer.add_argument("--d-model", type=int, default=384)
    trainer.add_argument("--d-hidden", type=int, default=1056)
    trainer.add_argument("--layers", type=int, default=6)
    trainer.add_argument("--context", type=int, default=256)
    trainer.add_argument("--batch", type=int, default=64)
    trainer.add_argument("--lr", type=float, default=2e-3)
    trainer.add_argument("--warmup-steps", type=int, default=100)
    trainer.add_argument("--seconds", type=float, default=90)
    trainer.add_argument("--target-active", type=float, default=0.007, help="fraction of FFN neurons active per token")
    trainer.add_argument("--l1-start", type=float, default=0.05)
    trainer.add_argument("--steer-rate", type=float, default=0.01, help="log-coefficient change per step, at most")
    trainer.add_argument("--hold-fraction", type=float, default=0.2, help="last part of the run at a fixed coefficient")
    trainer.add_argument("--eval-batches", type=int, default=8)
    trainer.add_argument("--shard", default="14MB")
    trainer.add_argument("--seed", type=int, default=1)
    trainer.set_defaults(run=train)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    sys.exit(main())
