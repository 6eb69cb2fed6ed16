"""Decode inputs whose attention looks like a model's: a chosen softmax sharpness, sink tokens, needles -- and value
channels that read off, exactly, the weights a kernel gave them.

The Gaussian inputs of chapter 5 give logits with a spread of about 0.5: a flat softmax in which no weight is small
next to the largest. A model's attention is sharper: a few "sink" tokens (the first of the context) hold most of
the mass (Xiao et al., *Efficient Streaming Language Models with Attention Sinks*, 2023), and retrieval means one or
a few "needle" tokens a margin above everything else. What an FP8 softmax or an FP8 query loses is exactly there:
small weights next to a large one, and the weight of a needle.

A :class:`Profile` says what each head's logits should be (natural-log units, after ``sm_scale``):

- ordinary ("tail") tokens: independent normal logits of standard deviation ``spread``;
- ``sinks`` tokens, the first of the request, together holding ``sink_mass`` of the attention;
- ``needles`` tokens at random positions, ``margin`` above the largest tail logit of their head.

:func:`sharp_request` builds one request's latent keys so that ``sm_scale * q_h . k_t`` equals those logits for
every head at once (MLA shares the 576-wide latent between all heads): with the heads' queries ``Q [H, d]`` (random
directions, norm chosen so the keys' elements have unit RMS, as an RMS-normed latent has) the keys are
``Q^+ z / sm_scale`` -- the minimum-norm solution -- plus noise orthogonal to the queries' span (it changes no
logit; it gives the keys the unit-RMS content a real latent has). The keys are then stored in FP8 (e4m3, scale 1)
and the queries in BF16, so the logits that count are the ones :func:`realized` computes from the stored values in
float64: they differ from the targets by the storage's rounding, and every kernel reads the same stored values.

Four value channels are probes: the queries are zero there (they move no logit) and the keys hold 0 or 1 (exact in
FP8), so output channel ``c`` of head ``h`` *is* a sum of softmax weights (:data:`PROBES`):

- ``top``: 1 at the first needle (or, without needles, at head 0's largest tail logit): that token's weight;
- ``tail_token``: 1 at one ordinary tail token: its weight (is it kept, or flushed to zero?);
- ``tail_mass``: 1 at every tail token: the attention mass the tail receives;
- ``sink_mass``: 1 at every sink: the mass the sinks receive.

:func:`emulate_attention` is a model of what an FP8 query and FP8 softmax weights do to one request (the chapter's
prediction, before any kernel runs): the query stored in e4m3 with scale 1, the weights ``exp(z - max)`` stored in
e4m3 before they multiply the values, the row sum kept in full precision -- one split, the row's own maximum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvwall.model.geometry import GLM5

__all__ = [
    "Profile",
    "PROFILES",
    "PROBES",
    "SharpRequest",
    "sharp_request",
    "realized",
    "Realized",
    "emulate_attention",
]

DC, DR = GLM5.kv_lora_rank, GLM5.qk_rope_head_dim
D = DC + DR
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
FP8_MAX = 448.0
#: Output channel of each probe (the first value channels; the queries are zero there).
PROBES: dict[str, int] = {"top": 0, "tail_token": 1, "tail_mass": 2, "sink_mass": 3}
N_PROBES = len(PROBES)
#: RMS of a key element (signal and orthogonal noise each carry half of it).
KEY_RMS = 1.0


@dataclass(frozen=True)
class Profile:
    """What every head's logits are made of (see the module docstring); ``name`` labels rows and figures."""

    name: str
    spread: float
    sinks: int = 0
    sink_mass: float = 0.0
    needles: int = 0
    margin: float = 0.0

    def __post_init__(self) -> None:
        if self.spread < 0 or not math.isfinite(self.spread):
            raise ValueError(f"profile {self.name}: spread must be finite and >= 0, got {self.spread}.")
        if (self.sinks > 0) != (0.0 < self.sink_mass < 1.0):
            raise ValueError(
                f"profile {self.name}: sinks ({self.sinks}) need a sink_mass strictly between 0 and 1 "
                f"(got {self.sink_mass}), and a sink_mass needs sinks."
            )
        if self.needles < 0 or (self.needles == 0 and self.margin != 0.0):
            raise ValueError(f"profile {self.name}: a margin needs needles (needles={self.needles}).")

    @property
    def special(self) -> int:
        """Tokens that are not tail tokens (sinks and needles)."""
        return self.sinks + self.needles


#: The sharpness sweep, flattest first: Gaussian logits of spread 1 (a little sharper than chapter 5's inputs, whose
#: spread is about 0.5), 3 and 10; four sinks holding 90 % and 99 % of the attention over a spread-1 tail; retrieval
#: amid sinks -- one needle 4 above the tail's largest logit, and eight needles 2 above it (one request's needles
#: compete with each other).
PROFILES: tuple[Profile, ...] = (
    Profile("gaussian, spread 1", 1.0),
    Profile("gaussian, spread 3", 3.0),
    Profile("gaussian, spread 10", 10.0),
    Profile("4 sinks hold 90 %", 1.0, sinks=4, sink_mass=0.90),
    Profile("4 sinks hold 99 %", 1.0, sinks=4, sink_mass=0.99),
    Profile("needle +4, sinks 90 %", 1.0, sinks=4, sink_mass=0.90, needles=1, margin=4.0),
    Profile("8 needles +2, sinks 90 %", 1.0, sinks=4, sink_mass=0.90, needles=8, margin=2.0),
)


@dataclass
class SharpRequest:
    """One request: ``keys [n, 576]`` FP8 (probe channels included), ``q_nope [H, 512]`` / ``q_pe [H, 64]`` BF16, the
    target logits ``[H, n]`` (float64) and which tokens are sinks, needles, the probed tail token."""

    keys: torch.Tensor
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    target: torch.Tensor
    sinks: torch.Tensor
    needles: torch.Tensor
    tail_token: int
    top: int
    saturated: int

    @property
    def tail(self) -> torch.Tensor:
        """Boolean mask of the tail tokens."""
        mask = torch.ones(self.keys.shape[0], dtype=torch.bool, device=self.keys.device)
        mask[self.sinks] = False
        mask[self.needles] = False
        return mask


def _target_logits(
    profile: Profile, heads: int, n: int, gen: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [H, n] float64, sink positions, needle positions) of :data:`Profile` for one request of n tokens."""
    z = torch.randn(heads, n, generator=gen, dtype=torch.float64, device=device) * profile.spread
    sinks = torch.arange(profile.sinks, device=device)
    rest = profile.sinks + torch.randperm(n - profile.sinks, generator=gen, device=device)
    needles = rest[: profile.needles].sort().values
    tail = torch.ones(n, dtype=torch.bool, device=device)
    tail[sinks] = False
    tail[needles] = False
    if profile.needles:
        top_tail = z[:, tail].amax(dim=1, keepdim=True)
        z[:, needles] = top_tail + profile.margin
    if profile.sinks:
        others = torch.ones(n, dtype=torch.bool, device=device)
        others[sinks] = False
        lse_others = torch.logsumexp(z[:, others], dim=1, keepdim=True)
        f = profile.sink_mass
        z[:, sinks] = lse_others + math.log(f / (1.0 - f)) - math.log(profile.sinks)
    return z, sinks, needles


def sharp_request(
    profile: Profile, heads: int, n: int, *, sm_scale: float, gen: torch.Generator, device: torch.device
) -> SharpRequest:
    """One request of ``n`` tokens whose stored keys and queries give ``profile``'s logits (module docstring)."""
    if n < profile.special + 2:
        raise ValueError(
            f"a request of {n} tokens cannot hold {profile.special} sinks and needles, a probed tail "
            "token and another tail token."
        )
    if not 1 <= heads <= D - N_PROBES:
        raise ValueError(f"heads={heads}: the keys are solved for up to {D - N_PROBES} heads.")
    z, sinks, needles = _target_logits(profile, heads, n, gen, device)
    width = D - N_PROBES
    q = torch.randn(heads, width, generator=gen, dtype=torch.float64, device=device)
    q = q / q.norm(dim=1, keepdim=True)
    q_pinv = torch.linalg.pinv(q)  # [width, H]
    signal = (z.T @ q_pinv.T) / sm_scale  # [n, width]: q @ signal.T * sm_scale == z
    tail = torch.ones(n, dtype=torch.bool, device=device)
    tail[sinks] = False
    tail[needles] = False
    # A unit-norm query; scale the query up (and the keys down) so the tail keys' signal has RMS KEY_RMS / sqrt(2).
    rms = float(signal[tail].pow(2).mean().sqrt())
    gain = rms / (KEY_RMS / math.sqrt(2.0)) if rms > 0 else 1.0
    noise = torch.randn(n, width, generator=gen, dtype=torch.float64, device=device) * (KEY_RMS / math.sqrt(2.0))
    noise -= (noise @ q.T) @ q_pinv.T  # orthogonal to every head's query: it moves no logit
    q, signal = q * gain, signal / gain
    keys = torch.zeros(n, D, dtype=torch.float64, device=device)
    keys[:, N_PROBES:] = signal + noise
    saturated = int((keys.abs() > FP8_MAX).sum())
    keys.clamp_(-FP8_MAX, FP8_MAX)
    tail_idx = tail.nonzero().flatten()
    tail_token = int(tail_idx[torch.randint(0, tail_idx.numel(), (1,), generator=gen, device=device)])
    top = int(needles[0]) if profile.needles else int(tail_idx[z[0, tail_idx].argmax()])
    keys[top, PROBES["top"]] = 1.0
    keys[tail_token, PROBES["tail_token"]] = 1.0
    keys[tail, PROBES["tail_mass"]] = 1.0
    keys[sinks, PROBES["sink_mass"]] = 1.0
    qfull = torch.zeros(heads, D, dtype=torch.float64, device=device)
    qfull[:, N_PROBES:] = q
    qb = qfull.to(BF16)
    return SharpRequest(
        keys.to(FP8), qb[:, :DC].contiguous(), qb[:, DC:].contiguous(), z, sinks, needles, tail_token, top, saturated
    )


@dataclass(frozen=True)
class Realized:
    """What the stored values give, in float64, medians over heads: the tail logits' spread, the gap between a
    head's largest and its median logit, the needles' margin over the largest tail logit (None without needles),
    the mass the sinks and the tail hold, the top token's and the probed tail token's weight (as a fraction of the
    largest weight of its head too), and the query's RMS."""

    spread: float
    max_gap: float
    margin: float | None
    sink_mass: float
    tail_mass: float
    top_weight: float
    tail_token_weight: float
    tail_token_vs_max: float
    query_rms: float


def realized(req: SharpRequest, sm_scale: float) -> Realized:
    """The logits the stored keys and BF16 queries really give (float64), summarized (:class:`Realized`)."""
    q = torch.cat([req.q_nope, req.q_pe], dim=-1).double()
    z = (q @ req.keys.double().T) * sm_scale  # [H, n]
    p = torch.softmax(z, dim=-1)
    tail = req.tail

    def med(x: torch.Tensor) -> float:
        return float(x.median())

    margin = None
    if req.needles.numel():
        margin = med(z[:, req.needles].amin(dim=1) - z[:, tail].amax(dim=1))
    return Realized(
        spread=med(z[:, tail].std(dim=1)),
        max_gap=med(z.amax(dim=1) - z.median(dim=1).values),
        margin=margin,
        sink_mass=med(p[:, req.sinks].sum(dim=1)) if req.sinks.numel() else 0.0,
        tail_mass=med(p[:, tail].sum(dim=1)),
        top_weight=med(p[:, req.top]),
        tail_token_weight=med(p[:, req.tail_token]),
        tail_token_vs_max=med(p[:, req.tail_token] / p.amax(dim=1)),
        query_rms=float(q[:, N_PROBES:].pow(2).mean().sqrt()),
    )


def emulate_attention(req: SharpRequest, sm_scale: float, *, fp8_query: bool, fp8_weights: bool) -> torch.Tensor:
    """One request's output ``[H, 512]`` (float64) as a kernel with an e4m3 query (``fp8_query``: static scale 1,
    clamped to +-448) and e4m3 softmax weights (``fp8_weights``: ``exp(z - rowmax)`` rounded to e4m3, subnormals
    included, so a weight under 2^-10 of its row's largest becomes 0) would compute it, everything else exact; the
    normalizer sums the unrounded weights. A model of the arithmetic, not of any kernel's schedule."""
    q = torch.cat([req.q_nope, req.q_pe], dim=-1)
    q = q.float().clamp(-FP8_MAX, FP8_MAX).to(FP8).double() if fp8_query else q.double()
    keys = req.keys.double()
    z = (q @ keys.T) * sm_scale
    p = torch.exp(z - z.amax(dim=-1, keepdim=True))
    num = p.float().to(FP8).double() if fp8_weights else p
    return (num @ keys[:, :DC]) / p.sum(dim=-1, keepdim=True)
