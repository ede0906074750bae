"""Tokenizer loading: always from a local directory, never from a hub."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def tokenizer_digest(tokenizer: Any) -> str:
    """A fingerprint of what turns text into token ids and back: equal digests mean two
    processes (on different nodes, loaded from different directories) agree on every id.

    A fast tokenizer is hashed from its full serialization (normalizer, pre-tokenizer,
    vocabulary, merges, added tokens), a slow one from its vocabulary; the chat template is
    part of it too, since it decides the prompt's ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        body = backend.to_str()
    else:
        body = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    template = getattr(tokenizer, "chat_template", None) or ""
    digest = hashlib.sha256(body.encode())
    digest.update(b"\0" + str(template).encode())
    return digest.hexdigest()
