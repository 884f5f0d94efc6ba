"""`densa bench structured`: grammar-constrained decoding (runner.py) over the test schemas
(schemas.py)."""
