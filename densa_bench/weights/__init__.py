"""`densa bench weights`: weight formats (quantized linears) in speed and memory."""
