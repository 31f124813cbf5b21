"""An 8-bit KV cache (kv/quantize.py): quantize then widen round trips within the format's precision, past its range
clamped to its largest value; both attention paths read an 8-bit pool as the float path reads the same values
widened (the torch path exactly, the Triton kernel under Triton's interpreter to float32 rounding), and land within
the format's precision of the float path on the original keys and values, across windows, sinks, GQA and split
decoding rows; a checkpoint's k_scale and v_scale are read per layer under SGLang's and vLLM's names; and a bad
--kv-cache-dtype is a usage error naming the flag."""

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("triton")  # CI installs it (pyproject's test extra); an x86-64 Linux wheel only

from services.common.config import parse_config  # noqa: E402
from services.scheduler.config import SchedulerConfig  # noqa: E402
from services.scheduler.kv.pool import KVPool  # noqa: E402
from services.scheduler.kv.quantize import UNSCALED, KVScales, quantize, storage_dtype, widen  # noqa: E402
from services.scheduler.kv.specs import AttentionSpec, MLASpec, kv_layout  # noqa: E402
from services.scheduler.model.architecture import UnsupportedModel  # noqa: E402
from services.scheduler.model.kv_scales import read_kv_scales  # noqa: E402
from services.scheduler.model.torch_attention import TorchPlan  # noqa: E402
from services.scheduler.model.triton_attention import TritonPlan  # noqa: E402
from tests.scheduler.test_attention_windows import MIXED_COUNTS, MIXED_STARTS, PAGE_SIZE, make_batch  # noqa: E402
from tests.scheduler.test_triton_attention import TOLERANCE  # noqa: E402

CPU = torch.device("cpu")
FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]
MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def half_ulp(dtype: torch.dtype) -> float:
    """The largest relative rounding error of a normal value of the format."""
    return 2.0 ** -(MANTISSA_BITS[dtype] + 1)


@pytest.mark.parametrize("dtype", FLOAT8)
@pytest.mark.parametrize("scale", [1.0, 0.05, 8.0])  # 0.05: e4m3 holds up to 22, past these values
def test_quantize_then_widen_rounds_each_value_once(dtype, scale):
    values = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 3
    stored = quantize(values, dtype, scale)
    assert stored.dtype == dtype and stored.element_size() == 1
    back = widen(stored, torch.float32, scale)
    smallest = torch.finfo(dtype).smallest_normal * scale  # below it, subnormals round to an absolute step
    assert ((back - values).abs() <= half_ulp(dtype) * values.abs() + smallest).all()
    assert torch.equal(widen(quantize(back, dtype, scale), torch.float32, scale), back)  # a stored value is kept


@pytest.mark.parametrize("dtype", FLOAT8)
def test_values_past_the_range_are_clamped_to_its_largest(dtype):
    largest = torch.finfo(dtype).max
    stored = quantize(torch.tensor([1e9, -1e9, 3 * largest, largest]), dtype, 2.0)
    assert torch.equal(widen(stored, torch.float32, 2.0), torch.tensor([2, -2, 2, 1]) * largest)


def test_auto_stores_as_the_model_computes():
    assert storage_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert storage_dtype("fp8_e4m3", torch.bfloat16) is torch.float8_e4m3fn
    assert storage_dtype("fp8_e5m2", torch.float32) is torch.float8_e5m2
    values = torch.randn(64)
    assert torch.equal(widen(quantize(values, torch.float32, 1.0), torch.float32, 1.0), values)


@pytest.mark.parametrize("dtype", FLOAT8)
def test_the_pool_writes_each_layers_kv_over_its_scales(dtype):
    spec = AttentionSpec(kv_heads=2, head_dim=8, dtype=dtype)
    scales = [KVScales(0.5, 0.25), KVScales(2.0, 4.0)]
    pool = KVPool(kv_layout([spec, spec]), num_pages=4, page_size=4, device=CPU, scales=scales)
    assert pool.token_bytes == 2 * 2 * 2 * 8  # layers x (keys, values) x heads x width, a byte each
    keys, values = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    pages, offsets = torch.tensor([1, 1, 3]), torch.tensor([0, 3, 2])
    pool.write(1, pages, offsets, keys, values)
    assert pool.keys(1).dtype == dtype
    assert torch.equal(pool.keys(1)[pages, offsets].view(torch.uint8), quantize(keys, dtype, 2.0).view(torch.uint8))
    assert torch.equal(pool.values(1)[pages, offsets].view(torch.uint8), quantize(values, dtype, 4.0).view(torch.uint8))
    assert not pool.keys(0).view(torch.uint8).any()  # layer 0's tensors untouched


@pytest.mark.parametrize("dtype", FLOAT8)
def test_an_mla_pool_stores_its_latent_in_8_bits_alike(dtype):
    """One tensor a layer (the latent and the rope key), over the layer's key scale."""
    spec = MLASpec(latent_dim=16, rope_dim=8, dtype=dtype)
    pool = KVPool(kv_layout([spec]), num_pages=3, page_size=4, device=CPU, scales=[KVScales(0.5, 9.0)])
    assert pool.token_bytes == 16 + 8
    latent = torch.randn(2, 1, 24)
    pool.write(0, torch.tensor([2, 2]), torch.tensor([1, 2]), latent)
    stored = pool.keys(0)[2, 1:3]
    assert stored.dtype == dtype
    assert torch.equal(widen(stored, torch.float32, 0.5), widen(quantize(latent, dtype, 0.5), torch.float32, 0.5))


def float8_caches(batch, dtype: torch.dtype, scales: KVScales) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize(batch.keys, dtype, scales.key), quantize(batch.values, dtype, scales.value)


def both_paths(batch, keys, values, sinks=None, splits: int = 1, kv_scales: KVScales = UNSCALED):
    """(torch path, Triton kernel) over the same caches."""
    heads, kv_heads = batch.query.shape[1], keys.shape[2]
    scale = batch.query.shape[2] ** -0.5
    torch_plan = TorchPlan.build(batch.tables, batch.starts, batch.counts, batch.first, PAGE_SIZE, CPU)
    kernel_plan = TritonPlan.build(batch.tables, batch.starts, batch.counts, batch.first, heads // kv_heads, kv_heads,
                                   CPU, splits=splits)
    return [plan.attend(batch.query, keys, values, scale, batch.window, sinks, kv_scales)
            for plan in (torch_plan, kernel_plan)]


def calibrated(batch, dtype: torch.dtype) -> KVScales:
    """A checkpoint's kind of scales: each tensor's largest magnitude at the format's largest value."""
    largest = torch.finfo(dtype).max
    return KVScales(batch.keys.abs().max().item() / largest, batch.values.abs().max().item() / largest)


@pytest.mark.parametrize("dtype", FLOAT8)
@pytest.mark.parametrize("window,with_sinks,splits", [(0, False, 1), (6, True, 1), (0, False, 4), (3, True, 2)])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 2)])
def test_both_paths_read_an_8_bit_pool_as_its_values_widened(dtype, window, with_sinks, splits, heads, kv_heads):
    """The reference: the float path over float caches that hold exactly what the 8-bit caches hold."""
    batch = make_batch(window * 10 + heads, MIXED_STARTS, MIXED_COUNTS, window, heads, kv_heads)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(heads)) if with_sinks else None
    scales = calibrated(batch, dtype)
    keys, values = float8_caches(batch, dtype, scales)
    reference, _ = both_paths(batch, widen(keys, torch.float32, scales.key), widen(values, torch.float32,
                                                                                          scales.value), sinks)
    torch_out, kernel_out = both_paths(batch, keys, values, sinks, splits, scales)
    assert torch.equal(torch_out, reference)
    torch.testing.assert_close(kernel_out, reference, atol=TOLERANCE[torch.float32], rtol=0)


@pytest.mark.parametrize("dtype", FLOAT8)
@pytest.mark.parametrize("scaled", [False, True])
def test_an_8_bit_pool_attends_within_the_formats_precision_of_the_float_path(dtype, scaled):
    """Against the float path on the keys and values before rounding: within one unit in the last place of the
    largest value (a row that sees one key returns its value, rounded), and a root-mean-square error within half
    of one, relative to the output's."""
    errors = []
    for seed in range(4):
        batch = make_batch(seed, MIXED_STARTS, MIXED_COUNTS, 0, 8, 2)
        scales = calibrated(batch, dtype) if scaled else KVScales()
        float_out, _ = both_paths(batch, batch.keys, batch.values)
        for out in both_paths(batch, *float8_caches(batch, dtype, scales), kv_scales=scales):
            error = out - float_out
            assert error.abs().max() <= 2 * half_ulp(dtype) * batch.values.abs().max()
            errors.append((error.square().mean() / float_out.square().mean()).sqrt().item())
    assert max(errors) <= half_ulp(dtype)


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16])
def test_the_kernel_widens_an_8_bit_pool_to_half_precision_as_the_torch_path(compute):
    """The GPU's configuration: half-precision queries over an fp8_e4m3 pool."""
    batch = make_batch(9, MIXED_STARTS, MIXED_COUNTS, 6, 8, 2, dtype=compute)
    scales = KVScales(0.01, 0.004)
    keys, values = (quantize(cache, torch.float8_e4m3fn, scale)
                    for cache, scale in ((batch.keys, scales.key), (batch.values, scales.value)))
    torch_out, kernel_out = both_paths(batch, keys, values, kv_scales=scales)
    assert torch_out.dtype == kernel_out.dtype == compute
    torch.testing.assert_close(kernel_out.float(), torch_out.float(), atol=TOLERANCE[compute], rtol=0)


def test_a_checkpoints_scales_are_read_per_layer_under_each_published_name(tmp_path):
    save_file({"model.embed_tokens.weight": torch.zeros(4, 2),
               "model.layers.0.self_attn.k_scale": torch.tensor(0.5), "model.layers.0.self_attn.v_scale": torch.tensor(
                   0.25)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"model.layers.1.self_attn.k_proj.k_scale": torch.tensor([2.0]),  # ModelOpt's names
               "model.layers.1.self_attn.v_proj.v_scale": torch.tensor(3.0),
               "model.layers.2.self_attn.kv_scale": torch.tensor(0.125),  # deprecated: one for both
               "model.language_model.layers.3.self_attn.v_scale": torch.tensor(6.0),  # one of the two: both
               "model.layers.4.self_attn.k_scale": torch.tensor(-1.0),  # "not calibrated": 1.0
               "model.layers.9.self_attn.k_scale": torch.tensor(7.0)},  # past the decoder layers (MTP): ignored
              tmp_path / "model-00002-of-00002.safetensors")
    assert read_kv_scales(tmp_path, 6) == [KVScales(0.5, 0.25), KVScales(2.0, 3.0), KVScales(0.125, 0.125),
                                           KVScales(6.0, 6.0), KVScales(), KVScales()]
    save_file({"model.layers.0.self_attn.k_scale": torch.ones(2)}, tmp_path / "per-head.safetensors")
    with pytest.raises(UnsupportedModel, match="holds 2 scales; an 8-bit KV cache takes one per tensor"):
        read_kv_scales(tmp_path, 6)


def test_a_bad_kv_cache_dtype_is_a_usage_error_naming_the_flag(capsys):
    assert parse_config(SchedulerConfig, ["--kv-cache-dtype", "fp8_e5m2"]).kv_cache_dtype == "fp8_e5m2"
    assert parse_config(SchedulerConfig, []).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit) as exited:
        parse_config(SchedulerConfig, ["--kv-cache-dtype", "fp8"])
    assert exited.value.code == 2
    assert "--kv-cache-dtype: expected auto, fp8_e4m3 or fp8_e5m2, not 'fp8'" in capsys.readouterr().err


def test_every_8_bit_value_widens_exactly_to_half_precision():
    """Why the kernel may widen its tiles to the query's dtype: no value of either format rounds there."""
    codes = torch.arange(256, dtype=torch.uint8)
    for dtype in FLOAT8:
        finite = codes.view(dtype).float()
        finite = finite[finite.isfinite()]
        for compute in (torch.bfloat16, torch.float16):
            assert torch.equal(finite.to(compute).float(), finite)
