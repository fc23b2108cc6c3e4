"""The settings fields several stages share, each declared once, in a small dataclass the stages' settings inherit.

    Out, Output        out (required), and force: what --force may replace is the stage's (convert, eval; generate
                       resumes, so it takes out alone)
    Runtime            device, dtype, trust_remote_code, progress (eval, generate); Dtype, TrustRemoteCode and
                       Progress alone where a stage takes only those (convert: dtype, progress; uptrain:
                       trust_remote_code, progress)
    Seed               seed, within what the generators take (convert, generate, uptrain)
    Hub                push_to_hub (convert, uptrain)

The calibration's fields are the conversion's `MethodSettings` (conversion/settings.py), which convert and uptrain
inherit. A text a stage reads (its sources, weights, split and column) is a `FieldTemplate` each stage places under
names of its own (`gqaify.text.settings.Texts`: calib_data, data, score_data, eval_data), not a group: the names
differ. A stage words a shared field for itself, or gives it another default, with `override` (`gqaify.settings`):
its type and rules stay declared here.
"""

from __future__ import annotations

from dataclasses import dataclass

from gqaify.auto import AUTO
from gqaify.model.dtypes import DtypeName
from gqaify.model.hub import repo_id_problem
from gqaify.settings import SEED, FieldGroup, setting


@dataclass(frozen=True)
class Out(FieldGroup):
    """Where the stage writes."""

    shared = True

    out: str | None = setting(None, "the folder to write", required=True)


@dataclass(frozen=True)
class Output(Out):
    """Where the stage writes, and whether it may replace what is there."""

    shared = True

    force: bool = setting(False, "replace OUT if it is empty or what this command wrote (nothing else)")


@dataclass(frozen=True)
class Device(FieldGroup):
    """Where the model runs."""

    shared = True

    device: str = setting(AUTO, "auto, cpu, cuda or cuda:N")


@dataclass(frozen=True)
class Dtype(FieldGroup):
    """The dtype of the model's weights."""

    shared = True

    dtype: DtypeName = setting(AUTO, "model dtype (auto: the config's)")


@dataclass(frozen=True)
class TrustRemoteCode(FieldGroup):
    """Whether a model folder's own modeling code runs."""

    shared = True

    trust_remote_code: bool = setting(
        False, "run the modeling code a model folder carries (gqaify writes it for GPT-2, GPT-NeoX, OPT)"
    )


@dataclass(frozen=True)
class Progress(FieldGroup):
    """Whether progress bars show."""

    shared = True

    progress: bool = setting(True, "show a progress bar")


@dataclass(frozen=True)
class Runtime(Progress, TrustRemoteCode, Device, Dtype):
    """How the models load and run: device, dtype, trust_remote_code, progress."""

    shared = True


@dataclass(frozen=True)
class Seed(FieldGroup):
    """The seed of what is random."""

    shared = True

    seed: int = setting(0, "seed: the same seed and settings give the same result", check=SEED)


@dataclass(frozen=True)
class Hub(FieldGroup):
    """Where the result is uploaded."""

    shared = True

    push_to_hub: str | None = setting(
        None, "upload OUT, once complete, to this hub repository (owner/name)", check=repo_id_problem
    )
