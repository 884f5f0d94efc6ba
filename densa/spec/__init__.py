"""Speculative decoding: proposers guess the next tokens cheaply; the target verifies them in one
forward (densa/engine). See docs/speculative.md."""
