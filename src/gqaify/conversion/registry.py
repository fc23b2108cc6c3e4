"""Every conversion method and every attention shape gqaify writes, one entry each, as data: what it is (read by
--help before torch is loaded) and where its code lives, by name ("module:NAME"), imported only when asked.

    METHOD_INFO      the methods (`--method`): each names its function in `conversion.methods`
    ATTENTION_INFO   the attention shapes (`--attention`): each names its folder's `Shape`, the record of its rewrite,
                     its own settings and the model classes it writes (`conversion.shapes` imports them)

A new method is one entry here and its function; a new shape is one entry here and its folder under conversion/.
This module imports nothing of gqaify, so that everything may read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MethodInfo:
    """A conversion method, declared once: what it does and needs (read by --help without torch), and the name of
    its function in `conversion.methods` (a pure function of one layer)."""

    function: str
    summary: str  # one line, for --help and the model card
    calibrated: bool = False  # fitted on calibration statistics: needs --calib-data
    folds: bool = False  # also rewrites query rows and o_proj columns
    reference: str | None = None  # the paper it is from (a `papers.PAPERS` key); None: gqaify's own


GQA_PAPER = "2305.13245"  # the GQA paper (`papers.PAPERS`)
METHOD_INFO: dict[str, MethodInfo] = {
    "mean": MethodInfo(
        "mean", "mean-pool every K/V-indexed tensor over each group (the GQA paper)", reference=GQA_PAPER
    ),
    "first": MethodInfo("first", "keep the first head of each group (the GQA paper's ablation)", reference=GQA_PAPER),
    "random": MethodInfo(
        "random", "re-initialise the K/V projections, seeded by --seed (the GQA paper's ablation)", reference=GQA_PAPER
    ),
    "norm-mean": MethodInfo("norm_mean", "mean-pool, then restore each pooled row's norm to the group's mean"),
    "aligned": MethodInfo(
        "aligned",
        "rotate each head onto its group's first head, fold the rotation into its readers, average",
        calibrated=True,
        folds=True,
        reference="2412.20677",  # its idea, aligning heads before merging them; gqaify's rotation is its own fit
    ),
    "lsq": MethodInfo(
        "lsq",
        "fit the shared K/V and each reader's compensation in closed form (least squares)",
        calibrated=True,
        folds=True,
    ),
}


@dataclass(frozen=True)
class ShapeInfo:
    """An attention shape a conversion can write, declared once: what it is (read by --help without torch), and, by
    name ("module:NAME", imported when asked), its `conversion.shape_contract.Shape`, what its rewrite records, its
    own settings and the model classes it writes."""

    summary: str  # one line, for --help
    title: str  # what the tool's description calls it: "grouped-query attention (GQA, MQA)"
    label: str  # what a report calls a cache of it that is not whole K/V heads, before the values it holds
    shape: str  # "module:NAME" of its `Shape`
    record: str | None = None  # "module:Class" of what its rewrite records (None: it rewrites nothing)
    settings: str | None = None  # "module:Class" of its own fields, a `Settings` every conversion's settings inherit
    writes: str | None = None  # "module:NAME" of the model classes it writes that gqaify converts from none, by
    # model_type: where each one's attention trains (a dict of `model.archs.TrainedAttention`)
    references: tuple[str, ...] = ()  # the papers it is from (`papers.PAPERS` keys)
    any_cut: bool = False  # whether it makes any `--kv-cut`, where whole K/V heads make only their own


# Every attention shape: a new one is one entry here and its folder under conversion/ (`shape_contract`)
ATTENTION_INFO: dict[str, ShapeInfo] = {
    "gqa": ShapeInfo(
        "G whole K/V heads (G = 1 is MQA)",
        "grouped-query attention (GQA, MQA)",
        "GQA",
        "gqaify.conversion.gqa:GQA",
        references=(GQA_PAPER,),
    ),
    "mla": ShapeInfo(
        "DeepSeek-V3's latent attention, rewritten from the G-head model: exact at its cache size, smaller with "
        "kv_rank and rope_dims",
        "latent attention (MLA)",
        "MLA",
        "gqaify.conversion.mla.shape:MLA",
        record="gqaify.conversion.mla.record:MlaRecord",
        settings="gqaify.conversion.mla.settings:LatentSettings",
        writes="gqaify.conversion.mla.written:TRAINED",
        references=("2405.04434", "2502.07864", "2502.14837"),
        any_cut=True,
    ),
}
STREAM_SHAPE = "gqa"  # the shape the stream writes, rewritten by nothing: the default


def shape_titles() -> str:
    """Every shape as the tool's description names it: "grouped-query attention (GQA, MQA) or latent ..."."""
    *rest, last = [info.title for info in ATTENTION_INFO.values()]
    return f"{', '.join(rest)} or {last}" if rest else last
