"""`densa bench step-bytes`: bytes moved per engine step."""
