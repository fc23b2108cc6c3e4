"""Peak memory of the distillation loss, whole against chunked, at SmolLM2's vocabulary.

    python benchmarks/distill_memory.py                     # 16 x 1,024 tokens, vocabulary 49,152
    python benchmarks/distill_memory.py --batch 4 --seq 256

Each variant runs in a fresh process: both models' logits (float32, the student's with gradients) are made, then
the loss and its backward pass; the figure is the process's peak resident memory above what it held once the
logits existed, so it is what the loss itself adds. "whole" is the loss as gqaify computed it before: a float32
log-softmax of each model's logits over all tokens at once, and kl_div over them. "chunked" is
`gqaify.uptrain.distill.distillation_kl` (1,024 tokens at a time in both passes). Both give the same value.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = """
import json, resource, sys
import torch
import torch.nn.functional as F
from gqaify.uptrain.distill import distillation_kl

variant, batch, seq, vocab = sys.argv[1], *map(int, sys.argv[2:])
torch.manual_seed(0)
student = torch.randn(batch, seq, vocab, requires_grad=True)
teacher = torch.randn(batch, seq, vocab)
held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if variant == "whole":
    s = F.log_softmax(student.float().reshape(-1, vocab), dim=-1)
    t = F.log_softmax(teacher.float().reshape(-1, vocab), dim=-1)
    loss = F.kl_div(s, t, log_target=True, reduction="batchmean")
else:
    loss = distillation_kl(student, teacher)
loss.backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"variant": variant, "loss": loss.item(), "logits_bytes": 2 * student.numel() * 4,
                  "added_bytes": peak - held}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()
    rows = []
    for variant in ("whole", "chunked"):
        shape = [str(args.batch), str(args.seq), str(args.vocab)]
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, variant, *shape], capture_output=True, text=True, check=True
        )
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(
        f"{args.batch} x {args.seq} tokens, vocabulary {args.vocab:,}: both models' logits "
        f"{rows[0]['logits_bytes'] / 2**30:.2f} GiB (float32)"
    )
    print("| loss | value | memory the loss adds (peak RSS) |\n|---|---|---|")
    for row in rows:
        print(f"| {row['variant']} | {row['loss']:.6f} | {row['added_bytes'] / 2**30:.2f} GiB |")


if __name__ == "__main__":
    main()
