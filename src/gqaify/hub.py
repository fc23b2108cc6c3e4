"""Publishing a finished output folder to the Hugging Face hub: one commit of the whole folder, or nothing.

Only a complete folder is pushed (a conversion's OUT after its atomic rename), in a single commit through
`HfApi.upload_folder`, so the repository never holds part of a model. A push that fails leaves the local
folder as it is, complete, and says how to push it again.
"""

from __future__ import annotations

import logging
from pathlib import Path

from gqaify.errors import UserError

LOG = logging.getLogger(__name__)


def repo_id_problem(repo_id: str, option: str = "--push-to-hub") -> str | None:
    """A one-line problem if `repo_id` is not a valid hub repository id (owner/name), else None."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return f"{option} {repo_id!r} is not a hub repository id; write it as owner/name, e.g. you/llama-gqa8"
    return None


def push_folder(folder: Path, repo_id: str, message: str, private: bool | None = None) -> str:
    """Create `repo_id` if needed and upload `folder` to it in one commit; the commit's URL.

    Raises:
        UserError: the hub refused (no token, no rights, no network); `folder` is left as it is.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model", commit_message=message)
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise UserError(
            f"the push to {repo_id} failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            f"{folder} is complete: log in (`hf auth login`) and push it with `hf upload {repo_id} {folder}`"
        ) from exc
    LOG.info("pushed %s to %s", folder, repo_id)
    return str(getattr(commit, "commit_url", commit))
