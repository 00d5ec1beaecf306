"""Weight quantization techniques."""

from ember import hookimpl


@hookimpl
def ember_quantizers(register) -> None:
    register("int8", "ember_plugins.quantization.int8:Int8Quantizer",
             summary="weight-only int8, per output channel; a native CPU kernel streams int8 weights at a few "
                     "rows, an int8 GEMM on per-row int8 activations above (fbgemm W8A8 or torch's int8 matmul "
                     "where it cannot build)",
             options=("skip", "kernel", "dense_threshold"),
             check="ember_plugins.quantization.options:check_int8")
    register("int4", "ember_plugins.quantization.int4:Int4Quantizer",
             summary="int4 weights in groups of 32/64/128 inputs, symmetric or not; a native CPU kernel "
                     "(int8 activations per group, VNNI/AVX2), torch int4pack, or Triton on GPU",
             options=("group_size", "symmetric", "skip", "kernel"),
             check="ember_plugins.quantization.options:check_int4")
    register("fp8", "ember_plugins.quantization.fp8:Fp8Quantizer",
             summary="float8 e4m3 weights, per output channel: weight-only everywhere (a native CPU kernel "
                     "decodes e4m3 in registers; tiles widened into the dense GEMM for many rows), W8A8 through "
                     "torch._scaled_mm on GPUs of compute capability >= 8.9",
             options=("skip", "kernel", "dense_threshold", "activations"),
             check="ember_plugins.quantization.options:check_fp8")
    register("compressed-tensors", "ember_plugins.quantization.compressed_tensors:CompressedTensorsQuantizer",
             summary="loads checkpoints already quantized to int8, 4-bit pack-quantized or fp8 float-quantized in the "
                     "compressed-tensors format (config.json quantization_config), straight into the int8, int4 or "
                     "fp8 kernels",
             options=("kernel", "dense_threshold", "activations"))
    register("gptq", "ember_plugins.quantization.gptq:GPTQQuantizer",
             summary="curvature-based: calibrates a full-precision checkpoint and quantizes it layer after layer "
                     "with GPTQ (Hessian error feedback, act-order, groups) into the int4 or int8 kernels; loads "
                     "GPTQ 4-bit checkpoints (config.json quantization_config) into the int4 kernels",
             options=("bits", "group_size", "sym", "act_order", "damp", "num_samples", "seq_len", "skip", "kernel"),
             check="ember_plugins.quantization.options:check_gptq")
    register("rotation", "ember_plugins.quantization.rotation:RotationQuantizer",
             summary="QuaRot-style random Hadamard rotations folded into the full-precision weights (norms "
                     "absorbed, an online Hadamard before down_proj), so that the method after it quantizes "
                     "without outlier channels; by default (sites = \"calibrated\") each rotation is kept only "
                     "where it makes the weights quantize better on calibration text (sites = \"all\": every "
                     "one, as QuaRot); comes first: [\"rotation\", \"int8\"]",
             options=("seed", "online", "kv_rotation", "candidates", "search_group_size", "sites"),
             check="ember_plugins.quantization.options:check_rotation")
    register("mixed", "ember_plugins.quantization.mixed:MixedQuantizer",
             summary="outlier-aware mixed precision: int4 (groups 128/64/32), int8 or dense per layer from "
                     "calibration sensitivity, under an average-bits budget; the plan is stored beside the "
                     "quantized-weight cache and printed by ember explain",
             options=("average_bits", "group_size", "symmetric", "skip", "calibration_tokens"),
             check="ember_plugins.quantization.options:check_mixed")
