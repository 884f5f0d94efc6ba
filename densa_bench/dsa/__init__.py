"""`densa bench dsa`: decode with DeepSeek Sparse Attention vs dense MLA, by context length."""
