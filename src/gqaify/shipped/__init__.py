"""Code that leaves with a converted checkpoint: the modeling file for types transformers has no K/V heads for.

`modeling_gqaify.py` is copied into the output folder as it is; it imports only torch and transformers.
"""

from pathlib import Path

SHIPPED_FILE = Path(__file__).with_name("modeling_gqaify.py")
SHIPPED_MODULE = SHIPPED_FILE.stem
