"""The settings fields of a text a stage reads, declared once (`Texts`): its sources, a weight per source where
several make a mixture, the split a dataset is read from and the column that holds the text. A stage places them
among its settings under the name of the sources' field, and the others are named after it (`FieldTemplate`):

    calib_data = Texts(...)    calib_data, calib_weights, calib_split, calib_text_column   (convert, uptrain)
    data = Texts(...)          data, data_weights, split, text_column          (uptrain's training text)
    score_data = Texts(...)    score_data, score_weights, score_split, score_text_column   (generate)
    data = Texts(...)          data, split, text_column       (eval's panel: each text reported, so no weights)
    eval_data = Texts(...)     eval_data, eval_split          (uptrain's panel, read in its data's text_column)

The sources' help (what a source is), the weights' rules (`Needs`, `OnePerItem`) and the split's and the column's
help are written here, worded after the sources' field; a stage says what its text is for, what several sources
make, and its defaults. `text.loading` reads the sources.
"""

from __future__ import annotations

from dataclasses import dataclass

from gqaify.settings import FieldTemplate, Needs, OnePerItem, setting
from gqaify.text.loading import named_texts_problem

# What each source of every text may be (`text.loading`), in the sources' help
SOURCE = (
    "a file or folder (.txt .jsonl .parquet .csv) or a hub dataset name[:config][@split], named NAME=SOURCE or by its "
    "file's stem or dataset's name"
)


@dataclass(frozen=True)
class Texts(FieldTemplate):
    """The fields of one text a stage reads, one source or several (a mixture, or a panel), placed under the name of
    its sources' field (`names`)."""

    what: str  # what the text is for, the start of the sources' help: "training text"
    several: str  # what several sources make: "a mixture, their windows interleaved"
    weighs: str | None = None  # what a source's weight is, in a mixture ("its share of calib_tokens"); None: none
    default: tuple[str, ...] | None = ()  # the sources when none are given: none, or None (the field takes None)
    required: bool = False
    split: str = "train"
    column: bool = True  # a text_column of its own (False: the text is in another text's, as uptrain's eval_data)
    column_of: str | None = None  # what the column's help says it holds the text of (None: the sources' field)

    @staticmethod
    def names(data: str) -> dict[str, str]:
        """The fields' names under `data`, the sources' field's, which ends in "data": its prefix starts the others'
        ("calib_data": calib_weights, calib_split, calib_text_column), and without one the weights are data_weights.

        Raises:
            TypeError: `data` does not end in "data".
        """
        if not data.endswith("data"):
            raise TypeError(f"{data} = Texts(...): the sources' field is named NAME_data or data")
        prefix = data.removesuffix("data")
        return {
            "data": data,
            "weights": f"{prefix or 'data_'}weights",
            "split": f"{prefix}split",
            "text_column": f"{prefix}text_column",
        }

    def fields(self, name: str) -> dict:
        names = self.names(name)
        data = names["data"]
        fields = {
            data: (
                list[str] if self.default is not None else list[str] | None,
                setting(
                    None if self.default is None else list(self.default),
                    f"{self.what}: {SOURCE}; several make {self.several}",
                    required=self.required,
                    check=named_texts_problem,
                ),
            )
        }
        if self.weighs is not None:
            fields[names["weights"]] = (
                list[float] | None,
                setting(
                    None,
                    f"one weight per {data} source: {self.weighs} (default: equal)",
                    check=(Needs(data, f"weighs {data} sources"), OnePerItem(data)),
                ),
            )
        fields[names["split"]] = (str, setting(self.split, f"split of {data}"))
        if self.column:
            column = setting("text", f"column of {self.column_of or data} holding the text")
            fields[names["text_column"]] = (str, column)
        return fields
