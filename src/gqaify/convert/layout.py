"""Cut one layer's K/V-indexed checkpoint tensors into heads, and put them back together.

Conversion methods see one layer as a dict of head-major float32 tensors, whatever the architecture
stores on disk (see `archs.py`):

    "k.weight" (KV, d, hidden)     "k.bias" (KV, d)
    "v.weight" (KV, d, hidden)     "v.bias" (KV, d)
    "k_norm.weight" (KV, d)        "k_norm.bias" (KV, d)

Row r of a K/V projection belongs to head r // d, the order `repeat_kv` assumes. A fused QKV projection's
query rows are carried aside untouched and put back in front.

Every output tensor name is also an input tensor name (a layer with G heads has a subset of the names of a
layer with KV heads), so an output keeps the dtype of the input of the same name.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from gqaify.convert.archs import HEAD, ArchSpec, Geometry
from gqaify.errors import UserError

SUFFIXES = ("weight", "bias")
Heads = dict[str, torch.Tensor]


@dataclass(frozen=True)
class _Module:
    part: str  # "k", "v", "k_norm", or "qkv" (fused: query rows carried, K and V converted)
    path: str  # full module path; per-head modules contain {head}
    per_head: bool = False


class LayerLayout:
    """The K/V-indexed tensors of attention layer `layer` of a checkpoint."""

    def __init__(self, spec: ArchSpec, geometry: Geometry, layer: int):
        self.geometry = geometry
        self.layer = layer
        if spec.qkv_proj:
            modules = [_Module("qkv", spec.module(layer, spec.qkv_proj))]
        else:
            modules = [_Module("k", spec.module(layer, spec.k_proj)), _Module("v", spec.module(layer, spec.v_proj))]
        if spec.k_norm:
            modules.append(_Module("k_norm", spec.module(layer, spec.k_norm)))
        if spec.k_norm_per_head:
            modules.append(_Module("k_norm", spec.module(layer, spec.k_norm_per_head), per_head=True))
        self._modules = modules
        self._module_of = {  # every tensor name this layer may have -> its module
            name: module
            for module in modules
            for suffix in SUFFIXES
            for name in self._names(module, suffix, geometry.num_kv_heads)
        }

    # -- names and shapes ---------------------------------------------------------------------------------

    def _names(self, module: _Module, suffix: str, num_heads: int) -> list[str]:
        if module.per_head:
            return [f"{module.path.replace(HEAD, str(h))}.{suffix}" for h in range(num_heads)]
        return [f"{module.path}.{suffix}"]

    def inputs(self, available: Collection[str]) -> list[str]:
        """Names of this layer's K/V-indexed tensors present in `available`, in a fixed order.

        Raises:
            UserError: a K/V projection weight is missing, or a per-head norm lacks some heads.
        """
        names = []
        for module in self._modules:
            for suffix in SUFFIXES:
                wanted = self._names(module, suffix, self.geometry.num_kv_heads)
                present = [n for n in wanted if n in available]
                if suffix == "weight" and module.part != "k_norm" and not present:
                    raise UserError(
                        f"the checkpoint has no tensor {wanted[0]!r}, which config.json implies; "
                        "check that the weights and config.json belong to the same model"
                    )
                if present and len(present) != len(wanted):
                    missing = sorted(set(wanted) - set(present))
                    raise UserError(f"the checkpoint lacks {missing[0]!r} (one per K/V head); it is incomplete")
                names += present
        return names

    def outputs(self, inputs: list[str], num_kv_heads: int) -> list[str]:
        """Names this layer has with `num_kv_heads` heads, given its input names."""
        keep = set()
        for module in self._modules:
            for suffix in SUFFIXES:
                keep.update(self._names(module, suffix, num_kv_heads))
        return [name for name in inputs if name in keep]

    def output_shape(self, name: str, shape: tuple[int, ...], num_kv_heads: int) -> tuple[int, ...]:
        """Shape of output tensor `name`, given the shape of the input of the same name.

        Raises:
            UserError: the input's shape disagrees with the geometry in config.json.
        """
        module = self._module_of[name]
        if module.per_head:
            expected_in, out = (self.geometry.head_dim,), shape
        else:
            expected_in = (self._rows(module, self.geometry.num_kv_heads),)
            out = (self._rows(module, num_kv_heads), *shape[1:])
        if tuple(shape[:1]) != expected_in:
            raise UserError(
                f"tensor {name!r} has shape {list(shape)}, but config.json implies {expected_in[0]} rows; "
                "check that the weights and config.json belong to the same model"
            )
        return out

    def _rows(self, module: _Module, num_kv_heads: int) -> int:
        g = self.geometry
        fused_q = g.num_heads * g.head_dim if module.part == "qkv" else 0
        kv_parts = 2 if module.part == "qkv" else 1  # fused rows hold K heads and V heads
        return fused_q + kv_parts * num_kv_heads * g.head_dim

    # -- tensors ------------------------------------------------------------------------------------------

    def split(self, tensors: Mapping[str, torch.Tensor]) -> tuple[Heads, Heads]:
        """Cut this layer's input tensors into head-major float32 heads.

        Returns:
            (heads, carry): heads keyed as in the module docstring; carry holds what conversion leaves
            alone (a fused projection's query rows), keyed by suffix.
        """
        g = self.geometry
        heads: Heads = {}
        carry: Heads = {}
        for module in self._modules:
            for suffix in SUFFIXES:
                names = self._names(module, suffix, g.num_kv_heads)
                if names[0] not in tensors:
                    continue
                if module.per_head:  # KV tensors (d,) -> (KV, d)
                    heads[f"{module.part}.{suffix}"] = torch.stack([tensors[n].float() for n in names])
                    continue
                rows = tensors[names[0]].float()
                if module.part == "qkv":  # ((H + 2*KV)*d, ...) -> (H*d, ...), (KV*d, ...), (KV*d, ...)
                    q, k, v = _split_fused(rows, g)
                    carry[suffix] = q
                    parts = {"k": k, "v": v}
                else:
                    parts = {module.part: rows}
                for part, t in parts.items():  # (KV*d, *rest) -> (KV, d, *rest)
                    heads[f"{part}.{suffix}"] = t.reshape(g.num_kv_heads, g.head_dim, *t.shape[1:])
        return heads, carry

    def join(self, heads: Heads, carry: Heads, num_kv_heads: int) -> dict[str, torch.Tensor]:
        """Inverse of `split` for a layer with `num_kv_heads` heads; float32 tensors keyed by output name."""
        out: dict[str, torch.Tensor] = {}
        for module in self._modules:
            for suffix in SUFFIXES:
                key = f"{module.part}.{suffix}"
                if module.part == "qkv":
                    if suffix not in carry:
                        continue
                    # (G, d, *rest) -> (G*d, *rest), then rows [Q | K | V]
                    k, v = (heads[f"{p}.{suffix}"].flatten(0, 1) for p in ("k", "v"))
                    out[f"{module.path}.{suffix}"] = torch.cat([carry[suffix], k, v])
                    continue
                if key not in heads:
                    continue
                t = heads[key]
                if t.shape[0] != num_kv_heads:
                    raise ValueError(f"{key}: expected {num_kv_heads} heads, got {t.shape[0]}")
                names = self._names(module, suffix, num_kv_heads)
                if module.per_head:  # (G, d) -> G tensors (d,)
                    out.update(zip(names, t.unbind(0), strict=True))
                else:  # (G, d, *rest) -> (G*d, *rest)
                    out[names[0]] = t.flatten(0, 1)
        return out


def _split_fused(rows: torch.Tensor, g: Geometry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused QKV rows ((H + 2*KV)*d, ...) -> Q (H*d, ...), K (KV*d, ...), V (KV*d, ...)."""
    kv_rows = g.num_kv_heads * g.head_dim
    q, k, v = rows.split([g.num_heads * g.head_dim, kv_rows, kv_rows])
    return q, k, v
