#!/usr/bin/env python3
"""Which decode predictor could reach the issue's quality target (recall >= 99% with a predicted set
<= 4x the truly active set) on a real L1-trained ReLU model: a float64 study of candidates that
twell does not implement yet, beside the ones it does (`twell predictor-report` measures those with
twell's own kernels; the two agree on the shared rows).

Each candidate approximates every gate row W[j] by Q[j] and scores s = x·Q[j]; "z" divides s by
||x||·rms(W[j] − Q[j]) (the estimate's error scale, as twell's one-bit-norm). Each layer's threshold
is calibrated for 99% recall on the first half of the tokens and measured on the second half.

    python3 scripts/predictor_study.py --model .models/relu-l1-d512 --tokens .models/relu-l1-data/heldout.bin

Needs torch and transformers (CPU is enough: a few minutes for 8192 tokens of a D=512 model).
"""
import argparse
import math

import numpy as np
import torch
from transformers import LlamaForCausalLM


def ffn_inputs(model, ids, window):
    """Each layer's FFN input [tokens, D] (the RMS-normed hidden state the gate sees)."""
    captured = {l: [] for l in range(len(model.model.layers))}
    for l, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda _m, a, l=l: captured[l].append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        for start in range(0, len(ids), window):
            model(input_ids=ids[start:start + window][None])
    return [torch.cat(captured[l]).double() for l in captured]


def one_bit(w):
    return w.abs().mean(1, keepdim=True) * w.sign()


def one_bit_with_outliers(k):
    """One bit per weight, plus each row's k largest |w| kept exactly."""
    def approximate(w):
        mask = torch.zeros_like(w, dtype=torch.bool).scatter_(1, w.abs().topk(k, dim=1).indices, True)
        scale = (w.abs() * ~mask).sum(1, keepdim=True) / (~mask).sum(1, keepdim=True)
        return torch.where(mask, w, scale * w.sign())
    return approximate


def two_level(quantile):
    """Two bits per weight: the sign, and whether |w| is above the row's quantile (two scales a row).
    twell's two-bit-norm splits at 0.6 (the element at index 3K/5 of the sorted |w|)."""
    def approximate(w):
        large = w.abs() > w.abs().quantile(quantile, dim=1, keepdim=True)
        large_scale = (w.abs() * large).sum(1, keepdim=True) / large.sum(1, keepdim=True)
        small_scale = (w.abs() * ~large).sum(1, keepdim=True) / (~large).sum(1, keepdim=True)
        return torch.where(large, large_scale, small_scale) * w.sign()
    return approximate


def uniform(bits):
    """Symmetric uniform levels ±0.5..±(2^(bits-1) − 0.5) times a per-row scale from max |w|."""
    def approximate(w):
        top = 2 ** (bits - 1) - 0.5
        scale = w.abs().amax(1, keepdim=True) / top
        return (torch.clamp((w / scale - 0.5).round(), -top - 0.5, top - 0.5) + 0.5) * scale
    return approximate


def measure(inputs, gates, approximate, normalized, recall):
    rows = []
    for x, w in zip(inputs, gates):
        q = approximate(w)
        residual = (w - q).pow(2).mean(1).sqrt()

        def score(x):
            s = x @ q.T
            return s / (x.norm(dim=1, keepdim=True) * residual[None, :]) if normalized else s
        half = len(x) // 2
        calibration, evaluation = x[:half], x[half:]
        active_scores = score(calibration)[(calibration @ w.T) > 0].sort().values
        threshold = active_scores[len(active_scores) - math.ceil(recall * len(active_scores))]
        predicted, active = score(evaluation) >= threshold, (evaluation @ w.T) > 0
        rows.append(((predicted & active).sum().item() / active.sum().item(),
                     predicted.sum().item() / active.sum().item(), predicted.double().mean().item()))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", required=True, help="uint16 token ids (scripts/train_relu_l1.py corpus)")
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--recall", type=float, default=0.99)
    args = parser.parse_args()
    model = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids = torch.from_numpy(np.fromfile(args.tokens, dtype=np.uint16).astype(np.int64))[:args.max_tokens]
    inputs = ffn_inputs(model, ids, args.window)
    gates = [layer.mlp.gate_proj.weight.detach().double() for layer in model.model.layers]
    candidates = [("one-bit", one_bit), ("one-bit + 16 outliers", one_bit_with_outliers(16)),
                  ("one-bit + 32 outliers", one_bit_with_outliers(32)), ("two-level at the median", two_level(0.5)),
                  ("two-level at 0.6", two_level(0.6)), ("two-level at 0.7", two_level(0.7)),
                  ("uniform 2 bits", uniform(2)), ("uniform 3 bits", uniform(3)), ("uniform 4 bits", uniform(4))]
    print("one-bit is twell's one-bit gate, one-bit z its one-bit-norm, two-level at 0.6 z its two-bit-norm")
    print(f"{'candidate':34s} {'recall':>7s} {'pred/active':>11s} {'pred %':>7s}  pred/active per layer")
    for name, approximate in candidates:
        for normalized in (False, True):
            rows = measure(inputs, gates, approximate, normalized, args.recall)
            mean = [sum(r[i] for r in rows) / len(rows) for i in range(3)]
            print(f"{name + (' z' if normalized else ''):34s} {mean[0]:7.4f} {mean[1]:10.2f}x {100 * mean[2]:6.2f}%  "
                  + " ".join(f"{r[1]:.1f}" for r in rows), flush=True)


if __name__ == "__main__":
    main()
