"""Recorded GPU runs: one JSON file per experiment, ``{schema, experiment, params, rows, provenance}``.

These files in ``book/results/`` are the only numbers the book does not compute live. The provenance
says where, when, with what and at which scale a result was measured, fingerprints the code its
numbers depend on (:mod:`~kvwall.results.fingerprint`: the experiment's import closure, normalized so
comments and docstrings do not count). The whole file is sealed by one digest: a file edited after recording,
or spliced from parts of two recordings, is refused naming the file and the field, and so is one that is
malformed, not a plain file, too big or too deep, or whose rows do not match the experiment's row schema
(:mod:`~kvwall.results.store`); files of older formats are refused with the advice to re-record them. A result
whose code changed since the run is *stale*, and chapters show that with a visible warning.

This is the lowest library layer above the kernels: it imports nothing else of ``kvwall``.
"""

from kvwall.results.awaiting import AWAITING_FILE, awaiting_rerecord
from kvwall.results.fingerprint import source_fingerprint
from kvwall.results.locations import PROJECT_ROOT, RESULTS_DIR
from kvwall.results.provenance import SCALES, Provenance, collect_provenance
from kvwall.results.store import (
    Result,
    ResultFileError,
    ResultMissingError,
    ResultTargetError,
    RowSchemaError,
    check_writable_target,
    content_digest,
    load_result,
    recorded_scale,
    register_row_schema,
    save_result,
    validate_rows,
)

__all__ = [
    "AWAITING_FILE",
    "awaiting_rerecord",
    "PROJECT_ROOT",
    "RESULTS_DIR",
    "SCALES",
    "Provenance",
    "Result",
    "ResultFileError",
    "ResultMissingError",
    "ResultTargetError",
    "RowSchemaError",
    "check_writable_target",
    "collect_provenance",
    "content_digest",
    "load_result",
    "recorded_scale",
    "register_row_schema",
    "save_result",
    "source_fingerprint",
    "validate_rows",
]
