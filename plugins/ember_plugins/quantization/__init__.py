"""Weight quantization techniques."""

from ember import hookimpl


@hookimpl
def ember_quantizers(register) -> None:
    register("int8", "ember_plugins.quantization.int8:Int8Quantizer",
             summary="weight-only int8, per output channel; a native CPU kernel streams int8 weights "
                     "(fbgemm W8A8 or torch's int8 matmul where it cannot build)",
             options=("skip", "kernel", "dense_threshold"))
