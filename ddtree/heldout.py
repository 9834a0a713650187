"""The held-out split of a code corpus, shared by training (which leaves these files out) and the
benchmark (which draws its prompts from them): a hash of each file's posix relative path, so the
split is the same on every machine."""
from __future__ import annotations

import hashlib

DEFAULT_HELD_OUT_FRACTION = 0.02  # the default --held-out-fraction of train-target / train-drafter


def is_held_out(relative_path: str, fraction: float = DEFAULT_HELD_OUT_FRACTION) -> bool:
    """True for about `fraction` of all paths, chosen by the SHA-256 of the posix relative path."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction
