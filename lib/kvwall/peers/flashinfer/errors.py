"""What can stop us from installing or building a FlashInfer release.

A build that FlashInfer refuses or that nvcc fails is not an error here: it is a
:class:`kvwall.peers.flashinfer.build.BuildResult`. These exceptions are for what keeps the
question from being asked at all (a bad request, no compiler, no network, a release that does not
exist or cannot be driven).
"""

from __future__ import annotations

__all__ = [
    "FlashInferReleaseError",
    "InvalidConfigError",
    "NvccNotFoundError",
    "NetworkUnavailableError",
    "ReleaseNotFoundError",
    "ReleaseImportError",
    "BuildTimeoutError",
]


class FlashInferReleaseError(RuntimeError):
    """Something stopped us from installing or building a FlashInfer release."""


class InvalidConfigError(FlashInferReleaseError, ValueError):
    """A release string, backend, dtype or arch that this package does not accept."""


class NvccNotFoundError(FlashInferReleaseError):
    """No CUDA compiler to drive the JIT build with."""


class NetworkUnavailableError(FlashInferReleaseError):
    """The package index could not be reached to install a release that is not cached yet."""


class ReleaseNotFoundError(FlashInferReleaseError):
    """The package index has no installable wheel of ``flashinfer-python`` at that version."""


class ReleaseImportError(FlashInferReleaseError):
    """The installed release could not be imported or driven (missing dependency, or an API this
    package does not know)."""


class BuildTimeoutError(FlashInferReleaseError):
    """The JIT build ran past its time limit."""
