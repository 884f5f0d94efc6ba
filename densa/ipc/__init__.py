"""The engine core's typed contract (messages, their codec) and its ZeroMQ transport.

Torch-free: the HTTP front and the router import this, never the engine.
"""
