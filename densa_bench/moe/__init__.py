"""`densa bench moe`: a mixture-of-experts model in each weight format."""
