"""One way to configure every stage: a settings dataclass, read from a file and overridden on the command line.

    gqaify convert SRC OUT --kv-heads 2 --method lsq --calib-data calib.txt
    gqaify convert --config convert.yaml --kv-heads 1        the file's values; the command line wins
    gqaify convert --config OUT/gqaify.json --out OUT2       rerun a conversion from its own record

Each stage (`ConvertSettings`, `EvalSettings`, `UptrainSettings`, `GenerateSettings`) is one dataclass. Every field
is a key of a --config file (YAML, or a JSON record gqaify wrote: its "settings"), a `--field value` option
(`--field-name` and `--field_name` alike) and a keyword argument in Python. `build_parser` turns the fields into
options and --help, as transformers' HfArgumentParser would, in a few lines of our own (importing transformers for
it took most of --help's time); a positional argument (convert's SRC OUT, eval's MODEL...) is a second way to give
one field. Unknown keys and options are refused with the nearest name.

A field declares what its values may be beside it, in `setting(...)`: its type (a Literal gives the choices),
whether it is `required`, and the rules a value must meet (`Range`, `Limit`, `Finite`, `Needs`, `Excludes`, or a
function). Two checks, each reporting every problem at once:

    types       when a settings object is made (`Settings.__post_init__`): an object always holds values of its
                fields' types, whether the command line, a file or a Python caller gave them
    problems()  each stage's one list of what is wrong with the values: required fields unset, and every rule
                its fields declare (`Stage.declared_problems`), with the few that read better as code. Each stage
                asks it before any work, with what only the files can tell (is SRC there, can OUT be written,
                does G divide SRC's heads), so that every problem is one message; it keeps what those checks
                parse (a size in bytes, where SRC is) for the work that follows. `parse` checks only the types
                and the required fields, which the stage needs to read the files at all.

A --config file is read with care, as it may come from anyone: at most 1 MiB of YAML (a JSON record, 16 MiB),
no YAML aliases, no deep nesting, and no message shows more than the start of a value.

The package, one idea a module (only the standard library and PyYAML are imported):

    fields.py        `setting(...)`, the `Settings` base and its type check, `override` of an inherited field's
                     default or help, `FieldGroup` (the fields stages share: `gqaify.settings.groups`),
                     `FieldTemplate` (fields each stage places under its own names: `gqaify.text.settings`), helpers
    rules.py         the rules a value must meet (`Range`, `Limit`, `Finite`, `Needs`, `Excludes`, ...)
    stage.py         `Stage`: how one command reads and names its settings; the problems its fields declare
    command_line.py  `parse` and `build_parser`: the options, --config and --help
    files.py         `read_config` and `read_data`: a settings file read with care
"""

from gqaify.settings.command_line import OneLineParser, add_field_option, build_parser, parse, parse_command
from gqaify.settings.fields import (
    FieldGroup,
    FieldTemplate,
    Override,
    Settings,
    current_names,
    defaults,
    field_default,
    ordered_fields,
    override,
    recorded,
    setting,
    shown,
    text_lists,
    type_problems,
)
from gqaify.settings.files import MAX_DEPTH, MAX_JSON_BYTES, MAX_YAML_BYTES, read_config, read_data, read_settings_file
from gqaify.settings.rules import SEED, CountOr, Excludes, Finite, Limit, Needs, OneOf, OnePerItem, Range
from gqaify.settings.stage import QUIET, Context, Option, Positional, Stage, Switch, nearest, required_problems

__all__ = [
    "MAX_DEPTH",
    "MAX_JSON_BYTES",
    "MAX_YAML_BYTES",
    "QUIET",
    "SEED",
    "Context",
    "CountOr",
    "Excludes",
    "FieldGroup",
    "FieldTemplate",
    "Finite",
    "Limit",
    "Needs",
    "OneOf",
    "OnePerItem",
    "Override",
    "OneLineParser",
    "Option",
    "Positional",
    "Range",
    "Settings",
    "Stage",
    "Switch",
    "add_field_option",
    "build_parser",
    "current_names",
    "defaults",
    "field_default",
    "nearest",
    "ordered_fields",
    "override",
    "parse",
    "parse_command",
    "read_config",
    "read_data",
    "read_settings_file",
    "recorded",
    "required_problems",
    "setting",
    "shown",
    "text_lists",
    "type_problems",
]
