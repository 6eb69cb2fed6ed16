"""Our fused kernel on architectures we have no GPU for: Triton's offline compile of the launcher's fallback shapes
for sm_90, sm_100 and sm_120 must agree with what the cost model (and chapter 6) says runs where."""

import pytest
import triton

from kvwall.model.cost import FUSED_MAX_HEADS
from kvwall.tuning.arch_check import ARCHS, check_architectures, fallback_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def builds():
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    if (major, minor) < (3, 7):
        pytest.skip(f"Triton {triton.__version__} bundles no ptxas for sm_100a/sm_120a (3.7+ does)")
    return check_architectures((16, 32, 64, 128), cast_kernels=True)


def test_every_architecture_compiles_every_fallback_shape(builds):
    fused = [b for b in builds if b["kernel"] == "fused split"]
    assert len(fused) == 4 * len(ARCHS)
    assert all(b["error"] is None and b["shared_bytes"] for b in fused), [b["error"] for b in fused if b["error"]]


def test_cast_kernels_fit_every_architecture(builds):
    gathers = [b for b in builds if b["kernel"].startswith("gather_cast")]
    triton_ones = [b for b in gathers if "Triton" in b["kernel"]]
    assert len(triton_ones) == len(ARCHS) and all(b["fits"] and not b["spills"] for b in triton_ones)
    cuda = [b for b in gathers if "CUDA" in b["kernel"]]
    if cuda and cuda[0]["error"] and "nvcc is not on PATH" in cuda[0]["error"]:
        pytest.skip("no nvcc on this machine: the CUDA C++ twin was not compiled")
    assert len(cuda) == len(ARCHS) and all(b["fits"] and b["regs"] for b in cuda), cuda


def test_what_fits_is_what_the_cost_model_offers(builds):
    for b in (b for b in builds if b["kernel"] == "fused split"):
        arch = f"sm_{b['cap']}"
        offered = b["heads"] <= FUSED_MAX_HEADS.get(arch, 10**6)
        assert b["fits"] == offered, (f"{b['arch']}, {b['heads']} heads ({b['shape']}): compile says "
                                      f"{'fits' if b['fits'] else 'does not fit'} ({b['shared_bytes']} of "
                                      f"{b['shared_limit']} B shared, trap-only {b['trap_only']}), the cost model "
                                      f"{'offers' if offered else 'leaves out'} the fused path")


def test_the_16_head_shape_fits_everywhere_without_spills(builds):
    for b in (b for b in builds if b["kernel"] == "fused split" and b["heads"] == 16):
        assert b["fits"] and b["spills"] == 0 and b["regs"] and b["regs"] <= 255, b


def test_fallback_shape_is_the_launchers_own():
    assert fallback_config(16).block_h == 16 and fallback_config(128).block_h == 64
