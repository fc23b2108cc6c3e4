"""How far a converted model has drifted from its parent, layer by layer, before any training.

On the same tokens, each model runs its own forward pass; for every layer the attention output (what the
attention block adds to the residual stream) is compared with the parent's:

    relative error_l = ||attn_l(converted) - attn_l(parent)|| / ||attn_l(parent)||   (Frobenius, all tokens)

and the next-token distributions by KL(parent || converted), in nats per token. Errors compound through the
layers, as they do in use; a collapsed conversion shows as errors near or above 1 and a KL of several nats.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gqaify.eval.results import Diagnostics
from gqaify.kl import kl_sum
from gqaify.model.archs import ARCHITECTURES, ArchSpec


def attention_modules(model) -> list[torch.nn.Module] | None:
    """Each layer's attention module, found through the architecture table; None if it cannot be found."""
    spec = ARCHITECTURES.get(model.config.model_type) or ArchSpec(model.config.model_type)
    try:
        return [model.get_submodule(spec.attention.format(layer=i)) for i in range(model.config.num_hidden_layers)]
    except AttributeError:
        return None


@torch.inference_mode()
def _trace(model, modules, ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(per-layer attention outputs (T, hidden) in float32, log-probabilities (T, vocab) in float32)."""
    outputs: list[torch.Tensor] = []
    hooks = [module.register_forward_hook(lambda _m, _in, out: outputs.append(out[0][0].float())) for module in modules]
    try:
        logits = model(ids.to(next(model.parameters()).device).unsqueeze(0)).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    return outputs, F.log_softmax(logits.float(), dim=-1)


def compare(parent, model, ids: torch.Tensor) -> Diagnostics | None:
    """Diagnostics of `model` against `parent` on the token ids `ids` (1-D); None where layers cannot be matched."""
    parent_modules, modules = attention_modules(parent), attention_modules(model)
    if parent_modules is None or modules is None or len(parent_modules) != len(modules):
        return None
    parent_attn, parent_logp = _trace(parent, parent_modules, ids)
    attn, logp = _trace(model, modules, ids)
    errors = [((a.cpu() - p.cpu()).norm() / p.cpu().norm()).item() for a, p in zip(attn, parent_attn, strict=True)]
    kl = kl_sum(logp.to(parent_logp.device), parent_logp).item() / len(parent_logp)  # per token
    return Diagnostics(len(ids), errors, kl)
