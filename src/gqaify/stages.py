"""Every command's settings, in one place (`Stage`s, lowest stage first).

`gqaify.settings` is below the commands, so each command's entry hands it these, for naming whose settings a
--config file holds when they are not the command's own (`gqaify eval --config OUT/gqaify.json`: "is a
conversion record, not eval's; use `gqaify convert --config ...`").
"""

from __future__ import annotations

from gqaify.conversion.options import CONVERT
from gqaify.eval.settings import EVAL
from gqaify.generation.settings import GENERATE
from gqaify.uptrain.settings import UPTRAIN

STAGES = (CONVERT, EVAL, GENERATE, UPTRAIN)
