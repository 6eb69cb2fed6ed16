"""A model of one decode step of GLM-5 on one GPU, layer by layer.

For each of the L layers: write the new tokens' latent KV into the pool; the KV strategy (here the
whole-pool cast) and MLA decode attention, both run for real; then a *stand-in* for the rest of
the layer. The book cannot run GLM-5's weights (MoE, projections, the all-reduce over four GPUs),
so the stand-in takes the original investigation's non-cast time, divided evenly over the layers,
and spends it in a calibrated spin kernel (``torch.cuda._sleep``) on a GPU or a busy-wait on a
CPU. It is a modelled input, never a measurement of GLM-5 work, and every profile labels it so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from kvwall.model.attention import MLADecode
from kvwall.model.original import ORIGINAL
from kvwall.model.pool import DecodeBatch, TokenPool, random_kv
from kvwall.model.strategies import KVStrategy
from kvwall.measure.timing import PhaseClock

__all__ = ["RestOfLayerStandIn", "DecodeStepModel", "PHASES", "STANDIN_LABEL"]

STANDIN_LABEL = "rest_of_layer [stand-in: original's non-cast time, modelled]"
#: The phases of one layer, in order, as profile labels. ``kv_free`` releases what the strategy
#: materialized (free on a GPU's caching allocator; a real munmap of tens of MB on a CPU).
PHASES = ("write_kv", "kv_strategy", "attention", "kv_free", STANDIN_LABEL)


def _spin_cycles_per_ms(device: torch.device) -> float:
    """Calibrate ``torch.cuda._sleep`` (which spins for a number of clock cycles)."""
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # warm-up
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    stop.record()
    torch.cuda.synchronize(device)
    return cycles / start.elapsed_time(stop)


@dataclass
class RestOfLayerStandIn:
    """Spends ``ms_per_layer`` on the device, labelled as a modelled stand-in."""

    ms_per_layer: float
    device: torch.device
    cycles_per_ms: float = 0.0

    @classmethod
    def from_original(cls, num_layers_in_model: int, device: torch.device) -> "RestOfLayerStandIn":
        """The original's non-cast time (step minus cast) spread evenly over the model's layers."""
        standin = cls(ORIGINAL.non_cast_ms / num_layers_in_model, device)
        if device.type == "cuda":
            standin.cycles_per_ms = _spin_cycles_per_ms(device)
        return standin

    def __call__(self) -> None:
        if self.ms_per_layer <= 0:
            return
        if self.device.type == "cuda":
            torch.cuda._sleep(int(self.ms_per_layer * self.cycles_per_ms))
        else:
            end = time.perf_counter() + self.ms_per_layer / 1e3
            while time.perf_counter() < end:
                pass


class DecodeStepModel:
    """One decode step over ``pool.num_layers`` layers for the requests in ``batch``."""

    def __init__(
        self,
        pool: TokenPool,
        batch: DecodeBatch,
        strategy: KVStrategy,
        attention: MLADecode,
        rest_of_layer: RestOfLayerStandIn,
        *,
        q_dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
    ) -> None:
        self.pool, self.batch, self.strategy = pool, batch, strategy
        self.attention, self.rest_of_layer, self.q_dtype = attention, rest_of_layer, q_dtype
        g = pool.geometry
        gen = torch.Generator().manual_seed(seed)
        b, h, dev = batch.batch_size, g.heads_per_gpu, pool.device
        self.q_nope = random_kv((b, h, g.kv_lora_rank), generator=gen, device=dev, dtype=q_dtype)
        self.q_pe = random_kv((b, h, g.qk_rope_head_dim), generator=gen, device=dev, dtype=q_dtype)
        self.new_kv = random_kv((b, 1, g.kv_dim), generator=gen, device=dev, dtype=q_dtype)
        self.last_output: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def _layer(self, layer: int, clock: PhaseClock | None) -> None:
        def mark(phase: str) -> None:
            if clock is not None:
                clock.mark(f"{layer}:{phase}")

        mark(PHASES[0])
        with record_function(PHASES[0]):
            self.pool.write_new_tokens(layer, self.batch.new_token_slots, self.new_kv)
        mark(PHASES[1])
        with record_function(PHASES[1]):
            ckv, kpe = self.strategy.prepare_kv(self.pool, layer, self.q_dtype)
        mark(PHASES[2])
        with record_function(PHASES[2]):
            self.last_output = self.attention(self.q_nope, self.q_pe, ckv, kpe)
        mark(PHASES[3])
        with record_function(PHASES[3]):
            del ckv, kpe
        mark(PHASES[4])
        with record_function(STANDIN_LABEL):
            self.rest_of_layer()

    def step(self) -> None:
        for layer in range(self.pool.num_layers):
            self._layer(layer, None)

    def timed_step(self) -> list[dict]:
        """Run one step with a clock on every phase: rows ``{layer, phase, start_ms, ms}``."""
        clock = PhaseClock(self.device)
        for layer in range(self.pool.num_layers):
            self._layer(layer, clock)
        clock.mark("end:end")
        rows = []
        for label, start, ms in clock.intervals_ms():
            layer, phase = label.split(":", 1)
            rows.append({"layer": int(layer), "phase": phase, "start_ms": start, "ms": ms})
        return rows
