"""How a model's matrices are held (`--weights`): the choices, and the one help text every command shows.

No torch here: the CLI builds its options from this module without loading the model code.
"""

WEIGHTS = ("auto", "dense", "native", "native-q8")
NATIVE = ("native", "native-q8")  # GGUF blocks kept; "-q8": every product with int8 activations (blockquant.py)

WEIGHTS_HELP = ("auto (native for a GGUF in fp32 on CPU, else dense) | native (GGUF blocks, exact) | native-q8 (and "
                "int8 activations in every product, llama.cpp's arithmetic: faster, not exact) | dense (dequantized).")
