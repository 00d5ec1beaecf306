"""Weight quantization techniques."""

from ember import hookimpl


@hookimpl
def ember_quantizers(register) -> None:
    register("int8", "ember_plugins.quantization.int8:Int8Quantizer",
             summary="weight-only int8, per output channel; a native CPU kernel streams int8 weights "
                     "(fbgemm W8A8 or torch's int8 matmul where it cannot build)",
             options=("skip", "kernel", "dense_threshold"))
    register("int4", "ember_plugins.quantization.int4:Int4Quantizer",
             summary="int4 weights in groups of 32/64/128 inputs, symmetric or not; a native CPU kernel "
                     "(int8 activations per group, VNNI/AVX2), torch int4pack, or Triton on GPU",
             options=("group_size", "symmetric", "skip", "kernel"))
    register("compressed-tensors", "ember_plugins.quantization.compressed_tensors:CompressedTensorsQuantizer",
             summary="loads checkpoints already quantized to int8 (or 4-bit pack-quantized) in the compressed-tensors "
                     "format (config.json quantization_config), straight into the int8 (int4) kernels",
             options=("kernel", "dense_threshold"))
    register("gptq", "ember_plugins.quantization.gptq:GPTQQuantizer",
             summary="loads GPTQ 4-bit checkpoints (config.json quantization_config) into the int4 kernels",
             options=("kernel",))
