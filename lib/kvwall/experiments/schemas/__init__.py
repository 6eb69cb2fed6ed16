"""The typed rows of every experiment's result, by experiment name: what its file must hold.

Each experiment's row is a union of one pydantic model per section, told apart by ``section``.
The models were derived from the recorded files and from the code that writes the rows; saving and
loading a result validate its rows against them (:func:`kvwall.results.validate_rows`), and so does
every live run (:func:`kvwall.experiments.run_experiment`), so a change to what an experiment writes
shows up in the CPU tests, not after a GPU run.
"""

from __future__ import annotations

from typing import Any

from kvwall.experiments.schemas.accuracy import FP8AccuracyRow
from kvwall.experiments.schemas.answer import DecodeStepBatchesRow, DecodeStepPathsRow, PathSweepRow
from kvwall.experiments.schemas.decode_profile import AttentionSweepRow, CastKernelsRow, CastSweepRow, DecodeProfileRow
from kvwall.experiments.schemas.dsa import ChaptersGpuModeRow, DSADecodeRow, DSAForcedDenseRow
from kvwall.experiments.schemas.doors import DoorsChecksRow, DoorsSm90Row
from kvwall.experiments.schemas.fused_decode import (
    FusedDecodeBenchRow,
    FusedDecodePathsRow,
    FusedDecodeProfileRow,
    FusedDecodeTuningRow,
    FusedDecodeValidationRow,
)
from kvwall.experiments.schemas.gpu_tests import GpuTestsRow
from kvwall.experiments.schemas.gather_cast import GatherCastBenchRow, GatherCastProfileRow, GatherCastValidationRow
from kvwall.experiments.schemas.multi_token import MultiTokenDecodeRow
from kvwall.experiments.schemas.sglang_patch import SGLangPatchCheckRow
from kvwall.experiments.schemas.wall import WallOnGpuRow, WallTimelineRow

__all__ = ["ROW_SCHEMAS"]

#: Experiment name -> the type of one of its rows.
ROW_SCHEMAS: dict[str, Any] = {
    "decode_profile": DecodeProfileRow,
    "cast_kernels": CastKernelsRow,
    "cast_sweep": CastSweepRow,
    "attention_sweep": AttentionSweepRow,
    "wall_timeline": WallTimelineRow,
    "wall_on_gpu": WallOnGpuRow,
    "doors_checks": DoorsChecksRow,
    "doors_sm90": DoorsSm90Row,
    "gather_cast_validation": GatherCastValidationRow,
    "gather_cast_bench": GatherCastBenchRow,
    "gather_cast_profile": GatherCastProfileRow,
    "fused_decode_tuning": FusedDecodeTuningRow,
    "fused_decode_paths": FusedDecodePathsRow,
    "fused_decode_validation": FusedDecodeValidationRow,
    "fused_decode_bench": FusedDecodeBenchRow,
    "fused_decode_profile": FusedDecodeProfileRow,
    "fp8_accuracy": FP8AccuracyRow,
    "decode_step_paths": DecodeStepPathsRow,
    "path_sweep": PathSweepRow,
    "decode_step_batches": DecodeStepBatchesRow,
    "sglang_patch_check": SGLangPatchCheckRow,
    "multi_token_decode": MultiTokenDecodeRow,
    "dsa_decode": DSADecodeRow,
    "dsa_forced_dense": DSAForcedDenseRow,
    "chapters_gpu_mode": ChaptersGpuModeRow,
    "chapters_gpu_mode_rest": ChaptersGpuModeRow,
    "gpu_tests": GpuTestsRow,
}
