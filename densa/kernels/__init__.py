"""Paged attention: torch reference (paged_attention_ref), fast CPU paths (cpu_paged_attention)."""
