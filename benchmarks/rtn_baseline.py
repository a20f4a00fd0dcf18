"""Round-to-nearest as a baseline for a quant's loss: every decoder linear rounded to 4 bits per weight (asymmetric,
per group; benchmarks/kld_estimator.py `rtn`), no calibration, scored as the factory scores a quant (its windows of
builtin:wiki, no BOS: perplexity, exact KL divergence from FP16, top-1). Where an AWQ quant loses as much as this, the
loss is the format's, not AWQ's doing.

    python benchmarks/rtn_baseline.py SOURCE [--groups 128,32] [--windows 4] [--out RESULTS.json]

Gemma-3-270M (tests/support/gemma.py, whose "FP16" is PyPI's Q4_K_M dequantized):
benchmarks/results/gemma3-270m-rtn.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.kld_estimator import rtn
    from calibration import builtin_text
    from factory.evaluation import evaluate

    parser = argparse.ArgumentParser()
    parser.add_argument("source", type=Path)
    parser.add_argument("--groups", default="128,32")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    ids = evaluate.tokenize(args.source, builtin_text("wiki"), args.windows * evaluate.WINDOW)
    windows = [torch.tensor(w) for w in evaluate.stream(ids, args.windows, None, "builtin:wiki").windows]
    fp16 = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.float32).eval()
    results = {"source": str(args.source), "windows": args.windows, "window": evaluate.WINDOW, "rows": {}}
    for group in map(int, args.groups.split(",")):
        quant = rtn(args.source, 4, group)
        nll = kld = top1 = positions = 0.0
        with torch.inference_mode():
            for w in windows:
                p = torch.log_softmax(fp16(w[None]).logits[0, :-1].float(), -1)
                q = torch.log_softmax(quant(w[None]).logits[0, :-1].float(), -1)
                nll -= q.gather(-1, w[1:, None]).sum().item()
                kld += (p.exp() * (p - q)).sum().item()
                top1 += (p.argmax(-1) == q.argmax(-1)).sum().item()
                positions += len(w) - 1
        row = {"ppl": float(torch.tensor(nll / positions).exp()), "kld": kld / positions, "top1": top1 / positions}
        results["rows"][f"rtn-w4g{group}"] = row
        print(f"rtn-w4g{group}: ppl {row['ppl']:.4f}, KLD {row['kld']:.4f}, top-1 {row['top1']:.1%}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
