"""Tokenizers fetched by model id from the Hugging Face Hub (PyPI `huggingface_hub`).

Only the tokenizer's files are downloaded (`tokenizer.json`, `tokenizer_config.json`,
`chat_template.jinja`/`.json`, `special_tokens_map.json`), into the Hub's cache
layout under `cache_dir` (a volume shared by replicas works; files already there
are used without a download). `offline=True` uses the cache only, as
`HF_HUB_OFFLINE=1` does. A token for gated models comes from the usual place
(`HF_TOKEN` or the Hub's token file); the EPP never handles it.

The download is blocking I/O: callers run it in a worker thread, at start-up, never
on the pick path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

TOKENIZER_FILES: Final = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
]


class HubFetchError(Exception):
    pass


def fetch_tokenizer(
    repo_id: str,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    offline: bool = False,
) -> Path:
    """The local directory holding `repo_id`'s tokenizer files (downloading them
    unless `offline`). Raises `HubFetchError`."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(cache_dir) if cache_dir is not None else None,
            allow_patterns=TOKENIZER_FILES,
            local_files_only=offline,
        )
    except LocalEntryNotFoundError as exc:
        raise HubFetchError(
            f"{repo_id}: not in the cache{' (offline)' if offline else ''}: {exc}"
        ) from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise HubFetchError(f"{repo_id}: cannot download the tokenizer: {exc}") from exc
    directory = Path(str(path))
    if not (directory / "tokenizer.json").is_file():
        raise HubFetchError(f"{repo_id}: the repository has no tokenizer.json")
    return directory
