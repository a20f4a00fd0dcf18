"""How to keep what KL(FP16 || quant) needs without the full-vocabulary logits (the KL divergence issue's design).

    python benchmarks/kld_estimator.py [WINDOWS]     (CPU, fp32; default 2 windows of 2048 tokens)

SmolLM2-135M-Instruct (tests/support/smollm2.py; 49152 tokens) against two stand-in quants made here, round-to-nearest
of every decoder linear at 4 and at 3 bits (group 64), on builtin:wiki. Per position it compares the exact
full-vocabulary KL with two compact FP16 references:
- "lumped": FP16's top-K log-probabilities plus the remaining mass as one bucket (KL of the coarsened
  distributions, a lower bound);
- "sampled": the same top-K plus S tokens drawn from FP16's distribution outside the top-K (with their FP16
  log-probabilities); the tail's share of the KL is estimated as tail mass x mean log(p/q) over the samples, which
  is unbiased.
Bytes per position: K + S (token id int32 + log-probability fp16) + 4 for the mass. Results:
benchmarks/results/kld_estimator.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "kld_estimator.json"


def rtn(folder: Path, bits: int, group: int = 64):
    """The model with every decoder linear rounded to `bits` per weight (asymmetric, per group), the head kept."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
                w = module.weight.data.view(-1, group)
                lo, hi = w.min(1, keepdim=True).values, w.max(1, keepdim=True).values
                scale = (hi - lo).clamp(min=1e-8) / (2**bits - 1)
                module.weight.data = (((w - lo) / scale).round() * scale + lo).view_as(module.weight)
    return model


def log_probs(model, windows):
    import torch

    with torch.no_grad():
        return torch.cat([torch.log_softmax(model(w[None]).logits[0, :-1].float(), -1) for w in windows])


def estimates(p, q, k: int, s: int, seed: int = 0) -> dict:
    import torch

    lp, idx = p.topk(k, -1)
    lq = q.gather(-1, idx)
    head = (lp.exp() * (lp - lq)).sum(-1)
    rest_p = (1 - lp.exp().sum(-1)).clamp(min=1e-12)
    rest_q = (1 - lq.exp().sum(-1)).clamp(min=1e-12)
    lumped = head + rest_p * (rest_p.log() - rest_q.log())
    tail = p.exp().scatter(-1, idx, 0.0)
    drawn = torch.multinomial(
        tail / tail.sum(-1, keepdim=True), s, replacement=True, generator=torch.Generator().manual_seed(seed)
    )
    sampled = head + tail.sum(-1) * (p.gather(-1, drawn) - q.gather(-1, drawn)).mean(-1)
    return {"lumped": lumped, "sampled": sampled}


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    import calibration
    from factory.evaluation import evaluate
    from tests.support.smollm2 import convert

    count = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    folder = convert(Path("/tmp/quantfactory-bench") / "SmolLM2-135M-Instruct")
    ids = evaluate.tokenize(folder, calibration.resolve("builtin:wiki").text)
    windows = [torch.tensor(w) for w in evaluate.stream(ids, count, 2048, "builtin:wiki").windows]
    p = log_probs(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), windows)
    rows = []
    for bits in (4, 3):
        q = log_probs(rtn(folder, bits), windows)
        exact = (p.exp() * (p - q)).sum(-1)
        truth = {
            "mean": exact.mean().item(),
            "p99": exact.quantile(0.99).item(),
            "top1": (p.argmax(-1) == q.argmax(-1)).float().mean().item(),
        }
        for k, s in ((16, 0), (32, 0), (64, 0), (128, 0), (256, 0), (16, 16), (32, 32), (64, 64)):
            for kind, kl in estimates(p, q, k, max(s, 1)).items():
                if (kind == "sampled") != (s > 0):
                    continue
                rows.append(
                    {
                        "quant": f"rtn-{bits}bit-g64",
                        "reference": kind,
                        "top_k": k,
                        "samples": s,
                        "bytes_per_position": (k + s) * 6 + 4,
                        "exact": truth,
                        "mean": kl.mean().item(),
                        "p99": kl.quantile(0.99).item(),
                        "mean_error": kl.mean().item() / truth["mean"] - 1,
                        "p99_error": kl.quantile(0.99).item() / truth["p99"] - 1,
                    }
                )
                r = rows[-1]
                print(
                    f"{r['quant']} {kind:7} K={k:3} S={s:2}: mean {r['mean']:.5f} ({r['mean_error']:+.2%}) "
                    f"p99 {r['p99']:.4f} ({r['p99_error']:+.2%}), exact {truth['mean']:.5f} / {truth['p99']:.4f}, "
                    f"{r['bytes_per_position']} B/position",
                    flush=True,
                )
    RESULTS.write_text(
        json.dumps(
            {
                "command": f"python benchmarks/kld_estimator.py {count}",
                "model": "smollm2-135m-instruct",
                "positions": len(p),
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
