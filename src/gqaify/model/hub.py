"""The Hugging Face hub: whether it answers, and publishing a finished output folder to it.

Before `datasets` or the harness fetch anything, `offline_unless_reachable` asks the hub once, briefly, whether it
answers; where it does not, the libraries work offline for that call (their caches only), so that a missing
network is one line at once rather than half a minute of retries.

A push sends only a complete folder (a conversion's OUT after its atomic rename), in a single commit through
`HfApi.upload_folder`, so the repository never holds part of a model. A push that fails leaves the local
folder as it is, complete, and says how to push it again.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from gqaify.errors import UserError, one_line
from gqaify.logs import muted

LOG = logging.getLogger(__name__)

PROBE_TIMEOUT = 3.0  # seconds the hub has to answer before it counts as unreachable
_PROBE_MEMORY = 60.0  # seconds an answer is remembered, so that one command asks once
_probed: dict[str, tuple[float, str | None]] = {}  # endpoint -> (when asked, why unreachable or None)


def repo_id_problem(repo_id: str, option: str = "--push-to-hub") -> str | None:
    """A one-line problem if `repo_id` is not a valid hub repository id (owner/name), else None."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return f"{option} {repo_id!r} is not a hub repository id; write it as owner/name, e.g. you/llama-gqa8"
    return None


def unreachable() -> str | None:
    """Why the hub (HF_ENDPOINT) cannot be reached now, e.g. "ConnectError: ...", or None where it answers.

    Offline mode (HF_HUB_OFFLINE) counts as unreachable. Otherwise one HEAD request with a `PROBE_TIMEOUT`
    timeout, through huggingface_hub's own session (its proxies and certificates); any answer, even an error
    status, counts as reachable. The answer is remembered for a minute.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.is_offline_mode():
        return "offline mode is on (HF_HUB_OFFLINE)"
    endpoint = constants.ENDPOINT
    asked, why = _probed.get(endpoint, (-_PROBE_MEMORY, None))
    if time.monotonic() - asked < _PROBE_MEMORY:
        return why
    try:
        get_session().head(endpoint, timeout=PROBE_TIMEOUT)
        why = None
    except Exception as exc:  # noqa: BLE001 (DNS, refused, timeout, TLS, proxy: all mean no answer)
        why = one_line(exc)
    _probed[endpoint] = (time.monotonic(), why)
    return why


@contextlib.contextmanager
def offline_unless_reachable() -> Iterator[str | None]:
    """Within: huggingface_hub and `datasets` offline (caches only, no requests, no retries) where the hub does
    not answer, and their retry warnings silenced. Yields why the hub is unreachable, or None."""
    import datasets.config
    from huggingface_hub import constants

    why = unreachable()
    offline = (constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)
    if why is not None:
        constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        with muted("huggingface_hub"):  # its warnings: a retry per failed request
            yield why
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = offline


def push_folder(folder: Path, repo_id: str, message: str, private: bool | None = None) -> str:
    """Create `repo_id` if needed and upload `folder` to it in one commit; the commit's URL.

    Raises:
        UserError: the hub refused or could not be reached (no token, no rights, no network, a timeout);
            `folder` is left as it is.
    """
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        with muted("huggingface_hub"):  # a warning per retry; the failure itself is the one line below
            api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
            commit = api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model", commit_message=message)
    except Exception as exc:
        if not isinstance(exc, _hub_errors()):
            raise
        raise UserError(
            f"the push to {repo_id} failed ({one_line(exc)}); {folder} is complete: check the network and "
            f"your login (`hf auth login`), then push it with `hf upload {repo_id} {folder}`"
        ) from exc
    LOG.info("pushed %s to %s", folder, repo_id)
    return str(getattr(commit, "commit_url", commit))


def _hub_errors() -> tuple[type[BaseException], ...]:
    """What a hub call raises for the user's environment rather than a bug: the hub's refusals (HfHubHTTPError),
    offline mode, a missing token (OSError subclasses, as are requests' errors), bad values, and the HTTP
    client's own connection errors and timeouts (httpx2's or httpx's, whichever huggingface_hub speaks)."""
    errors: list[type[BaseException]] = [OSError, ValueError]  # OSError: TimeoutError, ConnectionError too
    for client in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError):
            errors.append(importlib.import_module(client).HTTPError)
    return tuple(errors)
