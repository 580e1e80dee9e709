"""Tokenizers fetched by model id from the Hugging Face Hub (PyPI `huggingface_hub`).

Only the tokenizer's files are downloaded (`tokenizer.json`, `tokenizer_config.json`,
`chat_template.jinja`/`.json`, `special_tokens_map.json`), into the Hub's cache
layout under `cache_dir` (a volume shared by replicas works; files already there
are used without a download). `offline=True` uses the cache only.

Everything else is the Hub client's own, read from its environment when it is first
imported, exactly as vLLM and `huggingface-cli` read it: `HF_HUB_OFFLINE=1` (the
cache only, like `offline=True`), `HF_HOME` and `HF_HUB_CACHE` (the cache when
`cache_dir` is not given), `HF_ENDPOINT` (a mirror), `HF_TOKEN` or the token file
(gated models; the EPP never handles the token). None of it is re-implemented here.

The download is blocking I/O: callers run it in a worker thread, never on the event
loop.
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
    """The tokenizer could not be fetched. `retryable`: trying again later may work
    (the Hub was unreachable, the repository not found or gated yet); not when the
    Hub is off (the cache will not change by itself) or the name is no model id."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def fetch_tokenizer(
    repo_id: str,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    offline: bool = False,
) -> Path:
    """The local directory holding `repo_id`'s tokenizer files (downloading them
    unless `offline` or `HF_HUB_OFFLINE`). Raises `HubFetchError`."""
    # Imported here: the import reads the Hub's environment and costs a few hundred
    # milliseconds, which only a process that fetches should pay (in this thread).
    from huggingface_hub import is_offline_mode, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    offline = offline or is_offline_mode()
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(cache_dir) if cache_dir is not None else None,
            allow_patterns=TOKENIZER_FILES,
            local_files_only=offline,
        )
    except HFValidationError as exc:
        raise HubFetchError(f"{repo_id!r} is not a Hub model id: {exc}", retryable=False) from exc
    except LocalEntryNotFoundError as exc:
        where = "the cache (offline)" if offline else "the cache, and the Hub cannot be reached"
        raise HubFetchError(f"{repo_id}: not in {where}: {exc}", retryable=not offline) from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise HubFetchError(
            f"{repo_id}: cannot download the tokenizer: {exc}", retryable=not offline
        ) from exc
    directory = Path(str(path))
    if not (directory / "tokenizer.json").is_file():
        raise HubFetchError(f"{repo_id}: the repository has no tokenizer.json", retryable=False)
    return directory
