"""Downstream task accuracy through EleutherAI's lm-evaluation-harness, on models gqaify has already loaded.

    harness = Harness(TaskRequest(("hellaswag", "arc_easy"), limit=200))   # checks the names and datasets
    scores = harness.score(model, tokenizer)                                # one model: list of TaskScore

The harness's own Hugging Face wrapper (`HFLM`) is put around the model object gqaify loaded, so a task sees
the same weights, device and dtype, and the same logits, as `gqaify eval`'s perplexity. Any task the harness
knows works (its registry, or task YAMLs in `include_path`). Every task is loaded once up front, so that an
unknown name or a dataset the hub cannot give is refused before any model is evaluated. Where the hub does not
answer, datasets come from `datasets`' cache alone (`gqaify.model.hub.offline_unless_reachable`): one line at once,
not retries. A task YAML that does not parse, which the harness skips without a word, is named.

lm-eval is an optional extra (`pip install 'gqaify[tasks]'`): it is imported here, when tasks are asked for.
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

from gqaify.errors import UserError, one_line
from gqaify.eval.results import TaskScore
from gqaify.logs import muted
from gqaify.model.hub import offline_unless_reachable

EXTRA = "pip install 'gqaify[tasks]'"
_GLOB = set("*?[")


# How `gqaify eval` names the request's parts; uptraining names them eval_tasks, eval_limit, ...
EVAL_FLAGS = {"names": "--tasks", "num_fewshot": "--num-fewshot", "limit": "--limit", "include_path": "--include-path"}


@dataclass(frozen=True)
class TaskRequest:
    """Which tasks to score, and how: the harness's own knobs, under the harness's names."""

    names: tuple[str, ...]  # registered names (tasks, groups, tags), glob patterns, or task YAML paths; () for none
    num_fewshot: int | None = None  # None: each task's own default
    limit: float | None = None  # items per task (a fraction below 1); None: all
    include_path: str | None = None  # a folder of local task YAMLs
    batch_size: int = 1
    flags: dict[str, str] = field(default_factory=lambda: dict(EVAL_FLAGS))  # how the user names each part

    @classmethod
    def of(cls, names: list[str], **knobs) -> TaskRequest:
        """A request from names as a user gives them: a list whose items may be comma-separated."""
        return cls(tuple(n.strip() for item in names for n in item.split(",") if n.strip()), **knobs)

    def problems(self) -> list[str]:
        """What is wrong with the knobs, without importing the harness: a knob set without tasks, or out of range."""
        flags = self.flags
        if not self.names:
            knobs = [k for k in ("num_fewshot", "limit", "include_path") if getattr(self, k) is not None]
            return [f"{flags[k]} applies to {flags['names']}; give {flags['names']} or leave it out" for k in knobs]
        problems = []
        if self.limit is not None and not self.limit > 0:  # nan too
            problems.append(f"{flags['limit']} {self.limit:g} must be above 0 (items per task, or a fraction below 1)")
        elif self.limit is not None and self.limit >= 1 and not float(self.limit).is_integer():
            problems.append(
                f"{flags['limit']} {self.limit:g} is neither a whole number of items per task nor a "
                "fraction below 1; give e.g. 200 (items) or 0.5 (half of each task)"
            )
        if self.num_fewshot is not None and self.num_fewshot < 0:
            problems.append(f"{flags['num_fewshot']} {self.num_fewshot} must be 0 or more")
        if self.include_path and not Path(self.include_path).expanduser().is_dir():
            problems.append(f"{flags['include_path']} {self.include_path} is not a folder; give a folder of task YAMLs")
        return problems


class Harness:
    """The tasks of one request, checked, ready to score any number of models the same way."""

    def __init__(self, request: TaskRequest):
        """
        Raises:
            UserError: lm-eval is not installed; no task named; a name the harness does not know (with the
                nearest ones); a task whose dataset cannot be read (the hub unreachable, a broken local task).
        """
        self.request, self.flag, self.include_flag = request, request.flags["names"], request.flags["include_path"]
        try:
            from lm_eval.tasks import TaskManager
        except ImportError as exc:
            raise UserError(f"{self.flag} needs lm-evaluation-harness, which is not installed; {EXTRA}") from exc
        if not request.names:
            raise UserError(f"{self.flag} names no task; give task names, e.g. {self.flag} hellaswag,arc_easy")
        # the harness's warnings are meant for its own command line; its errors still reach the user
        with muted("lm_eval"), offline_unless_reachable() as self.unreachable:
            include = str(Path(request.include_path).expanduser()) if request.include_path else None
            self.manager = TaskManager(include_path=include)
            self.names = self._resolve(request.names)
            for name in self.names:
                self._load(name)

    def _resolve(self, names: tuple[str, ...]) -> list[str]:
        """Registered names as given, glob patterns expanded, YAML paths kept; unknown names refused."""
        known, resolved, unknown = self.manager.all_tasks, [], []
        for name in names:
            if name in self.manager.task_index or Path(name).suffix in (".yaml", ".yml") and Path(name).is_file():
                resolved.append(name)
            elif _GLOB & set(name) and (matched := fnmatch.filter(known, name)):
                resolved += matched
            else:
                unknown.append(name)
        if unknown:
            raise self._unknown(unknown[0], known)
        return list(dict.fromkeys(resolved))

    def _unknown(self, name: str, known: list[str]) -> UserError:
        """The error for a task name the harness does not know: a task file that could not be read where the
        include path has one (the file named like the task first), else the nearest known names."""
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        nearest = f" (nearest: {', '.join(close)})" if close else ""
        if broken := _broken_task_files(self.request.include_path):
            path = next((p for p in broken if p.stem == name), next(iter(broken)))
            others = f" (and {len(broken) - 1} other file(s))" if len(broken) > 1 else ""
            return UserError(
                f"{self.flag}: unknown task {name!r}{'' if path.stem == name else nearest}; {path} in "
                f"{self.include_flag} could not be read ({broken[path]}){others}, so the harness skipped it: fix it"
            )
        where = f"; give a local task's folder with {self.include_flag}" if not self.request.include_path else ""
        return UserError(
            f"{self.flag}: unknown task {name!r}{nearest}; `lm-eval ls tasks` lists the harness's tasks{where}"
        )

    def _load(self, name: str) -> None:
        """Build the task once: it reads its dataset, which is where a missing dataset shows."""
        try:
            self.manager.load([name])
        except ConnectionError as exc:  # datasets' "Couldn't reach ... on the Hub", offline or not
            dataset = self.manager.task_index.get(name)
            dataset = (dataset.cfg or {}).get("dataset_path", "its dataset") if dataset else "its dataset"
            why = f" ({self.unreachable})" if self.unreachable else ""
            raise UserError(
                f"{self.flag}: task {name} needs {dataset} from the Hugging Face hub, which could not be reached"
                f"{why}; run it once where the hub is reachable (datasets keeps a copy), or give a local task with "
                f"{self.include_flag} DIR"
            ) from exc
        except Exception as exc:  # a task YAML or its dataset loader is the user's input, not gqaify's
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise UserError(
                f"{self.flag}: task {name} could not be loaded ({type(exc).__name__}: {first_line}); "
                "check the task's YAML and its dataset"
            ) from exc

    def score(self, model, tokenizer) -> list[TaskScore]:
        """Every metric of every task (and group) for `model`, in the harness's order."""
        from lm_eval import simple_evaluate

        was_training = model.training
        try:
            with muted("lm_eval"), offline_unless_reachable():  # the tasks read their datasets again
                results = simple_evaluate(
                    model=harness_model(model, tokenizer, self.request.batch_size),
                    tasks=self.names,
                    num_fewshot=self.request.num_fewshot,
                    limit=self.request.limit,
                    task_manager=self.manager,
                    log_samples=False,
                )
        finally:
            model.train(was_training)
        return [] if results is None else scores_of(results)  # None: a process other than the launch's first


def harness_model(model, tokenizer, batch_size: int = 1):
    """The harness's HF model (`HFLM`) around `model`, already on its device and in its dtype: the one wrapper
    gqaify puts around a model for the harness.

    The harness gets a copy of the tokenizer: it sets a padding token on the one it is given, which would
    otherwise change the tokenizer a caller goes on to use or save.
    """
    from lm_eval.models.huggingface import HFLM

    with muted("lm_eval"):
        return HFLM(pretrained=model, tokenizer=copy.deepcopy(tokenizer), batch_size=batch_size)


def _broken_task_files(include_path: str | None) -> dict[Path, str]:
    """The task YAMLs under `include_path` that cannot be read (the harness skips them without a word), each
    with its problem on one line."""
    if not include_path:
        return {}
    import yaml
    from lm_eval.tasks._yaml_loader import load_yaml

    broken = {}
    for path in sorted(Path(include_path).expanduser().glob("**/*.yaml")):  # the files the harness reads
        if "__pycache__" in path.parts or ".ipynb_checkpoints" in path.parts:
            continue
        try:
            load_yaml(path, resolve_func=False)
        except (yaml.YAMLError, ValueError, OSError) as exc:
            broken[path] = _yaml_problem(exc)
    return broken


def _yaml_problem(exc: BaseException) -> str:
    """ "line 3, column 7: mapping values are not allowed here": where and what, on one line."""
    import yaml

    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"line {mark.line + 1}, column {mark.column + 1}: {exc.problem}"
    return one_line(exc)


def scores_of(results: dict) -> list[TaskScore]:
    """The harness's results dict as rows: "acc,none": 0.61 and "acc_stderr,none": 0.01 become one TaskScore."""
    scores = []
    for task, metrics in results["results"].items():
        n = results.get("n-samples", {}).get(task, {}).get("effective")
        for key, value in metrics.items():
            metric, _, filter_ = key.partition(",")
            if not filter_ or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filter_}")
            scores.append(
                TaskScore(
                    task, metric, filter_, float(value), float(stderr) if isinstance(stderr, (int, float)) else None, n
                )
            )
    return scores


def headlines(models: list) -> list[dict[str, TaskScore]]:
    """Each of `models`' (`results.ModelReport`) headline score per task (`headline`), in their order."""
    return [headline(m.tasks or []) for m in models]


def headline(scores: list[TaskScore]) -> dict[str, TaskScore]:
    """One score per task for plots and logs: acc_norm where the task has it, else acc, else its first metric."""
    by_task: dict[str, list[TaskScore]] = {}
    for s in scores:
        by_task.setdefault(s.task, []).append(s)
    order = {"acc_norm": 0, "acc": 1}
    return {task: min(rows, key=lambda s: order.get(s.metric, 2)) for task, rows in by_task.items()}
