"""Everything that reads the bus: the trainer, the archiver, live metrics and sinks, offline retraining.

Imports bus/ and runtime's core; never producers/.
"""
