"""L2: KV page bookkeeping in plain Python: page ids, ref counts, generation tags, prefix index."""
