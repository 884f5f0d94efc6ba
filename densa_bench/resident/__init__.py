"""`densa bench resident`: how many long sessions a KV budget keeps resident, measured by
admitting them (densa's KV formats vs llama-server's -ctk/-ctv types)."""
