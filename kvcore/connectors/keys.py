"""Block keys: content hashes of token blocks, chained with the parent block's key.

A key names what a block *holds*, not where it lives: the KV of a full block of
``block_size`` tokens depends on those tokens and on every token before them, so the key of
block ``i`` hashes its tokens together with the key of block ``i - 1``. Two requests that
share a prefix share the keys of its blocks, which is what makes a saved block reusable.

Keys are lowercase SHA-256 hex digests of exactly 64 characters. Connectors accept nothing
else, so a key is always safe to use as a file name (see the ``storage`` connector), and a
key of another length (a truncated digest, a digest with bytes appended) is refused rather
than hashed: with one key length the parent field cannot absorb the start of the tokens.

The hashed bytes are framed so that no two inputs share an encoding: a domain prefix, then
each field as a presence byte and, when present, its length as little-endian uint64 before
its bytes: the parent key (32 bytes), the tokens (their count, then each as little-endian
int64) and ``extra`` (UTF-8).
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence

import torch

__all__ = ["hash_block_tokens", "hash_request_tokens", "check_block_keys"]

#: The one key format: a SHA-256 digest in lowercase hex.
_KEY = re.compile(r"[0-9a-f]{64}")
#: Deletes the characters of a key (str.translate): what is left of keys is what is not.
_NOT_HEX = str.maketrans("", "", "0123456789abcdef")
_MAX_TOKEN_ID = 2**63 - 1
# Domain separation: a kvcore block key can never equal a hash computed for another purpose.
# v2: every field length-framed and one key length (v1 keys of other lengths could collide).
_KEY_PREFIX = b"kvcore-block-key-v2\0"


def _check_key(name: str, key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"{name} must be a str hex digest, got {type(key).__name__}")
    if not _KEY.fullmatch(key):
        raise ValueError(
            f"{name}={key!r} is not a block key: keys are lowercase SHA-256 hex digests of "
            "exactly 64 characters (compute them with kvcore.connectors.hash_block_tokens)"
        )
    return key


def check_block_keys(keys: Sequence[str], name: str = "keys") -> list[str]:
    """Validate ``keys`` (a list or tuple of hex digests) and return them as a list.

    Raises ``TypeError`` for a non-sequence or non-string entry and ``ValueError`` naming
    ``keys[i]`` for anything that is not a lowercase hex digest, e.g. ``"../../etc/passwd"``.
    """
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise TypeError(f"{name} must be a list or tuple of hex-digest strings, got "
                        f"{type(keys).__name__}")
    keys = list(keys)
    if _all_keys(keys):
        return keys
    return [_check_key(f"{name}[{i}]", key) for i, key in enumerate(keys)]


def _all_keys(keys: list[object]) -> bool:
    """Whether every entry is a key, checked in a few passes of C code (a load names hundreds
    of keys); ``False`` leaves it to the per-key check, which names the first bad one."""
    if not keys or set(map(type, keys)) != {str} or set(map(len, keys)) != {64}:
        return False
    return not "".join(keys).translate(_NOT_HEX)  # (nothing left: lowercase hex digits only)


def _token_list(token_ids: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1 or token_ids.is_floating_point() or token_ids.is_complex():
            raise ValueError(f"{name} must be a 1-D integer tensor, got {token_ids.dtype} "
                             f"shape {tuple(token_ids.shape)}")
        token_ids = token_ids.tolist()
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(token_ids).__name__}")
    for i, tok in enumerate(token_ids):
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise TypeError(f"{name}[{i}]={tok!r} must be an int")
        if not 0 <= tok <= _MAX_TOKEN_ID:
            raise ValueError(f"{name}[{i}]={tok} is outside 0..2**63-1")
    return list(token_ids)


def hash_block_tokens(
    parent_hash: str | None,
    token_ids: Sequence[int] | torch.Tensor,
    extra: str | None = None,
) -> str:
    """The key of one block: SHA-256 over the parent's key, the block's tokens and ``extra``.

    Args:
        parent_hash: the key of the previous block of the sequence, ``None`` for the first.
        token_ids: the block's token ids (non-negative ints, or a 1-D integer tensor).
        extra: anything else the KV depends on (model name and revision, LoRA adapter, cache
            salt). Connectors that outlive one model (``storage``) need it: without it two
            models that read the same tokens produce the same keys.

    Returns:
        A 64-character lowercase hex digest, identical on every machine (tokens are hashed as
        little-endian int64).
    """
    tokens = _token_list(token_ids, "token_ids")
    if extra is not None and not isinstance(extra, str):
        raise TypeError(f"extra must be a str or None, got {type(extra).__name__}")
    h = hashlib.sha256(_KEY_PREFIX)
    h.update(_field(None if parent_hash is None
                    else bytes.fromhex(_check_key("parent_hash", parent_hash))))
    h.update(b"\1" + struct.pack(f"<Q{len(tokens)}q", len(tokens), *tokens))
    h.update(_field(None if extra is None else extra.encode()))
    return h.hexdigest()


def _field(data: bytes | None) -> bytes:
    """One optional field of the hashed bytes: absent, or present with its length."""
    return b"\0" if data is None else b"\1" + struct.pack("<Q", len(data)) + data


def hash_request_tokens(
    token_ids: Sequence[int] | torch.Tensor,
    block_size: int,
    extra: str | None = None,
) -> list[str]:
    """Keys of every *full* block of a token sequence, chained from the first block.

    A trailing partial block has no key: its KV changes as tokens are appended, so it is never
    saved. ``extra`` is passed to every :func:`hash_block_tokens` call.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size={block_size!r} must be a positive integer")
    tokens = _token_list(token_ids, "token_ids")
    keys: list[str] = []
    parent = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tokens[start:start + block_size], extra)
        keys.append(parent)
    return keys
