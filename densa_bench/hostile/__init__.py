"""`densa bench hostile`: a server under hostile clients."""
