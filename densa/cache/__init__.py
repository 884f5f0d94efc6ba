"""L2: KV page bookkeeping in plain Python: page ids, reference counts, generation tags, prefix index."""
