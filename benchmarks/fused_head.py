"""Time and peak memory of one forward and backward pass of the fused head and loss (`uptrain.head_loss.fused_loss`)
at SmolLM2's head: hidden 576, vocabulary 49,152, random hidden states and weights.

    python benchmarks/fused_head.py                                        # 2,048 tokens, each mode, 3 turns
    python benchmarks/fused_head.py --src before=/tmp/before/src --src after=src --turns 4   # two versions
    python benchmarks/fused_head.py --src 341=src --src 170=src:170 --modes kl                # two chunk sizes

Each variant (a gqaify source folder, put first on the child's PYTHONPATH, and after a colon the tokens per chunk if
not gqaify's own choice; without --src the gqaify Python imports) runs in a fresh process per mode and turn, the
variants in turns (A B A B ...), so that a machine whose speed drifts slows each alike. A process makes its tensors,
runs one pass, then `--repeats` timed passes; its time is their median. Its memory is that of the first pass: the
peak bytes of the tensors the pass made, each counted while it lived (a dispatch mode, as the memory plan counts
them), and the peak resident memory above what the process held before it (Linux's VmHWM, reset then); both include
the gradients of the hidden states and of the head's weight. glibc is told to hand every allocation of 1 MiB or more
back to the system when it is freed (MALLOC_MMAP_THRESHOLD_), so that the resident memory follows the tensors alive.
The table gives, per mode and variant, the median over turns and the range (min to max), then each variant's ratio
to the first, turn by turn.

The modes are the losses uptraining trains on: `kl` the KL to a live teacher alone (the recipes' distill_weight 1,
T 1), `mixed-T2` half LM loss and half KL at temperature 2, `stored` half LM loss and half the KL to the parent's
stored top-64 log-probabilities, `lm` the LM loss alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

MODES = {  # mode -> (distill_weight, temperature, teacher: "live", "stored" or None)
    "kl": (1.0, 1.0, "live"),
    "mixed-T2": (0.5, 2.0, "live"),
    "stored": (0.5, 1.0, "stored"),
    "lm": (0.0, 1.0, None),
}

_CHILD = """
import json, statistics, sys, time, weakref
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from gqaify.uptrain.head_loss import Teacher, fused_loss

def resident(field):  # VmRSS (now) or VmHWM (the peak since the last reset), in bytes
    lines = open("/proc/self/status").read().splitlines()
    return 1024 * int(next(line for line in lines if line.startswith(field)).split()[1])

class Tensors(TorchDispatchMode):  # the peak bytes of the tensors made while it is on (not those of `held`)
    def __init__(self, held):
        super().__init__()
        self.live, self.now, self.peak = {id(t.untyped_storage()): 0 for t in held}, 0, 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in self.live:
                storage = t.untyped_storage()
                self.live[id(storage)] = storage.nbytes()
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self.free, id(storage))
        return out
    def free(self, key):
        self.now -= self.live.pop(key, 0)

w, temperature, kind, tokens, width, vocab, repeats, threads, chunk = json.loads(sys.argv[1])
torch.set_num_threads(threads)
torch.manual_seed(0)
hidden = torch.randn(tokens, width, requires_grad=True)
weight = (0.05 * torch.randn(vocab, width)).requires_grad_()
labels = torch.randint(0, vocab, (tokens,))
teacher = None
if kind == "live":
    teacher = Teacher(hidden=torch.randn(tokens, width), weight=0.05 * torch.randn(vocab, width))
elif kind == "stored":  # the parent's top-64: distinct ids, log-probabilities summing below 0
    ids = torch.stack([torch.randperm(vocab)[:64] for _ in range(tokens)])
    logprobs = torch.log_softmax(torch.randn(tokens, 65), -1)[:, :64].sort(-1, descending=True).values
    teacher = Teacher(top_ids=ids, top_logprobs=logprobs)
open("/proc/self/clear_refs", "w").write("5")  # the peak resident memory counts from here
held = resident("VmRSS")
inputs = [hidden, weight, labels, *(t for t in vars(teacher or Teacher()).values() if t is not None)]
with Tensors(inputs) as tensors:  # the first pass, counted
    loss, _ = fused_loss(hidden, weight, labels, teacher, w, temperature, chunk=chunk)
    loss.backward()
added = resident("VmHWM") - held
times = []
for _ in range(repeats):
    hidden.grad = weight.grad = None
    start = time.perf_counter()
    loss, _ = fused_loss(hidden, weight, labels, teacher, w, temperature, chunk=chunk)
    loss.backward()
    times.append(time.perf_counter() - start)
found = {"loss": loss.item(), "seconds": statistics.median(times), "added_bytes": added, "tensor_bytes": tensors.peak}
print(json.dumps(found))
"""


def measure(variant: str | None, mode: str, args) -> dict:
    """One fresh process's figures for `mode` with gqaify from `variant`'s folder (None: the one Python imports)."""
    w, temperature, kind = MODES[mode]
    src, _, chunk = (variant or "").partition(":")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(2**20))  # freed tensors leave the resident memory at once
    if src:
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), *filter(None, [env.get("PYTHONPATH")])])
    shape = [args.tokens, args.hidden, args.vocab, args.repeats, args.threads, int(chunk) if chunk else None]
    spec = json.dumps([w, temperature, kind, *shape])
    done = subprocess.run([sys.executable, "-c", _CHILD, spec], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"{mode} ({variant or 'installed'}) failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float], unit: str, scale: float = 1.0) -> str:
    """The median and the range of `values`, as `median (min to max) unit`."""
    lo, mid, hi = (scale * v for v in (min(values), statistics.median(values), max(values)))
    return f"{mid:.3g} {unit} ({lo:.3g} to {hi:.3g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", action="append", default=[], metavar="NAME=DIR[:CHUNK]", help="a variant (see above)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per process, after one to warm up")
    parser.add_argument("--turns", type=int, default=3, help="processes per mode and variant, the variants in turns")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads in each process")
    args = parser.parse_args()
    variants = dict(v.split("=", 1) for v in args.src) or {"installed": None}
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: {', '.join(sorted(unknown))} unknown; choose from {', '.join(MODES)}")
    rows = {(m, v): [] for m in modes for v in variants}
    for turn in range(args.turns):
        for mode in modes:
            for name, src in variants.items():
                rows[mode, name].append(found := measure(src, mode, args))
                print(f"turn {turn + 1} {mode} {name}: {json.dumps(found)}", file=sys.stderr, flush=True)
    print(f"{args.tokens:,} tokens, hidden {args.hidden}, vocabulary {args.vocab:,}, {args.threads} thread(s):")
    print(f"the median of {args.turns} processes (min to max), each the median of {args.repeats} passes\n")
    print("| mode | variant | loss | forward + backward | peak of its tensors | peak RSS added |")
    print("|---|---|---|---|---|---|")
    for (mode, name), found in rows.items():
        seconds, added = [f["seconds"] for f in found], [f["added_bytes"] for f in found]
        tensors = spread([f["tensor_bytes"] for f in found], "MiB", 2**-20)
        loss = found[0]["loss"]
        print(f"| {mode} | {name} | {loss:.6f} | {spread(seconds, 's')} | {tensors} | {spread(added, 'MiB', 2**-20)} |")
    first, *others = variants
    for other in others:
        print(f"\n| mode | {other} / {first}: time | peak of its tensors | peak RSS added |\n|---|---|---|---|")
        for mode in modes:
            pairs = list(zip(rows[mode, first], rows[mode, other], strict=True))
            ratios = [[b[key] / max(a[key], 1) for a, b in pairs] for key in ("seconds", "tensor_bytes", "added_bytes")]
            print(f"| {mode} | {' | '.join(spread(r, 'x') for r in ratios)} |")


if __name__ == "__main__":
    main()
