"""Weight quantization techniques."""

from ember import hookimpl


@hookimpl
def ember_quantizers(register) -> None:
    register("int8", "ember_plugins.quantization.int8:Int8Quantizer",
             summary="weight-only int8, per output channel; int8 matmul for decode, dequantized for prefill")
