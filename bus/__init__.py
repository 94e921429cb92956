"""Events and how they move and persist: the event model, Redis Streams, the on-disk log, blob stores.

Imports nothing of Reel: every other folder builds on it.
"""
