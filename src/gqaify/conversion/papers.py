"""The papers gqaify's methods and shapes come from (`MethodInfo.reference`, `ShapeInfo.references` in
`conversion.registry`), by arXiv id, as the model card and the docs cite them."""

from __future__ import annotations

PAPERS: dict[str, str] = {
    "2305.13245": "Ainslie et al., GQA: Training Generalized Multi-Query Transformer Models from Multi-Head "
    "Checkpoints (2023)",
    "2412.20677": "Jin et al., Align Attention Heads Before Merging Them: An Effective Way for Converting MHA to GQA "
    "(2024)",
    "2405.04434": "DeepSeek-AI, DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language Model "
    "(2024)",
    "2502.07864": "Meng et al., TransMLA: Multi-Head Latent Attention Is All You Need (2025)",
    "2502.14837": "Ji et al., Towards Economical Inference: Enabling DeepSeek's Multi-Head Latent Attention in Any "
    "Transformer-based LLMs (MHA2MLA, 2025)",
}


def cited(reference: str | None) -> str:
    """A paper as the card cites it: "Ainslie et al., GQA: ... (2023), arXiv:2305.13245"; "" for gqaify's own."""
    return "" if reference is None else f"{PAPERS[reference]}, arXiv:{reference}"
