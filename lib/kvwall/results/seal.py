"""The seal of a result file (format 4): one sha256 over the whole file, and per-part hashes keyed by it.

``digest.seal`` is the sha256 of the canonical JSON (sorted keys, no spaces) of everything in the file but the digest
-- schema, experiment, params, rows and the provenance without its digest (which holds ``sources``, the code
fingerprint). No part can be edited, and no genuine part of another recording spliced in, without breaking it.
``digest.parts`` says *which* part differs: one sha256 per part (``schema``, ``experiment``, ``params``, ``rows``
and each provenance field: ``provenance.gpu``, ``provenance.sources``, ...), each of ``[seal, part name, value]``:
keyed by the seal, a part hash belongs to one recording, so a part spliced in from another recording with its own
hash copied along disagrees with this file's seal and is named. The seal is a digest, not a signature: it makes a
file tamper-evident (an edit or a splice that does not recompute it); it does not stop whoever recomputes it.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

__all__ = ["content_digest", "digest_problem"]

#: The parts of a file the seal covers, in this order; ``provenance`` without its ``digest``.
_SEALED = ("schema", "experiment", "params", "rows", "provenance")


def _canonical(value: Any) -> bytes:
    """``value`` as canonical JSON: sorted keys, no spaces, ASCII (NaN and Infinity as Python writes them)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _sealed_content(data: dict[str, Any]) -> dict[str, Any]:
    provenance = data.get("provenance")
    if isinstance(provenance, dict):
        provenance = {k: v for k, v in provenance.items() if k != "digest"}
    return {key: (provenance if key == "provenance" else data.get(key)) for key in _SEALED}


def _part_values(content: dict[str, Any]) -> dict[str, Any]:
    """``{part name: value}``: each top-level part, and each provenance field as ``provenance.<field>``."""
    parts = {key: content[key] for key in _SEALED if key != "provenance"}
    provenance = content["provenance"]
    if isinstance(provenance, dict):
        parts.update({f"provenance.{k}": v for k, v in provenance.items()})
    else:
        parts["provenance"] = provenance
    return parts


def _seal(content: dict[str, Any]) -> str:
    return hashlib.sha256(b"kvwall result, format 4\n" + _canonical(content)).hexdigest()


def _part_hash(seal: str, name: str, value: Any) -> str:
    return hashlib.sha256(_canonical([seal, name, value])).hexdigest()


def content_digest(data: dict[str, Any]) -> dict[str, Any]:
    """The digest a file of this format stores in ``provenance.digest`` for the file's JSON object ``data``:
    ``{"seal": sha256 of everything but the digest, "parts": {part: sha256 of [seal, part, value]}}``."""
    content = _sealed_content(data)
    seal = _seal(content)
    return {
        "seal": seal,
        "parts": {name: _part_hash(seal, name, value) for name, value in _part_values(content).items()},
    }


def _names(names: list[str], most: int = 24) -> str:
    """Part names for a message: at most ``most``, each cut short (a hostile file may name fields at length)."""
    text = ", ".join(name if len(name) <= 60 else f"{name[:57]}..." for name in names[:most])
    return text + (f" and {len(names) - most} more" if len(names) > most else "")


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


def digest_problem(data: dict[str, Any]) -> str | None:
    """Why the digest of a file's JSON object ``data`` (of this format) does not vouch for it; None if it does.

    The seal decides; the per-part hashes only say which part differs. A part whose hash, keyed by the stored seal,
    is not the stored one differs from what was recorded with that seal: edited, or spliced in from another
    recording with its own hash."""
    provenance = data.get("provenance")
    digest = provenance.get("digest") if isinstance(provenance, dict) else None
    if not digest:
        return "provenance has no digest (recorded before digests existed, or the digest was removed)"
    if (
        not isinstance(digest, dict)
        or set(digest) != {"seal", "parts"}
        or not _is_sha256(digest["seal"])
        or not isinstance(digest["parts"], dict)
        or not all(_is_sha256(v) for v in digest["parts"].values())
    ):
        return (
            'provenance.digest is not a digest of this format ({"seal": sha256, "parts": {part: sha256}}): '
            "edited, or written by other code"
        )
    stored_seal, stored_parts = digest["seal"], digest["parts"]
    content = _sealed_content(data)
    values = _part_values(content)
    keyed = {name: _part_hash(stored_seal, name, value) for name, value in values.items()}
    differ = sorted(n for n in keyed.keys() | stored_parts.keys() if keyed.get(n) != stored_parts.get(n))
    if _seal(content) == stored_seal:
        if differ:
            return (
                f"provenance.digest.parts was edited (the hashes of {_names(differ)} are not the recorded "
                "ones, although the content matches its seal)"
            )
        return None
    if not differ:
        return (
            "the seal (provenance.digest.seal) does not match the content, though every part's hash does: parts "
            "were edited and their hashes recomputed by hand"
        )
    if len(differ) == len(keyed.keys() | stored_parts.keys()):
        return (
            "the seal (provenance.digest.seal) matches none of the parts: the seal was edited, or every part "
            f"replaced ({_names(differ)})"
        )
    return (
        f"field(s) {_names(differ)} differ from what was recorded: the file's seal does not match them "
        "(edited by hand? spliced in from another recording?)"
    )
