"""Cut one layer's head-indexed checkpoint tensors into heads, and put them back together.

Conversion methods see one layer as an `Attention`: two dicts of head-major float32 tensors, whatever the
architecture stores on disk (see `archs.py`). `kv` holds what is indexed by K/V head, the tensors a method
pools from KV heads to G:

    "k.weight" (KV, d, hidden)     "k.bias" (KV, d)
    "v.weight" (KV, d, hidden)     "v.bias" (KV, d)
    "k_norm.weight" (KV, d)        "k_norm.bias" (KV, d)

`queries` holds what is indexed by query head; methods may rewrite it but keep its H heads:

    "q.weight" (H, d, hidden)      "q.bias" (H, d)
    "o.weight" (H, hidden, d)      o_proj's columns of each head
    "q_norm.weight" (H, d)         "q_norm.bias" (H, d)

Row r of a projection (column r of o_proj) belongs to head r // d, the order `repeat_kv` assumes. A fused
QKV projection's rows are cut as its `qkv_layout` says (`archs.py`), and its query rows are always in
`queries`; the separate q_proj, o_proj and Q norms only when the layout is built `with_queries` (otherwise
they are copied through unread). Weights stored transposed (`transposed`, GPT-2's Conv1D) are turned to
(out, in) on `split` and back on `join`.

Where RoPE pairs a head's dimensions other than as rotate_half does (an architecture's `rope`), the layout
built with the `rotary_dim` reorders each Q and K head's dimensions into rotate_half pairs on `split`, and back
on `join`: methods only ever see rotate_half heads.

Every output tensor name is also an input tensor name (a layer with G heads has a subset of the names of a
layer with KV heads), so an output keeps the dtype of the input of the same name.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch

from gqaify.errors import UserError
from gqaify.model.archs import HEAD, ArchSpec
from gqaify.model.geometry import Geometry

SUFFIXES = ("weight", "bias")
Heads = dict[str, torch.Tensor]


@dataclass
class Attention:
    """One layer's head-indexed tensors, head-major float32 (keys as in the module docstring)."""

    kv: Heads
    queries: Heads = field(default_factory=dict)


@dataclass(frozen=True)
class _Module:
    part: str  # "k", "v", "k_norm", "q", "q_norm", "o", or "qkv" (fused: query rows, then K, then V)
    path: str  # full module path; per-head modules contain {head}
    indexed_by: str = "kv"  # "kv" or "q": which head count indexes it
    per_head: bool = False
    required: bool = True  # its weight must be in the checkpoint

    @property
    def columns(self) -> bool:  # o_proj: heads index columns, and only the weight is per head
        return self.part == "o"


class LayerLayout:
    """The head-indexed tensors of attention layer `layer` of a checkpoint."""

    def __init__(
        self, spec: ArchSpec, geometry: Geometry, layer: int, with_queries: bool = False, rotary_dim: int | None = None
    ):
        self.geometry = geometry
        self.layer = layer
        self.qkv_layout = spec.qkv_layout
        self.transposed = spec.transposed
        order = spec.rope_order(geometry.head_dim, rotary_dim) if rotary_dim else None
        self._rope_order = None if order is None else torch.tensor(order)

        def module(part, name, indexed_by="kv", per_head=False, required=True):
            return _Module(part, spec.module(layer, name), indexed_by, per_head, required)

        if spec.qkv_proj:
            modules = [module("qkv", spec.qkv_proj)]
        else:
            modules = [module("k", spec.k_proj), module("v", spec.v_proj)]
            if with_queries:
                modules.append(module("q", spec.q_proj, "q"))
        if spec.k_norm or spec.k_norm_per_head:
            modules.append(
                module("k_norm", spec.k_norm or spec.k_norm_per_head, "kv", bool(spec.k_norm_per_head), False)
            )
        if with_queries:
            modules.append(module("o", spec.o_proj, "q"))
            if spec.q_norm or spec.q_norm_per_head:
                per_head = bool(spec.q_norm_per_head)
                modules.append(module("q_norm", spec.q_norm or spec.q_norm_per_head, "q", per_head, False))
        self._modules = modules
        self._module_of = {  # every tensor name this layer may have -> its module
            name: m for m in modules for suffix in SUFFIXES for name in self._names(m, suffix, self._count(m))
        }

    # -- names and shapes ---------------------------------------------------------------------------------

    def _count(self, module: _Module, num_kv_heads: int | None = None) -> int:
        """Heads indexing `module` in a layer with `num_kv_heads` K/V heads (default: the source's)."""
        if module.indexed_by == "q":
            return self.geometry.num_heads
        return self.geometry.num_kv_heads if num_kv_heads is None else num_kv_heads

    def _names(self, module: _Module, suffix: str, num_heads: int) -> list[str]:
        if module.per_head:
            return [f"{module.path.replace(HEAD, str(h))}.{suffix}" for h in range(num_heads)]
        return [f"{module.path}.{suffix}"]

    def inputs(self, available: Collection[str]) -> list[str]:
        """Names of this layer's head-indexed tensors present in `available`, in a fixed order.

        Raises:
            UserError: a projection weight is missing, or a per-head norm lacks some heads.
        """
        names = []
        for module in self._modules:
            for suffix in ("weight",) if module.columns else SUFFIXES:
                wanted = self._names(module, suffix, self._count(module))
                present = [n for n in wanted if n in available]
                if suffix == "weight" and module.required and not present:
                    raise UserError(
                        f"the checkpoint has no tensor {wanted[0]!r}, which config.json implies; "
                        "check that the weights and config.json belong to the same model"
                    )
                if present and len(present) != len(wanted):
                    missing = sorted(set(wanted) - set(present))
                    raise UserError(f"the checkpoint lacks {missing[0]!r} (one per head); it is incomplete")
                names += present
        return names

    def has_qk_norms(self, inputs: list[str]) -> bool:
        """Whether any of this layer's `inputs` is a Q or K norm (acting between projection and RoPE)."""
        return any(self._module_of[name].part in ("k_norm", "q_norm") for name in inputs)

    def outputs(self, inputs: list[str], num_kv_heads: int) -> list[str]:
        """Names this layer has with `num_kv_heads` heads, given its input names."""
        keep = set()
        for module in self._modules:
            for suffix in SUFFIXES:
                keep.update(self._names(module, suffix, self._count(module, num_kv_heads)))
        return [name for name in inputs if name in keep]

    def output_shape(self, name: str, shape: tuple[int, ...], num_kv_heads: int) -> tuple[int, ...]:
        """Shape of output tensor `name`, given the shape of the input of the same name.

        Raises:
            UserError: the input's shape disagrees with the geometry in config.json.
        """
        module = self._module_of[name]
        axis = 1 if module.columns else 0
        if self.transposed and len(shape) == 2:
            axis = 1 - axis
        if module.per_head:
            expected_in, out = self.geometry.head_dim, shape
        else:
            expected_in = self._rows(module, self.geometry.num_kv_heads)
            out = (*shape[:axis], self._rows(module, num_kv_heads), *shape[axis + 1 :])
        if len(shape) <= axis or shape[axis] != expected_in:
            raise UserError(
                f"tensor {name!r} has shape {list(shape)}, but config.json implies {expected_in} "
                f"{'columns' if axis else 'rows'}; check that the weights and config.json belong to the same model"
            )
        return out

    def _rows(self, module: _Module, num_kv_heads: int) -> int:
        g = self.geometry
        if module.part == "qkv":  # rows [Q heads | K heads | V heads]
            return (g.num_heads + 2 * num_kv_heads) * g.head_dim
        return self._count(module, num_kv_heads) * g.head_dim

    # -- tensors ------------------------------------------------------------------------------------------

    def split(self, tensors: Mapping[str, torch.Tensor]) -> Attention:
        """Cut this layer's input tensors into head-major float32 heads."""
        g = self.geometry
        attn = Attention({}, {})
        for module in self._modules:
            for suffix in SUFFIXES:
                names = self._names(module, suffix, self._count(module))
                if names[0] not in tensors:
                    continue
                if module.per_head:  # n tensors (d,) -> (n, d)
                    heads = attn.queries if module.indexed_by == "q" else attn.kv
                    heads[f"{module.part}.{suffix}"] = torch.stack([tensors[n].float() for n in names])
                    continue
                t = tensors[names[0]].float()
                if self.transposed and t.dim() == 2:  # stored (in, out) -> (out, in)
                    t = t.T
                if module.columns:  # (hidden, H*d) -> (H, hidden, d)
                    attn.queries["o.weight"] = t.unflatten(1, (g.num_heads, g.head_dim)).transpose(0, 1)
                    continue
                parts = dict(zip("qkv", self._unfuse(t), strict=True)) if module.part == "qkv" else {module.part: t}
                for part, rows in parts.items():  # (n*d, *rest) -> (n, d, *rest)
                    heads = attn.queries if part in ("q", "q_norm") else attn.kv
                    heads[f"{part}.{suffix}"] = rows.unflatten(0, (-1, g.head_dim))
        return self._reorder(attn, self._rope_order)

    def _unfuse(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A fused projection's rows ((H + 2*KV)*d, *rest) -> the rows of Q (H*d), K (KV*d) and V (KV*d)."""
        g = self.geometry
        if self.qkv_layout == "contiguous":
            kv_rows = g.num_kv_heads * g.head_dim
            return t.split([g.num_heads * g.head_dim, kv_rows, kv_rows])
        # grouped: (KV*(r + 2)*d, *rest) -> (KV, r + 2, d, *rest), r queries, then K, then V per K/V head
        grouped = t.unflatten(0, (g.num_kv_heads, g.queries_per_kv_head + 2, g.head_dim))
        return grouped[:, :-2].flatten(0, 2), grouped[:, -2].flatten(0, 1), grouped[:, -1].flatten(0, 1)

    def _fuse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Inverse of `_unfuse` for heads (n, d, *rest): q of H heads, k and v of any G dividing H."""
        if self.qkv_layout == "contiguous":
            return torch.cat([q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)])
        groups = k.shape[0]  # (H, d, *rest) -> (G, H/G, d, *rest), then K and V after each group's queries
        return torch.cat([q.unflatten(0, (groups, -1)), k[:, None], v[:, None]], dim=1).flatten(0, 2)

    def _reorder(self, attn: Attention, order: torch.Tensor | None) -> Attention:
        """`attn` with the dimensions of every Q and K head (norms included) taken in `order`."""
        if order is None:
            return attn
        rotated = ("q", "k", "q_norm", "k_norm")
        return Attention(
            *(
                {k: t[:, order] if k.split(".")[0] in rotated else t for k, t in heads.items()}
                for heads in (attn.kv, attn.queries)
            )
        )

    def join(self, attn: Attention, num_kv_heads: int) -> dict[str, torch.Tensor]:
        """Inverse of `split` for a layer with `num_kv_heads` heads; float32 tensors keyed by output name."""
        attn = self._reorder(attn, None if self._rope_order is None else torch.argsort(self._rope_order))
        out: dict[str, torch.Tensor] = {}
        for module in self._modules:
            heads = attn.queries if module.indexed_by == "q" else attn.kv
            for suffix in SUFFIXES:
                if module.part == "qkv":
                    if f"k.{suffix}" in attn.kv:  # (n, d, *rest) -> rows as the layout has them
                        q, k, v = attn.queries[f"q.{suffix}"], attn.kv[f"k.{suffix}"], attn.kv[f"v.{suffix}"]
                        out[f"{module.path}.{suffix}"] = self._stored(self._fuse(q, k, v))
                    continue
                key = f"{module.part}.{suffix}"
                if key not in heads:
                    continue
                t = heads[key]
                count = self._count(module, num_kv_heads)
                if t.shape[0] != count:
                    raise ValueError(f"{key}: expected {count} heads, got {t.shape[0]}")
                names = self._names(module, suffix, count)
                if module.per_head:  # (n, d) -> n tensors (d,)
                    out.update(zip(names, t.unbind(0), strict=True))
                elif module.columns:  # (H, hidden, d) -> (hidden, H*d)
                    out[names[0]] = self._stored(t.transpose(0, 1).flatten(1, 2))
                else:  # (n, d, *rest) -> (n*d, *rest)
                    out[names[0]] = self._stored(t.flatten(0, 1))
        return out

    def _stored(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor as the checkpoint stores it: weight matrices back to (in, out) when `transposed`."""
        return t.T.contiguous() if self.transposed and t.dim() == 2 else t
