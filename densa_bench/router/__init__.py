"""`densa bench router`: the router in front of local workers."""
