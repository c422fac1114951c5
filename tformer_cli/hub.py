"""The Hugging Face hub as ``data.py`` reaches it: whether it can be reached at all (a few seconds,
not huggingface_hub's retries), offline mode for a block, the commit a dataset's revision is at, and
what is wrong with a dataset's subset."""

from __future__ import annotations

import os
import re
import socket
from contextlib import contextmanager
from urllib.parse import urlparse


def wrong_subset(name: str, subset: str | None, revision: str | None = None) -> str | None:
    """What is wrong with ``subset`` for the dataset ``name`` (at ``revision``), or None where it is not
    the problem."""
    import datasets

    try:
        subsets = datasets.get_dataset_config_names(name, revision=revision)
    except Exception:
        return None
    if subset is None and len(subsets) > 1:
        return f"'{name}' has several subsets ({', '.join(subsets)}); pick one, e.g. --set data.subset={subsets[0]}"
    if subset is not None and subset not in subsets:
        return f"'{name}' has no subset '{subset}' (has: {', '.join(subsets)})"
    return None


def unreachable() -> str | None:
    """Why the hub cannot be reached, found by opening one connection to it (3 s at most), or None.
    Offline, huggingface_hub would otherwise retry five times (~25 s) before failing. Not checked in
    offline mode (HF_HUB_OFFLINE) or behind a proxy, which connects for us."""
    import datasets

    proxies = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
    if datasets.config.HF_HUB_OFFLINE or any(os.environ.get(name) for name in proxies):
        return None
    endpoint = urlparse(datasets.config.HF_ENDPOINT)
    host = endpoint.hostname or datasets.config.HF_ENDPOINT
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)  # HF_ENDPOINT may name a mirror
    try:
        socket.create_connection((host, port), timeout=3).close()
    except socket.gaierror:
        return f"no address for {host}"
    except OSError as exc:
        return f"cannot connect to {host}:{port}, {type(exc).__name__}"
    return None


ANSWER_TIMEOUT = 10.0  # seconds for the hub's answer to a question of ours (huggingface_hub waits forever)


def commit_of(name: str, revision: str | None) -> str | None:
    """The commit that ``revision`` (a branch or tag; None: the default branch) of the hub dataset
    ``name`` is at now, or None where the hub cannot say (offline, unreachable, no such dataset or
    revision: loading it then says what is wrong)."""
    if revision and re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    if unreachable():
        return None
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(name, revision=revision, timeout=ANSWER_TIMEOUT).sha
    except Exception:
        return None


@contextmanager
def offline():
    """`datasets` and huggingface_hub in offline mode inside the block: a hub dataset loads from the
    local cache, or fails at once. Their HF_HUB_OFFLINE is read from the environment at import time, so
    the module flags are set here, and restored."""
    import datasets
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved
