"""KL divergence of a quant's next-token distributions from its FP16 source's, and how often both pick the same token.

Full-vocabulary FP16 log-probabilities for 48 windows of 2048 tokens are ~19 GB at a 49k vocabulary, so the FP16
evaluation keeps a compact reference instead: at each position, FP16's top K tokens with their log-probabilities,
S tokens drawn from FP16's distribution outside the top K (with theirs), and the mass outside the top K. A quant's
KL(FP16 || quant) at a position is then

    sum over the top K of p (log p - log q)  +  tail mass x mean over the samples of (log p - log q)

The first term is exact; the second is an unbiased estimate of the tail's share (the samples follow p restricted to
the tail). With K = S = 32, SmolLM2-135M's mean KLD and 99th percentile stay within 0.3% of the exact
full-vocabulary figures (benchmarks/kld_estimator.py; tests/integration/test_smollm2.py checks it on every run) at 516
bytes a position (50 MB for 48 windows). Top-1 agreement is exact: FP16's most likely token is the first of its top K.
Samples are drawn with a generator seeded per window, so the same stream gives the same reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from factory.checkpoints.files import write_atomic

if TYPE_CHECKING:
    import torch

TOP_K = 32
TAIL_SAMPLES = 32
SEED = 20261202
CHUNK = 256  # positions drawn from at once: the tail's copy of a 128k vocabulary is 128 MB, not a window's 1 GB
KEYS = ("top_ids", "top_logp", "tail_ids", "tail_logp", "tail_mass")
LAYOUT = (TOP_K, TAIL_SAMPLES, SEED, CHUNK)  # a reference made another way is another file (identity.reference_key)


@dataclass(frozen=True)
class Divergence:
    """A quant's divergence from FP16 over every scored position."""

    mean: float  # mean KL(FP16 || quant) per token, in nats
    p99: float  # its 99th percentile over positions
    top1: float  # share of positions where both models' most likely next token is the same


class Reference:
    """FP16's next-token distributions of one token stream, kept compactly: one entry of KEYS a window."""

    def __init__(self, windows: list[dict[str, torch.Tensor]] | None = None):
        self.windows = windows or []

    def add(self, logp: torch.Tensor, index: int) -> None:
        """Keep what KL needs of one window's FP16 log-probabilities [positions, vocab]."""
        import torch

        generator = torch.Generator(device=logp.device).manual_seed(SEED + index)
        parts = [_compact(logp[start : start + CHUNK], generator) for start in range(0, len(logp), CHUNK)]
        self.windows.append({k: torch.cat([part[k] for part in parts]) for k in KEYS})

    def divergence(self, logq: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per position of window `index`: the estimated KL(FP16 || quant) and whether both pick the same token,
        from the quant's log-probabilities [positions, vocab]."""
        ref = {k: v.to(logq.device) for k, v in self.windows[index].items()}
        top_q = logq.gather(-1, ref["top_ids"].long()).float()
        head = (ref["top_logp"].exp() * (ref["top_logp"] - top_q)).sum(-1)
        tail_q = logq.gather(-1, ref["tail_ids"].long()).float()
        tail = ref["tail_mass"] * (ref["tail_logp"] - tail_q).mean(-1)
        same = logq.argmax(-1) == ref["top_ids"][:, 0].long()
        return (head + tail).cpu(), same.cpu()

    def save(self, path: Path) -> None:
        import torch
        from safetensors.torch import save

        # readers (and another job that made the same reference at the same time) see a whole one or none
        write_atomic(path, save({k: torch.stack([w[k] for w in self.windows]) for k in KEYS}))

    @classmethod
    def load(cls, path: Path) -> Reference:
        from safetensors.torch import load_file

        stacked = load_file(str(path))
        return cls([{k: stacked[k][i] for k in KEYS} for i in range(len(stacked["top_ids"]))])


def _compact(logp: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
    import torch

    top_logp, top_ids = logp.topk(TOP_K, dim=-1)
    tail = logp.exp().scatter_(-1, top_ids, 0.0)
    mass = tail.sum(-1)
    empty = mass <= 0  # every bit of mass in the top K: draw anything, the term weighs nothing
    tail[empty] = 1.0
    tail_ids = torch.multinomial(tail, TAIL_SAMPLES, replacement=True, generator=generator)
    del tail
    return {
        "top_ids": top_ids.int().cpu(),
        "top_logp": top_logp.float().cpu(),
        "tail_ids": tail_ids.int().cpu(),
        "tail_logp": logp.gather(-1, tail_ids).float().cpu(),
        "tail_mass": mass.masked_fill(empty, 0.0).float().cpu(),
    }


def summarize(kls: list[torch.Tensor], same: list[torch.Tensor]) -> Divergence:
    import torch

    every = torch.cat(kls).double()
    mean, p99 = every.mean().item(), torch.quantile(every, 0.99).item()
    if not (math.isfinite(mean) and math.isfinite(p99)):
        mean = p99 = math.inf
    return Divergence(mean=mean, p99=p99, top1=torch.cat(same).float().mean().item())
