"""`--push-to-hub REPO`: upload a saved model folder (weights, tokenizer, model card, recipe) to the Hugging Face hub.

Checked before any work (offline or a malformed repo id: one line, exit 2); the upload itself is
huggingface_hub's `HfApi.create_repo` + `upload_folder`, with the token from the usual places (HF_TOKEN,
`hf auth login`).
"""

from __future__ import annotations

import re
from pathlib import Path

from llmcompress.errors import UserError

_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def check_push(repo: str | None) -> None:
    """Refuse --push-to-hub before any work when it cannot succeed."""
    if repo is None:
        return
    if not _REPO.fullmatch(repo):
        raise UserError(f"--push-to-hub {repo!r} is not a hub repo id", "use OWNER/NAME, e.g. --push-to-hub me/smollm2-collapsed")
    from llmcompress.data.sources import hub_reachable

    if not hub_reachable():
        raise UserError(
            "--push-to-hub: the hub is unreachable (offline, or HF_HUB_OFFLINE set)",
            "run without --push-to-hub, then upload the saved folder with `hf upload REPO DIR` when online",
        )


def push(folder: Path, repo: str) -> str:
    """Upload `folder` to the model repo `repo` (created when missing); returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo, exist_ok=True)
    info = api.upload_folder(repo_id=repo, folder_path=str(folder), commit_message=f"llmcompress: upload {Path(folder).name}")
    return str(getattr(info, "commit_url", info))
