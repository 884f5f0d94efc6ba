"""L5: speculative decoding: proposers of draft tokens for the target model to verify.

    proposer.py    the Proposer protocol and its input (SpecInput)
    ngram.py       prompt lookup: propose what followed the latest earlier occurrence of the tail
    speculator.py  which requests speculate, how many tokens each (adaptive), and the counters

The target verifies every proposal in its own batch (worker/model_runner.py); docs/speculative.md
explains verification, rollback and when speculation turns itself off.
"""
