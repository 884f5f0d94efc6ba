"""`densa bench memory`: a densa server's whole-life peak RSS (load and waves) vs its bound."""
